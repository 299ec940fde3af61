"""launcher=ray (areal_async/launch/ray_launcher.py) on a real Ray cluster: a head on this machine's side of the
hosts' bridge and a worker node on each of two network-namespace hosts (areal_async/testing/netns_ray.py), each
with its own address. The head offers no CPUs, so Ray places every server and torchrun agent on a namespace host:
another host, as far as the network goes, from the controller (this test's child, in the root namespace).

One cluster for the module (a head and two workers take seconds to start on a 2-core machine). The checks that
need no cluster (placement arithmetic, errors naming the key, Ray missing) run first and fast.

CI: AREAL_REQUIRE_RAY=1 makes a missing `ray` an error here instead of a skip, as AREAL_REQUIRE_NETNS=1 does for
hosts that cannot be built.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from areal_async.config import ConfigError, RunConfig, from_dict
from areal_async.launch.ray_placement import RayNode, bundles, check_fits, check_reachable
from areal_async.testing import hosts as nshosts
from areal_async.testing.faults import RunProcess, assert_exact_accounting, signal_pid, summary

REQUIRE_RAY = "AREAL_REQUIRE_RAY"
SESSION = os.environ.get("AREAL_TEST_SESSION", "nosession")


def _ray_missing() -> str | None:
    if importlib.util.find_spec("ray") is not None:
        return None
    if os.environ.get(REQUIRE_RAY) == "1":
        raise RuntimeError(f"{REQUIRE_RAY}=1 but ray is not installed: pip install 'areal_async[ray]'")
    return "ray is not installed (pip install 'areal_async[ray]')"


RAY_WHY = _ray_missing()
NETNS_WHY = nshosts.skip_reason()
needs_cluster = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(RAY_WHY is not None, reason=str(RAY_WHY)),
    pytest.mark.skipif(NETNS_WHY is not None, reason=str(NETNS_WHY)),
]
B, N, STEPS = 2, 2, 8  # checkpoints at 2, 4 and 6: a rank killed past 2, the node lost past 4


# ---- no cluster -------------------------------------------------------------------------------------------------


def _cfg(**kw) -> RunConfig:
    raw: dict = {"launcher": "ray", "server": {"device": "cpu"}, "train": {"device": "cpu"}}
    for key, value in kw.items():
        node = raw
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return from_dict(raw)


def _node(i: int, cpus: float, **res: float) -> RayNode:
    return RayNode(f"id{i}", f"10.0.0.{i}", f"n{i}", {"CPU": cpus, **res})


def test_bundles_follow_the_config():
    b = bundles(_cfg(train__nproc=2, train__torch_threads=3, ray__server_resources={"inference": 1}), False)
    assert b.trainer == {"CPU": 8.0} and b.server == {"CPU": 2.0, "inference": 1.0}
    b = bundles(_cfg(server__device="auto", train__device="auto", ray__cpus_per_trainer=1), True)
    assert b.trainer == {"CPU": 1.0, "GPU": 1.0} and b.server == {"CPU": 2.0, "GPU": 1.0}
    assert bundles(_cfg(server__backend="external", server__urls=["http://a:1"]), False).num_servers == 0


def test_placement_that_cannot_fit_names_the_key():
    two = [_node(1, 4), _node(2, 4)]
    check_fits(bundles(_cfg(train__nnodes=2, server__num_servers=2), False), two)  # 2+2 per node: fits
    cases = [
        (_cfg(train__nnodes=3, ray__cpus_per_trainer=1, ray__cpus_per_server=1), "train.nnodes: 3 trainer node"),
        (_cfg(ray__cpus_per_trainer=16), "ray.cpus_per_server, ray.cpus_per_trainer: the run asks for 18 CPU"),
        (_cfg(ray__cpus_per_trainer=5), "train.nnodes: 1 trainer node(s)"),
        (  # 8 CPUs asked for and 8 there, but the trainers leave 1 on each node and a server needs 2
            _cfg(train__nnodes=2, ray__cpus_per_trainer=3, ray__cpus_per_server=2),
            "server.num_servers: server 0 of 1 does not fit beside the trainers",
        ),
        (_cfg(ray__server_resources={"inference": 1}), "ray.server_resources: the run asks for 1 inference"),
        (_cfg(ray__gpus_per_trainer=1), "ray.gpus_per_trainer: the run asks for 1 GPU"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_fits(bundles(cfg, False), two)
    with pytest.raises(ConfigError, match="ray.address: the Ray cluster has no alive node"):
        check_fits(bundles(_cfg(), False), [])


def test_servers_on_other_nodes_must_be_reachable():
    nodes = [_node(1, 4), _node(2, 4)]
    with pytest.raises(ConfigError, match=r"^server\.host: 127\.0\.0\.1 cannot be reached"):
        check_reachable(_cfg(), nodes, "10.0.0.9")
    with pytest.raises(ConfigError, match=r"^server\.api_key"):
        check_reachable(_cfg(server__host="0.0.0.0"), nodes, "10.0.0.9")
    check_reachable(_cfg(server__host="0.0.0.0", server__api_key="k"), nodes, "10.0.0.9")
    check_reachable(_cfg(), [_node(1, 4)], "10.0.0.1")  # one node, this host: loopback is fine


def test_config_rejects_bad_ray_keys():
    for kw, key in (
        ({"ray__address": "nowhere"}, "ray.address: must be auto, local or the head's host:port"),
        ({"ray__address": "ray://head:10001"}, "ray.address: 'ray://head:10001': Ray Client addresses"),
        ({"ray__placement_timeout_s": 0}, "ray.placement_timeout_s"),
        ({"ray__trainer_resources": {"GPU": 1}}, "ray.trainer_resources.GPU"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            _cfg(**kw)


def test_ray_missing_says_how_to_install(monkeypatch):
    from areal_async.launch import ray_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=re.escape("launcher: ray is not installed here")) as e:
        ray_launcher.import_ray()
    assert "pip install 'areal_async[ray]'" in str(e.value)


@pytest.mark.skipif(RAY_WHY is not None, reason=str(RAY_WHY))
def test_an_unreachable_cluster_names_the_key(tmp_path):
    from areal_async.launch.local import launcher_for

    cfg = _cfg(ray__address="127.0.0.1:1", run_dir=str(tmp_path / "r"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^ray\.address: cannot reach the Ray cluster's head at 127\.0\.0\.1:1"):
        asyncio.run(launcher_for(cfg).launch(cfg, model_path=str(tmp_path)))
    assert time.monotonic() - t0 < 10


# ---- the cluster's decisions, with Ray replaced by fakes ------------------------------------------------------


class _Call:
    """`actor.method.remote(...)`: a fake object ref, resolved at once (or failing: the actor is dead)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn, args


class _Actor:
    def __init__(self, fleet: _Fleet, node: RayNode) -> None:
        self.fleet, self.where, self.killed = fleet, node, False
        self.node = _Call(lambda: {"ip": node.ip, "hostname": node.hostname, "node_id": node.node_id, "pid": 1})
        self.stop = _Call(lambda pid, grace: None)
        self.shutdown = _Call(lambda grace, first: None)

    def answers(self) -> bool:
        return not self.killed and self.where.node_id not in self.fleet.dead


class _Fleet:
    """Nodes, some dead; placement groups placed on the alive ones (STRICT_SPREAD: distinct nodes)."""

    def __init__(self, nodes: list[RayNode]) -> None:
        self.nodes, self.dead, self.removed = nodes, set(), 0

    def alive(self) -> list[RayNode]:
        return [n for n in self.nodes if n.node_id not in self.dead]

    def parts(self):
        from areal_async.launch.ray_cluster import RayParts

        def future(ref):
            fn, args = ref
            fut = asyncio.get_running_loop().create_future()
            actor = getattr(fn, "actor", None)
            if actor is not None and not actor.answers():
                fut.set_exception(RuntimeError("ActorDiedError"))
            else:
                fut.set_result(fn(*args))
            return fut

        def new_actor(group, index, bundle):
            actor = _Actor(self, group[index])
            for name in ("node", "stop", "shutdown"):
                getattr(actor, name).fn.actor = actor
            return actor

        async def ready(group, timeout_s):
            return group is not None

        def new_group(bundles_, strategy):
            alive = self.alive()
            return alive[: len(bundles_)] if len(bundles_) <= len(alive) else None

        def remove(group):
            self.removed += 1

        def state(node_id):
            return "dead in Ray's node table (test)" if node_id in self.dead else None

        def kill(actor):
            actor.killed = True

        return RayParts(new_group, ready, remove, new_actor, kill, state, future, lambda: None)


def _fake_cluster(fleet: _Fleet, **kw):
    from areal_async.launch.ray_cluster import RayCluster

    cfg = _cfg(train__nnodes=2, ray__node_timeout_s=0.5, ray__regrow_timeout_s=0.1, **kw)
    registry = type("Reg", (), {"entries": {}, "rank_dir": "/nonexistent", "env": lambda self: {}})()
    cluster = RayCluster(cfg, fleet.parts(), registry, b"s" * 32, "/model")
    cluster.trainer_bundle = {"CPU": 1.0}
    started: list[tuple] = []

    async def start_job(resume, generation):
        started.append((resume, generation, [n.hostname for _, n in cluster.trainer_actors]))

    cluster.start_trainer_job = start_job
    return cluster, started


def test_a_lost_trainer_node_shrinks_regrows_or_stops_the_run():
    from areal_async.launch.ray_cluster import RayNodeLost

    async def scenario(nodes: int, lose: bool, **kw):
        fleet = _Fleet([_node(i, 2) for i in range(nodes)])
        cluster, started = _fake_cluster(fleet, **kw)
        assert await cluster.place_trainers(2, 1.0)
        if lose:
            fleet.dead.add("id1")
        handle = await cluster.restart_trainers("ckpt/v2")
        return cluster, started, handle

    cluster, started, handle = asyncio.run(scenario(2, lose=False))  # a dead rank: same actors, same nodes
    assert started == [("ckpt/v2", 1, ["n0", "n1"])] and cluster.last_shrink is None and handle.world_size == 2
    cluster, started, handle = asyncio.run(scenario(2, lose=True))  # nothing to take n1's place: shrink
    assert started == [("ckpt/v2", 1, ["n0"])] and handle.world_size == 1
    assert cluster.last_shrink.lost == {"n1": "dead in Ray's node table (test)"}
    cluster, started, handle = asyncio.run(scenario(3, lose=True))  # n2 has room: the whole job again
    assert started == [("ckpt/v2", 1, ["n0", "n2"])] and cluster.last_shrink is None and handle.world_size == 2
    with pytest.raises(RayNodeLost, match=r"n1: dead in Ray's node table .* does not shrink \(recovery\.shrink"):
        asyncio.run(scenario(2, lose=True, recovery__shrink_trainers=False))


_LOCAL_HEAD = """
import json, os, sys
from areal_async.config import RayConfig
from areal_async.launch.processes import descendants
from areal_async.launch.ray_launcher import connect
import ray

stop = connect(RayConfig(address=sys.argv[1], num_cpus=1))
nodes = [n["Resources"].get("CPU") for n in ray.nodes() if n["Alive"]]
started = len(descendants(os.getpid()))
stop()
print("RESULT " + json.dumps({"nodes": nodes, "started": started, "left": descendants(os.getpid()),
                              "auth": os.environ.get("RAY_AUTH_MODE")}))
"""


@pytest.mark.slow
@pytest.mark.skipif(RAY_WHY is not None, reason=str(RAY_WHY))
@pytest.mark.timeout(120)
def test_a_head_started_for_the_run_leaves_nothing_behind(tmp_path):
    """ray.address=local (and auto with no cluster around): a head of ray.num_cpus for this run alone, with an auth
    token of its own that never reaches ~/.ray (where it would turn on token authentication for every later
    `ray start --head` of the user), and nothing of it left once the run disconnects."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="arh", dir="/tmp")  # short: Ray's socket paths
    try:
        p = subprocess.run(
            [sys.executable, "-c", _LOCAL_HEAD, "local"], capture_output=True, text=True, timeout=100, env=env
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)  # the head's session logs
    m = re.search(r"^RESULT (.*)$", p.stdout, re.M)
    assert m, p.stderr[-3000:]
    out = json.loads(m.group(1))
    assert out["nodes"] == [1.0] and out["started"] > 0, out  # a head of its own: GCS, raylet, ...
    assert out["left"] == [] and out["auth"] is None, out
    assert not os.path.exists(tmp_path / ".ray" / "auth_token")


# ---- a Ray cluster of a head and two namespace-host workers ----------------------------------------------------


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory):
    if RAY_WHY or NETNS_WHY:
        pytest.skip(str(RAY_WHY or NETNS_WHY))
    from areal_async.testing.netns_ray import RayOnHosts

    with nshosts.Hosts(2) as hs:
        cluster = RayOnHosts(hs, str(tmp_path_factory.mktemp("ray")))
        try:
            yield hs, cluster
        finally:
            cluster.close()


def _ensure_nodes(hs, cluster) -> None:
    """Every host runs a worker node (a test before may have killed one)."""
    for i in range(len(hs)):
        if i not in cluster.workers:
            cluster.start_node(i)
    cluster.wait_nodes()


class RayRun(RunProcess):
    """`python -m areal_async.run launcher=ray ...` in the root namespace (this test's side of the bridge)."""

    def __init__(self, args: list[str], run_dir: str, address: str) -> None:
        super().__init__(args, run_dir)
        self.address = address

    def start(self) -> RayRun:
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_async.run", *self.args, f"ray.address={self.address}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.started = time.monotonic()
        return self

    def run_log(self) -> str:
        with open(os.path.join(self.run_dir, "run.log"), errors="replace") as f:
            return f.read()


def run_args(model: str, run_dir: str, **over: str) -> list[str]:
    args = {
        "launcher": "ray",
        "model.path": model,
        "run_dir": run_dir,
        "total_steps": str(STEPS),
        "schedule.checkpoint_every": "2",
        "schedule.eval_every": "0",
        "eval.num_prompts": "0",
        "schedule.batch_size": str(B),
        "rollout.group_size": str(N),
        "rollout.max_new_tokens": "32",
        "data.num_train": "100",
        "server.device": "cpu",
        "train.device": "cpu",
        "server.num_servers": "1",
        "train.nnodes": "2",
        "train.nproc": "1",
        "server.host": "0.0.0.0",
        "server.api_key": secrets.token_hex(16),
        "ray.cpus_per_server": "1",
        "ray.cpus_per_trainer": "1",
        "ray.node_timeout_s": "10",
        "ray.regrow_timeout_s": "2",
        "recovery.health_interval_s": "0.5",
        "recovery.health_timeout_s": "1",
        "recovery.restart_backoff_s": "0.2",
        "train.connect_timeout_s": "300",
        "train.rdzv.timeout_s": "300",
        **over,
    }
    return [f"{k}={v}" for k, v in args.items()]


def _left_behind(cluster, run_dir: str) -> list[str]:
    """Processes of the run still alive anywhere on the machine (every host shares its /proc), and resources some
    actor or placement group still holds."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if run_dir in cmd and "pytest" not in cmd:
                out.append(f"pid {entry}: {cmd[:200]}")
    total, free = cluster.resources()
    if free.get("CPU", 0.0) != total.get("CPU", 0.0):
        out.append(f"CPUs still reserved: {free.get('CPU', 0.0)} of {total.get('CPU', 0.0)} free")
    return out


def _wait_nothing_left(cluster, run_dir: str, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _left_behind(cluster, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def cluster_test(f):
    """The marks of a test that runs on the module's Ray cluster."""
    for mark in needs_cluster:
        f = mark(f)
    return f


@cluster_test
def test_the_default_task_learns_over_two_ray_nodes(ray_hosts, tmp_path):
    """The default task (its shipped base model) with launcher=ray: a server and a torchrun agent on each
    namespace host, the agents meeting at a c10d store on one of them; 4 steps must learn as under the other
    launchers (+20 held-out points asserted; launcher=local measured +47.0, the two-node Slurm test +44.5 to
    +48.0), and the end of the run leaves nothing behind."""
    from areal_async.tasks.base_model import ensure_base_model

    hs, cluster = ray_hosts
    _ensure_nodes(hs, cluster)
    run_dir = str(tmp_path / f"t{SESSION}-rayl-{secrets.token_hex(3)}")
    args = [
        "launcher=ray",
        f"model.path={ensure_base_model()}",
        f"run_dir={run_dir}",
        "total_steps=4",
        "schedule.eval_every=4",
        "schedule.checkpoint_every=0",
        "server.device=cpu",
        "train.device=cpu",
        "server.num_servers=2",
        "train.nnodes=2",
        "train.nproc=1",
        "server.host=0.0.0.0",
        f"server.api_key={secrets.token_hex(16)}",
        "ray.cpus_per_server=1",
        "ray.cpus_per_trainer=1",
        "train.connect_timeout_s=300",
        "train.rdzv.timeout_s=300",
    ]
    run = RayRun(args, run_dir, cluster.address).start()
    try:
        rc = run.wait(420)
    finally:
        run.kill()
    assert rc == 0, run.output()[-4000:]
    s = summary(run_dir)
    assert s["steps"] == 4 and s["final_accuracy"] >= s["base_accuracy"] + 0.20, s
    log_text = run.run_log()
    addresses = {h.address for h in hs.hosts}
    servers = re.findall(r"server\d runs on \S+ \(([\d.]+)\)", log_text)
    ranks = re.findall(r"registered rank\d at tcp://([\d.]+):\d+", log_text)
    assert sorted(servers) == sorted(addresses) and sorted(ranks) == sorted(addresses), log_text[-3000:]
    assert not _wait_nothing_left(cluster, run_dir)
    print(f"default task on Ray: {s['base_accuracy']:.3f} -> {s['final_accuracy']:.3f}")


@cluster_test
def test_a_run_over_two_ray_nodes_survives_a_dead_rank_and_a_lost_node(ray_hosts, tiny_ckpt, tmp_path):
    """train.nnodes=2: Ray places one torchrun agent on each namespace host (STRICT_SPREAD) and the server on one
    of them, away from the controller; the ranks report from their hosts' addresses.

    1. Past the checkpoint at 2, trainer rank 1 is SIGKILLed: its agent exits, its actor reports it, and the job
       starts again through the same actors on the same two nodes from the checkpoint.
    2. Past the checkpoint at 4, the server's host loses power (every process there SIGKILLed, its raylet
       included): Ray marks the node dead, the trainer job shrinks to the node left from the checkpoint, the server
       comes back there with the current weights, and the run finishes every step with no sample lost or trained
       twice. Then nothing of the run is left: no process, no actor, no placement group holding resources."""
    hs, cluster = ray_hosts
    _ensure_nodes(hs, cluster)
    run_dir = str(tmp_path / f"t{SESSION}-ray-{secrets.token_hex(3)}")
    run = RayRun(run_args(tiny_ckpt, run_dir), run_dir, cluster.address).start()
    try:
        run.wait_version(3, timeout=300)
        log_text = run.run_log()
        addresses = {h.address: i for i, h in enumerate(hs.hosts)}
        ranks = dict(re.findall(r"registered (rank\d) at tcp://([\d.]+):\d+", log_text))
        assert sorted(addresses[a] for a in ranks.values()) == [0, 1], log_text[-3000:]  # one agent per host
        # 1. a dead rank
        os.kill(run.trainer_rank_pid(1), signal.SIGKILL)
        back = run.wait_recovery("trainer_recovered", timeout=240)[-1]
        assert back["version"] == 2 and back["trainer_layout"]["world_size"] == 2, back
        # 2. a lost node: the server's
        run.wait_version(5, timeout=240)
        server = re.search(r"server0 runs on \S+ \(([\d.]+)\) at http://([\d.]+):\d+", run.run_log())
        assert server and server.group(1) == server.group(2) and server.group(1) in addresses, log_text[-3000:]
        lost = addresses[server.group(1)]
        ranks = dict(re.findall(r"registered (rank\d) at tcp://([\d.]+):\d+", run.run_log()))  # the new job's
        survivor = run.trainer_rank_pid(0 if ranks["rank0"] != server.group(1) else 1)
        os.kill(survivor, signal.SIGSTOP)  # no step ends until the job is replaced: the run cannot finish first
        try:
            assert cluster.kill_node(lost)
            killed = time.monotonic()
            run.wait_recovery("trainer_failed", count=2, timeout=120)
        finally:
            signal_pid(survivor, signal.SIGCONT)
        rc = run.wait(300)
    finally:
        run.kill()
    out = run.output()
    assert rc == 0, out[-4000:]
    assert summary(run_dir)["completed"]
    recs = run.recoveries()
    shrunk = next((r for r in recs if r["event"] == "trainer_shrunk"), None)
    assert shrunk is not None, recs
    assert shrunk["lost_hosts"] == [hs[lost].name] and "dead in Ray's node table" in shrunk["what"], shrunk
    assert shrunk["trainer_layout"] == {"nodes": [hs[1 - lost].name], "nproc": 1, "world_size": 1}, shrunk
    assert [r["version"] for r in recs if r["event"] == "trainer_recovered"] == [2, 4], recs
    moved = next((r for r in recs if r["event"] == "server_recovered"), None)
    assert moved is not None and moved["server_version"] == moved["current_version"], recs
    assert moved["where"].startswith(f"on {hs[1 - lost].name} ") and f"moved from {hs[lost].name}" in moved["where"]
    assert_exact_accounting(run_dir, STEPS, B, N)
    assert not _wait_nothing_left(cluster, run_dir)
    print(f"node {hs[lost].name} lost: the run ended {time.monotonic() - killed:.1f}s later")


@cluster_test
def test_ctrl_c_leaves_nothing_behind(ray_hosts, tiny_ckpt, tmp_path):
    """SIGTERM mid-run, which the run turns into its Ctrl-C (ray.init's own SIGTERM handler, a bare exit, must not
    stay in its place): the controller stops every process through its actor, kills the actors and removes the
    placement groups before it exits; the cluster's resources are all free again and no process of the run is left
    on any host."""
    hs, cluster = ray_hosts
    _ensure_nodes(hs, cluster)
    run_dir = str(tmp_path / f"t{SESSION}-rayc-{secrets.token_hex(3)}")
    args = run_args(tiny_ckpt, run_dir, total_steps="1000", **{"train.nnodes": "1"})
    run = RayRun(args, run_dir, cluster.address).start()
    try:
        run.wait_version(1, timeout=300)
        run.kill(signal.SIGTERM)
        t0 = time.monotonic()
        rc = run.wait(120)
    finally:
        run.kill()
    assert rc is not None and "interrupted" in run.output(), run.output()[-3000:]
    assert not _wait_nothing_left(cluster, run_dir), run.output()[-3000:]
    print(f"Ctrl-C: the controller exited {time.monotonic() - t0:.1f}s later")
