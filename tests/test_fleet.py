"""Servers joining and leaving a running job, for real: an embedded server started apart from the run is added to
run_dir/servers.txt after the first train step and taken out again later. It must take traffic only once it holds
the current weights (never while it still serves the base model), stop taking traffic once it has left, and the run
must go on and finish cleanly: with broadcast weight sync the weight-update group is formed again (a new name) at
the first update after each change, so no broadcast waits on a server that is gone; with disk sync the newcomer
loads the latest checkpoint. Plus the join file's parsing and health deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from areal_async.launch.api import ServerJoined, ServerLeft
from areal_async.launch.membership import JoinFile, read_urls

SMALL = [
    "schedule.batch_size=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=32",
    "eval.num_prompts=0",
    "schedule.eval_every=0",
    "server.device=cpu",
    "train.device=cpu",  # the CPU paths, on any host
    "data.num_train=400",
    "server.max_total_tokens=8192",
    "train.micro_batch_tokens=1024",
]


def start_server(model: str, log_path: str) -> tuple[subprocess.Popen, str]:
    out = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.serve",
            "--model",
            model,
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "8192",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = re.search(r"areal_async server ready at (\S+)", f.read())
        if m:
            return proc, m.group(1)
        assert proc.poll() is None, open(log_path).read()
        time.sleep(0.2)
    raise AssertionError("the extra server did not start")


def server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
        return json.loads(r.read())


def train_records(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for line in f if json.loads(line)["kind"] == "train")
    except (OSError, ValueError):
        return 0


def run_log(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, "run.log")) as f:
            return f.read()
    except OSError:
        return ""


def wait(cond, timeout: float, what: str, proc: subprocess.Popen, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.stdout.read()[-3000:]}"
        time.sleep(poll)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["broadcast", "disk"])
def test_server_joins_with_current_weights_and_leaves_drained(tiny_ckpt, tmp_path, sync):
    run_dir = str(tmp_path / "run")
    extra, url = start_server(tiny_ckpt, str(tmp_path / "extra.log"))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.run",
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            f"train.weight_sync={sync}",
            "total_steps=10000",
            *SMALL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    samples: list[tuple[int, float]] = []  # (weight version, busy seconds) of the extra server, over time

    def sample() -> tuple[int, float]:
        info = server_info(url)
        samples.append((int(info["weight_version"]), float(info["busy_s"])))
        return samples[-1]

    try:
        wait(lambda: train_records(run_dir) >= 1, 180, "a train step", run)
        assert sample() == (0, 0.0)
        with open(os.path.join(run_dir, "servers.txt"), "w") as f:
            f.write(f"# added at run time\n{url}\n")
        wait(lambda: sample()[1] > 0, 60, "traffic on the joined server", run)
        assert "joined0 joined at " + url in run_log(run_dir)
        # it took traffic only once it held trained weights: never busy while it still had the base model
        assert all(busy == 0.0 for version, busy in samples if version == 0), samples
        assert samples[-1][0] >= 1
        if sync == "broadcast":
            assert re.search(
                r"weight-update group areal-[0-9a-f]+-2 \(gloo\): trainer rank 0 and 2 server", run_log(run_dir)
            )

        with open(os.path.join(run_dir, "servers.txt"), "w") as f:
            f.write("")
        wait(lambda: f"at {url} drained and removed" in run_log(run_dir), 90, "the drain", run)
        # a weight update already under way when it left still reaches it (with broadcast it is a member of that
        # update's group until the group is formed again, at the next update): look from the step after on
        left_at = train_records(run_dir) + 1
        wait(lambda: train_records(run_dir) >= left_at, 60, "the step after the drain", run)
        after = sample()
        wait(lambda: train_records(run_dir) >= left_at + 3, 120, "three more train steps", run)
        assert sample() == after  # no traffic and no weight updates since it left
        if sync == "broadcast":
            assert re.search(r"areal-[0-9a-f]+-3 \(gloo\): trainer rank 0 and 1 server", run_log(run_dir))
        # seen all it had to see: end the run (it has no wall-clock limit, which a slower machine would run into
        # before these steps)
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(60)
            except subprocess.TimeoutExpired:
                run.kill()
        os.killpg(extra.pid, signal.SIGTERM)
        extra.wait(30)
    assert run.returncode == 130, out[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(train) >= left_at + 3
    assert max(r["staleness_max"] for r in train) <= 1


def test_join_file_parsing(tmp_path):
    p = tmp_path / "servers.txt"
    assert read_urls(str(p)) == []
    p.write_text("http://a:1/\n# comment\n  http://b:2  # trailing\nnot-a-url\nhttp://a:1\n\n")
    assert read_urls(str(p)) == ["http://a:1", "http://b:2"]


async def test_join_file_events_and_health_deadline(tmp_path):
    """A URL is announced once it answers /health; one that never answers is given up after the deadline (and
    tried again when the file changes); a URL taken out is announced as leaving; launched servers are not."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    good = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    dead = "http://127.0.0.1:9"
    path = tmp_path / "servers.txt"
    jf = JoinFile(str(path), api_key=None, startup_timeout_s=0.5, exclude=["http://launched:1"])
    try:
        assert await jf.poll() == []
        path.write_text(f"{good}\n{dead}\nhttp://launched:1\n")
        assert await jf.poll() == [ServerJoined("joined0", good)]
        await asyncio.sleep(0.7)
        assert await jf.poll() == [] and dead not in jf.waiting  # given up after the deadline
        path.write_text(f"{dead}\n")
        assert await jf.poll() == [ServerLeft("joined0", good)]
        assert dead in jf.waiting  # the file changed: tried again
    finally:
        await runner.cleanup()
