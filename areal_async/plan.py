"""`python -m areal_async.plan`: the capacity planner's command, kept under its first name. It lives in
`areal_async.planner` (planner/cli.py, docs/planner.md)."""

from __future__ import annotations

from areal_async.planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
