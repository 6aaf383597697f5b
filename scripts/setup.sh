#!/usr/bin/env bash
# Installs everything pippy_xla needs and builds the extension in place, into the Python that
# `python3` is: an activated virtual environment (what the README starts with, and CI: .ci/run) or
# a Python whose pip may install packages (pyenv, conda, a container's). Nothing is taken from what
# a machine happens to have: every package is installed here with what it needs.
# torch 2.13.0 is the CPU build (never ask pip for an unpinned torch: that pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
  echo "setup.sh: python3 is missing or older than 3.10: install Python 3.10+ with venv" >&2
  exit 1
fi
# A system Python whose packages belong to the distribution (PEP 668) refuses pip installs.
if python3 -c "import sys, sysconfig, os; sys.exit(sys.prefix != sys.base_prefix or not \
  os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"; then
  echo "setup.sh: $(command -v python3) is managed by the distribution (EXTERNALLY-MANAGED):" \
    "create a virtual environment first: python3 -m venv .venv && . .venv/bin/activate" >&2
  exit 1
fi
pip=(python3 -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
# The release pyproject.toml's range ends with (what `pip install` picks), and the rest.
"${pip[@]}" "transformers==5.25.0" "peft==0.21.2" "trl==1.16.0" pytest pytest-xdist \
  ninja tqdm matplotlib "mypy==2.4.1" "ruff==0.17.6"
# The other transformers release of the compatibility pass (scripts/test.sh), the oldest that
# pyproject.toml declares, in .compat/transformers-<release>/ with what it needs that the packages
# installed above do not give: pip resolves the release against this environment (--dry-run
# --report), and what it would add or change goes into the folder, which the compatibility pass
# puts first on PYTHONPATH (for 5.17: its hub client, huggingface_hub 1.x, with httpx, httpcore
# and certifi). Pins beside the release keep its folder the same from run to run.
compat() {
  local dir=".compat/transformers-$1" report
  [ -d "$dir" ] && return
  report=$(mktemp)
  "${pip[@]}" --dry-run --report "$report" "transformers==$1" "${@:2}"
  mapfile -t wanted < <(python3 -c "import json, sys
for item in json.load(open(sys.argv[1]))['install']:
    print(item['metadata']['name'] + '==' + item['metadata']['version'])" "$report")
  rm -f "$report"
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  ((${#wanted[@]} == 0)) || "${pip[@]}" --no-deps --target "$dir.partial" "${wanted[@]}"
  mv "$dir.partial" "$dir"
}
compat 5.17.0 huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0
# CMake and GoogleTest for the C++ unit tests (scripts/ctest.sh), from the distribution where this may
# install packages (root with apt-get); elsewhere ctest.sh skips those tests and says why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  gtest() { apt-get install -y -q cmake libgtest-dev >/dev/null; }
  gtest || { apt-get update -q >/dev/null && gtest; } ||
    echo "cmake or libgtest-dev not installed: C++ tests will be skipped"
fi
MAX_JOBS="${MAX_JOBS:-2}" "${pip[@]}" --no-build-isolation -e .
