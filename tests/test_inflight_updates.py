"""Weight updates while requests are generating, over real HTTP, by disk and by broadcast (a real gloo group with a
trainer-side sender process):

- not paused, the update waits for the running requests (SGLang 0.5 takes its model-update writer lock), so every
  token of a request comes from one version;
- paused `in_place`, running requests keep their KV cache and continue under the new weights after
  /continue_generation; `meta_info.weight_version_spans` says exactly where the version changed, and the tokens
  after the change are exactly what the new weights compute on top of the old weights' KV;
- paused `retract`, requests are recomputed under the new weights from their prompt and output so far;
- `in_place` with `flush_cache=true` is refused and changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import aiohttp
import pytest
import pytest_asyncio
import torch

from areal_async.server.app import start_server
from areal_async.server.model import DecoderModel, KVCache, build_step_batch
from areal_async.server.weights import load_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 17, 23, 42, 8, 61, 33, 12, 9, 70, 4, 28, 55, 19, 3, 44, 26, 11]  # 18 tokens: two pages


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = await start_server(tiny_ckpt, "127.0.0.1", 0, device="cpu", weight_version="0", max_total_tokens=8192)
    yield srv
    await srv.close()
    torch.set_num_threads(threads)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(server):
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


async def post(http, path, obj) -> tuple[int, dict]:
    async with http.post(path, json=obj) as r:
        return r.status, json.loads(await r.text())


def long_request(n: int = 700) -> dict:
    return {
        "input_ids": PROMPT,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }


class Stream:
    """A streamed /generate call read in the background; `events` grows as they arrive."""

    def __init__(self, http, body: dict):
        self.events: list[dict] = []
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._read(http, body))

    async def _read(self, http, body: dict) -> dict:
        async with http.post("/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
        return self.events[-1]


def lps(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def mixed_logprobs(old: str, new: str, prompt: list[int], out: list[int], k: int) -> list[float]:
    """Logprobs of out[k:] when positions before len(prompt) + k - 1 hold the old weights' KV and everything from
    there on is computed by the new weights: an in-place update after output token k - 1 was sampled (its KV is
    written by the first step after the update)."""
    spec, old_t = load_checkpoint(old)
    _, new_t = load_checkpoint(new)
    model = DecoderModel(spec)
    model.load_tensors(old_t)
    seq = prompt + out
    cut = len(prompt) + k - 1
    n_pages = -(-len(seq) // 16)
    cache = KVCache(spec, n_pages * 16, 16, torch.device("cpu"), torch.float32)
    pages = list(range(1, n_pages + 1))
    table = torch.tensor([pages])
    model.forward(build_step_batch([(seq[:cut], 0, pages, 0)], table, 16, torch.device("cpu"), [[]]), cache)
    model.load_tensors(new_t)
    fed = seq[cut : len(seq) - 1]
    batch = build_step_batch([(fed, cut, pages, 0)], table, 16, torch.device("cpu"), [list(range(len(fed)))])
    logp = torch.log_softmax(model.forward(batch, cache), dim=-1)  # [len(fed), V]
    return logp.gather(1, torch.tensor(out[k:])[:, None])[:, 0].tolist()


def full_logprobs(path: str, prompt: list[int], out: list[int], k: int) -> list[float]:
    """Logprobs of out[k:] with every position computed by the weights at `path`."""
    spec, t = load_checkpoint(path)
    model = DecoderModel(spec)
    model.load_tensors(t)
    logits = model.score([prompt + out])[0]  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    idx = torch.arange(len(prompt) + k - 1, len(prompt) + len(out) - 1)
    return logp[idx].gather(1, torch.tensor(out[k:])[:, None])[:, 0].tolist()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


# ---- the trainer side of a broadcast update, as a trainer written for SGLang does it -------------------------------

SENDER = textwrap.dedent("""
    import os
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from safetensors.torch import load_file
    paths = sys.argv[1:]
    timeout = timedelta(seconds=120)
    # the store binds a free port itself and says which (no port picked by the test and bound here later)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    print("port", store.port, flush=True)
    store = dist.PrefixStore("inflight", store)
    pg, _ = c10d._new_process_group_helper(2, 0, [], "gloo", store, group_name="inflight", timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    for path in paths:  # one update per checkpoint, in order; each blocks until the server receives it
        tensors = load_file(path + "/model.safetensors")
        for name in sorted(tensors):
            dist.broadcast(tensors[name].contiguous(), src=0, group=pg)
    print("sent", len(paths), flush=True)
    os._exit(0)  # skip teardown: the server may still hold a connection to this process's TCPStore
""")


async def _sender_port(sender: subprocess.Popen) -> int:
    line = await asyncio.to_thread(sender.stdout.readline)
    assert line.startswith("port "), (line, sender.stderr.read() if sender.poll() is not None else "")
    return int(line.split()[1])


class Updater:
    """Disk or broadcast updates behind one call, so each scenario runs over both paths."""

    def __init__(self, http, kind: str, ckpts: dict[str, str]):
        self.http, self.kind, self.ckpts = http, kind, ckpts
        self.sender: subprocess.Popen | None = None

    async def start(self, sequence: list[str]) -> None:
        """Broadcast: start the sender with the checkpoints it will send, in order, and join its group."""
        if self.kind != "broadcast":
            return
        self.sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, *[self.ckpts[c] for c in sequence]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = await _sender_port(self.sender)
        status, body = await post(
            self.http,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "inflight",
                "backend": "gloo",
            },
        )
        assert status == 200 and body["success"], body

    async def update(self, ckpt: str, version: str, flush_cache: bool) -> tuple[int, dict]:
        if self.kind == "disk":
            return await post(
                self.http,
                "/update_weights_from_disk",
                {"model_path": self.ckpts[ckpt], "weight_version": version, "flush_cache": flush_cache},
            )
        from safetensors import safe_open

        with safe_open(os.path.join(self.ckpts[ckpt], "model.safetensors"), "pt") as f:
            names = sorted(f.keys())
            shapes = [list(f.get_slice(n).get_shape()) for n in names]
        return await post(
            self.http,
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": ["float32"] * len(names),
                "shapes": shapes,
                "group_name": "inflight",
                "weight_version": version,
                "flush_cache": flush_cache,
            },
        )

    async def finish(self, server) -> None:
        if self.sender is None:
            return
        try:
            _, err = await asyncio.to_thread(self.sender.communicate, timeout=120)
            assert self.sender.returncode == 0, err
        finally:
            if self.sender.poll() is None:
                self.sender.kill()
            group = server.engine._groups.pop("inflight", None)  # the next scenario joins a fresh group
            if group is not None:
                from areal_async.server.weights import destroy_group

                destroy_group(group)


@pytest.fixture
def ckpts(tiny_ckpt, tiny_ckpt_b) -> dict[str, str]:
    return {"a": tiny_ckpt, "b": tiny_ckpt_b}


@pytest_asyncio.fixture(loop_scope="module")
async def updater(server, http, ckpts):
    """`updater(kind)` makes an Updater; whatever the test did, and however it ended, the module's server is put
    back afterwards: no request running, generation not paused, no sender or group left, the base weights ("a")
    and the weight version it started with. A failed test then leaves the next one the same server."""
    made: list[Updater] = []
    version = server.engine.weight_version

    def make(kind: str) -> Updater:
        made.append(Updater(http, kind, ckpts))
        return made[-1]

    try:
        yield make
    finally:
        for up in made:
            if up.sender is not None and up.sender.poll() is None:
                up.sender.kill()
                await asyncio.to_thread(up.sender.wait)
        group = server.engine._groups.pop("inflight", None)
        if group is not None:
            from areal_async.server.weights import destroy_group

            destroy_group(group)
        for path, obj in (("/continue_generation", {}), ("/abort_request", {"abort_all": True})):
            async with http.post(path, json=obj) as r:  # these answer without a JSON body
                assert r.status == 200, (path, r.status, await r.text())
        status, body = await post(
            http,
            "/update_weights_from_disk",
            {"model_path": ckpts["a"], "weight_version": version, "flush_cache": True},
        )
        assert status == 200 and body["success"], body


@pytest.mark.parametrize("kind", ["disk", "broadcast"])
async def test_update_without_pause_waits_for_running_requests(server, http, ckpts, updater, kind):
    up = updater(kind)
    await up.start(["b", "a"])
    v = server.engine.weight_version
    stream = Stream(http, long_request(900))
    await stream.first.wait()
    assert server.engine.num_running() == 1  # the update below arrives while the request is generating
    status, body = await up.update("b", f"{v}+b", flush_cache=False)
    assert status == 200 and body["success"], body
    final = await stream.task
    # the request ran to the end on the version it started with: the swap waited for it
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 900}
    assert final["meta_info"]["weight_version_spans"] == [[0, v]]
    after = Stream(http, long_request(3))
    out = await after.task
    meta = out["meta_info"]
    assert meta["weight_version_spans"] == [[0, f"{v}+b"]] and meta["weight_version"] == f"{v}+b"
    status, body = await up.update("a", f"{v}+a", flush_cache=True)
    assert status == 200 and body["success"], body
    await up.finish(server)


@pytest.mark.parametrize("kind", ["disk", "broadcast"])
async def test_in_place_pause_keeps_kv_and_continues_under_new_weights(server, http, ckpts, updater, kind):
    up = updater(kind)
    await up.start(["b", "a"])
    v = server.engine.weight_version
    stream = Stream(http, long_request(700))
    await stream.first.wait()
    status, _ = await post(http, "/pause_generation", {"mode": "in_place"})
    assert status == 200 and server.engine.num_running() == 1 and server.engine.num_waiting() == 0
    status, body = await up.update("b", "new", flush_cache=False)
    assert status == 200 and body["success"], body
    assert server.engine.num_running() == 1  # still holding its KV, not retracted
    status, _ = await post(http, "/continue_generation", {})
    assert status == 200
    final = await stream.task
    meta = final["meta_info"]
    spans = meta["weight_version_spans"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "new"
    assert len(spans) == 2 and spans[0] == [0, v] and spans[1][1] == "new"
    k = spans[1][0]
    assert 0 < k < 700
    out, got = final["output_ids"], lps(final)
    # before the change: exactly the old weights; after it: the new weights on top of the old weights' KV
    assert close(got[:k], full_logprobs(ckpts["a"], PROMPT, out, 0)[:k])
    assert close(got[k:], mixed_logprobs(ckpts["a"], ckpts["b"], PROMPT, out, k))
    assert not close(got[k:], full_logprobs(ckpts["b"], PROMPT, out, k))  # not recomputed under the new weights
    # streamed events carry the spans cumulatively: each one is a prefix of the final list
    for ev in stream.events:
        s = ev["meta_info"]["weight_version_spans"]
        assert s == spans[: len(s)] and (s or not ev["output_ids"])
    status, body = await up.update("a", v, flush_cache=True)
    assert status == 200 and body["success"], body
    await up.finish(server)


async def test_retract_pause_recomputes_under_new_weights(server, http, ckpts, updater):
    up = updater("disk")
    v = server.engine.weight_version
    stream = Stream(http, long_request(700))
    await stream.first.wait()
    status, _ = await post(http, "/pause_generation", {"mode": "retract"})
    assert status == 200 and server.engine.num_running() == 0 and server.engine.num_waiting() == 1
    status, body = await up.update("b", "new", flush_cache=True)  # nothing holds KV: a flush is fine
    assert status == 200 and body["success"] and body["num_paused_requests"] == 1, body
    await post(http, "/continue_generation", {})
    final = await stream.task
    spans = final["meta_info"]["weight_version_spans"]
    assert len(spans) == 2 and spans[0] == [0, v] and spans[1][1] == "new"
    k = spans[1][0]
    out, got = final["output_ids"], lps(final)
    assert close(got[:k], full_logprobs(ckpts["a"], PROMPT, out, 0)[:k])
    assert close(got[k:], full_logprobs(ckpts["b"], PROMPT, out, k))  # prompt and output so far recomputed
    status, body = await up.update("a", v, flush_cache=True)
    assert status == 200 and body["success"], body


@pytest.mark.parametrize("kind", ["disk", "broadcast"])
async def test_in_place_pause_with_flush_cache_is_refused(server, http, ckpts, updater, kind):
    up = updater(kind)
    await up.start(["b"])
    v = server.engine.weight_version
    stream = Stream(http, long_request(300))
    await stream.first.wait()
    await post(http, "/pause_generation", {"mode": "in_place"})
    status, body = await up.update("b", "refused", flush_cache=True)
    assert status == 400 and body["success"] is False
    assert "flush_cache" in body["message"] and "in place" in body["message"]
    assert server.engine.weight_version == v and server.engine.num_running() == 1
    await post(http, "/continue_generation", {})
    final = await stream.task
    assert final["meta_info"]["weight_version_spans"] == [[0, v]]
    assert close(lps(final), full_logprobs(ckpts["a"], PROMPT, final["output_ids"], 0))
    await up.finish(server)
