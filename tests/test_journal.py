"""The generation journal (rollout/journal.py, rollout/journal_client.py): what a resume keeps of the groups in
flight, and how a restarted group continues from it.

A scripted generator stands in for the inference client here so that every interleaving is exact; the real client
over HTTP, killed for real, is in tests/test_faults.py (the controller SIGKILLed mid-step and during a save)."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from areal_async.rollout.buffer import StalenessBuffer
from areal_async.rollout.checkpoints import checkpoint_dir
from areal_async.rollout.journal import JOURNAL_DIR, SNAPSHOT_FILE, GenerationJournal, call_digest
from areal_async.rollout.journal_client import JournaledGenerator
from areal_async.types import GenerationResult, SamplingParams

SP = SamplingParams(max_new_tokens=6, temperature=1.0)


class Scripted:
    """A generator whose tokens are `base + position` at the version it is told, reporting each segment through
    `on_segment` like the InferenceClient; `holds[i]` keeps call i after its first segment until it is set."""

    def __init__(self, version: int = 0, holds: int = 0) -> None:
        self.version = version
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.holds = [asyncio.Event() for _ in range(holds)]

    async def agenerate(self, input_ids, sampling, *, on_segment=None, **_):
        hold = self.holds[len(self.calls)] if len(self.calls) < len(self.holds) else None
        self.calls.append((list(input_ids), sampling))
        st = SimpleNamespace(out_ids=[], out_logprobs=[], out_versions=[], segment_texts=[])
        for i in range(sampling.max_new_tokens):
            st.out_ids.append(100 + len(input_ids) + i)
            st.out_logprobs.append(-0.5)
            st.out_versions.append(self.version)
            st.segment_texts.append("x")
            if i == 1 and on_segment is not None:
                on_segment(st)  # an interruption after two tokens: the journal has them from here
                if hold is not None:
                    await hold.wait()
        return GenerationResult(
            input_ids=list(input_ids),
            output_ids=st.out_ids,
            output_logprobs=st.out_logprobs,
            output_versions=st.out_versions,
            finish_reason="length",
            text="".join(st.segment_texts),
        )


async def _start_group(journal, draw, client, n_calls, prompt):
    journal.start(draw, journal.version)
    gen = JournaledGenerator(client, journal, draw)
    tasks = [asyncio.create_task(gen.agenerate(prompt, SP)) for _ in range(n_calls)]
    await asyncio.sleep(0)  # every call has journaled its first segment and waits on `hold`
    return gen, tasks


def _write_checkpoint(run_dir, journal, version, pending):
    ckpt = checkpoint_dir(run_dir, version)
    os.makedirs(ckpt, exist_ok=True)
    journal.checkpoint(ckpt, version, pending)
    journal.rotate(version)


async def test_a_resumed_group_continues_from_its_tokens_and_finished_calls_are_not_asked_again(tmp_path):
    run_dir = str(tmp_path)
    prompt = [1, 2, 3]
    journal = GenerationJournal(run_dir, 0)
    client = Scripted(version=0, holds=2)
    _gen, tasks = await _start_group(journal, 7, client, 2, prompt)
    _write_checkpoint(run_dir, journal, 0, [7])  # two calls in flight, two tokens each, in the checkpoint
    client.holds[0].set()
    first = await tasks[0]  # one call finishes after the checkpoint: in the journal file only
    journal.close()  # the other is still held: the "kill" comes now
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    resumed = GenerationJournal(run_dir, 0, resume=True)
    rep = resumed.report
    assert rep.groups == 1 and rep.calls_kept == 2 and rep.tokens_kept == 6 + 2 and rep.calls_in_flight == 1
    client2 = Scripted(version=0)
    resumed.start(7, 0)
    gen = JournaledGenerator(client2, resumed, 7)
    a, b = await asyncio.gather(gen.agenerate(prompt, SP), gen.agenerate(prompt, SP))
    # the finished call comes back as it was, without a request; the other is resubmitted with its two tokens
    assert {tuple(a.output_ids), tuple(b.output_ids)} >= {tuple(first.output_ids)}
    assert len(client2.calls) == 1
    sent, sampling = client2.calls[0]
    assert sent == prompt + first.output_ids[:2] and sampling.max_new_tokens == SP.max_new_tokens - 2
    cont = b if a.output_ids == first.output_ids else a
    assert cont.output_ids[:2] == first.output_ids[:2] and len(cont.output_ids) == SP.max_new_tokens
    assert cont.input_ids == prompt and cont.num_interruptions >= 1


def test_tokens_of_versions_after_the_checkpoint_are_cut_and_counted(tmp_path):
    run_dir = str(tmp_path)
    journal = GenerationJournal(run_dir, 3)
    journal.start(1, 3)
    seq = journal.new_call(1, call_digest([5], SP))
    journal.add_tokens(1, seq, [10, 11], [-1.0, -1.0], [3, 3], "ab")
    _write_checkpoint(run_dir, journal, 3, [1])
    journal.add_tokens(1, seq, [12, 13, 14], [-1.0] * 3, [3, 4, 4], "cde")  # version 4 never got a checkpoint
    journal.finish_call(1, seq, "stop", 14, 1)
    with open(os.path.join(run_dir, JOURNAL_DIR, "v3-0.jsonl"), "ab") as f:
        f.write(b'{"e": "tok", "draw": 1, "seq": 0, "ids": [9')  # a kill in the middle of a write
    journal.close()

    resumed = GenerationJournal(run_dir, 3, resume=True)
    call = resumed.replay[1].calls[0]
    assert call.ids == [10, 11, 12] and call.ver == [3, 3, 3] and call.finish is None  # cut: unfinished again
    dropped = resumed.report.tokens_dropped
    assert dropped == {"made after the checkpoint by a version the resume discards": 2}
    path = resumed.write_report()
    with open(path) as f:
        assert json.load(f)["tokens_kept"] == 3


def test_resolved_draws_leave_the_checkpoint_and_old_journal_files_go(tmp_path):
    run_dir = str(tmp_path)
    journal = GenerationJournal(run_dir, 0)
    for d in (1, 2):
        journal.start(d, 0)
        journal.add_tokens(d, journal.new_call(d, call_digest([d], SP)), [d], [0.0], [0], "")
    _write_checkpoint(run_dir, journal, 1, [2])  # draw 1 was trained
    with open(os.path.join(checkpoint_dir(run_dir, 1), SNAPSHOT_FILE)) as f:
        assert set(json.load(f)["groups"]) == {"2"}
    assert sorted(os.listdir(os.path.join(run_dir, JOURNAL_DIR))) == ["v1-0.jsonl"]
    journal.close()
    again = GenerationJournal(run_dir, 1, resume=True)  # a second process after the same checkpoint
    assert set(again.replay) == {2}
    again.close()
    assert sorted(os.listdir(os.path.join(run_dir, JOURNAL_DIR))) == ["v1-0.jsonl", "v1-1.jsonl"]


async def test_a_second_kill_before_a_resumed_group_asks_again_loses_nothing(tmp_path):
    """The restart carries the kept calls into the new journal file at once: killed again before the workflow
    asks for them, the next resume still has them, and only once."""
    run_dir = str(tmp_path)
    journal = GenerationJournal(run_dir, 0)
    journal.start(4, 0)
    seq = journal.new_call(4, call_digest([1], SP))
    journal.add_tokens(4, seq, [7, 8], [-1.0, -2.0], [0, 0], "")
    _write_checkpoint(run_dir, journal, 0, [4])
    journal.close()
    first = GenerationJournal(run_dir, 0, resume=True)
    first.start(4, 0)  # restarted, then killed before any call
    first.close()
    second = GenerationJournal(run_dir, 0, resume=True)
    assert [c.ids for c in second.replay[4].calls] == [[7, 8]]


async def test_a_resumed_group_counts_under_its_oldest_kept_version():
    buf = StalenessBuffer(batch_size=2, eta=1, max_running=8)
    buf.restore(5)
    s = await buf.acquire_slot()
    buf.rebook(s, 4)  # kept tokens of version 4: the batch rule must train it by version 5
    assert buf.running_by_version() == {4: 1}
    s2 = await buf.acquire_slot()
    with pytest.raises(ValueError, match="more than eta=1 versions behind"):
        buf.rebook(s2, 3)
    assert buf.running_by_version() == {4: 1, 5: 1}


async def test_rebook_keeps_the_window_budget_of_the_staleness_invariant():
    """Part 2 of I(v) (docs/design.md): with B = 1 and eta = 2 at version 5, at most (3 + 2 - 5 + 1) * 1 = 1 group
    may be untrained under <= 3: a second one rebooked there is refused, one under 4 still fits."""
    buf = StalenessBuffer(batch_size=1, eta=2, max_running=8)
    buf.restore(5)
    for target, ok in ((3, True), (3, False), (4, True)):
        s = await buf.acquire_slot()
        if ok:
            buf.rebook(s, target)
        else:
            with pytest.raises(ValueError, match="no room under version 3"):
                buf.rebook(s, target)
            await buf.finish(None, s)
    assert buf.running_by_version() == {3: 1, 4: 1}
