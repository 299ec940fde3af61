"""A trainer job that shrinks to the hosts left (recovery.shrink_trainers, docs/recovery.md): when a trainer host
goes away and the run cannot start trainers there again (a Slurm node whose part of the old step Slurm keeps
listing, or an agent started by hand on another host), the cluster starts the new trainer job on the hosts it can
still use, with fewer nodes and the same `train.nproc` each, instead of the run stopping. The layouts and the Slurm
rule (`hosts_left`: the nodes less the lost ones) are here, apart from launch/slurm.py, so that they are tested
without processes; launch/local.py has a simpler rule (the agents started here are the hosts left) and uses the
same layouts; session/rollback.py records the result. No torch here.

What a smaller job changes, and why the run is still the same run: the trainer checkpoint is torch.distributed
.checkpoint (train/checkpoint.py), which reshards to any world size on load; the controller splits each batch over
however many ranks there are (train/client.py `split_by_rank`) and every rank divides its loss by the global token
count, so a step's gradient does not depend on the world size (train/engine.py, "Loss scaling").
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Shrink", "TrainerLayout", "hosts_left", "not_shrinking_why"]


@dataclass(frozen=True)
class TrainerLayout:
    """Where a trainer job runs: its nodes (hosts), in node-rank order, and the ranks on each."""

    nodes: tuple[str, ...]
    nproc: int

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc

    def describe(self) -> str:
        where = ", ".join(self.nodes)
        return f"{len(self.nodes)} node(s) x {self.nproc} rank(s) ({where}; world size {self.world_size})"

    def record(self) -> dict[str, object]:
        """For recoveries.jsonl."""
        return {"nodes": list(self.nodes), "nproc": self.nproc, "world_size": self.world_size}


@dataclass(frozen=True)
class Shrink:
    """A trainer job restarted on fewer hosts: the layout before and after, and each host left out with why."""

    before: TrainerLayout
    after: TrainerLayout
    lost: dict[str, str] = field(default_factory=dict)  # host -> why it was left out

    def describe(self) -> str:
        gone = "; ".join(f"{h}: {why}" for h, why in self.lost.items())
        return (
            f"the trainer job shrinks from {len(self.before.nodes)} to {len(self.after.nodes)} node(s) ({gone}); "
            f"it now runs on {self.after.describe()}, and does not grow back when the host returns (a rerun of the "
            f"same command resumes on every train.nnodes node)"
        )


def hosts_left(nodes: list[str], lost: dict[str, str], *, enabled: bool) -> list[str] | None:
    """The nodes a shrunk trainer job runs on: `nodes` less the `lost` ones, in their order (the first left hosts
    the rendezvous). None when there is nothing to shrink to: shrinking is off (recovery.shrink_trainers=false),
    no node of the job is lost, or every one is."""
    if not enabled or not any(n in lost for n in nodes):
        return None
    left = [n for n in nodes if n not in lost]
    return left or None


def not_shrinking_why(nodes: list[str], lost: dict[str, str], *, enabled: bool) -> str:
    """Why `hosts_left` said None, for the message that stops the run."""
    if not enabled:
        return "recovery.shrink_trainers=false: the job does not shrink to the nodes left"
    if not any(n in lost for n in nodes):
        return "no node of the trainer job is known to be lost, so there is nothing to shrink to"
    return "no trainer node is left to shrink to"
