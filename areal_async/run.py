"""`python -m areal_async.run` and the `areal-run` console script: the run's command, kept under its first name.

The run itself lives in `areal_async.session` (session/run.py: prepare, launch, train, report). This module only
re-exports its public names, so `from areal_async.run import main, prepare` and the command keep working.
"""

from __future__ import annotations

import sys

from areal_async.session.connect import bring_servers_to, connect_trainers, connect_weights
from areal_async.session.prepare import RunPlan
from areal_async.session.report import print_summary, server_busy_s, summarize, write_outputs
from areal_async.session.rollback import restart_trainers, retire_controller, rewind
from areal_async.session.run import (
    Session,
    check_before_submission,
    main,
    make_controller,
    make_score,
    open_run_dir,
    parse_args,
    prepare,
    program_name,
    resolve_model,
    rewind_records,
    roll_back,
    run,
    setup_logging,
    train,
)

__all__ = [
    "RunPlan",
    "Session",
    "bring_servers_to",
    "check_before_submission",
    "connect_trainers",
    "connect_weights",
    "main",
    "make_controller",
    "make_score",
    "open_run_dir",
    "parse_args",
    "prepare",
    "print_summary",
    "program_name",
    "resolve_model",
    "restart_trainers",
    "retire_controller",
    "rewind",
    "rewind_records",
    "roll_back",
    "run",
    "server_busy_s",
    "setup_logging",
    "summarize",
    "train",
    "write_outputs",
]

if __name__ == "__main__":
    sys.exit(main())
