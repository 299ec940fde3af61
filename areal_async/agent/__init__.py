"""Agents: an OpenAI-compatible endpoint over the policy that records every call as trainable tokens, and the
episode bookkeeping (rewards, discounting, export as trajectories). Controller side: no torch."""

from areal_async.agent.episode import CallRecord, Episode, ExportMode
from areal_async.agent.openai_proxy import AgentContext, AgentWorkflow, OpenAIProxy, parse_tool_calls

__all__ = ["AgentContext", "AgentWorkflow", "CallRecord", "Episode", "ExportMode", "OpenAIProxy",
           "parse_tool_calls"]
