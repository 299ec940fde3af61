"""Trainer side of SGLang's weight broadcast (/init_weights_update_group + /update_weights_from_distributed).

The group is a process group of its own, apart from the trainers' FSDP group: trainer rank 0 is group rank 0 and
hosts the rendezvous store at (master_address, master_port); server ranks join from `rank_offset` = 1 on. Only
trainer rank 0 is a member, but every trainer rank takes part in `broadcast` because gathering a full parameter
out of FSDP is an all-gather among the trainers.

Choreography (driven by the controller, see `TrainerGroup.broadcast_weights` in train/client.py):

    1. controller: `weight_plan(bucket_bytes)` from trainer rank 0 -> buckets of (names, dtypes, shapes)
    2. controller: `open_broadcast` -> rank 0 hosts the group's TCPStore (a free port unless one is given) and
       reports where; then concurrently trainer `init_broadcast` and every server's /init_weights_update_group
       (each side blocks in the rendezvous until the other arrives); done once
    3. controller, concurrently: trainer `broadcast(version)`, and for each bucket in order, every server's
       /update_weights_from_distributed(bucket) -- the trainer broadcasts the bucket's tensors one by one, in the
       announced order, while that HTTP call is pending; the server returns once it has them all. Only the last
       bucket carries the version and the cache flush (a server labels nothing v+1 before it has all of v+1);
       the controller pauses generation around the whole update, so no request runs on half-updated weights.
       Each member has a receive loop of its own; at a member's first failed bucket the controller calls
       `abort_broadcast` (served on the RPC loop, beside this call: `WeightBroadcaster.request_abort`), rank 0
       stops sending, finishes the gathers with the other ranks, and every rank raises.

Tensors go one `broadcast` per tensor, in the checkpoint's dtype, exactly as SGLang receives them; buckets only bound
how much a server allocates per HTTP call. The plan is a pure function of the model and `bucket_bytes`, so the
broadcast recomputes it and returns it for the controller to check.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from areal_async.net.custom_group import new_custom_group, open_store
from areal_async.train.dist import agree
from areal_async.train.errors import BroadcastError
from areal_async.train.publish import iter_full_tensors
from areal_async.types import BroadcastResult, InitBroadcastRequest, WeightSpec
from areal_async.weights.digest import IdentityBuilder

__all__ = ["WeightBroadcaster", "plan_buckets", "spec_bytes", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang's `dtypes` field uses."""
    return str(dtype).removeprefix("torch.")


def spec_bytes(spec: WeightSpec) -> int:
    """Bytes the tensors of one bucket occupy."""
    return sum(math.prod(shape) * getattr(torch, dt).itemsize for dt, shape in zip(spec.dtypes, spec.shapes))


def plan_buckets(model: nn.Module, *, skip: set[str], dtype: torch.dtype, bucket_bytes: int) -> list[WeightSpec]:
    """Group the state-dict entries, in order, into buckets of at most `bucket_bytes` (a bigger tensor is a
    bucket of its own). Local: reads only global shapes, no collective."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[WeightSpec] = []
    current = WeightSpec(names=[], dtypes=[], shapes=[])
    size = 0
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        sent = dtype if value.is_floating_point() else value.dtype  # as iter_full_tensors sends it
        nbytes = value.numel() * sent.itemsize
        if current.names and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = WeightSpec(names=[], dtypes=[], shapes=[]), 0
        current.names.append(name)
        current.dtypes.append(dtype_name(sent))
        current.shapes.append(list(value.shape))
        size += nbytes
    if current.names:
        buckets.append(current)
    return buckets


class WeightBroadcaster:
    """Holds the weight-update groups this trainer rank created (rank 0 only) and sends the weights through them."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.devices: dict[str, torch.device] = {}
        self.stores: dict[str, tuple[dist.TCPStore, int]] = {}  # group name -> (store rank 0 hosts, its port)
        # group name -> why the controller aborted it; set from the RPC loop's thread while `broadcast` runs in
        # the worker thread, so that a member lost mid-update ends the broadcast at once, not at its deadline
        self.aborted: dict[str, str] = {}
        self._running: str | None = None  # the group `broadcast` is sending on now
        # rank 0: digests of what the last complete broadcast sent, in the dtype it sent (policy identity for a
        # transport that publishes nothing: the controller checks the servers against it; built while sending)
        self.last_sent: IdentityBuilder | None = None
        self._delivered: str | None = None  # the group whose last send was a delta that every member received
        self._lock = threading.Lock()

    def request_abort(self, group_name: str, reason: str) -> bool:
        """Abort group `group_name` from any thread: a broadcast running on it stops sending before its next
        tensor (or in its wait for the current bucket) and raises BroadcastError; a group with no broadcast running
        is dropped now. Either way the group is finished: a later broadcast on it fails at once until a new group
        of that name is made. Returns True when a broadcast on it was running (it stops), False otherwise."""
        with self._lock:
            if group_name not in self.groups and group_name != self._running:
                return False
            if self._delivered == group_name and self._running is None:
                # late: a delta's payloads all arrived before a member refused it; the group stays for the full
                # broadcast of the same version that follows (see _complete_delta)
                self._delivered = None
                return False
            self.aborted[group_name] = reason or "aborted by the controller"
            running = self._running == group_name
        if not running:
            self._abort(group_name)
        return running

    def _check_aborted(self, group_name: str) -> None:
        reason = self.aborted.get(group_name)
        if reason is not None:
            raise BroadcastError(f"weight-update group {group_name!r} aborted: {reason}")

    def open_store(self, group_name: str, world_size: int, host: str, port: int) -> int:
        """Rank 0: host the rendezvous store of group `group_name` on `port` (0: a free port, bound here, so no
        other process can take it between now and the servers' connect). Returns the port; 0 on other ranks."""
        if dist.get_rank() != 0:
            return 0
        # one live group at a time: a group superseded by a fleet change may have a dead peer, and destroying it
        # at exit could hang the teardown; it is aborted here, while nothing is pending on it
        self.close()
        store = open_store(host, port, world_size, self.timeout_s)
        self.stores[group_name] = (store, int(store.port))
        return int(store.port)

    def init_group(self, req: InitBroadcastRequest, device: torch.device) -> None:
        """Rank 0: join group `req.group_name` as rank 0 on the store `open_store` made (or, for a request with a
        port and no open store, on a store made now); blocks until the servers join. Other trainer ranks:
        nothing. Re-initialising a name replaces the old group."""
        if req.world_size < 2:
            raise BroadcastError(
                f"world_size must be >= 2 (the trainer plus at least one server rank), got {req.world_size}"
            )
        if req.backend not in ("gloo", "nccl"):
            raise BroadcastError(f"backend must be 'gloo' or 'nccl', got {req.backend!r}")
        if req.backend == "nccl" and device.type != "cuda":
            raise BroadcastError("backend 'nccl' needs the trainer on CUDA; use 'gloo' on CPU")
        if dist.get_rank() != 0:
            return
        held = self.stores.get(req.group_name)
        if held is None or held[1] != req.master_port:
            if req.master_port == 0:
                raise BroadcastError(f"group {req.group_name!r}: master_port 0 needs open_broadcast first")
            self.open_store(req.group_name, req.world_size, req.master_address, req.master_port)
        store, _ = self.stores[req.group_name]
        if req.group_name in self.groups:  # a group of the same name on another store: leave it first
            self._destroy(self.groups.pop(req.group_name))
        self.aborted.pop(req.group_name, None)  # a new group of an aborted name starts afresh
        # the watchdog's timeout lies past the per-bucket deadline, so `_complete` raises first; cleanup-only error
        # handling for this group: an aborted weight group must not tear the trainer down (torchrun's default, 1)
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
            pg = new_custom_group(
                req.backend,
                store,
                world_size=req.world_size,
                rank=0,
                group_name=req.group_name,
                device=device,
                timeout_s=self.timeout_s + _WATCHDOG_MARGIN_S,
            )
        self.groups[req.group_name] = pg
        self.devices[req.group_name] = device if req.backend == "nccl" else torch.device("cpu")

    def broadcast(
        self, model: nn.Module, *, group_name: str, skip: set[str], dtype: torch.dtype, bucket_bytes: int
    ) -> BroadcastResult:
        """Collective among the trainers; rank 0 also broadcasts each full tensor to the group.

        Rank 0 waits for each bucket's broadcasts to complete before it gathers the next bucket: the servers take
        one bucket per HTTP call, so without the wait rank 0 would run ahead and hold every gathered tensor
        (the whole model, in the checkpoint dtype) on its device until the servers caught up.

        A failure on rank 0 (a bucket past its deadline, an abort the controller asked for, a failed send) stops
        the sending, not the gathering: rank 0 keeps taking part in the FSDP all-gathers to the end, so the other
        ranks are never left waiting in one, and then every rank raises (rank 0 the BroadcastError, the others its
        Peer twin). The trainers are then ready for the next call, and the controller can form a new group."""
        t0 = time.perf_counter()
        rank = dist.get_rank()
        with self._lock:
            pg = self.groups.get(group_name)
            self._delivered = None
            if rank == 0 and pg is not None:
                self._running = group_name
        try:
            missing = rank == 0 and pg is None
            why = self.aborted.get(group_name)
            agree(
                BroadcastError(
                    f"weight-update group {group_name!r} aborted: {why}"
                    if why is not None
                    else f"no weight-update group {group_name!r} on trainer rank 0: call init_broadcast first"
                )
                if missing
                else None,
                BroadcastError,
                "the weight broadcast could not start",
            )
            return self._send(
                model, pg, group_name=group_name, skip=skip, dtype=dtype, bucket_bytes=bucket_bytes, t0=t0
            )
        finally:
            with self._lock:
                if self._running == group_name:
                    self._running = None

    def _send(
        self,
        model: nn.Module,
        pg: dist.ProcessGroup | None,
        *,
        group_name: str,
        skip: set[str],
        dtype: torch.dtype,
        bucket_bytes: int,
        t0: float,
    ) -> BroadcastResult:
        buckets = plan_buckets(model, skip=skip, dtype=dtype, bucket_bytes=bucket_bytes)
        bucket_of = {name: i for i, spec in enumerate(buckets) for name in spec.names}
        send_device = self.devices.get(group_name, torch.device("cpu"))
        meter = _MemoryMeter(send_device)
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        current, num_bytes, held, held_peak = 0, 0, 0, 0
        error: BroadcastError | None = None
        self.last_sent = None
        sent = IdentityBuilder(dtype, -1)
        for name, tensor in iter_full_tensors(model, skip=skip, dtype=dtype, to_cpu=send_device.type == "cpu"):
            if tensor is None or error is not None:  # after a failure: still in every gather, sending nothing
                continue
            try:
                if bucket_of[name] != current:
                    self._complete(pending, send_device, group_name, current)
                    current, held = bucket_of[name], 0
                self._check_aborted(group_name)
                tensor = tensor.to(send_device)
                pending.append((dist.broadcast(tensor, group=pg, group_src=0, async_op=True), tensor))
                sent.add(name, tensor)  # hashed while the broadcast is on the wire (a host copy on CUDA)
            except Exception as e:
                error = self._failed(e, pending, group_name, current)
                continue
            size = tensor.numel() * tensor.element_size()
            num_bytes += size
            held += size
            held_peak = max(held_peak, held)
        if error is None and dist.get_rank() == 0:
            try:
                self._complete(pending, send_device, group_name, current)
            except Exception as e:
                error = self._failed(e, pending, group_name, current)
        agree(error, BroadcastError, "the weight broadcast failed")
        self.last_sent = sent
        return BroadcastResult(
            buckets=buckets,
            seconds=time.perf_counter() - t0,
            num_bytes=num_bytes,
            held_peak_bytes=held_peak,
            memory_peak_bytes=meter.peak(),
        )

    def send_payloads(self, group_name: str, payloads: list[torch.Tensor]) -> BroadcastResult:
        """Rank 0: broadcast prepared tensors (a delta's payloads, train/delta_broadcast.py) through `group_name`,
        in order, as one bucket; no gather, so the other ranks have nothing to do. Aborts and deadlines as for
        `broadcast`."""
        t0 = time.perf_counter()
        if dist.get_rank() != 0:
            return BroadcastResult(buckets=[], seconds=0.0, num_bytes=0, held_peak_bytes=0, memory_peak_bytes=0)
        with self._lock:
            pg = self.groups.get(group_name)
            if pg is not None:
                self._running = group_name
        try:
            if pg is None:
                self._check_aborted(group_name)
                raise BroadcastError(
                    f"no weight-update group {group_name!r} on trainer rank 0: call init_broadcast first"
                )
            device = self.devices.get(group_name, torch.device("cpu"))
            pending: list[tuple[dist.Work, torch.Tensor]] = []
            num_bytes = 0
            try:
                for t in payloads:
                    self._check_aborted(group_name)
                    t = t.to(device)
                    pending.append((dist.broadcast(t, group=pg, group_src=0, async_op=True), t))
                    num_bytes += t.numel()
                self._complete_delta(pending, group_name)
            except Exception as e:
                raise self._failed(e, pending, group_name, 0) from e
        finally:
            with self._lock:
                if self._running == group_name:
                    self._running = None
        return BroadcastResult(
            buckets=[],
            seconds=time.perf_counter() - t0,
            num_bytes=num_bytes,
            held_peak_bytes=num_bytes,
            memory_peak_bytes=0,
        )

    def _complete_delta(self, pending: list[tuple[dist.Work, torch.Tensor]], group_name: str) -> None:
        """Wait for a delta's sends. A member answers only once it has received every payload, so an abort that
        comes from a member refusing the delta (its base is not the trainer's) finds the sends complete, or about
        to be: within `_DELTA_GRACE_S` of the abort they count as sent and the group stays usable (the controller
        sends the version again in full through it). Sends still pending then (a member gone) fail as usual."""
        deadline = time.monotonic() + self.timeout_s
        grace_until: float | None = None
        for work, _ in pending:
            while not work.is_completed():
                now = time.monotonic()
                if group_name in self.aborted and grace_until is None:
                    grace_until = now + _DELTA_GRACE_S
                if grace_until is not None and now > grace_until:
                    self._check_aborted(group_name)
                if now > deadline:
                    raise BroadcastError(f"weight-update group {group_name!r}: the delta was not received in time")
                time.sleep(0.005)
            work.wait()
        pending.clear()
        with self._lock:
            self.aborted.pop(group_name, None)  # every payload arrived: a refusal afterwards is the member's business
            self._delivered = group_name

    def _failed(self, e: Exception, pending: list, group_name: str, bucket: int) -> BroadcastError:
        """Rank 0 stops sending on `group_name`: the work in flight is dropped with the group (it will never
        complete), and the error becomes the BroadcastError every rank agrees on after the gathers."""
        pending.clear()
        self._abort(group_name)
        if isinstance(e, BroadcastError):
            return e
        return BroadcastError(f"weight-update group {group_name!r}: bucket {bucket} failed: {type(e).__name__}: {e}")

    def close(self, group_name: str | None = None) -> None:
        """Leave one group (or all) and stop hosting its store."""
        names = [group_name] if group_name is not None else list(set(self.groups) | set(self.stores))
        for name in names:
            self.aborted.pop(name, None)
            pg = self.groups.pop(name, None)
            self.devices.pop(name, None)
            self.stores.pop(name, None)
            if pg is not None:
                self._destroy(pg)

    def _complete(
        self, pending: list[tuple[dist.Work, torch.Tensor]], device: torch.device, group_name: str, bucket: int
    ) -> None:
        """Wait until every broadcast in `pending` has finished, at most `timeout_s`, then drop the tensors.

        Polled (`is_completed`, which for NCCL queries the work's CUDA event and does not block), so that a member
        lost mid-bucket (a crash, or an SGLang that failed to allocate a tensor and returned without receiving the
        rest of the bucket) ends in a `BroadcastError` here, on rank 0, instead of a blocking stream synchronise
        that only the NCCL watchdog ends, by tearing the process down. The group is then aborted and dropped: the
        controller forms a new one."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        try:
            for work, _ in pending:
                while not work.is_completed():
                    self._check_aborted(group_name)
                    if time.monotonic() > deadline:
                        raise BroadcastError(
                            f"weight-update group {group_name!r}: bucket {bucket} was not received "
                            f"within {self.timeout_s:g}s (a member left mid-broadcast?)"
                        )
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                work.wait()  # raises the work's error, if it failed
        except BaseException:
            pending.clear()
            self._abort(group_name)
            raise
        if device.type == "cuda" and pending:
            torch.cuda.current_stream(device).synchronize()  # completed already: returns at once
        pending.clear()

    def _abort(self, group_name: str) -> None:
        """Drop a group with work that will never complete: NCCL's communicator is aborted (destroying it would
        wait for that work); a gloo group is left to the garbage collector for the same reason."""
        pg = self.groups.pop(group_name, None)
        self.devices.pop(group_name, None)
        self.stores.pop(group_name, None)
        if pg is None:
            return
        from torch.distributed import distributed_c10d as c10d

        abort = getattr(c10d, "_abort_process_group", None)
        with contextlib.suppress(Exception):
            if abort is not None and dist.get_backend(pg) == "nccl":
                abort(pg)

    @staticmethod
    def _destroy(pg: dist.ProcessGroup) -> None:
        from torch.distributed import distributed_c10d as c10d

        abort = getattr(c10d, "_abort_process_group", None)
        try:
            if abort is not None and dist.get_backend(pg) == "nccl":
                abort(pg)  # a peer may be gone: an abort never waits for it, a destroy may
            else:
                dist.destroy_process_group(pg)
        except Exception:  # a group whose peers are gone may refuse a clean teardown
            pass


_DELTA_GRACE_S = 2.0  # see WeightBroadcaster._complete_delta
_WATCHDOG_MARGIN_S = 60.0  # the group's own (watchdog) timeout is this much past the per-bucket deadline


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the duration (NCCL reads its options when a communicator is made)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _MemoryMeter:
    """Peak memory above the level at the start, during one broadcast: the CUDA allocator's peak on CUDA, the
    process's resident-set high-water mark on Linux CPU (reset through /proc/self/clear_refs); 0 where neither
    can be read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.start = _status_kib("VmRSS") << 10
        except OSError:
            self.start = -1

    def peak(self) -> int:
        if self.device.type == "cuda":
            return max(torch.cuda.max_memory_allocated(self.device) - self.start, 0)
        if self.start < 0:
            return 0
        return max((_status_kib("VmHWM") << 10) - self.start, 0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")
