"""An endless, resumable stream of training samples: shuffled once per epoch from a seed."""

from __future__ import annotations

import random

from areal_async.types import Sample


class SampleStream:
    """Yields samples epoch after epoch, each epoch in a fresh seeded order. `position` (samples drawn so far) is all
    the state a resume needs."""

    def __init__(self, samples: list[Sample], seed: int = 0, position: int = 0) -> None:
        if not samples:
            raise ValueError("the training dataset is empty")
        self.samples = samples
        self.seed = seed
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []
        self.seek(position)

    def seek(self, position: int) -> None:
        self.position = position
        self._load_epoch(position // len(self.samples))

    def _load_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch

    @property
    def epoch(self) -> int:
        return self.position // len(self.samples)

    def next(self) -> Sample:
        n = len(self.samples)
        self._load_epoch(self.position // n)
        sample = self.samples[self._order[self.position % n]]
        self.position += 1
        return sample
