"""One engine step's input as the model reads it: every scheduled request's new tokens in one flat batch, where
their keys and values are written in the paged cache, and how they attend (`AttnGroup`s).

Apart from model.py because it is the scheduler's side of the contract: built on the host from page tables and
token lists, with no weights involved (model.py re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttnGroup", "SeqChunk", "StepBatch", "build_step_batch"]


@dataclass
class AttnGroup:
    """Requests that share one attention call. Their new tokens are `flat[start:end]`, request-major.

    Two kinds: a *paged decode* group (one new token per request, read straight from the pages by the CPU kernel:
    `table` and `lens`, no padding) and a *padded* group (gathered pages and an additive mask, for prefill chunks
    and wherever the kernel is not used)."""

    start: int
    end: int
    q_len: int  # padded number of new tokens per request (1 for decode)
    batch: int
    page_idx: torch.Tensor | None = None  # [B * P] long: every request's pages in order, padded with page 0
    bias: torch.Tensor | None = None  # [B, 1, q_len, P * page_size] additive mask: 0 where key j is visible, else -inf
    q_index: torch.Tensor | None = None  # [B * q_len] long: flat index of each padded query (q_len > 1)
    valid: torch.Tensor | None = None  # [B * q_len] bool: which padded queries are real (q_len > 1)
    table: torch.Tensor | None = None  # [B, P] long: pages of each request (paged decode)
    lens: torch.Tensor | None = None  # [B] long: keys each request attends to (paged decode)


@dataclass
class StepBatch:
    """One forward pass: flat tokens, where their keys/values go, how they attend, which rows need logits."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    write_slots: torch.Tensor  # [N] long: page * page_size + offset, where each token's k/v is stored
    groups: list[AttnGroup]
    logits_idx: torch.Tensor  # [M] long: flat rows whose next-token logits are wanted
    num_tokens: int = 0


# One request's part of a step: (new tokens, position of the first, its pages, its row in the page table).
SeqChunk = tuple[list[int], int, list[int], int]


def build_step_batch(
    seqs: list[SeqChunk],
    page_table: torch.Tensor,
    page_size: int,
    device: torch.device,
    logits_rows: list[list[int]],
    dtype: torch.dtype = torch.float32,
    paged_decode: bool = False,
) -> StepBatch:
    """Build the tensors of one step on the host and move them once.

    `page_table` [rows, max_pages] (host, long) holds each request's pages. `logits_rows[b]` lists offsets into
    `seqs[b]`'s new tokens whose next-token logits are wanted. Requests with one new token form the decode group
    (one paged group with `paged_decode`, else padded groups bucketed by length); the rest form a prefill group,
    padded to its longest chunk. Host work is kept to a few list passes and one tensor per kind of data: at small
    batch sizes a step's cost is mostly fixed overhead.
    """
    if paged_decode and _only_decode_rows(seqs, logits_rows):
        return _paged_decode_batch(seqs, page_table, page_size, device)
    decode_rows = [b for b, s in enumerate(seqs) if len(s[0]) == 1]
    if paged_decode:
        decode_groups = [decode_rows] if decode_rows else []
    else:
        decode_groups = _length_buckets(decode_rows, [s[1] for s in seqs])
    decode = [b for g in decode_groups for b in g]
    prefill = [b for b, s in enumerate(seqs) if len(s[0]) > 1]
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    flat_start = [0] * len(seqs)
    for b in decode:
        toks, start, pages, _ = seqs[b]
        flat_start[b] = len(ids)
        ids.append(toks[0])
        pos.append(start)
        slots.append(pages[start // page_size] * page_size + start % page_size)
    for b in prefill:
        toks, start, pages, _ = seqs[b]
        flat_start[b] = len(ids)
        ids.extend(toks)
        end = start + len(toks)
        pos.extend(range(start, end))
        p = start
        while p < end:  # page by page: a run of consecutive slots
            page, off = divmod(p, page_size)
            run = min(end - p, page_size - off)
            base = pages[page] * page_size + off
            slots.extend(range(base, base + run))
            p += run
    flat = torch.tensor([ids, pos, slots], dtype=torch.long).to(device)  # [3, N]
    logits_idx = [flat_start[b] + r for b in range(len(seqs)) for r in logits_rows[b]]
    groups = []
    for gi, members in enumerate([*decode_groups, prefill]):
        if not members:
            continue
        q_lens = [len(seqs[b][0]) for b in members]
        starts = [seqs[b][1] for b in members]
        kv_lens = [st + q for st, q in zip(starts, q_lens)]
        q_len = max(q_lens)
        n_pages = -(-max(kv_lens) // page_size)
        meta = torch.tensor([[seqs[b][3] for b in members], kv_lens, starts])  # [3, B]: table rows, kv lens, starts
        table = page_table.index_select(0, meta[0])[:, :n_pages]  # [B, P]
        g = AttnGroup(
            start=flat_start[members[0]], end=flat_start[members[-1]] + q_lens[-1], q_len=q_len, batch=len(members)
        )
        if paged_decode and gi < len(decode_groups):
            g.table, g.lens = table.to(device), meta[1].to(device)
            groups.append(g)
            continue
        key_pos = torch.arange(n_pages * page_size)  # [S]
        if q_len == 1:
            hidden = (key_pos[None, :] >= meta[1][:, None])[:, None, None, :]  # [B, 1, 1, S]
        else:
            q_pos = meta[2][:, None] + torch.arange(q_len)[None, :]  # [B, Q]
            # causal; a padded query (i >= its q_len) sees exactly the request's keys, so no row is all -inf
            hidden = (key_pos[None, None, :] > q_pos[:, :, None]) | (key_pos[None, None, :] >= meta[1][:, None, None])
            hidden = hidden[:, None]  # [B, 1, Q, S]
        g.bias = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf")).to(device)
        g.page_idx = table.reshape(-1).to(device)
        if q_len > 1:
            q_lens_t = torch.tensor(q_lens)
            offs = torch.arange(q_len)[None, :]
            firsts = torch.tensor([flat_start[b] for b in members])
            g.q_index = (firsts[:, None] + torch.minimum(offs, q_lens_t[:, None] - 1)).reshape(-1).to(device)
            g.valid = (offs < q_lens_t[:, None]).reshape(-1).to(device)
        groups.append(g)
    return StepBatch(
        input_ids=flat[0],
        positions=flat[1],
        write_slots=flat[2],
        groups=groups,
        logits_idx=torch.tensor(logits_idx, dtype=torch.long).to(device),
        num_tokens=len(ids),
    )


def _only_decode_rows(seqs: list[SeqChunk], logits_rows: list[list[int]]) -> bool:
    """Every request has one new token and wants its logits (a pure decode step)."""
    return bool(seqs) and all(len(s[0]) == 1 and r == [0] for s, r in zip(seqs, logits_rows))


def _paged_decode_batch(
    seqs: list[SeqChunk], page_table: torch.Tensor, page_size: int, device: torch.device
) -> StepBatch:
    """`build_step_batch` for a step of one new token per request, every one wanting its logits, read from the pages
    by the kernel: the same tensors from one host tensor and a handful of torch calls. Why apart: at batch 1 the
    general path's ~13 torch calls took ~0.19 ms of a ~8 ms step, run cold after the weights streamed through the
    caches."""
    b = len(seqs)
    rows: list[int] = []
    for toks, start, pages, row in seqs:
        rows += (toks[0], start, pages[start // page_size] * page_size + start % page_size, row, start + 1)
    host = torch.tensor(rows, dtype=torch.long).view(b, 5).t()  # [5, B]: ids, positions, slots, table rows, lens
    n_pages = -(-max(s[1] + 1 for s in seqs) // page_size)
    table = page_table.index_select(0, host[3])[:, :n_pages]  # [B, P]
    if device.type != "cpu":
        host, table = host.to(device), table.to(device)
    ids, pos, slots, _, lens = host.contiguous().unbind(0)
    group = AttnGroup(start=0, end=b, q_len=1, batch=b, table=table, lens=lens)
    return StepBatch(
        input_ids=ids,
        positions=pos,
        write_slots=slots,
        groups=[group],
        logits_idx=torch.arange(b, device=device),
        num_tokens=b,
    )


# Decode rows are bucketed by length only when there are enough of them for the padding saved to pay for the
# extra attention calls (each costs a few fixed-overhead ops per layer).
MIN_ROWS_TO_BUCKET = 16


def _length_buckets(rows: list[int], lengths: list[int]) -> list[list[int]]:
    """Split decode rows into attention groups by cache length: a group's keys are padded to its longest row, so
    one long request in a batch of short ones would make every row gather and attend over its length. Rows are
    sorted longest first and a new group opens when a row is shorter than half the group's longest."""
    if len(rows) < MIN_ROWS_TO_BUCKET:
        return [rows] if rows else []
    rows = sorted(rows, key=lambda b: -lengths[b])
    groups: list[list[int]] = []
    for b in rows:
        if groups and 2 * (lengths[b] + 1) > lengths[groups[-1][0]] + 1:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups
