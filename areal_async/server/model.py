"""The decoder of the Qwen2 / Qwen2.5 / Qwen3 / Llama dense family, written for continuous batching.

One forward pass serves a whole engine step: the tokens of every scheduled request are concatenated into one flat
batch `[N]` (no padding), so embeddings, projections and MLPs run as single matmuls over all requests. Only attention
needs per-request structure; it reads keys and values from a paged KV cache (`KVCache`) per *attention group*.
Decode rows (one new token each) on CPU form one group that a small C kernel serves straight from the pages, each
key read once, no padding (kernels/attention.py). Prefill chunks, and decode rows where the kernel is not used (CUDA,
half precision, no C compiler), gather their pages into a padded batch and run one SDPA with an additive mask;
such decode rows are split by cache length so one long request does not make every row attend over its length.
Query heads that share a kv head are folded into the query axis, so SDPA sees plain multi-head attention (its
`enable_gqa` flag would send CUDA to the slow math kernel).

The family differs in a few switches, all read from config.json (`ModelSpec.from_hf_config`): Qwen2 has a bias on
q/k/v, Qwen3 RMS-normalises q and k per head before RoPE, Llama may have biases everywhere (`attention_bias`,
`mlp_bias`), and any of them may tie the LM head to the embeddings. Numerics follow transformers' implementation
(RMSNorm in fp32, RoPE tables computed in fp32 then cast, rotate-half layout), so fp32 logits agree to ~1e-5.

Weights are stored fused (q|k|v and gate|up) for fewer, larger matmuls; `params` exposes every Hugging Face tensor
name as a view into the fused storage, so loading a checkpoint is a `copy_` per name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from areal_async.server.cpu_matmul import Matmuls
from areal_async.server.kernels import attention as cpu_attention
from areal_async.server.kernels import decode_layer
from areal_async.server.kernels import elementwise as cpu_elementwise
from areal_async.server.step_batch import AttnGroup, SeqChunk, StepBatch, build_step_batch

if TYPE_CHECKING:
    from areal_async.server.sampling import DrawPlan

# Hugging Face `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class StepInterrupted(Exception):
    """Raised by `DecoderModel.forward` between layers when its `interrupt` callback says so."""


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something this implementation does not do; the message names it."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything about the architecture that the forward pass and the weight shapes depend on."""

    architecture: str  # the HF class name, e.g. "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_type: str = "default"
    rope_params: tuple[tuple[str, float], ...] = ()  # the scaling parameters of rope_type, sorted by key

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelSpec:
        """Parse a config.json dict; raises `UnsupportedModelError` naming whatever is not supported."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"<model_type {cfg.get('model_type')!r}>"
        family = SUPPORTED_ARCHITECTURES.get(arch)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"{arch}: unsupported hidden_act {act!r} (only silu)")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{arch}: sliding-window attention (use_sliding_window=true) is not supported")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        theta, rope_type, rope_params = _parse_rope(cfg, arch)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            rope_theta=theta,
            rope_type=rope_type,
            rope_params=rope_params,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The Hugging Face tensor names this model is made of, with their shapes (the lm head only when untied)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, out in (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)):
                shapes[p + f"self_attn.{name}.weight"] = (out, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            for name, (o, n) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes[p + f"mlp.{name}.weight"] = (o, n)
                if self.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (o,)
        return shapes


def _parse_rope(cfg: dict, arch: str) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """RoPE base and scaling from either config layout: transformers 5 writes `rope_parameters` (theta inside),
    older checkpoints write `rope_theta` plus an optional `rope_scaling` dict (`type` or `rope_type`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is not supported")
    keys = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
    picked = []
    for key in keys.get(rope_type, ()):
        if key not in params:
            raise UnsupportedModelError(f"{arch}: rope scaling {rope_type!r} needs {key!r} in its parameters")
        picked.append((key, float(params[key])))
    return theta, rope_type, tuple(sorted(picked))


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, scaled per `spec.rope_type` exactly as transformers does."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = dict(spec.rope_params)
    if spec.rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif spec.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, old_len = p["factor"], p["original_max_position_embeddings"]
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class KVCache:
    """Paged key/value storage, preallocated for a token budget.

    Per layer one tensor `[num_pages, page_size, 2 * num_kv_heads, head_dim]` holding k heads then v heads, so a
    step stores its new keys and values with one `index_copy_` and reads a request's pages with one `index_select`.
    Page 0 is never handed out: padded page-table entries point at it and the attention bias hides what they read.
    """

    def __init__(self, spec: ModelSpec, max_tokens: int, page_size: int, device: torch.device, dtype: torch.dtype):
        self.page_size = page_size
        self.num_pages = -(-max_tokens // page_size) + 1  # + the dummy page 0
        self.kv = torch.zeros(
            (spec.num_layers, self.num_pages, page_size, 2 * spec.num_kv_heads, spec.head_dim),
            device=device,
            dtype=dtype,
        )


class _Layer:
    """One decoder layer's tensors (fused storage)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        h, i = spec.hidden_size, spec.intermediate_size
        qkv_out = spec.q_size + 2 * spec.kv_size

        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, device=device, dtype=dtype)

        self.ln1 = new(h)
        self.ln2 = new(h)
        self.qkv_w = new(qkv_out, h)  # [q | k | v, hidden]
        self.qkv_b = new(qkv_out) if spec.qkv_bias else None
        self.o_w = new(h, spec.q_size)
        self.o_b = new(h) if spec.o_bias else None
        # Qwen3: one weight per head row [H + Hkv, D]: q_norm repeated for q heads, then k_norm for k heads
        self.qk_norm = new(spec.num_heads + spec.num_kv_heads, spec.head_dim) if spec.qk_norm else None
        self.gate_up_w = new(2 * i, h)  # [gate | up, hidden]
        self.gate_up_b = new(2 * i) if spec.mlp_bias else None
        self.down_w = new(h, i)
        self.down_b = new(h) if spec.mlp_bias else None

    def named_views(self, spec: ModelSpec, prefix: str) -> dict[str, torch.Tensor]:
        q, kv, i = spec.q_size, spec.kv_size, spec.intermediate_size
        out = {
            prefix + "input_layernorm.weight": self.ln1,
            prefix + "post_attention_layernorm.weight": self.ln2,
            prefix + "self_attn.q_proj.weight": self.qkv_w[:q],
            prefix + "self_attn.k_proj.weight": self.qkv_w[q : q + kv],
            prefix + "self_attn.v_proj.weight": self.qkv_w[q + kv :],
            prefix + "self_attn.o_proj.weight": self.o_w,
            prefix + "mlp.gate_proj.weight": self.gate_up_w[:i],
            prefix + "mlp.up_proj.weight": self.gate_up_w[i:],
            prefix + "mlp.down_proj.weight": self.down_w,
        }
        if self.qkv_b is not None:
            out[prefix + "self_attn.q_proj.bias"] = self.qkv_b[:q]
            out[prefix + "self_attn.k_proj.bias"] = self.qkv_b[q : q + kv]
            out[prefix + "self_attn.v_proj.bias"] = self.qkv_b[q + kv :]
        if self.o_b is not None:
            out[prefix + "self_attn.o_proj.bias"] = self.o_b
        if self.qk_norm is not None:
            # expanded views: copying a [D] checkpoint tensor into them fills every head's row
            out[prefix + "self_attn.q_norm.weight"] = self.qk_norm[: spec.num_heads]
            out[prefix + "self_attn.k_norm.weight"] = self.qk_norm[spec.num_heads :]
        if self.gate_up_b is not None:
            out[prefix + "mlp.gate_proj.bias"] = self.gate_up_b[:i]
            out[prefix + "mlp.up_proj.bias"] = self.gate_up_b[i:]
            out[prefix + "mlp.down_proj.bias"] = self.down_b
        return out


class DecoderModel:
    """The forward pass over a `StepBatch` with a `KVCache`. Not an nn.Module: inference only, no hooks, no grads.

    Speed notes (CPU decode is bound by per-op overhead, so the op count per layer matters): RoPE is applied to the
    whole fused q|k|v row at once with tables that leave v unchanged and fold the softmax scale into q; the k|v
    half is then stored with a single `index_copy_`; residual adds are fused into `addmm`. On CPU in fp32, C kernels
    take over where torch is slow at decode sizes (each falls back to torch where it cannot be built): decode
    attention (kernels/attention.py), matmuls on weights packed into panels with the residual added in place
    (kernels/gemm_packed.py, routed by cpu_matmul.py), RMSNorm and SiLU-gating (kernels/elementwise.py); a step of
    decode tokens only runs each layer as one C call over those same kernels (kernels/decode_layer.py), which
    takes the per-op dispatch out of a batch-1 step.

    On CPU the activations are fp32 whatever `dtype` is: with bf16 weights (and a bf16 KV cache) only the matmuls'
    inputs are rounded to bf16, as a bf16 trainer's are, and the rest (norms, RoPE, softmax, residual stream) stays
    fp32 and on the fp32 kernels; cpu_matmul.py routes each product. On CUDA everything is in `dtype`."""

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype  # the weights' (and the KV cache's): the served dtype
        # [N, hidden] activations, RoPE tables: fp32 on CPU (see the class docstring), else the weights' dtype
        self.act_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.embed = torch.zeros(spec.vocab_size, spec.hidden_size, device=self.device, dtype=dtype)
        self.norm = torch.zeros(spec.hidden_size, device=self.device, dtype=dtype)
        self.lm_head = self.embed if spec.tie_word_embeddings else torch.zeros_like(self.embed)
        self.layers = [_Layer(spec, self.device, dtype) for _ in range(spec.num_layers)]
        self.params: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not spec.tie_word_embeddings:
            self.params["lm_head.weight"] = self.lm_head
        for n, layer in enumerate(self.layers):
            self.params.update(layer.named_views(spec, f"model.layers.{n}."))
        # RoPE tables for every position, computed in fp32 like transformers, then cast. rotate_half(x) equals
        # roll(x, D/2) with the first half negated, so the sign goes into the sine table.
        inv_freq = rope_inv_freq(spec)
        freqs = torch.arange(spec.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        half = spec.head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(spec.head_dim - half)))
        act = self.act_dtype
        self.cos = emb.cos().to(device=self.device, dtype=act)
        self.sin = (emb.sin() * sign).to(device=self.device, dtype=act)
        self.scale = spec.head_dim**-0.5
        # per-head-row factors for the fused q|k|v rope: q rows carry the softmax scale; v rows get cos = 1 and
        # sin = 0, i.e. pass through unchanged
        h, hkv = spec.num_heads, spec.num_kv_heads
        self._rope_mul = torch.tensor([self.scale] * h + [1.0] * hkv + [0.0] * hkv, dtype=act, device=self.device)[
            :, None
        ]  # [H + 2Hkv, 1]
        self._cos_add = torch.tensor([0.0] * (h + hkv) + [1.0] * hkv, dtype=act, device=self.device)[:, None]
        # decode attention straight from the pages on CPU when the kernel builds (else gather + SDPA)
        self._kernel = None
        if self.device.type == "cpu" and cpu_attention.supports(h, hkv, spec.head_dim, dtype):
            self._kernel = cpu_attention.load()
        self.paged_decode = self._kernel is not None
        # every matmul through the code that wins for its rows and dtype (cpu_matmul.py)
        self.mm = Matmuls(self.device, dtype)
        # one-pass RMSNorm, SiLU-gating and greedy sampling on the fp32 activations (kernels/elementwise.py; the
        # scheduler samples with it)
        self.elementwise = cpu_elementwise.load() if self.device.type == "cpu" else None
        # decode steps' layers as one C call each where every kernel above is built (kernels/decode_layer.py)
        kernels_built = self.elementwise is not None and self._kernel is not None and self.mm.packed is not None
        lib = decode_layer.load_library_for() if kernels_built else None
        self._fused = decode_layer.FusedDecode(lib, self) if lib is not None else None

    @property
    def _gemm(self):
        """The fp32 few-rows kernel (kernels/gemm.py) in use, or None (tests and benchmarks switch it off)."""
        return self.mm.gemm

    @_gemm.setter
    def _gemm(self, kernel) -> None:
        self.mm.gemm = kernel

    @torch.inference_mode()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy already-validated tensors (HF names; any float dtype, any device) into the model's storage."""
        for name, t in tensors.items():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # the same tensor as the embeddings
            self.params[name].copy_(t)
        # the CPU kernels' packed copies now, not in the next step (kernels/gemm_packed.py; unchanged ones are kept)
        self.mm.prepack([w for la in self.layers for w in (la.qkv_w, la.o_w, la.gate_up_w, la.down_w)] + [self.lm_head])

    @torch.inference_mode()
    def forward(
        self,
        batch: StepBatch,
        cache: KVCache,
        interrupt: Callable[[], bool] | None = None,
        draws: DrawPlan | None = None,
    ) -> torch.Tensor:
        """Run the new tokens through the model, storing their k/v in `cache`; returns fp32 logits
        `[len(batch.logits_idx), vocab]`.

        `interrupt` is polled after every layer; when it returns True the pass stops with `StepInterrupted`. The
        cache then holds some layers' k/v for these tokens, which is harmless: a later pass over the same positions
        rewrites every layer before reading it. `draws` (one per logits row): where the whole decode step runs in one
        C call, its draws are made there too (`draws.done`); otherwise the caller draws from the logits."""
        spec = self.spec
        n, h, hkv, d = batch.num_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
        eps = spec.rms_norm_eps
        fused = self._fused is not None and self._fused.applies(batch)
        if fused and self._fused.whole_step(batch, interrupt):
            logits = self._fused.step(batch, cache, interrupt, draws)  # the same kernels and tables, one C call
            if logits is None:
                raise StepInterrupted
            return logits
        # [N, H + 2Hkv, D] rope tables for the fused rows: (q: scaled rope, k: rope, v: identity)
        cos = torch.addcmul(self._cos_add, self.cos[batch.positions][:, None, :], self._rope_mul)
        sin = self.sin[batch.positions][:, None, :] * self._rope_mul
        x = F.embedding(batch.input_ids, self.embed).to(self.act_dtype)  # [N, hidden]
        half, i = d // 2, spec.intermediate_size
        if fused and x.is_contiguous():
            if self._fused.run(x, batch, cache, cos, sin, interrupt):  # the same layers in one C call each
                raise StepInterrupted
            return self._head(x, batch)
        for li, layer in enumerate(self.layers):
            hs = self._rms_norm(x, layer.ln1, eps)
            qkv = self._linear(hs, layer.qkv_w, layer.qkv_b).view(n, h + 2 * hkv, d)  # [N, H + 2Hkv, D]
            if layer.qk_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
                qk = F.rms_norm(qkv[:, : h + hkv], (d,), None, eps) * layer.qk_norm
                qkv = torch.cat((qk, qkv[:, h + hkv :]), dim=1)
            qkv = torch.addcmul(qkv * cos, qkv.roll(half, dims=-1), sin)
            kv_pages = cache.kv[li]  # [pages, page_size, 2Hkv, D]
            kv_pages.view(-1, 2 * hkv, d).index_copy_(0, batch.write_slots, qkv[:, h:].to(kv_pages.dtype))
            attn = self._attention(qkv[:, :h], kv_pages, batch.groups)  # [N, H D]
            x = self._linear_add(x, attn, layer.o_w, layer.o_b)
            hs = self._rms_norm(x, layer.ln2, eps)
            gate_up = self._linear(hs, layer.gate_up_w, layer.gate_up_b)  # [N, 2I]
            if self.elementwise is not None:
                act = self.elementwise.silu_mul(gate_up)  # [N, I]
            else:
                act = F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])
            x = self._linear_add(x, act, layer.down_w, layer.down_b)
            if interrupt is not None and interrupt():
                raise StepInterrupted
        return self._head(x, batch)

    def _head(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The final norm and the LM head over the rows that want logits: x [N, hidden] -> [M, V] fp32."""
        x = self._rms_norm(x[batch.logits_idx], self.norm, self.spec.rms_norm_eps)  # [M, hidden]
        return self.mm.head(x, self.lm_head)  # [M, V] fp32

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        if self.elementwise is not None:
            return self.elementwise.rms_norm(x, weight if weight.dtype == torch.float32 else weight.float(), eps)
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w.T (+ b) -> [M, N] in the activations' dtype."""
        return self.mm.linear(x, w, b)

    def _linear_add(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x + inp @ w.T (+ b) for the residual connections; the kernel adds into x in place (x is this pass's own
        residual stream)."""
        return self.mm.linear_add(x, inp, w, b)

    def _attention(self, q: torch.Tensor, kv_pages: torch.Tensor, groups: list[AttnGroup]) -> torch.Tensor:
        """q [N, H, D] (already scaled); kv_pages [num_pages, page_size, 2Hkv, D] -> [N, H * D]."""
        spec = self.spec
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        rep = h // hkv
        outs = []
        for g in groups:
            b = g.batch
            if g.table is not None:  # one token per request, read straight from the pages (kernels/attention.py)
                out = cpu_attention.paged_decode_attention(
                    self._kernel, q[g.start : g.end], kv_pages, g.table, g.lens, hkv
                )  # [B, H, D]
                outs.append(out.view(b, h * d))
                continue
            kv = kv_pages.index_select(0, g.page_idx).view(b, -1, 2 * hkv, d).transpose(1, 2)  # [B, 2Hkv, S, D]
            kv = kv.to(q.dtype)  # a bf16 cache under fp32 activations (CPU): attention in fp32
            if g.q_index is None:
                qg = q[g.start : g.end].view(b, 1, h, d)  # [B, 1, H, D]
            else:
                qg = q.index_select(0, g.q_index).view(b, g.q_len, h, d)  # [B, Q, H, D]
            # Grouped queries: the `rep` query heads that share a kv head ride along the query axis, so SDPA runs
            # plain attention over Hkv heads. (SDPA's enable_gqa would send CUDA to its slow math kernel.)
            qg = qg.view(b, g.q_len, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, rep * g.q_len, d)
            mask = g.bias.to(q.dtype)  # [B, 1, Q, S]; with Q == 1 it broadcasts over the grouped rows
            if rep > 1 and g.q_len > 1:
                mask = mask[:, :, None].expand(b, 1, rep, g.q_len, mask.shape[-1]).reshape(b, 1, rep * g.q_len, -1)
            out = F.scaled_dot_product_attention(
                qg, kv[:, :hkv], kv[:, hkv:], attn_mask=mask, scale=1.0
            )  # [B, Hkv, rep * Q, D]
            out = out.view(b, hkv, rep, g.q_len, d).permute(0, 3, 1, 2, 4).reshape(b * g.q_len, h * d)
            if g.valid is not None:
                out = out[g.valid]
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], page_size: int = 16) -> list[torch.Tensor]:
        """Full-sequence logits `[T, V]` (fp32) for each sequence, through the same paged path the engine uses
        (a temporary cache sized for exactly these sequences). For tests and prompt scoring."""
        counts = [-(-len(s) // page_size) for s in sequences]
        cache = KVCache(self.spec, sum(counts) * page_size, page_size, self.device, self.dtype)
        table = torch.zeros(len(sequences), max(counts), dtype=torch.long)
        seqs: list[SeqChunk] = []
        next_page = 1
        for row, (s, c) in enumerate(zip(sequences, counts)):
            pages = list(range(next_page, next_page + c))
            table[row, :c] = torch.tensor(pages)
            seqs.append((list(s), 0, pages, row))
            next_page += c
        rows = [list(range(len(s))) for s in sequences]
        batch = build_step_batch(seqs, table, page_size, self.device, rows, self.dtype, self.paged_decode)
        logits = self.forward(batch, cache)
        return list(logits.split([len(s) for s in sequences]))
