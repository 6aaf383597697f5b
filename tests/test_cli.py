"""The ``pippy-xla`` command line's handling of a user's mistakes: one line, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pippy_xla as px
from pippy_xla import cli

PLAN = ["plan", "--layers", "4", "--hidden", "64", "--stages", "2", "--microbatches", "2"]


def test_version_and_python_dash_m():
    argv = [sys.executable, "-m", "pippy_xla", "--version"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"pippy_xla {px.__version__}"
    assert px.__version__.count(".") >= 2  # the installed package's version


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        ("20", "'20' would be 20 bytes; give a unit, e.g. 20GiB or 20MiB"),
        ("20MiB,7", "'7' would be 7 bytes"),
        ("20 parsecs", "cannot parse memory size '20 parsecs'"),
    ],
)
def test_a_size_without_a_unit_is_refused(limit, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*PLAN, "--memory-limit", limit])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sizes_with_units_are_bytes():
    assert cli._memory_limits("20GiB,512MiB") == [20 * 2**30, 512 * 2**20]
    assert cli._memory_limits("1048576") == [2**20]  # a bare number of at least 1 MiB is bytes


def test_a_bad_request_is_one_line_without_a_traceback(capsys):
    argv = ["plan", "--layers", "4", "--stages", "8", "--microbatches", "2"]
    assert cli.main([*argv, "--memory-limit", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("pippy-xla plan: error: cannot split 4 decoder layers into 8 stages")


def test_simulate_tune_orders_for_the_costs(capsys):
    # B twice F, W a quarter of F: the order list-scheduled at these costs is shorter than the
    # published one at the same costs; a fixed schedule refuses --tune.
    argv = ["simulate", "--schedule", "zbv", "--ranks", "4", "--microbatches", "8"]
    costs = ["--backward", "2.25", "--weight", "0.25"]

    def step(extra):
        assert cli.main([*argv, *costs, *extra]) == 0
        return float(capsys.readouterr().out.split("step ")[1].split(",")[0])

    assert step(["--tune"]) < step([])
    assert cli.main(["simulate", "--schedule", "1f1b", "--tune"]) == 2
    assert "'1f1b' has a fixed order" in capsys.readouterr().err


def test_simulate_writes_only_what_it_is_asked_to(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["simulate", "--schedule", "1f1b", "--ranks", "2"]) == 0
    assert list(tmp_path.iterdir()) == []  # no timeline.png dropped into the current folder
    png = tmp_path / "new" / "folder" / "t.png"  # a folder that does not exist yet
    assert cli.main(["simulate", "--schedule", "1f1b", "--ranks", "2", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"timeline drawn to {png}" in capsys.readouterr().out
