"""Run metrics: one JSON line per event in metrics.jsonl, TensorBoard scalars, and a PNG of reward and held-out
accuracy against wall time. No torch: TensorBoard events are written with the tensorboard package's own writer."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from areal_async.atomic_write import write_lines_atomic


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard: bool = True) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from tensorboard.summary.writer.event_file_writer import EventFileWriter

                self._tb = EventFileWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:  # the [tensorboard] extra; a run never dies for want of it
                self._tb = None

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """Append one record; numeric values also go to TensorBoard as `<kind>/<key>`."""
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            vals = [
                Summary.Value(tag=f"{kind}/{k}", simple_value=float(v))
                for k, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            if vals:
                self._tb.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=vals)))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cut_back(path: str, version: int, keep_kinds: tuple[str, ...] = ("recovery",)) -> None:
    """Keep only the records of steps <= `version` (a resume from a checkpoint at that version: the records a killed
    run wrote after it would otherwise appear twice), and every record of `keep_kinds` (what happened to the run
    stays true after it goes back). A torn last line is dropped. Atomic and durable (atomic_write.py)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if rec.get("step", 0) <= version or rec.get("kind") in keep_kinds:
                kept.append(json.dumps(rec) + "\n")
    write_lines_atomic(path, kept)


def keep_aside(path: str) -> str | None:
    """A fresh run in a used directory: rename an older run's file to `<name>.before-<time><ext>` so the new
    records never follow the old ones. Returns the new name, or None when there was nothing to keep."""
    if not os.path.exists(path):
        return None
    stem, ext = os.path.splitext(path)
    kept = f"{stem}.before-{time.strftime('%Y%m%d-%H%M%S')}{ext}"
    os.replace(path, kept)
    return kept


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Reward (train) and held-out accuracy against wall time, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    if train:
        ax1.plot(
            [r["wall_s"] for r in train],
            [r["reward_mean"] for r in train],
            color="tab:blue",
            alpha=0.7,
            label="train reward (mean)",
        )
    ax1.set_xlabel("wall time (s)")
    ax1.set_ylabel("train reward", color="tab:blue")
    ax2 = ax1.twinx()
    if evals:
        ax2.plot(
            [r["wall_s"] for r in evals],
            [100 * r["accuracy"] for r in evals],
            "o-",
            color="tab:red",
            label="held-out greedy accuracy",
        )
    ax2.set_ylabel("held-out accuracy (%)", color="tab:red")
    ax2.set_ylim(0, 100)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "progress.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
