#!/usr/bin/env bash
# The numerics-sensitive tests again with torch held to AVX2 (ATen's kernels, oneDNN and MKL) and the C kernels
# built for the portable baseline (x86-64-v3): on an AVX-512 or AMX machine this is the path an AVX2-only CPU
# runs, so both paths are checked wherever CI runs. Only on x86 CPUs with AVX2 (elsewhere there is no such path).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    echo "isa_leg: no AVX2 on this CPU, nothing to hold torch to; skipped"
    exit 0
fi
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 AREAL_KERNEL_MARCH=x86-64-v3
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import torch; c = torch.backends.cpu.get_cpu_capability(); print("isa_leg: torch CPU capability", c)
assert c == "AVX2", c'
exec "$PY" -m pytest -q tests/test_cpu_gemm.py tests/test_cpu_attention.py \
    tests/test_cpu_elementwise.py tests/test_model.py tests/test_lm_head.py tests/test_engine.py \
    tests/test_cpu_gemm_bf16.py tests/test_cpu_gemm_packed.py tests/test_decode_layer.py
