"""The generation journal: every token the running groups' requests bring back, on disk as it arrives, so that a
resumed run continues each group from its tokens instead of generating them again.

    run_dir/journal/v<k>-<n>.jsonl            events since checkpoint k (n counts the processes that wrote after it)
    run_dir/checkpoints/v<k>/inflight.json    the unresolved groups at checkpoint k with everything they had

What a checkpoint holds and what a resume from it keeps:
- The checkpoint's `inflight.json` is the journal's state when the checkpoint was taken, for the draws the
  checkpoint leaves unresolved (running, or finished and waiting in the buffer). It is written before
  `latest.json` moves, and the journal starts a new file in the same step (no await between), so the snapshot and
  the files after it never overlap and never leave a gap.
- A resume from checkpoint V reads the snapshot, then every journal file of version >= V in order. Only tokens
  made by versions <= V are kept: the trainer resumes at V, so the weights of a later version no longer exist
  (the next version V+1 will be different weights). A call's tokens are cut at the first later-version token.
- A kept group restarts through the same workflow, which asks for the same generations again: a finished call is
  answered from the journal at once; an unfinished one is resubmitted as prompt + kept tokens, exactly as an
  interrupted request is (journal_client.py). Calls are matched by a digest of their input ids and sampling, not
  by order, so concurrent samples and multi-turn episodes match whatever order their calls come in; a call the
  workflow does not ask for again is dropped with that reason.
- Tokens not kept are counted by reason in `journal/resumed-v<V>-<n>.json` (and the log): made after the checkpoint by a
  version the resume discards, or asked for no more. Tokens of a segment still on a server at the kill never
  reached the controller; the calls they belong to are counted as in flight.

Events (one JSON object per line, each written with one write(), so a kill leaves at most a torn last line, which
the reader skips): `start` (a draw's group begins, under version `at`; it supersedes anything earlier of that
draw), `call` (a generation call: its digest), `tok` (new tokens of a call, with logprobs, versions and text),
`done` (the call finished: finish reason, matched stop, interruptions). No torch here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field

import msgspec

from areal_async.atomic_write import write_json_atomic, write_text_atomic
from areal_async.rollout.checkpoints import checkpoint_dir
from areal_async.types import SamplingParams

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
SNAPSHOT_FILE = "inflight.json"
_FILE_RE = re.compile(r"^v(\d+)-(\d+)\.jsonl$")


class CallLog(msgspec.Struct, kw_only=True):
    """One generation call of a group: its tokens so far and, once it finished, how."""

    digest: str
    ids: list[int] = []  # [T] output tokens so far
    lp: list[float] = []  # [T] their behaviour logprobs
    ver: list[int] = []  # [T] the version that made each
    text: str = ""
    finish: str | None = None  # None: unfinished
    matched: int | str | None = None
    interruptions: int = 0

    def cut_after(self, version: int) -> int:
        """Drop every token from the first one made by a version after `version`; returns how many went."""
        cut = next((i for i, v in enumerate(self.ver) if v > version), None)
        if cut is None:
            return 0
        gone = len(self.ids) - cut
        del self.ids[cut:], self.lp[cut:], self.ver[cut:]
        self.finish, self.matched = None, None
        self.text = ""  # the text of a cut call cannot be cut with it; the continuation's text stands alone
        return gone


class GroupLog(msgspec.Struct, kw_only=True):
    start_version: int
    calls: list[CallLog] = []


class Snapshot(msgspec.Struct, kw_only=True):
    version: int
    groups: dict[int, GroupLog] = {}


def call_digest(input_ids: list[int], sampling: SamplingParams) -> str:
    """What identifies a call across a resume: its exact input ids and sampling settings."""
    h = hashlib.blake2b(digest_size=16)
    h.update(msgspec.json.encode(input_ids))
    h.update(msgspec.json.encode(sampling))
    return h.hexdigest()


@dataclass
class ResumeReport:
    """What a resume kept of the journal and what it could not (tokens by reason)."""

    version: int
    groups: int = 0
    calls_kept: int = 0
    tokens_kept: int = 0
    tokens_dropped: dict[str, int] = field(default_factory=dict)
    calls_in_flight: int = 0  # unfinished calls at the kill: their last segment's tokens never reached us
    groups_dropped: dict[str, int] = field(default_factory=dict)

    def drop_tokens(self, reason: str, n: int) -> None:
        if n:
            self.tokens_dropped[reason] = self.tokens_dropped.get(reason, 0) + n


class GenerationJournal:
    """The running groups' generation record (see the module docstring); one per controller.

    Writes never fail the run: a journal that cannot be written is warned about once and switched off (a resume
    then regenerates what it would have kept)."""

    def __init__(self, run_dir: str, version: int, *, resume: bool = False) -> None:
        self.dir = os.path.join(run_dir, JOURNAL_DIR)
        self.run_dir = run_dir
        self.version = version
        self.groups: dict[int, GroupLog] = {}
        self.replay: dict[int, GroupLog] = {}  # loaded at a resume, handed to groups as they restart
        self.report = ResumeReport(version)
        self._enc = msgspec.json.Encoder()
        self._fd: int | None = None
        self._broken = False
        self._resumed = resume
        os.makedirs(self.dir, exist_ok=True)
        if resume:
            self._load(version)
        self._open(version)
        self._resume_writer = self._writer  # names this resume's report (several may resume one checkpoint)

    # ---- writing -----------------------------------------------------------------------------------------------

    def _open(self, version: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        taken = [
            int(m.group(2)) for f in os.listdir(self.dir) if (m := _FILE_RE.match(f)) and int(m.group(1)) == version
        ]
        self._writer = max(taken, default=-1) + 1
        name = f"v{version}-{self._writer}.jsonl"
        self._fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _write(self, event: dict) -> None:
        if self._broken or self._fd is None:
            return
        try:
            os.write(self._fd, self._enc.encode(event) + b"\n")
        except OSError as e:
            self._broken = True
            log.warning("generation journal off (%s): a resume regenerates the groups in flight", e)

    def start(self, draw: int, start_version: int) -> GroupLog:
        """A draw's group begins (again); what a resume kept of it is carried into the new record at once, so a
        second kill before its calls come loses nothing."""
        carried = self.replay.pop(draw, None)
        group = GroupLog(start_version=start_version, calls=list(carried.calls) if carried else [])
        self.groups[draw] = group
        self._write({"e": "start", "draw": draw, "at": start_version})
        for seq, call in enumerate(group.calls):
            self._write({"e": "call", "draw": draw, "seq": seq, "digest": call.digest})
            self._write_tokens(draw, seq, call.ids, call.lp, call.ver, call.text)
            if call.finish is not None:
                self._write_done(draw, seq, call)
        return group

    def new_call(self, draw: int, digest: str) -> int:
        group = self.groups[draw]
        group.calls.append(CallLog(digest=digest))
        seq = len(group.calls) - 1
        self._write({"e": "call", "draw": draw, "seq": seq, "digest": digest})
        return seq

    def add_tokens(self, draw: int, seq: int, ids: list[int], lp: list[float], ver: list[int], text: str) -> None:
        group = self.groups.get(draw)
        if group is None or not ids:
            return
        call = group.calls[seq]
        call.ids.extend(ids), call.lp.extend(lp), call.ver.extend(ver)
        call.text += text
        self._write_tokens(draw, seq, ids, lp, ver, text)

    def finish_call(self, draw: int, seq: int, finish: str, matched: int | str | None, interruptions: int) -> None:
        group = self.groups.get(draw)
        if group is None:
            return
        call = group.calls[seq]
        call.finish, call.matched, call.interruptions = finish, matched, interruptions
        self._write_done(draw, seq, call)

    def _write_tokens(self, draw: int, seq: int, ids: list[int], lp: list[float], ver: list[int], text: str) -> None:
        if ids:
            self._write({"e": "tok", "draw": draw, "seq": seq, "ids": ids, "lp": lp, "ver": ver, "text": text})

    def _write_done(self, draw: int, seq: int, call: CallLog) -> None:
        event = {"e": "done", "draw": draw, "seq": seq, "finish": call.finish, "matched": call.matched}
        self._write({**event, "interruptions": call.interruptions})

    def forget(self, draws: list[int]) -> None:
        """These draws are resolved (trained, or dropped with a reason): nothing of them is needed again."""
        for d in draws:
            self.groups.pop(d, None)
            self.replay.pop(d, None)

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def checkpoint(self, ckpt_dir: str, version: int, pending: list[int]) -> None:
        """Write the unresolved draws' records into the checkpoint directory (before its `latest.json` moves)."""
        keep = set(pending)
        groups = {d: g for src in (self.replay, self.groups) for d, g in src.items() if d in keep}
        self.forget([d for d in list(self.groups) + list(self.replay) if d not in keep])
        snapshot = self._enc.encode(Snapshot(version=version, groups=groups)).decode()
        write_text_atomic(os.path.join(ckpt_dir, SNAPSHOT_FILE), snapshot)
        if self._resumed:  # what the resumed groups did not ask for again is known only as they finish
            self.write_report()

    def rotate(self, version: int) -> None:
        """The checkpoint at `version` is complete: start its journal file and drop the files before it (a resume
        from an older checkpoint, after a rollback, keeps only that checkpoint's own snapshot)."""
        self.version = version
        self._open(version)
        for v, _n, name in _journal_files(self.dir):
            if v < version:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- reading at a resume -----------------------------------------------------------------------------------

    def _load(self, version: int) -> None:
        """The checkpoint's snapshot plus every journal file after it, cut to what version `version` may keep."""
        groups: dict[int, GroupLog] = {}
        snap_path = os.path.join(checkpoint_dir(self.run_dir, version), SNAPSHOT_FILE)
        if os.path.exists(snap_path):
            try:
                with open(snap_path, "rb") as f:
                    groups = dict(msgspec.json.decode(f.read(), type=Snapshot).groups)
            except (OSError, msgspec.DecodeError) as e:
                log.warning("%s unreadable (%s): the groups in flight at the checkpoint start over", snap_path, e)
        files = sorted((int(m.group(1)), int(m.group(2)), f) for f in os.listdir(self.dir) if (m := _FILE_RE.match(f)))
        for v, _n, name in files:
            if v >= version:
                _apply_file(os.path.join(self.dir, name), groups)
        rep = self.report
        for draw, group in groups.items():
            for call in group.calls:
                rep.drop_tokens("made after the checkpoint by a version the resume discards", call.cut_after(version))
                if call.finish is None:
                    rep.calls_in_flight += 1
            group.calls = [c for c in group.calls if c.ids or c.finish is not None]
            if group.calls:
                self.replay[draw] = group
        rep.groups = len(self.replay)
        rep.calls_kept = sum(len(g.calls) for g in self.replay.values())
        rep.tokens_kept = sum(len(c.ids) for g in self.replay.values() for c in g.calls)

    def write_report(self) -> str:
        path = os.path.join(self.dir, f"resumed-v{self.report.version}-{self._resume_writer}.json")
        write_json_atomic(path, self.report.__dict__, indent=2)
        return path


def _journal_files(directory: str) -> list[tuple[int, int, str]]:
    """(checkpoint version, writer number, file name) of every journal file, in the order they were written."""
    return sorted((int(m.group(1)), int(m.group(2)), f) for f in os.listdir(directory) if (m := _FILE_RE.match(f)))


def _apply_file(path: str, groups: dict[int, GroupLog]) -> None:
    """Replay one journal file's events onto `groups` (a torn or foreign line is skipped)."""
    dec = msgspec.json.Decoder()
    with open(path, "rb") as f:
        for line in f:
            try:
                ev = dec.decode(line)
                kind, draw = ev["e"], int(ev["draw"])
                if kind == "start":
                    groups[draw] = GroupLog(start_version=int(ev["at"]))
                    continue
                group = groups.get(draw)
                if group is None:
                    continue
                seq = int(ev["seq"])
                if kind == "call":
                    if seq == len(group.calls):
                        group.calls.append(CallLog(digest=str(ev["digest"])))
                elif seq < len(group.calls):
                    call = group.calls[seq]
                    if kind == "tok":
                        call.ids.extend(ev["ids"]), call.lp.extend(ev["lp"]), call.ver.extend(ev["ver"])
                        call.text += ev.get("text", "")
                    elif kind == "done":
                        call.finish, call.matched = ev["finish"], ev.get("matched")
                        call.interruptions = int(ev.get("interruptions", 0))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError):
                continue
