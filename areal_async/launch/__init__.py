"""Starting what a run needs and watching it: the `Launcher`/`Cluster` protocol (api.py), launchers for this host
(local.py) and for Slurm (slurm.py inside an allocation, sbatch.py to submit one), the registration endpoint that
finds processes on other nodes (net/rank_registry.py, step.py), servers joining and leaving (membership.py), fault
recovery (recovery.py; docs/recovery.md), how a run's segment can end (outcomes.py) and child-process management
(processes.py). No torch here."""

from areal_async.launch.api import (
    Cluster,
    ClusterEvent,
    EventHandler,
    Launcher,
    ProcessExited,
    ServerHandle,
    ServerJoined,
    ServerLeft,
    TrainerHandle,
    end_run_on_failure,
    supervise,
)
from areal_async.launch.local import ExternalLauncher, LocalCluster, LocalLauncher, launcher_for
from areal_async.launch.membership import FleetPolicy, JoinFile, failure_policy
from areal_async.launch.processes import Child, ChildFailed, Processes, free_port, interrupt_on_sigterm, tail
from areal_async.launch.recovery import RecoveryLog, RunRecovery

# the transport lives with the weight syncs (rollout/broadcast_sync.py); importable from here as before
from areal_async.rollout.broadcast_sync import ElasticBroadcastSync
from areal_async.rollout.outcomes import NoServerServing, RunStopped, TrainerLost

__all__ = [
    "Child",
    "ChildFailed",
    "Cluster",
    "ClusterEvent",
    "ElasticBroadcastSync",
    "EventHandler",
    "ExternalLauncher",
    "FleetPolicy",
    "JoinFile",
    "Launcher",
    "LocalCluster",
    "LocalLauncher",
    "NoServerServing",
    "ProcessExited",
    "Processes",
    "RecoveryLog",
    "RunRecovery",
    "RunStopped",
    "ServerHandle",
    "ServerJoined",
    "ServerLeft",
    "TrainerHandle",
    "TrainerLost",
    "end_run_on_failure",
    "failure_policy",
    "free_port",
    "interrupt_on_sigterm",
    "launcher_for",
    "supervise",
    "tail",
]
