"""What runs in the next engine step: the queues, admission, chunked prefill, prompt-page sharing, sampling and the
stop rules. Everything here belongs to the engine thread (engine.py sends it commands between steps), so there are
no locks.

Scheduling: FIFO admission (a request with a larger `priority` goes ahead of lower ones in the queue, as held-out
evals do so they need not wait behind thousands of queued rollouts) while a running slot (`max_running_requests`)
and KV pages for prompt + `max_new_tokens` are free (reserving the whole budget up front means a running request is
never evicted); each step decodes every running request and prefills waiting ones in chunks of at most
`chunked_prefill_size` tokens, batched together. Requests that do not fit wait.

Shared prompts (pages.py has the rules): a request about to prefill maps every registered page its prompt begins
with instead of computing it (reported as `cached_tokens`), keeping at least one prompt token to compute; its own
prompt pages are registered as soon as their KV is written. A request whose first prompt page another request is
computing right now waits one step for it: the G samples of a prompt arrive together, and without that each would
compute the prompt. Requests that ask for prompt logprobs always compute their whole prompt.

Stop rules, checked after each token in SGLang's order: `max_new_tokens` first (finish "length"), then, once
`min_new_tokens` are out, stop token ids (`stop_token_ids` always; the model's EOS ids unless `ignore_eos`), then
stop strings, matched on the decoded tail of the output. Output ids keep the stop token; trimming a matched stop
string from the text is the server's job. Before `min_new_tokens`, stop tokens are banned from sampling.

Logprobs: the logprob of every sampled token is `log_softmax(logits / temperature)` at the sampled token (raw
`log_softmax(logits)` for greedy, temperature < 1e-6), after penalties and the min_new_tokens stop-token ban and
before top-k/top-p/min-p truncation (see sampling.py). Input logprobs (`logprob_start_len >= 0`) use the same rule.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable

import torch

from areal_async.protocol.engine_api import EngineRequest
from areal_async.server.model import DecoderModel, KVCache, StepInterrupted, build_step_batch
from areal_async.server.pages import ROOT, PagePool
from areal_async.server.sampling import DrawPlan, RowParams, plan_draws, process_logits, sample


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def validate_request(req: EngineRequest, *, vocab_size: int, context_len: int, max_total_tokens: int) -> None:
    """What the engine can serve: a ValueError naming the problem otherwise (the server turns it into a 400)."""
    s = req.sampling
    n = len(req.input_ids)
    if n == 0:
        raise ValueError("input_ids is empty")
    bad = [t for t in req.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if s.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {s.max_new_tokens}")
    if n + s.max_new_tokens > context_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the context length {context_len}"
        )
    if n + s.max_new_tokens > max_total_tokens:
        raise ValueError(
            f"prompt ({n} tokens) + max_new_tokens ({s.max_new_tokens}) can never fit the KV cache "
            f"budget of {max_total_tokens} tokens (max_total_tokens)"
        )
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


class Request:
    """Engine-thread state of one request. `stream` is the loop-side end its chunks go to (opaque here)."""

    def __init__(self, req: EngineRequest, stream: object, eos_ids: list[int], device: torch.device, page_size: int):
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
        self.serials: list[int] = []  # the registrations of those pages
        self.may_register = True  # False once the weights changed under it: its KV is not the new weights' KV
        # the registry key of the first prompt page (see Scheduler.step); None when the prompt has no full page to
        # share beyond the one token that must be computed
        self.key0 = (ROOT, tuple(req.input_ids[:page_size])) if len(req.input_ids) > page_size else None
        self.table_row = -1  # row of the page table while admitted
        self.max_new = s.max_new_tokens
        self.pages_needed = -(-(self.prompt_len + self.max_new) // page_size)
        self.stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_ids))
        self.stop_strs = [x for x in s.stop if x]
        self.stop_window = 2 * max((len(x) for x in self.stop_strs), default=0) + 2  # tokens of tail to decode
        gen = None
        if s.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(s.seed)
        self.params = RowParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            generator=gen,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
        )
        self.want_input_lp = req.logprob_start_len >= 0
        # input logprobs: prompt positions [lp_next, prompt_len) are still to be scored (position 0 has none)
        self.input_logprobs: list[float | None] = [None] if req.logprob_start_len == 0 else []
        self.lp_next = max(req.logprob_start_len, 1) if self.want_input_lp else self.prompt_len
        self.sent_first = False
        self.saved_u: float | None = None  # the uniform drawn for a step that was interrupted (reused when redone)
        # tokens made since the last chunk; sealed into one chunk when the loop is ready for more (engine._flush)
        self.pend_ids: list[int] = []
        self.pend_lps: list[float] = []
        self.pend_top: list[list[tuple[float, int]]] = []
        self.pend_reason: dict | None = None
        self.dirty = False
        self.done = False


class Scheduler:
    """The queues and the step over `DecoderModel`; see the module docstring for the rules."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        *,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_pages_per_request: int,
        prefix_cache: bool,
        tokenizer,
        generator: torch.Generator,
        interrupt: Callable[[], bool],
    ):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.page_size = cache.page_size
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.prefix_cache = prefix_cache
        self.pages = PagePool(cache.num_pages, cache.page_size)
        self._page_table = torch.zeros(max_running_requests, max_pages_per_request, dtype=torch.long)  # host
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.dirty: list[Request] = []  # requests with unsealed tokens or an unsent finish
        self.admit_blocked = False  # a weight update waits for running requests to end: admit nobody
        self._tokenizer = tokenizer
        self._stop_tokenizer = None  # engine thread's own copy (HF tokenizers are not safe to share across threads)
        self._generator = generator
        self._interrupt = interrupt

    # ---- queue operations (commands from the loop run these between steps) ----

    def add(self, r: Request) -> None:
        """Queue in arrival order behind every request of the same or a higher priority."""
        p = r.req.priority
        if not self.waiting or self.waiting[-1].req.priority >= p:
            self.waiting.append(r)
            return
        for i, w in enumerate(self.waiting):
            if w.req.priority < p:
                self.waiting.insert(i, r)
                return

    def all_requests(self) -> list[Request]:
        return list(self.running) + list(self.waiting)

    def finish(self, r: Request, reason: dict, emit: bool = True) -> None:
        """End a request (running or waiting) and queue its last chunk."""
        if r.done:
            return
        r.done = True
        if r in self.running:
            self.running.remove(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        self._release(r)
        if emit:
            r.pend_reason = reason
            self.mark_dirty(r)

    def retract_all(self) -> None:
        """Running requests back to the front of the queue, in their original order, their KV dropped: they are
        recomputed (prompt and output so far) when admitted again."""
        for r in reversed(self.running):
            self._release(r)
            r.num_cached = 0
            self.waiting.appendleft(r)
        self.running.clear()

    def forget_prefixes(self) -> None:
        """Weights changed: registered pages hold the old weights' KV. Their holders keep them (an in-place pause
        resumes on them, as SGLang does); nobody new may map them."""
        self.pages.forget()
        for r in self.running:
            r.may_register = False

    def mark_dirty(self, r: Request) -> None:
        if not r.dirty:
            r.dirty = True
            self.dirty.append(r)

    # ---- admission and pages ----

    def _admit(self) -> None:
        """FIFO: move waiting requests to running while a slot and their whole KV reservation are free."""
        if self.admit_blocked:
            return
        while self.waiting and len(self.running) < self.max_running_requests:
            r = self.waiting[0]
            if r.pages_needed > self.pages.available:
                break
            self.waiting.popleft()
            r.pages = self.pages.allocate(r.pages_needed)
            r.table_row = self._free_rows.pop()
            self._page_table[r.table_row, : len(r.pages)] = torch.tensor(r.pages)
            self.running.append(r)

    def _release(self, r: Request) -> None:
        self.pages.release(r.pages)
        r.pages = []
        r.shared_pages = 0
        r.serials = []
        if r.table_row >= 0:
            self._free_rows.append(r.table_row)
            r.table_row = -1

    def _map_prefix(self, r: Request) -> None:
        """Before r's first prefill step: replace its leading pages with registered ones holding the same prompt
        tokens, as far as they match, always leaving at least one prompt token to compute (its logits sample the
        first output token). Requests that want prompt logprobs compute everything."""
        r.cached_tokens = 0
        if r.want_input_lp or r.key0 is None or not self.prefix_cache:
            return
        hits = self.pages.match(r.tokens[: r.prompt_len], (r.prompt_len - 1) // self.page_size)
        for i, (page, serial) in enumerate(hits):
            self.pages.release([r.pages[i]])
            self.pages.share(page)
            r.pages[i] = page
            r.serials.append(serial)
        if hits:
            n = len(hits)
            self._page_table[r.table_row, :n] = torch.tensor(r.pages[:n])
            r.num_cached = r.cached_tokens = n * self.page_size
            r.shared_pages = n

    def _register_prefix(self, r: Request) -> None:
        """After a step: register r's prompt pages that are now completely written."""
        ps = self.page_size
        full = min(r.num_cached, r.prompt_len) // ps if self.prefix_cache else 0
        while r.may_register and r.shared_pages < full:
            i = r.shared_pages
            serial = self.pages.register(r.serials[i - 1] if i else ROOT, r.tokens[i * ps : (i + 1) * ps], r.pages[i])
            if serial is None:  # another request registered the same tokens first: keep theirs
                r.may_register = False
                break
            r.serials.append(serial)
            r.shared_pages += 1

    # ---- the step ----

    def can_step(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and not self.admit_blocked)

    @torch.inference_mode()
    def step(self) -> None:
        """One forward over every running request: decode rows plus prefill chunks within the token budget."""
        self._admit()
        sched: list[tuple[Request, int]] = []
        budget = self.chunked_prefill_size
        # first prompt pages being computed right now: a request with the same one waits a step and then maps it
        computing: set[tuple[int, tuple[int, ...]]] = set()
        for r in self.running:
            if 0 < r.num_cached < r.prompt_len and r.key0 is not None and r.shared_pages == 0 and r.may_register:
                computing.add(r.key0)
        for r in self.running:
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
            seqs.append((r.tokens[start : start + n], start, r.pages, r.table_row))
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
        batch = build_step_batch(
            seqs, self._page_table, self.page_size, self.device, logit_rows, self.model.dtype, self.model.paged_decode
        )
        draws = self._plan_draws(sample_reqs) if sample_reqs and n_rows == len(sample_reqs) else None
        try:
            logits = self.model.forward(batch, self.cache, self._interrupt, draws)  # [n_rows, V]
        except StepInterrupted:  # nothing was sampled: put the requests back as they were; the step is redone
            for (r, _), (_, start, _, _), lp_next in zip(sched, seqs, saved_lp_next):
                r.num_cached, r.lp_next = start, lp_next
            if draws is not None:  # the redo reuses these draws: a seeded request's tokens ignore interruptions
                for (r, _), u in zip(sample_reqs, draws.uniforms.tolist()):
                    r.saved_u = u if not r.params.greedy else None
            return
        for r, row0, positions in input_lp:
            temp = 1.0 if r.params.greedy else r.params.temperature
            lp = torch.log_softmax(logits[row0 : row0 + len(positions)] / temp, dim=-1)  # [n, V]
            ids = torch.tensor([r.tokens[p] for p in positions], device=lp.device)
            r.input_logprobs.extend(lp.gather(1, ids[:, None])[:, 0].tolist())
        for (r, _), (_, start, _, _) in zip(sched, seqs):
            if start < r.prompt_len:  # this step wrote prompt KV
                self._register_prefix(r)
        if sample_reqs:
            self._sample(logits, sample_reqs, draws)
        for r, _n in sched:  # prompts of max_new_tokens == 0 end after their prefill
            if not r.done and r.max_new == 0 and r.num_cached == len(r.tokens):
                self.finish(r, {"type": "length", "length": 0})

    @staticmethod
    def _row_params(r: Request) -> RowParams:
        """r's sampling settings for this step: the stop-token ban before min_new_tokens, its outputs for
        penalties."""
        p = r.params
        p.banned = sorted(r.stop_ids) if len(r.output_ids) < r.req.sampling.min_new_tokens and r.stop_ids else None
        p.output_ids = r.output_ids if p.has_penalty else None
        return p

    def _plan_draws(self, sample_reqs: list[tuple[Request, int]]) -> DrawPlan | None:
        """This step's draws fixed before its forward (sampling.plan_draws), when every logits row samples, the
        model runs on CPU and nobody asks for top logprobs; else None (sampling after the forward, as _sample)."""
        if self.device.type != "cpu" or any(r.req.top_logprobs_num for r, _ in sample_reqs):
            return None
        params = [self._row_params(r) for r, _ in sample_reqs]
        return plan_draws(params, self._generator, self.model.lm_head.shape[0], [r.saved_u for r, _ in sample_reqs])

    def _sample(
        self, logits: torch.Tensor, sample_reqs: list[tuple[Request, int]], draws: DrawPlan | None = None
    ) -> None:
        top_l = None
        if draws is not None:  # every logits row samples, in order; the forward may have drawn already
            draws.draw(logits)
            tokens_l, lps_l = draws.tokens.tolist(), draws.logprobs.tolist()
        else:
            rows = [i for _, i in sample_reqs]
            if rows == list(range(logits.shape[0])):  # every logits row samples (a pure decode step): no copy
                lg = logits  # [B, V]; input logprobs were read from it already, so processing it in place is safe
            else:
                lg = logits.index_select(0, torch.tensor(rows, device=logits.device))  # [B, V]
            params = [self._row_params(r) for r, _ in sample_reqs]
            lg = process_logits(lg, params)
            k = max(r.req.top_logprobs_num for r, _ in sample_reqs)
            saved = [r.saved_u for r, _ in sample_reqs]
            tokens, lps, top = sample(lg, params, self._generator, k, getattr(self.model, "elementwise", None), saved)
            tokens_l, lps_l = tokens.tolist(), lps.tolist()
            top_l = (top[0].tolist(), top[1].tolist()) if top is not None else None
        finished: list[Request] = []
        for i, (r, _) in enumerate(sample_reqs):
            r.saved_u = None
            tok = tokens_l[i]
            r.tokens.append(tok)
            r.output_ids.append(tok)
            r.pend_ids.append(tok)
            r.pend_lps.append(lps_l[i])
            if top_l is not None and r.req.top_logprobs_num > 0:
                kk = r.req.top_logprobs_num
                r.pend_top.append(list(zip(top_l[0][i][:kk], top_l[1][i][:kk])))
            self.mark_dirty(r)
            reason = self._check_finished(r, tok)
            if reason is not None:
                r.done = True
                r.pend_reason = reason
                finished.append(r)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for r in finished:
                self._release(r)

    def _check_finished(self, r: Request, tok: int) -> dict | None:
        n = len(r.output_ids)
        if n >= r.max_new:
            return {"type": "length", "length": r.max_new}
        if n < r.req.sampling.min_new_tokens:
            return None
        if tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.stop_strs:
            if self._stop_tokenizer is None:
                self._stop_tokenizer = copy.deepcopy(self._tokenizer)
            tail = self._stop_tokenizer.decode(
                r.output_ids[-r.stop_window :], skip_special_tokens=r.req.sampling.skip_special_tokens
            )
            for s in r.stop_strs:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None
