"""Dynamic micro-batching and data-parallel balancing: which sequences go together, decided on lengths alone.

RL batches have very uneven lengths (a few long chains of thought among many short answers). Padding every
micro-batch to its longest member wastes most of the compute, so sequences are packed end to end under a token
budget instead (no padding; `train/logprobs.py` keeps attention inside each sequence), and the budget is shared
evenly across data-parallel ranks.

Two layouts, two packers. `pack_micro_batches` fills rows end to end (flash-attention models: every token is real).
`pack_sorted_micro_batches` is for one-sequence-per-row padded batches (`train/logprobs.py`'s
`rows_forward_logprobs`, the exact and cheap layout where packing would need a dense attention mask): it cuts the
length-sorted sequences into runs, so the members of a micro-batch have similar lengths and padding stays small,
and it counts the padded slots (members x longest) against the budget.

Torch-free on purpose (plain lists): the controller calls `balance_across_ranks` and must not import torch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = ["pack_micro_batches", "pack_sorted_micro_batches", "padded_slots", "balance_across_ranks",
           "split_minibatches"]


def _check_lengths(lengths: Sequence[int], what: str) -> None:
    for i, n in enumerate(lengths):
        try:
            n = operator.index(n)  # ints and numpy integers; floats and strings are refused
        except TypeError:
            raise TypeError(f"{what}[{i}] must be an int, got {type(n).__name__}") from None
        if n < 0:
            raise ValueError(f"{what}[{i}] must be >= 0, got {n}")


def pack_micro_batches(seq_lens: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens` tokens each.

    AReaL's rule: visit sequences longest first; open a new micro-batch while fewer than `min_micro_batches` exist
    or when the sequence fits in none of the open ones; otherwise add it to the fitting micro-batch holding the
    fewest sequences (ties: the lighter one, then the older one). Longest-first keeps the big items from being
    left without a home at the end; "fewest sequences" spreads the short ones so micro-batches stay similar.

    A sequence longer than `max_tokens` is never dropped: it gets a micro-batch of its own (it can only be run
    whole), which nothing else joins. `min_micro_batches` is a floor only where there are that many sequences
    (data-parallel ranks must agree on a count; a rank with fewer sequences has to pad with empty steps itself).

    Returns a list of micro-batches, each a list of indices into `seq_lens` in ascending order; the micro-batches
    are in the order they were opened (the first holds the longest sequence). Every index appears exactly once.
    """
    order = _longest_first(seq_lens, max_tokens, min_micro_batches)
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = int(seq_lens[i])
        best = -1
        if len(batches) >= min_micro_batches:
            for b, load in enumerate(loads):
                if load + n > max_tokens:
                    continue
                if best < 0 or (len(batches[b]), load) < (len(batches[best]), loads[best]):
                    best = b
        if best < 0:
            batches.append([i])
            loads.append(n)
        else:
            batches[best].append(i)
            loads[best] += n
    return [sorted(b) for b in batches]


def _longest_first(seq_lens: Sequence[int], max_tokens: int, min_micro_batches: int) -> list[int]:
    """Validate the packers' arguments; sequence indices longest first (ties: lower index first)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be >= 1, got {min_micro_batches}")
    _check_lengths(seq_lens, "seq_lens")
    return sorted(range(len(seq_lens)), key=lambda i: (-int(seq_lens[i]), i))


def padded_slots(seq_lens: Sequence[int], micro_batch: Sequence[int]) -> int:
    """Token slots of `micro_batch` laid out one sequence per row: members x the longest member."""
    return len(micro_batch) * max((int(seq_lens[i]) for i in micro_batch), default=0)


def pack_sorted_micro_batches(seq_lens: Sequence[int], max_tokens: int,
                              min_micro_batches: int = 1) -> list[list[int]]:
    """Group sequence indices into padded micro-batches of similar lengths, each at most `max_tokens` slots.

    Visit sequences longest first (ties: lower index first) and cut the run whenever one more member would take
    the padded size (members x the run's first, longest length) over `max_tokens`. A sequence longer than the
    budget runs alone. Then, while there are fewer than `min_micro_batches` runs and some run has two or more
    members, the run with the most padded slots (ties: the earlier) is halved, the longer half first: data-parallel
    ranks must agree on a count, as for `pack_micro_batches`.

    Returns micro-batches in longest-first order, each a list of indices in ascending order; every index appears
    exactly once.
    """
    order = _longest_first(seq_lens, max_tokens, min_micro_batches)
    runs: list[list[int]] = []
    for i in order:
        if runs and (len(runs[-1]) + 1) * int(seq_lens[runs[-1][0]]) <= max_tokens:
            runs[-1].append(i)
        else:
            runs.append([i])
    while len(runs) < min_micro_batches:
        splittable = [k for k, r in enumerate(runs) if len(r) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda j: (padded_slots(seq_lens, runs[j]), -j))
        half = (len(runs[k]) + 1) // 2
        runs[k:k + 1] = [runs[k][:half], runs[k][half:]]
    return [sorted(r) for r in runs]


def balance_across_ranks(group_token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign prompt groups (never split, so group advantages stay local) to data-parallel ranks by tokens.

    Greedy longest-processing-time: the heaviest group first, each onto the rank with the fewest tokens so far
    (ties: fewer groups, then lower rank). With at least `world_size` groups every rank gets one, since an empty
    rank always wins the tie. Returns, per rank, the ascending indices of its groups; a rank may be empty only when
    there are fewer groups than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_lengths(group_token_counts, "group_token_counts")
    order = sorted(range(len(group_token_counts)), key=lambda g: (-int(group_token_counts[g]), g))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for g in order:
        r = min(range(world_size), key=lambda k: (loads[k], len(ranks[k]), k))
        ranks[r].append(g)
        loads[r] += int(group_token_counts[g])
    return [sorted(r) for r in ranks]


def split_minibatches(n_items: int, k: int) -> list[list[int]]:
    """Split `range(n_items)` into exactly `k` contiguous runs whose sizes differ by at most one (longer first).

    Exactly `k` lists even when `n_items < k` (the tail ones are then empty): data-parallel ranks must take the
    same number of optimizer steps, so the count may not depend on a rank's share of the data.
    """
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    base, extra = divmod(n_items, k)
    out: list[list[int]] = []
    start = 0
    for j in range(k):
        size = base + (1 if j < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
