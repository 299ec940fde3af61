"""SGLang's LoRA adapters as weight versions (`server.backend=sglang` with `train.lora`): each trained version's
peft directory is loaded under its own name, every generation names the adapter of the version it started under,
and the newest `size` versions (eta + 1) stay loaded. No torch here.

Why the window is eta + 1 wide, and what happens to a request at its edge: docs/weights.md, "LoRA on SGLang". The
wire, as SGLang 0.5.x serves it (`entrypoints/http_server.py`, `managers/io_struct.py`, the tokenizer manager's
`load_lora_adapter` / `unload_lora_adapter`, `lora/lora_registry.py`):

- POST /load_lora_adapter `{"lora_name", "lora_path", "pinned"}` and POST /unload_lora_adapter `{"lora_name"}`
  answer `LoRAUpdateOutput` (`success`, `error_message`, `loaded_adapters`: name -> path) with 200, or with 400 when
  `success` is false (LoRA not enabled, a name already loaded, an adapter whose rank or modules the server was not
  started for, a name that does not exist).
- /generate takes `"lora_path"`: the adapter's *name*; a name that is not registered is refused ("The following
  requested LoRA adapters are not loaded"); no `lora_path` runs the base model.
- An unload first unregisters the name (new requests naming it are refused), then waits for the requests in flight
  under it to finish before the adapter leaves memory: an unload never cuts a request short.
- SGLang has no endpoint that lists the adapters it holds; the load answer's `loaded_adapters` is the list.

`LoRAAdapters` is a mixin of `InferenceClient` (like weight_groups.py), using its `_pool` and `_fleet`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp
import msgspec

from areal_async.inference.errors import ConnectionFailed, error_message
from areal_async.inference.routing import ServerState
from areal_async.inference.transport import ServerPool

__all__ = ["AdapterPin", "AdapterWindow", "LoRAAdapters", "adapter_name", "adapter_version"]

log = logging.getLogger(__name__)

PREFIX = "areal-v"  # adapter names: PREFIX + version (a persistent server may hold other users' adapters)
PROBE_IDS = [0]  # the probe generation's prompt (SGLang's own health check generates from input_ids [0])


def adapter_name(version: int) -> str:
    """The name version `version`'s adapter is loaded under on every server."""
    return f"{PREFIX}{version}"


def adapter_version(name: str) -> int | None:
    """The version an adapter name of ours stands for (None: not one of ours)."""
    rest = name[len(PREFIX) :] if name.startswith(PREFIX) else ""
    return int(rest) if rest.isdigit() else None


class AdapterPin(NamedTuple):
    """What a generation runs under: `version` (recorded for each of its tokens) and the adapter `name` sent as
    `lora_path` (None: the base model, version 0 before any adapter was loaded)."""

    version: int
    name: str | None


class LoRAUpdate(msgspec.Struct):
    """SGLang's LoRAUpdateOutput as /load_lora_adapter and /unload_lora_adapter answer it."""

    success: bool = False
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


def read_update(body: bytes) -> LoRAUpdate:
    """The answer of a load or unload; a body that is not one (a proxy's error page) is a failure naming it."""
    try:
        return msgspec.json.decode(body, type=LoRAUpdate)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return LoRAUpdate(success=False, error_message=error_message(body) or "empty answer")


def served_path(update: LoRAUpdate, name: str) -> str | None:
    """Where the server says it loaded adapter `name` from (its loaded_adapters maps a name to the path; some
    builds map it to the LoRARef itself, a dict with `lora_path`)."""
    entry = (update.loaded_adapters or {}).get(name)
    if isinstance(entry, dict):
        entry = entry.get("lora_path")
    return entry if isinstance(entry, str) else None


class AdapterWindow:
    """The adapter versions the fleet holds, newest last: at most `size` of them. A version leaves the window
    (and is unloaded) when a newer one makes it the `size + 1`-th; a generation pinned to a version outside the
    window is re-pinned to the newest at its next submission (`LoRAAdapters._adapter_pin`)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("an adapter window holds at least one version")
        self.size = size
        self._paths: dict[int, str] = {}  # version -> its adapter directory, every version the fleet holds
        # the version being loaded across the fleet, not yet named by requests: a server that recovers meanwhile
        # loads it too, so it never returns to rotation (and to the relabel) without it
        self.pending: tuple[int, str] | None = None
        self.counts = {"adapter_loads": 0, "adapter_unloads": 0, "adapter_load_failures": 0, "adapter_repins": 0}

    def pin(self) -> AdapterPin:
        """The newest version: what a generation starting now runs under (the base model before any load)."""
        if not self._paths:
            return AdapterPin(0, None)
        v = max(self._paths)
        return AdapterPin(v, adapter_name(v))

    def holds(self, version: int) -> bool:
        """True while `version` is in the window (the base model, version 0, while no adapter pushed it out)."""
        if version in self._paths:
            return True
        return version == 0 and (not self._paths or max(self._paths) < self.size)

    def admit(self, version: int, path: str) -> list[int]:
        """`version` is loaded everywhere that serves: it becomes the newest. Returns the versions that fell out
        of the window (to unload), oldest first."""
        self._paths[version] = path
        newest = max(self._paths)
        out = sorted(v for v in self._paths if v <= newest - self.size)
        for v in out:
            del self._paths[v]
        return out

    def forget(self, versions: list[int]) -> None:
        """These versions are no longer to be named (another lineage's, after a rollback): out of the window."""
        for v in versions:
            self._paths.pop(v, None)

    @property
    def loaded(self) -> dict[int, str]:
        """version -> adapter directory of every version in the window, oldest first."""
        return dict(sorted(self._paths.items()))

    def wanted(self) -> dict[int, str]:
        """What a server must hold to serve: the window and the version being loaded."""
        out = self.loaded
        if self.pending is not None:
            out[self.pending[0]] = self.pending[1]
        return out


async def _post(pool: ServerPool, server: ServerState, path: str, payload: dict) -> tuple[int, bytes]:
    server.admin_ops += 1  # a load reads the adapter from disk: the heartbeat leaves the server alone meanwhile
    try:
        return await pool.send(
            server,
            "POST",
            path,
            msgspec.json.encode(payload),
            timeout=aiohttp.ClientTimeout(total=pool.weight_load_timeout_s),
        )
    finally:
        server.admin_ops -= 1


async def load_adapter(pool: ServerPool, server: ServerState, version: int, path: str) -> str:
    """Load `path` as version `version`'s adapter on `server`. Returns "" once the server's own list of loaded
    adapters names it at `path`, else why not. A name the server holds already (a catch-up racing an update, a
    retried load) counts as loaded when it is listed at the same path."""
    name = adapter_name(version)
    try:
        status, body = await _post(pool, server, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
    except ConnectionFailed as e:
        return f"unreachable: {e}"
    update = read_update(body)
    if status == 200 and update.success:
        where = served_path(update, name)
        if where == path:
            return ""
        return f"answered success, but its loaded adapters list {name} at {where!r}, not {path!r}"
    why = update.error_message or f"HTTP {status}"
    if "already loaded" in why and served_path(update, name) in (path, None):
        return ""
    return f"HTTP {status}: {why}"


async def unload_adapter(pool: ServerPool, server: ServerState, version: int) -> str:
    """Unload version `version`'s adapter from `server` ("" when done or not there any more, else why not).
    SGLang answers only once the requests in flight under it have finished."""
    try:
        status, body = await _post(pool, server, "/unload_lora_adapter", {"lora_name": adapter_name(version)})
    except ConnectionFailed as e:
        return f"unreachable: {e}"
    update = read_update(body)
    if status == 200 and update.success:
        return ""
    why = update.error_message or f"HTTP {status}"
    return "" if "does not exist" in why else f"HTTP {status}: {why}"


async def probe_adapter(pool: ServerPool, server: ServerState, version: int) -> str:
    """One greedy token under version `version`'s adapter: "" when the server runs a generation that names it
    (its tokenizer manager resolved the name, so rollouts naming it will run), else why not."""
    payload = {
        "input_ids": PROBE_IDS,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "lora_path": adapter_name(version),
        "rid": f"areal-lora-probe-{uuid.uuid4().hex}",
    }
    try:
        status, body = await pool.send(  # queued behind the rollouts on a busy server: a weight load's time
            server,
            "POST",
            "/generate",
            msgspec.json.encode(payload),
            timeout=aiohttp.ClientTimeout(total=pool.weight_load_timeout_s),
        )
    except ConnectionFailed as e:
        return f"unreachable: {e}"
    return "" if status == 200 else f"HTTP {status}: {error_message(body)}"


Ready = Callable[[ServerState], Awaitable[bool]]


def adapters_ready(window: AdapterWindow, pool: ServerPool, ready: Ready | None) -> Ready:
    """A ready check that, after `ready` passed, loads every adapter of the window onto a returning server (a
    restarted SGLang holds none): it serves only once it holds all of them, so any generation routed to it finds
    the adapter it names."""

    async def checked(server: ServerState) -> bool:
        if ready is not None and not await ready(server):
            return False
        for version, path in window.wanted().items():
            why = await load_adapter(pool, server, version, path)
            if why:
                window.counts["adapter_load_failures"] += 1
                log.warning(
                    "inference server %s cannot load adapter version %d (%s): %s", server.url, version, path, why
                )
                return False
        return True

    return checked


class LoRAAdapters:
    """The client's side of SGLang's LoRA endpoints (mixin of `InferenceClient`)."""

    # set by InferenceClient.__init__
    _pool: ServerPool
    _fleet: Any
    _adapters: AdapterWindow | None = None

    def use_adapters(self, window: AdapterWindow) -> None:
        """From now on every generation runs under an adapter of `window` (sent as `lora_path`, its tokens
        labelled with that adapter's version), and a server that comes back loads the window before it serves."""
        self._adapters = window
        self._pool.ready_check = adapters_ready(window, self._pool, self._pool.ready_check)

    def _adapter_pin(self, pin: AdapterPin | None) -> AdapterPin | None:
        """The pin for a generation's next submission: its own while the window holds it, else the newest (a
        request outlived its adapter: only possible beyond the staleness bound; its later tokens carry the newer
        version, as a resumed request's tokens do with full weights). None without adapters."""
        window = self._adapters
        if window is None:
            return None
        if pin is not None and window.holds(pin.version):
            return pin
        if pin is not None:
            window.counts["adapter_repins"] += 1
        return window.pin()

    async def _on_servers(self, fn: Callable[[ServerState], Awaitable[str]]) -> dict[str, str]:
        servers = self._fleet.reachable()
        whys = await asyncio.gather(*(fn(s) for s in servers))
        return {s.url: why for s, why in zip(servers, whys)}

    async def load_lora_adapter(self, version: int, path: str) -> dict[str, str]:
        """Every reachable server loads `path` as version `version`'s adapter and runs a probe generation under it.
        Returns url -> "" (proven) or why not; a server that fails leaves rotation until it loads the window."""
        assert self._adapters is not None, "use_adapters() first"
        window = self._adapters
        window.pending = (version, path)

        async def one(server: ServerState) -> str:
            why = await load_adapter(self._pool, server, version, path)
            if not why:
                why = await probe_adapter(self._pool, server, version)
                why = f"loaded, but a generation under it failed: {why}" if why else ""
            window.counts["adapter_loads" if not why else "adapter_load_failures"] += 1
            if why and not why.startswith("unreachable"):
                self._pool.needs_sync(server, f"adapter of version {version}: {why}")
            return why

        try:
            return await self._on_servers(one)
        finally:
            window.pending = None  # the caller admits it (or stops the run): from here the window says

    async def unload_lora_adapters(self, versions: list[int]) -> dict[str, str]:
        """Every reachable server unloads these versions' adapters (returns when SGLang has: after the requests
        under them finished). Returns url -> "" or the first failure."""
        assert self._adapters is not None, "use_adapters() first"
        window = self._adapters

        async def one(server: ServerState) -> str:
            for v in versions:
                why = await unload_adapter(self._pool, server, v)
                if why:
                    return f"version {v}: {why}"
                window.counts["adapter_unloads"] += 1
            return ""

        return await self._on_servers(one)
