"""Policy losses as pure functions over flat per-token tensors of one packed micro-batch.

Decoupled PPO (AReaL): three policies meet in one token. pi_behav sampled it (its logprob came back from the
inference server, possibly from an older version), pi_prox is the trainer's weights before this step (logprobs
recomputed when the batch arrived), pi_theta is being optimised. The clip's trust region is centred on pi_prox,
and the off-policy gap between pi_behav and pi_prox is corrected by a detached importance weight:

    loss_t = w_t * max(-A_t * u_t, -A_t * clip(u_t, 1 - eps_low, 1 + eps_high))
    u_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav (no gradient; capped)

With pi_prox == pi_behav, w == 1 and this is standard PPO. The ratio math runs in fp32 whatever the input dtype:
exp of a bf16 log-difference loses the few percent the clip is about.

Normalisation: with `ratio_level="token"` the loss is a mean over every trained token of the global batch (each
micro-batch's sum divided by the global token count). With `ratio_level="sequence"` (GSPO) it is the paper's
sequence mean: a sequence's tokens share one ratio, their terms are averaged within the sequence, and the global
count of trained sequences divides the sum, so every sequence weighs the same whatever its length (a token mean
would weigh a sequence by its length). `loss_normalizer` says which count the caller passes.

Stats convention (so the engine can all-reduce them without knowing each one): every stat is a detached fp32
scalar tensor; keys ending in `_max` reduce with MAX, all others (`*_sum`, `*_count`) with SUM. `LOSS_STAT_KEYS`
lists them (a rank with nothing to train must still reduce the same vector) and `summarize_loss_stats` turns the
reduced sums into the reported means, e.g. clip fraction = clipped_count / used_token_count.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from areal_async.config import LossConfig

__all__ = [
    "ppo_actor_loss",
    "actor_loss",
    "kl_penalty",
    "entropy_from_logits",
    "loss_normalizer",
    "LOSS_STAT_KEYS",
    "summarize_loss_stats",
]

KLEstimator = Literal["k1", "k2", "k3"]

# exp() of a log-ratio beyond this overflows fp32 long before it means anything; clamping keeps one broken token
# from turning the whole micro-batch into inf/nan.
_MAX_LOG_RATIO = 20.0

LOSS_STAT_KEYS = (
    "token_count",
    "used_token_count",
    "seq_count",
    "clipped_count",
    "dual_clipped_count",
    "capped_count",
    "imp_weight_sum",
    "imp_weight_max",
    "ratio_sum",
    "approx_kl_sum",
    "pg_loss_sum",
    "kl_ref_sum",
    "entropy_sum",
)


def loss_normalizer(cfg: LossConfig) -> str:
    """Which global count divides the loss: "tokens" (trained tokens) or "seqs" (sequences with a trained token,
    GSPO's sequence mean)."""
    return "seqs" if cfg.ratio_level == "sequence" else "tokens"


def _check_flat(name: str, t: Tensor, n: int) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be a flat [N] tensor with N={n}, got shape {tuple(t.shape)}")


def _segment_mean(values: Tensor, weights: Tensor, seq_ids: Tensor) -> Tensor:
    """Per-token broadcast of the weighted mean of `values` over each token's sequence. [N] -> [N]."""
    num_seqs = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    total = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values * weights)
    count = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_ids, weights)
    return (total / count.clamp(min=1.0))[seq_ids]  # [N]


def ppo_actor_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    normalizer: float,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Decoupled PPO loss of one micro-batch, already divided by the global `normalizer`.

    All tensors are flat [N] over the packed micro-batch: `logp` (pi_theta, carries the gradient), `prox_logp`,
    `behav_logp`, per-token `advantages`, and `mask` (1 on trained tokens). `normalizer` is the number of response
    tokens in the whole global batch (all micro-batches, all ranks), so that summing the returned losses over
    micro-batches and ranks gives the global per-token mean. Tokens dropped by the importance-weight cap stay in
    the normalizer: they count as seen, they just contribute nothing.

    `cfg.decoupled=False` is naive PPO: prox := behav and w := 1, the trust region centred on the behaviour
    policy. `cfg.ratio_level="sequence"` is GSPO: each sequence's ratio is exp(mean over its trained tokens of
    logp - prox_logp), broadcast to its tokens; `seq_ids` [N] (each token's sequence index, 0-based) is required,
    each sequence's terms are averaged over its trained tokens, and `normalizer` is then the global number of
    trained sequences (the paper's sequence mean; see the module docstring).

    Returns (loss, stats); `prox_logp` and `behav_logp` never receive gradient.
    """
    loss, stats, _ = _ppo(logp, prox_logp, behav_logp, advantages, mask, cfg, normalizer=normalizer, seq_ids=seq_ids)
    return loss, stats


def _ppo(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    normalizer: float,
    seq_ids: Tensor | None,
) -> tuple[Tensor, dict, Tensor]:
    """`ppo_actor_loss`, plus the per-token weight [N] of everything else in the loss: 1 / normalizer on the tokens
    the importance-weight cap kept (divided by the sequence's trained tokens for GSPO), 0 elsewhere."""
    _check_ppo_inputs(logp, prox_logp, behav_logp, advantages, mask, cfg, normalizer=normalizer, seq_ids=seq_ids)
    m = mask.bool()  # [N]
    mf = m.float()
    logp32 = logp.float()
    behav = behav_logp.detach().float()
    prox = prox_logp.detach().float() if cfg.decoupled else behav
    adv = advantages.detach().float()

    raw_w, w, keep, over_cap = _behav_weight(m, prox, behav, logp32, cfg)
    keepf = keep.float()
    ratio, per_seq, seq_count = _policy_ratio(logp32, prox, keep, mf, cfg, seq_ids)
    pg, clipped, dual_clipped = _clipped_objective(adv, ratio, keep, m, cfg)

    per_token = pg * w.detach() * keepf * per_seq  # [N]
    loss = per_token.sum() / normalizer

    with torch.no_grad():
        # k3 estimator of KL(prox || theta) on tokens sampled (nearly) from prox: r - 1 - log r, r = theta / prox.
        lr_tok = torch.where(keep, logp32 - prox, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl_tok = torch.exp(lr_tok) - 1.0 - lr_tok
        stats = {
            "token_count": mf.sum(),
            "used_token_count": keepf.sum(),
            "seq_count": seq_count,
            "clipped_count": clipped.float().sum(),
            "dual_clipped_count": dual_clipped.float().sum(),
            "capped_count": over_cap.float().sum(),
            "imp_weight_sum": (raw_w * mf).sum(),
            "imp_weight_max": raw_w[m].max() if bool(m.any()) else torch.zeros((), device=logp.device),
            "ratio_sum": (ratio * keepf).sum(),
            "approx_kl_sum": (kl_tok * keepf).sum(),
            "pg_loss_sum": per_token.detach().sum(),
        }
    return loss, {k: v.detach().float() for k, v in stats.items()}, keepf * per_seq / normalizer


def _check_ppo_inputs(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    normalizer: float,
    seq_ids: Tensor | None,
) -> None:
    if logp.dim() != 1:
        raise ValueError(f"logp must be a flat [N] tensor, got shape {tuple(logp.shape)}")
    n = logp.shape[0]
    for name, t in (
        ("logp", logp),
        ("prox_logp", prox_logp),
        ("behav_logp", behav_logp),
        ("advantages", advantages),
        ("mask", mask),
    ):
        _check_flat(name, t, n)
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (the global number of response tokens), got {normalizer}")
    if cfg.ratio_level == "sequence":
        if seq_ids is None:
            raise ValueError("ratio_level='sequence' (GSPO) needs seq_ids: each token's sequence index")
        _check_flat("seq_ids", seq_ids, n)


def _behav_weight(
    m: Tensor, prox: Tensor, behav: Tensor, logp32: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The behaviour importance weight pi_prox / pi_behav and its cap. Returns (raw weight [N], the weight the loss
    uses [N], the tokens kept [N] bool, the tokens over the cap [N] bool)."""
    # masked-out positions (prompt tokens, behav=0) must not reach exp()
    if cfg.decoupled:
        raw_w = torch.exp(torch.where(m, prox - behav, 0.0).clamp(max=_MAX_LOG_RATIO))  # [N]
    else:
        raw_w = torch.ones_like(logp32)
    keep = m
    w = raw_w
    cap = cfg.behav_imp_weight_cap
    over_cap = m & (raw_w > cap) if (cap is not None and cfg.decoupled) else torch.zeros_like(m)
    if cap is not None and cfg.decoupled:
        if cfg.behav_imp_weight_mode == "mask":
            keep = m & ~over_cap
        else:
            w = raw_w.clamp(max=cap)
    return raw_w, w, keep, over_cap


def _policy_ratio(
    logp32: Tensor, prox: Tensor, keep: Tensor, mf: Tensor, cfg: LossConfig, seq_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The ratio pi_theta / pi_prox per token, or per sequence broadcast to its tokens (GSPO). Returns (ratio [N],
    1 / trained tokens of the token's sequence [N] (GSPO, else 1), the number of trained sequences (GSPO, else 0))."""
    keepf = keep.float()
    log_ratio = torch.where(keep, logp32 - prox, 0.0)  # [N]
    per_seq = torch.ones_like(mf)  # [N]
    seq_count = torch.zeros((), device=logp32.device)
    if cfg.ratio_level == "sequence":
        assert seq_ids is not None  # _check_ppo_inputs
        sid = seq_ids.long()
        log_ratio = _segment_mean(log_ratio, keepf, sid)
        num = int(sid.max().item()) + 1 if sid.numel() else 0
        trained = torch.zeros(num, dtype=mf.dtype, device=mf.device).index_add(0, sid, mf)  # [S]
        per_seq = 1.0 / trained.clamp(min=1.0)[sid]
        seq_count = (trained > 0).float().sum()
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [N]
    return ratio, per_seq, seq_count


def _clipped_objective(
    adv: Tensor, ratio: Tensor, keep: Tensor, m: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped (and optionally dual-clipped) policy-gradient term per token. Returns (pg [N], clipped [N] bool,
    dual-clipped [N] bool)."""
    eps_low = cfg.eps_clip
    eps_high = cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = keep & (pg_clipped > pg_unclipped)
    dual_clipped = torch.zeros_like(m)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip  # only binds for A < 0, where it is positive
        dual_clipped = keep & (adv < 0) & (pg > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    return pg, clipped, dual_clipped


def actor_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    normalizer: float,
    seq_ids: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """The whole policy objective of one micro-batch: `ppo_actor_loss`, plus `cfg.kl_coef` x the KL to the frozen
    reference (`ref_logp` [N]) and minus `cfg.entropy_coef` x the entropy (`entropy` [N], with gradient when the
    coefficient is not 0; without one it is only measured).

    The KL term weighs each token as the policy term does: tokens the importance-weight cap dropped are left out
    (their off-policy gap is too large to trust; training them towards the reference would still move the policy
    on exactly the tokens the cap protects), and GSPO's sequence mean applies to it too. The entropy bonus covers
    every trained token. Returns (loss, stats) with every key of `LOSS_STAT_KEYS`."""
    loss, stats, weight = _ppo(
        logp, prox_logp, behav_logp, advantages, mask, cfg, normalizer=normalizer, seq_ids=seq_ids
    )
    zero = torch.zeros((), device=logp.device)
    stats["kl_ref_sum"], stats["entropy_sum"] = zero, zero
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, mask, cfg.kl_estimator)  # [N], 0 outside the mask
        kl_term = (kl * weight).sum()  # already normalised
        loss = loss + cfg.kl_coef * kl_term
        stats["kl_ref_sum"] = (kl_term * normalizer).detach().float()  # summarised over the same normaliser
    if entropy is not None:
        ent_sum = (entropy.float() * mask.float()).sum()
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * ent_sum / normalizer
        stats["entropy_sum"] = ent_sum.detach().float()
    return loss, stats


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def summarize_loss_stats(r: dict[str, float], cfg: LossConfig, *, response_tokens: float) -> dict[str, float]:
    """The loss's reported figures from its reduced stat sums (`LOSS_STAT_KEYS`, summed over micro-batches and
    ranks). `pg_loss` and `kl_ref` are divided by the loss's own normaliser (tokens, or GSPO's sequences), the
    token fractions by the token counts, `entropy` by `response_tokens`."""
    tok, used = r.get("token_count", 0.0), r.get("used_token_count", 0.0)
    norm = r.get("seq_count", 0.0) if loss_normalizer(cfg) == "seqs" else response_tokens
    out = {
        "pg_loss": _ratio(r.get("pg_loss_sum", 0.0), norm),
        "clip_frac": _ratio(r.get("clipped_count", 0.0), used),
        "dual_clip_frac": _ratio(r.get("dual_clipped_count", 0.0), used),
        "imp_weight_mean": _ratio(r.get("imp_weight_sum", 0.0), tok),
        "imp_weight_max": max(r.get("imp_weight_max", 0.0), 0.0),
        "imp_weight_masked_frac": _ratio(r.get("capped_count", 0.0), tok),
        "ratio_mean": _ratio(r.get("ratio_sum", 0.0), used),
        "approx_kl": _ratio(r.get("approx_kl_sum", 0.0), used),
        "entropy": _ratio(r.get("entropy_sum", 0.0), response_tokens),
    }
    if cfg.kl_coef != 0.0:
        out["kl_ref"] = _ratio(r.get("kl_ref_sum", 0.0), norm)
    return out


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by the policy, zero outside `mask`. [N].

    With log r = logp - ref_logp: k1 = log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r (unbiased, always >= 0; Schulman's estimator). Gradient flows through `logp`.
    """
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, ref_logp {tuple(ref_logp.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    log_r = torch.where(m, logp.float() - ref_logp.detach().float(), 0.0)
    if estimator == "k1":
        kl = log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(-log_r) - 1.0 + log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")
    return kl * m.float()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) along the last dim, in fp32. [..., V] -> [...].

    H = logsumexp(z) - sum softmax(z) * z, which never takes log of a probability that underflowed to 0. Rows are
    independent, so callers may feed token chunks to bound memory.
    """
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [..., 1]
    p = torch.exp(z - lse)
    pz = torch.where(p > 0, p * z, 0.0)  # a banned token (z = -inf, p = 0) contributes 0, not nan
    return lse.squeeze(-1) - pz.sum(dim=-1)
