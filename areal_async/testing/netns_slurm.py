"""A Slurm cluster of several nodes on one machine, for tests: slurmctld and one slurmd on the first network-namespace
host (areal_async/testing/hosts.py), one slurmd on each other host, each node under its own NodeName and NodeAddr.
Jobs and steps run inside the hosts' namespaces, so a step on the second node is on another host as far as the
network goes; the hosts share the filesystem (and with it munge's socket, a file path), as nodes with a shared
home directory do.

It is a cluster of its own beside the machine's one-node Slurm (.ci/start_slurm.sh), never touching it: its own
cluster name, config directory (clients find it through SLURM_CONF, `env`), ports, state, spool, pid and log
files, all under one directory; `close()` cancels its jobs, stops its daemons and leaves the directory to the
caller. Munge must be running (start_slurm.sh starts it). Nothing happens at import time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from areal_async.testing.hosts import Hosts

__all__ = ["SlurmOnHosts"]

CTLD_PORT, SLURMD_PORT = 6917, 6918  # not the one-node cluster's 6817/6818 (they are other namespaces, but still)


def _conf(name: str, root: str, hosts: Hosts, cpus: int, mem_mb: int) -> str:
    h0 = hosts[0]
    nodes = "".join(
        f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN\n"
        for h in hosts.hosts
    )
    return (
        f"ClusterName={name}\n"
        f"SlurmctldHost={h0.name}({h0.address})\n"
        f"SlurmctldPort={CTLD_PORT}\nSlurmdPort={SLURMD_PORT}\n"
        "SlurmUser=root\nAuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSchedulerType=sched/backfill\n"
        "MpiDefault=none\nReturnToService=2\nSlurmdParameters=config_overrides\n"
        f"StateSaveLocation={root}/state\nSlurmdSpoolDir={root}/spool/%n\n"
        f"SlurmctldPidFile={root}/slurmctld.pid\nSlurmdPidFile={root}/slurmd-%n.pid\n"
        f"SlurmctldLogFile={root}/log/slurmctld.log\nSlurmdLogFile={root}/log/slurmd-%n.log\n"
        "SlurmctldTimeout=30\nSlurmdTimeout=300\nInactiveLimit=0\nKillWait=5\nMinJobAge=30\n"
        f"{nodes}"
        "PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
    )


class SlurmOnHosts:
    """Slurm over `hosts`: `hosts[0]` runs slurmctld, every host a slurmd (node name = host name). Each node
    advertises `cpus` CPUs (config_overrides: more than the machine has, so that steps fit side by side)."""

    def __init__(self, hosts: Hosts, root: str, *, cpus: int = 16, startup_timeout_s: float = 60.0) -> None:
        for tool in ("slurmctld", "slurmd", "sinfo"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"needs {tool} (Debian's slurm-wlm)")
        if not os.path.exists("/run/munge/munge.socket.2"):
            raise RuntimeError("munged is not running (.ci/start_slurm.sh starts it)")
        self.hosts, self.root = hosts, root
        self.name = f"arealns{os.getpid()}"[:40]
        for d in ("state", "log", "etc", *(f"spool/{h.name}" for h in hosts.hosts)):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.conf = os.path.join(root, "etc", "slurm.conf")
        mem_mb = int(int(open("/proc/meminfo").read().split()[1]) / 1024 * 0.4)
        with open(self.conf, "w") as f:
            f.write(_conf(self.name, root, hosts, cpus, mem_mb))
        with open(os.path.join(root, "etc", "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        self.env = {"SLURM_CONF": self.conf}
        self._daemons: list[subprocess.Popen] = []
        self._closed = False
        try:
            self._start(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _daemon(self, host_index: int, cmd: list[str], log: str) -> None:
        with open(os.path.join(self.root, "log", log), "ab") as out:
            env = {**os.environ, **self.env}
            self._daemons.append(
                self.hosts[host_index].popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
            )

    def _start(self, timeout_s: float) -> None:
        self._daemon(0, ["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
        for i, h in enumerate(self.hosts.hosts):
            self._daemon(i, ["slurmd", "-D", "-N", h.name, "-f", self.conf], f"slurmd-{h.name}.out")
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.node_states()
            if len(states) == len(self.hosts) and all(s in ("idle", "mixed", "allocated") for s in states.values()):
                return
            dead = [p.args for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the nodes did not come up idle within {timeout_s:.0f}s (states {states}, exited {dead}); "
                    f"logs in {self.root}/log:\n{self._log_tails()}"
                )
            time.sleep(0.5)

    def start_slurmd(self, host_index: int, timeout_s: float = 60.0) -> None:
        """Start host `host_index`'s slurmd again (after `Host.kill_all`, as a node that comes back from a power
        loss) and wait until slurmctld sees it answer."""
        h = self.hosts[host_index]
        self._daemon(host_index, ["slurmd", "-D", "-N", h.name, "-f", self.conf], f"slurmd-{h.name}.out")
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.node_states().get(h.name, "")
            if state and not state.endswith("*") and not state.startswith(("down", "fail")):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{h.name} not answering {timeout_s:.0f}s after its slurmd started ({state})")
            time.sleep(0.5)

    def _log_tails(self) -> str:
        out = []
        log_dir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                out.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(out)

    def cmd(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scancel, ...) against this cluster, from this process's host."""
        kw.setdefault("timeout", 30)
        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env}, **kw)

    def node_states(self) -> dict[str, str]:
        """Node name -> state, as sinfo says ({} while slurmctld does not answer)."""
        try:
            p = self.cmd(["sinfo", "-h", "-N", "-o", "%N %T"])
        except subprocess.TimeoutExpired:
            return {}
        rows = [line.split() for line in p.stdout.splitlines() if line.strip()] if p.returncode == 0 else []
        return {r[0]: r[1] for r in rows if len(r) == 2}

    def jobs(self) -> list[str]:
        """Ids of the jobs this cluster holds, in any state squeue shows."""
        p = self.cmd(["squeue", "-h", "-o", "%i"])
        return p.stdout.split() if p.returncode == 0 else []

    def close(self) -> None:
        """Cancel every job, wait (briefly) for them to go, stop the daemons. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.jobs():
                self.cmd(["scancel", "--full", *self.jobs()])
                deadline = time.monotonic() + 20
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for p in self._daemons:
            if p.poll() is None:
                p.terminate()
        for p in self._daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
