#!/usr/bin/env bash
# What a session with the GPU machine runs through the `device` tool, in one call:
#   bash scripts/gpu_check.sh
# Builds the extension against that machine's torch, runs the GPU tests (two ranks sharing the
# GPU over NCCL), the example with --device cuda, the planner's GPU check, then the CPU suite;
# summaries and logs go to $OUT (or ./gpu_check_out). Every step has a time limit (seconds, from
# the environment) so that one device call of at most 10 minutes ends with its logs written.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } \
  > "$out/machine.txt" 2>&1
# SKIP_BUILD=1: the caller has just built and installed it (pip rebuilds every file each time).
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
    || { echo "build failed"; tail -40 "$out/build.log"; exit 1; }
fi
timeout "${GPU_TESTS_S:-420}" python3 -m pytest -q tests/test_gpu.py --timeout 700 \
  > "$out/gpu_tests.log" 2>&1
echo "gpu tests: exit $? $(tail -1 "$out/gpu_tests.log")"
# One rank: torchrun gives every rank the same environment, so two ranks on one GPU would share a
# NCCL host id and device (the tests set them per rank instead).
OMP_NUM_THREADS=1 timeout "${EXAMPLE_S:-120}" torchrun --standalone --nproc-per-node 1 \
  examples/train_llama.py --device cuda --steps 20 > "$out/example_cuda.log" 2>&1
# tqdm redraws its bar with carriage returns: the step lines follow them.
echo "example --device cuda: exit $? $(tr '\r' '\n' < "$out/example_cuda.log" | grep -E '^ *step ' | tail -1)"
# Issue 12: the planner's predicted peak memory and step time against the GPU's own counters.
timeout "${PLANNER_S:-240}" python3 benchmarks/planner_gpu.py > "$out/planner_gpu.log" 2>&1
echo "planner_gpu: exit $? $(grep -c 'fits True' "$out/planner_gpu.log") plans fit"
cp benchmarks/results/planner_gpu.json "$out/" 2>/dev/null
timeout "${CPU_SUITE_S:-900}" python3 -m pytest -q -n 8 tests --ignore=tests/test_gpu.py \
  > "$out/cpu_suite.log" 2>&1
echo "cpu suite: exit $? $(tail -1 "$out/cpu_suite.log")"
