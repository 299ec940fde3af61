"""One simulated inference server: continuous batching in virtual time.

The model (docs/planner.md, "The server"): a server (one tensor-parallel group) holds a set of running sequences
that advance one token per decode step, in lockstep. A decode step over n sequences holding K tokens of KV costs

    overhead + max(memory, compute)         (roofline; `additive` adds the two instead, as a CPU does)
    memory  = weights_s + kv_s * K          the weights and every running sequence's KV read once per step
    compute = seq_s * n + attn_s * K        2 x params FLOPs per sequence, plus the attention over its context

so a step gets slower as the batch grows and as contexts lengthen, and throughput rises with the batch until KV
capacity stops admission. Prompt groups queue until their KV reservation (the prompt once, shared by the group's
samples, plus each sample's whole answer: no retraction) fits and the running-sequence cap allows them; admitted
groups are prefilled first (compute-bound: per-token cost plus attention over the prompt), which stalls decoding
as SGLang's prefill-first scheduler does. Pauses stop the clock of the batch; an abort pause makes the server
recompute every running sequence's KV at resume; weight loads take `load_s`; an update without a pause waits for
the running sequences to finish first (and admits nothing meanwhile).

Why events and not steps: between two events (a sequence finishing, a group arriving, a pause) the batch does not
change, so the time for any number of steps has a closed form (K grows by n per step: a quadratic). The server
keeps one timer, at its next sequence completion, on the virtual clock (clock.py); a 32k-token answer costs a few
events, not 32,000.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import deque
from dataclasses import dataclass


@dataclass
class ServerCosts:
    """Every cost term of one server, in seconds, tokens and sequences (presets: costs.py; a profile: calibrate.py)."""

    step_overhead_s: float = 0.004  # scheduling, sampling, kernel launches per decode step
    weights_s: float = 0.001  # reading the weights once (weight bytes / effective HBM bandwidth)
    kv_s: float = 1e-8  # reading one token's KV (KV bytes per token / effective bandwidth)
    seq_s: float = 0.0  # compute per running sequence per step
    attn_s: float = 0.0  # attention compute per context token per step
    additive: bool = False  # memory + compute (CPU) instead of max(memory, compute) (GPU roofline)
    prefill_token_s: float = 1e-5  # prefill compute per prompt token
    prefill_attn_s: float = 0.0  # prefill attention per token per context token before it
    prefill_overhead_s: float = 0.0  # per prefill batch
    kv_capacity_tokens: int = 1_000_000  # KV the server can hold
    max_running: int = 256  # SGLang's max_running_requests
    prefix_sharing: bool = True  # a group's samples share the prompt's KV (radix cache)
    pause_s: float = 0.0  # one pause or continue call
    load_s: float = 1.0  # loading a new set of weights (disk read or broadcast receive)

    def step_time(self, n: int, k: float) -> float:
        """One decode step over `n` sequences holding `k` KV tokens."""
        mem = self.weights_s + self.kv_s * k
        comp = self.seq_s * n + self.attn_s * k
        return self.step_overhead_s + (mem + comp if self.additive else max(mem, comp))

    def time_for_steps(self, n: int, k: float, steps: float) -> float:
        """`steps` decode steps from (n, k), KV growing by n per step."""
        mem = (self.weights_s + self.kv_s * k) * steps + self.kv_s * n * steps * steps / 2
        comp = (self.seq_s * n + self.attn_s * k) * steps + self.attn_s * n * steps * steps / 2
        return self.step_overhead_s * steps + (mem + comp if self.additive else max(mem, comp))

    def steps_in(self, n: int, k: float, seconds: float) -> float:
        """How many decode steps fit in `seconds` from (n, k) (the inverse of `time_for_steps`)."""
        if seconds <= 0:
            return 0.0  # what _solve gives
        a_mem, b_mem = self.weights_s + self.kv_s * k, self.kv_s * n / 2
        a_cmp, b_cmp = self.seq_s * n + self.attn_s * k, self.attn_s * n / 2
        o = self.step_overhead_s
        if self.additive:
            return _solve(b_mem + b_cmp, o + a_mem + a_cmp, seconds)
        # min(_solve(b_mem, o + a_mem, seconds), _solve(b_cmp, o + a_cmp, seconds)), the solves inline (a pause
        # asks every server this)
        a = o + a_mem
        if b_mem <= 0:
            x = seconds / a if a > 0 else math.inf
        else:
            x = 2 * seconds / (a + math.sqrt(a * a + 4 * b_mem * seconds))
        a = o + a_cmp
        if b_cmp <= 0:
            y = seconds / a if a > 0 else math.inf
        else:
            y = 2 * seconds / (a + math.sqrt(a * a + 4 * b_cmp * seconds))
        return y if y < x else x

    def prefill_time(self, tokens: float, context: float = 0.0) -> float:
        """Prefill of `tokens` new tokens whose average earlier context is `context` tokens."""
        return tokens * (self.prefill_token_s + self.prefill_attn_s * context)


def _solve(b: float, a: float, t: float) -> float:
    """The x >= 0 with b x^2 + a x = t (a stable root); inf when nothing costs time."""
    if t <= 0:
        return 0.0
    if b <= 0:
        return t / a if a > 0 else math.inf
    return 2 * t / (a + math.sqrt(a * a + 4 * b * t))


class SimGroup:
    """One prompt group on a server: its samples' lengths (ascending), and where it stands."""

    __slots__ = (
        "lengths",
        "total",
        "prompt",
        "future",
        "start_step",
        "version",
        "need",
        "finish_step",
        "kv_term",
        "done_members",
    )

    def __init__(self, lengths: list[int], prompt: int, future: asyncio.Future) -> None:
        self.lengths = sorted(lengths)  # ascending: the prefill inserts them in order, the version split needs it
        self.total = sum(lengths)
        self.prompt = prompt
        self.future = future
        self.start_step = 0.0
        self.version = 0
        self.need = 0
        self.finish_step = 0.0  # the step its longest samples finish at
        self.kv_term = 0.0  # each running sample's KV is kv_term + step (prompt + tokens so far)
        self.done_members = 0


class SimServer:
    """One server on the virtual clock. `submit` a group; its future resolves to {version: tokens} once every
    sample finished. Counters: `busy_s` (prefilling or decoding), `load_busy_s` (loading weights),
    `generated_tokens`, `recomputed_tokens` (KV recomputed after abort pauses)."""

    def __init__(self, costs: ServerCosts, loop: asyncio.AbstractEventLoop, index: int = 0) -> None:
        self.c = costs
        self.loop = loop
        self.index = index
        self.version = 0
        self.t = loop.time()  # the time the state below describes
        self.step = 0.0  # decode steps done so far (every running sequence advanced by this many tokens)
        self.n = 0  # running sequences
        self.kv_base = 0.0  # K = kv_base + n * step
        self.reserved = 0  # KV tokens reserved by admitted groups
        # the running sequences from index `_head` on, sorted by the step they finish at: `fin` holds that step,
        # `grp` the sequence's group (equal steps in admission order). Two flat lists rather than a tuple per
        # sequence: the prefill inserts 16 sequences a group and the walks read every one, and floats compare and
        # insert faster alone (which samples of one group finish at one step is immaterial: they are alike)
        self.fin: list[float] = []
        self.grp: list[SimGroup] = []
        self._head = 0
        self.waiting: deque[SimGroup] = deque()
        # the version bounds: from step bound_steps[i] on, tokens are sampled by version bound_versions[i]
        self.bound_steps: list[float] = [-math.inf]
        self.bound_versions: list[int] = [0]
        self.prefill_end: float | None = None  # set while a prefill runs
        self.prefilling: list[SimGroup] = []
        self.paused = False
        self.draining = False  # an update without a pause waits for the running sequences
        self._drained: asyncio.Future | None = None
        self._pending_prefill_s = 0.0  # a prefill cut by a pause, resumed after it
        self._timer: asyncio.TimerHandle | None = None
        # the last walk (_next_event_time says what it holds)
        self._walk: list | None = None
        self.busy_s = 0.0
        self.load_busy_s = 0.0
        self.generated_tokens = 0
        self.recomputed_tokens = 0.0
        self._unstarted = 0  # sequences of groups waiting or in prefill

    # ---- the outside ------------------------------------------------------------------------------------------

    def submit(self, lengths: list[int], prompt: int) -> asyncio.Future:
        fut = asyncio.Future(loop=self.loop)  # loop.create_future(), less its frame
        self._advance()
        self.waiting.append(SimGroup(lengths, prompt, fut))
        self._unstarted += len(lengths)
        self._admit()
        self._schedule()
        return fut

    def pause(self, abort: bool) -> None:
        """Stop decoding; with `abort`, every running sequence's KV is recomputed when generation continues."""
        self._advance()
        if self.prefill_end is not None:
            self._pending_prefill_s += max(self.prefill_end - self.t, 0.0)
            self.prefill_end = None
        if abort and self.n:
            k = self.kv_base + self.n * self.step
            self.recomputed_tokens += k
            # sum of c^2 over running contexts approximated by K^2 / n (equal contexts)
            c = self.c  # c.prefill_time(k, k / n / 2), inline
            self._pending_prefill_s += k * (c.prefill_token_s + c.prefill_attn_s * (k / self.n / 2))
        self.paused = True
        # what `_schedule` does once paused: no timer
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        if self.paused:
            self.t = self.loop.time()  # `_advance` while paused: nothing runs, the clock moves
        else:
            self._advance()
        self.paused = False
        if self._pending_prefill_s > 0 and self.prefill_end is None:
            self.prefill_end = self.t + self._pending_prefill_s
            self._pending_prefill_s = 0.0
        self._admit()
        self._schedule()

    async def load(self, version: int) -> None:
        """New weights as `version`. Unpaused: wait for the running sequences first, admitting nothing."""
        self._advance()
        if not self.paused and (self.n or self.prefill_end is not None):
            self.draining = True
            self._drained = self.loop.create_future()
            self._schedule()
            await self._drained
        await asyncio.sleep(self.c.load_s)
        self.set_version(version, self.c.load_s)

    def set_version(self, version: int, load_s: float) -> None:
        """The load of `version` (which took `load_s`) is done: tokens from here on are sampled by it."""
        self.load_busy_s += load_s
        paused = self.paused
        if paused:
            self.t = self.loop.time()  # `_advance` while paused
        else:
            self._advance()
        self.version = version
        self.bound_steps.append(self.step)
        self.bound_versions.append(version)
        self.draining = False
        if not paused:  # paused, neither admits nor schedules anything
            self._admit()
            self._schedule()

    def release(self) -> None:
        """Drop the groups and the timer once the run is over (SimFleet.release says why)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.fin, self.grp, self.prefilling = [], [], []
        self.waiting.clear()
        self._walk = None
        self._drained = None

    # ---- the model --------------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Sequences waiting, in prefill or running: the router's load figure."""
        return self.n + self._unstarted

    @property
    def kv_tokens(self) -> float:
        return self.kv_base + self.n * self.step

    def _advance(self) -> None:
        """Bring the state up to the loop's now, finishing whatever finished on the way."""
        now = self.loop.time()
        if self.paused:
            self.t = now
            return
        tol = 1e-9 * (1.0 + abs(now))
        while True:
            prefill_end = self.prefill_end
            if prefill_end is not None:
                if prefill_end > now:
                    break
                self.busy_s += prefill_end - self.t
                self.t = prefill_end
                self._finish_prefill()
                continue
            if self.n == 0 or not self._decode_until(now, tol):
                break
        if self.n > 0 or self.prefill_end is not None:
            self.busy_s += now - self.t
        self.t = now

    def _decode_until(self, now: float, tol: float) -> bool:
        """Decode towards `now`, finishing sequences on the way (locals for speed: this is the planner's inner
        loop). Returns True when it stopped early because a prefill started (the caller goes on from there)."""
        c = self.c
        fin, grp = self.fin, self.grp
        head, n, base, step, t = self._head, self.n, self.kv_base, self.step, self.t
        busy = 0.0
        waiting, draining = len(self.waiting), self.draining
        try:
            while n > 0:
                w = self._walk
                if w is not None and w[0] == (head, len(fin), n, step, waiting, draining):
                    self._walk = None
                    if t + w[1] > now + tol:
                        # the walk knows when each sequence that finishes before its event does
                        elapsed = w[8] + (now - t)
                        # the sequences finished by now: their seconds from the walk's start are at most elapsed + tol
                        lo = w[7]
                        m = bisect.bisect_right(w[6], elapsed + tol, lo)
                        if m > lo:
                            # the state after the last of them, as the walk made it (so the same floats): the step
                            # is the larger of today's and that sequence's finish, K's base the walk's
                            e = head + m - lo - 1
                            f = fin[e]
                            if f > step:
                                step = f
                            base = w[9][m - 1]
                            n -= m - lo
                            head = e + 1
                            e_m = w[6][m - 1]
                            t += e_m - w[8]
                            busy += e_m - w[8]
                        if now > t:  # (as below)
                            x = step + c.steps_in(n, base + n * step, now - t)
                            f = fin[head]
                            step = f if f < x else x  # min(x, f)
                        busy += now - t
                        t = now
                        # the rest of the walk still holds: keep it, keyed by the state reached (a pause and its
                        # continue then cost no second walk)
                        w[0] = (head, len(fin), n, step, waiting, draining)
                        w[1] -= elapsed - w[8]
                        w[7], w[8] = m, elapsed
                        self._walk = w
                        return False
                    # the walk that set the timer already knows the state at its event: take it whole
                    _, dt, j, n, base, step, _, _, _, _ = w
                    t += dt
                    busy += dt
                    f, g = fin[j], grp[j]
                    head = j + 1
                else:
                    f, g = fin[head], grp[head]
                    if f > step:
                        # ServerCosts.time_for_steps(n, base + n * step, f - step), inline (as in the walk)
                        k = base + n * step
                        d = f - step
                        mem = (c.weights_s + c.kv_s * k) * d + c.kv_s * n * d * d / 2
                        comp = (c.seq_s * n + c.attn_s * k) * d + c.attn_s * n * d * d / 2
                        dt = c.step_overhead_s * d + (mem + comp if c.additive else (comp if comp > mem else mem))
                        if t + dt > now + tol:
                            if now > t:  # (none fit in no time: steps_in would give 0.0 and leave step as it is)
                                x = step + c.steps_in(n, base + n * step, now - t)
                                step = f if f < x else x  # min(x, f)
                            busy += now - t
                            t = now
                            return False
                        t += dt
                        busy += dt
                        step = f
                    head += 1
                    n -= 1
                    base -= g.kv_term
                # one of the group's longest samples (f is the step its prefill started at plus the sample's
                # length, finish_step the same plus the longest length: equal exactly when the lengths are)
                done = f == g.finish_step and not g.done_members
                if done:
                    g.done_members = 1
                    self.reserved -= g.need
                    self.generated_tokens += g.total
                    if not g.future.done():
                        g.future.set_result(self._versions_of(g))
                if self.waiting and (done or n + len(self.waiting[0].lengths) <= c.max_running):
                    self._head, self.n, self.kv_base, self.step, self.t = head, n, base, step, t
                    self._admit()
                    if self.prefill_end is not None:
                        return True
                    waiting = len(self.waiting)
            return False
        finally:
            self._head, self.n, self.kv_base, self.step, self.t = head, n, base, step, t
            self.busy_s += busy
            if head > 256 and head * 2 > len(fin):
                del fin[:head]
                del grp[:head]
                self._head = 0
            if self.draining:
                self._check_drained()

    def _check_drained(self) -> None:
        if self.draining and self.n == 0 and self.prefill_end is None and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)

    def _versions_of(self, g: SimGroup) -> dict[int, int]:
        """Tokens of the group by the version that sampled them (the server's version changes at step bounds)."""
        steps, versions = self.bound_steps, self.bound_versions
        # the last bound at or before the group's start (bound_steps[0] is -inf, so i >= 0)
        i = bisect.bisect_right(steps, g.start_step) - 1
        if i == len(steps) - 1:  # one version all along: the common case
            return {versions[i]: g.total}
        out: dict[int, int] = {}
        # tokens the samples made in their first x steps: the sum of min(length, x), i.e. the sum of the k lengths
        # at most x plus (m - k) x; taken at each version bound, differences give each version's share
        lengths = g.lengths  # ascending
        m = len(lengths)
        start = g.start_step
        done_before = 0.0
        v = versions[i]
        for j in range(i + 1, len(steps)):
            hi = steps[j] - start
            k = bisect.bisect_right(lengths, hi)
            upto = sum(lengths[:k]) + (m - k) * hi if hi > 0 else 0.0
            tokens = upto - done_before
            if upto > done_before:
                done_before = upto
            if tokens > 0:
                out[v] = out.get(v, 0) + round(tokens)
            v = versions[j]
        tokens = g.total - done_before  # the last version: up to the whole group
        if tokens > 0:
            out[v] = out.get(v, 0) + round(tokens)
        return out

    def _admit(self) -> None:
        """Start a prefill of the waiting groups that fit, unless one runs, the server is paused or draining."""
        if self.paused or self.draining or self.prefill_end is not None or not self.waiting:
            return
        c = self.c
        batch: list[SimGroup] = []
        tokens = 0.0
        running = self.n
        reserved = self.reserved
        while self.waiting:
            g = self.waiting[0]
            m = len(g.lengths)
            prompt_kv = g.prompt if c.prefix_sharing else g.prompt * m
            need = prompt_kv + g.total
            empty = running == 0 and not batch
            if not empty and (running + m > c.max_running or reserved + need > c.kv_capacity_tokens):
                break
            self.waiting.popleft()
            g.need = need
            reserved += need
            running += m
            tokens += prompt_kv
            batch.append(g)
        if not batch:
            return
        self.reserved = reserved
        self.prefilling = batch
        prompt = batch[0].prompt
        self.prefill_end = self.t + c.prefill_overhead_s + c.prefill_time(tokens, prompt / 2)

    def _finish_prefill(self) -> None:
        self.prefill_end = None
        # locals for the per-answer loop (16 answers a group: the planner's most repeated lines); the sums are
        # taken in the same order as attribute updates would be, so the state is the same to the last bit
        step, n, base, head = self.step, self.n, self.kv_base, self._head
        fin, grp = self.fin, self.grp
        bisect_right = bisect.bisect_right
        for g in self.prefilling:
            g.start_step = step
            g.version = self.version
            lengths = g.lengths  # ascending, so each insert starts its search after the one before
            g.finish_step = step + lengths[-1]
            kv_term = g.kv_term = g.prompt - step  # each answer's KV: prompt + (step - start_step)
            ends = [step + length for length in lengths]
            # each after every entry of an equal step (earlier groups first, as they were admitted): those finishing
            # at or after the last running one go at the end as they are, the others are inserted
            tail = bisect.bisect_left(ends, fin[-1]) if len(fin) > head else 0
            lo = head
            for f in ends[:tail]:
                lo = bisect_right(fin, f, lo)
                fin.insert(lo, f)
                grp.insert(lo, g)
                lo += 1
            fin += ends[tail:]
            grp += [g] * (len(ends) - tail)
            n += len(ends)
            for _ in ends:
                base += kv_term
            self._unstarted -= len(lengths)
        self.n, self.kv_base = n, base
        self.prefilling = []
        self._check_drained()
        self._admit()

    def _schedule(self) -> None:
        """One timer: at the end of the running prefill, or at the next sequence completion. A timer already set
        for that instant is kept (cancelled timers stay in the loop's heap until they come due)."""
        when: float | None = None
        if not self.paused:
            if self.prefill_end is not None:
                when = self.prefill_end
                if self.n > 0 and not self.prefilling and not self.waiting and not self.draining:
                    # the KV recompute after an abort pause adds no sequence and admits none, so the state after
                    # it is today's moved to its end: the walk already known says when the next visible event
                    # is, and the prefill's end needs no timer of its own (`_advance` finishes it on the way)
                    w = self._walk
                    if w is not None and w[0] == (self._head, len(self.fin), self.n, self.step, 0, False):
                        when = self.prefill_end + w[1]
            elif self.n > 0:
                when = self._next_event_time()
        timer = self._timer
        if timer is not None:
            if when is not None and timer._when == when:  # TimerHandle.when(), without the call
                return
            timer.cancel()
            self._timer = None
        if when is not None:
            self._timer = self.loop.call_at(when, self._on_timer)

    def _next_event_time(self) -> float:
        """When the next thing the outside can see happens while decoding: a group's last sample finishing, or a
        sequence finishing that lets a waiting group in under the running cap (KV reservations are freed only with
        whole groups). Walks the sorted running sequences without changing anything: the sequences finishing
        before then change only the batch, which `_advance` replays when the timer fires. The walk is kept in
        `_walk`: [the state it started from, seconds to its event, the event's index, n, kv_base and step after
        it, seconds from its start to each earlier sequence's finish, how many of those are consumed, the seconds
        consumed, and kv_base after each earlier sequence's finish]."""
        c = self.c
        t, step, n, base = self.t, self.step, self.n, self.kv_base
        key = (self._head, len(self.fin), n, step, len(self.waiting), self.draining)
        w = self._walk
        if w is not None and w[0] == key:
            return t + w[1]  # nothing changed but the clock (a pause, say): the same wait from now
        fin, grp = self.fin, self.grp
        want = 0  # the running count under which the first waiting group may start (0: the cap is not what binds)
        if self.waiting and not self.draining:
            g = self.waiting[0]
            m = len(g.lengths)
            need = (g.prompt if c.prefix_sharing else g.prompt * m) + g.total
            if self.reserved + need <= c.kv_capacity_tokens and n + m > c.max_running:
                want = c.max_running - m
        t0 = t
        # seconds from now to each earlier sequence's finish, and K's base after it
        states: list[float] = []
        bases: list[float] = []
        # ServerCosts.time_for_steps inlined (the same expression, term by term, so the same floats): this loop
        # runs about once per answer, and the call and its attribute reads were most of its cost. The running
        # count as a float (`nf`) gives the same products as the int (a float times an int converts it exactly,
        # and halving is exact), in the interpreter's float-only arithmetic
        o, ws, kvs, sq, at, additive = c.step_overhead_s, c.weights_s, c.kv_s, c.seq_s, c.attn_s, c.additive
        nf = float(n)
        head = self._head
        # memory-bound all along: with weights_s > 2 seq_s n (n only falls during the walk) and kv_s > 2 attn_s, every
        # term of `comp` is at most half the matching term of `mem` (for K >= 0), so comp <= mem / 2 and, all terms
        # being sums and products of non-negative numbers (a relative error of a few ulps each), the computed comp
        # is below the computed mem too: max(mem, comp) is mem, and comp need not be computed
        roof = not additive and sq >= 0.0 and at >= 0.0 and ws > 2.0 * sq * nf and kvs > 2.0 * at
        for i in range(head, len(fin)):
            f = fin[i]
            if f > step:
                k = base + nf * step
                d = f - step
                mem = (ws + kvs * k) * d + kvs * nf * d * d * 0.5
                if roof and k >= 0.0:
                    t += o * d + mem
                else:
                    comp = (sq * nf + at * k) * d + at * nf * d * d * 0.5
                    t += o * d + (mem + comp if additive else (comp if comp > mem else mem))  # max(mem, comp)
                step = f
            nf -= 1.0
            g = grp[i]
            base -= g.kv_term
            if nf <= want or (f == g.finish_step and not g.done_members):
                self._walk = [key, t - t0, i, n - (i - head + 1), base, step, states, 0, 0.0, bases]
                return t
            states.append(t - t0)
            bases.append(base)
        self._walk = None
        return t

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        self._schedule()
