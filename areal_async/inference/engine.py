"""The continuous-batching generation engine behind the embedded server (implements `engine_api.Engine`).

Two threads, one owner each:

    asyncio loop (server)                          engine thread (this module's step loop)
    ---------------------                          ---------------------------------------
    generate() -> command "add"      --cmds-->     run commands at the step boundary
    abort/pause/resume/weights       --cmds-->     admit waiting requests (slots, KV budget)
    awaits futures / per-request     <--chunks--   one forward for every scheduled request:
    streams (call_soon_threadsafe)                 decode rows + prefill chunks, batched sampling

Every piece of scheduler state (queues, KV pages, requests) belongs to the engine thread; the loop only sends
commands and receives chunks, so there are no locks around model state and pause, abort and weight swaps take
effect exactly between two steps. Those urgent commands also cut the step in progress short (the model polls
between layers; the interrupted step is simply redone), so a pause waits for one layer, not a whole step.
Chunks go to the loop in one `call_soon_threadsafe` call per batch; while a
batch is still undelivered (the loop is busy), new tokens accumulate per request and travel later as one larger
chunk, so a loaded loop costs the engine nothing per token. A command's result is posted after every chunk made
before it, so `pause("abort")` returns after the aborted requests' final chunks are in their streams.

Scheduling: FIFO admission (a request with a larger `priority` goes ahead of lower ones in the queue, as held-out
evals do so they need not wait behind thousands of queued rollouts) while a running slot (`max_running_requests`) and
KV pages for prompt +
`max_new_tokens` are free (reserving the whole budget up front means a running request never has to be evicted);
each step decodes every running request and prefills waiting ones in chunks of at most `chunked_prefill_size`
tokens, batched together. Requests that do not fit wait; a request that could never fit is a ValueError.

Shared prompts (what SGLang's radix cache does for us, at page granularity): once a full page of prompt tokens has
its KV written, it is registered under (the previous page's registration, its tokens). A request about to prefill
maps every registered page its prompt begins with instead of computing it (reported as `cached_tokens`), keeping
at least one prompt token to compute. A request whose first prompt page another request is computing right now
waits one step for it: the G samples of a prompt arrive together, and without that each would compute the prompt.
Pages are refcounted; a registered page its last holder releases stays cached until admissions need the space
(least recently released first). A weight swap forgets every registration (their KV is the old weights').
Requests that ask for prompt logprobs always compute their whole prompt; `prefix_cache=False` turns all this off.

Stop rules, checked after each token in SGLang's order: `max_new_tokens` first (finish "length"), then, once
`min_new_tokens` are out, stop token ids (`stop_token_ids` always; the model's EOS ids unless `ignore_eos`), then
stop strings, matched on the decoded tail of the output. Output ids keep the stop token; trimming a matched stop
string from the text is the server's job. Before `min_new_tokens`, stop tokens are banned from sampling.

Logprobs: the logprob of every sampled token is `log_softmax(logits / temperature)` at the sampled token (raw
`log_softmax(logits)` for greedy, temperature < 1e-6), after penalties and the min_new_tokens stop-token ban and
before top-k/top-p/min-p truncation (see sampling.py). Input logprobs (`logprob_start_len >= 0`) use the same rule.

Each chunk carries the weight version of the weights that computed its tokens.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import copy
import logging
import os
import threading
import time
from typing import AsyncIterator, Callable

import torch

from areal_async.inference.engine_api import EngineChunk, EngineRequest, PauseMode
from areal_async.inference.model import (DecoderModel, KVCache, ModelSpec, StepInterrupted, UnsupportedModelError,
                                         build_step_batch)
from areal_async.inference.sampling import RowParams, process_logits, sample
from areal_async.inference.weights import DTYPES, WeightError, check_tensors, load_checkpoint

log = logging.getLogger(__name__)

PAGE_SIZE = 16


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the OS.

    A decode step allocates and frees the same multi-megabyte tensors (gathered KV pages, logits) every few
    milliseconds; with glibc's defaults, blocks that size are unmapped or trimmed on free and page-faulted back on
    the next step, which measured 3-5x slower than the step itself on CPU. A serving process wants the memory
    kept. No-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 1 << 30)
    mallopt(m_trim_threshold, 1 << 31)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def _abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class _Stream:
    """The loop-side end of one request: chunks delivered by the engine thread, and a wake-up event."""

    __slots__ = ("chunks", "event")

    def __init__(self) -> None:
        self.chunks: list[EngineChunk] = []
        self.event = asyncio.Event()


class _Request:
    """Engine-thread state of one request."""

    def __init__(self, req: EngineRequest, stream: _Stream, eos_ids: list[int], device: torch.device):
        s = req.sampling
        self.rid = req.rid
        self.req = req
        self.stream = stream
        self.prompt_len = len(req.input_ids)
        self.tokens: list[int] = list(req.input_ids)  # prompt + output; the cache holds tokens[:num_cached]
        self.output_ids: list[int] = []
        self.num_cached = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from another request's pages (SGLang's cached_tokens)
        self.pages: list[int] = []
        self.shared_pages = 0  # leading pages of `pages` that are registered for sharing (ours or matched)
        self.serials: list[int] = []  # the registrations of those pages (see AsyncEngine._register_prefix)
        self.may_register = True  # False once the weights changed under it: its KV is not the new weights' KV
        # the registry key of the first prompt page (see AsyncEngine._map_prefix); None when the prompt has no full
        # page to share beyond the one token that must be computed
        self.key0 = (-1, tuple(req.input_ids[:PAGE_SIZE])) if len(req.input_ids) > PAGE_SIZE else None
        self.table_row = -1  # row of the engine's page table while admitted
        self.max_new = s.max_new_tokens
        self.stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_ids))
        self.stop_strs = [x for x in s.stop if x]
        self.stop_window = 2 * max((len(x) for x in self.stop_strs), default=0) + 2  # tokens of tail to decode
        gen = None
        if s.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(s.seed)
        self.params = RowParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, generator=gen,
                             frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                             repetition_penalty=s.repetition_penalty)
        self.want_input_lp = req.logprob_start_len >= 0
        # input logprobs: prompt positions [lp_next, prompt_len) are still to be scored (position 0 has none)
        self.input_logprobs: list[float | None] = [None] if req.logprob_start_len == 0 else []
        self.lp_next = max(req.logprob_start_len, 1) if self.want_input_lp else self.prompt_len
        self.sent_first = False
        # tokens made since the last chunk; sealed into one chunk when the loop is ready for more (see _flush)
        self.pend_ids: list[int] = []
        self.pend_lps: list[float] = []
        self.pend_top: list[list[tuple[float, int]]] = []
        self.pend_reason: dict | None = None
        self.dirty = False
        self.done = False

    @property
    def pages_needed(self) -> int:
        return -(-(self.prompt_len + self.max_new) // PAGE_SIZE)


class AsyncEngine:
    """Continuous-batching engine over `DecoderModel`; see the module docstring for the threading model."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", max_total_tokens: int = 65536,
                 max_running_requests: int = 256, weight_version: str = "0", seed: int = 0,
                 chunked_prefill_size: int | None = None, prefix_cache: bool = True):
        from transformers import AutoTokenizer

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if chunked_prefill_size is None:
            # A step's length is the latency of everything that waits for a step boundary (requests joining, the
            # token cadence of streams): on CPU, 256 prompt tokens per step keep a small model's step in the tens
            # of milliseconds at a ~15% cost in prefill throughput.
            chunked_prefill_size = 2048 if self.device.type == "cuda" else 256
        if max_total_tokens <= 0 or max_running_requests <= 0 or chunked_prefill_size <= 0:
            raise ValueError("max_total_tokens, max_running_requests and chunked_prefill_size must be > 0")
        self.model_path = model_path
        self.weight_version = weight_version
        self.busy_s = 0.0  # seconds spent in model steps since start (reported by /server_info)
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.prefix_cache = prefix_cache  # share full prompt pages between requests (module docstring)
        self.seed = seed
        spec, tensors = load_checkpoint(model_path)
        self.spec: ModelSpec = spec
        self.model = DecoderModel(spec, self.device, self.dtype)
        self.model.load_tensors(tensors)
        del tensors
        self.context_len = spec.max_position_embeddings
        self.vocab_size = spec.vocab_size
        self.cache = KVCache(spec, max_total_tokens, PAGE_SIZE, self.device, self.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._eos_ids = _eos_token_ids(model_path, self.tokenizer)
        self._stop_tokenizer = None  # engine thread's own copy (HF tokenizers are not safe to share across threads)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._groups: dict[str, object] = {}  # weight-update process groups by name

        # engine-thread state
        self._free_pages = list(range(self.cache.num_pages - 1, 0, -1))  # pop() hands out low pages first
        # shared prompt pages (module docstring): registry key (parent registration serial, page tokens) ->
        # (page, serial). Serials are never reused, so a key whose parent was evicted can never match again. Pages
        # nobody holds stay registered, least recently released first in `_evictable`, until pages run short.
        self._page_refs = [0] * self.cache.num_pages
        self._prefix_pages: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._page_keys: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_serial = 0
        max_pages = -(-min(self.context_len, max_total_tokens) // PAGE_SIZE)
        self._page_table = torch.zeros(max_running_requests, max_pages, dtype=torch.long)  # host; row per request
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._paused = False
        self._pending_swap: Callable[[], None] | None = None  # a weight swap waiting for running requests to end
        self._dirty: list[_Request] = []  # requests with unsealed tokens or an unsent finish
        self._outbox: list[tuple[_Stream, EngineChunk]] = []  # sealed chunks not yet handed to the loop
        self._delivering = False  # a batch is on its way to the loop and has not been delivered yet
        # shared between threads (guarded by _cv)
        self._cv = threading.Condition()
        self._cmds: list[Callable[[], None]] = []
        self._urgent = False  # a pause, abort or weight swap is queued: cut the running step short
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # loop side: rids in flight
        self._weights_lock: asyncio.Lock | None = None
        self._n_running = 0
        self._n_waiting = 0

    # ---- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._weights_lock = asyncio.Lock()
        self._stopping = False
        keep_freed_memory()
        self._thread = threading.Thread(target=self._run, name="areal-engine", daemon=True)
        self._thread.start()
        # A process that exits without shutdown() must still stop the thread first: one killed inside a torch op
        # at interpreter teardown aborts the process.
        atexit.register(self._stop_thread)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        await asyncio.to_thread(self._stop_thread)
        atexit.unregister(self._stop_thread)
        for group in self._groups.values():
            _destroy_group(group)
        self._groups.clear()

    def _stop_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify()
        thread.join()
        self._thread = None

    # ---- requests -------------------------------------------------------------------------------------------

    def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Validate now (ValueError), then queue on first iteration and yield chunks until the request ends."""
        self._validate(req)
        return self._generate(req)

    async def _generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        if self._loop is None:
            raise RuntimeError("engine not started: await engine.start() first")
        if req.rid in self._streams:
            raise ValueError(f"rid {req.rid!r} is already in flight")
        stream = _Stream()
        self._streams[req.rid] = stream
        r = _Request(req, stream, self._eos_ids, self.device)
        finished = False
        try:
            self._post(lambda: self._add(r))
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                chunks, stream.chunks = stream.chunks, []
                for chunk in _coalesce(chunks):
                    finished = chunk.finish_reason is not None
                    yield chunk
        finally:
            del self._streams[req.rid]
            if not finished:  # the consumer went away (disconnect, cancel): free the request's slot and pages
                self._post(lambda: self._finish(r, _abort_reason("client went away"), emit=False))

    def _validate(self, req: EngineRequest) -> None:
        s = req.sampling
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids is empty")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if s.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {s.max_new_tokens}")
        if n + s.max_new_tokens > self.context_len:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the context length "
                             f"{self.context_len}")
        if n + s.max_new_tokens > self.max_total_tokens:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({s.max_new_tokens}) can never fit the KV cache "
                             f"budget of {self.max_total_tokens} tokens (max_total_tokens)")
        if s.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {s.temperature}")
        if not 0 < s.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
        if s.top_k == 0 or s.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {s.top_k}")
        if not 0 <= s.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {s.min_p}")
        if s.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
        if s.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {s.min_new_tokens}")
        if req.logprob_start_len > n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) is beyond the prompt ({n} tokens)")
        if req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")

    async def abort(self, rid: str = "", abort_all: bool = False) -> int:
        def cmd() -> int:
            hits = [r for r in list(self._running) + list(self._waiting) if abort_all or r.rid.startswith(rid)]
            for r in hits:
                self._finish(r, _abort_reason("aborted by request"))
            return len(hits)

        return await self._call(cmd, urgent=True)

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, retract or in_place")

        def cmd() -> None:
            self._paused = True
            if mode == "abort":
                for r in list(self._running) + list(self._waiting):
                    self._finish(r, _abort_reason("generation paused (abort)"))
            elif mode == "retract":
                for r in reversed(self._running):  # back to the front of the queue, in their original order
                    self._release_pages(r)
                    r.num_cached = 0
                    self._waiting.appendleft(r)
                self._running.clear()

        await self._call(cmd, urgent=True)

    async def resume(self) -> None:
        def cmd() -> None:
            self._paused = False

        await self._call(cmd)

    @property
    def paused(self) -> bool:
        return self._paused

    def num_running(self) -> int:
        return self._n_running

    def num_waiting(self) -> int:
        return self._n_waiting

    async def flush_cache(self) -> bool:
        """Forget the shared prompt pages; refused (False) while requests hold KV, as SGLang does."""
        def cmd() -> bool:
            if self._running:
                return False
            self._forget_prefixes()
            return True

        return await self._call(cmd)

    # ---- weights --------------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None,
                                       abort_all_requests: bool = False, flush_cache: bool = True
                                       ) -> tuple[bool, str, int]:
        del flush_cache  # shared prompt pages are always forgotten at a swap; in-place-paused requests keep their KV
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:
            try:
                _, tensors = await asyncio.to_thread(load_checkpoint, model_path, self.spec)
            except (WeightError, UnsupportedModelError, OSError) as e:
                return False, f"failed to load weights from {model_path}: {e}", 0
            done: asyncio.Future = self._loop.create_future()

            def swap() -> int:
                held = len(self._running) + len(self._waiting) if self._paused else 0
                self._seal()  # chunks made by the old weights keep the old version
                self.model.load_tensors(tensors)
                self._forget_prefixes()
                self.model_path = model_path
                self.weight_version = _next_version(self.weight_version, weight_version)
                return held

            def cmd() -> None:
                if abort_all_requests:
                    for r in list(self._running) + list(self._waiting):
                        self._finish(r, _abort_reason("aborted for a weight update"))
                self._pending_swap = lambda: self._resolve(done, swap)
            self._post(cmd, urgent=abort_all_requests or self._paused)
            held = await done
        return True, f"Succeeded to update model weights from {model_path}.", held

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> tuple[bool, str]:
        """Join the trainer's broadcast group as rank `rank_offset` (SGLang's receiving side; see weight_sync)."""
        from areal_async.inference.weights import init_custom_group

        if group_name in self._groups:
            return False, f"weight update group {group_name!r} already exists"
        if backend == "nccl" and self.device.type != "cuda":
            return False, "backend nccl needs a CUDA device; this engine runs on CPU (use gloo)"
        try:
            group = await asyncio.to_thread(init_custom_group, backend, f"tcp://{master_address}:{master_port}",
                                            world_size, rank_offset, group_name, self.device)
        except Exception as e:  # rendezvous timeouts and connection errors come as several types
            return False, f"failed to join weight update group {group_name!r}: {type(e).__name__}: {e}"
        self._groups[group_name] = group
        return True, f"Succeeded to initialize weight update group {group_name!r}."

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str | None,
                                              flush_cache: bool = True) -> tuple[bool, str]:
        """Receive each tensor by broadcast(src=0), in order, then swap them in at the next step boundary."""
        from areal_async.inference.weights import receive_tensors

        del flush_cache
        group = self._groups.get(group_name)
        if group is None:
            return False, f"no weight update group {group_name!r}; call init_weights_update_group first"
        if not len(names) == len(dtypes) == len(shapes):
            return False, "names, dtypes and shapes must have the same length"
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            return False, f"unsupported dtypes {bad[:3]}"
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:
            try:
                # Receive everything first, even names we will reject: the trainer's broadcasts must all be matched.
                tensors = await asyncio.to_thread(receive_tensors, group, names, dtypes, shapes, self.device)
                expected = self.spec.param_shapes()
                if self.spec.tie_word_embeddings and "lm_head.weight" in tensors:
                    expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
                check_tensors(tensors, expected, where="update_weights_from_distributed", require_all=False)
            except Exception as e:
                return False, f"failed to update weights from distributed: {type(e).__name__}: {e}"

            def swap() -> None:
                self._seal()
                self.model.load_tensors(tensors)
                self._forget_prefixes()
                if weight_version is not None:  # as SGLang: a bucket without a version keeps the label
                    self.weight_version = weight_version

            await self._call(swap, urgent=True)
        return True, "Succeeded to update parameter online from distributed."

    async def set_weight_version(self, version: str) -> None:
        def cmd() -> None:
            self._seal()
            self.weight_version = version

        await self._call(cmd)

    # ---- info and tokenizer ---------------------------------------------------------------------------------

    def server_args(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "max_total_tokens": self.max_total_tokens,
                "max_running_requests": self.max_running_requests, "chunked_prefill_size": self.chunked_prefill_size,
                "page_size": PAGE_SIZE, "context_length": self.context_len, "random_seed": self.seed,
                "disable_radix_cache": not self.prefix_cache,
                "architecture": self.spec.architecture, "weight_version": self.weight_version,
                "busy_s": self.busy_s}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.model_path} has no chat template")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    # ---- loop <-> thread plumbing ---------------------------------------------------------------------------

    def _post(self, cmd: Callable[[], None], urgent: bool = False) -> None:
        """Queue a command for the engine thread. An urgent one also interrupts the step in progress (between
        layers; the step is redone later), so pause and abort wait for one layer instead of a whole step."""
        with self._cv:
            self._cmds.append(cmd)
            self._urgent = self._urgent or urgent
            self._cv.notify()

    async def _call(self, fn: Callable[[], object], urgent: bool = False):
        """Run `fn` on the engine thread at the next step boundary and return its result."""
        if self._loop is None:
            raise RuntimeError("engine not started: await engine.start() first")
        fut = self._loop.create_future()
        self._post(lambda: self._resolve(fut, fn), urgent)
        return await fut

    def _resolve(self, fut: asyncio.Future, fn: Callable[[], object]) -> None:
        """Engine thread: run fn, flush the chunks it made, then hand its result (or error) to the loop."""
        try:
            result, error = fn(), None
        except Exception as e:  # handed to the awaiting coroutine
            result, error = None, e
        self._n_running, self._n_waiting = len(self._running), len(self._waiting)
        self._flush(force=True)
        self._to_loop(_set_future, fut, result, error)

    def _to_loop(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (process exit without shutdown): nobody is listening
            pass

    def _seal(self) -> None:
        """Turn every request's pending tokens into one chunk each (under the current weight version)."""
        for r in self._dirty:
            chunk = EngineChunk(rid=r.rid, new_ids=r.pend_ids, new_logprobs=r.pend_lps if r.req.return_logprob else [],
                                new_top_logprobs=r.pend_top, finish_reason=r.pend_reason, prompt_tokens=r.prompt_len,
                                completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
                                weight_version=self.weight_version)
            if not r.sent_first:
                r.sent_first = True
                if r.want_input_lp:
                    chunk.input_logprobs = r.input_logprobs
            self._outbox.append((r.stream, chunk))
            r.pend_ids, r.pend_lps, r.pend_top, r.pend_reason, r.dirty = [], [], [], None, False
        self._dirty = []

    def _flush(self, force: bool = False) -> None:
        """Hand sealed chunks to the loop in one call. Unless forced, wait while the previous batch is still
        undelivered: tokens keep accumulating per request, so a busy loop gets fewer, larger chunks instead of
        falling behind (and the engine thread stops paying for wake-ups nobody is ready to take)."""
        if self._delivering and not force:
            return
        self._seal()
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._delivering = True
            self._to_loop(self._deliver, batch)

    def _deliver(self, batch: list[tuple[_Stream, EngineChunk]]) -> None:
        """Loop side: append each chunk to its stream and wake its consumer."""
        self._delivering = False
        for stream, chunk in batch:
            stream.chunks.append(chunk)
            stream.event.set()

    # ---- engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._cmds or self._stopping or self._can_step() or self._swap_ready()):
                    self._cv.wait()
                cmds, self._cmds = self._cmds, []
                self._urgent = False
                stopping = self._stopping
            for cmd in cmds:
                cmd()
            if stopping:
                if self._pending_swap is not None:
                    self._pending_swap()
                for r in list(self._running) + list(self._waiting):
                    self._finish(r, _abort_reason("engine shut down"))
                self._flush(force=True)
                return
            if self._swap_ready():
                swap, self._pending_swap = self._pending_swap, None
                swap()
            if self._can_step():
                t_step = time.perf_counter()
                try:
                    self._step()
                except Exception as e:  # never leave clients hanging: fail the running requests, keep serving
                    log.exception("engine step failed")
                    for r in list(self._running):
                        self._finish(r, _abort_reason(f"engine error: {type(e).__name__}: {e}"))
                self.busy_s += time.perf_counter() - t_step  # model compute time: benchmarks report busy fractions
            self._n_running, self._n_waiting = len(self._running), len(self._waiting)
            self._flush(force=not self._can_step())  # going idle: nothing may stay pending

    def _swap_ready(self) -> bool:
        return self._pending_swap is not None and (self._paused or not self._running)

    def _can_step(self) -> bool:
        if self._paused:
            return False
        if self._running:
            return True
        return bool(self._waiting) and self._pending_swap is None

    def _add(self, r: _Request) -> None:
        """Queue in arrival order behind every request of the same or a higher priority."""
        p = r.req.priority
        if not self._waiting or self._waiting[-1].req.priority >= p:
            self._waiting.append(r)
            return
        for i, w in enumerate(self._waiting):
            if w.req.priority < p:
                self._waiting.insert(i, r)
                return

    def _admit(self) -> None:
        """FIFO: move waiting requests to running while a slot and their whole KV reservation are free."""
        if self._pending_swap is not None:
            return  # a weight update is waiting for running requests to finish
        while self._waiting and len(self._running) < self.max_running_requests:
            r = self._waiting[0]
            need = r.pages_needed
            if need > len(self._free_pages) + len(self._evictable):
                break
            while need > len(self._free_pages):  # reuse the cached prompt pages released longest ago
                page, _ = self._evictable.popitem(last=False)
                del self._prefix_pages[self._page_keys.pop(page)]
                self._free_pages.append(page)
            self._waiting.popleft()
            r.pages = [self._free_pages.pop() for _ in range(need)]
            for page in r.pages:
                self._page_refs[page] = 1
            r.table_row = self._free_rows.pop()
            self._page_table[r.table_row, :need] = torch.tensor(r.pages)
            self._running.append(r)

    def _release_pages(self, r: _Request) -> None:
        for page in reversed(r.pages):
            self._page_refs[page] -= 1
            if self._page_refs[page] == 0:
                if page in self._page_keys:  # still a registered prompt page: keep it for later requests
                    self._evictable[page] = None
                else:
                    self._free_pages.append(page)
        r.pages = []
        r.shared_pages = 0
        r.serials = []
        if r.table_row >= 0:
            self._free_rows.append(r.table_row)
            r.table_row = -1

    def _finish(self, r: _Request, reason: dict, emit: bool = True) -> None:
        """End a request (running or waiting) and send its last chunk."""
        if r.done:
            return
        r.done = True
        if r in self._running:
            self._running.remove(r)
        else:
            try:
                self._waiting.remove(r)
            except ValueError:
                pass
        self._release_pages(r)
        if emit:
            r.pend_reason = reason
            self._mark_dirty(r)

    def _mark_dirty(self, r: _Request) -> None:
        if not r.dirty:
            r.dirty = True
            self._dirty.append(r)

    # ---- shared prompt pages ----

    def _forget_prefixes(self) -> None:
        """Weights changed: registered pages hold the old weights' KV. Their holders keep them (an in-place pause
        resumes on them, as SGLang does); nobody new may map them."""
        self._prefix_pages.clear()
        self._page_keys.clear()
        self._free_pages.extend(self._evictable)
        self._evictable.clear()
        for r in self._running:
            r.may_register = False

    def _map_prefix(self, r: _Request) -> None:
        """Before r's first prefill step: replace its leading pages with registered ones holding the same prompt
        tokens, as far as they match, always leaving at least one prompt token to compute (its logits sample the
        first output token). Requests that want prompt logprobs compute everything."""
        r.cached_tokens = 0
        if r.want_input_lp or r.key0 is None or not self.prefix_cache:
            return
        limit = (r.prompt_len - 1) // PAGE_SIZE
        prev, i = -1, 0
        while i < limit:
            hit = self._prefix_pages.get((prev, tuple(r.tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])))
            if hit is None:
                break
            page, serial = hit
            own = r.pages[i]
            self._page_refs[own] -= 1
            if self._page_refs[own] == 0:
                self._free_pages.append(own)
            if self._page_refs[page] == 0:
                del self._evictable[page]
            self._page_refs[page] += 1
            r.pages[i] = page
            r.serials.append(serial)
            prev, i = serial, i + 1
        if i:
            self._page_table[r.table_row, :i] = torch.tensor(r.pages[:i])
            r.num_cached = r.cached_tokens = i * PAGE_SIZE
            r.shared_pages = i

    def _register_prefix(self, r: _Request) -> None:
        """After a step: register r's prompt pages that are now completely written. A key chains through the
        previous page's registration, so equal keys mean equal prompts up to and including the page."""
        full = min(r.num_cached, r.prompt_len) // PAGE_SIZE if self.prefix_cache else 0
        while r.may_register and r.shared_pages < full:
            i = r.shared_pages
            key = (r.serials[i - 1] if i else -1, tuple(r.tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]))
            if key in self._prefix_pages:  # another request registered the same tokens first: keep theirs
                r.may_register = False
                break
            self._prefix_pages[key] = (r.pages[i], self._next_serial)
            self._page_keys[r.pages[i]] = key
            r.serials.append(self._next_serial)
            self._next_serial += 1
            r.shared_pages += 1

    def _step(self) -> None:
        """One forward over every running request: decode rows plus prefill chunks within the token budget."""
        self._admit()
        sched: list[tuple[_Request, int]] = []
        budget = self.chunked_prefill_size
        # first prompt pages being computed right now: a request with the same one waits a step and then maps it
        # (the samples of one prompt arrive together; without this every one of them would compute the prompt)
        computing: set[tuple[int, tuple[int, ...]]] = set()
        for r in self._running:
            if 0 < r.num_cached < r.prompt_len and r.key0 is not None and r.shared_pages == 0 and r.may_register:
                computing.add(r.key0)
        for r in self._running:
            pending = len(r.tokens) - r.num_cached
            if pending == 1:
                sched.append((r, 1))
                continue
            if budget <= 0:
                continue
            if r.num_cached == 0:
                self._map_prefix(r)
                if r.num_cached == 0 and r.key0 is not None and not r.want_input_lp and self.prefix_cache:
                    if r.key0 in computing:
                        continue
                    computing.add(r.key0)
                pending = len(r.tokens) - r.num_cached
                if pending == 1:
                    sched.append((r, 1))
                    continue
            n = min(pending, budget)
            budget -= n
            sched.append((r, n))
        if not sched:
            return
        seqs, logit_rows, sample_reqs, input_lp = [], [], [], []
        saved_lp_next = [r.lp_next for r, _ in sched]
        n_rows = 0  # logits rows requested so far
        for r, n in sched:
            start = r.num_cached
            seqs.append((r.tokens[start:start + n], start, r.pages, r.table_row))
            rows: list[int] = []
            if r.lp_next < r.prompt_len:
                # prompt position k is scored by the logits at position k - 1, if that falls in this chunk
                lo, hi = max(r.lp_next, start + 1), min(r.prompt_len, start + n + 1)
                if lo < hi:
                    input_lp.append((r, n_rows, list(range(lo, hi))))
                    rows.extend(range(lo - 1 - start, hi - 1 - start))
                    r.lp_next = hi
            if start + n == len(r.tokens) and len(r.output_ids) < r.max_new:
                sample_reqs.append((r, n_rows + len(rows)))
                rows.append(n - 1)
            n_rows += len(rows)
            logit_rows.append(rows)
            r.num_cached = start + n
        batch = build_step_batch(seqs, self._page_table, PAGE_SIZE, self.device, logit_rows, self.dtype)
        try:
            logits = self.model.forward(batch, self.cache, lambda: self._urgent)  # [n_rows, V]
        except StepInterrupted:  # nothing was sampled: put the requests back as they were; the step is redone
            for (r, _), (_, start, _, _), lp_next in zip(sched, seqs, saved_lp_next):
                r.num_cached, r.lp_next = start, lp_next
            return
        for r, row0, positions in input_lp:
            temp = 1.0 if r.params.greedy else r.params.temperature
            lp = torch.log_softmax(logits[row0:row0 + len(positions)] / temp, dim=-1)  # [n, V]
            ids = torch.tensor([r.tokens[p] for p in positions], device=lp.device)
            r.input_logprobs.extend(lp.gather(1, ids[:, None])[:, 0].tolist())
        for (r, _), (_, start, _, _) in zip(sched, seqs):
            if start < r.prompt_len:  # this step wrote prompt KV
                self._register_prefix(r)
        if sample_reqs:
            self._sample(logits, sample_reqs)
        for r, n in sched:  # prompts of max_new_tokens == 0 end after their prefill
            if not r.done and r.max_new == 0 and r.num_cached == len(r.tokens):
                self._finish(r, {"type": "length", "length": 0})

    def _sample(self, logits: torch.Tensor, sample_reqs: list[tuple[_Request, int]]) -> None:
        rows = torch.tensor([i for _, i in sample_reqs], device=logits.device)
        lg = logits.index_select(0, rows)  # [B, V]
        params = []
        for r, _ in sample_reqs:
            p = r.params
            p.banned = sorted(r.stop_ids) if len(r.output_ids) < r.req.sampling.min_new_tokens and r.stop_ids else None
            p.output_ids = r.output_ids if p.has_penalty else None
            params.append(p)
        lg = process_logits(lg, params)
        k = max(r.req.top_logprobs_num for r, _ in sample_reqs)
        tokens, lps, top = sample(lg, params, self._generator, k)
        tokens_l, lps_l = tokens.tolist(), lps.tolist()
        finished: list[_Request] = []
        top_l = (top[0].tolist(), top[1].tolist()) if top is not None else None
        for i, (r, _) in enumerate(sample_reqs):
            tok = tokens_l[i]
            r.tokens.append(tok)
            r.output_ids.append(tok)
            r.pend_ids.append(tok)
            r.pend_lps.append(lps_l[i])
            if top_l is not None and r.req.top_logprobs_num > 0:
                kk = r.req.top_logprobs_num
                r.pend_top.append(list(zip(top_l[0][i][:kk], top_l[1][i][:kk])))
            self._mark_dirty(r)
            reason = self._check_finished(r, tok)
            if reason is not None:
                r.done = True
                r.pend_reason = reason
                finished.append(r)
        if finished:
            done = set(map(id, finished))
            self._running = [r for r in self._running if id(r) not in done]
            for r in finished:
                self._release_pages(r)

    def _check_finished(self, r: _Request, tok: int) -> dict | None:
        n = len(r.output_ids)
        if n >= r.max_new:
            return {"type": "length", "length": r.max_new}
        if n < r.req.sampling.min_new_tokens:
            return None
        if tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.stop_strs:
            if self._stop_tokenizer is None:
                self._stop_tokenizer = copy.deepcopy(self.tokenizer)
            tail = self._stop_tokenizer.decode(r.output_ids[-r.stop_window:],
                                               skip_special_tokens=r.req.sampling.skip_special_tokens)
            for s in r.stop_strs:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None


def _coalesce(chunks: list[EngineChunk]) -> list[EngineChunk]:
    """Merge consecutive chunks made by the same weights, so a slow consumer gets fewer, larger chunks."""
    out: list[EngineChunk] = []
    for c in chunks:
        if out and out[-1].weight_version == c.weight_version and out[-1].finish_reason is None:
            prev = out[-1]
            prev.new_ids = prev.new_ids + c.new_ids
            prev.new_logprobs = prev.new_logprobs + c.new_logprobs
            prev.new_top_logprobs = prev.new_top_logprobs + c.new_top_logprobs
            prev.finish_reason = c.finish_reason
            prev.completion_tokens = c.completion_tokens
            if prev.input_logprobs is None:
                prev.input_logprobs = c.input_logprobs
        else:
            out.append(c)
    return out


def _set_future(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _next_version(current: str, given: str | None) -> str:
    """The version after an update: the given one, else the current one plus one when it is a number."""
    if given is not None:
        return given
    return str(int(current) + 1) if current.isdigit() else current


def _eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (a model may have several)."""
    import json

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(model_path, name)
        if os.path.exists(p):
            with open(p) as f:
                value = json.load(f).get("eos_token_id")
            ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def _destroy_group(group) -> None:
    from areal_async.inference.weights import destroy_group

    try:
        destroy_group(group)
    except Exception:  # best effort at shutdown
        log.warning("failed to destroy a weight update group", exc_info=True)


