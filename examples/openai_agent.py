"""Train an agent written against the official `openai` SDK, with tool calls, through areal_async's OpenAI proxy.

The agent is ordinary SDK code: it offers the model a `calculator` tool through chat completions, runs every tool
call the model makes, feeds the result back as a `tool` message and asks again, until the model answers without a
tool call (three rounds at most). The answer is graded by the reward below. The proxy records each call's exact
tokens, logprobs and policy versions; an agent loop like this one extends its own conversation, so the proxy keeps
the episode token-exact and it trains as one trajectory (the tool results and template text are context, loss mask
0).

    python examples/openai_agent.py                    # any `python -m areal_async.run` override works

With the shipped tiny model (`model.path=tiny`, a base model that never saw a tool) the model answers without
calling the tool; a model that emits `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5's
format; the proxy turns those blocks into OpenAI `tool_calls`) calls it. tests/test_embedding.py trains a model
taught to call it.
"""

from __future__ import annotations

import ast
import json
import operator
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from areal_async import embed
from areal_async.tasks.arith import extract_answer

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression (+, -, *, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TOOL_ROUNDS = 3

_OPS: dict[type, Callable[[int, int], int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """The tool: integer arithmetic only, evaluated on the syntax tree (never `eval`: the model writes the input)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not integer arithmetic")

    try:
        return str(ev(ast.parse(str(expression), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error: not an integer arithmetic expression"


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator}


def exact_answer(completion: str, answer: str) -> float:
    """The reward: 1.0 when the number after the last `####` is the reference answer, else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and float(got) == float(answer) else 0.0


def run_tool(tools: Mapping[str, Callable[..., str]], name: str, arguments: str) -> str:
    """One tool call as the model wrote it; a bad call gets an error message back, as agent frameworks do."""
    try:
        args = json.loads(arguments or "{}")
        return str(tools[name](**args)) if isinstance(args, dict) else "error: arguments must be an object"
    except KeyError:
        return f"error: no tool {name!r}"
    except (ValueError, TypeError) as e:
        return f"error: {e}"


def make_agent(
    reward: Callable[[str, str], float] = exact_answer, tools: Mapping[str, Callable[..., str]] = TOOLS
) -> embed.AgentFn:
    """The agent: plain `openai` SDK code; only the client comes from the episode (`ctx.openai()`)."""
    specs = [CALCULATOR_TOOL] if "calculator" in tools else []

    async def agent(ctx: embed.AgentContext) -> float:
        oai = ctx.openai()  # AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": ctx.sample.prompt}]
        for _round in range(MAX_TOOL_ROUNDS + 1):
            out = await oai.chat.completions.create(model="policy", messages=messages, tools=specs)
            msg = out.choices[0].message
            if not msg.tool_calls or _round == MAX_TOOL_ROUNDS:
                return reward(msg.content or "", ctx.sample.answer)
            messages.append(msg.model_dump(exclude_none=True))  # the assistant turn exactly as returned
            for call in msg.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": run_tool(tools, call.function.name, call.function.arguments),
                    }
                )
        return 0.0

    return agent


# by name, with examples/ on PYTHONPATH: rollout.workflow=openai_agent:make_workflow
make_workflow = embed.agent_workflow(make_agent())


def main(
    overrides: Sequence[str] = (),
    *,
    agent: embed.AgentFn | None = None,
    on_group: embed.GroupCallback | None = None,
    log_to_console: bool = False,
) -> embed.RunResult:
    """Train the agent with the default config (the tiny model on the arithmetic task); `overrides` as on the
    command line."""
    return embed.train(
        ["run_dir=runs/openai_agent", *overrides],
        workflow=embed.agent_workflow(agent or make_agent()),
        on_group=on_group,
        log_to_console=log_to_console,
    )


if __name__ == "__main__":
    result = main(sys.argv[1:], log_to_console=True)
    print(f"trained {result.steps} steps; final model: {result.final_model}")
