#!/usr/bin/env bash
# What a session with the GPU machine runs through the `device` tool, in one call:
#   bash scripts/gpu_check.sh
# Builds the extension against that machine's torch, runs the GPU tests (two ranks sharing the
# GPU over NCCL), then the whole CPU suite, and the example with --device cuda; summaries and
# logs go to $OUT (or ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } \
  > "$out/machine.txt" 2>&1
MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
  || { echo "build failed"; tail -40 "$out/build.log"; exit 1; }
python3 -m pytest -q tests/test_gpu.py -x > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
# One rank: torchrun gives every rank the same environment, so two ranks on one GPU would share a
# NCCL host id and device (the tests set them per rank instead).
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 1 examples/train_llama.py --device cuda \
  --steps 20 > "$out/example_cuda.log" 2>&1
echo "example --device cuda: exit $? $(grep -E '^step' "$out/example_cuda.log" | tail -1)"
python3 -m pytest -q -n 8 tests --ignore=tests/test_gpu.py > "$out/cpu_suite.log" 2>&1
echo "cpu suite: $(tail -1 "$out/cpu_suite.log")"
# Issue 12: the planner's predicted peak memory and step time against the GPU's own counters.
python3 benchmarks/planner_gpu.py > "$out/planner_gpu.log" 2>&1
echo "planner_gpu: exit $? $(grep -c 'fits True' "$out/planner_gpu.log") plans fit"
cp benchmarks/results/planner_gpu.json "$out/" 2>/dev/null
