"""Training on groups that share a prompt: each prompt goes through the model once, not once per sample.

GRPO-style RL samples G answers per prompt, so a batch holds every prompt G times (8 in the default config, ~40% of
the tokens of the default task). The forward of a token depends only on the tokens before it, so the prompt's hidden
states, and its keys and values in every layer, are the same for all G samples. This layout computes them once:

    pass 1: the family's prefix (the group's common prompt) as one row      -> logits, per-layer keys/values
    pass 2: the G suffixes (the answers) as right-padded rows, attending to
            the prefix keys/values (selected per row) and causally to themselves -> logits

Gradients are exact, not approximated: the shared prefix activations feed every member's loss, so autograd sums the
members' gradients into them, exactly what G separate copies would have accumulated. Pass 2 needs an explicit mask
(a row sees its family's real prefix keys, then its own suffix causally); it is [S, 1, R, P + R] booleans, small next
to the model, and the attention it guards is short rows over short prefixes.

Planning is torch-free (`plan_families`): a family is the sequences of one prompt group whose longest common prefix
is at least one token, cut so that every member keeps at least one token of its own (the token at the cut is
scored from the prefix's last logits). Sequences of different groups never share, even when their prompts are equal:
groups are the unit the controller shards by, so they never straddle ranks.

Needs the model's own key/value cache (transformers' `DynamicCache`): full causal attention in every layer (no
sliding windows, whose masks this layout does not build), sdpa or eager attention, and no activation checkpointing
(transformers turns the cache off under it). `supports_shared_prefix` checks that; the engine falls back to padded
rows otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from areal_async.train.attention import sdpa_like
from areal_async.train.lm_head import DEFAULT_CHUNK_TOKENS, forward_features, token_logprobs
from areal_async.train.logprobs import model_device

__all__ = ["plan_families", "supports_shared_prefix", "shared_prefix_forward_logprobs", "shared_prefix_savings"]


def plan_families(
    input_ids: np.ndarray, seq_lens: Sequence[int], group_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Which sequences share a prefix, and how long it is. Returns (family [B], prefix_len [B]).

    `input_ids` [N] is the concatenation of the sequences. Sequences of one group form a family when they share at
    least one leading token; the prefix is their longest common prefix, capped at the shortest member's length - 1.
    Any other sequence is a family of its own with prefix_len = its length - 1 (the split of a lone sequence does
    not change its cost). Family ids are dense, numbered in order of first appearance.
    """
    lens = [int(n) for n in seq_lens]
    if len(group_ids) != len(lens):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(lens)} sequences")
    if any(n < 2 for n in lens):
        raise ValueError("every sequence needs at least 2 tokens to be split into a prefix and a suffix")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens else np.zeros(0, np.int64)
    members: dict[int, list[int]] = {}
    for b, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(b)
    family = [-1] * len(lens)
    prefix = [0] * len(lens)
    next_id = 0
    for b in range(len(lens)):
        if family[b] >= 0:
            continue
        group = members[int(group_ids[b])]
        cap = min(lens[m] for m in group) - 1
        first = input_ids[starts[group[0]] : starts[group[0]] + cap]
        p = cap
        for m in group[1:]:
            other = input_ids[starts[m] : starts[m] + p]
            diff = np.flatnonzero(first[:p] != other)
            if diff.size:
                p = int(diff[0])
            if p == 0:
                break
        if len(group) > 1 and p >= 1:
            for m in group:
                family[m], prefix[m] = next_id, p
            next_id += 1
        else:  # nothing shared: every member alone
            for m in group:
                family[m], prefix[m] = next_id, lens[m] - 1
                next_id += 1
    return family, prefix


def shared_prefix_savings(family: Sequence[int], prefix_lens: Sequence[int]) -> int:
    """Tokens the layout does not run through the model: for each family, (members - 1) x prefix length."""
    seen: set[int] = set()
    saved = 0
    for f, p in zip(family, prefix_lens):
        if f in seen:
            saved += p
        seen.add(f)
    return saved


def supports_shared_prefix(model: torch.nn.Module) -> bool:
    """True when `shared_prefix_forward_logprobs` is exact for this model (see the module docstring)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if not (sdpa_like(impl) or impl == "eager"):
        return False
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return False
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5, then 4
        if hasattr(type(model), attr):
            return not getattr(model, attr)
    return True


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 calls the cache argument `cache`; earlier versions `past_key_values`."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out: object):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def shared_prefix_forward_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    seq_lens: Sequence[int],
    family: Sequence[int],
    prefix_lens: Sequence[int],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pad_id: int = 0,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Per-token logp [N] (fp32) and entropy [N] | None of the S sequences of lengths `seq_lens` laid end to end in
    `input_ids` [N], the same outputs as `train/logprobs.py`'s `packed_forward_logprobs`, computed with each family's
    prefix run once.

    `family[s]` names sequence s's family (any hashable ints; members need not be adjacent) and `prefix_lens[s]`
    its family's shared prefix length p, 1 <= p < seq_lens[s], equal across the family. The members' first p tokens
    must be equal (checked: ValueError otherwise). Always exactly two model calls, so data-parallel ranks running
    this layout make matching FSDP collectives whatever their data.
    """
    lay = _family_layout(input_ids, seq_lens, family, prefix_lens, model_device(model), pad_id)
    logits_p, cache = _prefix_pass(model, lay)
    logits_s, head = _suffix_pass(model, lay, cache, logits_p.dtype)
    del cache
    kw = dict(
        temperature=temperature, compute_entropy=compute_entropy, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad
    )
    parts = _next_token_logprobs(lay, logits_p, logits_s, head, pad_id, kw)
    return _gather_tokens(lay, parts, compute_entropy)


@dataclass
class _FamilyLayout:
    """The batch as pass 1 and pass 2 see it: F family prefixes [F, P] and S member suffixes [S, R], right-padded."""

    ids: Tensor  # [N] the input tokens on the model's device
    starts: Tensor  # [S] first token of each sequence in `ids`
    lens: Tensor  # [S]
    pre: Tensor  # [S] prefix length of each sequence's family
    row: Tensor  # [S] pass-1 row (family) of each sequence
    prefix_ids: Tensor  # [F, P]
    suffix_ids: Tensor  # [S, R]
    n_fam: int
    n_seq: int
    p_max: int
    r_max: int


def _family_layout(
    input_ids: Tensor,
    seq_lens: Sequence[int],
    family: Sequence[int],
    prefix_lens: Sequence[int],
    device: torch.device,
    pad_id: int,
) -> _FamilyLayout:
    """Check the arguments (ValueError naming what is wrong) and cut the token rows of both passes."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a flat [N] tensor, got shape {tuple(input_ids.shape)}")
    lens = [int(n) for n in seq_lens]
    n_seq = len(lens)
    if not (len(family) == len(prefix_lens) == n_seq) or n_seq == 0:
        raise ValueError(
            f"need one family and prefix length per sequence and at least one sequence, got "
            f"{n_seq} seq_lens, {len(family)} family ids, {len(prefix_lens)} prefix lengths"
        )
    if sum(lens) != input_ids.numel():
        raise ValueError(f"sum(seq_lens)={sum(lens)} != len(input_ids)={input_ids.numel()}")
    pre = [int(p) for p in prefix_lens]
    if any(not 1 <= p < n for p, n in zip(pre, lens)):
        raise ValueError("every prefix length must be >= 1 and shorter than its sequence")
    slot: dict[int, int] = {}  # family id -> row of pass 1
    fam_row = []
    firsts: list[int] = []
    for s, f in enumerate(family):
        if f not in slot:
            slot[f] = len(firsts)
            firsts.append(s)
        fam_row.append(slot[f])
        if pre[s] != pre[firsts[slot[f]]]:
            raise ValueError(f"family {f} has members with different prefix lengths")

    ids = input_ids.to(device=device, dtype=torch.long)  # [N]
    starts_l = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    starts = torch.as_tensor(starts_l, device=device)  # [S]
    lens_t = torch.as_tensor(lens, device=device)  # [S]
    pre_t = torch.as_tensor(pre, device=device)  # [S]
    row_t = torch.as_tensor(fam_row, device=device)  # [S]
    firsts_t = torch.as_tensor(firsts, device=device)  # [F]
    fam_pre = pre_t[firsts_t]  # [F]
    p_max, r_max = max(pre), max(n - p for n, p in zip(lens, pre))
    last = ids.numel() - 1

    def rows(first_tok: Tensor, count: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """Right-padded token rows: row i is ids[first_tok[i] : first_tok[i] + count[i]]. [K, width] x2."""
        offs = torch.arange(width, device=device)[None, :]  # [1, W]
        valid = offs < count[:, None]  # [K, W]
        toks = ids[(first_tok[:, None] + offs).clamp_(max=last)]  # [K, W]
        return toks.masked_fill(~valid, pad_id), valid

    prefix_ids, _ = rows(starts[firsts_t], fam_pre, p_max)  # [F, P]
    member_prefix, member_valid = rows(starts, pre_t, p_max)  # [S, P]
    if not torch.equal(member_prefix.masked_fill(~member_valid, pad_id), prefix_ids[row_t]):
        raise ValueError("the members of a family must share their first prefix_lens tokens")
    suffix_ids, _ = rows(starts + pre_t, lens_t - pre_t, r_max)  # [S, R]
    return _FamilyLayout(
        ids=ids,
        starts=starts,
        lens=lens_t,
        pre=pre_t,
        row=row_t,
        prefix_ids=prefix_ids,
        suffix_ids=suffix_ids,
        n_fam=len(firsts),
        n_seq=n_seq,
        p_max=p_max,
        r_max=r_max,
    )


def _prefix_pass(model: torch.nn.Module, lay: _FamilyLayout) -> tuple[Tensor, object]:
    """Pass 1: each family's prefix once; right padding needs no mask under causal attention. Returns the head's
    inputs [F, P, H] ([F, P, V] logits for a model without a plain head) and the key/value cache, reordered to one
    row per member."""
    out, _ = forward_features(model, input_ids=lay.prefix_ids, use_cache=True)
    logits_p = out.logits  # [F, P, H]
    cache = _output_cache(out)
    if cache is None:
        raise RuntimeError(f"{type(model).__name__} returned no key/value cache; use the rows layout")
    cache.reorder_cache(lay.row)  # every layer's keys/values [F, Hkv, P, D] -> [S, Hkv, P, D], differentiable
    return logits_p, cache


def _suffix_pass(
    model: torch.nn.Module, lay: _FamilyLayout, cache: object, dtype: torch.dtype
) -> tuple[Tensor, object]:
    """Pass 2: the suffixes, seeing their family's real prefix keys and themselves causally. `dtype` is the compute
    dtype (an eager mask is added to the scores in it). Returns the head's inputs [S, R, H] ([S, R, V]) and the
    head."""
    device = lay.ids.device
    p_max, r_max = lay.p_max, lay.r_max
    key_pos = torch.arange(p_max + r_max, device=device)  # [P + R]
    q_pos = torch.arange(r_max, device=device)  # [R]
    see_prefix = key_pos[None, None, :] < lay.pre[:, None, None]  # [S, 1, P + R]
    see_suffix = (key_pos[None, :] >= p_max) & (key_pos[None, :] - p_max <= q_pos[:, None])  # [R, P + R]
    allowed = (see_prefix | see_suffix[None]).unsqueeze(1)  # [S, 1, R, P + R]
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":  # eager attention adds the mask to the scores
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    else:
        mask = allowed
    positions = lay.pre[:, None] + q_pos[None, :]  # [S, R]
    out, head = forward_features(
        model,
        input_ids=lay.suffix_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{_cache_kwarg(model): cache},
    )
    return out.logits, head


def _next_token_logprobs(
    lay: _FamilyLayout, logits_p: Tensor, logits_s: Tensor, head, pad_id: int, kw: dict
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor | None, Tensor | None, Tensor | None]]:
    """Next-token logprobs (and entropies) of three kinds of rows: prefix row t -> prefix token t + 1 [F * P], the
    prefix's last row -> each member's first suffix token [S], suffix row t -> suffix token t + 1 [S * R] (the last
    column of a row predicts padding and is never read)."""
    n_fam, n_seq, p_max, r_max = lay.n_fam, lay.n_seq, lay.p_max, lay.r_max
    prefix_ids, suffix_ids = lay.prefix_ids, lay.suffix_ids
    width = logits_s.shape[-1]
    pad_col_p = prefix_ids.new_full((n_fam, 1), pad_id)
    lp_p, ent_p = token_logprobs(
        logits_p.reshape(n_fam * p_max, width), torch.cat([prefix_ids[:, 1:], pad_col_p], 1).reshape(-1), head, **kw
    )  # [F * P]
    boundary = logits_p[lay.row, lay.pre - 1]  # [S, H]
    lp_b, ent_b = token_logprobs(boundary, suffix_ids[:, 0], head, **kw)  # [S]
    pad_col_s = suffix_ids.new_full((n_seq, 1), pad_id)
    lp_s, ent_s = token_logprobs(
        logits_s.reshape(n_seq * r_max, width), torch.cat([suffix_ids[:, 1:], pad_col_s], 1).reshape(-1), head, **kw
    )  # [S * R]
    return (lp_p, lp_b, lp_s), (ent_p, ent_b, ent_s)


def _gather_tokens(
    lay: _FamilyLayout, parts: tuple[tuple[Tensor, Tensor, Tensor], tuple], compute_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Each output token's value from where it lives in cat([0, lp_p, lp_b, lp_s]); prefix slots repeat across
    members, so their gradients add up in the shared rows. Returns logp [N] and entropy [N] | None."""
    (lp_p, lp_b, lp_s), (ent_p, ent_b, ent_s) = parts
    device = lay.ids.device
    n_fam, n_seq, p_max, r_max = lay.n_fam, lay.n_seq, lay.p_max, lay.r_max
    seq_of_tok = torch.repeat_interleave(torch.arange(n_seq, device=device), lay.lens)  # [N]
    t = torch.arange(lay.ids.numel(), device=device) - lay.starts[seq_of_tok]  # [N] position in its sequence
    p_tok = lay.pre[seq_of_tok]  # [N]
    base_b, base_s = 1 + n_fam * p_max, 1 + n_fam * p_max + n_seq
    where = torch.where(
        t < p_tok,
        1 + lay.row[seq_of_tok] * p_max + (t - 1),
        torch.where(t == p_tok, base_b + seq_of_tok, base_s + seq_of_tok * r_max + (t - p_tok - 1)),
    )
    where = torch.where(t == 0, 0, where)  # [N]
    zero = lp_p.new_zeros(1)
    logp = torch.cat([zero, lp_p, lp_b, lp_s])[where]
    entropy = None
    if compute_entropy:
        assert ent_p is not None and ent_b is not None and ent_s is not None
        entropy = torch.cat([zero, ent_p, ent_b, ent_s])[where]
    return logp, entropy
