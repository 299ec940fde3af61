"""How a micro-batch of sequences goes through the model: one object per layout, each with `pack` (which sequences
share a micro-batch under the token budget) and `forward` (per-token logprobs of those sequences). All are exact;
they differ in cost.

    PackedLayout   sequences end to end in one row (`packed_forward_logprobs`): for varlen kernels (flash
                   attention), where every token is real and no mask is built
    RowsLayout     one right-padded row per sequence, no mask (`rows_forward_logprobs`): sdpa/eager attention,
                   where packing would need a dense [N, N] block mask
    PrefixLayout   the samples of a prompt group share one pass over their common prefix
                   (train/shared_prefix.py); built per step from that step's family plan

`select_layout` decides once per engine (the model's attention and the configured layout) and `for_step` per
step: a batch whose prompts share nothing, or whose answers differ so much in length that padding them to the
longest of their family costs more than the prompts save, runs the plain layout.

Data-parallel ranks must run the same number of forwards (FSDP collectives run per forward), so `forward` of an
empty list still runs the model once on a dummy sequence and returns an empty token index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from areal_async.train.logprobs import needs_dense_packing_mask, packed_forward_logprobs, rows_forward_logprobs
from areal_async.train.packing import (
    family_slots,
    pack_family_micro_batches,
    pack_micro_batches,
    pack_sorted_micro_batches,
    padded_slots,
)
from areal_async.train.shard import Shard
from areal_async.train.shared_prefix import (
    plan_families,
    shared_prefix_forward_logprobs,
    shared_prefix_savings,
    supports_shared_prefix,
)

__all__ = ["Layout", "PackedLayout", "RowsLayout", "PrefixLayout", "LayoutChoice", "select_layout", "LayoutName"]

LayoutName = Literal["auto", "packed", "rows", "prefix"]
# The prefix layout pays per slot more than padded rows (two model calls, a masked attention, short prefix rows):
# measured on SmolLM2-135M on CPU, its slots ran ~0.8x as fast (benchmarks/README.md). So it is chosen when it
# needs at most this fraction of the plain layout's slots.
PREFIX_SLOT_RATIO = 0.8
_Result = tuple[Tensor, Tensor | None, Tensor]  # logp [n], entropy [n] | None, token index [n]


class Layout:
    """One way to lay sequences out for the model (see the module docstring)."""

    name = ""
    dummy_len = 1  # tokens of the dummy sequence an empty micro-batch runs

    def pack(self, shard: Shard, seqs: Sequence[int], budget: int, min_micro_batches: int = 1) -> list[list[int]]:
        """Micro-batches of `seqs` (shard sequence indices) under `budget` slots, at least `min_micro_batches`
        where there are that many sequences."""
        if not seqs:
            return []
        lens = [shard.seq_lens[i] for i in seqs]
        return [[seqs[j] for j in mb] for mb in self._pack(shard, seqs, lens, budget, min_micro_batches)]

    def slots(self, shard: Shard, seqs: Sequence[int], budget: int) -> int:
        """Token slots the model runs for `seqs` packed at `budget` (real tokens plus padding)."""
        return sum(self._slots(shard, mb) for mb in self.pack(shard, seqs, budget))

    def _slots(self, shard: Shard, mb: list[int]) -> int:
        return sum(shard.seq_lens[i] for i in mb)

    def forward(
        self,
        model: nn.Module,
        shard: Shard,
        seqs: Sequence[int],
        *,
        temperature: float,
        entropy: bool,
        entropy_grad: bool = True,
    ) -> _Result:
        """logp [n] and entropy [n] | None of the tokens of `seqs`, flat in the order of `seqs`, with their
        positions in the shard [n]. Gradient flows to the model when grad mode is on."""
        kw = dict(temperature=temperature, compute_entropy=entropy, entropy_grad=entropy_grad)
        index = shard.token_index(list(seqs))
        if not seqs:
            ids = torch.zeros(self.dummy_len, dtype=torch.long, device=shard.input_ids.device)
            logp, ent = self._dummy(model, ids, **kw)
        else:
            logp, ent = self._run(model, shard, list(seqs), shard.input_ids[index], **kw)
        return logp, ent, index

    def _pack(
        self, shard: Shard, seqs: Sequence[int], lens: list[int], budget: int, min_micro_batches: int
    ) -> list[list[int]]:
        raise NotImplementedError

    def _run(self, model: nn.Module, shard: Shard, seqs: list[int], ids: Tensor, **kw) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def _dummy(self, model: nn.Module, ids: Tensor, **kw) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError


class _PlainLayout(Layout):
    """A layout that is one forward function of (model, ids, seq_lens)."""

    forward_fn = staticmethod(packed_forward_logprobs)

    def _run(self, model, shard, seqs, ids, **kw):
        return self.forward_fn(model, ids, [shard.seq_lens[i] for i in seqs], **kw)

    def _dummy(self, model, ids, **kw):
        return self.forward_fn(model, ids, [len(ids)], **kw)


class PackedLayout(_PlainLayout):
    name = "packed"
    forward_fn = staticmethod(packed_forward_logprobs)

    def _pack(self, shard, seqs, lens, budget, min_micro_batches):
        return pack_micro_batches(lens, budget, min_micro_batches)


class RowsLayout(_PlainLayout):
    name = "rows"
    forward_fn = staticmethod(rows_forward_logprobs)

    def _slots(self, shard, mb):
        return padded_slots(shard.seq_lens, mb)

    def _pack(self, shard, seqs, lens, budget, min_micro_batches):
        return pack_sorted_micro_batches(lens, budget, min_micro_batches)


class PrefixLayout(Layout):
    """Shared prompts run once; `family` / `prefix_lens` [B] are this step's plan for the shard's sequences."""

    name = "prefix"
    dummy_len = 2  # a prefix and a suffix token: the same two model calls as every real micro-batch

    def __init__(self, family: list[int], prefix_lens: list[int]) -> None:
        self.family = family
        self.prefix_lens = prefix_lens

    def _slots(self, shard, mb):
        return family_slots(shard.seq_lens, self.family, self.prefix_lens, mb)

    def _pack(self, shard, seqs, lens, budget, min_micro_batches):
        fam = [self.family[i] for i in seqs]
        pre = [self.prefix_lens[i] for i in seqs]
        return pack_family_micro_batches(lens, fam, pre, budget, min_micro_batches)

    def _run(self, model, shard, seqs, ids, **kw):
        return shared_prefix_forward_logprobs(
            model,
            ids,
            [shard.seq_lens[i] for i in seqs],
            [self.family[i] for i in seqs],
            [self.prefix_lens[i] for i in seqs],
            **kw,
        )

    def _dummy(self, model, ids, **kw):
        return shared_prefix_forward_logprobs(model, ids, [2], [0], [1], **kw)


class LayoutChoice:
    """The engine's layout decision: `fixed` (packed/rows) or shared prefixes with `plain` as the fallback."""

    def __init__(self, model: nn.Module, layout: LayoutName) -> None:
        if layout not in ("auto", "packed", "rows", "prefix"):
            raise ValueError(f"layout must be 'auto', 'packed', 'rows' or 'prefix', got {layout!r}")
        plain: Layout = RowsLayout() if needs_dense_packing_mask(model) else PackedLayout()
        self.weigh_costs = layout == "auto"  # a configured "prefix" shares whenever something is shared
        if layout == "auto":
            layout = "prefix" if supports_shared_prefix(model) else plain.name  # type: ignore[assignment]
        elif layout == "prefix" and not supports_shared_prefix(model):
            raise ValueError(
                "layout='prefix' needs sdpa/eager attention without sliding windows or activation "
                "checkpointing (train/shared_prefix.py)"
            )
        if layout == "packed":
            plain = PackedLayout()
        elif layout == "rows":
            plain = RowsLayout()
        self.name: str = layout
        self.plain = plain

    def plan(self, shard: Shard, budget: int) -> tuple[Layout | None, list[float]]:
        """This rank's candidate for the step: a PrefixLayout when shared prefixes are on and the shard has
        sequences, else None; with [tokens it saves, its padded slots, the plain layout's slots] at `budget`, to
        be summed over ranks before `for_step` decides."""
        if self.name != "prefix" or not shard.num_seqs:
            return None, [0.0, 0.0, 0.0]
        family, prefix_lens = plan_families(shard.host_ids, shard.seq_lens, shard.group_ids.tolist())
        prefix = PrefixLayout(family, prefix_lens)
        seqs = list(range(shard.num_seqs))
        return prefix, [
            float(shared_prefix_savings(family, prefix_lens)),
            float(prefix.slots(shard, seqs, budget)),
            float(self.plain.slots(shard, seqs, budget)),
        ]

    def for_step(self, candidate: Layout | None, costs: list[float]) -> Layout:
        """Shared prefixes when some rank saves tokens and (for layout "auto"), over all ranks, their padded slots
        are at most `PREFIX_SLOT_RATIO` of the plain layout's. Every rank must run the same layout: the prefix
        layout makes two model calls per micro-batch, the others one."""
        saved, prefix_slots, plain_slots = costs
        pays = not self.weigh_costs or prefix_slots <= PREFIX_SLOT_RATIO * plain_slots
        if self.name == "prefix" and saved > 0 and pays:
            return candidate if candidate is not None else PrefixLayout([], [])
        return self.plain


def select_layout(model: nn.Module, layout: LayoutName) -> LayoutChoice:
    """The engine's layout for `model` (see the module docstring); raises ValueError for an impossible choice."""
    return LayoutChoice(model, layout)
