"""The trainer's model, optimizer and step: FSDP2 over any transformers causal LM, callable without RPC.

One `TrainEngine` lives in each torchrun rank. Every public method is a collective: all ranks must call the same
methods in the same order (the RPC worker guarantees it by running calls one at a time, in arrival order, and the
controller by sending every call to every rank). Anything that can fail on one rank only (a malformed shard) is
checked and then agreed on with an all-reduce before the first FSDP collective (train/dist.py `agree`), so one bad
shard raises on every rank instead of leaving the others waiting in an all-gather.

The train step (see `train_step`), for the shard of groups this rank owns:

    prox logprobs with the weights before the step (no grad)     <- skipped when loss.prox_logp == "behav", and
                                                                    folded into the training forward when k == 1
    shaped rewards -> group advantages (groups are whole here) -> optional batch norm with all-reduced moments
                      (both weighted by the batch's baseline_weights when it has them: train/advantages.py)
    for each of k minibatches (one optimizer step each):
        micro-batches under micro_batch_tokens (train/layouts.py), the same count on every rank (empty ones pad)
        loss = sum over tokens / the minibatch's global count (train/losses.py)  -> backward (grads accumulate)
        clip the global grad norm; a non-finite norm skips the step
    scheduler.step(); version += 1

Folding the prox pass (k == 1): the weights do not change until the optimizer step after the last micro-batch, the
model has no dropout and the micro-batches are the same, so the recomputed prox logprobs would equal the training
forward's logprobs; the step takes them from there (detached) and saves a whole forward over the batch. With k > 1
the later minibatches run on updated weights, so the separate pass stays.

Layouts (train/layouts.py): where the model allows it (sdpa/eager attention, no sliding windows, no activation
checkpointing), the samples of a prompt group share one pass over their common prefix (train/shared_prefix.py:
exact; in the default run ~60% of a batch's tokens are not run again). A batch with no shared prefix falls back,
step by step, to the plain layout: padded length-sorted rows with no mask for sdpa/eager attention (packing would
need a dense [N, N] block mask), true packing for varlen kernels (flash attention).

Loss scaling: each rank's loss is already divided by the global count, so the true gradient is the SUM of the
ranks' gradients; FSDP's reduce-scatter averages, hence the backward of `loss * world_size`.

Sampling temperature: logprobs are computed at `TrainConfig.temperature`, the rollouts' temperature (filled from
`rollout.temperature`); greedy rollouts (temperature 0) are scored at 1.0, where their logprobs are defined.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_async.config import OptimConfig, TrainConfig, logprob_temperature
from areal_async.host.cpu_features import model_hidden_size, resolve_mixed_precision
from areal_async.host.memory import keep_freed_memory
from areal_async.net.custom_group import device_uuid
from areal_async.train import checkpoint
from areal_async.train.advantages import (
    batch_normalize_with,
    group_advantages,
    mean_std_from_moments,
    normalization_moments,
    shape_rewards,
)
from areal_async.train.broadcast import WeightBroadcaster, plan_buckets
from areal_async.train.dist import agree, all_reduce_floats, any_rank, bind_device, init_distributed, rank_device
from areal_async.train.errors import BatchError
from areal_async.train.fsdp import clip_grad_norm, load_sharded, rng_state, set_rng_state
from areal_async.train.layouts import Layout, select_layout
from areal_async.train.losses import actor_loss, loss_normalizer
from areal_async.train.packing import split_minibatches
from areal_async.train.publish import publish_hf
from areal_async.train.shard import Shard, decode_shard
from areal_async.train.stats import StatSums, StepResult, summarize_step
from areal_async.types import (
    BroadcastRequest,
    BroadcastResult,
    InitBroadcastRequest,
    PublishResult,
    TrainBatch,
    TrainerInfo,
    WeightSpec,
)

log = logging.getLogger(__name__)
# init_distributed, rank_device, any_rank and BatchError live in train/dist.py and train/errors.py; they are
# re-exported here because scripts start an engine with `from areal_async.train.engine import ...`.
__all__ = ["TrainEngine", "lr_factor", "init_distributed", "rank_device", "any_rank", "BatchError"]


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


@dataclass
class _Step:
    """One train step's decoded shard and the decisions every rank agreed on."""

    shard: Shard
    layout: Layout
    num_seqs: float  # global
    saved: float  # global tokens the shared-prefix layout does not run again
    fold: bool  # prox logprobs taken from the training forward (k == 1)
    seq_of_tok: Tensor  # [N]


class TrainEngine:
    """FSDP2-sharded policy (and optional frozen reference), AdamW, LR schedule and the decoupled-PPO step.

    Call `init_distributed` first (torchrun, or a world of one). Weights are loaded once by rank 0 from the HF
    directory and scattered to the shards of every rank (train/fsdp.py).
    """

    def __init__(
        self,
        model_path: str,
        cfg: TrainConfig,
        *,
        seed: int = 1,
        device: torch.device | None = None,
        broadcast_timeout_s: float = 600.0,
        layout: Literal["auto", "packed", "rows", "prefix"] | None = None,
        fold_prox: bool = True,
    ) -> None:
        """`layout` (default: `cfg.layout`): see train/layouts.py. `fold_prox=False` keeps the separate prox pass
        even with one minibatch (the reference the folded path is tested against)."""
        if not dist.is_initialized():
            raise RuntimeError("TrainEngine needs torch.distributed; call init_distributed() first")
        cfg.validate("train")
        self.cfg = cfg
        self.model_path = model_path
        self.temperature = float(logprob_temperature(cfg.temperature))
        self.device = device if device is not None else rank_device(cfg.device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.version = 0
        self._broadcast_timeout_s = broadcast_timeout_s
        self._broadcaster = None  # train/broadcast.py's WeightBroadcaster, made on first use
        self.bind_device()
        if self.device.type == "cpu":  # steps allocate and free the same large host tensors (host/memory.py)
            keep_freed_memory(single_arena=True)
        self._gpu_uuid = device_uuid(self.device)
        torch.manual_seed(seed + self.rank)

        mp, why = resolve_mixed_precision(cfg.mixed_precision, self.device.type, model_hidden_size(model_path))
        if self.rank == 0:
            log.info("train.mixed_precision=%s: %s compute (%s)", cfg.mixed_precision, mp, why)
        self.compute_dtype = torch.bfloat16 if mp == "bf16" else torch.float32
        loaded = load_sharded(
            model_path,
            self.device,
            self.compute_dtype,
            cfg.activation_checkpointing,
            trainable=True,
            lora=cfg.lora,
            seed=seed,
        )
        self.model = loaded.model
        self.hf_config = loaded.config
        self.vocab_size = int(loaded.config.get_text_config().vocab_size)
        self.checkpoint_dtype = loaded.checkpoint_dtype
        self.tied_names = loaded.tied_names
        self.lora = loaded.lora  # train.lora: adapted module -> scale (empty: full fine-tuning)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.layouts = select_layout(self.model, cfg.layout if layout is None else layout)
        self.layout = self.layouts.name
        self.last_step_layout = ""  # the layout the last step ran (the prefix layout falls back per step)
        self.fold_prox = fold_prox
        # host-side seconds of the last step's phases: prox, forward, backward, optimizer (for benchmarks; on CUDA
        # they measure launches, not kernels, since the step never synchronises for them)
        self.last_timings: dict[str, float] = {}
        self.ref_model = None  # the frozen initial policy, for the KL penalty only
        if cfg.loss.kl_coef != 0.0:
            self.ref_model = load_sharded(model_path, self.device, self.compute_dtype, False, trainable=False).model
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with train.lora: the adapters alone
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,
        )  # CPU too, torch >= 2.4
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, self.cfg.optim))

    def bind_device(self) -> None:
        """Public methods run in the RPC worker thread; the CUDA current device is per thread."""
        bind_device(self.device)

    # ---- forwards ----

    def _equal_micro_batches(self, layout: Layout, shard: Shard, seqs: list[int]) -> list[list[int]]:
        """Micro-batches of the shard's sequences `seqs` in `layout`, the same count on every rank (FSDP
        collectives run per forward). A rank below the largest count repacks with that floor (spreading its
        tokens) and pads with empty micro-batches where it has too few sequences; if a repack overshoots, the
        ranks agree again on the new maximum. The count only grows, so this ends."""
        budget = self.cfg.micro_batch_tokens
        base = layout.pack(shard, seqs, budget)
        mbs = base
        while True:
            hi, neg_lo = all_reduce_floats([len(mbs), -len(mbs)], op=dist.ReduceOp.MAX)
            target = int(hi)
            if target == int(-neg_lo):
                return mbs
            if len(mbs) < target:
                real = layout.pack(shard, seqs, budget, min_micro_batches=target) if len(seqs) >= target else base
                mbs = real + [[] for _ in range(target - len(real))]

    @torch.no_grad()
    def _forward_all(self, model: nn.Module, step: _Step, *, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """No-grad logprobs (and entropy) of the whole shard, in micro-batches. [N], [N] | None."""
        shard = step.shard
        model.eval()
        logp_all = torch.zeros(len(shard.input_ids), dtype=torch.float32, device=self.device)
        ent_all = torch.zeros_like(logp_all) if entropy else None
        for mb in self._equal_micro_batches(step.layout, shard, list(range(shard.num_seqs))):
            logp, ent, index = step.layout.forward(model, shard, mb, temperature=self.temperature, entropy=entropy)
            if index.numel():  # an empty micro-batch ran a dummy sequence
                logp_all[index] = logp.float()
                if ent_all is not None and ent is not None:
                    ent_all[index] = ent.float()
        model.reshard()  # FSDP2 keeps the root unsharded after a forward; no backward follows to reshard it
        return logp_all, ent_all

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> Tensor:
        """The current weights' logprobs of every token of this rank's shard, as a train step computes its
        proximal logprobs (the step's layout, micro-batches, precision and temperature), without training. [N] fp32,
        0 at each sequence's first token. For numerics checks against the servers' behaviour logprobs
        (benchmarks/logprob_mismatch.py). Collective, like every public method."""
        self.bind_device()
        return self._forward_all(self.model, self._begin(batch), entropy=False)[0]

    # ---- the step ----

    def train_step(self, batch: TrainBatch) -> tuple[int, dict[str, float]]:
        """One decoupled-PPO train step on this rank's shard; returns (new version, stats reduced over ranks)."""
        self.bind_device()
        t_start = time.perf_counter()
        step = self._begin(batch)
        stats = StatSums(self.device)
        t0 = time.perf_counter()
        # 1. proximal logprobs with the weights before any update (and that policy's entropy for the stats),
        # the frozen reference's logprobs for the KL penalty
        lcfg = self.cfg.loss
        separate_prox = lcfg.prox_logp == "recompute" and not step.fold
        prox, ent = (
            self._forward_all(self.model, step, entropy=lcfg.entropy_coef == 0.0)
            if separate_prox
            else (step.shard.behav_logp, None)
        )  # behav, or folded (then never read)
        ref = self._forward_all(self.ref_model, step, entropy=False)[0] if self.ref_model is not None else None
        prox_s = time.perf_counter() - t0
        if ent is not None:
            stats.add("entropy_sum", (ent * step.shard.loss_mask).sum())
        # 2. advantages, 3. k minibatches with one optimizer step each
        adv_tok = self._token_advantages(step.shard, stats)
        result = self._optimize(step, prox, ref, adv_tok, stats, train_entropy=ent is None)
        self.scheduler.step()
        self.version += 1
        # 4. stats, reduced over ranks
        self._add_shard_stats(step.shard, batch.policy_version, stats)
        stats.add("step_seconds_max", time.perf_counter() - t_start)
        stats.add("prox_seconds_max", prox_s)
        self.last_timings = {"prox": prox_s, **result.timings}
        return self.version, summarize_step(
            stats.reduce(), result, lcfg, num_seqs=step.num_seqs, saved_tokens=step.saved
        )

    def _begin(self, batch: TrainBatch) -> _Step:
        """Decode and check this rank's shard, agree with the other ranks that every shard is good, and settle the
        step's layout and global counts."""
        error, shard = None, None
        try:
            shard = decode_shard(batch, self.vocab_size, self.device)
            if batch.policy_version != self.version:
                raise BatchError(
                    f"batch.policy_version={batch.policy_version} but the trainer is at version {self.version}"
                )
        except BatchError as e:
            error = e
        agree(error, BatchError, "its shard of the batch was rejected")
        assert shard is not None
        candidate, costs = self.layouts.plan(shard, self.cfg.micro_batch_tokens)
        resp_tokens, num_seqs, *costs = all_reduce_floats([float(shard.loss_mask.sum()), float(shard.num_seqs), *costs])
        if resp_tokens <= 0:
            raise BatchError("the batch has no trainable tokens (loss_mask is 0 everywhere on every rank)")
        if int(resp_tokens) != batch.global_response_tokens or int(num_seqs) != batch.global_num_seqs:
            raise BatchError(
                f"batch.global_response_tokens/global_num_seqs = {batch.global_response_tokens}/"
                f"{batch.global_num_seqs}, but the shards hold {int(resp_tokens)}/{int(num_seqs)}"
            )
        layout = self.layouts.for_step(candidate, costs)
        self.last_step_layout = layout.name
        fold = (
            self.cfg.loss.prox_logp == "recompute"
            and self.cfg.ppo_minibatches == 1
            and self.fold_prox
            and self.cfg.lora.dropout == 0.0  # adapter dropout: the training forward is not the prox policy's
        )
        saved = costs[0] if layout.name == "prefix" else 0.0
        return _Step(shard, layout, num_seqs, saved, fold, shard.seq_of_token())

    def _token_advantages(self, shard: Shard, stats: StatSums) -> Tensor:
        """Shaped rewards -> group baseline -> optional global batch norm, broadcast to the trained tokens. [N]

        The baseline weights (None: all 1.0) weigh each sequence in its group's statistics and in the batch
        moments, so a per_call agent episode counts once however many calls it made (train/advantages.py)."""
        acfg = self.cfg.advantage
        weights = shard.baseline_weights  # [B] | None
        shaped = shape_rewards(shard.rewards, acfg, shard.response_lens)  # [B]
        adv = group_advantages(shaped, shard.group_ids, acfg.estimator, weights=weights)  # [B]
        if acfg.batch_norm:
            moments = normalization_moments(adv, weights)  # [3] float64
            if self.world_size > 1:
                dist.all_reduce(moments)
            adv = batch_normalize_with(adv, *mean_std_from_moments(moments))
        stats.add("shaped_reward_sum", shaped.double().sum())
        stats.add("adv_abs_sum", adv.double().abs().sum())
        lens = torch.tensor(shard.seq_lens, dtype=torch.long, device=self.device)
        return torch.repeat_interleave(adv.float(), lens) * shard.loss_mask  # [N]

    def _optimize(
        self, step: _Step, prox: Tensor, ref: Tensor | None, adv_tok: Tensor, stats: StatSums, *, train_entropy: bool
    ) -> StepResult:
        """The k minibatches: micro-batch forwards and backwards, then clip and step (skipped on a non-finite
        norm, on every rank alike: they all see the same all-reduced norm)."""
        shard, cfg = step.shard, self.cfg
        self.model.train()
        minibatches = split_minibatches(shard.num_seqs, cfg.ppo_minibatches)
        per_seq = loss_normalizer(cfg.loss) == "seqs"
        normalizers = all_reduce_floats(
            [
                float(sum(float(shard.response_lens[i] > 0) if per_seq else float(shard.response_lens[i]) for i in mb))
                for mb in minibatches
            ]
        )
        # the optimizer's list, not model.parameters(): after a forward FSDP2 leaves the root's parameters
        # registered as unsharded tensors, which never receive the (sharded) gradients
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        result = StepResult(lr=float(self.optimizer.param_groups[0]["lr"]))
        timings = result.timings = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
        for mb_seqs, normalizer in zip(minibatches, normalizers):
            if normalizer <= 0:  # no trainable token in this minibatch on any rank: nothing to step on
                continue
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            micro_batches = self._equal_micro_batches(step.layout, shard, mb_seqs)
            for j, seqs in enumerate(micro_batches):
                t0 = time.perf_counter()
                loss = self._micro_batch_loss(step, seqs, prox, ref, adv_tok, normalizer, stats, train_entropy)
                t1 = time.perf_counter()
                if self.world_size == 1:  # nothing to reduce with: accumulate unsharded, "reduce" (copy) once
                    self.model.set_requires_gradient_sync(j == len(micro_batches) - 1)
                (loss * self.world_size).backward()
                loss_sum += loss.detach().double()
                timings["forward"] += t1 - t0
                timings["backward"] += time.perf_counter() - t1
            t0 = time.perf_counter()
            norm = float(clip_grad_norm(params, cfg.optim.grad_clip))
            result.grad_norms.append(norm)
            result.minibatches += 1
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                result.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            stats.add("loss_sum", loss_sum)
            timings["optimizer"] += time.perf_counter() - t0
        return result

    def _micro_batch_loss(
        self,
        step: _Step,
        seqs: list[int],
        prox: Tensor,
        ref: Tensor | None,
        adv_tok: Tensor,
        normalizer: float,
        stats: StatSums,
        train_entropy: bool,
    ) -> Tensor:
        shard = step.shard
        entropy_grad = self.cfg.loss.entropy_coef != 0.0
        logp, ent, index = step.layout.forward(
            self.model, shard, seqs, temperature=self.temperature, entropy=train_entropy, entropy_grad=entropy_grad
        )
        if not seqs:
            return logp.sum() * 0.0  # keeps this rank in the FSDP collectives, contributes nothing
        loss, lstats = actor_loss(
            logp,
            logp.detach() if step.fold else prox[index],
            shard.behav_logp[index],
            adv_tok[index],
            shard.loss_mask[index],
            self.cfg.loss,
            normalizer=normalizer,
            seq_ids=step.seq_of_tok[index],
            ref_logp=ref[index] if ref is not None else None,
            entropy=ent,
        )
        stats.add_all(lstats)
        return loss

    def _add_shard_stats(self, shard: Shard, policy_version: int, stats: StatSums) -> None:
        mask = shard.loss_mask
        stats.add("response_tokens", mask.sum())
        stats.add("tokens", float(len(shard.input_ids)))
        stats.add("reward_sum", shard.rewards.double().sum())
        stale = (policy_version - shard.versions).double() * mask  # [N]
        stats.add("staleness_sum", stale.sum())
        if len(stale):
            stats.add("staleness_max", stale.max())
        nonfinite = (~torch.isfinite(shard.behav_logp)).sum() + (~torch.isfinite(shard.rewards)).sum()
        stats.add("nonfinite_inputs", nonfinite)

    # ---- weights out, checkpoints, info ----

    def info(self) -> TrainerInfo:
        return TrainerInfo(
            rank=self.rank,
            world_size=self.world_size,
            version=self.version,
            device=str(self.device),
            num_params=self.num_params,
            gpu_uuid=self._gpu_uuid,
        )

    def weight_plan(self, bucket_bytes: int) -> list[WeightSpec]:
        """How `broadcast` buckets the weights: names, dtypes, shapes in send order (local, no collective)."""
        self.bind_device()
        self._no_full_broadcast()
        return plan_buckets(self.model, skip=self.tied_names, dtype=self.checkpoint_dtype, bucket_bytes=bucket_bytes)

    def _no_full_broadcast(self) -> None:
        if self.lora:
            raise ValueError(
                "train.lora broadcasts the adapters alone (prepare_delta_broadcast, train/lora_publish.py), never the "
                "full weights: every server must take adapters (the embedded server)"
            )

    def _weight_broadcaster(self):
        if self._broadcaster is None:
            self._broadcaster = WeightBroadcaster(timeout_s=self._broadcast_timeout_s)
        return self._broadcaster

    def open_broadcast(self, group_name: str, world_size: int, host: str, port: int) -> int:
        """Rank 0 hosts the weight-update group's store on `port` (0: a free one); returns the port (0 elsewhere)."""
        self.bind_device()
        return self._weight_broadcaster().open_store(group_name, world_size, host, port)

    def init_broadcast(self, req: InitBroadcastRequest) -> None:
        """Rank 0 joins the weight-update group with the servers (see train/broadcast.py)."""
        self.bind_device()
        self._weight_broadcaster().init_group(req, self.device)

    def broadcast(self, req: BroadcastRequest) -> BroadcastResult:
        """Send the current weights through the group (collective among trainers; rank 0 sends)."""
        self.bind_device()
        self._no_full_broadcast()
        return self._weight_broadcaster().broadcast(
            self.model,
            group_name=req.group_name,
            skip=self.tied_names,
            dtype=self.checkpoint_dtype,
            bucket_bytes=req.bucket_bytes,
        )

    def close_broadcast(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()

    def publish(self, root: str, version: int, keep: int = 2) -> PublishResult:
        """Write the full model as an HF directory `root/v<version>` (collective; rank 0 writes); with train.lora
        the adapters merged into the base (W0 + scale * B @ A, train/lora.py), so transformers loads it as is."""
        self.bind_device()
        merged = None
        if self.lora:  # the adapters merged into the base weights: an ordinary HF checkpoint
            from areal_async.train.lora import merged_tensors
            from areal_async.train.publish import iter_full_tensors

            gathered = iter_full_tensors(self.model, skip=self.tied_names, dtype=torch.float32, to_cpu=True)
            merged = merged_tensors(gathered, self.lora, self.checkpoint_dtype)
        return publish_hf(
            self.model,
            source_dir=self.model_path,
            root=root,
            version=version,
            keep=keep,
            dtype=self.checkpoint_dtype,
            skip=self.tied_names,
            tensors=merged,
        )

    def save_checkpoint(self, path: str) -> float:
        self.bind_device()
        t0 = time.perf_counter()
        checkpoint.save_checkpoint(
            path, self.model, self.optimizer, trainer_state=self._trainer_state(), rng_state=rng_state(self.device)
        )
        return time.perf_counter() - t0

    def load_checkpoint(self, path: str) -> float:
        self.bind_device()
        t0 = time.perf_counter()
        state, rng = checkpoint.load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if rng is not None:
            set_rng_state(rng, self.device)
        return time.perf_counter() - t0

    def _trainer_state(self) -> dict:
        return {
            "version": self.version,
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.world_size,
            "model_path": os.path.abspath(self.model_path),
        }
