"""A whole run across three real hosts (network namespaces, areal_async/testing/hosts.py), and a host that fails in
it. The controller runs on h0 with trainer agent 0; agent 1 runs on h1, started by hand with the command the
launcher logs (`train.rdzv.local_agents=1`); embedded servers on h1 and h2 serve it (`server.backend=external`,
reached by host name, behind an API key). This test process is not on their network at all.

Mid-step, h2's link is cut (`ip link set ... down`: its packets vanish, nothing is reset) and brought back; later
every process on h2 is SIGKILLed, as when a host loses power. The run goes on as it does for a dead or hung server
on one host: the client takes the server out of rotation and moves its requests to h1 with their tokens, re-admits
it when it answers again, and the run finishes every step without losing or repeating a sample. The log names the
host that went away.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
import time

import pytest

from areal_async.launch.processes import embedded_server_cmd, thread_env
from areal_async.testing import hosts as nshosts
from areal_async.testing.faults import RunProcess, assert_exact_accounting, metrics

WHY = nshosts.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(WHY is not None, reason=str(WHY))]

B, N, STEPS = 4, 4, 16  # prompt groups per step, samples per group, steps
PORT = 30000
COMMON = [
    f"schedule.batch_size={B}",
    f"rollout.group_size={N}",
    "rollout.max_new_tokens=96",
    "eval.num_prompts=0",
    "data.num_train=400",
    "train.micro_batch_tokens=1024",
    "schedule.eval_every=0",
    "recovery.health_interval_s=0.5",
    "recovery.health_timeout_s=1",
    "train.rdzv.timeout_s=90",
    f"total_steps={STEPS}",
]


class HostRun(RunProcess):
    """A controller (`python -m areal_async.run`) on one of the hosts."""

    def __init__(self, host: nshosts.Host, args: list[str], run_dir: str, env: dict[str, str]) -> None:
        super().__init__(args, run_dir)
        self.host, self.env = host, env

    def start(self) -> HostRun:
        with open(self.out_path, "w") as out:
            self.proc = self.host.popen(
                [sys.executable, "-m", "areal_async.run", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
            )
        self.started = time.monotonic()
        return self


def agent_command(output: str) -> tuple[dict[str, str], list[str]]:
    """The environment and command line the launcher logged for the agent it did not start."""
    m = re.search(r"start the other 1, one per node, with AREAL_RPC_SECRET exported as here and:\n\s+(.+)", output)
    assert m, output[-3000:]
    words = shlex.split(m.group(1))
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    return env, [w for w in words if not re.match(r"^[A-Z_]+=", w)]


def test_a_host_cut_off_and_a_host_lost_mid_run(tiny_ckpt, tmp_path):
    run_dir = str(tmp_path / "run")
    secret, key = os.urandom(32).hex(), secrets.token_hex(16)
    with nshosts.Hosts(3, gateway=False) as hs:
        h0, h1, h2 = hs.hosts
        logs = tmp_path / "logs"
        logs.mkdir()
        srv = embedded_server_cmd(
            tiny_ckpt,
            host="0.0.0.0",
            port=str(PORT),
            device="cpu",
            max_total_tokens=16384,
            max_running_requests=32,
            api_key=key,
        )
        for h in (h1, h2):
            with open(logs / f"server-{h.name}.log", "w") as out:
                h.popen(srv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **thread_env(1)})
        urls = f"[http://{h1.name}:{PORT}, http://{h2.name}:{PORT}]"
        args = [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "server.backend=external",
            f"server.urls={urls}",
            f"server.api_key={key}",
            "train.nnodes=2",
            "train.rdzv.local_agents=1",
            "train.weight_sync=disk",  # the hosts share the filesystem: run_dir/weights is seen by both servers
            *COMMON,
        ]
        run = HostRun(h0, args, run_dir, {"AREAL_RPC_SECRET": secret}).start()
        try:
            output = run.wait_for(lambda: "start the other 1" in run.output() and run.output(), "the agent command")
            env, cmd = agent_command(output)
            assert not [v for v in env.values() if "127.0.0.1" in v or "localhost" in v], env  # routable only
            assert f"{h0.address}:" in " ".join(cmd)  # the rendezvous on h0, at its routable address
            with open(logs / "agent1.log", "w") as out:
                h1.popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **thread_env(1), **env, "AREAL_RPC_SECRET": secret},
                )
            run.wait_version(1)
            out_of_rotation = f"inference server http://{h2.name}:{PORT} taken out of rotation"
            back = f"inference server http://{h2.name}:{PORT} is back in rotation"
            h2.link_down()  # mid-step: the first steps' rollouts are in flight on both servers
            cut = time.monotonic()
            run.wait_for(lambda: out_of_rotation in run.output(), "h2 out of rotation", 60)  # the run goes on
            with run.training_frozen():  # from here the run waits: it must not end before h2 is back
                time.sleep(max(0.0, 4 - (time.monotonic() - cut)))  # cut off for 4 s at least
                h2.link_up()
                run.wait_for(lambda: back in run.output(), "h2 back in rotation", 120)
            run.wait_version(run.version() + 1)  # h2 serves again
            assert h2.kill_all()  # its server, at least
            assert run.version() < STEPS - 2, "too late: the run must go on without h2 for a while"
            assert run.wait(240) == 0, run.output()[-4000:]
        finally:
            run.kill()
        out = run.output()
    # the client took h2's server out of rotation twice (cut off, then gone), naming the host each time
    gone = re.findall(rf"inference server http://{h2.name}:{PORT} taken out of rotation: (.*)", out)
    assert len(gone) >= 2, out[-4000:]
    assert_exact_accounting(run_dir, STEPS, B, N)
    assert [r["version"] for r in metrics(run_dir, "train")] == list(range(1, STEPS + 1))
