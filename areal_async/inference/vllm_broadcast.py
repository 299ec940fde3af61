"""SGLang's broadcast calls on vLLM's four-phase weight transfer, for the vLLM dialect (vllm_dialect.py).

The trainer's broadcast group is the one SGLang joins (train/broadcast.py): a c10d group on the trainer's TCPStore.
vLLM's own transfer engines do not join such a group (NCCL through vLLM's StatelessProcessGroup, and CUDA-only),
so the project's vLLM servers run the engine that does, `areal_c10d`, a vLLM plugin the launcher puts on vLLM's
path (launch/vllm_plugin/areal_vllm_plugin/engine.py; gloo on a CPU). The calls map as:

- /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}
  -> /init_weight_transfer_engine {init_info: the same fields}; blocks in the rendezvous, as SGLang's does.
- /update_weights_from_distributed {names, dtypes, shapes, weight_version?, flush_cache, abort_all_requests}
  -> the first bucket of an update: /start_weight_update; each bucket: /update_weights {update_info: {names,
  dtype_names, shapes, group_name}}; the last bucket (the one with weight_version): /finish_weight_update
  {weight_version}, then /reset_prefix_cache when asked.
- /destroy_weights_update_group -> /shutdown_weight_transfer_engine.

Why start and finish go around the whole update, not around each bucket: vLLM reloads layer by layer. Start puts
every layer back to its checkpoint-format parameters; a layer is processed (on vLLM-CPU: repacked into oneDNN's
layout) once all its weights have arrived; finish processes those that got only some and puts back, untouched, those
that got none. A bucket boundary can fall inside a layer (q_proj and k_proj fill one qkv_proj), so a finish per
bucket would process such a layer with half its weights. The same cycle is what /collective_rpc reload_weights runs
for the disk path, so the repacked layers are rebuilt from the broadcast tensors the same way.

The dialect holds one session per server: opened at the first bucket, closed at the last. A session left open (a
broadcast aborted part-way: that member gets no more buckets) is closed before anything else touches the weights:
a disk load, a new group, or the next update (recognised by a bucket naming a tensor this session already took).
A bucket that fails leaves vLLM's worker with layers still to be processed: the dialect finishes the session and
reloads the weights the server held from disk (the launch model, or the last directory it loaded), so it never
serves unloaded layers; the fleet counts the server as holding a mix of versions until the next update.

No torch here.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from areal_async.inference.dialect import RawSend, json_answer
from areal_async.inference.errors import ConnectionFailed

__all__ = ["BroadcastSession", "init_group", "receive_bucket", "destroy_group", "close_session"]

_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
_FOREIGN_KEYS = ("delta", "lora", "load_format")  # the embedded server's delta/adapter fields; SGLang's tensor formats


class BroadcastSession:
    """One server's open update, as far as the dialect knows it: whether vLLM's start_weight_update ran without
    its finish yet, and the tensors received since."""

    def __init__(self) -> None:
        self.open = False
        self.names: set[str] = set()


class VLLMDialect(Protocol):
    """What these calls use of the vLLM dialect (vllm_dialect.py), named here so that neither module imports the
    other's names both ways."""

    broadcast: BroadcastSession
    epoch: int
    label: str
    prefix_caching: bool

    async def _restore(self, raw: RawSend) -> str: ...

    async def _reset_prefix_cache(self, raw: RawSend) -> bool: ...


def _fail(status: int, message: str) -> tuple[int, bytes]:
    return json_answer(status, {"success": False, "message": message})


def _decode(body: bytes | None) -> Any:
    try:
        return msgspec.json.decode(body) if body else {}
    except msgspec.DecodeError:
        return None


def _why(data: bytes) -> str:
    answer = _decode(data)
    if isinstance(answer, dict):
        err = answer.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("detail", "error", "message"):
            if answer.get(key):
                return str(answer[key])
    return data[:300].decode("utf-8", "replace").strip() or "no answer"


async def _post(
    raw: RawSend, path: str, payload: dict[str, Any] | None = None, *, retry: bool = False
) -> tuple[int, bytes]:
    """`retry`: once more on a new connection when the pooled one was closed (only for the calls of a recovery,
    which are safe to repeat): vLLM answers a failed transfer call from an unhandled exception, after which
    uvicorn closes the connection that carried it, and the next call may take that connection."""
    body = msgspec.json.encode(payload if payload is not None else {})
    try:
        return await raw("POST", path, body, None)
    except ConnectionFailed:
        if not retry:
            raise
        return await raw("POST", path, body, None)


async def close_session(dialect: VLLMDialect, raw: RawSend) -> None:
    """Finish an update left open (best effort: a worker that has none answers an error, which is ignored)."""
    session = dialect.broadcast
    if not session.open:
        return
    session.open, session.names = False, set()
    await _post(raw, "/finish_weight_update", retry=True)


async def init_group(dialect: VLLMDialect, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
    """/init_weights_update_group -> /init_weight_transfer_engine (the rendezvous blocks until the trainer joins)."""
    payload = _decode(body)
    if not isinstance(payload, dict) or any(payload.get(k) is None for k in _INIT_KEYS[:4]):
        return _fail(400, "/init_weights_update_group: master_address, master_port, rank_offset and world_size")
    await close_session(dialect, raw)  # vLLM refuses to leave a group while an update is open
    info = {k: payload[k] for k in _INIT_KEYS if payload.get(k) is not None}
    status, data = await _post(raw, "/init_weight_transfer_engine", {"init_info": info})
    if status != 200:
        return _fail(status if status != 500 else 400, f"vLLM init_weight_transfer_engine failed: {_why(data)}")
    return json_answer(200, {"success": True, "message": "joined the weight-update group"})


async def destroy_group(dialect: VLLMDialect, raw: RawSend) -> tuple[int, bytes]:
    """/destroy_weights_update_group -> /shutdown_weight_transfer_engine (vLLM holds one group per engine)."""
    await close_session(dialect, raw)
    status, data = await _post(raw, "/shutdown_weight_transfer_engine")
    if status != 200:
        return _fail(400, f"vLLM shutdown_weight_transfer_engine failed: {_why(data)}")
    return json_answer(200, {"success": True, "message": "left the weight-update group"})


async def receive_bucket(dialect: VLLMDialect, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
    """One bucket of a broadcast (see the module docstring for the session around the buckets)."""
    payload = _decode(body)
    if not isinstance(payload, dict) or not isinstance(payload.get("names"), list):
        return _fail(400, "/update_weights_from_distributed: names, dtypes and shapes are required")
    foreign = [k for k in _FOREIGN_KEYS if payload.get(k)]
    if foreign:
        return _fail(400, f"/update_weights_from_distributed: {', '.join(foreign)} is not mapped on vLLM")
    names = [str(n) for n in payload["names"]]
    session = dialect.broadcast
    if session.open and session.names.intersection(names):
        await close_session(dialect, raw)  # a new update after one that stopped part-way
    if payload.get("abort_all_requests"):
        await raw("POST", "/abort_requests", b"{}", None)
    if not session.open:
        status, data = await _post(raw, "/start_weight_update")
        if status != 200:
            return _fail(400, f"vLLM start_weight_update failed: {_why(data)}")
        session.open, session.names = True, set()
        dialect.epoch += 1  # the weights change from here on: no KV computed before is matched after
    update = {"names": names, "dtype_names": payload.get("dtypes"), "shapes": payload.get("shapes")}
    if payload.get("group_name"):
        update["group_name"] = payload["group_name"]
    status, data = await _post(raw, "/update_weights", {"update_info": update})
    if status != 200:
        return await _failed_bucket(dialect, raw, _why(data))
    session.names.update(names)
    version = payload.get("weight_version")
    if version is None:
        return json_answer(200, {"success": True, "message": f"received {len(names)} tensors"})
    session.open, session.names = False, set()
    status, data = await _post(raw, "/finish_weight_update", {"weight_version": str(version)})
    if status != 200:
        restored = await dialect._restore(raw)
        return _fail(400, f"vLLM finish_weight_update failed: {_why(data)}{restored}")
    dialect.label = str(version)
    dialect.epoch += 1
    flushed = True
    if payload.get("flush_cache", True) and dialect.prefix_caching:
        flushed = await dialect._reset_prefix_cache(raw)
    return json_answer(200, {"success": True, "message": "updated", "flushed": flushed})


async def _failed_bucket(dialect: VLLMDialect, raw: RawSend, why: str) -> tuple[int, bytes]:
    """A bucket vLLM did not take: vLLM's worker ends its update flag but leaves the layers it was loading
    unprocessed (on the meta device). A start and a finish process or put back every layer; the reload from disk
    then gives every layer weights of one checkpoint. The server answers the failure either way."""
    session = dialect.broadcast
    session.open, session.names = False, set()
    await _post(raw, "/start_weight_update", retry=True)
    await _post(raw, "/finish_weight_update", retry=True)
    restored = await dialect._restore(raw)
    return _fail(400, f"vLLM update_weights failed: {why}{restored}")
