"""The chunked LM head (train/lm_head.py) computes what the unchunked head does: logprobs, entropy and the
gradients to the hidden states, the head's weight and bias, for chunk sizes that do and do not divide the rows, at
a temperature, with the entropy in the loss or only measured; an empty micro-batch still gives the weight a
(zero) gradient; a model with logit soft-capping keeps its own logits. CPU, fp64/fp32."""

from __future__ import annotations

import pytest
import torch
from error_bounds import U32, gamma, logsumexp_bound

from areal_async.train.lm_head import LMHead, _head_module, forward_features, logprobs_from_hidden

pytestmark = pytest.mark.timeout(120)


def _reference(hidden, weight, bias, targets, temperature):
    z = (hidden @ weight.T + bias) / temperature  # [M, V], the whole thing at once
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])  # backward recomputes the logits / reuses forward's
def test_chunked_head_matches_unchunked_values_and_gradients(chunk, entropy_grad, keep_bytes):
    g = torch.Generator().manual_seed(chunk)
    m, h, v, temp = 23, 8, 41, 0.7
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (m,), generator=g)
    g_lp = torch.randn(m, generator=g, dtype=torch.float64)
    g_ent = torch.randn(m, generator=g, dtype=torch.float64)

    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    lp, ent = logprobs_from_hidden(
        leaves[0],
        LMHead(leaves[1], leaves[2]),
        targets,
        temperature=temp,
        compute_entropy=True,
        chunk_tokens=chunk,
        entropy_grad=entropy_grad,
        keep_bytes=keep_bytes,
    )
    objective = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
    objective.backward()

    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref_lp, ref_ent = _reference(*ref_leaves, targets, temp)
    ((ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if entropy_grad else 0.0)).backward()

    assert lp.dtype == torch.float32  # logprobs are fp32 whatever the model dtype
    # The head's logits are fp64, cast to fp32 (u), divided by the temperature (u); the log-softmax runs in fp32:
    # each logprob errs by logsumexp_bound plus those two roundings of the logits' magnitude.
    z = (hidden @ weight.T + bias) / temp  # [M, V] fp64
    spread, zmax = float((z.max(-1).values - z.min(-1).values).max()), float(z.abs().max())
    eps_lp = logsumexp_bound(v, spread, zmax) + 2 * U32 * zmax
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=eps_lp, rtol=0)
    # entropy = -sum p logp: each logp off by eps_lp, each p relatively by eps_lp, sum p = 1, sum p |logp| = ent
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=eps_lp * (1 + float(ref_ent.max())), rtol=0)
    assert ent.requires_grad == entropy_grad
    # the logits' gradient dz [M, V] is fp32: relative eps_lp in each p and logp (plus a few roundings), of size
    # |g_lp| + |g_ent| (1 + |logp| + ent) per unit of probability; the fp64 matmuls back sum it over V (probabilities:
    # at most 2 with the one-hot) into hidden, over M rows into the weight and bias
    eps_dz = eps_lp + 4 * U32
    dz_mag = float(g_lp.abs().max()) + float(g_ent.abs().max()) * (1 + spread + float(ref_ent.max())) * entropy_grad
    atol = eps_dz * dz_mag * 2 * max(float(weight.abs().max()), m * float(hidden.abs().max()), m) / temp
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=0)


def test_kept_logprobs_give_the_same_gradients_without_entropy_and_on_a_second_backward():
    g = torch.Generator().manual_seed(3)
    m, h, v = 19, 8, 37
    hidden, weight = torch.randn(m, h, generator=g), torch.randn(v, h, generator=g) * 0.5
    targets = torch.randint(0, v, (m,), generator=g)
    grads = []
    for keep_bytes in (0, 1 << 30):
        hd, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, _ = logprobs_from_hidden(hd, LMHead(w, None), targets, chunk_tokens=5, keep_bytes=keep_bytes)
        lp.sum().backward(retain_graph=True)
        first = (hd.grad.clone(), w.grad.clone())
        hd.grad, w.grad = None, None
        lp.sum().backward()  # the kept buffers were used up in place: this one must recompute, not reuse them
        torch.testing.assert_close((hd.grad, w.grad), first)
        grads.append(first)
    torch.testing.assert_close(grads[0], grads[1])


def test_empty_rows_give_the_weight_a_zero_gradient():
    """A rank whose micro-batch has no scored row must still produce a gradient for the head's weight, or FSDP's
    reduce-scatter would see different tensors on different ranks."""
    weight = torch.randn(11, 4, requires_grad=True)
    hidden = torch.randn(0, 4, requires_grad=True)
    lp, ent = logprobs_from_hidden(hidden, LMHead(weight, None), torch.zeros(0, dtype=torch.long), compute_entropy=True)
    assert lp.shape == (0,) and ent is not None and ent.shape == (0,)
    (lp.sum() * 0.0).backward()
    assert weight.grad is not None and torch.count_nonzero(weight.grad) == 0


def test_forward_features_returns_hidden_states_and_the_head(tiny_ckpt):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    ids = torch.tensor([[3, 17, 42, 8, 64]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]  # [T, V]
        out, head = forward_features(model, input_ids=ids)
    assert head is not None and head.weight is model.get_output_embeddings().weight
    feats = out.logits[0]
    assert feats.shape == (5, model.config.hidden_size)
    # the same fp32 dot products of h terms in maybe another order: gamma(h) * sum |f w| apart at most
    bound = gamma(feats.shape[-1]) * (feats.abs() @ head.weight.abs().T)  # [T, V]
    assert bool(((feats @ head.weight.T - logits).abs() <= 2 * bound).all())
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size  # the head is restored afterwards

    model.config.final_logit_softcapping = 30.0  # logits that are more than h W^T: the model's own are kept
    assert _head_module(model) is None
    out, head = forward_features(model, input_ids=ids)
    assert head is None and out.logits.shape[-1] == model.config.vocab_size
