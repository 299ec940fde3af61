"""Batched token sampling for the engine: one set of tensor ops (or, on CPU, one C kernel call) per step for every
request that samples.

The logprob reported for a sampled token is `log_softmax(logits / temperature)` at that token, computed after the
logit processors that change the model's distribution (frequency/presence/repetition penalties, and the ban on stop
tokens before `min_new_tokens`) and before the truncations that only restrict where samples may land (top-k, top-p,
min-p). Greedy rows (temperature < 1e-6) report `log_softmax(logits)` and take the argmax.

On CPU, rows without top-k/top-p go through kernels/sampling.py: one uniform per row and an inverse-CDF draw over
the tempered softmax, computed in two passes over the row with no [B, V] temporary (88 -> ~2 ms a step at batch 64
over a 49k vocabulary; the module says why). Elsewhere, and for top-k/top-p, sampling draws `argmax(p / E)` with
`E ~ Exponential(1)` per entry, which picks index i with probability p_i (the exponential race); it needs no
normalisation after truncation and no host sync. Either way a request with its own `seed` gets its own generator
(its uniform, or its row of noise, comes from it), so its samples do not depend on which other requests share the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from areal_async.server.kernels import sampling as cpu_sampling

if TYPE_CHECKING:
    from areal_async.server.kernels.elementwise import Kernels

GREEDY_EPS = 1e-6
_cpu_kernel: list[cpu_sampling.Kernel | None] = []  # loaded on first CPU use: [kernel or None]
_greedy_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> (zeros [B] fp32, zeros [B] float64)


@dataclass
class RowParams:
    """One sampling row's settings, as the engine keeps them per request."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    banned: list[int] | None = None  # token ids forbidden at this step (stop tokens before min_new_tokens)
    output_ids: list[int] | None = None  # generated so far; only needed with penalties

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def needs_sort(self, vocab: int) -> bool:
        """Whether this row's truncation needs the distribution sorted (top-k, top-p)."""
        return not self.greedy and ((0 < self.top_k < vocab) or self.top_p < 1.0)

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def process_logits(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Apply penalties and bans in place to logits [B, V] (fp32); rows without any are untouched."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        if r.has_penalty and r.output_ids:
            ids = torch.tensor(r.output_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)  # [V]
            seen = counts > 0
            row = logits[i]
            if r.repetition_penalty != 1.0:
                penalised = torch.where(row > 0, row / r.repetition_penalty, row * r.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            row.sub_(counts * r.frequency_penalty + seen.to(logits.dtype) * r.presence_penalty)
        if r.banned:
            logits[i, r.banned] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    rows: list[RowParams],
    generator: torch.Generator | None,
    top_logprobs_num: int = 0,
    kernels: Kernels | None = None,
    saved: list[float | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Sample one token per row of logits [B, V] (fp32, already processed). `kernels`: the model's CPU
    `cpu_elementwise.Kernels`, for greedy rows; `saved`: uniforms drawn for an interrupted step (see `uniforms`).

    Returns (tokens [B] long, logprobs [B] fp32, optional (top values [B, k], top ids [B, k]))."""
    device = logits.device
    kernel = _kernel_for(logits)
    if kernel is not None and not any(r.needs_sort(logits.shape[1]) for r in rows):
        return _sample_cpu(kernel, logits, rows, generator, top_logprobs_num, saved)
    greedy = [r.greedy for r in rows]
    if all(greedy) and top_logprobs_num == 0:
        # log_softmax(x)[t] = x[t] - logsumexp(x): no [B, V] temporaries (on CPU one kernel, two passes per row)
        if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            tokens, lse = kernels.argmax_logsumexp(logits)
        else:
            tokens, lse = logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
        return tokens, logits.gather(1, tokens[:, None])[:, 0] - lse, None
    if all(g or r.temperature == 1.0 for g, r in zip(greedy, rows)):
        scaled = logits
    else:
        temps = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], device=device)  # [B]
        scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        probs = logprobs.exp()  # [B, V]
        probs = _truncate(probs, rows)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # a draw of exactly 0 (possible in fp32) would turn p / E into inf, or NaN where p is 0
        tokens = (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=device)
            tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
    token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
    top = None
    if top_logprobs_num > 0:
        top = logprobs.topk(min(top_logprobs_num, logits.shape[1]), dim=-1)
        top = (top.values, top.indices)
    return tokens, token_logprobs, top


@dataclass
class DrawPlan:
    """A step's draws fixed before its forward pass: the CPU kernel's inputs for every row ([B]: temperature, 0 for
    greedy rows; min-p; the row's uniform) and where its tokens [B] long and logprobs [B] fp32 go. Why before: the
    kernel can then run inside the whole-step C call right after the LM head (model.forward; `done` says it did),
    while the logits are still in cache, instead of after it through ~10 small cold torch and Python calls (a
    batch-1 step spent ~0.28 ms of ~9-14 there)."""

    kernel: cpu_sampling.Kernel
    temps: torch.Tensor
    min_p: torch.Tensor
    uniforms: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: bool = False

    def draw(self, logits: torch.Tensor) -> None:
        """Run the kernel on logits [B, V] (CPU fp32) unless the forward pass already did."""
        if not self.done:
            self.tokens, self.logprobs = self.kernel.sample(logits.contiguous(), self.temps, self.min_p, self.uniforms)
            self.done = True


def plan_draws(
    rows: list[RowParams], generator: torch.Generator | None, vocab: int, saved: list[float | None]
) -> DrawPlan | None:
    """The draws of `rows` when the CPU kernel can make them with nothing to apply to the logits first (no
    penalties, no banned tokens, no top-k/top-p), else None. `saved[i]`: a uniform row i already drew for this step
    before the step was interrupted (reused, so a seeded request's draws do not depend on interruptions)."""
    kernel = _loaded_kernel()
    if kernel is None or any(r.has_penalty or r.banned or r.needs_sort(vocab) for r in rows):
        return None
    n = len(rows)
    if all(r.greedy for r in rows):  # zeros in, nothing drawn: the same inputs every step (the kernel only writes)
        if n not in _greedy_inputs:
            _greedy_inputs[n] = (torch.zeros(n), torch.zeros(n, dtype=torch.float64))
        zeros, zeros_d = _greedy_inputs[n]
        return DrawPlan(kernel, zeros, zeros, zeros_d, torch.empty(n, dtype=torch.long), torch.empty(n))
    temps, min_p = _kernel_inputs(rows)
    return DrawPlan(
        kernel, temps, min_p, uniforms(rows, generator, saved), torch.empty(n, dtype=torch.long), torch.empty(n)
    )


def _kernel_for(logits: torch.Tensor) -> cpu_sampling.Kernel | None:
    """The CPU sampling kernel where it serves these logits (fp32, contiguous, on CPU), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    return _loaded_kernel()


def _loaded_kernel() -> cpu_sampling.Kernel | None:
    """The CPU sampling kernel, loaded on first use (None where it cannot be built)."""
    if not _cpu_kernel:
        _cpu_kernel.append(cpu_sampling.load())
    return _cpu_kernel[0]


def _kernel_inputs(rows: list[RowParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's per-row temperature (0 for greedy rows) and min-p, [B] fp32 each."""
    temps = torch.tensor([0.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32)
    return temps, torch.tensor([r.min_p for r in rows], dtype=torch.float32)


def uniforms(
    rows: list[RowParams], generator: torch.Generator | None, saved: list[float | None] | None = None
) -> torch.Tensor:
    """One uniform in [0, 1) per row [B] float64 (53 random bits: a token's chance is resolved to 1e-16): a row
    with its own generator draws from it, the others from `generator` (greedy rows get 0 and draw nothing); a row
    with a `saved` value takes that instead (drawn for a step that was interrupted)."""
    saved = saved or [None] * len(rows)
    u = torch.zeros(len(rows), dtype=torch.float64)
    if any(not r.greedy and r.generator is None and s is None for r, s in zip(rows, saved)):
        u = torch.rand(len(rows), generator=generator, dtype=torch.float64)
    for i, (r, s) in enumerate(zip(rows, saved)):
        if r.greedy:
            continue
        if s is not None:
            u[i] = s
        elif r.generator is not None:
            u[i] = torch.rand((), generator=r.generator, dtype=torch.float64)
    return u


def _sample_cpu(
    kernel: cpu_sampling.Kernel,
    logits: torch.Tensor,
    rows: list[RowParams],
    generator: torch.Generator | None,
    top_logprobs_num: int,
    saved: list[float | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`sample` for CPU rows without top-k/top-p: the kernel draws (min-p included) and reports the logprobs."""
    temps, min_p = _kernel_inputs(rows)  # [B], [B]
    tokens, token_logprobs = kernel.sample(logits, temps, min_p, uniforms(rows, generator, saved))
    top = None
    if top_logprobs_num > 0:
        scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]  # [B, V]
        lp = torch.log_softmax(scaled, dim=-1).topk(min(top_logprobs_num, logits.shape[1]), dim=-1)
        top = (lp.values, lp.indices)
    return tokens, token_logprobs, top


def _truncate(probs: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude (in that order, as SGLang applies them); never the top token."""
    vocab = probs.shape[1]
    need_sort = any((0 < r.top_k < vocab) or r.top_p < 1.0 for r in rows)
    if need_sort:
        top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=probs.device)
        top_p = torch.tensor([r.top_p for r in rows], device=probs.device, dtype=probs.dtype)
        sorted_p, idx = probs.sort(dim=-1, descending=True)  # [B, V]
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # probability mass ranked above each entry
        drop = mass_before > top_p[:, None] * sorted_p.sum(dim=-1, keepdim=True)
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    if any(r.min_p > 0 for r in rows):
        min_p = torch.tensor([r.min_p for r in rows], device=probs.device, dtype=probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
