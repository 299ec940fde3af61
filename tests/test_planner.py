"""The capacity planner: the real controller in virtual time against simulated servers and trainers."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_async.planner.clock import SimulationStalled, run_virtual
from areal_async.planner.lengths import LengthModel
from areal_async.planner.server_model import ServerCosts
from areal_async.planner.simulate import Setting, simulate
from areal_async.planner.trainer_model import TrainerCosts


def test_virtual_clock_jumps_and_orders_timers():
    async def main() -> tuple[float, list[float], float]:
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        seen: list[float] = []

        async def wait(d: float) -> None:
            await asyncio.sleep(d)
            seen.append(loop.time())

        await asyncio.gather(*(wait(d) for d in (30.0, 10.0, 20.0)))
        await asyncio.sleep(3600)
        return loop.time(), seen, time.perf_counter() - t

    now, seen, real = run_virtual(main())
    assert now == pytest.approx(3630.0)
    assert seen == pytest.approx([10.0, 20.0, 30.0])
    assert real < 1.0


def test_virtual_clock_reports_a_stall():
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    with pytest.raises(SimulationStalled):
        run_virtual(main())


def test_decode_time_has_the_closed_form_of_growing_kv():
    c = ServerCosts(step_overhead_s=0.002, weights_s=0.003, kv_s=1e-7, seq_s=1e-5, attn_s=1e-9)
    n, k, steps = 64, 50_000.0, 400
    explicit = sum(c.step_time(n, k + n * i) for i in range(steps))
    # continuous KV growth: within half a step's growth of the step-by-step sum
    assert c.time_for_steps(n, k, steps) == pytest.approx(explicit, rel=2e-3)
    assert c.steps_in(n, k, c.time_for_steps(n, k, steps)) == pytest.approx(steps, rel=1e-9)


def _analytic_setting(steps: int = 10) -> Setting:
    # one server whose decode step costs 10 ms whatever the batch, answers of exactly 100 tokens, a trainer taking
    # 10 ms per token: generation of a batch 1.0 s, a train step 1.0 s, free weight syncs
    return Setting(
        server=ServerCosts(step_overhead_s=0.01, weights_s=0.0, kv_s=0.0, prefill_token_s=0.0, load_s=0.0),
        trainer=TrainerCosts(token_s=0.01),
        servers=1,
        lengths=LengthModel(median=100, sigma=0.0, prompt_tokens=0),
        batch_size=1,
        group_size=1,
        steps=steps,
    )


def test_virtual_time_matches_the_analytic_schedule():
    s = _analytic_setting()
    sync = simulate(s, "sync")
    assert sync.wall_s == pytest.approx(20.0)  # generate 1 s, train 1 s, ten times
    assert sync.staleness_hist == {0: 1000}
    a1 = simulate(s, "async", 1)
    assert a1.wall_s == pytest.approx(11.0)  # the first batch, then one overlapped step per second
    assert a1.staleness_max == 1 and a1.staleness_hist == {0: 100, 1: 900}


def _long_tail(steps: int = 12, mode: str = "abort") -> Setting:
    return Setting(
        server=ServerCosts(step_overhead_s=0.01, weights_s=0.002, kv_s=1e-7, load_s=0.5, pause_s=0.05),
        trainer=TrainerCosts(token_s=2e-5, overhead_s=0.2, publish_s=0.3),
        servers=4,
        lengths=LengthModel(median=400, sigma=1.2, max_new_tokens=6000, prompt_tokens=64),
        batch_size=16,
        group_size=4,
        steps=steps,
        interrupt_mode=mode,
    )


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_async_beats_sync_on_long_tails_and_staleness_stays_bounded(mode):
    s = _long_tail(mode=mode)
    sync = simulate(s, "sync")
    assert sync.staleness_max == 0
    prev = sync.wall_s
    for eta in (1, 2, 4):
        r = simulate(s, "async", eta)
        assert r.steps == s.steps and r.samples == s.steps * s.batch_size * s.group_size
        assert max(r.staleness_hist) <= eta
        assert r.wall_s < sync.wall_s / 1.3, (eta, r.wall_s, sync.wall_s)
        assert r.wall_s <= prev * 1.02  # a looser bound never makes the run slower (beyond noise)
        prev = r.wall_s
    assert 0 < sync.gen_busy_frac < 1 and 0 < sync.trainer_busy_frac < 1


def test_rejected_groups_are_replaced_and_cost_generation_time():
    s = _long_tail(steps=6)
    base = simulate(s, "async", 2)
    s.lengths.reject_rate = 0.5
    rej = simulate(s, "async", 2)
    assert rej.samples == base.samples  # every step still trains B groups
    assert rej.groups_rejected > 0
    assert rej.wall_s > base.wall_s


def test_waiting_for_requests_in_flight_loses_to_interrupting_them_on_long_tails():
    # the AReaL paper's case for interruptible generation: a weight update that waits for the longest answer in
    # flight stalls every server behind it
    wait = simulate(_long_tail(mode="wait"), "async", 2)
    abort = simulate(_long_tail(mode="abort"), "async", 2)
    assert max(wait.staleness_hist) <= 2
    assert wait.wall_s > 1.2 * abort.wall_s
