"""Train an agent written against the official `openai` SDK, unchanged, through areal_async's OpenAI proxy.

The agent answers an arithmetic problem with /v1/completions; if the answer is wrong it says so in the prompt and
asks again (two calls at most). The proxy records each call's exact tokens, logprobs and versions; the agent returns
the episode reward, and the episode becomes trajectories (one per call, or one concatenated trajectory when the
calls extend each other token for token: see areal_async/agent/episode.py).

    python examples/openai_agent.py                    # any `python -m areal_async.run` override works
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lets the run import this file as `openai_agent`

from openai import AsyncOpenAI  # noqa: E402

from areal_async.agent import AgentWorkflow, OpenAIProxy, PolicySampling  # noqa: E402


def make_workflow(cfg, tokenizer, score):  # rollout.workflow = "openai_agent:make_workflow"
    r = cfg.rollout

    async def agent(ctx) -> float:
        oai = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        prompt = ctx.sample.prompt
        for _attempt in range(2):
            out = await oai.completions.create(model="policy", prompt=prompt, max_tokens=r.max_new_tokens,
                                               temperature=r.temperature)
            text = out.choices[0].text
            reward, _why = await score(text, ctx.sample.answer, ctx.sample.prompt)
            if reward > 0:
                return reward * (1.0 if _attempt == 0 else 0.5)
            prompt = f"{prompt}{text}\nWrong, try again.\n{ctx.sample.prompt}"
        return 0.0

    # the proxy forwards through the controller's InferenceClient (AgentWorkflow hands it over per episode); its
    # calls are sampled at the run's rollout settings, at which the trainer computes logprobs, whatever the agent asks
    policy = PolicySampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    return AgentWorkflow(OpenAIProxy(None, tokenizer, policy=policy), agent, r.group_size)


if __name__ == "__main__":
    from areal_async.run import main

    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "multiturn.yaml")
    sys.exit(main(["--config", config, "run_dir=runs/openai_agent", "rollout.workflow=openai_agent:make_workflow",
                   *sys.argv[1:]]))
