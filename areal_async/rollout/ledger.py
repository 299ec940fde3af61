"""Where every drawn sample stands, and `trained_index.jsonl`: the run's record that none is lost or trained twice.

Each draw from the SampleStream (its draw index: 0, 1, 2, ... in draw order, across epochs; see samples.py) is, at
any moment, exactly one of: outstanding (generating, or finished and waiting in the buffer), trained, or dropped
(with a reason: the workflow raised or returned nothing, a generation was aborted, the group had no trainable token,
its rewards were all equal under filtering). The file gets one line per train step and one at a normal stop:

    {"version": 3, "trained": [17, 4, 21, 9], "dropped": [{"index": 12, "why": "aborted"}]}
    ...
    {"end": true, "dropped": [...], "unfinished": [30, 31]}

`version` is the policy version the step produced (as in metrics.jsonl), `trained` the draw indices of the groups it
trained, `dropped` the draws dropped since the line before, `unfinished` what was still outstanding when the run
stopped. Invariant over a finished file: every index from 0 to the largest one in it appears exactly once.

Across a resume: a checkpoint at version v records the next fresh draw index and `pending()`, the draws that no line
up to v resolves (the outstanding ones, and drops not yet written). The resumed run cuts the file back to its lines
with version <= v (`truncate`), draws the pending indices again (same index, same sample) before any fresh one, and
goes on appending. Lines that a killed run wrote after its last checkpoint are cut with the rest of its state, so the
invariant holds over the final file however often the run was killed and resumed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import IO, Any

from areal_async.atomic_write import write_lines_atomic

FILE_NAME = "trained_index.jsonl"


class SampleLedger:
    """Bookkeeping of draws; with `path`, the file above too (appended, one flushed line per event)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._outstanding: set[int] = set()
        self._unlogged_drops: list[tuple[int, str]] = []
        self.drop_counts: Counter[str] = Counter()  # reason class -> drops over this process's lifetime
        self._file: IO[str] | None = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1)

    # ---- events -------------------------------------------------------------------------------------------------

    def drawn(self, index: int) -> None:
        if index in self._outstanding:
            raise ValueError(f"draw {index} is already outstanding")
        self._outstanding.add(index)

    def dropped(self, index: int, why: str) -> None:
        """The draw will never be trained (`why` starts with its reason class: "aborted", "failed: ...")."""
        self._resolve(index)
        self._unlogged_drops.append((index, why))
        self.drop_counts[why.split(":", 1)[0]] += 1

    def trained(self, version: int, indices: list[int]) -> None:
        """One train step made `version` from these draws: write its line."""
        for i in indices:
            self._resolve(i)
        self._write({"version": version, "trained": list(indices), "dropped": self._take_drops()})

    def close(self, *, finished: bool, undrawn: list[int] | None = None) -> None:
        """At a normal stop (`finished`) write the end line naming what is still outstanding, and `undrawn`: draws a
        resume queued to hand out again that were not reached; then close the file."""
        if finished:
            unfinished = sorted(self._outstanding | set(undrawn or []))
            self._write({"end": True, "dropped": self._take_drops(), "unfinished": unfinished})
        if self._file is not None:
            self._file.close()
            self._file = None

    # ---- state --------------------------------------------------------------------------------------------------

    @property
    def outstanding(self) -> list[int]:
        return sorted(self._outstanding)

    def pending(self) -> list[int]:
        """What a resume from a checkpoint taken now must draw again: nothing written so far resolves these."""
        return sorted(self._outstanding | {i for i, _ in self._unlogged_drops})

    def _resolve(self, index: int) -> None:
        try:
            self._outstanding.remove(index)
        except KeyError:
            raise ValueError(f"draw {index} is not outstanding (resolved twice, or never drawn)") from None

    def _take_drops(self) -> list[dict[str, Any]]:
        drops, self._unlogged_drops = self._unlogged_drops, []
        return [{"index": i, "why": why} for i, why in drops]

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")


def truncate(path: str, version: int) -> int:
    """Cut `path` back to its train lines with version <= `version` (what a checkpoint at that version has seen);
    an end line, later lines and a torn last line go. Atomic and durable (atomic_write.py). Returns lines kept."""
    if not os.path.exists(path):
        return 0
    kept: list[str] = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line torn by a crash: nothing after it can be trusted
            if rec.get("end") or rec.get("version", version + 1) > version:
                break
            kept.append(json.dumps(rec) + "\n")
    write_lines_atomic(path, kept)
    return len(kept)


def read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_invariant(records: list[dict[str, Any]]) -> None:
    """Raise AssertionError unless every index 0..max appears exactly once in trained, dropped or unfinished."""
    seen: Counter[int] = Counter()
    for rec in records:
        seen.update(rec.get("trained", []))
        seen.update(d["index"] for d in rec.get("dropped", []))
        seen.update(rec.get("unfinished", []))
    twice = sorted(i for i, c in seen.items() if c > 1)
    top = max(seen, default=-1)
    missing = sorted(set(range(top + 1)) - set(seen))
    if twice or missing:
        raise AssertionError(f"trained_index: appear more than once {twice[:10]}, missing {missing[:10]} (of 0..{top})")
