#!/usr/bin/env bash
# The trainer's transformers-version leg: runs the trainer, shared-prefix, LM-head and distributed-train tests in a
# separate venv whose transformers is the one SGLang pins, because the launcher runs SGLang in the same environment
# as the trainers, so a GPU image with SGLang carries SGLang's transformers, not the one the main venv resolves.
#
# Versions (read from the wheels' METADATA with `pip download --no-deps sglang==X`):
#   sglang 0.5.10        pins torch==2.9.1, transformers==5.3.0
#   sglang 0.5.6 - 0.5.9 pin  torch==2.9.1, transformers==4.57.1   (pyproject allows sglang>=0.5.6)
# The leg runs both transformers pins (5.3.0 and 4.57.1; 4.57.1 is what reaches the transformers-4 branches of
# train/fsdp.py, train/shared_prefix.py and train/logprobs.py). It holds ONLY transformers at SGLang's pin: torch
# stays at 2.13.0, the CPU wheel this machine has locally; SGLang's torch 2.9.1 is a multi-GB CUDA download from
# PyPI, so it is not part of this leg.
#
# Usage: .ci/transformers4_leg.sh [TRANSFORMERS_VERSION ...]     (default: 5.3.0 4.57.1)
# Venvs go to ${TF_LEG_DIR:-/tmp/areal-tf-leg}/tf-<version> and are reused when present. Needs PyPI for
# transformers and its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
ROOT=${TF_LEG_DIR:-/tmp/areal-tf-leg}
TESTS=(tests/test_trainer.py tests/test_shared_prefix.py tests/test_lm_head.py tests/test_train_dist.py)
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(5.3.0 4.57.1)

for tf in "${VERSIONS[@]}"; do
  venv="$ROOT/tf-$tf"
  start=$(date +%s)
  if [ ! -f "$venv/.installed" ]; then
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # torch first and alone, so that the resolver does not pull a CUDA build for transformers' sake.
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
    # transformers with its own dependencies (tokenizers, huggingface_hub, safetensors at its pins); the project
    # without its dependencies, then the few of them these tests import.
    "$venv/bin/python" -m pip install -q "transformers==$tf"
    "$venv/bin/python" -m pip install -q --no-deps -e .
    "$venv/bin/python" -m pip install -q "aiohttp>=3.9" "msgspec>=0.18" "numpy>=1.24" "pyyaml>=6" "jinja2>=3.1.6" \
      "uvloop>=0.19" "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2"
    touch "$venv/.installed"
  fi
  # a reused venv may have been made from another checkout: this checkout's package comes first on the path
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$venv/bin/python" -c "import areal_async, os, sys; p = os.path.realpath(areal_async.__file__)
sys.exit(0 if p.startswith(os.path.realpath('$PWD') + os.sep) else f'transformers leg: areal_async from {p}')"
  got=$("$venv/bin/python" -c "import torch, transformers; print(torch.__version__, transformers.__version__)")
  echo "transformers leg: torch / transformers = $got"
  case "$got" in *" $tf") ;; *) echo "transformers leg: wanted transformers $tf, got $got" >&2; exit 1;; esac
  "$venv/bin/python" -m pytest -x -q -p no:cacheprovider "${TESTS[@]}"
  echo "transformers leg $tf: $(( $(date +%s) - start )) s"
done
