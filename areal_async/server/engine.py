"""The continuous-batching generation engine behind the embedded server (implements `engine_api.Engine`).

Two threads, one owner each:

    asyncio loop (server)                          engine thread (this module's step loop)
    ---------------------                          ---------------------------------------
    generate() -> command "add"      --cmds-->     run commands at the step boundary
    abort/pause/resume/weights       --cmds-->     admit waiting requests (slots, KV budget)
    awaits futures / per-request     <--chunks--   one forward for every scheduled request:
    streams (call_soon_threadsafe)                 decode rows + prefill chunks, batched sampling

Every piece of scheduler state (queues, KV pages, requests; scheduler.py) belongs to the engine thread; the loop
only sends commands and receives chunks, so there are no locks around model state and pause, abort and weight swaps
take effect exactly between two steps. Those urgent commands also cut the step in progress short (the model polls
between layers; the interrupted step is simply redone), so a pause waits for one layer, not a whole step.
Chunks go to the loop in one `call_soon_threadsafe` call per batch; while a batch is still undelivered (the loop is
busy), new tokens accumulate per request and travel later as one larger chunk, so a loaded loop costs the engine
nothing per token. A request whose consumer reads only the end (`EngineRequest.stream=False`: a non-streaming
HTTP request) is not handed over after every step at all, only when it finishes, before a weight swap and at
commands: each hand-over wakes the loop, whose thread then takes a core from the step's OpenMP team (2-core AMD
EPYC Zen 5, SmolLM2-135M fp32, the 64-request workload of benchmarks/inference_throughput.py through HTTP: 4% more
tokens/s without the per-step wake-ups, median of 6 runs in turns). A command's result is posted after every chunk
made before it, so `pause("abort")` returns after the aborted requests' final chunks are in their streams.

Weight updates (disk and broadcast alike, as SGLang 0.5 does): the new tensors are loaded and validated first; the
swap then waits until no request is running, unless generation is paused, in which case it happens at once. While
it waits, nobody new is admitted. Requests paused `in_place` keep their KV cache and continue under the new weights
after `resume()` (SGLang's in-flight update); `flush_cache=true` cannot be honoured while such requests hold KV, so
that combination is refused before anything changes (SGLang's scheduler asserts on the failed flush). Registered
prompt pages are always forgotten at a swap, whatever `flush_cache` says: their KV belongs to the old weights.
That protocol is in weight_updates.py, whose methods the engine inherits.

Each chunk carries the weight version of the weights that computed its tokens: pending tokens are sealed into
chunks before every swap, so a response can say exactly where the version changed.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from areal_async.host.memory import keep_freed_memory
from areal_async.host.torch_threads import single_torch_thread
from areal_async.net.custom_group import bind_cuda, device_uuid
from areal_async.protocol.engine_api import EngineChunk, EngineRequest, PauseMode
from areal_async.server.device import resolve_dtype, resolve_visible_device
from areal_async.server.kernels.decode_layer import InterruptWord
from areal_async.server.model import DecoderModel, KVCache, ModelSpec
from areal_async.server.scheduler import Request, Scheduler, abort_reason, validate_request
from areal_async.server.weight_updates import WeightUpdates, destroy_update_group
from areal_async.server.weights import load_checkpoint
from areal_async.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PAGE_SIZE = 16


class _Stream:
    """The loop-side end of one request: chunks delivered by the engine thread, and a wake-up event."""

    __slots__ = ("chunks", "event")

    def __init__(self) -> None:
        self.chunks: list[EngineChunk] = []
        self.event = asyncio.Event()


class AsyncEngine(WeightUpdates):
    """Continuous-batching engine over `DecoderModel`; see the module docstring for the threading model."""

    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_total_tokens: int = 65536,
        max_running_requests: int = 256,
        weight_version: str = "0",
        seed: int = 0,
        chunked_prefill_size: int | None = None,
        prefix_cache: bool = True,
        threads: int | None = None,
    ):
        self.device = resolve_visible_device(device)
        bind_cuda(self.device)  # this thread loads the weights; the engine thread binds itself
        self.dtype = resolve_dtype(dtype, self.device, model_path)
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
        self.prefix_cache = prefix_cache  # share full prompt pages between requests (scheduler.py)
        self.seed = seed
        self.threads = threads or torch.get_num_threads()  # the engine thread's count (host/torch_threads.py)
        with single_torch_thread():  # built here, stepped in the engine thread: only that one runs an OpenMP team
            spec, tensors = load_checkpoint(model_path)
            self.spec: ModelSpec = spec
            self.model = DecoderModel(spec, self.device, self.dtype)
            self.model.load_tensors(tensors)
            del tensors
            self.context_len = spec.max_position_embeddings
            self.vocab_size = spec.vocab_size
            self.cache = KVCache(spec, max_total_tokens, PAGE_SIZE, self.device, self.dtype)
            # the project's own reader of the tokenizer files (areal_async/tokenizer.py, held equal to transformers by
            # tests/test_tokenizer.py): the same Rust tokenizer without importing transformers, which took 1.7 of a
            # SmolLM2 server's start-up seconds (import 0.75 s, load 0.9 s; ours loads in 0.08 s)
            self.tokenizer = Tokenizer(model_path)
            self._eos_ids = sorted(set(self.tokenizer.eos_token_ids))
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        self._groups: dict[str, object] = {}  # weight-update process groups by name
        self._lora_base: dict[str, torch.Tensor] | None = None  # W0 of adapted layers (server/lora_load.py)
        self.gpu_uuid = device_uuid(self.device)  # "" on CPU; the broadcast compares it with the trainer's

        # engine-thread state
        # a pause, abort or weight swap is queued: the step in progress (which polls this between layers) stops
        self._urgent = InterruptWord()
        self._sched = Scheduler(
            self.model,
            self.cache,
            max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size,
            max_pages_per_request=-(-min(self.context_len, max_total_tokens) // PAGE_SIZE),
            prefix_cache=prefix_cache,
            tokenizer=self.tokenizer,
            generator=generator,
            interrupt=self._urgent,
        )
        self._paused = False
        self._pending_swap: Callable[[], None] | None = None  # a weight swap waiting for running requests to end
        self._outbox: list[tuple[_Stream, EngineChunk]] = []  # sealed chunks not yet handed to the loop
        self._delivering = False  # a batch is on its way to the loop and has not been delivered yet
        # shared between threads (guarded by _cv)
        self._cv = threading.Condition()
        self._cmds: list[Callable[[], None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # loop side: rids in flight
        self._weights_lock: asyncio.Lock | None = None
        self._n_running = 0
        self._n_waiting = 0

    @property
    def pages(self):
        """The KV page pool (pages.py); engine-thread state, read it only while the engine is idle."""
        return self._sched.pages

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
            destroy_update_group(group)
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
        validate_request(
            req, vocab_size=self.vocab_size, context_len=self.context_len, max_total_tokens=self.max_total_tokens
        )
        return self._generate(req)

    async def _generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        if self._loop is None:
            raise RuntimeError("engine not started: await engine.start() first")
        if req.rid in self._streams:
            raise ValueError(f"rid {req.rid!r} is already in flight")
        stream = _Stream()
        self._streams[req.rid] = stream
        r = Request(req, stream, self._eos_ids, self.device, PAGE_SIZE)
        finished = False
        try:
            self._post(lambda: self._sched.add(r))
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
                self._post(lambda: self._sched.finish(r, abort_reason("client went away"), emit=False))

    async def abort(self, rid: str = "", abort_all: bool = False) -> int:
        def cmd() -> int:
            hits = [r for r in self._sched.all_requests() if abort_all or r.rid.startswith(rid)]
            for r in hits:
                self._sched.finish(r, abort_reason("aborted by request"))
            return len(hits)

        return await self._call(cmd, urgent=True)

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, retract or in_place")

        def cmd() -> None:
            self._paused = True
            if mode == "abort":
                for r in self._sched.all_requests():
                    self._sched.finish(r, abort_reason("generation paused (abort)"))
            elif mode == "retract":
                self._sched.retract_all()

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
            if self._sched.running:
                return False
            self._sched.forget_prefixes()
            return True

        return await self._call(cmd)

    # ---- weights: inherited from WeightUpdates (weight_updates.py) ------------------------------------------

    # ---- info and tokenizer ---------------------------------------------------------------------------------

    def server_args(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_total_tokens": self.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "chunked_prefill_size": self.chunked_prefill_size,
            "page_size": PAGE_SIZE,
            "context_length": self.context_len,
            "random_seed": self.seed,
            "disable_radix_cache": not self.prefix_cache,
            "architecture": self.spec.architecture,
            "weight_version": self.weight_version,
            "busy_s": self.busy_s,
            "torch_threads": self.threads,
            # SGLang's parallelism fields: a broadcast joins each server as tp_size ranks (one process here)
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "base_gpu_id": self.device.index or 0,
            "gpu_uuid": self.gpu_uuid,
        }

    def encode(self, text: str) -> list[int]:
        # with what the tokenizer's post-processor adds (a BOS, for some), as transformers' encode and SGLang do
        return self.tokenizer.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise ValueError(f"the tokenizer of {self.model_path} has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str)  # tokenize=False renders text
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    # ---- loop <-> thread plumbing ---------------------------------------------------------------------------

    def _post(self, cmd: Callable[[], None], urgent: bool = False) -> None:
        """Queue a command for the engine thread. An urgent one also interrupts the step in progress (between
        layers; the step is redone later), so pause and abort wait for one layer instead of a whole step."""
        with self._cv:
            self._cmds.append(cmd)
            if urgent:
                self._urgent.set(True)
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
        self._n_running, self._n_waiting = len(self._sched.running), len(self._sched.waiting)
        self._flush(force=True)
        self._to_loop(_set_future, fut, result, error)

    def _to_loop(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (process exit without shutdown): nobody is listening
            pass

    def _seal(self, every: bool = True) -> None:
        """Turn pending tokens into one chunk per request (under the current weight version): every request's, or
        with `every=False` (after a step) those of streamed and finished requests only; the others keep
        accumulating."""
        keep: list[Request] = []
        for r in self._sched.dirty:
            if not every and not r.req.stream and r.pend_reason is None:
                keep.append(r)
                continue
            chunk = EngineChunk(
                rid=r.rid,
                new_ids=r.pend_ids,
                new_logprobs=r.pend_lps if r.req.return_logprob else [],
                new_top_logprobs=r.pend_top,
                finish_reason=r.pend_reason,
                prompt_tokens=r.prompt_len,
                completion_tokens=len(r.output_ids),
                cached_tokens=r.cached_tokens,
                weight_version=self.weight_version,
            )
            if not r.sent_first:
                r.sent_first = True
                if r.want_input_lp:
                    chunk.input_logprobs = r.input_logprobs
            self._outbox.append((r.stream, chunk))
            r.pend_ids, r.pend_lps, r.pend_top, r.pend_reason, r.dirty = [], [], [], None, False
        self._sched.dirty = keep

    def _flush(self, force: bool = False) -> None:
        """Hand sealed chunks to the loop in one call. Unless forced, wait while the previous batch is still
        undelivered: tokens keep accumulating per request, so a busy loop gets fewer, larger chunks instead of
        falling behind (and the engine thread stops paying for wake-ups nobody is ready to take); and leave
        unfinished requests that nobody streams pending (see the module docstring). Forced, everything goes."""
        if self._delivering and not force:
            return
        self._seal(every=force)
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
        torch.set_num_threads(self.threads)
        # The CUDA current device is per thread and starts at cuda:0: without this, a server on cuda:3 would
        # create a context (and allocator state) on cuda:0, which another process may own.
        bind_cuda(self.device)
        sched = self._sched
        while True:
            with self._cv:
                while not (self._cmds or self._stopping or self._can_step() or self._swap_ready()):
                    self._cv.wait()
                cmds, self._cmds = self._cmds, []
                self._urgent.set(False)
                stopping = self._stopping
            for cmd in cmds:
                cmd()
            if stopping:
                if self._pending_swap is not None:
                    self._pending_swap()
                for r in sched.all_requests():
                    sched.finish(r, abort_reason("engine shut down"))
                self._flush(force=True)
                return
            if self._swap_ready():
                swap, self._pending_swap = self._pending_swap, None
                swap()
            if self._can_step():
                t_step = time.perf_counter()
                try:
                    sched.step()
                except Exception as e:  # never leave clients hanging: fail the running requests, keep serving
                    log.exception("engine step failed")
                    for r in list(sched.running):
                        sched.finish(r, abort_reason(f"engine error: {type(e).__name__}: {e}"))
                self.busy_s += time.perf_counter() - t_step  # model compute time: benchmarks report busy fractions
            self._n_running, self._n_waiting = len(sched.running), len(sched.waiting)
            self._flush(force=not self._can_step())  # going idle: nothing may stay pending

    def _swap_ready(self) -> bool:
        return self._pending_swap is not None and (self._paused or not self._sched.running)

    def _can_step(self) -> bool:
        return not self._paused and self._sched.can_step()


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
