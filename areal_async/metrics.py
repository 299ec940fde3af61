"""Run metrics: one JSON line per event in metrics.jsonl (the source of truth), the same records to TensorBoard and
to the run's other sinks (metrics_sinks.py: wandb, or sinks of your own named by `metrics.loggers`), and a PNG of
reward and held-out accuracy against wall time at the end. No torch: TensorBoard events are written with the
tensorboard package's own writer."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from areal_async.atomic_write import write_lines_atomic
from areal_async.metrics_sinks import SinkSet, TensorBoardSink

log = logging.getLogger("areal_async.metrics")


class MetricsLogger:
    """The writer of `run_dir/metrics.jsonl`. Every record also goes to TensorBoard (when `tensorboard` and the
    extra is installed) and to `sinks` (a writer reopened after a rollback is handed the same ones). A sink that
    fails never fails `log`; closing the writer leaves the run's sinks open (the run closes them)."""

    def __init__(self, run_dir: str, tensorboard: bool = True, sinks: SinkSet | None = None) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self._tb: TensorBoardSink | None = None
        if tensorboard:
            tb = TensorBoardSink(run_dir)
            self._tb = tb if tb.available() else None
        self._tb_failed = False
        self.sinks = sinks

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """Append one record; numeric values also go to TensorBoard as `<kind>/<key>`, and the record to the sinks."""
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        line = json.dumps(record)
        self._jsonl.write(line + "\n")
        if self._tb is not None:
            try:
                self._tb.log(record)
            except Exception as e:
                if not self._tb_failed:
                    self._tb_failed = True
                    log.warning("TensorBoard events: %s: %s (metrics.jsonl has every record)", type(e).__name__, e)
        if self.sinks is not None:
            self.sinks.log(json.loads(line))  # each sink gets what the file holds, in a copy of its own

    def close(self) -> None:
        """Close metrics.jsonl and the TensorBoard writer; again is a no-op."""
        if not self._jsonl.closed:
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
    """Reward (train) and held-out accuracy against wall time, from metrics.jsonl.

    Drawn on a figure of its own with the Agg canvas, not through pyplot: a program that embeds the run (a
    notebook) keeps its backend and its current figure, and pyplot's import is not paid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax1 = fig.add_subplot()
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
    return out
