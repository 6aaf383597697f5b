#!/usr/bin/env bash
# Type-checks the C++ sources against another torch release's headers (no GPU, no install):
#   bash scripts/check_torch_headers.sh 2.11.0
# Downloads that release's wheel (without dependencies) into a cache, extracts its include/
# directory and runs `g++ -fsyntax-only` over every translation unit. Catches API drift such as
# the autograd node pointer type (see csrc/runtime/compat.h) before a GPU machine sees it.
set -euo pipefail
version="${1:?usage: check_torch_headers.sh TORCH_VERSION}"
cd "$(dirname "$0")/.."
cache="${PIPPY_TORCH_CACHE:-/tmp/pippy_torch_headers}/$version"
if [ ! -d "$cache/torch/include" ]; then
  mkdir -p "$cache"
  python -m pip download -q --no-deps -d "$cache" "torch==$version"
  python - "$cache" <<'PY'
import pathlib, sys, zipfile
cache = pathlib.Path(sys.argv[1])
wheel = next(cache.glob("torch-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(cache, [n for n in z.namelist() if n.startswith("torch/include/")])
wheel.unlink()
PY
fi
# The C++ standard the release's headers need: C++20 from torch 2.13 on, C++17 before (what
# torch's BuildExtension passes; the sources themselves are C++17).
IFS=. read -r major minor _ <<<"$version"
if [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 13 ]; }; then
  std=c++20
else
  std=c++17
fi
inc="$cache/torch/include"
py_inc="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
status=0
for f in $(git ls-files 'csrc/*.cpp'); do
  if g++ -std="$std" -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=_C \
      -DTORCH_API_INCLUDE_EXTENSION_H -I"$inc" -I"$inc/torch/csrc/api/include" -I"$py_inc" \
      -Icsrc "$f"; then
    echo "ok    $f (torch $version, $std)"
  else
    echo "FAIL  $f (torch $version, $std)"
    status=1
  fi
done
exit $status
