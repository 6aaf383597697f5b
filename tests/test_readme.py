"""The README's Python snippets run as shown: the ``## Use`` section's ``python`` blocks, in
order, as one program under ``torchrun --nproc-per-node 4`` (they say so in the README)."""

from __future__ import annotations

import re

from test_materialize import ROOT, torchrun


def readme_program() -> str:
    text = (ROOT / "README.md").read_text()
    use = text[text.index("\n## Use\n") : text.index("\n## How the code is organized\n")]
    blocks = re.findall(r"^```python\n(.*?)^```$", use, re.M | re.S)
    assert len(blocks) >= 5, len(blocks)
    return "\n".join(blocks)


def test_readme_snippets_run_as_shown(tmp_path):
    script = tmp_path / "readme.py"
    script.write_text(readme_program())
    out = torchrun(4, script, cwd=tmp_path)
    assert "checkpointed" in out or "ckpt" in out  # rank 0 printed the plan's table
    assert (tmp_path / "trained" / "config.json").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000001"
