"""Train in your own environment: reset/step and a reward of your own, plugged into the full async RL run.

The environment below grades an arithmetic answer with its own reward function, answers a wrong one with a hint
("too high" / "too low") and lets the model try again, three times at most. An episode (every turn) is one
trajectory, trained only on the model's tokens; its reward is the sum of the step rewards (here: the reward of the
correct attempt divided by the number of attempts it took).

    python examples/custom_env.py                     # any `python -m areal_async.run` override works: steps=20
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from areal_async import embed
from areal_async.tasks.arith import extract_answer

MULTITURN = str(Path(__file__).resolve().parent.parent / "configs" / "multiturn.yaml")

Reward = Callable[[str, str], float]


def exact_answer(completion: str, answer: str) -> float:
    """This environment's reward: 1.0 when the number after the last `####` is the reference answer, else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and float(got) == float(answer) else 0.0


class HintEnv:
    """Implements `embed.Env`. One instance per episode (the factory below makes a fresh one)."""

    def __init__(self, reward: Reward = exact_answer, max_tries: int = 3) -> None:
        self.reward = reward
        self.max_tries = max_tries
        self.sample: embed.Sample | None = None
        self.tries = 0

    async def reset(self, sample: embed.Sample) -> embed.Observation:
        self.sample, self.tries = sample, 0
        return sample.prompt  # the first observation: plain text (or a list of chat messages)

    async def step(self, action: str) -> tuple[embed.Observation, float, bool]:
        """(feedback, reward of this step, done): `action` is the model's decoded turn."""
        assert self.sample is not None, "reset() first"
        self.tries += 1
        r = self.reward(action, self.sample.answer)
        if r >= 1.0:
            return "", r / self.tries, True
        got, want = extract_answer(action), float(self.sample.answer)
        hint = "no answer" if got is None else ("too high" if float(got) > want else "too low")
        return f"Wrong ({hint}). Try again.\n{self.sample.prompt}", 0.0, self.tries >= self.max_tries


def workflow(reward: Reward = exact_answer) -> embed.WorkflowFactory:
    """The run's workflow: `rollout.group_size` HintEnv episodes per prompt, three model turns at most."""
    return embed.env_workflow(lambda sample: HintEnv(reward), max_turns=3)


make_workflow = workflow()  # by name, with examples/ on PYTHONPATH: rollout.workflow=custom_env:make_workflow


def main(
    overrides: Sequence[str] = (),
    *,
    reward: Reward = exact_answer,
    on_group: embed.GroupCallback | None = None,
    log_to_console: bool = False,
) -> embed.RunResult:
    """Train with configs/multiturn.yaml (the tiny model on the arithmetic task) and HintEnv; `overrides` as on
    the command line."""
    return embed.train(
        ["run_dir=runs/custom_env", *overrides],
        config=MULTITURN,
        workflow=workflow(reward),
        on_group=on_group,
        log_to_console=log_to_console,
    )


if __name__ == "__main__":
    result = main(sys.argv[1:], log_to_console=True)
    print(f"trained {result.steps} steps; final model: {result.final_model}")
