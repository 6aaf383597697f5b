#!/usr/bin/env bash
# The test suite, as CI runs it (after scripts/setup.sh; docs/testing.md says what each pass checks
# and how long it takes):
#  0. ruff's lint and format check over the repository (seconds);
#  1. the whole Python suite on this CPU's native kernels, in two pytest-xdist workers (see below);
#  2. the tests that compare compiled stages with eager ones (marker `compiled`) once more under
#     another ATEN_CPU_CAPABILITY than this CPU's own (avx2 on an AVX-512 CPU, default, no vector
#     code, on any other), so that inductor emits another CPU's code and sums in another order: a
#     tolerance that only this CPU meets fails here, not on a user's machine; then the tests
#     marked `compat` against the other transformers release in .compat/ (the oldest that
#     pyproject.toml declares; scripts/setup.sh installs it);
#  3. the C++ unit tests (scripts/ctest.sh; skipped, with the reason, without GoogleTest).
# Extra arguments are pytest options for every pytest run (e.g. -x, --durations=20), not paths.
# Each pass prints its wall and CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
timed() { # timed <label> <command...>: runs the command, then prints its wall and CPU seconds
  local TIMEFORMAT="$1: %R s wall, %U s user, %S s system"
  time "${@:2}"
}
timed ruff bash -c 'ruff check --quiet . && ruff format --check --quiet .'
# Step 3's build (about 45 s of compiling) runs beside step 1, one job at low priority: it takes
# what the Python suite leaves idle (a rank waiting for its peers) and yields to the rest.
mkdir -p build
nice -n 10 env MAX_JOBS=1 bash scripts/ctest.sh --build-only >build/ctest-build.log 2>&1 &
cxx=$!
trap 'kill "$cxx" 2>/dev/null || true' EXIT
# Two workers (PYTEST_WORKERS): a single-process test uses one core and a multi-rank test's ranks
# wait for each other, so one worker leaves some of CI's 2 cores idle (step 1 took 740 s with two
# workers, the C++ tests building beside it, against 821 s with one, on one tree). Each worker has
# its own ranks' forkserver; "worksteal" evens out the tests of a minute or more.
# Tried and dropped: the tests ordered longest first and handed out two at a time ("load"):
# pass 1 478 s against 512 and 526 s, pass 2 154 s against 129 and 154 s; fresh clones of one
# tree differ by that much between runs, so no gain shows, and the order needs a data file.
workers=(-n "${PYTEST_WORKERS:-2}" --dist worksteal)
timed "pass 1 (the suite)" python3 -m pytest -q "${workers[@]}" tests "$@"
# Step 2 after step 1, not beside it: beside it (a third pytest process on the 2 cores) the two
# took 777 s against 709 s one after the other, each test slower by more than the cores' share.
isa=$(python3 -c "import torch; print({'AVX512': 'avx2'}.get(torch.backends.cpu.get_cpu_capability(), 'default'))")
ATEN_CPU_CAPABILITY=$isa timed "pass 2 (compiled, $isa)" \
  python3 -m pytest -q "${workers[@]}" -m compiled tests "$@"
# Step 2b: the tests marked `compat` (families, generation, tensor parallel, checkpoints, PEFT,
# the Trainer) against each other transformers release scripts/setup.sh put in .compat/;
# pytest's header names the release under test.
for release in .compat/transformers-*; do
  [ -d "$release" ] && [[ $release != *.partial ]] || continue # none: scripts/setup.sh not run
  PYTHONPATH="$PWD/$release" timed "pass 2 (compat, ${release#.compat/})" \
    python3 -m pytest -q "${workers[@]}" -m compat tests "$@"
done
if ! wait "$cxx"; then
  cat build/ctest-build.log
  exit 1
fi
timed "C++ tests" bash scripts/ctest.sh
