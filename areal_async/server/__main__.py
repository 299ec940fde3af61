"""`python -m areal_async.server --model DIR`: the embedded inference server as a process (see cli.py)."""

from areal_async.server.cli import run_and_exit

run_and_exit()
