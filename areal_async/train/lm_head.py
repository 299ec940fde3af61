"""Per-token logprobs straight from the last hidden states: the LM head runs chunk by chunk, so the [N, V] logits
of a micro-batch never exist at once (32k tokens x 152k vocab is 10 GB in bf16, 20 GB as fp32), in forward or
backward.

`forward_features` runs the model with its output embedding (lm_head) turned into the identity, so `.logits` of
the output holds the hidden states [.., H] the head would have multiplied; `token_logprobs` then applies the head to
chunks of `chunk_tokens` rows inside one autograd Function:

    forward   per chunk: z = (h W^T + b) / T in fp32 -> logp[target] = z[target] - logsumexp(z), entropy
    backward  per chunk: recompute z, p = softmax(z); dlogp/dz = onehot - p, dH/dz = -p (z - E_p[z]);
              dh = dz W / T, dW += dz^T h / T (accumulated in fp32)

so memory beyond the model is a few [chunk, V] fp32 buffers, and the head's matmul runs once forward and twice
backward (the recompute plus the two gradient products), as with checkpointing but without keeping any chunk.
Where the whole micro-batch's log-probabilities fit in `keep_bytes` (1 GiB by default: 2,048 tokens of a
49k vocab are 0.4 GB), forward keeps them and backward skips the recompute, one of the head's three matmuls: for
SmolLM2-135M, whose head is a fifth of its matmul parameters, that is ~7% of a train step's matmul FLOPs.

Models whose logits are more than `h W^T + b` (Gemma's final soft-capping, Cohere's logit scale, Granite's logit
scaling) keep the model's own logits (`forward_features` returns head None) and go through `logprobs_from_logits`,
still chunked for the fp32 part.

Under FSDP2 the head's weight is read after the forward, when the root's parameters are unsharded (the root stays
unsharded until backward), so its gradient lands in the unsharded parameter that FSDP reduce-scatters after
backward; an empty micro-batch still gives the weight a (zero) gradient, so every rank reduces the same tensors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from areal_async.server.kernels import head as head_kernel
from areal_async.train.losses import entropy_from_logits

__all__ = [
    "LMHead",
    "forward_features",
    "token_logprobs",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "DEFAULT_CHUNK_TOKENS",
]

DEFAULT_CHUNK_TOKENS = 1024
PACK_ROWS = 128  # below this many rows, and with no packed weight at hand, the head's product stays on torch
DEFAULT_KEEP_BYTES = 1 << 30  # forward keeps the [M, V] fp32 log-probabilities for backward up to this size
# config attributes that change logits after the head's matmul (a value other than these disables the hidden path)
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None,),
    "logit_scale": (None, 1.0),
    "logits_scaling": (None, 1.0),
    "output_multiplier_scale": (None, 1.0),
}


@dataclass
class LMHead:
    weight: Tensor  # [V, H]
    bias: Tensor | None  # [V]
    # what the head's product prepares once per weight (server/kernels/head.py's packed layout): an LMHead lives for
    # one model forward and its backward, while the weight stays the same
    prepared: dict = field(default_factory=dict, repr=False, compare=False)


def _head_module(model: nn.Module) -> nn.Linear | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return None
    cfg = getattr(model, "config", None)
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        for attr, neutral in _LOGIT_TRANSFORMS.items():
            if getattr(text, attr, None) not in neutral:
                return None
    return head


@contextlib.contextmanager
def _identity_head(head: nn.Linear) -> Iterator[None]:
    # instance attribute, shadows Linear.forward; a copy, not a view: FSDP2 hooks the output for its backward
    head.forward = torch.clone  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def forward_features(model: nn.Module, **kwargs) -> tuple[object, LMHead | None]:
    """`model(**kwargs)` whose `.logits` are the head's inputs [.., H] (with the head returned), or, for a model
    without a plain linear head, the real logits [.., V] (head None)."""
    head = _head_module(model)
    if head is None:
        return model(**kwargs), None
    with _identity_head(head):
        out = model(**kwargs)
    weight = head.weight  # read now: under FSDP2 the root's gathered (unsharded) parameter
    if type(weight).__name__ == "DTensor":
        raise RuntimeError(
            "the LM head's weight is still sharded after the forward: the root FSDP module must "
            "keep its parameters gathered after forward (fully_shard's default for the root)"
        )
    return out, LMHead(weight, head.bias)


def token_logprobs(
    features: Tensor,
    targets: Tensor,
    head: LMHead | None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[targets] and the entropy, from `forward_features`'s output rows. [M, H|V], [M] ->
    [M] fp32, [M] fp32 | None."""
    if head is None:
        return logprobs_from_logits(
            features,
            targets,
            temperature=temperature,
            compute_entropy=compute_entropy,
            chunk_tokens=chunk_tokens,
            entropy_grad=entropy_grad,
        )
    return logprobs_from_hidden(
        features,
        head,
        targets,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
        keep_bytes=keep_bytes,
    )


def _check(temperature: float, chunk_tokens: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def logprobs_from_hidden(
    hidden: Tensor,
    head: LMHead,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
) -> tuple[Tensor, Tensor | None]:
    """Chunked LM head + log-softmax (see the module docstring). [M, H], [M] -> [M], [M] | None (fp32).
    `entropy_grad=False`: the entropy is a statistic only (no gradient flows through it). `keep_bytes`: the
    largest [M, V] fp32 forward keeps for backward instead of recomputing it (0: always recompute)."""
    _check(temperature, chunk_tokens)
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [M, H] and targets [M], got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    bias = head.bias if head.bias is not None else hidden.new_zeros(0)
    keep = (
        torch.is_grad_enabled()
        and (hidden.requires_grad or head.weight.requires_grad)
        and hidden.shape[0] * head.weight.shape[0] * 4 <= keep_bytes
    )
    lp, ent = _ChunkedHead.apply(
        hidden,
        head.weight,
        bias,
        targets,
        float(temperature),
        int(chunk_tokens),
        bool(compute_entropy),
        bool(entropy_grad),
        keep,
        head.prepared,
    )
    return lp, (ent if compute_entropy else None)


def _fp32(t: Tensor | None) -> Tensor | None:
    """`t` in fp32 (itself when it already is: no copy)."""
    return None if t is None else t.float()


_kernel_state: dict[str, object] = {}
_kernel_lock = threading.Lock()


def _head_kernel() -> head_kernel.Kernel | None:
    with _kernel_lock:
        if "kernel" not in _kernel_state:
            _kernel_state["kernel"] = head_kernel.load()
        return _kernel_state["kernel"]  # type: ignore[return-value]


class _Scratch:
    """Reused [chunk, V] buffers for the kernel path's per-chunk temporaries (the logits, fp32, and their
    gradient, bf16: 200 and 100 MB at 1,024 x 49,152).

    Why: allocations this large come back from the C library as fresh pages each time (measured in the train step:
    ~250k page faults a step, each page zeroed by the kernel), which cost the head's product and backward pass more
    than their arithmetic (1.8 s and 0.7 s of a 18.4 s SmolLM2 step against ~0.9 and ~0.1 s alone). Buffers are
    keyed by dtype and capacity (whole chunks), handed out as row-prefix views and returned after their last use;
    at most `keep` free ones per key are held, so the process keeps about the step's peak of them between steps."""

    def __init__(self, keep: int = 4) -> None:
        self._free: dict[tuple[torch.dtype, int], list[Tensor]] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, rows: int, cols: int, capacity_rows: int, dtype: torch.dtype) -> Tensor:
        """A [rows, cols] contiguous view of a buffer of max(rows, capacity_rows) x cols elements (contents
        undefined)."""
        key = (dtype, max(rows, capacity_rows) * cols)
        with self._lock:
            pool = self._free.get(key)
            flat = pool.pop() if pool else None
        if flat is None:
            flat = torch.empty(key[1], dtype=dtype)
        return flat[: rows * cols].view(rows, cols)

    def give(self, t: Tensor) -> None:
        """Return a tensor from `take` (no view of it may be used afterwards)."""
        flat = t._base if t._base is not None else t
        key = (flat.dtype, flat.numel())
        with self._lock:
            pool = self._free.setdefault(key, [])
            if len(pool) < self._keep:
                pool.append(flat)


_scratch = _Scratch()


def _head_product(hidden: Tensor, weight: Tensor, bias: Tensor | None, prepared: dict) -> Callable[[Tensor], Tensor]:
    """h [C, H] -> h W^T + b [C, V] as a fresh fp32 tensor, for the chunks of `hidden` [M, H].

    The product is fp32: with a bf16 matmul the logits carry bf16 rounding (about 1e-2 on the log-probabilities),
    which lands in the importance ratios of the loss. The inference side keeps its bf16 head, so this removes the
    trainer's half of that noise. With bf16 operands on a CPU with AVX512-BF16 the product runs in
    server/kernels/head.py (exact bf16 products, fp32 sums: the same fp32 logits at the bf16 rate); otherwise both
    operands are upcast once and torch multiplies in fp32. `prepared` keeps the kernel's packed weight for the
    head's later calls in the same forward; a first call of few rows (a pack costs about as much as the product of
    PACK_ROWS rows) takes torch's product."""
    kernel = _head_kernel() if hidden.device.type == "cpu" else None
    if kernel is not None and kernel.applies(hidden, weight) and ("packed" in prepared or hidden.shape[0] >= PACK_ROWS):
        if "packed" not in prepared:
            prepared["packed"] = kernel.pack(weight)  # [V / 32, H / 2, 32]: the weight changes every step
        packed = prepared["packed"]
        b32, n = _fp32(bias), weight.shape[0]
        chunk = int(prepared.get("chunk", DEFAULT_CHUNK_TOKENS))
        # into a reused buffer (the caller gives it back to _scratch)
        return lambda h: kernel.forward(h, packed, n, b32, out=_scratch.take(h.shape[0], n, chunk, torch.float32))
    w32, b32 = weight.float(), _fp32(bias)  # [V, H] fp32, one cast per call (none for fp32 weights)

    def product(h: Tensor) -> Tensor:
        with torch.autocast(h.device.type, enabled=False):  # an autocast caller would make it bf16 again
            return F.linear(h.float(), w32, b32)

    return product


def _chunk_z(product: Callable[[Tensor], Tensor], hidden: Tensor, temperature: float) -> Tensor:
    """(h W^T + b) / T for one chunk, as a fresh fp32 tensor the caller may overwrite. [C, V]"""
    z = product(hidden)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _fused_softmax(hidden: Tensor, weight: Tensor) -> head_kernel.Kernel | None:
    """server/kernels/head.py's log-softmax passes where they apply: bf16 weights on CPU (a bf16 trainer; the fp32
    path keeps torch's ops), else None."""
    if hidden.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    return _head_kernel()


def _torch_dz(kept, i, product, h, g, lse, ent, g_ent, targets, s, chunk, t, use_ent, dtype) -> Tensor:
    """dz [C, V] of one chunk with torch's ops, in place on the kept (or recomputed) log-probabilities."""
    if kept is not None:
        logp = kept[i]  # [C, V]
        kept[i] = None  # freed as soon as its chunk is done
    else:
        logp = _chunk_z(product, h, t).sub_(lse[s : s + chunk, None])  # [C, V]
    if use_ent:
        # dlogp/dz = onehot - p; dH/dz = -p (z - E_p[z]) = -p (logp + H). Together:
        # dz = onehot g - p (g + g_ent (logp + H))
        p = torch.exp(logp)
        coef = logp.add_(ent[s : s + chunk, None]).mul_(g_ent[s : s + chunk, None].float()).add_(g)
        dz = p.mul_(coef).neg_()
    else:
        dz = logp.exp_().mul_(-g)  # -p g
    dz.scatter_add_(1, targets[s : s + chunk, None], g)
    if t != 1.0:
        dz.div_(t)  # through z = logits / T
    return dz.to(dtype)


class _ChunkedHead(torch.autograd.Function):
    """Element-wise work runs in place on the chunk's one [C, V] buffer (plus one for the probabilities where the
    entropy needs them): on a CPU these passes over C x V floats cost a sizeable part of the matmuls beside them."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor,
        targets: Tensor,
        temperature: float,
        chunk: int,
        want_entropy: bool,
        entropy_grad: bool,
        keep: bool,
        prepared: dict,
    ) -> tuple[Tensor, Tensor]:
        m = hidden.shape[0]
        b = bias if bias.numel() else None
        lp = torch.empty(m, dtype=torch.float32, device=hidden.device)  # [M]
        lse = torch.empty_like(lp)  # [M], kept for backward
        ent = torch.empty_like(lp) if want_entropy else lp.new_zeros(0)
        kept: list[Tensor | None] = []  # [C, V] log-probabilities per chunk, when backward is to reuse them
        prepared["chunk"] = chunk  # the scratch buffers' capacity in rows
        product = _head_product(hidden, weight, b, prepared)
        ctx.prepared = prepared
        fused = _fused_softmax(hidden, weight)
        ctx.fused = fused
        for s in range(0, m, chunk):
            if fused is not None:  # the kernel's two passes per row; keeps the scaled logits instead of logp
                z = product(hidden[s : s + chunk])  # [C, V]
                lp_c, lse_c, ent_c = fused.softmax_forward(z, targets[s : s + chunk], temperature, want_entropy)
                lp[s : s + chunk], lse[s : s + chunk] = lp_c, lse_c
                if ent_c is not None:
                    ent[s : s + chunk] = ent_c
                if keep:
                    kept.append(z)
                else:
                    _scratch.give(z)
                continue
            z = _chunk_z(product, hidden[s : s + chunk], temperature)  # [C, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[s : s + chunk] = lse_c
            lp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse_c
            if want_entropy or keep:
                logp = z.sub_(lse_c[:, None])
                if want_entropy:  # H = -sum p log p; logits from a matmul are finite, so p log p is too
                    ent[s : s + chunk] = -torch.linalg.vecdot(torch.exp(logp), logp)
                if keep:
                    kept.append(logp)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.kept = kept if keep else None  # intermediate buffers, not inputs or outputs: safe to hold on ctx
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, want_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        b = bias if bias.numel() else None
        m = hidden.shape[0]
        if g_lp is None:
            g_lp = lse.new_zeros(m)
        use_ent = ctx.entropy_grad and g_ent is not None
        grad_h = torch.empty_like(hidden) if need_h else None  # [M, H]
        grad_w = None  # [V, H] fp32 accumulator; a reused buffer on the kernel path
        if need_w:
            grad_w = (
                _scratch.take(weight.shape[0], weight.shape[1], 0, torch.float32).zero_()
                if ctx.fused is not None
                else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            )
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and b is not None else None
        kept, ctx.kept = ctx.kept, None  # used up in place below: a second backward recomputes
        product = (
            _head_product(hidden, weight, b, ctx.prepared) if kept is None else None
        )  # for the recompute, as forward
        fused = ctx.fused
        for i, s in enumerate(range(0, m, chunk)):
            h = hidden[s : s + chunk]  # [C, H]
            g = g_lp[s : s + chunk, None].float()  # [C, 1]
            if fused is not None:
                if kept is not None:
                    z = kept[i]  # [C, V] scaled logits
                    kept[i] = None
                else:  # the same product and scaling as forward
                    z = product(h)
                    fused.softmax_forward(z, targets[s : s + chunk], t, False)
                dz = fused.softmax_backward(
                    z,
                    lse[s : s + chunk],
                    targets[s : s + chunk],
                    g_lp[s : s + chunk],
                    t,
                    weight.dtype,
                    ent[s : s + chunk] if use_ent else None,
                    g_ent[s : s + chunk] if use_ent else None,
                    out=_scratch.take(z.shape[0], z.shape[1], chunk, weight.dtype),
                )  # [C, V]
                _scratch.give(z)
                del z
            else:
                dz = _torch_dz(kept, i, product, h, g, lse, ent, g_ent, targets, s, chunk, t, use_ent, weight.dtype)
            if grad_h is not None:
                torch.mm(dz, weight, out=grad_h[s : s + chunk])
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(dz.t(), h)
                else:  # the bf16 product added into fp32 (the same values as .float() first, one temporary less)
                    grad_w.add_(dz.t() @ h)
            if grad_b is not None:
                grad_b += dz.float().sum(0)
            if fused is not None:
                _scratch.give(dz)  # its products above are done (CPU ops run synchronously)
            del dz
        grad_w_out = grad_w.to(weight.dtype) if grad_w is not None else None
        if grad_w is not None and fused is not None:
            _scratch.give(grad_w)
        return (
            grad_h,
            grad_w_out,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[targets] (and entropy) from full logits, in fp32 chunks. [M, V], [M] -> [M],
    [M] | None. Each chunk is checkpointed under autograd (its fp32 copy is recomputed in backward, not kept).
    `entropy_grad=False`: the entropy is only a statistic; it is computed without autograd."""
    from torch.utils.checkpoint import checkpoint

    _check(temperature, chunk_tokens)
    grad = torch.is_grad_enabled() and logits.requires_grad
    lps: list[Tensor] = []
    ents: list[Tensor] = []
    # split, not slicing: one backward node for all chunks, instead of a full-size zero gradient per chunk
    for lg, tg in zip(logits.split(chunk_tokens), targets.split(chunk_tokens)):
        if compute_entropy and (entropy_grad or not grad):
            lp, ent = (
                checkpoint(_chunk_logp_entropy, lg, tg, temperature, use_reentrant=False)
                if grad
                else _chunk_logp_entropy(lg, tg, temperature)
            )
            ents.append(ent)
        else:
            lp = (
                checkpoint(_chunk_logp, lg, tg, temperature, use_reentrant=False)
                if grad
                else _chunk_logp(lg, tg, temperature)
            )
            if compute_entropy:
                with torch.no_grad():
                    ents.append(entropy_from_logits(lg.detach().float() / temperature))
        lps.append(lp)
    if not lps:  # no rows: still a tensor attached to the graph, so backward runs through the model like on every
        # other rank (FSDP collectives must match) and just yields zero gradients; [0] elements, no copy
        empty = logits.sum(-1).float()  # [0]
        return empty, (empty.detach().clone() if compute_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if compute_entropy else None)


def _chunk_logp(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    z = logits.float() / temperature  # [C, V] fp32, transient
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _chunk_logp_entropy(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    z = logits.float() / temperature
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return lp, entropy_from_logits(z)
