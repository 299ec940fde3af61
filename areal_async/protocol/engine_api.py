"""The seam between the embedded HTTP server and the generation engine.

The server (server/app.py) speaks SGLang's HTTP protocol and validates input; the engine (engine.py) owns the model,
the KV cache and the continuous-batching loop. This module fixes what one asks of the other, so either side can be
replaced (and tested) on its own. No torch here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol

import msgspec

PauseMode = Literal["abort", "retract", "in_place"]


class EngineSampling(msgspec.Struct, kw_only=True):
    """Validated per-request sampling settings (the server checks ranges before building one)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # < 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_new_tokens: int = 0
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None


class EngineRequest(msgspec.Struct, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling: EngineSampling
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only; k >= 0: also input logprobs from position k
    top_logprobs_num: int = 0
    priority: int = 0  # larger is admitted first; equal priorities keep arrival order
    # False: the consumer reads only the end (a non-streaming HTTP request): its tokens are handed to the event loop
    # when it finishes, or when the weights change under it, instead of after every step (engine.py `_flush`)
    stream: bool = True


class EngineChunk(msgspec.Struct, kw_only=True):
    """What the engine yields for a request: the new tokens since the last chunk, and, on the last one, why it
    finished. Cumulative views (SGLang's default for streams) are built by the server."""

    rid: str
    new_ids: list[int]
    new_logprobs: list[float]  # empty unless return_logprob
    new_top_logprobs: list[list[tuple[float, int]]] = []  # per new token, when top_logprobs_num > 0
    input_logprobs: list[float | None] | None = None  # first chunk only, when logprob_start_len >= 0
    finish_reason: dict | None = None  # SGLang shape: {"type": "stop", "matched": ...} | length | abort
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0
    weight_version: str = "default"  # the weights that made these tokens (chunks never straddle a swap)


class Engine(Protocol):
    """An asyncio-facing engine. Generation runs off the event loop; every method here is safe to call from it.
    Pause and abort take effect at the next step boundary. A weight swap (disk or broadcast) waits until no request
    is running, unless generation is paused: then it happens at once, and requests paused in place continue on
    their KV cache under the new weights (flush_cache=True is refused while they hold KV)."""

    weight_version: str
    model_path: str
    context_len: int
    vocab_size: int

    def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Queue `req` and yield chunks until it finishes (stop, length or abort). While paused, a new request
        waits in the queue. Raises ValueError for a request the engine cannot serve (a duplicate rid in flight)."""
        ...

    async def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort every running or waiting request whose rid starts with `rid` (or all); returns how many."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """abort: every in-flight request finishes with type abort and its partial tokens; returns when drained.
        in_place: the loop stops after the current step, requests keep their KV cache. retract: back to the queue."""
        ...

    async def resume(self) -> None: ...

    @property
    def paused(self) -> bool: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, abort_all_requests: bool = False, flush_cache: bool = True
    ) -> tuple[bool, str, int]:
        """Load and fully validate the checkpoint before swapping; on failure keep the old weights.
        Returns (success, message, num_paused_requests)."""
        ...

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]: ...

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Leave the group (False, "The group to be destroyed does not exist." for an unknown name)."""
        ...

    async def set_weight_version(self, version: str) -> None: ...

    async def flush_cache(self) -> bool:
        """False (and nothing flushed) while requests are running."""
        ...

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def server_args(self) -> dict: ...

    # tokenizer access for text prompts, stop strings, chat templates and detokenisation
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
