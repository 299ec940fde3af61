"""The decode layer as one C call (server/kernels/decode_layer.py) against the model's op-by-op layers: the same
logits and the same KV cache, bit for bit, over several greedy decode steps, for fp32 and bf16 weights, with and
without projection biases; the steps it must leave to the op-by-op path; the interrupt between layers; and weight
writes seen by the next step."""

from __future__ import annotations

import pytest
import torch

from areal_async.server.model import DecoderModel, KVCache, StepInterrupted, build_step_batch
from areal_async.server.weights import load_checkpoint

PS = 16


def _model(ckpt: str, dtype: torch.dtype) -> DecoderModel:
    spec, tensors = load_checkpoint(ckpt)
    m = DecoderModel(spec, dtype=dtype)
    m.load_tensors(tensors)
    return m


def _fused_or_skip(m: DecoderModel):
    if m._fused is None:
        pytest.skip("the CPU decode kernels could not be built here")
    return m._fused


class _Run:
    """Three sequences prefilled into their own pages, then decoded greedily one token per step."""

    def __init__(self, m: DecoderModel, lengths=(40, 23, 3)):
        self.m = m
        g = torch.Generator().manual_seed(0)
        self.seqs = [torch.randint(0, m.spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
        per = [-(-(n + 8) // PS) for n in lengths]
        self.pages = [list(range(1 + sum(per[:i]), 1 + sum(per[: i + 1]))) for i in range(len(per))]
        self.table = torch.zeros(len(per), max(per), dtype=torch.long)
        for i, p in enumerate(self.pages):
            self.table[i, : len(p)] = torch.tensor(p)
        self.cache = KVCache(m.spec, (sum(per) + 1) * PS, PS, m.device, m.dtype)
        chunks = [(s, 0, self.pages[i], i) for i, s in enumerate(self.seqs)]
        batch = build_step_batch(chunks, self.table, PS, m.device, [[len(s) - 1] for s in self.seqs], m.dtype, True)
        self.next = m.forward(batch, self.cache).argmax(-1).tolist()
        self.lens = [len(s) for s in self.seqs]

    def batch(self, tokens, lens):
        chunks = [([t], n, self.pages[i], i) for i, (t, n) in enumerate(zip(tokens, lens))]
        return build_step_batch(chunks, self.table, PS, self.m.device, [[0]] * len(tokens), self.m.dtype, True)

    def decode(self, steps: int, fused: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Greedy steps from the prefilled state (on a copy of the cache) -> (each step's logits, the cache)."""
        m, saved = self.m, self.m._fused
        cache = KVCache(m.spec, (self.cache.kv.shape[1] - 1) * PS, PS, m.device, m.dtype)  # it adds page 0
        cache.kv.copy_(self.cache.kv)
        m._fused = saved if fused else None
        try:
            tokens, lens, out = list(self.next), list(self.lens), []
            for _ in range(steps):
                b = self.batch(tokens, lens)
                if fused:
                    assert saved.applies(b)
                logits = m.forward(b, cache)
                out.append(logits)
                tokens, lens = logits.argmax(-1).tolist(), [n + 1 for n in lens]
        finally:
            m._fused = saved
        return out, cache.kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: q|k|v biases; llama: none
def test_fused_layers_equal_the_op_by_op_layers(tiny_ckpts_all_archs, arch, dtype):
    m = _model(tiny_ckpts_all_archs[arch], dtype)
    _fused_or_skip(m)
    run = _Run(m)
    fused, kv_fused = run.decode(4, fused=True)
    ref, kv_ref = run.decode(4, fused=False)
    for a, b in zip(fused, ref):
        assert torch.equal(a, b)
    assert torch.equal(kv_fused, kv_ref)  # every layer's new k|v in the same slots, the same bits


def test_steps_it_leaves_to_the_op_by_op_path(tiny_ckpt, tiny_ckpts_all_archs):
    m = _model(tiny_ckpt, torch.float32)
    fused = _fused_or_skip(m)
    run = _Run(m)
    assert fused.applies(run.batch(run.next, run.lens))
    prefill = build_step_batch([([1, 2, 3], 0, run.pages[0], 0)], run.table, PS, m.device, [[2]], m.dtype, True)
    assert not fused.applies(prefill)  # a prefill chunk: a padded attention group
    m.paged_decode = False
    assert not fused.applies(run.batch(run.next, run.lens))
    q3 = _model(tiny_ckpts_all_archs["qwen3"], torch.float32)  # per-head q/k norms
    if q3._fused is not None:
        assert not q3._fused.applies(_Run(q3).batch([1, 2, 3], [40, 23, 3]))


def test_interrupt_between_layers(tiny_ckpt):
    m = _model(tiny_ckpt, torch.float32)
    _fused_or_skip(m)
    run = _Run(m)
    polls = []

    def interrupt() -> bool:
        polls.append(1)
        return len(polls) == 2  # after the second layer

    with pytest.raises(StepInterrupted):
        m.forward(run.batch(run.next, run.lens), run.cache, interrupt)
    assert len(polls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_step_in_one_call_equals_the_layer_calls(tiny_ckpt, dtype):
    """A decode step as one C call (embedding, layers, final norm, LM head) gives the logits and cache of the
    per-layer calls with the head in Python (what an interrupt callback that C cannot poll gets)."""
    m = _model(tiny_ckpt, dtype)
    _fused_or_skip(m)
    run = _Run(m)
    b = run.batch(run.next, run.lens)
    assert m._fused.whole_step(b, None)
    kv = run.cache.kv.clone()
    whole = m.forward(b, run.cache)
    kv_whole, run.cache.kv[:] = run.cache.kv.clone(), kv
    assert not m._fused.whole_step(b, lambda: False)
    layered = m.forward(b, run.cache, lambda: False)
    assert torch.equal(whole, layered) and torch.equal(kv_whole, run.cache.kv)


def test_interrupt_word_stops_the_whole_step_after_a_layer(tiny_ckpt):
    """The engine's InterruptWord, set while a step runs, is read by the one-call step after every layer: the step
    stops there (later layers' k/v untouched) and, cleared, the redone step gives the uninterrupted logits."""
    from areal_async.server.kernels.decode_layer import InterruptWord

    m = _model(tiny_ckpt, torch.float32)
    _fused_or_skip(m)
    run = _Run(m)
    b = run.batch(run.next, run.lens)
    word = InterruptWord()
    word.set(True)
    assert word() and m._fused.whole_step(b, word)
    before = run.cache.kv.clone()
    with pytest.raises(StepInterrupted):
        m.forward(b, run.cache, word)
    assert not torch.equal(run.cache.kv[0], before[0])  # the first layer stored the new k/v
    assert torch.equal(run.cache.kv[1:], before[1:])  # and nothing after it ran
    word.set(False)
    got = m.forward(b, run.cache, word)
    run.cache.kv[:] = before
    assert torch.equal(got, m.forward(b, run.cache))


def test_weight_writes_reach_the_next_fused_step(tiny_ckpt, tiny_ckpt_b):
    """A load (new weights, norms and biases) and an in-place write of one norm between two decode steps: the
    fused step's logits equal the op-by-op path's on the same written weights."""
    m = _model(tiny_ckpt, torch.bfloat16)
    _fused_or_skip(m)
    run = _Run(m)
    before, _ = run.decode(1, fused=True)
    m.load_tensors(load_checkpoint(tiny_ckpt_b)[1])
    with torch.inference_mode():
        m.layers[1].ln2.mul_(1.5)
    (after,), _ = run.decode(1, fused=True)
    (ref,), _ = run.decode(1, fused=False)
    assert torch.equal(after, ref) and not torch.equal(after, before[0])


def test_a_page_above_the_attention_kernels_limit_is_refused_as_op_by_op(tiny_ckpt):
    """Pages larger than the attention kernel's buffers: the same ValueError the op-by-op path raises, never a
    write past them."""
    from areal_async.server.kernels.attention import MAX_PAGE

    m = _model(tiny_ckpt, torch.float32)
    _fused_or_skip(m)
    ps = MAX_PAGE * 2
    cache = KVCache(m.spec, 2 * ps, ps, m.device, m.dtype)
    table = torch.tensor([[1]])
    batch = build_step_batch([([5], 3, [1], 0)], table, ps, m.device, [[0]], m.dtype, True)
    for fused in (m._fused, None):
        saved, m._fused = m._fused, fused
        try:
            with pytest.raises(ValueError, match="page size"):
                m.forward(batch, cache)
        finally:
            m._fused = saved


def test_draws_made_inside_the_step_equal_draws_after_it(tiny_ckpt):
    """A DrawPlan handed to the one-call step is drawn right after the LM head: the same tokens and logprobs, bit
    for bit, as the sampling kernel on the returned logits (greedy, tempered with min-p, mixed rows); steps that
    cannot take the whole-step call leave the draws to the caller (`done` stays False)."""
    from areal_async.server.kernels import sampling as cpu_sampling
    from areal_async.server.sampling import DrawPlan

    kernel = cpu_sampling.load()
    if kernel is None:
        pytest.skip("the sampling kernel could not be built here")
    m = _model(tiny_ckpt, torch.float32)
    _fused_or_skip(m)
    run = _Run(m)
    b = run.batch(run.next, run.lens)
    kv = run.cache.kv.clone()
    for temps, min_p in (([0.0] * 3, [0.0] * 3), ([1.0, 0.7, 1.3], [0.0, 0.05, 0.0]), ([0.0, 1.0, 0.0], [0.0] * 3)):
        run.cache.kv[:] = kv
        u = torch.tensor([0.11, 0.52, 0.93], dtype=torch.float64)
        plan = DrawPlan(
            kernel, torch.tensor(temps), torch.tensor(min_p), u, torch.empty(3, dtype=torch.long), torch.empty(3)
        )
        logits = m.forward(b, run.cache, None, plan)
        assert plan.done
        want_tok, want_lp = kernel.sample(logits, plan.temps, plan.min_p, u)
        assert torch.equal(plan.tokens, want_tok) and torch.equal(plan.logprobs, want_lp)
    plan = DrawPlan(kernel, torch.zeros(3), torch.zeros(3), u, torch.empty(3, dtype=torch.long), torch.empty(3))
    run.cache.kv[:] = kv
    m.forward(b, run.cache, lambda: False, plan)  # a callback C cannot poll: the per-layer calls
    assert not plan.done
