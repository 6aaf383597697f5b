#!/usr/bin/env bash
# The C++ unit tests (tests/cpp/, GoogleTest): configures and builds the C++ core against the
# installed torch's LibTorch in build/cmake, then runs ctest there. Without cmake or GoogleTest
# (scripts/setup.sh installs libgtest-dev where it may install packages) it says why the C++
# tests are skipped and exits 0. Extra arguments go to ctest; `--build-only` (first) builds and
# stops (scripts/test.sh builds beside the Python suite, then runs this again to test).
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi
if ! command -v cmake >/dev/null; then
  echo "C++ tests skipped: cmake is not installed"
  exit 0
fi
build=build/cmake
torch_prefix="$(python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
# Debug: unoptimized, assertions on; a third less compiling than Release (docs/cpp.md).
cmake -S . -B "$build" -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_BUILD_TYPE=Debug >/dev/null
if ! grep -q "^PIPPY_XLA_HAVE_GTEST:INTERNAL=\(1\|TRUE\|ON\)$" "$build/CMakeCache.txt"; then
  echo "C++ tests skipped: GoogleTest is not installed (Debian: apt-get install libgtest-dev)"
  exit 0
fi
# The tests' target only (see CMakeLists.txt): `cmake --build build/cmake` builds the whole core.
cmake --build "$build" --target pippy_xla_core_tests -j "${MAX_JOBS:-2}"
[ "$build_only" = 1 ] && exit 0
ctest --test-dir "$build" --output-on-failure -j "${MAX_JOBS:-2}" "$@"
