#!/usr/bin/env bash
# Installs everything pippy_xla needs on a fresh machine and builds the extension in place.
# torch 2.13.0 is the CPU build (never ask pip for an unpinned torch: that pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check "transformers==5.23.0" "peft==0.21.2" "trl==1.16.0" pytest pytest-xdist ninja tqdm matplotlib "mypy==2.4.1" "ruff==0.17.6"
# The other transformers releases of the compatibility pass (scripts/test.sh): the oldest that
# pyproject.toml declares and the newest, each in .compat/ beside the packages installed above
# (5.17 needs huggingface_hub 1.x, which needs httpx).
compat() {
  [ -d ".compat/transformers-$1" ] || python -m pip install -q --disable-pip-version-check \
    --no-deps --target ".compat/transformers-$1" "transformers==$1" "${@:2}"
}
compat 5.17.0 huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0
compat 5.24.0
# CMake and GoogleTest for the C++ unit tests (scripts/ctest.sh), from the distribution where this may
# install packages (root with apt-get); elsewhere ctest.sh skips those tests and says why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  gtest() { apt-get install -y -q cmake libgtest-dev >/dev/null; }
  gtest || { apt-get update -q >/dev/null && gtest; } ||
    echo "cmake or libgtest-dev not installed: C++ tests will be skipped"
fi
MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
