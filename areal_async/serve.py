"""`python -m areal_async.serve`: the embedded inference server's command, kept under its first name. The server
lives in `areal_async.server` (`python -m areal_async.server` is the same command); see `server/cli.py`."""

from __future__ import annotations

if __name__ == "__main__":
    from areal_async.server.cli import run_and_exit

    run_and_exit()
