"""Floating-point error bounds for the tests' tolerances, so that a tolerance follows from the computation (its
summation lengths, the dtype's rounding, the magnitudes involved) instead of from one machine's observed error.

Why: two correct fp32 implementations (a C kernel built for AVX-512 or AVX2, MKL, oneDNN, torch's own vectorised
loops) sum in different orders, and the difference grows with the summation length; a tolerance picked from the
error seen on one CPU fails on another. The bounds are Higham's (Accuracy and Stability of Numerical Algorithms,
ch. 3-4): any order of summing n terms errs by at most gamma(n - 1) * sum |terms|, with gamma(n) = n u / (1 - n u)
and u the unit roundoff. They are worst cases, so they hold on every CPU and summation order.
"""

from __future__ import annotations

U32 = 2.0**-24  # fp32 unit roundoff (half of torch.finfo(torch.float32).eps)
# relative error of the kernels' exp polynomial (cpu_build.EXP_POLY_C): its truncation (ln2 / 2)^7 / 7! = 1.2e-7
# plus four roundings (argument reduction, the Horner steps that matter at |r| <= 0.35, the scaling)
EXP_POLY_REL = 1.2e-7 + 4 * U32


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative error bound of n successive roundings."""
    return n * u / (1 - n * u)


def sum_bound(n: int, sum_abs: float, u: float = U32) -> float:
    """|computed - exact| of a sum (or dot product: one more rounding per term) of n terms whose absolute values
    add up to `sum_abs`, in any order or blocking."""
    return gamma(n, u) * sum_abs


def decoder_logit_bound(
    hidden: int, intermediate: int, layers: int, context: int, vocab: int, scale: float, u: float = U32
) -> float:
    """First-order bound on how far two fp32 implementations of a decoder's forward may put one logit or logprob
    apart: each side's matmuls on one residual path (q/k/v and o over `hidden`, gate/up over `hidden`, down over
    `intermediate`, attention over `context` keys, per layer; the head over `hidden`; log-softmax over `vocab`)
    each err by at most gamma(K) relative to the magnitudes they combine, taken here as `scale` (the largest
    |logit| or |logprob|; RMSNorm keeps every layer's inputs at unit scale). Both sides err, hence the factor 2.
    It ignores error amplification by the network (a first-order estimate, not a theorem), so tests use it with
    the worst-case gamma rather than the typical sqrt(K) u."""
    per_layer = gamma(hidden, u) * 3 + gamma(intermediate, u) + gamma(context, u) * 2
    path = layers * per_layer + gamma(hidden, u) + gamma(vocab, u)
    return 2 * path * max(scale, 1.0)


def spec_logit_bound(spec, context: int, scale: float) -> float:
    """decoder_logit_bound for a ModelSpec (areal_async.server.model) at `context` tokens and logit `scale`."""
    return decoder_logit_bound(
        spec.hidden_size, spec.intermediate_size, spec.num_layers, context, spec.vocab_size, scale
    )


def checkpoint_logit_bound(path: str, context: int, scale: float) -> float:
    """spec_logit_bound for the checkpoint directory `path` (its config.json)."""
    import json
    import os

    from areal_async.server.model import ModelSpec

    with open(os.path.join(path, "config.json")) as f:
        return spec_logit_bound(ModelSpec.from_hf_config(json.load(f)), context, scale)


def logsumexp_bound(n: int, spread: float, lse: float, u: float = U32) -> float:
    """|computed - exact| of an fp32 logsumexp (or of one log-softmax entry) over n logits whose max - min is
    `spread`, by any implementation: the sum of n exps (gamma(n), relative, turned absolute by the log), each exp
    (the kernels' polynomial or a libm one, EXP_POLY_REL covers both) of a rounded difference (u * spread), and
    the log, subtraction and cast (3 u |lse|)."""
    return gamma(n, u) + EXP_POLY_REL + u * spread + 3 * u * max(abs(lse), 1.0)


def attention_bound(q, k, v, u: float = U32) -> float:
    """|computed - exact| bound for softmax(q . k_j) weighted v_j over n keys (q [D], k, v [n, D], any dtype):
    each score errs by gamma(D) sum_d |q_d k_jd| (absolute, so relative in its exp), plus the exp polynomial and one
    rescale per 16-key page; numerator and denominator are sums of n positive-weighted terms (gamma(n) each); the
    ratio is a convex combination of the v_j, so the relative errors scale max |v| (twice: top and bottom)."""
    n, d = k.shape
    score_err = gamma(d, u) * float((q.abs().double() @ k.abs().double().T).max())
    rel_p = score_err + EXP_POLY_REL + (n // 16 + 1) * (EXP_POLY_REL + 2 * u)
    return 2 * (rel_p + gamma(n + 2, u)) * float(v.abs().max()) + u * float(v.abs().max())
