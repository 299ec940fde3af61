"""The CPU sampling kernel (kernels/sampling.py), built for every target this CPU runs (-march=native and the
portable x86-64-v3), against float64 references: the logprob of the drawn token, the inverse-CDF draw itself (which
token each uniform must give), banned and min-p-truncated tokens, and sampling.sample's seeds and row mixes."""

from __future__ import annotations

import pytest
import torch
from error_bounds import logsumexp_bound

from areal_async.server import sampling
from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import sampling as cpu_sampling


@pytest.fixture(params=cpu_build.runnable_marches())
def kernel(request):
    k = cpu_sampling.load(request.param)
    if k is None:
        pytest.skip(f"the CPU sampling kernel could not be built for -march={request.param}")
    return k


def _ref_logprobs(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) in float64 [B, V] (T = 1 where temps <= 0)."""
    t = torch.where(temps > 0, temps, 1.0).double()
    return torch.log_softmax(logits.double() / t[:, None], dim=-1)


def _bound(logits: torch.Tensor, temps: torch.Tensor) -> float:
    """logsumexp_bound over the tempered rows, plus the rounding of x / T."""
    t = torch.where(temps > 0, temps, 1.0)
    scaled = logits / t[:, None]
    spread = float(scaled.max() - scaled[scaled > -float("inf")].min())
    lse = float(torch.logsumexp(scaled, dim=-1).abs().max())
    return 2 * logsumexp_bound(logits.shape[1], spread, lse) + 2**-24 * float(scaled.abs().max())


@pytest.mark.parametrize("vocab", [1, 127, 128, 1000, 49152])
def test_logprobs_and_greedy_tokens_match_float64(kernel, vocab):
    g = torch.Generator().manual_seed(vocab)
    b = 6
    logits = torch.randn(b, vocab, generator=g) * 4  # [B, V]
    logits[1, vocab // 2] = logits[1].max() + 0.0  # a tie for the max: the first index wins, as torch.argmax
    logits[1, vocab - 1] = logits[1].max()
    temps = torch.tensor([0.0, 0.0, 0.7, 1.0, 0.3, 1.7])
    u = torch.rand(b, generator=g, dtype=torch.float64)
    tok, lp = kernel.sample(logits, temps, torch.zeros(b), u)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert tok[:2].tolist() == logits[:2].argmax(dim=-1).tolist()
    want = _ref_logprobs(logits, temps).gather(1, tok[:, None])[:, 0]  # [B]
    assert float((lp.double() - want).abs().max()) <= _bound(logits, temps)


@pytest.mark.parametrize("temp", [0.7, 1.0, 2.5])
def test_each_uniform_draws_the_inverse_cdf_token(kernel, temp):
    """The draw is the inverse CDF of softmax(x / T): uniform u gives the first token whose cumulative probability
    exceeds u. Checked for a grid of uniforms against float64 cumulative sums, over several blocks of the kernel's
    block sums; only uniforms within rounding of a boundary may land on either side."""
    g = torch.Generator().manual_seed(int(temp * 10))
    vocab, n = 700, 4000
    row = torch.randn(vocab, generator=g) * 2  # [V]
    row[::97] = -float("inf")  # banned tokens: zero width
    logits = row.repeat(n, 1).contiguous()  # [N, V]
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # [N]
    tok, _ = kernel.sample(logits, torch.full((n,), temp), torch.zeros(n), u)
    p = torch.softmax(row.double() / temp, dim=-1)
    cdf = p.cumsum(0)  # [V]
    want = torch.searchsorted(cdf, u, right=True).clamp_max(vocab - 1)
    near = (cdf[None, :] - u[:, None]).abs().min(dim=1).values < 1e-6
    assert bool((tok == want)[~near].all())
    assert not bool((row[tok] == -float("inf")).any())
    # the ends of [0, 1): the first and the last token of non-zero width
    live = (row > -float("inf")).nonzero()[:, 0]
    edge = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    tok, _ = kernel.sample(logits[:2].contiguous(), torch.full((2,), temp), torch.zeros(2), edge)
    assert tok.tolist() == [int(live[0]), int(live[-1])]


def test_frequencies_follow_the_tempered_softmax(kernel):
    """Random uniforms: token counts against softmax(x / T) within 5 standard deviations."""
    g = torch.Generator().manual_seed(3)
    vocab, n, temp = 40, 40000, 0.7
    row = torch.randn(vocab, generator=g)
    tok, _ = kernel.sample(
        row.repeat(n, 1).contiguous(),
        torch.full((n,), temp),
        torch.zeros(n),
        torch.rand(n, generator=g, dtype=torch.float64),
    )
    p = torch.softmax(row.double() / temp, dim=-1)
    counts = torch.bincount(tok, minlength=vocab).double()
    sd = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 5 * sd + 1).all())


def test_min_p_restricts_the_draw_not_the_logprob(kernel):
    g = torch.Generator().manual_seed(4)
    vocab, n, temp, min_p = 300, 3000, 1.0, 0.2
    row = torch.randn(vocab, generator=g) * 2
    logits = row.repeat(n, 1).contiguous()
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tok, lp = kernel.sample(logits, torch.full((n,), temp), torch.full((n,), min_p), u)
    p = torch.softmax(row.double() / temp, dim=-1)
    kept = p >= min_p * p.max()
    assert set(tok.tolist()) == set(kept.nonzero()[:, 0].tolist())  # every kept token is reached by the grid
    q = torch.where(kept, p, 0.0)
    cdf = (q / q.sum()).cumsum(0)
    want = torch.searchsorted(cdf, u, right=True).clamp_max(vocab - 1)
    near = (cdf[None, :] - u[:, None]).abs().min(dim=1).values < 1e-6
    assert bool((tok == want)[~near].all())
    # the logprob is the untruncated distribution's
    want_lp = torch.log(p)[tok]
    assert float((lp.double() - want_lp).abs().max()) <= _bound(logits[:1], torch.tensor([temp]))


def test_sample_seeds_mixes_and_top_logprobs():
    """sampling.sample through the kernel: a seeded request repeats its tokens whatever shares its batch, greedy and
    sampled rows mix, top logprobs come with the draw, and top-k/top-p rows still use torch's path."""
    if sampling._kernel_for(torch.zeros(1, 4)) is None:
        pytest.skip("the CPU sampling kernel could not be built here")
    g = torch.Generator().manual_seed(5)
    vocab = 500
    logits = torch.randn(4, vocab, generator=g) * 3  # [4, V]

    def seeded(seed):
        gen = torch.Generator()
        gen.manual_seed(seed)
        return sampling.RowParams(temperature=0.8, generator=gen)

    shared = torch.Generator().manual_seed(0)
    alone = sampling.sample(logits[:1].clone(), [seeded(7)], shared)[0].item()
    rows = [seeded(7), sampling.RowParams(temperature=0.0), sampling.RowParams(temperature=1.0), seeded(9)]
    tok, lp, top = sampling.sample(logits.clone(), rows, shared, top_logprobs_num=3)
    assert tok[0].item() == alone
    assert tok[1].item() == int(logits[1].argmax())
    temps = torch.tensor([0.8, 0.0, 1.0, 0.8])
    want = _ref_logprobs(logits, temps)
    assert float((lp.double() - want.gather(1, tok[:, None])[:, 0]).abs().max()) <= _bound(logits, temps)
    assert top is not None and top[0].shape == (4, 3)
    assert torch.equal(top[1], want.topk(3, dim=-1).indices)
    # a seeded request's sequence of draws repeats, whatever the shared generator
    r1, r2 = seeded(11), seeded(11)
    s1 = [sampling.sample(logits[:1].clone(), [r1], shared)[0].item() for _ in range(8)]
    s2 = [sampling.sample(logits[:1].clone(), [r2], torch.Generator().manual_seed(99))[0].item() for _ in range(8)]
    assert s1 == s2 and len(set(s1)) > 1
    # top-k: only the k best are drawn (torch's path)
    tk, _, _ = sampling.sample(logits[:1].repeat(200, 1), [sampling.RowParams(temperature=1.0, top_k=2)] * 200, shared)
    assert set(tk.tolist()) <= set(logits[0].topk(2).indices.tolist())
