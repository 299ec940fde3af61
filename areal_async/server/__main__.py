"""`python -m areal_async.server --model DIR`: the embedded inference server as a process (see cli.py)."""

import sys

from areal_async.server.cli import main

sys.exit(main())
