"""Workflows shipped with areal_async, and `build_workflow` that picks one from the config."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from areal_async.config import ConfigError
from areal_async.rollout.workflows.rlvr import RLVRWorkflow
from areal_async.types import SamplingParams

if TYPE_CHECKING:
    from areal_async.config import RunConfig
    from areal_async.rollout.workflow_api import ScoreFn, Workflow
    from areal_async.tokenizer import Tokenizer


def build_workflow(cfg: RunConfig, tokenizer: Tokenizer, score: ScoreFn) -> Workflow:
    """rollout.workflow: "rlvr", "multi_turn", or "module:callable" called as callable(cfg, tokenizer, score).
    Raises ConfigError naming rollout.workflow when the name does not resolve or the factory fails."""

    r = cfg.rollout
    name = r.workflow
    if name == "rlvr":
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )
        return RLVRWorkflow(tokenizer, score, sampling, r.group_size, use_chat_template=cfg.data.apply_chat_template)
    if name == "multi_turn":
        name = "areal_async.rollout.workflows.multi_turn:make_workflow"
    if ":" not in name:
        raise ConfigError(f"rollout.workflow: unknown workflow {name!r} (rlvr, multi_turn or module:callable)")
    module, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rollout.workflow: cannot import {name!r}: {e}") from None
    try:
        workflow = factory(cfg, tokenizer, score)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"rollout.workflow: {name} refused the config: {type(e).__name__}: {e}") from e
    if not hasattr(workflow, "run"):
        raise ConfigError(
            f"rollout.workflow: {name} returned {type(workflow).__name__}, not a workflow "
            "(an object with async run(client, sample))"
        )
    return workflow
