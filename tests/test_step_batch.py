"""server/step_batch.py: a pure decode step's batch, built by its own short path, equals the general path's."""

from __future__ import annotations

import random

import torch

from areal_async.server import step_batch


def test_decode_steps_short_path_equals_the_general_path(monkeypatch):
    rng = random.Random(0)
    page_size, max_pages = 16, 40
    table = torch.zeros(70, max_pages, dtype=torch.long)
    for b in (1, 2, 7, 64):
        starts = [rng.randrange(0, max_pages * page_size - 1) for _ in range(b)]
        rows = rng.sample(range(70), b)
        seqs = []
        for row, start in zip(rows, starts):
            pages = rng.sample(range(1, 5000), max_pages)
            table[row] = torch.tensor(pages)
            seqs.append(([rng.randrange(1000)], start, pages, row))
        logits = [[0]] * b
        short = step_batch.build_step_batch(seqs, table, page_size, torch.device("cpu"), logits, paged_decode=True)
        monkeypatch.setattr(step_batch, "_only_decode_rows", lambda *a: False)
        full = step_batch.build_step_batch(seqs, table, page_size, torch.device("cpu"), logits, paged_decode=True)
        monkeypatch.undo()
        for name in ("input_ids", "positions", "write_slots", "logits_idx"):
            assert torch.equal(getattr(short, name), getattr(full, name)), name
        assert short.num_tokens == full.num_tokens == b and len(short.groups) == len(full.groups) == 1
        gs, gf = short.groups[0], full.groups[0]
        assert (gs.start, gs.end, gs.q_len, gs.batch) == (gf.start, gf.end, gf.q_len, gf.batch)
        assert torch.equal(gs.table, gf.table) and torch.equal(gs.lens, gf.lens)
        assert gs.bias is None and gs.page_idx is None and gs.q_index is None and gs.valid is None
