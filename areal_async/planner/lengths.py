"""Where the simulated responses' lengths come from: a log-normal distribution by default, or the lengths a real
run recorded; optionally growing over training (reasoning models lengthen their answers as RL proceeds); and the
share of prompt groups the run throws away (rejected or filtered as all-equal rewards).

Why a distribution and not a mean: asynchronous RL pays off because a synchronous batch waits for its longest
answer. The tail of the length distribution, cut at the token budget, sets that wait, so the planner draws every
answer's length instead of using an average.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LengthModel:
    """Response lengths in tokens. `kind` "lognormal": median `median` and log-space sigma `sigma`; "empirical":
    drawn with replacement from `samples`. Every draw is clipped to [1, `max_new_tokens`]. `growth_per_step`:
    lengths at policy version v are scaled by (1 + growth_per_step * v) before clipping. `version_scale`: measured
    multipliers instead of (or on top of) a rate: lengths at version v are also scaled by `version_scale[v]`, and
    every version past the list by its last entry (a calibration's lengths as a short real run traced them, held at
    its last level rather than extrapolated). `prompt_tokens`: the prompt length (a constant: prompts vary far less
    than answers). `reject_rate`: the probability that a finished group is dropped (rejected, or filtered for equal
    rewards) and replaced by a fresh draw."""

    kind: str = "lognormal"
    median: float = 1000.0
    sigma: float = 1.0
    max_new_tokens: int = 8192
    prompt_tokens: int = 256
    growth_per_step: float = 0.0
    reject_rate: float = 0.0
    samples: list[int] = field(default_factory=list)
    version_scale: list[float] = field(default_factory=list)

    def validate(self) -> None:
        if self.kind not in ("lognormal", "empirical"):
            raise ValueError(f"lengths.kind must be lognormal or empirical, not {self.kind!r}")
        if self.kind == "empirical" and not self.samples:
            raise ValueError("lengths.kind=empirical needs samples (the lengths of a real run)")
        if self.median <= 0 or self.sigma < 0 or self.max_new_tokens < 1 or self.prompt_tokens < 0:
            raise ValueError("lengths: median > 0, sigma >= 0, max_new_tokens >= 1, prompt_tokens >= 0")
        if not 0.0 <= self.reject_rate < 1.0:
            raise ValueError("lengths.reject_rate must be in [0, 1)")
        if any(not (x > 0 and math.isfinite(x)) for x in self.version_scale):
            raise ValueError("lengths.version_scale: every entry must be a finite number > 0")

    def scale(self, version: int) -> float:
        """The factor lengths of `version` are scaled by (1.0: unscaled)."""
        s = 1.0 + self.growth_per_step * version
        if self.version_scale:
            s *= self.version_scale[min(version, len(self.version_scale) - 1)]
        return s

    def draw(self, rng: np.random.Generator, n: int, version: int = 0) -> list[int]:
        """`n` response lengths for a group started under policy `version`."""
        if self.kind == "empirical":
            raw = rng.choice(np.asarray(self.samples, dtype=np.float64), size=n)
        else:
            raw = self.median * np.exp(self.sigma * rng.standard_normal(n))
        raw = raw * self.scale(version)
        return [int(x) for x in np.clip(np.rint(raw), 1, self.max_new_tokens)]

    def sampler(self, rng: np.random.Generator, chunk: int = 1 << 16) -> Callable[[int, int], list[int]]:
        """A fast `draw`: unscaled lengths come from `rng` a chunk at a time (one numpy call per 65,536 answers
        instead of one per group, which is most of a draw's cost); the same distribution as `draw`. Unscaled draws
        (no growth, or version 0) are rounded and clipped by numpy once per chunk, so a group's draw is a slice:
        floor(x + 0.5) clipped to [1, cap] is exactly what the per-answer `int(x * 1.0 + 0.5)` gives for x > 0."""
        raw = np.empty(0)
        ints: list[int] = []
        pos = 0
        cap = self.max_new_tokens

        def refill() -> None:
            nonlocal raw, ints, pos
            if self.kind == "empirical":
                raw = rng.choice(np.asarray(self.samples, dtype=np.float64), size=chunk)
            else:
                raw = self.median * np.exp(self.sigma * rng.standard_normal(chunk))
            ints, pos = np.clip(np.floor(raw + 0.5), 1, cap).astype(np.int64).tolist(), 0

        def draw(n: int, version: int = 0) -> list[int]:
            nonlocal pos
            if pos + n > len(ints):
                refill()
            scale = self.scale(version)
            if scale == 1.0:
                out = ints[pos : pos + n]
            else:
                out = [min(max(int(x * scale + 0.5), 1), cap) for x in raw[pos : pos + n].tolist()]
            pos += n
            return out

        return draw

    def mean(self, version: int = 0, draws: int = 20000, seed: int = 12345) -> float:
        """The clipped mean response length at `version` (by sampling: clipping has no neat closed form for an
        empirical distribution, and one number for estimates does not need one)."""
        rng = np.random.default_rng(seed)
        return float(np.mean(self.draw(rng, draws, version)))

    def untruncated_mean(self) -> float:
        """The log-normal's mean before clipping (for docs and sanity checks)."""
        return self.median * math.exp(self.sigma**2 / 2)


def lengths_from_records(path: str) -> list[int]:
    """Response lengths from a real run: a run directory's metrics.jsonl (each train record's `response_len_mean`
    stands for its batch) or a JSON / JSONL file of integers or of objects with a `response_len` field.

    Why both: the run's own metrics keep only a mean per step, which loses the tail; a dump of per-sample lengths
    keeps it and is what `kind=empirical` is for. The mean per step is still better than guessing a median."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        text = f.read()
    out: list[int] = []
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for r in rows:
        if isinstance(r, (int, float)):
            out.append(int(r))
        elif isinstance(r, dict):
            if "response_len" in r:
                out.append(int(r["response_len"]))
            elif r.get("kind", "train") == "train" and "response_len_mean" in r:
                out.append(int(round(r["response_len_mean"])))
    if not out:
        raise ValueError(f"{path}: no response lengths found")
    return out
