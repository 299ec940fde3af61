"""llama.cpp's side of the inference benchmark: what a CPU user would run instead of the embedded engine.

Two comparisons, kept apart because they answer different questions:
- end to end (scheduling): llama-server with `-np 64` slots on the same 64 requests, sent all at once over HTTP
  (/completion with the prompt as token ids, greedy, ignore_eos, each request's own n_predict). A long tail of
  finishing requests is where a server's scheduling shows, so useful tokens/s here is the figure a user feels;
- decode (kernels): llama-batched-bench with `-npl 1,64`, best of `--repeats` runs: S_TG, the decode tokens/s with
  that many sequences, prompt length set so the mean context matches the engine's decode runs. llama-batched-bench
  is used for both batch sizes (not llama-bench's `-n` runs, which only decode one sequence) so batch 1 and 64 share
  one code path and one measurement; non-unified KV (as llama-server's `-np 64`), since the unified cache collapses
  at batch 64 here (156 against 887-1,024 tok/s in BF16 on a 2-core AMD EPYC Zen 5).
Both per precision (the GGUFs of benchmarks/build_llama_cpp.py: F32, BF16, optionally Q8_0), at the engine's thread
count, and never while another server runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import build_llama_cpp as blc

PRECISIONS = {"f32": "fp32", "bf16": "bf16", "q8_0": "q8_0"}  # GGUF type -> the dtype name of the roofline


def find_build(isa: str, given: str | None = None) -> Path | None:
    """The llama.cpp build to use: `given` (a build directory with bin/, or bin/ itself) or the cached one of
    build_llama_cpp.py for `isa`; None when there is none (the benchmark then skips llama.cpp)."""
    if given:
        p = Path(given).expanduser()
        for cand in (p, p / "bin"):
            if (cand / "llama-server").is_file():
                return cand
        raise SystemExit(f"--llama-cpp {given}: no llama-server in it or in its bin/")
    if blc.build_ready(isa):
        return blc.build_dir(isa) / "bin"
    return None


def find_gguf(model_dir: str, precision: str) -> Path:
    """The cached GGUF of `model_dir` in `precision`, converted now if missing (seconds, no network)."""
    return blc.convert(model_dir, precision)


def _free_port() -> int:
    from areal_async.launch.processes import free_port

    return free_port()


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    """Until GET `url` answers 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up; log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


async def _completion(session, url: str, prompt: list[int], n: int) -> tuple[int, float]:
    """One greedy /completion of exactly `n` tokens: (tokens made, seconds)."""
    body = {
        "prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
        "cache_prompt": True, "return_tokens": True, "stream": False,
    }  # fmt: skip
    t0 = time.perf_counter()
    async with session.post(url + "/completion", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"llama-server /completion -> HTTP {r.status}: {(await r.text())[:300]}")
        out = await r.json()
    return int(out.get("tokens_predicted", len(out.get("tokens", [])))), time.perf_counter() - t0


async def _workload(url: str, prompts: list[list[int]], lengths: list[int], repeats: int) -> dict[str, float]:
    """A warm-up of 8 tokens per request, then the workload `repeats` times: best wall and its latencies."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    conn = aiohttp.TCPConnector(limit=len(prompts) + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        await asyncio.gather(*(_completion(session, url, p, 8) for p in prompts))
        best: dict[str, float] = {"wall_s": float("inf")}
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(_completion(session, url, p, n) for p, n in zip(prompts, lengths)))
            wall = time.perf_counter() - t0
            made = sum(m for m, _ in outs)
            if made != sum(lengths):
                raise RuntimeError(f"llama-server made {made} tokens, expected {sum(lengths)}")
            if wall < best["wall_s"]:
                lat = sorted(s for _, s in outs)
                best = {"wall_s": wall, "latency_p50_s": lat[len(lat) // 2], "latency_max_s": lat[-1]}
    return best


def server_run(
    bin_dir: Path, gguf: Path, threads: int, prompts: list[list[int]], lengths: list[int], repeats: int,
    extra: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """llama-server `-np N` on the workload: useful tokens/s (best of `repeats`). Each slot gets room for the
    longest prompt plus the longest completion (non-unified KV, llama-server's default with an explicit -np)."""
    slot = max(map(len, prompts)) + max(lengths) + 16
    port = _free_port()
    cmd = [
        str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(len(prompts)), "-c", str(slot * len(prompts)), "-t", str(threads), "-tb", str(threads),
        "--no-webui", *(extra or []),
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="llama_server_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", proc, 300, log.name)
        best = asyncio.run(_workload(url, prompts, lengths, repeats))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "tokens_per_s": sum(lengths) / best["wall_s"],
        **best,
        "args": cmd[3:],
    }


def batched_decode(
    bin_dir: Path, gguf: Path, threads: int, prompt_len: int, steps: int, batches: tuple[int, ...] = (1, 64)
) -> dict[int, float]:
    """{batch: decode tokens/s} from one llama-batched-bench run (S_TG: decode tokens over decode time, after a
    prefill of `prompt_len` tokens per sequence)."""
    ctx = max(batches) * (prompt_len + steps) + 64
    cmd = [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
        "-npp", str(prompt_len), "-ntg", str(steps), "-npl", ",".join(map(str, batches)),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {out.stderr[-1500:]}")
    rates: dict[int, float] = {}
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    if set(rates) != set(batches):
        raise RuntimeError(f"llama-batched-bench gave batches {sorted(rates)}, wanted {list(batches)}")
    return rates


def llama_side(
    bin_dir: Path, model_dir: str, precisions: list[str], threads: int, prompts: list[list[int]],
    lengths: list[int], repeats: int, prompt_len: int, steps: int, server: bool = True,
    decoded: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict]:  # fmt: skip
    """Per precision: llama-server's workload run (unless `server` is False) and batch-1/64 decode rates, each the
    best of `repeats` runs; a precision in `decoded` keeps the decode rates given there (taken in alternation with
    the engine's, see inference_throughput.py) instead of measuring them apart."""
    res: dict[str, dict] = {}
    for prec in precisions:
        gguf = find_gguf(model_dir, prec)
        row: dict[str, Any] = {"gguf": os.path.basename(gguf)}
        if server:
            row["server"] = server_run(bin_dir, gguf, threads, prompts, lengths, repeats)
        if decoded and prec in decoded:
            row.update(decoded[prec])
        else:
            rates: dict[int, float] = {}
            for _ in range(max(1, repeats)):  # best of `repeats`, as the engine's decode rates are
                for b, r in batched_decode(bin_dir, gguf, threads, prompt_len, steps, (1, len(prompts))).items():
                    rates[b] = max(rates.get(b, 0.0), r)
            row["batch1_decode_tokens_per_s"] = rates[1]
            row["decode_tokens_per_s"] = rates[len(prompts)]
        res[prec] = row
        print(f"llama.cpp {prec}: {json.dumps({k: v for k, v in row.items() if k != 'server'})}", flush=True)
    return res
