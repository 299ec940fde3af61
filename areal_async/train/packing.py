"""Dynamic micro-batching and data-parallel balancing: which sequences go together, decided on lengths alone.

RL batches have very uneven lengths (a few long chains of thought among many short answers). Padding every
micro-batch to its longest member wastes most of the compute, so sequences are packed end to end under a token
budget instead (no padding; `train/logprobs.py` keeps attention inside each sequence), and the budget is shared
evenly across data-parallel ranks.

Three layouts, three packers. `pack_micro_batches` fills rows end to end (flash-attention models: every token is real).
`pack_sorted_micro_batches` is for one-sequence-per-row padded batches (`train/logprobs.py`'s
`rows_forward_logprobs`, the exact and cheap layout where packing would need a dense attention mask): it cuts the
length-sorted sequences into runs, so the members of a micro-batch have similar lengths and padding stays small,
and it counts the padded slots (members x longest) against the budget. `pack_family_micro_batches` is for the
shared-prefix layout (`train/shared_prefix.py`): families (a prompt and its sampled answers) stay together where they
fit, and a micro-batch costs its padded prefix rows plus its padded suffix rows.

Torch-free on purpose (plain lists): the controller calls `balance_across_ranks` and must not import torch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = [
    "pack_micro_batches",
    "pack_sorted_micro_batches",
    "pack_family_micro_batches",
    "padded_slots",
    "family_slots",
    "balance_across_ranks",
    "split_minibatches",
]


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


def pack_sorted_micro_batches(seq_lens: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
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
        runs[k : k + 1] = [runs[k][:half], runs[k][half:]]
    return [sorted(r) for r in runs]


def family_slots(
    seq_lens: Sequence[int], family: Sequence[int], prefix_lens: Sequence[int], micro_batch: Sequence[int]
) -> int:
    """Token slots of `micro_batch` in the shared-prefix layout: one row per family present, padded to the longest
    prefix, plus one row per member, padded to the longest suffix."""
    if not micro_batch:
        return 0
    fams = {int(family[i]) for i in micro_batch}
    p_max = max(int(prefix_lens[i]) for i in micro_batch)
    r_max = max(int(seq_lens[i]) - int(prefix_lens[i]) for i in micro_batch)
    return len(fams) * p_max + len(micro_batch) * r_max


def _split_family(members: list[int], suffix: list[int], prefix: int) -> list[list[int]]:
    """Cut one family (members sorted longest suffix first, `suffix` their suffix lengths) into runs minimising
    sum(prefix + len(run) x longest suffix in run): a run pays its own prefix row, so a cut is worth it only where
    it saves more padding than one more prefix costs. Exact, by dynamic programming over the cut points."""
    k = len(members)
    best = [0] + [0] * k  # best[j]: cheapest cost of the first j members
    cut = [0] * (k + 1)
    for j in range(1, k + 1):
        best[j], cut[j] = min((best[i] + prefix + (j - i) * suffix[i], i) for i in range(j))
    runs: list[list[int]] = []
    j = k
    while j > 0:
        runs.append(members[cut[j] : j])
        j = cut[j]
    return runs[::-1]


def pack_family_micro_batches(
    seq_lens: Sequence[int],
    family: Sequence[int],
    prefix_lens: Sequence[int],
    max_tokens: int,
    min_micro_batches: int = 1,
) -> list[list[int]]:
    """Group sequence indices into shared-prefix micro-batches of at most `max_tokens` slots (`family_slots`).

    Each family (members longest suffix first) is first cut into runs where one more prefix row costs less than
    the padding it saves (`_split_family`: a family whose answers differ a lot in length would otherwise pad every
    row to its longest). Runs are then visited longest suffix first (ties: first appearance), so a micro-batch holds
    suffixes of similar length; a run joins the open micro-batch whole if it fits, otherwise it opens the next, and
    a run too big for any micro-batch is cut member by member (each piece runs the prefix again; a single member
    over the budget runs alone). Finally, while there are fewer than `min_micro_batches` micro-batches and one has
    two or more members, the one with the most slots (ties: the earlier) is halved in visiting order, as in
    `pack_sorted_micro_batches`.

    Returns micro-batches in visiting order, each a list of indices in ascending order; every index appears
    exactly once.
    """
    _longest_first(seq_lens, max_tokens, min_micro_batches)  # validation only
    if not len(family) == len(prefix_lens) == len(seq_lens):
        raise ValueError(
            f"family ({len(family)}) and prefix_lens ({len(prefix_lens)}) need one entry per sequence ({len(seq_lens)})"
        )
    members: dict[int, list[int]] = {}
    for i, f in enumerate(family):
        members.setdefault(int(f), []).append(i)

    def suffix(i: int) -> int:
        return int(seq_lens[i]) - int(prefix_lens[i])

    pieces: list[list[int]] = []
    for m in members.values():
        m = sorted(m, key=lambda i: (-suffix(i), i))
        pieces.extend(_split_family(m, [suffix(i) for i in m], int(prefix_lens[m[0]])))
    pieces.sort(key=lambda r: (-suffix(r[0]), min(r)))
    runs: list[list[int]] = []
    current: list[int] = []
    for piece in pieces:
        if current and family_slots(seq_lens, family, prefix_lens, current + piece) <= max_tokens:
            current.extend(piece)
            continue
        if current:
            runs.append(current)
            current = []
        for i in piece:  # whole, or member by member when the run does not fit
            if current and family_slots(seq_lens, family, prefix_lens, current + [i]) > max_tokens:
                runs.append(current)
                current = []
            current.append(i)
    if current:
        runs.append(current)
    while len(runs) < min_micro_batches:
        splittable = [k for k, r in enumerate(runs) if len(r) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda j: (family_slots(seq_lens, family, prefix_lens, runs[j]), -j))
        half = (len(runs[k]) + 1) // 2
        runs[k : k + 1] = [runs[k][:half], runs[k][half:]]
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
