"""After a run: its summary (summary.json), the progress plot and the table printed at the end. No torch here."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from areal_async.metrics import plot_run
from areal_async.rollout.controller import AsyncRLController, RunState

if TYPE_CHECKING:
    from areal_async.session.prepare import RunPlan

__all__ = ["summarize", "write_outputs", "server_busy_s", "print_summary"]


def summarize(
    plan: RunPlan,
    ctrl: AsyncRLController,
    state: RunState,
    *,
    num_servers: int,
    final_checkpoint: str | None,
    recovery: dict[str, Any] | None = None,
) -> dict[str, Any]:
    s = plan.cfg.schedule
    return {
        "mode": s.mode,
        "eta": s.effective_eta,
        "interruptible": s.interruptible,
        "interrupt_mode": ctrl.interrupt,
        "base_accuracy": state.base_accuracy,
        "final_accuracy": ctrl.evals[-1]["accuracy"] if ctrl.evals else None,
        "wall_s": state.wall_s,
        "steps": state.version,
        "trained_samples": state.trained_samples,
        "trained_samples_per_s": state.trained_samples / max(state.wall_s, 1e-9),
        "max_staleness_seen": state.max_staleness_seen,
        "staleness_hist": state.staleness_hist,
        "rollout": ctrl.rollout.stats.__dict__,
        "dropped": dict(ctrl.ledger.drop_counts),
        "timings": ctrl.timings,
        # compute seconds summed over servers during the training loop (embedded servers report it)
        "server_busy_s": ctrl.timings.get("server_busy_s"),
        "num_servers": num_servers,
        "evals": ctrl.evals,
        # eval.mode=pinned: evals done / failed / skipped (queue full), and the train loop's time on snapshots
        "pinned_evals": (
            {**ctrl.pinned_evals.counts, "snapshot_s": ctrl.pinned_evals.snapshot_s} if ctrl.pinned_evals else None
        ),
        "final_checkpoint": final_checkpoint,
        "model": plan.model_path,
        "completed": True,
        # faults and what was done about them, over every controller this run directory had (recoveries.jsonl)
        "recovery": recovery,
    }


def write_outputs(run_dir: str, summary: dict[str, Any], logger: Any) -> None:

    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    logger.close()
    plot_run(run_dir)
    print_summary(summary)


async def server_busy_s(urls: list[str], api_key: str | None) -> float | None:
    """Seconds the servers spent computing (the embedded engine reports `busy_s` in /server_info; others don't)."""
    import aiohttp

    total = 0.0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for url in urls:
                async with http.get(url + "/server_info", headers=headers) as r:
                    busy = (await r.json()).get("busy_s")
                    if busy is None:
                        return None
                    total += float(busy)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    return total


def print_summary(s: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    gain = (
        None if s["base_accuracy"] is None or s["final_accuracy"] is None else s["final_accuracy"] - s["base_accuracy"]
    )
    rows = [
        ("mode", f"{s['mode']} (eta={s['eta']}, in-flight updates: {s['interrupt_mode']})"),
        (
            "held-out accuracy",
            f"{pct(s['base_accuracy'])} -> {pct(s['final_accuracy'])}"
            + (f"  ({100 * gain:+.1f} pts)" if gain is not None else ""),
        ),
        ("train steps", str(s["steps"])),
        ("trained samples", f"{s['trained_samples']}  ({s['trained_samples_per_s']:.1f}/s)"),
        ("dropped groups", ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "none"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("max staleness seen", str(s["max_staleness_seen"])),
        ("final checkpoint", str(s["final_checkpoint"])),
    ]
    rec = s.get("recovery")
    if rec and rec.get("faults"):
        rows.insert(
            -1,
            (
                "faults recovered",
                f"{rec['recovered']} of {rec['faults']} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(rec['by_event'].items()))})",
            ),
        )
    width = max(len(k) for k, _ in rows)
    print("\n" + "=" * 60)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print("=" * 60)
