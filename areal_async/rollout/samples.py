"""An endless, resumable stream of training samples: shuffled once per epoch from a seed, each draw numbered.

The draw index (0, 1, 2, ... in the order samples are handed out, across epochs) names one draw of one sample: it is
what `trained_index.jsonl` records (rollout/ledger.py) and what a resume draws again. The sample behind an index is
a pure function of (dataset, seed, index), so a checkpoint needs only the next fresh index and the list of indices
to draw again.
"""

from __future__ import annotations

import random
from collections import deque
from typing import NamedTuple

from areal_async.types import Sample


class Draw(NamedTuple):
    index: int  # draw index: the sample's place in the stream
    sample: Sample


class SampleStream:
    """Yields samples epoch after epoch, each epoch in a fresh seeded order. `position` is the next fresh draw
    index; `redraw(indices)` queues earlier draws to be handed out again (with their own indices) before it."""

    def __init__(self, samples: list[Sample], seed: int = 0, position: int = 0) -> None:
        if not samples:
            raise ValueError("the training dataset is empty")
        self.samples = samples
        self.seed = seed
        self.position = 0
        self._orders: dict[int, list[int]] = {}  # epoch -> permutation (the current one and a redraw's, at most)
        self._redraw: deque[int] = deque()
        self.seek(position)

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError("position must be >= 0")
        self.position = position

    def redraw(self, indices: list[int]) -> None:
        """Hand these earlier draws out again, in ascending order, before any fresh one."""
        bad = [i for i in indices if not 0 <= i < self.position]
        if bad:
            raise ValueError(f"cannot redraw indices never drawn: {bad[:5]} (position {self.position})")
        self._redraw.extend(sorted(set(indices) - set(self._redraw)))

    @property
    def pending_redraws(self) -> list[int]:
        return list(self._redraw)

    @property
    def epoch(self) -> int:
        return self.position // len(self.samples)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def sample_at(self, index: int) -> Sample:
        """The sample that draw `index` hands out."""
        n = len(self.samples)
        return self.samples[self._order(index // n)[index % n]]

    def draw(self) -> Draw:
        if self._redraw:
            index = self._redraw.popleft()
        else:
            index = self.position
            self.position += 1
        return Draw(index, self.sample_at(index))

    def next(self) -> Sample:
        return self.draw().sample
