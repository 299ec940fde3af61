"""Plain data shared by the controller, the inference client and the trainers.

Leaf module: imports nothing of the package and never torch, so a controller can run on a machine without it.
Arrays travel as `Array` (dtype, shape, raw bytes) so that msgpack carries them as one binary blob; decoding with
msgspec into a `memoryview` field references the received frame instead of copying it.

Token alignment convention, used everywhere a trajectory is stored or trained on: for a sequence `input_ids` of
length T, `logprobs[t]` is the log-probability of `input_ids[t]` given `input_ids[:t]` under the behaviour policy,
`versions[t]` is the policy version that sampled token t (-1 for prompt or environment tokens), and `loss_mask[t]`
is 1 exactly on the tokens the model generated and should be trained on. Position 0 is never trained.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

FinishType = Literal["stop", "length", "abort"]


class Array(msgspec.Struct, frozen=True):
    """A dense n-d array as raw little-endian bytes; `np.frombuffer` views it without a copy."""

    dtype: str  # numpy dtype name: "int32", "float32", "uint8", "bfloat16" is not used on the wire
    shape: list[int]
    data: memoryview  # bytes and bytearray values encode too; decoding gives a view into the frame

    @classmethod
    def from_numpy(cls, a: np.ndarray) -> Array:
        a = np.ascontiguousarray(a)
        return cls(dtype=a.dtype.name, shape=list(a.shape), data=memoryview(a).cast("B"))

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's sampling_params subset that RL uses. Field names and defaults are SGLang's."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True

    def to_sglang(self) -> dict:
        """The dict sent as `sampling_params`; SGLang 0.5.x accepts exactly these keys."""
        return msgspec.structs.asdict(self)


class GenerationResult(msgspec.Struct, kw_only=True):
    """One finished completion as the client returns it, after any number of interruptions."""

    input_ids: list[int]  # the prompt as first submitted
    output_ids: list[int]  # every generated token, across resumptions, EOS/stop token included
    output_logprobs: list[float]  # behaviour logprob of each output token, [len(output_ids)]
    output_versions: list[int]  # policy version that produced each output token, [len(output_ids)]
    finish_reason: FinishType
    text: str = ""
    matched_stop: int | str | None = None
    num_interruptions: int = 0  # how many times the request came back aborted and was resubmitted
    latency_s: float = 0.0  # wall time from first submit to final answer
    server: str = ""  # URL of the server that produced the last segment


class Sample(msgspec.Struct, kw_only=True):
    """One dataset item: a prompt with its reference answer. `messages` is set for chat-style prompts."""

    id: int
    prompt: str
    answer: str
    messages: list[dict] | None = None
    meta: dict[str, float | int | str | bool] = {}


class Trajectory(msgspec.Struct, kw_only=True):
    """One sample ready for training (see the module docstring for the alignment convention)."""

    input_ids: list[int]  # [T] prompt + completion (+ environment turns for multi-turn)
    loss_mask: list[int]  # [T] 1 on generated tokens
    logprobs: list[float]  # [T] behaviour logprobs, 0.0 where loss_mask is 0
    versions: list[int]  # [T] producing version, -1 where loss_mask is 0
    reward: float
    group_id: int = -1  # samples of one prompt group share it (the rollout manager sets it); advantages are per group
    prompt_len: int = 0  # tokens before the first generated one (for overlong penalties and stats)
    # free-form; one key is read by the trainer: info["episode_weight"] (EPISODE_WEIGHT_KEY), this sample's weight
    # in its group's baseline (finite, > 0; 1.0 when absent), set by the agent's per_call export
    info: dict[str, float | int | str | bool] = {}

    @property
    def response_len(self) -> int:
        return sum(self.loss_mask)


EPISODE_WEIGHT_KEY = "episode_weight"


def baseline_weight(traj: Trajectory) -> float:
    """The weight of `traj` in its group's baseline: `info["episode_weight"]`, 1.0 when absent (unchecked; the
    train client's `validate_trajectories` checks it before anything is sent)."""
    return float(traj.info.get(EPISODE_WEIGHT_KEY, 1.0))


class TrainBatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A shard of trajectories for one trainer rank, packed end to end (no padding).

    Groups are never split across ranks, so advantages can be computed locally per group. `baseline_weights` is
    sent only when some sequence weighs other than 1.0 (omit_defaults: a batch without it encodes exactly as it
    did before the field existed).
    """

    input_ids: Array  # int32 [N] all sequences concatenated
    seq_lens: Array  # int32 [B] length of each sequence; sum == N
    loss_mask: Array  # uint8 [N]
    logprobs: Array  # float32 [N] behaviour logprobs
    versions: Array  # int32 [N]
    rewards: Array  # float32 [B]
    group_ids: Array  # int64 [B]
    prompt_lens: Array  # int32 [B]
    policy_version: int  # the trainer's version before this step (v); tokens are at least v - eta
    global_response_tokens: int  # sum of loss_mask over all ranks' shards: the loss normaliser
    global_num_seqs: int  # number of sequences over all ranks
    # float32 [B] weight of each sequence in its group's baseline and the batch normalisation (train/advantages.py);
    # None: every sequence weighs 1.0
    baseline_weights: Array | None = None


def pack_trajectories(
    trajs: list[Trajectory], policy_version: int, global_response_tokens: int, global_num_seqs: int
) -> TrainBatch:
    """Concatenate trajectories into one `TrainBatch` of flat arrays; `baseline_weights` only when some
    trajectory's `baseline_weight` (as float32) is not 1.0."""
    seq_lens = np.array([len(t.input_ids) for t in trajs], dtype=np.int32)
    weights = np.array([baseline_weight(t) for t in trajs], dtype=np.float32)

    def cat(field: str, dtype: str) -> Array:
        flat = np.fromiter((x for t in trajs for x in getattr(t, field)), dtype=dtype, count=int(seq_lens.sum()))
        return Array.from_numpy(flat)

    return TrainBatch(
        input_ids=cat("input_ids", "int32"),
        seq_lens=Array.from_numpy(seq_lens),
        loss_mask=cat("loss_mask", "uint8"),
        logprobs=cat("logprobs", "float32"),
        versions=cat("versions", "int32"),
        rewards=Array.from_numpy(np.array([t.reward for t in trajs], dtype=np.float32)),
        group_ids=Array.from_numpy(np.array([t.group_id for t in trajs], dtype=np.int64)),
        prompt_lens=Array.from_numpy(np.array([t.prompt_len for t in trajs], dtype=np.int32)),
        policy_version=policy_version,
        global_response_tokens=global_response_tokens,
        global_num_seqs=global_num_seqs,
        baseline_weights=Array.from_numpy(weights) if bool((weights != 1.0).any()) else None,
    )


# ---- controller <-> trainer RPC messages -------------------------------------------------------------------------


class TrainStepRequest(msgspec.Struct, kw_only=True):
    batch: TrainBatch


class TrainStepResult(msgspec.Struct, kw_only=True):
    version: int  # the trainer's version after the step (v + 1)
    stats: dict[str, float]


class PublishRequest(msgspec.Struct, kw_only=True):
    """Write the full model as an HF checkpoint directory `<root>/v<version>` (atomically) and prune old ones."""

    version: int
    root: str
    keep: int = 2


class PublishResult(msgspec.Struct, kw_only=True):
    path: str
    seconds: float
    num_bytes: int


class CheckpointRequest(msgspec.Struct, kw_only=True):
    path: str  # directory for torch.distributed.checkpoint (model, optimizer, scheduler, step, RNG)


class CheckpointResult(msgspec.Struct, kw_only=True):
    path: str
    version: int
    seconds: float


class InitBroadcastRequest(msgspec.Struct, kw_only=True):
    """Trainer side of SGLang's /init_weights_update_group: rank 0 of the trainer is rank 0 of the group."""

    master_address: str
    master_port: int
    world_size: int  # 1 + total inference ranks
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class BroadcastRequest(msgspec.Struct, kw_only=True):
    """Broadcast every parameter, bucketed, while servers wait in /update_weights_from_distributed."""

    version: int
    group_name: str = "weight_update_group"
    bucket_bytes: int = 256 << 20


class WeightSpec(msgspec.Struct, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class BroadcastResult(msgspec.Struct, kw_only=True):
    buckets: list[WeightSpec]  # the order in which buckets are broadcast
    seconds: float
    num_bytes: int
    held_peak_bytes: int = 0  # most bytes of gathered full tensors trainer rank 0 held at once (about one bucket)
    memory_peak_bytes: int = 0  # rank 0's peak memory above its level at the start (CUDA allocator, or host RSS)


class Empty(msgspec.Struct):
    pass


class TrainerInfo(msgspec.Struct, kw_only=True):
    rank: int
    world_size: int
    version: int
    device: str
    num_params: int
    host: str = ""  # an address of this rank's host the inference servers can reach (the broadcast rendezvous)
    gpu_uuid: str = ""  # the physical GPU of this rank ("" on CPU): a server on the same GPU cannot join by nccl
