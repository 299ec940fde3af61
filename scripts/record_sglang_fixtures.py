"""Re-record tests/fixtures/sglang/<release>/answers.json from a real SGLang server.

    .venv/bin/python scripts/record_sglang_fixtures.py ~/.cache/areal_async/engines/sglang-0.5.23/bin/python

It launches SGLang from that interpreter the way `server.backend=sglang` does (launch/sglang_server.py: CPU engine
on a machine without a GPU, explicit dtype, no radix cache), serving SmolLM2-135M-Instruct, runs the exchange
script of areal_async/testing/sglang_record.py against it, and writes what the server answered. The conformance
tests (tests/test_sglang_conformance.py) hold FakeSGLang.like(<release>) to those answers, and a live server of the
release to them in CI. Re-record after moving to a new release.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from areal_async.launch.processes import Processes, tail  # noqa: E402
from areal_async.launch.sglang_server import installed_release  # noqa: E402
from areal_async.testing import sglang_record  # noqa: E402
from areal_async.testing.real_model import smollm2_path  # noqa: E402


def _wait_healthy(child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise SystemExit(f"SGLang exited ({child.proc.returncode}):\n{tail(child.log_path)}")
        try:
            with urllib.request.urlopen(child.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"SGLang not healthy after {timeout_s:.0f}s:\n{tail(child.log_path)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("python", help="an interpreter with SGLang installed (make sglang)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "sglang"))
    args = ap.parse_args()
    python = os.path.expanduser(args.python)
    release = installed_release(python, "sglang")
    if release is None:
        raise SystemExit(f"{python} has no sglang installed")
    model = smollm2_path()
    with tempfile.TemporaryDirectory(prefix="sglang-record-") as work:
        scratch = os.path.join(work, "not-a-checkpoint")
        os.makedirs(scratch)
        procs = Processes(os.path.join(work, "run"))
        child = procs.start_sglang_server(
            0, model, host="127.0.0.1", port=0, api_key=None, extra_args=["--max-total-tokens", "16384"],
            python=python, device="cpu", radix_cache=False, threads=2,
        )  # fmt: skip
        try:
            _wait_healthy(child, 600)
            answers = asyncio.run(sglang_record.record(child.url or "", model=model, scratch=scratch, real=True))
        except Exception:
            print(tail(child.log_path), file=sys.stderr)
            raise
        finally:
            procs.shutdown()
    path = os.path.join(args.out, release, "answers.json")
    sglang_record.write(path, release, answers)
    print(f"wrote {len(answers)} answers of SGLang {release} to {path}")


if __name__ == "__main__":
    main()
