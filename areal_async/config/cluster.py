"""Config sections of where a run's processes live and what happens when they die: the multi-node trainer
rendezvous, the Slurm and Ray launchers, the recovery policy. Split from run_config.py (which composes them into
RunConfig) by concept; every field is documented by the string literal under it, as there. Never torch."""

from __future__ import annotations

from typing import Literal

from areal_async.config.base import Section, check, is_host_port, key_of

__all__ = ["RendezvousConfig", "SlurmConfig", "RayConfig", "RecoveryConfig"]


class RendezvousConfig(Section):
    """How the ranks of a multi-node trainer job meet (c10d), and how the controller finds every rank."""

    endpoint: str | None = None
    """host:port of the c10d rendezvous; null: the launcher picks one (here, or on the first trainer node)."""
    timeout_s: float = 300.0
    """How long the torchrun agents wait for all train.nnodes of them to join before the job fails."""
    discovery: Literal["registry", "files"] = "registry"
    """registry: each rank reports its address to an authenticated endpoint on the controller (no shared
    filesystem); files: ranks write run_dir/trainer/rank<r>.json (run_dir shared with every trainer node)."""
    local_agents: int | None = None
    """launcher=local: agents started here (node ranks 0..local_agents-1); null: all. The launcher logs the
    command that starts the others by hand."""

    def validate(self, prefix: str = "") -> None:
        check(self.endpoint is None or is_host_port(self.endpoint), key_of(prefix, "endpoint"), "must be host:port")
        check(self.timeout_s > 0, key_of(prefix, "timeout_s"), "must be > 0")
        check(self.local_agents is None or self.local_agents >= 1, key_of(prefix, "local_agents"), "must be >= 1")


class SlurmConfig(Section):
    """launcher=slurm: servers and trainers as srun steps of one Slurm job (launch/slurm.py, docs/cluster.md).
    Outside an allocation the run is submitted as a batch job whose first node runs the controller."""

    partition: str | None = None
    """Partition of the submitted job; null: the cluster's default."""
    account: str | None = None
    """Account the submitted job is charged to; null: your default."""
    time_limit: str | int | None = None
    """Wall-clock limit of the submitted job, as sbatch --time takes it ("1-00:00:00") or in seconds (YAML reads
    an unquoted 2:00:00 as 7200); null: the partition's default."""
    nodes: int | None = None
    """Nodes of the submitted job; null: train.nnodes, or more if servers_per_node needs more."""
    gpus_per_node: int = 0
    """GPUs per node; a server step takes server.gpus_per_server (embedded: 1), a trainer rank 1. 0: CPU only."""
    servers_per_node: int | None = None
    """Server steps per node; null: server.num_servers spread evenly over the job's nodes (with servers_apart: over
    the nodes after the trainers')."""
    servers_apart: bool = False
    """true: servers only on nodes no trainer runs on (the nodes after the first train.nnodes; slurm.nodes null asks
    for enough of them); false: server i on node i // servers_per_node, the first beside the trainers."""
    cpus_per_server: int | None = None
    """CPUs of each server step; null: server.torch_threads + 1."""
    cpus_per_trainer: int | None = None
    """CPUs per trainer rank; null: train.torch_threads + 1."""
    controller_cpus: int = 2
    """CPUs the submitted job adds on its first node for the controller (workflows, rewards)."""
    controller_address: str | None = None
    """Address the steps reach the controller at; null: the route to the job's nodes (loopback on one node)."""
    sbatch_args: list[str] = []
    """More #SBATCH options for the submitted job (e.g. ["--exclusive", "--qos=high"])."""
    srun_args: list[str] = []
    """More options for every srun step."""
    setup: list[str] = []
    """Shell lines the batch script runs before the controller (e.g. ["module load cuda/12.4"])."""
    queue_timeout_s: float | None = None
    """Cancel a submitted job not started after this many seconds; null: wait for the queue. A job Slurm says
    cannot start as asked (a partition limit, bad constraints) fails at once either way."""
    node_timeout_s: float = 120.0
    """How long the run waits on nodes that do not come up: a step Slurm does not create (its node busy, down or
    not answering) or a submitted job held by down or drained nodes fails after this."""
    detach: bool = False
    """Outside an allocation: submit the job and return; false: follow its log, cancel it on Ctrl-C."""

    def validate(self, prefix: str = "") -> None:
        for name in ("nodes", "servers_per_node", "cpus_per_server", "cpus_per_trainer", "controller_cpus"):
            value = getattr(self, name)
            check(value is None or value >= 1, key_of(prefix, name), "must be >= 1")
        check(self.gpus_per_node >= 0, key_of(prefix, "gpus_per_node"), "must be >= 0")
        check(
            not isinstance(self.time_limit, int) or self.time_limit > 0,
            key_of(prefix, "time_limit"),
            "must be > 0 seconds",
        )
        check(
            self.queue_timeout_s is None or self.queue_timeout_s > 0,
            key_of(prefix, "queue_timeout_s"),
            "must be > 0 or null",
        )
        check(self.node_timeout_s > 0, key_of(prefix, "node_timeout_s"), "must be > 0")


class RayConfig(Section):
    """launcher=ray: servers and the torchrun trainer job placed on a Ray cluster's nodes by placement groups, each
    process started and watched by a Ray actor on its node (launch/ray_launcher.py, docs/cluster.md). Needs the
    `ray` extra (pip install areal_async[ray])."""

    address: str = "auto"
    """The cluster's GCS address (host:port, as `ray start --head` prints it); auto: the one RAY_ADDRESS names or
    one running on this machine, else a head started for this run alone; local: always a head for this run."""
    num_cpus: int | None = None
    """A head started for this run: the CPUs it offers; null: this machine's."""
    num_gpus: int | None = None
    """A head started for this run: the GPUs it offers; null: this machine's."""
    cpus_per_server: int | None = None
    """CPUs each server's bundle reserves; null: server.torch_threads + 1."""
    cpus_per_trainer: int | None = None
    """CPUs each trainer rank reserves (a trainer node's bundle: train.nproc of them); null: train.torch_threads + 1."""
    gpus_per_server: int | None = None
    """GPUs each server's bundle reserves; null: server.gpus_per_server for sglang, 1 for an embedded server on
    cuda (or on auto when the cluster has GPUs), else 0."""
    gpus_per_trainer: int | None = None
    """GPUs each trainer rank reserves; null: 1 on cuda (or on auto when the cluster has GPUs), else 0."""
    server_resources: dict[str, float] = {}
    """Custom node resources each server's bundle asks for (`ray start --resources`): which nodes may serve."""
    trainer_resources: dict[str, float] = {}
    """Custom node resources each trainer node's bundle asks for: which nodes may train."""
    env_vars: dict[str, str] = {}
    """Environment of the started processes on top of the node's (Ray's workers do not see the controller's;
    AREAL_*, HF_*, TRANSFORMERS_*, TOKENIZERS_*, NCCL_* and GLOO_* are passed on from it)."""
    placement_timeout_s: float = 120.0
    """How long the run waits for Ray to place its bundles (at launch, and a restarted part's) before it fails,
    naming what did not fit."""
    node_timeout_s: float = 30.0
    """How long a node's actor may stay silent before the node counts as lost (Ray marks a dead node within about
    its health-check period times its failure threshold)."""
    regrow_timeout_s: float = 10.0
    """A trainer node lost: how long the new trainer job waits for Ray to find another node for its whole size
    before it shrinks to the nodes left (recovery.shrink_trainers)."""

    def validate(self, prefix: str = "") -> None:
        check(
            "://" not in self.address,
            key_of(prefix, "address"),
            f"{self.address!r}: Ray Client addresses are not supported (the controller must reach the nodes "
            "itself); give the head's GCS address, host:port",
        )
        check(
            self.address in ("auto", "local") or is_host_port(self.address),
            key_of(prefix, "address"),
            f"must be auto, local or the head's host:port (GCS), not {self.address!r}",
        )
        for name in ("num_cpus", "num_gpus", "cpus_per_server", "cpus_per_trainer", "gpus_per_server"):
            value = getattr(self, name)
            check(value is None or value >= 0, key_of(prefix, name), "must be >= 0")
        check(
            self.gpus_per_trainer is None or self.gpus_per_trainer >= 0,
            key_of(prefix, "gpus_per_trainer"),
            "must be >= 0",
        )
        for name in ("server_resources", "trainer_resources"):
            for res, amount in getattr(self, name).items():
                check(amount > 0, f"{key_of(prefix, name)}.{res}", "must be > 0")
                check(res not in ("CPU", "GPU"), f"{key_of(prefix, name)}.{res}", "CPU and GPU have keys of their own")
        for name in ("placement_timeout_s", "node_timeout_s"):
            check(getattr(self, name) > 0, key_of(prefix, name), "must be > 0")
        check(self.regrow_timeout_s >= 0, key_of(prefix, "regrow_timeout_s"), "must be >= 0")


class RecoveryConfig(Section):
    """What a run does when a part of it fails (launch/recovery.py): dead and hung servers are restarted and caught
    up to the current weights, a dead trainer rolls the run back to its last checkpoint, and only "no server left
    serving" or spent retries end it, with a resumable checkpoint."""

    enabled: bool = True
    """false: any dead server or trainer ends the run at once, with its log tail."""
    max_server_restarts: int = 3
    """Restarts of one server within server_restart_window_s; beyond that it stays out of the run."""
    server_restart_window_s: float = 3600.0
    """The window max_server_restarts counts over (a server that fails once a day is restarted every time)."""
    restart_backoff_s: float = 1.0
    """Wait before restarting a server or the trainers; doubled for every earlier restart in the window."""
    restart_backoff_max_s: float = 60.0
    """Cap of that wait."""
    unhealthy_restart_s: float = 120.0
    """A launched server that is alive but out of rotation (hung, answering errors, failing its weight loads) or
    silent on /health for this long is killed and restarted; 0: never."""
    health_interval_s: float = 2.0
    """How often the recovery watchdog probes every launched server's /health."""
    health_timeout_s: float = 5.0
    """A probe unanswered within this counts as silent."""
    no_server_timeout_s: float = 600.0
    """The run stops (with a resumable checkpoint) when no server has been serving for this long."""
    max_trainer_restarts: int = 2
    """Restarts of the trainer job per run, each rolling the run back to the last checkpoint; when they are spent
    the run stops and its last checkpoint resumes it."""
    shrink_trainers: bool = True
    """A trainer host lost (a Slurm node gone away, or the host of an agent started by hand with
    train.rdzv.local_agents) while other trainer hosts remain that this run can start trainers on: start the trainer
    job again on those hosts only (fewer nodes, train.nproc ranks each) from the last checkpoint, and go on. It
    counts as a trainer restart (max_trainer_restarts) and does not grow back when the host returns. false: the run
    stops with its last checkpoint instead, naming the host."""
    trainer_unreachable_s: float = 120.0
    """A trainer rank whose host answers nothing on the controller's connection for this long (a link cut, a host
    powered off) counts as a dead trainer: the call waiting on it fails, naming the rank and its host. A cut of less
    than about half of it rides through (TCP's retransmissions back off, so the link's return can take as long again
    to be noticed); a rank that is only busy or stopped never trips it (its kernel still answers)."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept in run_dir/checkpoints (older ones go once a newer one is complete); 0: all."""
    journal: bool = True
    """Record every token the running groups bring back (run_dir/journal) and keep it in each checkpoint, so a
    resume continues the groups in flight from their tokens instead of generating them again (docs/recovery.md).
    Needs schedule.checkpoint_every > 0 to matter."""

    def validate(self, prefix: str = "") -> None:
        for name in ("max_server_restarts", "max_trainer_restarts", "keep_checkpoints"):
            check(getattr(self, name) >= 0, key_of(prefix, name), "must be >= 0")
        for name in (
            "server_restart_window_s",
            "health_interval_s",
            "health_timeout_s",
            "no_server_timeout_s",
            "trainer_unreachable_s",
        ):
            check(getattr(self, name) > 0, key_of(prefix, name), "must be > 0")
        for name in ("restart_backoff_s", "unhealthy_restart_s"):
            check(getattr(self, name) >= 0, key_of(prefix, name), "must be >= 0")
        check(
            self.restart_backoff_max_s >= self.restart_backoff_s,
            key_of(prefix, "restart_backoff_max_s"),
            "must be >= restart_backoff_s",
        )
