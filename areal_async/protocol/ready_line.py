"""The line the embedded server prints on stdout once it listens: `READY_PREFIX` + its URL (with the real port when
it was asked for port 0). Server/cli.py prints it and launch/processes.py waits for it; it lives here, between them,
so that a launcher reads the server's one word to it without importing the server (a torch process of its own)."""

from __future__ import annotations

__all__ = ["READY_PREFIX"]

READY_PREFIX = "areal_async server ready at "
