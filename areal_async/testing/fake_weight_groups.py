"""The fake SGLang's membership of a trainer's weight-update group (gloo): joining it, receiving a bucket's tensors
as SGLang's /update_weights_from_distributed does, leaving it. A mixin of `FakeSGLang` (fake_sglang.py), apart
because it is the one part that needs torch (imported lazily, inside the calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

__all__ = ["FakeWeightGroups"]


class FakeWeightGroups:
    """/init_weights_update_group, /destroy_weights_update_group and the receiving half of a bucket. Uses the
    fake's `admin` log, `_groups`, `gloo_member`, `buckets`, `fail_bucket`, `fail_after_tensors` and `_json`."""

    admin: list[tuple[str, Any]]
    _groups: dict[str, list[Any]]
    gloo_member: bool
    buckets: list[tuple[str, int, list[Any]]]
    fail_bucket: int
    fail_after_tensors: int
    _json: Callable[..., web.Response]  # FakeSGLang's: a JSON answer with a status

    @staticmethod
    async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking torch.distributed call in a daemon thread: a receive the trainer never completes must
        not keep the interpreter from exiting (asyncio's default executor joins its threads at exit)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)

        def run() -> None:
            try:
                value, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
                value, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop may be gone by then
                loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=run, name="fake-sglang-dist", daemon=True).start()
        return await fut

    async def _init_group(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        self.admin.append((request.path, body))
        if not self.gloo_member:
            return self._json({"success": True, "message": "ok"})
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        try:
            pg = await self._in_thread(_join_group, init, body["world_size"], body["rank_offset"], body["group_name"])
        except Exception as e:
            return self._json({"success": False, "message": f"{type(e).__name__}: {e}"}, 400)
        self._groups[body["group_name"]] = [pg, 0]  # the group, and the number of bucket calls it has had
        return self._json({"success": True, "message": "ok"})

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append((request.path, body))
        held = self._groups.pop(body.get("group_name", ""), None)
        if held is None:
            return self._json({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        from areal_async.server.weights import destroy_group  # lazy: torch

        # in the background: a receive still blocked on it (the trainer stopped mid-bucket) may hold it
        threading.Thread(
            target=_quietly, args=(destroy_group, held[0]), name="fake-sglang-destroy", daemon=True
        ).start()
        return self._json({"success": True, "message": "ok"})

    async def _receive(self, body: dict) -> web.Response:
        import torch

        from areal_async.server.weights import receive_tensors  # lazy: torch

        held = self._groups.get(body["group_name"])
        if held is None:
            return self._json({"success": False, "message": f"group {body['group_name']} does not exist"}, 400)
        pg, index = held
        held[1] += 1
        names = body["names"]
        take = self.fail_after_tensors if index == self.fail_bucket else len(names)
        take = min(take, len(names))
        try:
            got = await self._in_thread(
                receive_tensors, pg, names[:take], body["dtypes"][:take], body["shapes"][:take], torch.device("cpu")
            )
        except Exception as e:
            self.buckets.append((body["group_name"], index, []))
            return self._json({"success": False, "message": f"{type(e).__name__}: {e}"}, 400)
        self.buckets.append((body["group_name"], index, list(got)))
        if take < len(names):  # SGLang's answer when it cannot allocate a tensor of the bucket
            return self._json(
                {"success": False, "message": f"Failed to update parameter online: out of memory at {names[take]}"}, 400
            )
        return self._json({"success": True, "message": "ok"})


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # a group whose peer is gone may refuse a clean teardown
        pass


_registry_lock = threading.Lock()
_joining: list[Any] = []  # the real registration function while joins are under way, once per join


def _join_group(init_method: str, world_size: int, rank: int, group_name: str) -> Any:
    """Join gloo group `group_name` as `rank`, as server/weights.py's init_custom_group does, but without an
    entry in torch's by-name process-group registry (used only by functional collectives, never by
    broadcast(group=pg)): several fakes of one process may join one group at once, and that registry takes a
    name once per process."""
    from torch.distributed import distributed_c10d as c10d

    from areal_async.server.weights import init_custom_group  # lazy: torch

    with _registry_lock:
        _joining.append(_joining[0] if _joining else c10d._register_process_group)
        c10d._register_process_group = _unregistered
    try:
        return init_custom_group("gloo", init_method, world_size, rank, group_name, "cpu", 60.0)
    finally:
        with _registry_lock:
            real = _joining.pop()
            if not _joining:
                c10d._register_process_group = real


def _unregistered(group_name: str, pg: Any) -> None:
    del group_name, pg
