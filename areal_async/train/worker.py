"""One trainer rank: `torchrun --nproc_per_node N -m areal_async.train.worker --model DIR --run-dir DIR ...`.

Each rank loads its FSDP2 shard of the model (train/engine.py), then serves the controller over our RPC channel
(areal_async/net/rpc.py) and says where it listens (net/rank_registry.py's `announce_rank`: the rank file
`{run_dir}/trainer/rank{r}.json`, or a report to the controller's registry). The controller (`TrainerGroup` in
train/client.py) connects to every rank and sends each call to all of them.
"""

# Handlers that touch torch run in the RPC server's single worker thread, in arrival order, so the collectives of
# successive calls line up on every rank.
#
# The rank exits cleanly (barrier, destroy_process_group, rank file removed) on the `shutdown` RPC, on SIGTERM/SIGINT,
# when its parent (torchrun's agent) dies, or when the controller's connection has been gone for `--orphan-timeout`
# seconds, so an abandoned job does not linger. The RPC secret comes from the environment (AREAL_RPC_SECRET, hex),
# never the command line, where every user of the machine could read it.
#
# Devices: `TrainConfig.device` "auto" is this rank's CUDA device (LOCAL_RANK) with nccl, else CPU with gloo.
# Multi-node: use torchrun's own rendezvous (`--nnodes --rdzv-backend c10d --rdzv-endpoint ...` in
# `TrainConfig.torchrun_args`), a run dir on a filesystem every node and the controller share, and `--rpc-host` set
# to an address of this node the controller can reach (the default 127.0.0.1 only serves a controller on the same
# host). Rank 0 reports the address inference servers should use for the broadcast rendezvous (TrainerInfo.host, see
# `advertised_address`; override with AREAL_TRAINER_ADDRESS).
#
# Broadcast weight sync (`TrainConfig.weight_sync`): the rank sets NCCL_CUMEM_ENABLE=0 unless the environment sets
# it, as SGLang does for its own processes; NCCL peers that disagree on it fail their same-node p2p setup.

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping

import msgspec

from areal_async.config import ConfigError, TrainConfig, from_dict
from areal_async.host.startup_gc import collector_paused
from areal_async.host.torch_threads import one_thread_until_set
from areal_async.net.address import ADDRESS_ENV, host_address

# rank_file is not used here: re-exported because tests/test_clean_runs.py reads worker.rank_file
from areal_async.net.rank_registry import announce_rank, rank_file, read_secret  # noqa: F401
from areal_async.net.rpc import RpcServer
from areal_async.train.messages import (
    AbortBroadcastRequest,
    AbortBroadcastResult,
    BroadcastEndpoint,
    DeltaBroadcastPlan,
    DeltaBroadcastPrepare,
    DeltaPublishRequest,
    DeltaPublishResult,
    DeltaSendRequest,
    IdentityRequest,
    OpenBroadcastRequest,
    WeightPlan,
    WeightPlanRequest,
)
from areal_async.types import (
    BroadcastRequest,
    BroadcastResult,
    CheckpointRequest,
    CheckpointResult,
    Empty,
    InitBroadcastRequest,
    PublishRequest,
    PublishResult,
    TrainerInfo,
    TrainStepRequest,
    TrainStepResult,
)

log = logging.getLogger("areal_async.train.worker")

_TEARDOWN_TIMEOUT_S = 30.0  # a barrier that has not completed by then means the other ranks are gone
# After an unrequested stop (a signal, torchrun's agent gone, the controller gone), how long a running call may take
# to finish, and then the teardown barrier: nobody waits for the call's result any more, and a call stuck in a
# collective (a peer rank died or was stopped) would otherwise hold the rank, and the teardown that signalled it,
# for as long. Saves are atomic (a save cut short leaves the previous checkpoint), so a few seconds do. The shutdown
# RPC is not bounded by this: it runs after the calls before it, and the rank exits cleanly once they are done.
_STOP_GRACE_S = 3.0
_STOP_TEARDOWN_S = 10.0  # the teardown barrier after such a stop: every rank was signalled, or its peers are gone


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_async.train.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory of the initial policy")
    p.add_argument("--run-dir", required=True, help="rank files go to RUN_DIR/trainer/")
    p.add_argument("--config-json", default="{}", help="TrainConfig as JSON (omitted keys take their defaults)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--resume", default=None, help="a checkpoint directory written by save_checkpoint")
    p.add_argument("--rpc-host", default="127.0.0.1", help="interface the RPC server listens on")
    p.add_argument(
        "--orphan-timeout",
        type=float,
        default=120.0,
        help="exit when the controller has been disconnected this many seconds",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=3600.0,
        help="exit when no controller has connected this many seconds after start",
    )
    p.add_argument(
        "--broadcast-timeout", type=float, default=600.0, help="timeout of collectives in the weight-broadcast group"
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


class TrainerService:
    """The RPC methods of one rank. `host` is the address this rank reports (TrainerInfo.host, see
    `advertised_address`)."""

    def __init__(self, engine, server, host: str = "127.0.0.1") -> None:
        self.engine = engine
        self.server = server
        self.host = host
        self._deltas = None  # train/delta_publish.py's DeltaPublisher, made on first use (it imports torch)
        self._adapters = None  # train/lora_publish.py's AdapterPublisher (train.lora), made on first use
        self._sent_version: int | None = None  # the version the last complete broadcast sent
        self._sender = None  # train/delta_broadcast.py's DeltaSender, made on first use

    def _delta_sender(self):
        if self._sender is None:
            from areal_async.train.delta_broadcast import DeltaSender  # lazy: torch

            self._sender = DeltaSender()
        return self._sender

    def prepare_delta_broadcast(self, req: DeltaBroadcastPrepare) -> DeltaBroadcastPlan:
        """train.delta_sync with broadcast: the delta of the version held now (train/delta_broadcast.py); "off"
        without a gather when delta sync is off."""
        from areal_async.types import WeightSpec

        e = self.engine
        if getattr(e, "lora", None):  # train.lora: the adapters alone (train/lora_publish.py)
            if req.version != e.version:
                raise ValueError(f"the trainers hold version {e.version}, not {req.version}")
            e.bind_device()
            return self._adapter_publisher().prepare_broadcast(
                e.model,
                lora=e.lora,
                rank=e.cfg.lora.rank,
                alpha=e.cfg.lora.alpha,
                version=e.version,
                served=req.served_dtype,
                skip=e.tied_names,
            )
        if not getattr(e.cfg, "delta_sync", False):
            return DeltaBroadcastPlan(kind="off", version=e.version, spec=WeightSpec(names=[], dtypes=[], shapes=[]))
        if req.version != e.version:
            raise ValueError(f"the trainers hold version {e.version}, not {req.version}")
        e.bind_device()
        return self._delta_sender().prepare(
            e.model, version=e.version, served=req.served_dtype, skip=e.tied_names, checkpoint_dtype=e.checkpoint_dtype
        )

    def send_delta(self, req: DeltaSendRequest) -> BroadcastResult:
        """Rank 0 broadcasts the payloads `prepare_delta_broadcast` made for `req.version` (no gather)."""
        if getattr(self.engine, "lora", None):
            return self.engine._weight_broadcaster().send_payloads(
                req.group_name, self._adapter_publisher().take(req.version)
            )
        payloads = self._delta_sender().take(req.version)
        try:
            return self.engine._weight_broadcaster().send_payloads(req.group_name, payloads)
        except Exception:
            self._delta_sender().reset()  # the servers may hold anything now: the next one is full
            raise

    def _delta_publisher(self):
        if self._deltas is None:
            from areal_async.train.delta_publish import DeltaPublisher  # lazy: torch loads only in main()

            self._deltas = DeltaPublisher()
        return self._deltas

    def _adapter_publisher(self):
        if self._adapters is None:
            from areal_async.train.lora_publish import AdapterPublisher  # lazy: torch

            self._adapters = AdapterPublisher()
        return self._adapters

    def register(self) -> None:
        s = self.server
        s.register("info", self.info, Empty)  # on the loop: answers even while a step runs
        s.register("train_step", self.train_step, TrainStepRequest, blocking=True)
        s.register("publish", self.publish, PublishRequest, blocking=True)
        s.register("publish_delta", self.publish_delta, DeltaPublishRequest, blocking=True)
        s.register("identity", self.identity, IdentityRequest, blocking=True)
        s.register("prepare_delta_broadcast", self.prepare_delta_broadcast, DeltaBroadcastPrepare, blocking=True)
        s.register("send_delta", self.send_delta, DeltaSendRequest, blocking=True)
        s.register("save_checkpoint", self.save_checkpoint, CheckpointRequest, blocking=True)
        s.register("load_checkpoint", self.load_checkpoint, CheckpointRequest, blocking=True)
        s.register("weight_plan", self.weight_plan, WeightPlanRequest, blocking=True)
        s.register("open_broadcast", self.open_broadcast, OpenBroadcastRequest, blocking=True)
        s.register("init_broadcast", self.init_broadcast, InitBroadcastRequest, blocking=True)
        s.register("broadcast", self.broadcast, BroadcastRequest, blocking=True)
        s.register("abort_broadcast", self.abort_broadcast, AbortBroadcastRequest)  # on the loop: beside a broadcast
        s.register("shutdown", self.shutdown, Empty, blocking=True)

    def info(self, _: Empty) -> TrainerInfo:
        return msgspec.structs.replace(self.engine.info(), host=self.host)

    def train_step(self, req: TrainStepRequest) -> TrainStepResult:
        version, stats = self.engine.train_step(req.batch)
        return TrainStepResult(version=version, stats=stats)

    def publish(self, req: PublishRequest) -> PublishResult:
        self._delta_publisher().reset()  # its pruning may remove the delta chain's snapshot
        return self.engine.publish(req.root, req.version, req.keep)

    def publish_delta(self, req: DeltaPublishRequest) -> DeltaPublishResult:
        """A full snapshot or a delta (train.delta_sync, train.delta_full_every), or with train.lora the adapters
        alone, with the identity of what the servers then hold as served in `req.served_dtype`
        (train/delta_publish.py, train/lora_publish.py)."""
        e = self.engine
        e.bind_device()
        if getattr(e, "lora", None):  # train.lora: the adapters alone (train/lora_publish.py)
            lcfg = e.cfg.lora
            return self._adapter_publisher().publish(
                e.model,
                lora=e.lora,
                rank=lcfg.rank,
                alpha=lcfg.alpha,
                dropout=lcfg.dropout,
                source_dir=e.model_path,
                root=req.root,
                version=req.version,
                keep=req.keep,
                served=req.served_dtype,
                skip=e.tied_names,
                identity=req.identity,
            )
        return self._delta_publisher().publish(
            e.model,
            source_dir=e.model_path,
            root=req.root,
            version=req.version,
            keep=req.keep,
            checkpoint_dtype=e.checkpoint_dtype,
            served=req.served_dtype,
            skip=e.tied_names,
            delta=e.cfg.delta_sync,
            full_every=e.cfg.delta_full_every,
            force_full=req.force_full,
        )

    def identity(self, req: IdentityRequest):
        """The identity of the weights held now, as served in `req.served_dtype`: the digests the last broadcast
        took of what it sent when it sent this version in that dtype, else a gather (collective) of every
        parameter."""
        from areal_async.train.publish import iter_full_tensors  # lazy: torch
        from areal_async.weights.digest import IdentityBuilder, served_dtype

        e = self.engine
        dtype = served_dtype(req.served_dtype)
        sent_dtype = getattr(e, "checkpoint_dtype", None)  # what `broadcast` sends (engine.py)
        if self._sent_version == e.version and dtype == sent_dtype:  # the broadcast hashed what it sent
            sent = e._weight_broadcaster().last_sent
            if sent is None:  # not rank 0: its answer is not read
                return IdentityBuilder(dtype, e.version).finish()
            sent.version = e.version
            return sent.finish()
        e.bind_device()
        builder = IdentityBuilder(dtype, e.version)
        for name, tensor in iter_full_tensors(e.model, skip=e.tied_names, dtype=e.checkpoint_dtype, to_cpu=True):
            if tensor is not None:
                builder.add(name, tensor)
        return builder.finish()

    def save_checkpoint(self, req: CheckpointRequest) -> CheckpointResult:
        seconds = self.engine.save_checkpoint(req.path)
        return CheckpointResult(path=os.path.abspath(req.path), version=self.engine.version, seconds=seconds)

    def load_checkpoint(self, req: CheckpointRequest) -> CheckpointResult:
        self._sent_version = None
        if self._sender is not None:
            self._sender.reset()
        self._delta_publisher().reset()  # a resume or a rollback: the held bits are of another lineage
        seconds = self.engine.load_checkpoint(req.path)
        return CheckpointResult(path=os.path.abspath(req.path), version=self.engine.version, seconds=seconds)

    def weight_plan(self, req: WeightPlanRequest) -> WeightPlan:
        from areal_async.train.broadcast import spec_bytes  # lazy: it imports torch, which loads only in main()

        buckets = self.engine.weight_plan(req.bucket_bytes)
        return WeightPlan(buckets=buckets, num_bytes=sum(spec_bytes(b) for b in buckets))

    def open_broadcast(self, req: OpenBroadcastRequest) -> BroadcastEndpoint:
        port = self.engine.open_broadcast(req.group_name, req.world_size, self.host, req.port)
        return BroadcastEndpoint(address=self.host, port=port)

    def init_broadcast(self, req: InitBroadcastRequest) -> Empty:
        self.engine.init_broadcast(req)
        return Empty()

    def broadcast(self, req: BroadcastRequest) -> BroadcastResult:
        self._sent_version = None
        result = self.engine.broadcast(req)
        self._sent_version = self.engine.version  # every rank: `identity` decides alike everywhere
        return result

    def abort_broadcast(self, req: AbortBroadcastRequest) -> AbortBroadcastResult:
        return AbortBroadcastResult(running=self.engine._weight_broadcaster().request_abort(req.group_name, req.reason))

    def shutdown(self, _: Empty) -> Empty:
        self.server.request_stop()  # serve_forever returns once this reply is sent
        return Empty()


def nccl_environment(cfg: TrainConfig, environ: MutableMapping[str, str]) -> None:
    """Broadcast sync: NCCL_CUMEM_ENABLE=0 unless set. SGLang runs its processes with it; an NCCL peer with the
    default (cuMem on) fails the same-node p2p setup of the weight-update group ("p2p.cc ... invalid argument")."""
    if cfg.weight_sync == "broadcast":
        environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def advertised_address(rpc_host: str) -> str:
    """The address this rank reports for the broadcast rendezvous: AREAL_TRAINER_ADDRESS when set; else the RPC
    interface when it is a specific one (127.0.0.1 by default: a single-host run stays on loopback); else, for a
    wildcard interface (0.0.0.0, ::), an address of this host other hosts can reach (train/dist.py)."""
    override = os.environ.get(ADDRESS_ENV, "").strip()
    if override:
        return override
    if rpc_host in ("", "0.0.0.0", "::"):
        return host_address()
    return rpc_host


async def _watchdog(server, args: argparse.Namespace, parent: int, stop) -> None:
    """Stop when the parent (pid `parent`, noted at start-up: it may have died while the model loaded) is gone, or
    the controller is: no orphaned trainers."""
    started = last_seen = time.monotonic()
    ever_connected = False
    while True:
        now = time.monotonic()
        if os.getppid() != parent:
            stop(f"parent process {parent} exited", 1)
            return
        if server.num_clients > 0:
            ever_connected, last_seen = True, now
        elif ever_connected and now - last_seen > args.orphan_timeout:
            stop(f"the controller has been disconnected for {args.orphan_timeout:.0f}s", 1)
            return
        elif not ever_connected and now - started > args.connect_timeout:
            stop(f"no controller connected within {args.connect_timeout:.0f}s", 1)
            return
        await asyncio.sleep(1.0)


async def _serve(engine, args: argparse.Namespace, secret: bytes, parent: int) -> tuple[int, bool]:
    """Serve until stopped; returns (exit code: 0 after `shutdown` or a signal, 1 when orphaned, whether the stop
    was unrequested: a signal or the watchdog, not the shutdown RPC)."""
    threads = engine.cfg.torch_threads if engine.device.type == "cpu" else None

    def compute_thread() -> None:
        if threads is not None:
            import torch  # lazy: the module stays torch-free until main() calls one_thread_until_set()

            torch.set_num_threads(threads)

    server = RpcServer(secret, name=f"trainer-rank{engine.rank}", blocking_initializer=compute_thread)
    service = TrainerService(engine, server, host=advertised_address(args.rpc_host))
    service.register()
    loop = asyncio.get_running_loop()

    exit_code = 0
    unrequested = False  # stopped by a signal or the watchdog rather than by the shutdown RPC
    deadlines: list[threading.Timer] = []

    def stop(reason: str, code: int = 0) -> None:
        nonlocal exit_code, unrequested
        exit_code = max(exit_code, code)
        unrequested = True
        log.warning("stopping: %s", reason)
        server.request_stop()
        # a call stuck in a collective (another rank died) would keep serve_forever waiting forever
        timer = threading.Timer(
            _STOP_GRACE_S, lambda: (log.error("still busy %.0fs after the stop; exiting", _STOP_GRACE_S), os._exit(1))
        )
        timer.daemon = True
        timer.start()
        deadlines.append(timer)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, f"signal {signal.Signals(sig).name}")
    address = await server.start_tcp(args.rpc_host, 0)
    # a rank file in run_dir, or a report to the controller's registry when AREAL_REGISTRY is set (multi-node)
    path = await announce_rank(args.run_dir, engine.rank, engine.world_size, address, secret)
    log.info(
        "rank %d/%d serving on %s (model %s, device %s)",
        engine.rank,
        engine.world_size,
        address,
        args.model,
        engine.device,
    )
    watchdog = loop.create_task(_watchdog(server, args, parent, stop))
    try:
        await server.serve_forever()
    finally:
        for timer in deadlines:
            timer.cancel()
        watchdog.cancel()
        engine.close_broadcast()
        try:
            if path:
                os.remove(path)
        except OSError:
            pass
    return (exit_code, unrequested)


def _teardown(engine, timeout_s: float = _TEARDOWN_TIMEOUT_S) -> None:
    """Barrier, then destroy the process group, bounded: ranks that are gone must not keep us alive."""
    import torch.distributed as dist  # lazy: the module stays torch-free until main() calls one_thread_until_set()

    def run() -> None:
        try:
            engine.bind_device()
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()
        except Exception as e:  # peers already gone
            log.warning("process-group teardown: %s", e)

    t = threading.Thread(target=run, name="teardown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.error("teardown barrier did not complete in %.0fs; exiting without it", timeout_s)
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()
    args = _parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s trainer[{rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        try:
            secret = read_secret()
        except ValueError as e:
            raise ValueError(f"{e} (the launcher passes the run's RPC secret in the environment)") from None
        cfg = from_dict(json.loads(args.config_json), TrainConfig)
    except (ValueError, ConfigError, msgspec.ValidationError) as e:  # json.JSONDecodeError is a ValueError
        log.error("bad arguments: %s", e)
        return 2

    # Before torch loads: every thread starts with one torch thread; the RPC worker thread that runs the train steps
    # sets the rank's count (ranks share the host's cores) and is then the only one holding OpenMP workers
    # (areal_async/host/torch_threads.py: a second thread with a team slows every op of the first).
    one_thread_until_set()
    with collector_paused():  # torch, transformers and the model: no full collections while they load
        from areal_async.train.engine import TrainEngine, init_distributed  # lazy: torch loads here, after the above

        nccl_environment(cfg, os.environ)  # before the first communicator: NCCL reads it then
        log.info(
            "NCCL_CUMEM_ENABLE=%s TORCH_NCCL_ASYNC_ERROR_HANDLING=%s",
            os.environ.get("NCCL_CUMEM_ENABLE", "<unset>"),
            os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "<unset>"),
        )
        device = init_distributed(cfg.device)
        engine = TrainEngine(args.model, cfg, seed=args.seed, device=device, broadcast_timeout_s=args.broadcast_timeout)
        if args.resume:
            engine.load_checkpoint(args.resume)
            log.info("resumed from %s at version %d", args.resume, engine.version)
    code, unrequested = asyncio.run(_serve(engine, args, secret, parent))
    # stopped unasked, the peers are stopping too (torchrun signals every rank) or gone: do not wait long for them
    _teardown(engine, _STOP_TEARDOWN_S if unrequested else _TEARDOWN_TIMEOUT_S)
    return code


if __name__ == "__main__":
    exit_code = main()
    # Everything is flushed, closed and torn down by now; skip the interpreter's own finalisation, which after a
    # torch.distributed job spends seconds in C++ destructors and would only delay torchrun and the controller.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
