#!/usr/bin/env bash
# Builds, once, the venv that `server.backend=sglang` runs SGLang from (server.python) and tests/test_sglang_real.py
# uses:   ${AREAL_ENGINE_CACHE:-$HOME/.cache/areal_async/engines}/sglang-<release>
# Usage: scripts/install_sglang.sh [RELEASE ...]   (default: 0.5.23; `make sglang SGLANG_RELEASES="0.5.10 0.5.23"`)
# A venv that is already there and passes the check is kept: each is 9-11 GB (SGLang's CUDA torch, whose libraries
# load without a GPU) and takes about 5 minutes to build from PyPI's wheels.
#
# SGLang pins its own torch and transformers (docs/inference.md lists each release's), so it never shares the
# project's venv. 0.5.22 and later need Python >= 3.11. On a CPU without AMX, SGLang's CPU engine calls one op of
# the CPU build of sgl-kernel, which no package index carries; the launcher puts the project's pure-torch stand-in
# (areal_async/launch/sglang_cpu_kernels/) first on SGLang's PYTHONPATH, so nothing is patched here.
set -euo pipefail
CACHE=${AREAL_ENGINE_CACHE:-$HOME/.cache/areal_async/engines}
PY=${PY:-$(command -v python3.11 || command -v python3)}
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(0.5.23)
mkdir -p "$CACHE"

check() {  # the venv's SGLang release, read from its metadata (SGLang itself is not imported)
  "$1/bin/python" -c 'import importlib.metadata as m, sys; v = m.version("sglang"); print(v); sys.exit(v != sys.argv[1])' "$2"
}

for release in "${RELEASES[@]}"; do
  venv="$CACHE/sglang-$release"
  exec 9>"$CACHE/.sglang-$release.lock"
  flock 9  # one build of a release at a time (CI legs, developers)
  if [ -f "$venv/.installed" ] && check "$venv" "$release" >/dev/null 2>&1; then
    echo "sglang: $venv/bin/python ready (SGLang $release)"
    continue
  fi
  case "$release" in
    0.5.2[2-9]*|0.[6-9]*) "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
      || { echo "sglang: SGLang $release needs Python >= 3.11 (PY=$PY)" >&2; exit 2; } ;;
  esac
  start=$(date +%s)
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "sglang==$release"
  check "$venv" "$release"
  touch "$venv/.installed"
  echo "sglang: $venv/bin/python built in $(( $(date +%s) - start )) s (SGLang $release)"
  flock -u 9
done
