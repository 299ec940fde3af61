"""`launcher=ray`: the run's inference servers and torchrun trainer job on a Ray cluster's nodes.

    ray start --head ...; ray start --address=HEAD:6379 ...      # or a KubeRay RayCluster
    python -m areal_async.run launcher=ray ray.address=HEAD:6379 server.host=0.0.0.0 server.api_key=... ...

Ray is the launcher here, not a runtime: the controller stays the one asyncio process (a Ray driver that only
places and watches), and the processes are the very ones the local launcher starts (launch/processes.py), each
forked on its node by a small actor (launch/ray_actor.py) that sits in a placement-group bundle reserving its CPUs,
GPUs and custom resources (launch/ray_placement.py). The servers speak HTTP to the controller and the trainer
ranks msgspec RPC, as under every launcher; the ranks find the controller through its registry
(net/rank_registry.py), so no shared filesystem is needed to find anything (the model, run_dir's checkpoints and
the disk-published weights still have to be where every node sees them, as under Slurm).

`ray.address`: a cluster's GCS address; auto (the default) connects to the cluster RAY_ADDRESS names or one running
on this machine, and otherwise starts a head for this run; local always starts one. Before anything starts the run
is checked against the cluster's alive nodes, with errors naming the key (launch/ray_placement.py): Ray missing,
the cluster unreachable, too few CPUs or GPUs, a placement no node set can hold. What happens when parts fail, and
the teardown: launch/ray_cluster.py. Ray is imported only here and only when this launcher runs: importing the
package stays cheap without the extra. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from areal_async.config import ConfigError
from areal_async.launch.api import ServerHandle
from areal_async.launch.membership import JoinFile, join_file
from areal_async.launch.processes import ChildFailed, c10d_args
from areal_async.launch.ray_actor import NodeProcesses
from areal_async.launch.ray_cluster import RayCluster, RayParts, _Proc
from areal_async.launch.ray_placement import RayNode, bundles, check_fits, check_reachable
from areal_async.launch.sglang_server import sglang_options
from areal_async.net.rank_registry import Registry, route_address

if TYPE_CHECKING:
    from areal_async.config import RayConfig, RunConfig

__all__ = ["FORWARDED_ENV", "RayLauncher", "connect", "import_ray"]

log = logging.getLogger(__name__)

# the controller's variables the processes on the nodes get too (Ray's workers have their node's environment, not
# the driver's); the run's own RPC secret and registry are set per process, and a host address override is this
# host's, never a node's
FORWARDED_ENV = ("AREAL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "NCCL_", "GLOO_")
_NOT_FORWARDED = frozenset({"AREAL_RPC_SECRET", "AREAL_REGISTRY", "AREAL_TRAINER_ADDRESS"})


def import_ray() -> Any:
    """The ray module, or a ConfigError that says how to install it."""
    try:
        import ray
        from ray.util import placement_group  # noqa: F401  (the parts this launcher uses)
    except ImportError as e:
        raise ConfigError(f"launcher: ray is not installed here ({e}); pip install 'areal_async[ray]'") from None
    return ray


def _reachable(address: str, timeout_s: float = 5.0) -> str | None:
    """None when a TCP connection to host:port opens within `timeout_s`, else why not (ray.init itself would retry
    an unreachable head for a minute before it says so)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


def connect(r: RayConfig) -> Callable[[], None]:
    """Connect this process to the cluster `ray.address` names (see the module docstring), or start a head for
    this run; returns what ends that at the run's end (nothing when a caller had connected already). Errors name
    the key. Blocking (seconds)."""
    ray = import_ray()
    if ray.is_initialized():
        log.info("ray: using the connection this process already has")
        return lambda: None
    quiet: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False)
    env_address = os.environ.get("RAY_ADDRESS", "")
    address = r.address if r.address != "auto" else env_address or "auto"
    if address == "local" or (address == "auto" and not _running_here(ray)):
        if address == "auto":
            log.warning("ray.address=auto: no Ray cluster found here (RAY_ADDRESS unset): starting a head for this run")
        # ray.init reads RAY_ADDRESS before its own argument: a head for this run must not find the variable. A
        # head ray.init starts requires a token, which Ray would write to ~/.ray/auth_token, where every later
        # `ray start --head` of this user finds it and then refuses clients that send none: this run's head gets
        # a token of its own in this process's environment instead, and leaves no file behind
        auth = (
            {} if "RAY_AUTH_MODE" in os.environ else {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        )
        with _without("RAY_ADDRESS"):
            os.environ.update(auth)
            _reload_auth()
            try:
                with _keep_sigterm():
                    ray.init(num_cpus=r.num_cpus, num_gpus=r.num_gpus, **quiet)
            except BaseException:
                _restore(auth)
                raise

        def stop_head() -> None:
            ray.shutdown()
            _restore(auth)

        return stop_head
    if address != "auto":
        why = _reachable(address)
        if why is not None:
            key = "ray.address" if r.address != "auto" else "ray.address (auto, from RAY_ADDRESS)"
            raise ConfigError(f"{key}: cannot reach the Ray cluster's head at {address}: {why}")
    try:
        with _keep_sigterm():
            ray.init(address=address, **{k: v for k, v in quiet.items() if k != "include_dashboard"})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"ray.address: cannot connect to the Ray cluster at {address}: {e}") from None
    return ray.shutdown  # disconnects this driver; the cluster stays


def _restore(variables: dict[str, str]) -> None:
    for name in variables:
        os.environ.pop(name, None)
    if variables:
        _reload_auth()


def _reload_auth() -> None:
    """Ray reads its auth mode and token once per process (at import): make it read them again from the
    environment, as Ray does itself when it turns token authentication on (private names, hence the guard)."""
    with contextlib.suppress(Exception):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _running_here(ray: Any) -> bool:
    """Whether a Ray cluster runs on this machine (what ray.init(address="auto") would connect to)."""
    with contextlib.suppress(Exception):
        from ray._private.services import find_bootstrap_address

        return bool(find_bootstrap_address(None))
    return False


@contextlib.contextmanager
def _keep_sigterm():
    """ray.init replaces this process's SIGTERM handler with a bare sys.exit; the run's own (launch/processes.py
    `interrupt_on_sigterm`: a teardown like Ctrl-C's, which stops what the run started) is put back."""
    ours = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if callable(ours):
            signal.signal(signal.SIGTERM, ours)


@contextlib.contextmanager
def _without(name: str):
    value = os.environ.pop(name, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def alive_nodes(ray: Any) -> list[RayNode]:
    return [
        RayNode(
            n["NodeID"],
            n["NodeManagerAddress"],
            n.get("NodeManagerHostname") or n["NodeManagerAddress"],
            n["Resources"],
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _node_state(ray: Any, node_id: str) -> str | None:
    """None while Ray lists node `node_id` alive, else what it says of it."""
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            if n.get("Alive"):
                return None
            # DeathReason is an enum's number (1: unexpected termination), the message says it in words
            reason = str(n.get("DeathReasonMessage") or n.get("DeathReason") or "")
            return f"dead in Ray's node table ({reason or 'no reason given'})"
    return "gone from Ray's node table"


def _is_here(ip: str) -> bool:
    """Whether `ip` is an address of this host (the route to one's own address starts from it)."""
    return route_address(ip) == ip


def make_parts(ray: Any, run_dir: str, env: dict[str, str]) -> RayParts:
    """The Ray operations the cluster performs, as plain functions (tests can replace them)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_class = ray.remote(NodeProcesses)

    def future(ref: Any) -> asyncio.Future:
        fut = asyncio.wrap_future(ref.future())
        fut.add_done_callback(_retrieved)  # an actor killed at teardown fails its pending calls: no noise for that
        return fut

    async def ready(group: Any, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(future(group.ready()), timeout_s)
            return True
        except TimeoutError:
            return False

    def new_actor(group: Any, index: int, bundle: dict[str, float]) -> Any:
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return actor_class.options(
            num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0),
            resources=custom or None,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        ).remote(run_dir, env)

    return RayParts(
        new_group=lambda bundles_, strategy: placement_group(bundles_, strategy=strategy),
        ready=ready,
        remove_group=remove_placement_group,
        new_actor=new_actor,
        kill_actor=lambda actor: ray.kill(actor, no_restart=True),
        node_state=functools.partial(_node_state, ray),
        future=future,
        disconnect=ray.shutdown,  # replaced by what `connect` returned
    )


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def process_env(cfg: RunConfig) -> dict[str, str]:
    """What the processes on the nodes get from here: the FORWARDED_ENV variables, then ray.env_vars."""
    here = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV) and k not in _NOT_FORWARDED}
    return {**here, **cfg.ray.env_vars}


class RayLauncher:
    """Start the run's servers and trainer job on the Ray cluster `ray.address` names (the module docstring)."""

    async def launch(self, cfg: RunConfig, *, model_path: str, trainer_resume: str | None = None) -> RayCluster:
        disconnect = connect(cfg.ray)
        ray = import_ray()
        cluster: RayCluster | None = None
        registry: Registry | None = None
        try:
            nodes = alive_nodes(ray)
            has_gpus = any(n.resources.get("GPU", 0) > 0 for n in nodes)
            b = bundles(cfg, has_gpus)
            check_fits(b, nodes)
            remote = [n for n in nodes if not _is_here(n.ip)]
            here = route_address(remote[0].ip) if remote else "127.0.0.1"
            check_reachable(cfg, nodes, here if remote else nodes[0].ip)
            log.info(
                "ray: %d node(s) alive (%s); a server bundle is %s, a trainer node's %s",
                len(nodes),
                ", ".join(n.describe() for n in nodes),
                b.server,
                b.trainer,
            )
            secret = os.urandom(32)
            registry = Registry(secret, cfg.run_dir)
            await registry.start("0.0.0.0" if remote else "127.0.0.1", here if remote else None)
            run_dir = os.path.abspath(cfg.run_dir)
            model = os.path.abspath(model_path) if os.path.exists(model_path) else model_path
            parts = make_parts(ray, run_dir, process_env(cfg))
            parts.disconnect = disconnect
            cluster = RayCluster(cfg, parts, registry, secret, model)
            cluster.server_bundle, cluster.trainer_bundle = b.server, b.trainer
            await self._start(cluster, cfg, model, trainer_resume, remote=bool(remote))
        except BaseException:
            if cluster is not None:
                await cluster.shutdown()
            else:
                if registry is not None:
                    await registry.close()
                await asyncio.to_thread(disconnect)
            raise
        return cluster

    async def _start(
        self, cluster: RayCluster, cfg: RunConfig, model: str, resume: str | None, *, remote: bool
    ) -> None:
        r, srv = cfg.ray, cfg.server
        tag = secrets.token_hex(3)
        cluster.start_trainer_job = functools.partial(_start_trainer_job, cluster, cfg, model, tag, remote)
        # both kinds of bundles at once: Ray starts the actors' worker processes side by side
        placed = await asyncio.gather(
            cluster.place_trainers(cfg.train.nnodes, r.placement_timeout_s),
            self._place_servers(cluster, cfg),
            return_exceptions=True,  # both end before anything is torn down
        )
        for failed in placed:
            if isinstance(failed, BaseException):
                raise failed
        if not placed[0]:
            raise ChildFailed(
                f"ray.placement_timeout_s: Ray did not place the trainer job ({cfg.train.nnodes} node(s) of "
                f"{cluster.trainer_bundle}, one per node) within {r.placement_timeout_s:g}s: other work holds the "
                "resources, or the nodes that fit are fewer than they look"
            )
        await cluster.start_trainer_job(resume, 0)
        if srv.backend == "external":
            cluster.servers = [_handle(i, u) for i, u in enumerate(srv.urls)]
            probe = [
                _Proc(s.name, "server", RayNode("", "", "external"), 0, "", _never(), url=s.url)
                for s in cluster.servers
            ]
            await cluster.wait_healthy(probe, srv.startup_timeout_s, only=True)
        else:
            cluster.start_server_on = functools.partial(_start_server, cluster, cfg, model)
            procs = await asyncio.gather(
                *(
                    cluster.start_server_on(i, a, n, srv.port + i if srv.port else 0)
                    for i, (a, n) in enumerate(cluster.server_actors)
                )
            )
            for p in procs:
                cluster.add(p)
            await cluster.wait_healthy(procs, srv.startup_timeout_s)
            cluster.servers = [_handle(i, p.url or "") for i, p in enumerate(procs)]
        cluster.join = JoinFile(
            join_file(cfg.run_dir),
            api_key=srv.api_key,
            startup_timeout_s=srv.startup_timeout_s,
            exclude=[s.url for s in cluster.servers],
        )

    @staticmethod
    async def _place_servers(cluster: RayCluster, cfg: RunConfig) -> None:
        """The servers' group (SPREAD: over as many nodes as have room) and an actor in each of its bundles."""
        r, srv = cfg.ray, cfg.server
        if srv.backend == "external":
            return
        group = cluster.parts.new_group([dict(cluster.server_bundle) for _ in range(srv.num_servers)], "SPREAD")
        cluster.server_group = group
        if not await cluster.parts.ready(group, r.placement_timeout_s):
            raise ChildFailed(
                f"ray.placement_timeout_s: Ray did not place the {srv.num_servers} server bundle(s) of "
                f"{cluster.server_bundle} within {r.placement_timeout_s:g}s: other work holds the resources"
            )
        actors = [cluster.parts.new_actor(group, i, cluster.server_bundle) for i in range(srv.num_servers)]
        nodes = await asyncio.gather(
            *(cluster._placed(a, r.placement_timeout_s, f"server{i}") for i, a in enumerate(actors))
        )
        cluster.server_actors = list(zip(actors, nodes))


def _handle(i: int, url: str) -> ServerHandle:
    return ServerHandle(f"server{i}", url.rstrip("/"))


def _never() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


async def _start_server(
    cluster: RayCluster, cfg: RunConfig, model: str, index: int, actor: Any, node: RayNode, port: int
) -> _Proc:
    """Server `index` through `actor` on `node`, with the local launcher's command (launch/processes.py)."""
    srv = cfg.server
    if srv.backend == "embedded":
        kwargs: dict[str, Any] = dict(
            index=index,
            model=model,
            host=srv.host,
            port=port,
            device=srv.device,
            max_total_tokens=srv.max_total_tokens,
            max_running_requests=srv.max_running_requests,
            api_key=srv.api_key,
            torch_threads=srv.torch_threads,
            prefix_cache=srv.prefix_cache,
            dtype=cfg.model.dtype,
        )
    else:
        kwargs = dict(
            index=index, model=model, host=srv.host, port=port, tp_size=srv.gpus_per_server, **sglang_options(cfg)
        )
    try:
        info = await cluster.parts.future(actor.start_server.remote(srv.backend, kwargs, srv.startup_timeout_s))
    except Exception as e:
        raise ChildFailed(f"server{index} on {node.describe()} did not start: {e}") from None
    log.info("server%d runs on %s at %s (pid %d there)", index, node.describe(), info["url"], info["pid"])
    done = cluster.parts.future(actor.wait.remote(info["pid"]))
    return _Proc(f"server{index}", "server", node, info["pid"], info["log_path"], done, url=info["url"])


async def _start_trainer_job(
    cluster: RayCluster, cfg: RunConfig, model: str, tag: str, remote: bool, resume: str | None, generation: int
) -> None:
    """One torchrun agent per trainer bundle, through its actor: a standalone job on one node, else a c10d job
    whose store is on the first agent's node (a port free there), in a rendezvous of its own per generation."""
    t = cfg.train
    actors = cluster.trainer_actors
    n = len(actors)
    rdzv = list(t.torchrun_args)
    if n > 1:
        endpoint = t.rdzv.endpoint if (t.rdzv.endpoint and n == t.nnodes) else None
        if endpoint is None:
            port = await cluster.parts.future(actors[0][0].free_port.remote())
            endpoint = f"{actors[0][1].ip}:{port}"
        rdzv = c10d_args(nnodes=n, endpoint=endpoint, run_id=f"ray-{tag}-{generation}", timeout_s=t.rdzv.timeout_s)
    env = cluster.registry.env() if t.rdzv.discovery == "registry" else {}
    for k, (actor, node) in enumerate(actors):
        name = "trainer" if t.nnodes == 1 else f"trainer{k}"
        kwargs = dict(
            model=model,
            nproc=t.nproc,
            config_json=msgspec.json.encode(t).decode(),
            seed=cfg.seed,
            secret_hex=cluster.secret.hex(),
            torch_threads=t.torch_threads,
            resume=resume,
            torchrun_args=rdzv,
            name=name,
            rpc_host="0.0.0.0" if remote else None,
            env=env,
        )
        info = await cluster.parts.future(actor.start_trainer.remote(kwargs))
        log.info("%s (torchrun agent %d of %d) runs on %s (pid %d there)", name, k, n, node.describe(), info["pid"])
        done = cluster.parts.future(actor.wait.remote(info["pid"]))
        cluster.add(_Proc(name, "trainer", node, info["pid"], info["log_path"], done))
