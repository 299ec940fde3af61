"""Agents: an OpenAI-compatible endpoint over the policy that records every call as trainable tokens, the episode
bookkeeping (rewards, discounting, export as trajectories), and the workflow that trains SDK agents through it.
Controller side: no torch."""

from areal_async.agent.episode import CallRecord, Episode, ExportMode
from areal_async.agent.openai_proxy import OpenAIProxy, PolicySampling, parse_tool_calls
from areal_async.agent.workflow import AgentContext, AgentWorkflow

__all__ = [
    "AgentContext",
    "AgentWorkflow",
    "CallRecord",
    "Episode",
    "ExportMode",
    "OpenAIProxy",
    "PolicySampling",
    "parse_tool_calls",
]
