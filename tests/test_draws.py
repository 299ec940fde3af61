"""The engine's draws, fixed before each forward pass (server/sampling.py `plan_draws`): a seeded request gets the
same tokens and logprobs whether its steps ran whole in one C call (draws made there), op by op (draws made after),
or were interrupted and redone (the redo reuses the draws it had made)."""

from __future__ import annotations

import pytest

from areal_async.protocol.engine_api import EngineRequest, EngineSampling
from areal_async.server.engine import AsyncEngine
from areal_async.server.model import StepInterrupted
from areal_async.testing.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def lively(tmp_path_factory) -> str:
    """Large random weights: a tempered draw lands on different tokens for different uniforms."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lively") / "qwen2"), "qwen2", seed=5, init_std=0.3)


async def _generate(engine: AsyncEngine, rid: str, **sampling) -> tuple[list[int], list[float]]:
    req = EngineRequest(
        rid=rid,
        input_ids=[3, 14, 15, 9, 26],
        sampling=EngineSampling(max_new_tokens=120, ignore_eos=True, **sampling),
        return_logprob=True,
        stream=False,
    )
    ids, lps = [], []
    async for c in engine.generate(req):
        ids += c.new_ids
        lps += c.new_logprobs
    return ids, lps


@pytest.mark.parametrize("whole_step", [True, False])
async def test_seeded_tokens_ignore_interrupted_steps(lively, whole_step):
    engine = AsyncEngine(lively, device="cpu")
    await engine.start()
    try:
        model = engine._sched.model
        if not whole_step:
            model._fused = None  # op by op: the draws are made after the forward
        want = [await _generate(engine, f"ref{t}", temperature=t, seed=11) for t in (1.0, 0.7)]
        real, calls = model.forward, [0]

        def flaky(*args, **kw):
            calls[0] += 1
            if calls[0] % 3 == 0:  # every third step stops before its first layer, as an urgent command does
                raise StepInterrupted
            return real(*args, **kw)

        model.forward = flaky
        got = [await _generate(engine, f"int{t}", temperature=t, seed=11) for t in (1.0, 0.7)]
        assert calls[0] > 100
        assert got == want
        assert len(set(want[0][0])) > 10  # tempered draws that wander: a redrawn uniform would show
    finally:
        await engine.shutdown()
