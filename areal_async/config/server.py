"""The inference servers' config section: which engine serves (embedded, SGLang, vLLM or servers already
running), how launched ones are started. Split from run_config.py (which composes it into RunConfig) by concept;
every field is documented by the string literal under it, as there. Never torch."""

from __future__ import annotations

import os
from typing import Literal

from areal_async.config.base import Section, check, key_of

__all__ = ["ServerConfig"]


class ServerConfig(Section):
    """Inference servers: embedded (our CPU/GPU server), sglang (launched), or external URLs."""

    backend: Literal["embedded", "sglang", "vllm", "external"] = "embedded"
    """embedded: `python -m areal_async.serve` children; sglang: `sglang.launch_server` children; external: `urls`."""
    num_servers: int = 1
    """Servers to launch (embedded, sglang)."""
    urls: list[str] = []
    """Base URLs of running servers (backend=external)."""
    host: str = "127.0.0.1"
    """Interface launched servers bind to (anything else should come with api_key)."""
    port: int = 0
    """First port of launched servers (server i takes port + i); 0 picks free ports."""
    device: str = "auto"
    """Embedded servers' device ("cpu", "cuda", "cuda:1"); auto: cuda when available."""
    max_running_requests: int = 256
    """Embedded: requests decoded together."""
    max_total_tokens: int = 65536
    """Embedded and sglang: KV-cache token budget per server (SGLang's --max-total-tokens)."""
    api_key: str | None = None
    """Bearer token the servers require (and the client sends)."""
    extra_args: list[str] = []
    """Passed through to sglang.launch_server (e.g. ["--mem-fraction-static", "0.8"])."""
    python: str | None = None
    """sglang: the engine's interpreter, a venv of its own (`make sglang` builds one); null: this interpreter."""
    base_gpu_id: int = 0
    """sglang: server i uses --base-gpu-id base_gpu_id + i * gpus_per_server."""
    gpus_per_server: int = 1
    """sglang and external: GPUs each server takes (its tensor-parallel size; every one joins a weight broadcast)."""
    startup_timeout_s: float = 300.0
    """How long servers (launched or external) get to answer /health before the launch fails."""
    torch_threads: int = 1
    """Intra-op threads per embedded server process."""
    prefix_cache: bool = True
    """Embedded: samples of one prompt share the KV of its full prompt pages (SGLang's radix cache; for sglang
    servers pass --disable-radix-cache in extra_args instead)."""

    def validate(self, prefix: str = "") -> None:
        check(self.num_servers >= 1, key_of(prefix, "num_servers"), "must be >= 1")
        check(self.backend != "external" or bool(self.urls), key_of(prefix, "urls"), "required when backend=external")
        check(
            all(u.startswith(("http://", "https://")) for u in self.urls),
            key_of(prefix, "urls"),
            "every URL must start with http:// or https://",
        )
        check(0 <= self.port <= 65535, key_of(prefix, "port"), "must be in 0..65535")
        check(self.max_total_tokens > 0, key_of(prefix, "max_total_tokens"), "must be > 0")
        check(self.max_running_requests >= 1, key_of(prefix, "max_running_requests"), "must be >= 1")
        check(self.gpus_per_server >= 1, key_of(prefix, "gpus_per_server"), "must be >= 1")
        check(self.startup_timeout_s > 0, key_of(prefix, "startup_timeout_s"), "must be > 0")
        check(self.torch_threads >= 1, key_of(prefix, "torch_threads"), "must be >= 1")
        exe = os.path.expanduser(self.python or "")
        ok = self.python is None or (os.path.isfile(exe) and os.access(exe, os.X_OK))
        check(ok, key_of(prefix, "python"), f"{self.python!r} is not an executable file (make sglang builds one)")
