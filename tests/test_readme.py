"""The README and the ``docs/`` pages as they are read: their Python snippets run as shown, their
relative links lead somewhere, and their schedule table says what the C++ facts table says.

The snippets of ``docs/usage.md``, ``docs/schedules.md``, ``docs/planner.md``,
``docs/data_parallel.md`` and ``docs/checkpoints.md`` are one program: every ``python`` block of
those pages, page after page in that order, run under ``torchrun --nproc-per-node 4`` (the pages
say so). The README's example is the first of them, word for word."""

from __future__ import annotations

import re

from test_materialize import ROOT, torchrun

import pippy_xla as px

DOCS = ROOT / "docs"
# The pages whose Python blocks make one program, in the order it runs them.
PROGRAM_PAGES = ["usage.md", "schedules.md", "planner.md", "data_parallel.md", "checkpoints.md"]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def _python_blocks(path) -> list[str]:
    return PYTHON_BLOCK.findall(path.read_text())


def readme_program() -> str:
    blocks = [block for page in PROGRAM_PAGES for block in _python_blocks(DOCS / page)]
    # The main example, generating, the recipe, a CSV schedule, tuning, the planner, the mesh,
    # checkpoints.
    assert len(blocks) == 8, len(blocks)
    return "\n".join(blocks)


def test_readme_example_is_the_program_start():
    (example,) = _python_blocks(ROOT / "README.md")
    assert example == _python_blocks(DOCS / "usage.md")[0]


def test_readme_snippets_run_as_shown(tmp_path):
    script = tmp_path / "readme.py"
    script.write_text(readme_program())
    out = torchrun(4, script, cwd=tmp_path)
    assert "checkpointed" in out or "ckpt" in out  # rank 0 printed the plan's table
    assert (tmp_path / "trained" / "config.json").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000001"


def _anchors(path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _markdown_pages():
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_relative_links_lead_to_files_and_headings():
    checked = 0
    for page in _markdown_pages():
        text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.is_file(), f"{page.relative_to(ROOT)}: link {target!r}: no file {dest}"
            if anchor:
                assert dest.suffix == ".md", f"{page.relative_to(ROOT)}: {target!r}"
                assert anchor in _anchors(dest), (
                    f"{page.relative_to(ROOT)}: link {target!r}: {dest.name} has no heading "
                    f"#{anchor}; it has {sorted(_anchors(dest))}"
                )
            checked += 1
    assert checked >= 30, checked  # the README alone links every page


def _stages_per_rank(info) -> str:
    if info.min_chunks == info.max_chunks:
        return str(info.min_chunks)
    assert info.max_chunks == 0, info.name  # no upper bound
    return f"`chunks` >= {info.min_chunks} (default {info.default_chunks})"


def test_schedule_table_says_what_the_facts_table_says():
    # The docs list the schedules once, in docs/schedules.md; the names and facts come from C++.
    text = (DOCS / "schedules.md").read_text()
    begin = text.index("<!-- schedules table: checked against px.schedule_info")
    end = text.index("<!-- end of schedules table -->")
    rows = [line for line in text[begin:end].splitlines() if line.startswith('| `"')]
    yes_no = {True: "yes", False: "no"}
    names = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name = re.fullmatch(r'`"(\w+)"`( \(default\))?', cells[0])
        assert name, cells[0]
        info = px.schedule_info(name[1])
        names.append(info.name)
        assert bool(name[2]) == (info.name == px.PipelineConfig(num_microbatches=1).schedule)
        assert cells[1:5] == [
            _stages_per_rank(info),
            {"loop": "loop", "v": "V"}[info.placement],
            yes_no[info.split_backward],
            yes_no[info.list_scheduled],
        ], info.name
    assert names == [info.name for info in px._C.schedule_table() if info.trains]
