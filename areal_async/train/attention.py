"""The trainer's attention: transformers' SDPA, with short bf16 rows on CPU routed to train/attention_kernel.py.

Why a registered implementation rather than a patch: transformers looks the attention function up by the model's
`config._attn_implementation`, so registering one more name ("areal_sdpa") changes nothing for any other model in
the process. It takes exactly SDPA's arguments and masks (the same boolean masks are built for it), and every call
it does not handle (CUDA, fp32, long rows, float masks, dropout, extras such as soft-capping or sinks) goes to
transformers' own `sdpa_attention_forward` unchanged. Code that asks whether a model's attention is SDPA-like
(the layouts' mask choices) asks `sdpa_like`.

fp32 stays on torch: the kernel is used where it was measured faster (bf16 on CPU; benchmarks/README.md).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from areal_async.train import attention_kernel

__all__ = ["NAME", "sdpa_like", "trainer_attention", "attention", "kernel_applies"]

NAME = "areal_sdpa"
_lock = threading.Lock()
_state: dict[str, object] = {}


def sdpa_like(impl: str | None) -> bool:
    """Whether an `_attn_implementation` takes SDPA's boolean masks (sdpa itself or this module's)."""
    return (impl or "sdpa") in ("sdpa", NAME)


def _kernel() -> attention_kernel.Kernel | None:
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = attention_kernel.load()
        return _state["kernel"]  # type: ignore[return-value]


def trainer_attention(device: torch.device, compute_dtype: torch.dtype) -> str:
    """The `attn_implementation` to build the trainer's model with: this module's where its kernel can run (a
    bf16 model on CPU with the kernel built), else "sdpa". Registers the name with transformers on first use."""
    if device.type != "cpu" or compute_dtype != torch.bfloat16 or _kernel() is None:
        return "sdpa"
    _register()
    return NAME


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    with _lock:
        if _state.get("registered"):
            return
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _state["registered"] = True


def kernel_applies(
    kernel: attention_kernel.Kernel | None, query: Tensor, key: Tensor, mask: Tensor | None, causal: bool
) -> bool:
    """Whether the kernel computes this call: CPU bf16, whole register blocks of head dim, rows up to MAX_KEYS,
    no mask or a boolean one shared by the heads, and a causal call with as many keys as queries."""
    return (
        kernel is not None
        and query.device.type == "cpu"
        and query.dtype == key.dtype == torch.bfloat16
        and query.dim() == 4
        and query.shape[1] % key.shape[1] == 0
        and kernel.supports(query.shape[-1], key.shape[2], query.dtype)
        and (
            mask is None
            or (
                mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[1] == 1
                and mask.shape[2:] == (query.shape[2], key.shape[2])
            )
        )
        and not (causal and key.shape[2] != query.shape[2])
    )


def attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface: query [B, H, L, D], key/value [B, Hkv, Lk, D], a boolean mask
    [B|1, 1, L, Lk] (True: attend) or None -> ([B, L, H, D], None). The kernel where `kernel_applies`, else
    transformers' SDPA with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and query.shape[2] > 1 and attention_mask is None  # SDPA's rule (sdpa_attention_forward)
    extras = any(kwargs.get(x) is not None for x in ("softcap", "s_aux", "sinks", "position_bias", "sliding_window"))
    kernel = _kernel()
    if (
        dropout > 0.0
        or extras
        or kwargs.get("output_attentions")
        or not kernel_applies(kernel, query, key, attention_mask, causal)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return short_attention(kernel, query, key, value, attention_mask, causal, scale), None


def short_attention(
    kernel: attention_kernel.Kernel, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """softmax(scale q k^T, masked) v through the kernel, differentiable in q, k, v. q [B, H, L, D], k/v
    [B, Hkv, Lk, D] (last dim contiguous; copied if not), mask [B|1, 1, L, Lk] bool or None -> [B, L, H, D]."""
    return _ShortAttention.apply(q, k, v, mask, causal, scale, kernel)


def _last_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, kernel):
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        m = None if mask is None else _last_contiguous(mask).view(torch.uint8)  # [B|1, 1, L, Lk]
        b, h, length, d = q.shape
        out = torch.empty(b, length, h, d, dtype=q.dtype)  # [B, L, H, D]
        lse = torch.empty(b, h, length, dtype=torch.float32)  # [B, H, L]
        p = attention_kernel.params(q, k, v, m, causal, torch.get_num_threads())
        kernel.fwd(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            None if m is None else m.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            p.data_ptr(),
            scale,
        )
        ctx.save_for_backward(q, k, v, m, out, lse)
        ctx.causal, ctx.scale, ctx.kernel = causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, m, out, lse = ctx.saved_tensors
        g = grad_out.contiguous()  # [B, L, H, D]
        b, h, length, d = q.shape
        dq = torch.empty(b, length, h, d, dtype=q.dtype)  # [B, L, H, D], returned as [B, H, L, D]
        dk = torch.empty(k.shape, dtype=k.dtype)  # [B, Hkv, Lk, D]
        dv = torch.empty(v.shape, dtype=v.dtype)
        p = attention_kernel.params(q, k, v, m, ctx.causal, torch.get_num_threads())
        ctx.kernel.bwd(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            None if m is None else m.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            g.data_ptr(),
            dq.data_ptr(),
            dk.data_ptr(),
            dv.data_ptr(),
            p.data_ptr(),
            ctx.scale,
        )
        return dq.transpose(1, 2), dk, dv, None, None, None, None
