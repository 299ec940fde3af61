#!/usr/bin/env bash
# The real-vLLM leg: builds (once, cached outside the clone) the vLLM engine venv with scripts/install_vllm.sh, then
# runs the tests marked vllm_real against real vLLM servers (tests/test_vllm_real.py: every endpoint the vLLM
# dialect uses, through the client's own calls; tests/test_vllm_run.py: `python -m areal_async.run
# server.backend=vllm` end to end, in abort and in-place modes; tests/test_vllm_broadcast.py: broadcast weight sync
# through the project's gloo weight-transfer engine plugin, and a run with train.weight_sync=broadcast).
# AREAL_REQUIRE_VLLM=1 makes them fail rather than skip, so this leg
# cannot pass without a real vLLM having answered.
#
# A real vLLM-CPU server takes ~5 GB of memory (VLLM_CPU_KVCACHE_SPACE=2) and both cores of a small host while it
# starts (~40 s warm, ~80 s the first time: torch.compile, cached after); the tests start one per module. It must
# not be niced: a niced vLLM beside other work starves.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/install_vllm.sh
AREAL_REQUIRE_VLLM=1 .venv/bin/python -m pytest -m vllm_real -p no:randomly tests/test_vllm_real.py tests/test_vllm_run.py \
  tests/test_vllm_broadcast.py "$@"
echo "vllm leg: $(( $(date +%s) - start )) s"
