"""Writes tests/durations.json from the output of a suite run with ``--durations=0`` (stdin):
each test's seconds (setup, call and teardown), from the first pytest run in the output (the
native pass of scripts/test.sh). conftest orders the suite's tests by these, longest first
([Note: longest tests first] in tests/conftest.py). Refresh after adding a slow test:

    bash scripts/test.sh --durations=0 | tee run.log; python scripts/record_durations.py < run.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)")


def main() -> None:
    seconds: dict[str, float] = {}
    for line in sys.stdin:
        if re.search(r"\d+ passed", line) and seconds:
            break  # the end of the first pytest run's summary
        if m := LINE.match(line):
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    if not seconds:
        sys.exit("no --durations=0 lines on stdin")
    out = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
    ranked = dict(
        sorted(((k, round(v, 1)) for k, v in seconds.items() if v >= 0.5), key=lambda kv: -kv[1])
    )
    out.write_text(json.dumps(ranked, indent=0) + "\n")
    print(f"{out}: {len(ranked)} tests of 0.5 s or more, {sum(ranked.values()):.0f} s in all")


if __name__ == "__main__":
    main()
