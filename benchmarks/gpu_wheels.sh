#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels that benchmarks/gpu_check.sh installs on a GPU machine that has no
# network. That machine's image already holds torch, transformers, aiohttp, uvloop, numpy, safetensors, pyyaml,
# tokenizers, jinja2, accelerate, matplotlib, tensorboard, pyarrow, sympy, requests, tqdm and pytest (with
# pytest-timeout); what the project needs beyond them is listed below, each with every dependency that image lacks,
# since the download is --no-deps (two versions of one package would stop the install, so exactly one each).
#
#   bash benchmarks/gpu_wheels.sh            # -> .whl/ in the repository root (ignored through .git/info/exclude)
#
# The versions are the ones `make setup` installed when the check was written; the GPU machine runs Python 3.12 on
# x86-64, hence the fixed interpreter and platform tags (pip matches manylinux_2_N exactly, so several are named).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST="$ROOT/.whl"
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi

WHEELS=(
    "msgspec==0.23.0"                 # RPC frames and config validation (compiled: cp312 manylinux)
    "math-verify==0.9.0"              # math answer grading (areal_async.rewards.math)
    "latex2sympy2_extended==1.11.0"   # needed by math-verify
    "antlr4-python3-runtime==4.13.2"  # needed by latex2sympy2_extended
    "gguf==0.19.0"                    # transformers' GGUF loader (model.path=*.gguf)
    "pytest-asyncio==1.5.0"           # the async tests (pyproject sets asyncio_mode=auto)
)

PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done

mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$DEST" "${WHEELS[@]}"

EXCLUDE=$(git -C "$ROOT" rev-parse --git-path info/exclude)
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"

# exactly one wheel per package (a leftover of another version would stop the install on the GPU machine)
dupes=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [[ -n "$dupes" ]]; then
    echo "error: more than one wheel of: $dupes (in $DEST); remove the stale ones" >&2
    exit 1
fi
ls -l "$DEST"
echo "total: $(du -sh "$DEST" | cut -f1) in $(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels"
