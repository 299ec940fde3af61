"""The run's state on disk: the controller state a checkpoint holds, the checkpoints themselves, and rewinding a
run directory to one of them (a resume, or a rollback after the trainer job failed).

    run_dir/checkpoints/v<k>/trainer/          the trainer's own checkpoint (written by the trainer ranks)
    run_dir/checkpoints/v<k>/controller.json   `RunState` at version k (written after the trainer part)
    run_dir/checkpoints/latest.json            a copy of the newest complete controller.json: what a resume loads

Every file is written to a temporary name and renamed, so a kill at any moment leaves the previous checkpoint
whole. What a failure rolls back and what it keeps: docs/recovery.md. No torch here.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field, fields

from areal_async.atomic_write import write_json_atomic
from areal_async.metrics import cut_back
from areal_async.rollout.ledger import FILE_NAME as LEDGER_FILE
from areal_async.rollout.ledger import truncate

__all__ = [
    "RunState",
    "discard_after",
    "load_state",
    "prune_checkpoints",
    "rewind_records",
    "rollback_target",
    "save_state",
]

LATEST = "latest.json"
CONTROLLER_FILE = "controller.json"


@dataclass
class RunState:
    """Everything a resume needs besides the trainer's own checkpoint."""

    version: int = 0
    data_position: int = 0  # the next fresh draw index
    pending: list[int] = field(default_factory=list)  # draws the checkpoint has not seen trained or dropped
    trained_samples: int = 0
    trained_groups: int = 0
    max_staleness_seen: int = 0
    wall_s: float = 0.0  # training wall time accumulated over resumed segments
    base_accuracy: float | None = None
    staleness_hist: dict[str, int] = field(default_factory=dict)


def checkpoint_dir(run_dir: str, version: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"v{version}")


def save_state(run_dir: str, state: RunState, ckpt_path: str) -> None:
    """Write the controller state next to the trainer checkpoint, then point `latest.json` at it; each file is
    written to a temporary name and renamed, so a kill at any moment leaves the previous checkpoint intact."""
    os.makedirs(ckpt_path, exist_ok=True)
    data = {**state.__dict__, "checkpoint": os.path.abspath(ckpt_path)}
    write_json_atomic(os.path.join(ckpt_path, CONTROLLER_FILE), data, indent=2)
    write_json_atomic(os.path.join(run_dir, "checkpoints", LATEST), data, indent=2)


def load_state(run_dir: str) -> tuple[RunState, str] | None:
    """The latest controller state and its checkpoint directory, or None for a fresh run."""
    latest = os.path.join(run_dir, "checkpoints", LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        data = json.load(f)
    ckpt = data.pop("checkpoint")
    known = {f.name for f in fields(RunState)}
    return RunState(**{k: v for k, v in data.items() if k in known}), ckpt


def _version_dirs(root: str) -> dict[int, str]:
    """`v<k>` subdirectories of `root` by version."""
    out: dict[int, str] = {}
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("v") and name[1:].isdigit():
                out[int(name[1:])] = os.path.join(root, name)
    return out


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints (0: all) and the one latest.json names; remove older complete
    ones and every incomplete one (a save that was killed). Call only between saves. Returns what was removed."""
    root = os.path.join(run_dir, "checkpoints")
    latest = load_state(run_dir)
    current = os.path.abspath(latest[1]) if latest else None
    dirs = _version_dirs(root)
    complete = sorted(v for v, d in dirs.items() if os.path.isfile(os.path.join(d, CONTROLLER_FILE)))
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    removed = []
    for v, d in dirs.items():
        if v in kept or os.path.abspath(d) == current:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def discard_after(run_dir: str, version: int) -> None:
    """A rollback or a resume to `version`: checkpoints and published weights of later versions belong to steps
    that will be trained again, differently; remove them so nothing can load them (or keep them from pruning)."""
    for root in (os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "weights")):
        for v, d in _version_dirs(root).items():
            if v > version:
                shutil.rmtree(d, ignore_errors=True)


def rollback_target(run_dir: str, launch_state: RunState) -> tuple[RunState, str | None]:
    """Where a run goes back to when its trainers fail: the latest complete checkpoint and its directory, or
    without one the state the run was launched with (and no directory: the trainers start from the base model)."""
    found = load_state(run_dir)
    if found is not None:
        return found
    return RunState(**{f.name: copy.deepcopy(getattr(launch_state, f.name)) for f in fields(RunState)}), None


def rewind_records(run_dir: str, version: int) -> None:
    """Bring the run's records back to a checkpoint at `version` (a resume, or a rollback after the trainers
    failed): metrics.jsonl and trained_index.jsonl lose what came after it (so the ledger invariant holds over the
    final file), and later checkpoints and published weights go. Close the files' writers first.
    (recoveries.jsonl is append-only and keeps everything.)"""
    cut_back(os.path.join(run_dir, "metrics.jsonl"), version)
    truncate(os.path.join(run_dir, LEDGER_FILE), version)
    discard_after(run_dir, version)
