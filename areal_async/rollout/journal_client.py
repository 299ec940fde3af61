"""The `Generator` a group's workflow talks to when the run keeps a generation journal: it records every call's
tokens as they come back (rollout/journal.py), and after a resume it answers the calls the group had made before.

A call the journal holds finished is answered at once from it. One it holds unfinished is sent as the prompt plus
the kept tokens with the rest of the budget: the path an interrupted request takes, so the kept tokens keep their
logprobs and versions and only the rest is generated, under the current weights. The workflow sees one seamless
result either way. What is not carried over: a stop *string* that would have completed across the kept tokens and
the new ones is not looked for (stop token ids are), as with a server that returns no per-token text. No torch here.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from areal_async.rollout.journal import CallLog, GenerationJournal, call_digest
from areal_async.rollout.workflow_api import Generator
from areal_async.types import GenerationResult, SamplingParams

_SUPPORTS_PROGRESS: dict[type, bool] = {}


def _takes_on_segment(client: Generator) -> bool:
    """Does this client report segments (the InferenceClient does; a workflow's own test double may not)?"""
    kind = type(client)
    if kind not in _SUPPORTS_PROGRESS:
        try:
            _SUPPORTS_PROGRESS[kind] = "on_segment" in inspect.signature(client.agenerate).parameters
        except (TypeError, ValueError):
            _SUPPORTS_PROGRESS[kind] = False
    return _SUPPORTS_PROGRESS[kind]


class JournaledGenerator:
    """One group's view of the client: journals each call and replays what a resume kept (see the module doc)."""

    def __init__(self, client: Generator, journal: GenerationJournal, draw: int) -> None:
        self.client = client
        self.journal = journal
        self.draw = draw
        group = journal.groups[draw]
        # what the resume carried, by digest: each record answers one call with the same input and sampling
        self._kept: dict[str, list[int]] = {}
        for seq, call in enumerate(group.calls):
            self._kept.setdefault(call.digest, []).append(seq)
        self.replayed_calls = 0

    def unused_tokens(self) -> int:
        """Tokens of kept calls the workflow did not ask for again (its calls came out different this time)."""
        calls = self.journal.groups[self.draw].calls if self.draw in self.journal.groups else []
        return sum(len(calls[seq].ids) for seqs in self._kept.values() for seq in seqs)

    def kept_versions(self) -> int | None:
        """The oldest version among the kept tokens (None when nothing was kept)."""
        group = self.journal.groups[self.draw]
        return min((min(c.ver) for c in group.calls if c.ver), default=None)

    def __getattr__(self, name: str) -> Any:  # anything else a workflow uses of the client (tokenizer, urls, ...)
        return getattr(self.client, name)

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams, **kwargs: Any) -> GenerationResult:
        digest = call_digest(input_ids, sampling)
        seqs = self._kept.get(digest)
        if seqs:
            seq = seqs.pop(0)
            self.replayed_calls += 1
        else:
            seq = self.journal.new_call(self.draw, digest)
        call = self.journal.groups[self.draw].calls[seq]
        if call.finish is not None:
            return _result(input_ids, call, call.finish, call.matched, call.interruptions, 0.0, "journal")
        kept = len(call.ids)
        if kept and sampling.max_new_tokens - kept <= 0:
            self.journal.finish_call(self.draw, seq, "length", None, call.interruptions)
            return _result(input_ids, call, "length", None, call.interruptions, 0.0, "journal")
        rest = msgspec.structs.replace(
            sampling,
            max_new_tokens=sampling.max_new_tokens - kept,
            min_new_tokens=max(0, sampling.min_new_tokens - kept),
        )
        recorded = [0, 0]  # output tokens and text characters of this continuation already journaled

        def on_segment(state: Any) -> None:
            n, text = len(state.out_ids), "".join(state.segment_texts)
            self.journal.add_tokens(
                self.draw,
                seq,
                state.out_ids[recorded[0] : n],
                state.out_logprobs[recorded[0] : n],
                state.out_versions[recorded[0] : n],
                text[recorded[1] :],
            )
            recorded[0], recorded[1] = n, len(text)

        if _takes_on_segment(self.client):
            kwargs["on_segment"] = on_segment
        res = await self.client.agenerate(list(input_ids) + call.ids if kept else input_ids, rest, **kwargs)
        self.journal.add_tokens(
            self.draw,
            seq,
            res.output_ids[recorded[0] :],
            res.output_logprobs[recorded[0] :],
            res.output_versions[recorded[0] :],
            res.text[recorded[1] :] if len(res.text) >= recorded[1] else "",
        )
        interruptions = call.interruptions + res.num_interruptions + (1 if kept else 0)
        self.journal.finish_call(self.draw, seq, res.finish_reason, res.matched_stop, interruptions)
        if not kept:
            return res
        return _result(input_ids, call, res.finish_reason, res.matched_stop, interruptions, res.latency_s, res.server)


def _result(
    input_ids: list[int],
    call: CallLog,
    finish: str,
    matched: int | str | None,
    interruptions: int,
    latency_s: float,
    server: str,
) -> GenerationResult:
    return GenerationResult(
        input_ids=list(input_ids),
        output_ids=list(call.ids),
        output_logprobs=list(call.lp),
        output_versions=list(call.ver),
        finish_reason=finish,  # type: ignore[arg-type]
        text=call.text,
        matched_stop=matched,
        num_interruptions=interruptions,
        latency_s=latency_s,
        server=server,
    )
