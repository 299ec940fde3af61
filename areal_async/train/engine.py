"""The trainer's model, optimizer and step: FSDP2 over any transformers causal LM, callable without RPC.

One `TrainEngine` lives in each torchrun rank. Every public method is a collective: all ranks must call the same
methods in the same order (the RPC worker guarantees it by running calls one at a time, in arrival order, and the
controller by sending every call to every rank). Anything that can fail on one rank only (a malformed shard) is
checked and then agreed on with an all-reduce before the first FSDP collective, so one bad shard raises on every
rank instead of leaving the others waiting in an all-gather.

The train step (see `train_step`), for the shard of groups this rank owns:

    prox logprobs with the weights before the step (no grad)     <- skipped when loss.prox_logp == "behav", and
                                                                    folded into the training forward when k == 1
    shaped rewards -> group advantages (groups are whole here) -> optional batch norm with all-reduced moments
    for each of k minibatches (one optimizer step each):
        micro-batches under micro_batch_tokens (see Layouts), the same count on every rank (empty ones pad)
        loss = sum over tokens / the minibatch's global response-token count  -> backward (grads accumulate)
        clip the global grad norm; a non-finite norm skips the step
    scheduler.step(); version += 1

Folding the prox pass (k == 1): the weights do not change until the optimizer step after the last micro-batch, the
model has no dropout and the micro-batches are the same, so the recomputed prox logprobs would equal the training
forward's logprobs; the step takes them from there (detached) and saves a whole forward over the batch. With k > 1
the later minibatches run on updated weights, so the separate pass stays.

Layouts: where the model allows it (sdpa/eager attention, no sliding windows, no activation checkpointing), the
samples of a prompt group share one pass over their common prefix (`train/shared_prefix.py`: the prefix runs once,
the rest attends to its keys and values; exact). In the default run the common prefix is the prompt plus the start
of the worked solution the samples agree on: ~60% of a batch's tokens are not run again. A batch with no shared
prefix falls back, step by step, to the plain layout. Plain layout: with sdpa/eager attention
(how this engine loads models) a micro-batch is a right-padded batch of
length-sorted sequences (`rows_forward_logprobs` + `pack_sorted_micro_batches`, padded slots counted against the
budget): exact, with no attention mask, where packing end to end would need a dense [N, N] block mask (for 128
sequences of ~60 tokens in 1024-token rows that mask made attention most of the step on CPU). Flash-attention
models keep true packing (varlen kernels, no mask, no padding).

Loss scaling: each rank's loss is already divided by the global token count, so the true gradient is the SUM of
the ranks' gradients; FSDP's reduce-scatter averages, hence the backward of `loss * world_size`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_async.config import OptimConfig, TrainConfig
from areal_async.train.advantages import (batch_normalize_with, group_advantages, mean_std_from_moments,
                                          normalization_moments, shape_rewards)
from areal_async.train.losses import kl_penalty, ppo_actor_loss
from areal_async.train.logprobs import needs_dense_packing_mask, packed_forward_logprobs, rows_forward_logprobs
from areal_async.train.packing import (pack_family_micro_batches, pack_micro_batches, pack_sorted_micro_batches,
                                       split_minibatches)
from areal_async.train.shared_prefix import (plan_families, shared_prefix_forward_logprobs, shared_prefix_savings,
                                             supports_shared_prefix)
from areal_async.types import (Array, BroadcastRequest, BroadcastResult, InitBroadcastRequest, PublishResult,
                               TrainBatch, TrainerInfo, WeightSpec)

__all__ = ["TrainEngine", "init_distributed", "resolve_device", "lr_factor", "any_rank", "BatchError"]


class BatchError(ValueError):
    """A train batch that cannot be trained on; raised on every rank when any rank's shard is bad."""


# ---- process group and device -------------------------------------------------------------------------------------


def resolve_device(device: str = "auto") -> torch.device:
    """"auto": this rank's CUDA device (LOCAL_RANK) when CUDA is available, else CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return dev


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> torch.device:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    gloo on CPU; on CUDA nccl for tensors plus gloo for CPU objects (DCP and barriers exchange CPU tensors).
    Without torchrun's variables this becomes a world of one, so the engine also works in a plain process.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
        kwargs: dict = {}
        if "RANK" not in os.environ:  # not under torchrun: a private world of one
            kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None, **kwargs)
    return dev


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (an all-reduce, so also a barrier). Used to turn one
    rank's failure into an error everywhere instead of a hang in the next collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":  # a pure nccl group cannot reduce CPU tensors
        t = t.cuda()
    dist.all_reduce(t)
    return bool(t.item())


# ---- learning-rate schedule -------------------------------------------------------------------------------------


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` for train step `step` (0-based): linear warmup to 1, then constant, linear or cosine
    decay to `min_lr_ratio` at `total_steps`. One step here is one train step (one policy version), however many
    PPO minibatches it has, so the schedule is in the same unit as the run's `total_steps`."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.schedule == "linear":
        decay = 1.0 - progress
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


# ---- the shard as tensors ---------------------------------------------------------------------------------------


@dataclass
class _Shard:
    input_ids: Tensor  # [N] int64
    seq_lens: list[int]  # [B]
    starts: list[int]  # [B] offset of each sequence in the flat arrays
    loss_mask: Tensor  # [N] float32 (0/1)
    behav_logp: Tensor  # [N] float32
    versions: Tensor  # [N] int64
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] int64
    response_lens: Tensor  # [B] float32
    host_ids: np.ndarray  # [N] int64, the input ids on the host (planning the shared-prefix layout)
    family: list[int] | None = None  # [B] shared-prefix family of each sequence (train/shared_prefix.py)
    prefix_lens: list[int] | None = None  # [B] its family's shared prefix length

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


_FIELDS = {  # name -> (wire dtype, length: "N" tokens or "B" sequences)
    "input_ids": ("int32", "N"), "loss_mask": ("uint8", "N"), "logprobs": ("float32", "N"),
    "versions": ("int32", "N"), "seq_lens": ("int32", "B"), "rewards": ("float32", "B"),
    "group_ids": ("int64", "B"), "prompt_lens": ("int32", "B"),
}


def _decode_shard(batch: TrainBatch, vocab_size: int, device: torch.device) -> _Shard:
    """Check every array of the batch and turn it into tensors; raises BatchError naming the problem."""
    arrays: dict[str, np.ndarray] = {}
    for name, (dtype, _) in _FIELDS.items():
        a: Array = getattr(batch, name)
        if a.dtype != dtype:  # checked before np.frombuffer: a hostile dtype string never reaches numpy
            raise BatchError(f"batch.{name}: dtype must be {dtype}, got {a.dtype!r}")
        if len(a.shape) != 1:
            raise BatchError(f"batch.{name}: must be 1-d, got shape {a.shape}")
        try:
            arrays[name] = a.to_numpy()
        except ValueError as e:
            raise BatchError(f"batch.{name}: {e}") from None
    seq_lens = arrays["seq_lens"].astype(np.int64)
    n_tok, n_seq = int(seq_lens.sum()), len(seq_lens)
    for name, (_, kind) in _FIELDS.items():
        want = n_tok if kind == "N" else n_seq
        if arrays[name].shape[0] != want:
            raise BatchError(f"batch.{name}: length {arrays[name].shape[0]} != {want} "
                             f"({'sum of seq_lens' if kind == 'N' else 'number of sequences'})")
    if n_seq and seq_lens.min() < 2:
        raise BatchError("batch.seq_lens: every sequence needs at least 2 tokens (position 0 is never trained)")
    ids = arrays["input_ids"]
    if n_tok and (ids.min() < 0 or ids.max() >= vocab_size):
        raise BatchError(f"batch.input_ids: token ids must be in [0, {vocab_size})")
    mask = arrays["loss_mask"]
    if n_tok and mask.max() > 1:
        raise BatchError("batch.loss_mask: values must be 0 or 1")
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]]).astype(np.int64) if n_seq else np.zeros(0, np.int64)
    if n_seq and mask[starts].any():
        raise BatchError("batch.loss_mask: the first token of a sequence cannot be trained (no context)")
    response_lens = np.add.reduceat(mask.astype(np.float32), starts) if n_seq else np.zeros(0, np.float32)
    return _Shard(
        input_ids=torch.from_numpy(ids.astype(np.int64)).to(device),
        seq_lens=seq_lens.tolist(),
        starts=starts.tolist(),
        loss_mask=torch.from_numpy(mask.astype(np.float32)).to(device),
        behav_logp=torch.from_numpy(arrays["logprobs"].copy()).to(device),
        versions=torch.from_numpy(arrays["versions"].astype(np.int64)).to(device),
        rewards=torch.from_numpy(arrays["rewards"].copy()).to(device),
        group_ids=torch.from_numpy(arrays["group_ids"].copy()).to(device),
        response_lens=torch.from_numpy(response_lens.astype(np.float32)).to(device),
        host_ids=ids.astype(np.int64),
    )


# ---- stats ------------------------------------------------------------------------------------------------------


class _Stats:
    """Scalar accumulators reduced across ranks in two all-reduces: keys ending in `_max` with MAX, the rest SUM
    (the convention of train/losses.py). The key set is fixed up front: every rank must reduce the same vector,
    also a rank whose shard is empty and never computed a loss."""

    def __init__(self, keys: list[str], device: torch.device) -> None:
        self.device = device
        self.values: dict[str, Tensor] = {
            k: torch.tensor(float("-inf") if k.endswith("_max") else 0.0, dtype=torch.float64, device=device)
            for k in keys}

    def add(self, key: str, value: Tensor | float) -> None:
        v = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().reshape(())
        if key.endswith("_max"):
            self.values[key] = torch.maximum(self.values[key], v)
        else:
            self.values[key] = self.values[key] + v

    def add_all(self, stats: dict[str, Tensor]) -> None:
        for k, v in stats.items():
            self.add(k, v)

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for is_max in (False, True):
            keys = sorted(k for k in self.values if k.endswith("_max") == is_max)
            if not keys:
                continue
            t = torch.stack([self.values[k] for k in keys])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM)
            out.update(zip(keys, t.tolist()))
        return out


_STEP_STAT_KEYS = ["entropy_sum", "kl_ref_sum", "loss_sum", "response_tokens", "tokens", "reward_sum",
                   "shaped_reward_sum", "adv_abs_sum", "staleness_sum", "staleness_max", "nonfinite_inputs",
                   "step_seconds_max", "prox_seconds_max"]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


# ---- the engine -------------------------------------------------------------------------------------------------


class TrainEngine:
    """FSDP2-sharded policy (and optional frozen reference), AdamW, LR schedule and the decoupled-PPO step.

    Call `init_distributed` first (torchrun, or a world of one). Weights are loaded once by rank 0 from the HF
    directory and scattered to the shards of every rank, so a node does not hold one full copy per GPU.
    """

    def __init__(self, model_path: str, cfg: TrainConfig, *, seed: int = 1, temperature: float = 1.0,
                 device: torch.device | None = None, broadcast_timeout_s: float = 600.0,
                 layout: Literal["auto", "packed", "rows", "prefix"] | None = None, fold_prox: bool = True) -> None:
        """`layout` (default: `cfg.layout`): "auto" = shared prompts run once where the model allows it, else
        padded rows for sdpa/eager attention and packing for varlen kernels (see the module docstring);
        "packed"/"rows"/"prefix" force one (all exact). `fold_prox=False` keeps the separate prox pass even with
        one minibatch (the reference the folded path is tested against)."""
        layout = cfg.layout if layout is None else layout
        if not dist.is_initialized():
            raise RuntimeError("TrainEngine needs torch.distributed; call init_distributed() first")
        cfg.validate("train")
        if layout not in ("auto", "packed", "rows", "prefix"):
            raise ValueError(f"layout must be 'auto', 'packed', 'rows' or 'prefix', got {layout!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature of the rollouts), got {temperature}")
        self.cfg = cfg
        self.model_path = model_path
        self.temperature = float(temperature)
        self.device = device if device is not None else resolve_device(cfg.device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.version = 0
        self._broadcast_timeout_s = broadcast_timeout_s
        self._broadcaster = None  # train/broadcast.py's WeightBroadcaster, made on first use
        self.bind_device()
        torch.manual_seed(seed + self.rank)

        mp = cfg.mixed_precision
        if mp == "auto":
            mp = "bf16" if self.device.type == "cuda" else "fp32"
        self.compute_dtype = torch.bfloat16 if mp == "bf16" else torch.float32

        loaded = _load_sharded(model_path, self.device, self.compute_dtype, cfg.activation_checkpointing,
                               trainable=True)
        self.model = loaded.model
        self.hf_config = loaded.config
        self.vocab_size = int(loaded.config.get_text_config().vocab_size)
        self.checkpoint_dtype = loaded.checkpoint_dtype
        self.tied_names = loaded.tied_names
        self.num_params = sum(p.numel() for p in self.model.parameters())
        # the layout for batches without shared prompts, and the one "prefix" falls back to for them
        self.plain_layout = "rows" if needs_dense_packing_mask(self.model) else "packed"
        if layout == "auto":
            layout = "prefix" if supports_shared_prefix(self.model) else self.plain_layout
        elif layout == "prefix" and not supports_shared_prefix(self.model):
            raise ValueError("layout='prefix' needs sdpa/eager attention without sliding windows or activation "
                             "checkpointing (train/shared_prefix.py)")
        if layout != "prefix":
            self.plain_layout = layout
        self.layout = layout
        self._step_layout = layout  # this step's: "prefix" only when some family in the batch shares a prompt
        self.fold_prox = fold_prox
        # host-side seconds of the last step's phases: prox, forward, backward, optimizer (for benchmarks; on CUDA
        # they measure launches, not kernels, since the step never synchronises for them)
        self.last_timings: dict[str, float] = {}
        self.ref_model = None  # the frozen initial policy, for the KL penalty only
        if cfg.loss.kl_coef != 0.0:
            self.ref_model = _load_sharded(model_path, self.device, self.compute_dtype, False, trainable=False).model

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, self.cfg.optim))
        # the loss's stat names, from a one-token dry run: a rank with an empty shard must still reduce them all
        one = torch.zeros(1, device=self.device)
        _, probe = ppo_actor_loss(one, one, one, one, one, cfg.loss, normalizer=1.0,
                                  seq_ids=torch.zeros(1, dtype=torch.long, device=self.device))
        self._stat_keys = sorted(set(probe) | set(_STEP_STAT_KEYS))

    # ---- small helpers ----

    def bind_device(self) -> None:
        """Public methods run in the RPC worker thread; the CUDA current device is per thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def _agree(self, error: str | None) -> None:
        """Raise on every rank when any rank found a problem (before any FSDP collective starts)."""
        bad = any_rank(error is not None)
        if error:
            raise BatchError(error)
        if bad:
            raise BatchError("another trainer rank rejected its shard of the batch (see that rank's error)")

    def _equal_micro_batches(self, shard: _Shard, seqs: list[int]) -> list[list[int]]:
        """Pack the shard's sequences `seqs` into micro-batches (lists of shard sequence indices) in this step's
        layout, the same count on every rank (FSDP collectives run per forward).

        A rank below the largest count repacks with that floor (spreading its tokens) and pads with empty
        micro-batches where it has too few sequences; if a repack overshoots, the ranks agree again on the new
        maximum. The count only grows, so this ends."""
        budget = self.cfg.micro_batch_tokens
        lens = [shard.seq_lens[i] for i in seqs]
        if self._step_layout == "prefix":
            assert shard.family is not None and shard.prefix_lens is not None
            fam = [shard.family[i] for i in seqs]
            pre = [shard.prefix_lens[i] for i in seqs]

            def pack(lens: list[int], budget: int, min_micro_batches: int = 1) -> list[list[int]]:
                return pack_family_micro_batches(lens, fam, pre, budget, min_micro_batches)
        else:
            pack = pack_sorted_micro_batches if self._step_layout == "rows" else pack_micro_batches
        base = pack(lens, budget) if lens else []
        mbs = base
        while True:
            hi, neg_lo = self._all_reduce([len(mbs), -len(mbs)], op=dist.ReduceOp.MAX)
            target = int(hi)
            if target == int(-neg_lo):
                return [[seqs[j] for j in mb] for mb in mbs]
            if len(mbs) < target:
                real = pack(lens, budget, min_micro_batches=target) if len(lens) >= target else base
                mbs = real + [[] for _ in range(target - len(real))]

    def _forward(self, model: nn.Module, shard: _Shard, seqs: list[int], *, entropy: bool,
                 entropy_grad: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
        """Forward of sequences `seqs` of the shard in this engine's layout. Returns (logp [n], entropy [n] | None,
        token index [n]), flat in the order of `seqs`.

        An empty `seqs` runs one dummy token so the FSDP collectives still happen; its index is empty.
        `entropy_grad=False`: the entropy is for the stats only (no autograd graph for it)."""
        kw = dict(temperature=self.temperature, compute_entropy=entropy, entropy_grad=entropy_grad)
        if self._step_layout == "prefix":  # two model calls per micro-batch, the dummy included
            if not seqs:
                ids = torch.zeros(2, dtype=torch.long, device=self.device)
                logp, ent = shared_prefix_forward_logprobs(model, ids, [2], [0], [1], **kw)
                return logp, ent, torch.zeros(0, dtype=torch.long, device=self.device)
            assert shard.family is not None and shard.prefix_lens is not None
            fam = [shard.family[i] for i in seqs]
            pre = [shard.prefix_lens[i] for i in seqs]

            def fwd(model, ids, lens, **kw):
                return shared_prefix_forward_logprobs(model, ids, lens, fam, pre, **kw)
        else:
            fwd = rows_forward_logprobs if self._step_layout == "rows" else packed_forward_logprobs
            if not seqs:
                ids = torch.zeros(1, dtype=torch.long, device=self.device)
                logp, ent = fwd(model, ids, [1], **kw)
                return logp, ent, torch.zeros(0, dtype=torch.long, device=self.device)
        lens = [shard.seq_lens[i] for i in seqs]
        index = torch.cat([torch.arange(shard.starts[i], shard.starts[i] + n, device=self.device)
                           for i, n in zip(seqs, lens)])  # [n]
        logp, ent = fwd(model, shard.input_ids[index], lens, **kw)
        return logp, ent, index

    @torch.no_grad()
    def _forward_all(self, model: nn.Module, shard: _Shard, *, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """No-grad logprobs (and entropy) of the whole shard, in micro-batches. [N], [N] | None."""
        model.eval()
        logp_all = torch.zeros(len(shard.input_ids), dtype=torch.float32, device=self.device)
        ent_all = torch.zeros_like(logp_all) if entropy else None
        for mb in self._equal_micro_batches(shard, list(range(shard.num_seqs))):
            logp, ent, index = self._forward(model, shard, mb, entropy=entropy)
            if index.numel():
                logp_all[index] = logp.float()
                if ent_all is not None and ent is not None:
                    ent_all[index] = ent.float()
        model.reshard()  # FSDP2 keeps the root unsharded after a forward; no backward follows to reshard it
        return logp_all, ent_all

    # ---- the step ----

    def train_step(self, batch: TrainBatch) -> tuple[int, dict[str, float]]:
        """One decoupled-PPO train step on this rank's shard; returns (new version, stats reduced over ranks)."""
        self.bind_device()
        t_start = time.perf_counter()
        cfg, lcfg = self.cfg, self.cfg.loss
        error = None
        shard = None
        try:
            shard = _decode_shard(batch, self.vocab_size, self.device)
            if batch.policy_version != self.version:
                error = (f"batch.policy_version={batch.policy_version} but the trainer is at version "
                         f"{self.version}")
        except BatchError as e:
            error = str(e)
        self._agree(error)
        assert shard is not None
        saved = 0
        if self.layout == "prefix" and shard.num_seqs:
            shard.family, shard.prefix_lens = plan_families(shard.host_ids, shard.seq_lens,
                                                            shard.group_ids.tolist())
            saved = shared_prefix_savings(shard.family, shard.prefix_lens)
        resp_tokens, num_seqs, saved = self._all_reduce([float(shard.loss_mask.sum()), float(shard.num_seqs),
                                                         float(saved)])
        # a batch where no prompt is shared runs the plain layout: one model call per micro-batch instead of two
        self._step_layout = "prefix" if self.layout == "prefix" and saved > 0 else self.plain_layout
        if resp_tokens <= 0:
            raise BatchError("the batch has no trainable tokens (loss_mask is 0 everywhere on every rank)")
        if int(resp_tokens) != batch.global_response_tokens or int(num_seqs) != batch.global_num_seqs:
            raise BatchError(f"batch.global_response_tokens/global_num_seqs = {batch.global_response_tokens}/"
                             f"{batch.global_num_seqs}, but the shards hold {int(resp_tokens)}/{int(num_seqs)}")
        stats = _Stats(self._stat_keys, self.device)
        mask = shard.loss_mask  # [N]

        # 1. proximal logprobs with the weights before any update, and the entropy of that policy for the stats
        t0 = time.perf_counter()
        want_entropy_grad = lcfg.entropy_coef != 0.0
        # one minibatch: the training forward runs on exactly these weights and micro-batches (module docstring)
        fold = lcfg.prox_logp == "recompute" and cfg.ppo_minibatches == 1 and self.fold_prox
        if lcfg.prox_logp == "recompute" and not fold:
            prox, ent = self._forward_all(self.model, shard, entropy=not want_entropy_grad)
        else:  # behav, or folded: `prox` is then never read (each micro-batch takes its own logp.detach())
            prox, ent = shard.behav_logp.clone(), None
        ref = self._forward_all(self.ref_model, shard, entropy=False)[0] if self.ref_model is not None else None
        prox_s = time.perf_counter() - t0
        if ent is not None:
            stats.add("entropy_sum", (ent * mask).sum())
        train_entropy = ent is None  # for the loss, or because no prox pass measured it for the stats

        # 2. advantages: shaped rewards -> group baseline -> optional global batch norm -> per token
        shaped = shape_rewards(shard.rewards, cfg.advantage, shard.response_lens)  # [B]
        adv = group_advantages(shaped, shard.group_ids, cfg.advantage.estimator)  # [B]
        if cfg.advantage.batch_norm:
            moments = normalization_moments(adv)  # [3] float64
            if self.world_size > 1:
                dist.all_reduce(moments)
            mean, std = mean_std_from_moments(moments)
            adv = batch_normalize_with(adv, mean, std)
        seq_lens_t = torch.tensor(shard.seq_lens, dtype=torch.long, device=self.device)
        adv_tok = torch.repeat_interleave(adv.float(), seq_lens_t) * mask  # [N]
        seq_of_tok = torch.repeat_interleave(torch.arange(shard.num_seqs, device=self.device), seq_lens_t)  # [N]
        # (GSPO's per-sequence ratio only needs distinct ids per sequence; gaps are fine)

        # 3. k minibatches, one optimizer step each
        self.model.train()
        minibatches = split_minibatches(shard.num_seqs, cfg.ppo_minibatches)
        mb_tokens = self._all_reduce([float(sum(shard.response_lens[i] for i in mb)) if mb else 0.0
                                      for mb in minibatches])
        # the optimizer's list, not model.parameters(): after a forward FSDP2 leaves the root's parameters
        # registered as unsharded tensors, which never receive the (sharded) gradients
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        losses, grad_norms, skipped = [], [], 0
        fwd_s = bwd_s = opt_s = 0.0
        for mb_seqs, normalizer in zip(minibatches, mb_tokens):
            if normalizer <= 0:  # no trainable token in this minibatch on any rank: nothing to step on
                continue
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for seqs in self._equal_micro_batches(shard, mb_seqs):
                t_mb = time.perf_counter()
                logp, ent_mb, index = self._forward(self.model, shard, seqs, entropy=train_entropy,
                                                    entropy_grad=want_entropy_grad)
                if not seqs:
                    loss = logp.sum() * 0.0  # keeps this rank in the FSDP collectives, contributes nothing
                else:
                    m = mask[index]
                    prox_mb = logp.detach() if fold else prox[index]
                    loss, lstats = ppo_actor_loss(logp, prox_mb, shard.behav_logp[index], adv_tok[index], m,
                                                  lcfg, normalizer=normalizer, seq_ids=seq_of_tok[index])
                    stats.add_all(lstats)
                    if ref is not None:
                        kl = kl_penalty(logp, ref[index], m, lcfg.kl_estimator).sum() / normalizer
                        loss = loss + lcfg.kl_coef * kl
                        stats.add("kl_ref_sum", kl.detach() * normalizer)
                    if ent_mb is not None:
                        ent_sum = (ent_mb * m).sum()
                        if want_entropy_grad:
                            loss = loss - lcfg.entropy_coef * ent_sum / normalizer
                        stats.add("entropy_sum", ent_sum.detach())
                t_bwd = time.perf_counter()
                fwd_s += t_bwd - t_mb
                (loss * self.world_size).backward()
                loss_sum += loss.detach().double()
                bwd_s += time.perf_counter() - t_bwd
            losses.append(loss_sum)
            t_opt = time.perf_counter()
            norm = _clip_grad_norm(params, cfg.optim.grad_clip)
            grad_norms.append(norm)
            if torch.isfinite(norm):
                self.optimizer.step()
            else:  # every rank sees the same all-reduced norm, so all skip together
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            opt_s += time.perf_counter() - t_opt
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.version += 1

        # 4. stats, reduced over ranks
        stats.add("loss_sum", torch.stack(losses).sum() if losses else 0.0)
        stats.add("response_tokens", mask.sum())
        stats.add("tokens", float(len(shard.input_ids)))
        stats.add("reward_sum", shard.rewards.double().sum())
        stats.add("shaped_reward_sum", shaped.double().sum())
        stats.add("adv_abs_sum", adv.double().abs().sum())
        stale = (batch.policy_version - shard.versions).double() * mask  # [N]
        stats.add("staleness_sum", stale.sum())
        if len(stale):
            stats.add("staleness_max", stale.max())
        nonfinite = (~torch.isfinite(shard.behav_logp)).sum() + (~torch.isfinite(shard.rewards)).sum()
        stats.add("nonfinite_inputs", nonfinite)
        stats.add("step_seconds_max", time.perf_counter() - t_start)
        stats.add("prox_seconds_max", prox_s)
        self.last_timings = {"prox": prox_s, "forward": fwd_s, "backward": bwd_s, "optimizer": opt_s}
        r = stats.reduce()
        n_steps = max(len(losses), 1)
        tok, used = r.get("token_count", 0.0), r.get("used_token_count", 0.0)
        finite_norms = [float(g) for g in grad_norms if math.isfinite(float(g))]
        out = {
            "loss": r["loss_sum"] / n_steps,
            "pg_loss": _ratio(r.get("pg_loss_sum", 0.0), resp_tokens),
            "clip_frac": _ratio(r.get("clipped_count", 0.0), used),
            "dual_clip_frac": _ratio(r.get("dual_clipped_count", 0.0), used),
            "imp_weight_mean": _ratio(r.get("imp_weight_sum", 0.0), tok),
            "imp_weight_max": max(r.get("imp_weight_max", 0.0), 0.0),
            "imp_weight_masked_frac": _ratio(r.get("capped_count", 0.0), tok),
            "ratio_mean": _ratio(r.get("ratio_sum", 0.0), used),
            "approx_kl": _ratio(r.get("approx_kl_sum", 0.0), used),
            "entropy": _ratio(r.get("entropy_sum", 0.0), resp_tokens),
            "grad_norm": float(np.mean([float(g) for g in grad_norms])) if grad_norms else 0.0,
            "grad_norm_max": max(finite_norms) if finite_norms else 0.0,
            "skipped_steps": float(skipped),
            "optimizer_steps": float(len(grad_norms) - skipped),
            "staleness_mean": _ratio(r["staleness_sum"], resp_tokens),
            "staleness_max": max(r["staleness_max"], 0.0),
            "reward_mean": _ratio(r["reward_sum"], num_seqs),
            "shaped_reward_mean": _ratio(r["shaped_reward_sum"], num_seqs),
            "adv_abs_mean": _ratio(r["adv_abs_sum"], num_seqs),
            "response_len_mean": _ratio(resp_tokens, num_seqs),
            "num_seqs": num_seqs,
            "tokens": r["tokens"],
            "shared_prefix_tokens": saved,  # tokens of repeated prompts the model did not run again
            "response_tokens": resp_tokens,
            "nonfinite_inputs": r["nonfinite_inputs"],
            "lr": float(lr),
            "step_seconds": r["step_seconds_max"],
            "prox_seconds": r["prox_seconds_max"],
            "tokens_per_s": _ratio(r["tokens"], r["step_seconds_max"]),
        }
        if ref is not None:
            out["kl_ref"] = _ratio(r.get("kl_ref_sum", 0.0), resp_tokens)
        return self.version, out

    # ---- weights out, checkpoints, info ----

    def info(self) -> TrainerInfo:
        return TrainerInfo(rank=self.rank, world_size=self.world_size, version=self.version, device=str(self.device),
                           num_params=self.num_params)

    def weight_plan(self, bucket_bytes: int) -> list[WeightSpec]:
        """How `broadcast` buckets the weights: names, dtypes, shapes in send order (local, no collective)."""
        from areal_async.train.broadcast import plan_buckets

        self.bind_device()
        return plan_buckets(self.model, skip=self.tied_names, dtype=self.checkpoint_dtype, bucket_bytes=bucket_bytes)

    def _weight_broadcaster(self):
        from areal_async.train.broadcast import WeightBroadcaster

        if self._broadcaster is None:
            self._broadcaster = WeightBroadcaster(timeout_s=self._broadcast_timeout_s)
        return self._broadcaster

    def init_broadcast(self, req: InitBroadcastRequest) -> None:
        """Rank 0 joins the weight-update group with the servers (see train/broadcast.py)."""
        self.bind_device()
        self._weight_broadcaster().init_group(req, self.device)

    def broadcast(self, req: BroadcastRequest) -> BroadcastResult:
        """Send the current weights through the group (collective among trainers; rank 0 sends)."""
        self.bind_device()
        return self._weight_broadcaster().broadcast(self.model, group_name=req.group_name, skip=self.tied_names,
                                                    dtype=self.checkpoint_dtype, bucket_bytes=req.bucket_bytes)

    def close_broadcast(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()

    def publish(self, root: str, version: int, keep: int = 2) -> PublishResult:
        """Write the full model as an HF directory `root/v<version>` (collective; rank 0 writes)."""
        from areal_async.train.publish import publish_hf

        self.bind_device()
        return publish_hf(self.model, source_dir=self.model_path, root=root, version=version, keep=keep,
                          dtype=self.checkpoint_dtype, skip=self.tied_names)

    def save_checkpoint(self, path: str) -> float:
        from areal_async.train.checkpoint import save_checkpoint

        self.bind_device()
        t0 = time.perf_counter()
        save_checkpoint(path, self.model, self.optimizer, trainer_state=self._trainer_state(),
                        rng_state=_rng_state(self.device))
        return time.perf_counter() - t0

    def load_checkpoint(self, path: str) -> float:
        from areal_async.train.checkpoint import load_checkpoint

        self.bind_device()
        t0 = time.perf_counter()
        state, rng = load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if rng is not None:
            _set_rng_state(rng, self.device)
        return time.perf_counter() - t0

    def _trainer_state(self) -> dict:
        return {"version": self.version, "scheduler": self.scheduler.state_dict(), "world_size": self.world_size,
                "model_path": os.path.abspath(self.model_path)}


# ---- loading, sharding, clipping, RNG -----------------------------------------------------------------------------


@dataclass
class _Loaded:
    model: nn.Module
    config: object  # transformers PretrainedConfig (dropout zeroed, use_cache off)
    checkpoint_dtype: torch.dtype  # the dtype the HF directory stores: what publish and broadcast send
    tied_names: set[str]  # state-dict names that alias another parameter (a tied lm_head): never written twice


def _load_sharded(model_path: str, device: torch.device, compute_dtype: torch.dtype, activation_checkpointing: bool,
                  *, trainable: bool) -> _Loaded:
    """Build the model on the meta device on every rank, shard it with FSDP2, then fill the shards from the full
    weights that only rank 0 reads from disk (fp32 master weights whatever the checkpoint's dtype)."""
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(model_path)
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    checkpoint_dtype = stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32
    for key, value in list(vars(config).items()):  # RL trains without dropout: prox and theta must agree at u = 1
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    rank = dist.get_rank()
    full_sd: dict[str, Tensor] = {}
    loaded = None
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                                   attn_implementation="sdpa")
        full_sd = loaded.state_dict()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tied = {n for names in aliases.values() for n in names[1:]}
    persistent = set(model.state_dict())
    transient = [n for n, _ in model.named_buffers() if n not in persistent]  # rotary inv_freq and the like
    if activation_checkpointing and trainable:  # non-reentrant: the variant that composes with FSDP2
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{model_path}: cannot find the decoder layers to shard ({type(model).__name__} lists "
                         f"no _no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_sd
    # Buffers outside the state dict were left uninitialised by to_empty: take rank 0's freshly computed ones.
    real = dict(loaded.named_buffers()) if loaded is not None else {}
    for name in transient:
        buf = model.get_buffer(name)
        value = real[name].to(device=device, dtype=buf.dtype) if rank == 0 else torch.empty_like(buf)
        if dist.get_world_size() > 1:
            dist.broadcast(value, src=0)
        buf.copy_(value)
    del loaded, real
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return _Loaded(model, config, checkpoint_dtype, tied)


def _clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Total L2 norm of the (sharded) gradients across all ranks, then clip to `max_norm` when it is finite and
    `max_norm` > 0. Returns the norm before clipping as a plain tensor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm.detach().float().cpu()


def _rng_state(device: torch.device) -> dict[str, bytes]:
    state = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return state


def _set_rng_state(state: dict[str, bytes], device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), device)
