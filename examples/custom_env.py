"""Train in your own environment: reset/step, plugged into the full async RL run.

The environment below answers a wrong arithmetic answer with a hint ("too high" / "too low") and lets the model
try again, three times at most; an episode (every turn) is one trajectory, trained only on the model's tokens.

    python examples/custom_env.py                 # any `python -m areal_async.run` override works: total_steps=20
"""

import os
import sys

from areal_async.rollout.workflows.multi_turn import MultiTurnWorkflow
from areal_async.tasks.arith import extract_answer
from areal_async.types import SamplingParams


class HintEnv:
    async def reset(self, sample):
        self.sample, self.tries = sample, 0
        return sample.prompt  # the first observation: plain text (or chat messages)

    async def step(self, action):  # -> (feedback, reward, done)
        self.tries += 1
        got, want = extract_answer(action), float(self.sample.answer)
        if got is not None and float(got) == want:
            return "", 1.0 / self.tries, True
        hint = "no answer" if got is None else ("too high" if float(got) > want else "too low")
        return f"Wrong ({hint}). Try again.\n{self.sample.prompt}", 0.0, self.tries >= 3


def make_workflow(cfg, tokenizer, score):  # called by the run once the tokenizer exists
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature)
    return MultiTurnWorkflow(tokenizer, lambda sample: HintEnv(), sampling, r.group_size, max_turns=3)


if __name__ == "__main__":
    from areal_async.run import main

    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "multiturn.yaml")
    sys.exit(main(["--config", config, "run_dir=runs/custom_env", *sys.argv[1:]], workflow=make_workflow))
