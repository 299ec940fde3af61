"""Hardware and model presets from public specifications, each figure with its source.

Why presets and not a profile: before a run there is nothing to profile on the target cluster, and a vendor's data
sheet and a model's config.json are what a user has. Every figure is a default only: `Plan` (simulate.py) takes
overrides for each derived cost term, and `calibrate.py` replaces them with what a profile measured.

Peak FLOP/s are dense BF16 tensor-core figures (the data sheets' "with sparsity" figures are twice these).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: dense BF16 peak, HBM capacity and bandwidth, intra-node (NVLink) bandwidth per GPU and
    direction, and the inter-node network bandwidth per GPU (the node's NICs divided by its 8 GPUs)."""

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bw: float
    nvlink_bw: float
    network_bw: float
    gpus_per_node: int = 8


GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; 80 GB HBM3 at
    # 3.35 TB/s; NVLink 900 GB/s (bidirectional, 450 per direction). Network: DGX H100, 8x ConnectX-7 400 Gb/s
    # = 50 GB/s per GPU.
    "H100": GPUSpec("H100", 989 * TFLOPS, 80 * GB, 3.35e12, 450 * GB, 50 * GB),
    # NVIDIA H800 SXM5 (the export variant of H100): the same SMs, clocks and HBM3 (989 dense BF16 TFLOPS,
    # 80 GB, 3.35 TB/s); NVLink cut to 400 GB/s (200 per direction). Network: 8x 400 Gb/s per node assumed, as in
    # DGX H100 (the AReaL paper gives no NIC figure).
    "H800": GPUSpec("H800", 989 * TFLOPS, 80 * GB, 3.35e12, 200 * GB, 50 * GB),
    # NVIDIA H200 data sheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense; 141 GB HBM3e at 4.8 TB/s;
    # NVLink 900 GB/s. Network: DGX H200, 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU.
    "H200": GPUSpec("H200", 989 * TFLOPS, 141 * GB, 4.8e12, 450 * GB, 50 * GB),
    # NVIDIA A100 data sheet (SXM4 80 GB): BF16 312 TFLOPS dense; HBM2e 2,039 GB/s; NVLink 600 GB/s (300 per
    # direction). Network: DGX A100, 8x ConnectX-6 200 Gb/s = 25 GB/s per GPU.
    "A100": GPUSpec("A100", 312 * TFLOPS, 80 * GB, 2.039e12, 300 * GB, 25 * GB),
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shapes (as in its config.json); parameter count and KV bytes are derived from them."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def params(self) -> float:
        """Parameters from the shapes: attention (q, k, v with biases, o), the gated MLP, two norms per layer, the
        embedding and (when untied) the LM head."""
        d, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        attn = d * q + q + 2 * (d * kv + kv) + q * d
        mlp = 3 * d * self.intermediate
        per_layer = attn + mlp + 2 * d
        emb = self.vocab * d * (1 if self.tied_embeddings else 2)
        return float(self.layers * per_layer + emb + d)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token."""
        return float(2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def attention_flops_per_token(self, context: float) -> float:
        """Forward attention FLOPs of one token attending to `context` earlier tokens (QK^T and AV, 2 x 2 x ...)."""
        return 4.0 * self.layers * self.heads * self.head_dim * context


MODELS: dict[str, ModelSpec] = {
    # Qwen/Qwen2.5-1.5B config.json (the shapes of DeepSeek-R1-Distill-Qwen-1.5B): hidden 1536, 28 layers,
    # 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings.
    "qwen2.5-1.5b": ModelSpec("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True),
    # Qwen/Qwen2.5-7B config.json (R1-Distill-Qwen-7B): hidden 3584, 28 layers, 28 heads, 4 KV heads,
    # intermediate 18944, vocab 152064, untied.
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False),
    # Qwen/Qwen2.5-14B config.json (R1-Distill-Qwen-14B): hidden 5120, 48 layers, 40 heads, 8 KV heads,
    # intermediate 13824, vocab 152064, untied.
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False),
    # Qwen/Qwen2.5-32B config.json (R1-Distill-Qwen-32B): hidden 5120, 64 layers, 40 heads, 8 KV heads,
    # intermediate 27648, vocab 152064, untied.
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, False),
}


def gpu(name: str, **overrides: float) -> GPUSpec:
    """A GPU preset by name (case-insensitive), with any field overridden."""
    key = name.upper()
    if key not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; presets: {sorted(GPUS)}")
    return replace(GPUS[key], **overrides) if overrides else GPUS[key]


def model(name: str) -> ModelSpec:
    """A model preset by name: 'qwen2.5-7b', or just '7b'."""
    key = name.lower()
    if key not in MODELS:
        key = f"qwen2.5-{key}"
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; presets: {sorted(MODELS)}")
    return MODELS[key]
