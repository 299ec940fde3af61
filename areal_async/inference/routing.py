"""Which inference server gets the next request: least outstanding requests, sticky sessions, server states.

Pure bookkeeping with no I/O, so the policy can be read (and tested) apart from HTTP. The pool (transport.py) owns
the probes that move a server between states. No torch here.

Why least-outstanding: RL generations have long-tailed lengths, so counting requests in flight tracks a server's
load far better than round-robin does. Why sticky sessions: multi-turn and agent workflows resend a growing prefix;
keeping a session on one server lets that server's prefix cache serve it.

A server is in one of four states, and only "serving" ones take new requests:

    serving  --connection error, 502/503/504, failed or hung health probe-->  down
    down     --/health answers 200-->  syncing  --holds the current weights-->  serving
    serving  --its weight load failed-->  syncing
    any      --remove_server(drain)-->  draining  --its requests are done (or moved)-->  forgotten
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Literal

ServerStatus = Literal["serving", "down", "syncing", "draining"]


class ServerState:
    """What the client knows about one server."""

    __slots__ = (
        "url",
        "outstanding",
        "exchanges",
        "state",
        "num_requests",
        "num_failures",
        "health_failures",
        "admin_ops",
        "version",
        "incremental_stream",
        "dialect",
        "last_answer",
    )

    def __init__(self, url: str, state: ServerStatus = "serving"):
        self.url = url
        self.outstanding = 0  # routed requests sent and not yet answered (probes and admin calls not counted)
        self.exchanges = 0  # every request in flight to it except health probes: what a hang would block
        self.state: ServerStatus = state  # optimistic at start: the first failure takes it out of rotation
        self.num_requests = 0  # requests routed here
        self.num_failures = 0  # connection errors and 5xx seen from it
        self.health_failures = 0  # consecutive heartbeat probes without an answer
        self.admin_ops = 0  # weight loads in flight (a loading server may be slow to answer /health)
        self.version: int | None = None  # the weight version it was last seen or made to hold; None: unknown
        self.incremental_stream: bool | None = None  # its streams carry only new tokens; None: not asked yet
        self.dialect: Any = None  # its engine's Dialect (inference/dialect.py), detected on first contact
        self.last_answer = 0.0  # time.monotonic() of the last bytes it sent us: a slow server still answers

    @property
    def healthy(self) -> bool:
        """In rotation: reachable, holding the current weights, not draining."""
        return self.state == "serving"


class Router:
    """Least-outstanding selection among serving servers, with sticky session keys.

    A session key stays on the server that first served it while that server serves; when it does not, the key
    moves to the least-loaded serving server and stays there (its prefix cache now lives there). The key table is
    an LRU bounded by `max_sessions`, so a long run with unique keys does not grow memory without bound.
    """

    def __init__(self, urls: Iterable[str], max_sessions: int = 65536):
        self.servers: dict[str, ServerState] = {}
        for u in urls:
            self.add(u)
        if not self.servers:
            raise ValueError("at least one server URL is required")
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions
        self._rr = 0  # rotates ties so that equally loaded servers take turns

    def add(self, url: str, state: ServerStatus = "serving") -> ServerState:
        url = url.rstrip("/")
        if url in self.servers:
            raise ValueError(f"duplicate server URL {url!r}")
        s = self.servers[url] = ServerState(url, state)
        return s

    def remove(self, url: str) -> ServerState:
        """Forget a server (and the sessions pinned to it, which move on their next request)."""
        s = self.servers.pop(url)
        for key in [k for k, u in self._sessions.items() if u == url]:
            del self._sessions[key]
        return s

    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers.values() if s.healthy]

    def pick(self, session_key: str | None = None, exclude: Iterable[str] = ()) -> ServerState | None:
        """The server for the next request, or None when no server is serving.

        `exclude` names servers that just failed this request; they are avoided while another serving server
        exists (fail over), and used as a last resort otherwise (a 500 on the only server is worth retrying).
        """
        healthy = [s for s in self.servers.values() if s.healthy]
        if not healthy:
            return None
        candidates = healthy
        if exclude:
            excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
            candidates = [s for s in healthy if s.url not in excluded] or healthy
        if session_key is not None:
            url = self._sessions.get(session_key)
            if url is not None:
                s = self.servers.get(url)
                if s is not None and s.healthy and (candidates is healthy or s in candidates):
                    self._sessions.move_to_end(session_key)
                    return s
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            least = min(s.outstanding for s in candidates)
            ties = [s for s in candidates if s.outstanding == least]
            chosen = ties[self._rr % len(ties)]
        self._rr += 1
        if session_key is not None:
            self._sessions[session_key] = chosen.url
            self._sessions.move_to_end(session_key)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return chosen

    def session_server(self, session_key: str) -> str | None:
        """The URL a session key is pinned to, if any."""
        return self._sessions.get(session_key)

    def set_state(self, url: str, state: ServerStatus) -> ServerStatus:
        """Move a server to `state`; returns the state it had."""
        s = self.servers[url]
        was = s.state
        s.state = state
        return was

    def mark_down(self, url: str) -> bool:
        """Take a server out of rotation; True if it was serving until now."""
        return self.set_state(url, "down") == "serving"

    def mark_up(self, url: str) -> bool:
        """Put a server back into rotation; True if it was out until now."""
        return self.set_state(url, "serving") != "serving"
