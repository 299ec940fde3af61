"""Which inference server gets the next request: least outstanding requests, sticky sessions, health state.

Pure bookkeeping with no I/O, so the policy can be read (and tested) apart from HTTP. The client
(inference/client.py) owns the probing that flips a server back to healthy. No torch here.

Why least-outstanding: RL generations have long-tailed lengths, so counting requests in flight tracks a server's
load far better than round-robin does. Why sticky sessions: multi-turn and agent workflows resend a growing prefix;
keeping a session on one server lets that server's prefix cache serve it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ServerState:
    """What the client knows about one server."""

    __slots__ = ("url", "outstanding", "healthy", "num_requests", "num_failures")

    def __init__(self, url: str):
        self.url = url
        self.outstanding = 0  # requests sent and not yet answered
        self.healthy = True  # optimistic at start: the first failure takes it out of rotation
        self.num_requests = 0  # requests routed here, all kinds
        self.num_failures = 0  # connection errors and 5xx seen from it


class Router:
    """Least-outstanding selection among healthy servers, with sticky session keys.

    A session key stays on the server that first served it while that server is healthy; when it is not, the key
    moves to the least-loaded healthy server and stays there (its prefix cache now lives there). The key table is
    an LRU bounded by `max_sessions`, so a long run with unique keys does not grow memory without bound.
    """

    def __init__(self, urls: Iterable[str], max_sessions: int = 65536):
        self.servers: dict[str, ServerState] = {}
        for u in urls:
            u = u.rstrip("/")
            if u in self.servers:
                raise ValueError(f"duplicate server URL {u!r}")
            self.servers[u] = ServerState(u)
        if not self.servers:
            raise ValueError("at least one server URL is required")
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions
        self._rr = 0  # rotates ties so that equally loaded servers take turns

    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers.values() if s.healthy]

    def pick(self, session_key: str | None = None, exclude: Iterable[str] = ()) -> ServerState | None:
        """The server for the next request, or None when no server is healthy.

        `exclude` names servers that just failed this request; they are avoided while another healthy server
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
                s = self.servers[url]
                if s.healthy and (candidates is healthy or s in candidates):
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

    def forget_session(self, session_key: str) -> None:
        self._sessions.pop(session_key, None)

    def mark_down(self, url: str) -> bool:
        """Take a server out of rotation; True if it was healthy until now."""
        s = self.servers[url]
        was = s.healthy
        s.healthy = False
        return was

    def mark_up(self, url: str) -> bool:
        """Put a server back into rotation; True if it was down until now."""
        s = self.servers[url]
        was = s.healthy
        s.healthy = True
        return not was
