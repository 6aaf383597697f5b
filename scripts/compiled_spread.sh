#!/usr/bin/env bash
# Measures how far compiled stages land from eager ones under each CPU instruction set that
# inductor can emit code for here (the native one, avx2, default): runs the compiled-comparison
# tests (marker `compiled`) with PIPPY_XLA_SPREAD_LOG set and prints, per kind of tensor, the
# worst ratio max|compiled - eager| / max|eager| seen. tests/tolerances.py's bounds come from it.
# Usage: bash scripts/compiled_spread.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${SPREAD_DIR:-/tmp/pippy_xla_spread}"
mkdir -p "$out"
native=$(python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
for isa in ${ISAS:-native avx2 default}; do
  log="$out/$isa.tsv"
  rm -f "$log"
  # A cold inductor cache of its own per run ([Note: one inductor cache per instruction set]).
  export TORCHINDUCTOR_CACHE_DIR="$out/inductor_$isa"
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  cap=()
  [ "$isa" = native ] || cap=(ATEN_CPU_CAPABILITY="$isa")
  env "${cap[@]}" PIPPY_XLA_SPREAD_LOG="$log" python -m pytest -q -m compiled tests "$@" \
    > "$out/$isa.log" 2>&1
  echo "$isa: $(tail -n 1 "$out/$isa.log")"
done
python - "$out" "$native" <<'PY'
import pathlib, sys
out, native = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"worst max|compiled - eager| / max|eager| (native = {native})")
for isa in ("native", "avx2", "default"):
    worst, path = {}, out / f"{isa}.tsv"
    if not path.exists():  # not run (ISAS) nor earlier
        continue
    for line in path.read_text().splitlines():
        kind, ratio, where = line.split("\t", 2)
        if float(ratio) >= worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (float(ratio), where)
    for kind, (ratio, where) in sorted(worst.items()):
        print(f"{isa:8s} {kind:7s} {ratio:.2e}  {where}")
PY
