"""Per-token logprobs (and entropy) of a transformers causal LM on packed sequences, plus packed-layout helpers.

A packed micro-batch is several sequences laid end to end as one row, input_ids [1, N], with no padding. Attention
must not cross sequence boundaries. We pass `position_ids` that restart at 0 for every sequence and no
attention_mask: transformers (masking_utils, >= 4.56) detects the restarts and builds a block-diagonal causal mask for
eager/sdpa, and flash-attention turns the same position_ids into varlen cu_seqlens. `use_cache=False` matters: with
a cache object present transformers skips the packed detection and sequences would see each other.
`explicit_mask=True` (automatic on a transformers without the detection) builds the block-diagonal mask here.

The catch of packing with sdpa/eager attention: the block-diagonal mask is dense, [N, N] for a row of N tokens, and
a kernel given a mask computes every score it masks. For many short sequences that is most of the step (128
sequences of ~60 tokens in rows of 1024: ~17x the attention work of each sequence alone, and the masked kernel is
slower per score too). `rows_forward_logprobs` is the layout for those: one sequence per row, right-padded to the
row's longest, no mask at all. Causal attention is then exact without one: a real token only attends to positions
before it, and the padding comes after every real token of its row. Padding costs little when each micro-batch
holds sequences of similar length (`train/packing.py`'s `pack_sorted_micro_batches`). Packing stays the layout for
flash-attention models, whose varlen kernels never build the mask.

Alignment (see areal_async/types.py): logp[t] = log p(input_ids[t] | the tokens before t in its own sequence),
and 0 at each sequence's first token. entropy[t] is the entropy of that same next-token distribution (0 at first
tokens). Logits are divided by the sampling temperature first, as the inference server did for the behaviour
logprobs.

Memory: the logits of a micro-batch are never materialised whole. The model runs with its LM head turned into
the identity and `train/lm_head.py` applies the head to chunks of `chunk_tokens` rows (fp32 log-softmax, entropy,
and a backward that recomputes each chunk), so the full-vocab tensors are [chunk_tokens, V] at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from areal_async.train.attention import sdpa_like
from areal_async.train.lm_head import DEFAULT_CHUNK_TOKENS, forward_features, logprobs_from_logits, token_logprobs

__all__ = [
    "packed_forward_logprobs",
    "rows_forward_logprobs",
    "pad_forward_logprobs",
    "needs_dense_packing_mask",
    "seq_ids_from_lens",
    "position_ids_from_lens",
    "broadcast_to_tokens",
    "block_causal_mask",
    "logprobs_from_logits",
    "model_device",
]


def _lens_tensor(seq_lens: Tensor | Sequence[int], device: torch.device | None = None) -> Tensor:
    lens = torch.as_tensor(seq_lens, dtype=torch.long, device=device)
    if lens.dim() != 1:
        raise ValueError(f"seq_lens must be a flat [B] sequence, got shape {tuple(lens.shape)}")
    if lens.numel() and int(lens.min()) < 1:
        raise ValueError(f"every sequence must have at least one token, got seq_lens={lens.tolist()}")
    return lens


def seq_ids_from_lens(seq_lens: Tensor | Sequence[int], device: torch.device | None = None) -> Tensor:
    """Each token's sequence index: [3, 2] -> [0, 0, 0, 1, 1]. [B] -> [N] int64."""
    lens = _lens_tensor(seq_lens, device)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)


def position_ids_from_lens(seq_lens: Tensor | Sequence[int], device: torch.device | None = None) -> Tensor:
    """Positions restarting at 0 for every sequence: [3, 2] -> [0, 1, 2, 0, 1]. [B] -> [N] int64."""
    lens = _lens_tensor(seq_lens, device)
    starts = torch.cumsum(lens, 0) - lens  # [B] offset of each sequence
    total = int(lens.sum())
    return torch.arange(total, device=lens.device) - torch.repeat_interleave(starts, lens)


def broadcast_to_tokens(values: Tensor, seq_lens: Tensor | Sequence[int]) -> Tensor:
    """Repeat one value per sequence onto its tokens (e.g. advantages). [B] -> [N]."""
    lens = _lens_tensor(seq_lens, values.device)
    if values.shape != lens.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != seq_lens shape {tuple(lens.shape)}")
    return torch.repeat_interleave(values, lens)


def block_causal_mask(seq_lens: Tensor | Sequence[int], device: torch.device | None = None) -> Tensor:
    """Boolean [1, 1, N, N] mask, True where query i may attend key j: same sequence and j <= i."""
    ids = seq_ids_from_lens(seq_lens, device)  # [N]
    n = ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    return (causal & (ids[:, None] == ids[None, :]))[None, None]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live (CPU for a model without any)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _transformers_detects_packing() -> bool:
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def _explicit_attention_mask(model: torch.nn.Module, seq_lens: Tensor, device: torch.device) -> Tensor:
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    allowed = block_causal_mask(seq_lens, device)  # [1, 1, N, N] bool
    if sdpa_like(impl):
        return allowed
    if impl == "eager":  # eager attention adds the mask to the scores
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(
        f"explicit packed masks support attn_implementation 'sdpa' or 'eager', not {impl!r}; "
        "flash/flex attention take packing from position_ids (explicit_mask=False)"
    )


def packed_forward_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    seq_lens: Tensor | Sequence[int],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    explicit_mask: bool | None = None,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Forward one packed micro-batch and return per-token logp [N] (fp32) and entropy [N] (fp32) or None.

    `input_ids` [N] is the concatenation of sequences of lengths `seq_lens` [B] (sum == N), no padding. Gradient
    flows to the model when grad mode is on (`entropy_grad=False`: through logp only, see `logprobs_from_logits`).
    `explicit_mask`: None = rely on transformers' position_ids packing
    detection when available, True = pass a block-diagonal mask built here (sdpa/eager only; N x N memory).
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a flat [N] tensor, got shape {tuple(input_ids.shape)}")
    device = model_device(model)
    ids = input_ids.to(device=device, dtype=torch.long)  # [N]
    lens = _lens_tensor(seq_lens, device)
    n = ids.numel()
    if int(lens.sum()) != n:
        raise ValueError(f"sum(seq_lens)={int(lens.sum())} != len(input_ids)={n}")
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, (empty.clone() if compute_entropy else None)
    if explicit_mask is None:
        explicit_mask = not _transformers_detects_packing()
    pos = position_ids_from_lens(lens)  # [N]
    kwargs: dict = {"input_ids": ids[None], "position_ids": pos[None], "use_cache": False}
    if explicit_mask:
        kwargs["attention_mask"] = _explicit_attention_mask(model, lens, device)
    out, head = forward_features(model, **kwargs)
    feats = out.logits[0]  # [N, H] (hidden states; [N, V] logits for a model without a plain head)
    # Row t predicts token t + 1; rows that would predict the next sequence's first token are zeroed below.
    lp, ent = token_logprobs(
        feats[:-1],
        ids[1:],
        head,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
    )  # [N - 1]
    is_first = pos == 0  # [N]
    zero = lp.new_zeros(1)
    logp = torch.where(is_first, 0.0, torch.cat([zero, lp]))
    entropy = torch.where(is_first, 0.0, torch.cat([zero, ent])) if ent is not None else None
    return logp, entropy


def needs_dense_packing_mask(model: torch.nn.Module) -> bool:
    """True when packed sequences would need a dense [N, N] block mask with this model's attention (sdpa, eager):
    then `rows_forward_logprobs` is the cheaper exact layout. False for varlen kernels (flash attention)."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    return sdpa_like(impl) or impl == "eager"


def rows_forward_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    seq_lens: Tensor | Sequence[int],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pad_id: int = 0,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Same inputs and outputs as `packed_forward_logprobs` (flat [N] in concatenation order), computed as one
    right-padded [B, L] batch with no attention mask: exact, because causal attention never lets a real token see
    the padding after it (see the module docstring). L is the longest of `seq_lens`, so group sequences of similar
    length to keep the padding small. Gradient flows to the model when grad mode is on (`entropy_grad=False`:
    through logp only).
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a flat [N] tensor, got shape {tuple(input_ids.shape)}")
    device = model_device(model)
    ids = input_ids.to(device=device, dtype=torch.long)  # [N]
    lens_list = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, Tensor) else seq_lens)]
    lens = _lens_tensor(lens_list, device)  # [B]
    n = ids.numel()
    if sum(lens_list) != n:
        raise ValueError(f"sum(seq_lens)={sum(lens_list)} != len(input_ids)={n}")
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, (empty.clone() if compute_entropy else None)
    b, width = len(lens_list), max(lens_list)
    valid = torch.arange(width, device=device)[None, :] < lens[:, None]  # [B, L]
    rows = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    rows[valid] = ids  # row-major order of the valid slots == concatenation order
    # No attention_mask and default positions: transformers gives sdpa is_causal=True (flash kernel, no mask).
    out, head = forward_features(model, input_ids=rows, use_cache=False)
    feats = out.logits  # [B, L, H] ([B, L, V] without a plain head)
    # Every slot predicts the slot after it in its row (the last column predicts padding); the flat view needs no
    # copy, and the few padding rows cost their head and log-softmax only.
    targets = torch.cat([rows[:, 1:], rows.new_full((b, 1), pad_id)], dim=1)  # [B, L]
    lp, ent = token_logprobs(
        feats.reshape(b * width, feats.shape[-1]),
        targets.reshape(-1),
        head,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
    )  # [B * L]

    def to_flat(x: Tensor) -> Tensor:  # slot t's value belongs to token t + 1; 0 at each first token
        shifted = torch.cat([x.new_zeros(b, 1), x.reshape(b, width)[:, :-1]], dim=1)  # [B, L]
        return shifted[valid]  # [N]

    return to_flat(lp), (to_flat(ent) if ent is not None else None)


def pad_forward_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | Tensor],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pad_id: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """The padded-batch way, for comparison: right-pad to the longest, one [B, L] forward with an attention mask.

    Same outputs as `packed_forward_logprobs` on the concatenation: flat logp [N] and entropy [N] | None. Like a
    padded trainer, it pays for the log-softmax of the padding positions too.
    """
    device = model_device(model)
    rows = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not rows:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, (empty.clone() if compute_entropy else None)
    lens = _lens_tensor([r.numel() for r in rows])
    b, width = len(rows), int(lens.max())
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
    ids = ids.to(device)  # [B, L]
    valid = torch.arange(width)[None, :] < lens[:, None]  # [B, L]
    valid = valid.to(device)
    pos = torch.arange(width, device=device).expand(b, width)
    logits = model(input_ids=ids, attention_mask=valid.long(), position_ids=pos, use_cache=False).logits  # [B, L, V]
    vocab = logits.shape[-1]
    lp, ent = logprobs_from_logits(
        logits[:, :-1].reshape(-1, vocab),
        ids[:, 1:].reshape(-1),
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
    )  # [B * (L - 1)]

    def unpad(x: Tensor) -> Tensor:
        full = torch.cat([x.new_zeros(b, 1), x.reshape(b, width - 1)], dim=1)  # [B, L], 0 at position 0
        return full[valid]  # [N] row-major == concatenation order

    return unpad(lp), (unpad(ent) if ent is not None else None)
