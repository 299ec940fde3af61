"""The trainer's error kinds, as types that keep their meaning across the RPC channel. Torch-free.

A trainer rank raises one of these; areal_async/net/rpc.py sends its qualified type name (`remote_type`) with the
message, and the controller (train/client.py) turns that name back into the type with `kind_of`, so it can ask
"was the data at fault?" or "did this rank only hear about another rank's failure?" with `issubclass` instead of
matching message text.

Every collective method agrees on failures before its next collective (see train/dist.py's `agree`): the rank that
found the problem raises the specific error, the others raise its `Peer*` twin. Both are subclasses of the same
kind, so `bad_input` holds on every rank's answer; `PeerFailure` marks the ones that carry no first-hand detail.
"""

from __future__ import annotations

__all__ = [
    "TrainerFailure",
    "PeerFailure",
    "BatchError",
    "PeerBatchError",
    "CheckpointError",
    "PeerCheckpointError",
    "PublishError",
    "PeerPublishError",
    "BroadcastError",
    "PeerBroadcastError",
    "kind_of",
    "peer_error",
]


class TrainerFailure(Exception):
    """Base of the errors a trainer rank raises on purpose (anything else is a bug or an environment failure)."""


class PeerFailure(TrainerFailure):
    """Raised on a rank that is fine itself but must fail because another rank did (its error has the details)."""


class BatchError(TrainerFailure, ValueError):
    """A train batch that cannot be trained on; nothing was trained, on any rank. The caller's data is at fault."""


class PeerBatchError(BatchError, PeerFailure):
    """Another trainer rank rejected its shard of the batch."""


class CheckpointError(TrainerFailure, ValueError):
    """A checkpoint directory that cannot be restored; the message says why."""


class PeerCheckpointError(CheckpointError, PeerFailure):
    """Another trainer rank could not read the checkpoint."""


class PublishError(TrainerFailure, RuntimeError):
    """Writing the weights as an HF directory failed (disk full, permissions); no version was published."""


class PeerPublishError(PublishError, PeerFailure):
    """Publishing failed on trainer rank 0 (which writes)."""


class BroadcastError(TrainerFailure, RuntimeError):
    """The weight broadcast cannot run (no group of that name, a bad group request)."""


class PeerBroadcastError(BroadcastError, PeerFailure):
    """The weight broadcast failed on another trainer rank."""


_PEERS: dict[type[TrainerFailure], type[TrainerFailure]] = {
    BatchError: PeerBatchError,
    CheckpointError: PeerCheckpointError,
    PublishError: PeerPublishError,
    BroadcastError: PeerBroadcastError,
}
_KINDS: dict[str, type[TrainerFailure]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls for cls in (TrainerFailure, PeerFailure, *_PEERS, *_PEERS.values())
}


def peer_error(kind: type[TrainerFailure]) -> type[TrainerFailure]:
    """The `Peer*` twin of an error kind (what the ranks that did not find the problem raise)."""
    for base in kind.__mro__:
        if base in _PEERS:
            return _PEERS[base]
    return PeerFailure


def kind_of(remote_type: str) -> type[TrainerFailure] | None:
    """The error type behind an RPC error's `remote_type` (net/rpc.py sends `module.QualName`), or None for anything
    that is not one of ours (an exception the trainer did not raise on purpose)."""
    return _KINDS.get(remote_type)
