"""A train batch as this rank's tensors: every wire array checked, then moved to the device once.

The checks run before any collective, so a malformed shard raises `BatchError` here and the engine can agree on
it with the other ranks (train/dist.py `agree`) instead of one rank failing inside an FSDP all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from areal_async.train.errors import BatchError
from areal_async.types import Array, TrainBatch

__all__ = ["Shard", "decode_shard"]


@dataclass
class Shard:
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
    baseline_weights: Tensor | None = None  # [B] float32, finite and > 0; None: every sequence weighs 1.0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def token_index(self, seqs: list[int]) -> Tensor:
        """Flat positions of the tokens of sequences `seqs`, in that order. [n] int64 on the shard's device."""
        device = self.input_ids.device
        if not seqs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(self.starts[i], self.starts[i] + self.seq_lens[i], device=device) for i in seqs])

    def seq_of_token(self) -> Tensor:
        """Each token's sequence index. [N] int64."""
        lens = torch.tensor(self.seq_lens, dtype=torch.long, device=self.input_ids.device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens)


_FIELDS = {  # name -> (wire dtype, length: "N" tokens or "B" sequences)
    "input_ids": ("int32", "N"),
    "loss_mask": ("uint8", "N"),
    "logprobs": ("float32", "N"),
    "versions": ("int32", "N"),
    "seq_lens": ("int32", "B"),
    "rewards": ("float32", "B"),
    "group_ids": ("int64", "B"),
    "prompt_lens": ("int32", "B"),
}


def decode_shard(batch: TrainBatch, vocab_size: int, device: torch.device) -> Shard:
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
            raise BatchError(
                f"batch.{name}: length {arrays[name].shape[0]} != {want} "
                f"({'sum of seq_lens' if kind == 'N' else 'number of sequences'})"
            )
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
    weights = _baseline_weights(batch.baseline_weights, n_seq)
    return Shard(
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
        baseline_weights=None if weights is None else torch.from_numpy(weights.copy()).to(device),
    )


def _baseline_weights(a: Array | None, n_seq: int) -> np.ndarray | None:
    """The optional per-sequence baseline weights, checked like the other arrays: float32 [B], finite, > 0 (a
    zero weight would leave a group without a baseline, a negative one flip it)."""
    if a is None:
        return None
    if a.dtype != "float32":
        raise BatchError(f"batch.baseline_weights: dtype must be float32, got {a.dtype!r}")
    if len(a.shape) != 1:
        raise BatchError(f"batch.baseline_weights: must be 1-d, got shape {a.shape}")
    try:
        w = a.to_numpy()
    except ValueError as e:
        raise BatchError(f"batch.baseline_weights: {e}") from None
    if w.shape[0] != n_seq:
        raise BatchError(f"batch.baseline_weights: length {w.shape[0]} != {n_seq} (number of sequences)")
    bad = ~(np.isfinite(w) & (w > 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BatchError(f"batch.baseline_weights: every weight must be finite and > 0, sequence {i} has {w[i]}")
    return w
