#!/usr/bin/env bash
# The test suite, as CI runs it (after scripts/setup.sh):
#  0. ruff's lint and format check over the repository (seconds);
#  1. the whole Python suite on this CPU's native kernels, in two pytest-xdist workers (see below);
#  2. the tests that compare compiled stages with eager ones (marker `compiled`) once more with
#     ATEN_CPU_CAPABILITY=avx2, so that inductor emits the vector code of a lesser CPU and sums in
#     another order: a tolerance that only this CPU meets fails here, not on a user's machine;
#  3. the C++ unit tests (scripts/ctest.sh; skipped, with the reason, without GoogleTest).
# Extra arguments are pytest options for both pytest runs (e.g. -x, --durations=20), not paths.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check --quiet . && ruff format --check --quiet .
# Step 3's build (about 100 s of compiling) runs beside step 1, one job at low priority: it takes
# what the Python suite leaves idle (a rank waiting for its peers) and yields to the rest.
mkdir -p build
nice -n 10 env MAX_JOBS=1 bash scripts/ctest.sh --build-only >build/ctest-build.log 2>&1 &
cxx=$!
trap 'kill "$cxx" 2>/dev/null || true' EXIT
# Two workers (PYTEST_WORKERS): a single-process test uses one core and a multi-rank test's ranks
# wait for each other, so one worker leaves some of CI's 2 cores idle (step 1 took 740 s with two
# workers, the C++ tests building beside it, against 821 s with one, on one tree). Each worker has
# its own ranks' forkserver; "worksteal" evens out the tests of a minute or more.
workers=(-n "${PYTEST_WORKERS:-2}" --dist worksteal)
python -m pytest -q "${workers[@]}" tests "$@"
ATEN_CPU_CAPABILITY=avx2 python -m pytest -q "${workers[@]}" -m compiled tests "$@"
if ! wait "$cxx"; then
  cat build/ctest-build.log
  exit 1
fi
bash scripts/ctest.sh
