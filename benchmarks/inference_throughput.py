"""Generation throughput of the embedded server over HTTP against transformers' own batched `generate`, and how
fast a pause(abort) empties a busy server.

    python benchmarks/inference_throughput.py --out benchmarks/out/inference_throughput.json [--quick]

Workload: `--requests` prompts of random characters (16..64 tokens) with long-tailed completion lengths
(max_new_tokens ~ lognormal, clipped), greedy, ignore_eos, so both sides make exactly the same tokens.
- embedded: `python -m areal_async.serve` in its own process, driven by the real InferenceClient with every request
  in flight at once (continuous batching lets short requests leave early).
- hf: the same prompts as one left-padded batch through `model.generate` (use_cache, greedy, fp32 on CPU), which
  runs to the longest request; EOS is suppressed with min_new_tokens. Its tokens/s counts the tokens the requests
  asked for, because running the batch to the longest is the real cost a user pays.
- pause latency: with `--requests` long requests generating, the time from the pause call until every in-flight
  request has come back (raw /generate calls, so the abort answers are observed directly).
Both sides use the same torch thread count and never run at the same time; their timed runs alternate (best of
`--repeats` each) so that load changing on a shared machine hits both alike. On a busy machine pass --threads 1:
with other processes on the cores, multi-threaded torch matmuls wait on each other and slow down many times over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np


def make_workload(n: int, seed: int, vocab_lo: int, vocab_hi: int, mean_new: float, sigma: float,
                  max_new: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(16, 65))).tolist() for _ in range(n)]
    lengths = np.clip(rng.lognormal(np.log(mean_new), sigma, size=n), 8, max_new).astype(int).tolist()
    return prompts, lengths


def _drain(stream) -> None:
    """Keep reading the server's output so its pipe never fills and blocks it."""
    for _ in stream:
        pass


def start_server(model_dir: str, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Launch `python -m areal_async.serve` and return (process, URL) once it printed its URL."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "areal_async.serve", "--model", model_dir, "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 300
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


async def wait_healthy(client) -> None:
    for _ in range(600):
        if all((await client.health()).values()):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("server never became healthy")


class HFGenerate:
    """transformers' batched generate over all prompts at once: left padding, KV cache, greedy, EOS suppressed."""

    def __init__(self, model_dir: str, prompts: list[list[int]], threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        self.width = max(len(p) for p in prompts)
        self.ids = torch.full((len(prompts), self.width), self.pad, dtype=torch.long)  # [B, T] left padded
        self.mask = torch.zeros_like(self.ids)  # [B, T]
        for i, p in enumerate(prompts):
            self.ids[i, self.width - len(p):] = torch.tensor(p)
            self.mask[i, self.width - len(p):] = 1

    def run(self, n_new: int) -> float:
        """Seconds for one generate of `n_new` tokens per row."""
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=n_new,
                                      min_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=self.pad)
        wall = time.perf_counter() - t0
        assert out.shape[1] == self.width + n_new  # [B, T + n_new]
        return wall


async def embedded_run(client, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list]:
    from areal_async.types import SamplingParams

    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        client.agenerate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, lengths)))
    wall = time.perf_counter() - t0
    made = sum(len(r.output_ids) for r in results)
    if made != sum(lengths):
        raise RuntimeError(f"embedded server made {made} tokens, expected {sum(lengths)}")
    return wall, results


async def pause_latency(client, prompts: list[list[int]], pause_new: int) -> dict[str, Any]:
    """Every request in flight and decoding, then pause(abort): time until the last one has come back."""
    returned: list[float] = []

    async def raw(p: list[int]) -> dict:
        out = await client.acompletion_raw("/generate", {
            "input_ids": p, "sampling_params": {"max_new_tokens": pause_new, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, "stream": False})
        returned.append(time.perf_counter())
        return out

    tasks = [asyncio.create_task(raw(p)) for p in prompts]
    await asyncio.sleep(0.5 + 0.01 * len(prompts))  # admitted and decoding; far from done at pause_new tokens
    t_pause = time.perf_counter()
    await client.pause(mode="abort")
    t_call = time.perf_counter()
    outs = await asyncio.gather(*tasks)
    await client.resume()
    aborted = sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    if aborted < len(prompts):
        print(f"warning: only {aborted} of {len(prompts)} requests were still running at the pause", file=sys.stderr)
    return {"pause_latency_ms": (max(returned) - t_pause) * 1000, "pause_call_ms": (t_call - t_pause) * 1000,
            "pause_aborted_requests": aborted, "pause_in_flight": len(prompts)}


async def bench(url: str, model_dir: str, prompts: list[list[int]], lengths: list[int], pause_new: int,
                repeats: int, threads: int) -> dict[str, Any]:
    """Alternate embedded and HF runs (best of `repeats` each), so that load drifting on a shared machine hits
    both sides alike. The server idles while HF runs."""
    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    hf = HFGenerate(model_dir, prompts, threads)
    hf.run(4)  # warm-up
    longest = max(lengths)
    async with InferenceClient([url], probe_interval_s=0.2) as client:
        await wait_healthy(client)
        await asyncio.gather(*(client.agenerate(p, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                  ignore_eos=True)) for p in prompts[:8]))  # warm-up
        emb_wall, hf_wall, results = math.inf, math.inf, []
        for _ in range(repeats):
            wall, res = await embedded_run(client, prompts, lengths)
            if wall < emb_wall:
                emb_wall, results = wall, res
            hf_wall = min(hf_wall, hf.run(longest))
        pause = await pause_latency(client, prompts, pause_new)
    lat = sorted(r.latency_s for r in results)
    made = sum(lengths)
    return {"embedded_tokens_per_s": made / emb_wall, "embedded_wall_s": emb_wall, "tokens": made,
            "embedded_latency_p50_s": lat[len(lat) // 2], "embedded_latency_max_s": lat[-1],
            "hf_tokens_per_s": made / hf_wall, "hf_wall_s": hf_wall,
            "hf_padded_tokens_per_s": len(prompts) * longest / hf_wall, **pause}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model and workload: a smoke test, not a measurement")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side, best kept (default 2; quick 1)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for areal_async.serve")
    args = ap.parse_args()

    from areal_async.tasks.char_tokenizer import SPECIAL_TOKENS
    from areal_async.testing.tiny import make_tiny_checkpoint

    if args.quick:
        model_kw = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
        n_req, mean_new, sigma, max_new = args.requests or 8, 12.0, 0.5, 32
    else:
        model_kw = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768)
        n_req, mean_new, sigma, max_new = args.requests or 64, 96.0, 0.8, 512
    pause_new = 900  # long enough that nothing finishes before the pause; prompts <= 64, context 1024
    repeats = args.repeats or (1 if args.quick else 2)
    threads = args.threads or os.cpu_count() or 1

    with tempfile.TemporaryDirectory(prefix="bench_inf_") as tmp:
        model_dir = make_tiny_checkpoint(os.path.join(tmp, "model"), "qwen2", seed=args.seed,
                                         max_position_embeddings=1024, **model_kw)
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts, lengths = make_workload(n_req, args.seed, len(SPECIAL_TOKENS), vocab, mean_new, sigma, max_new)

        proc, url = start_server(model_dir, threads, args.server_arg)
        try:
            res = asyncio.run(bench(url, model_dir, prompts, lengths, pause_new, repeats, threads))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    result = {**res, "ratio": res["embedded_tokens_per_s"] / res["hf_tokens_per_s"],
              "settings": {"quick": args.quick, "requests": n_req, "threads": threads, "repeats": repeats,
                           "model": model_kw,
                           "max_new_tokens_lognormal": {"median": mean_new, "sigma": sigma, "max": max_new},
                           "sum_new_tokens": sum(lengths), "longest": max(lengths), "pause_max_new_tokens": pause_new,
                           "server_args": args.server_arg, "greedy": True, "ignore_eos": True}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    rows = [("embedded tokens/s (HTTP)", f"{res['embedded_tokens_per_s']:.0f}"),
            ("HF generate tokens/s", f"{res['hf_tokens_per_s']:.0f}"),
            ("ratio (target >= 5)", f"{result['ratio']:.2f}"),
            ("pause latency ms (target < 50)", f"{res['pause_latency_ms']:.1f}"),
            ("requests / tokens", f"{n_req} / {sum(lengths)} (longest {max(lengths)})")]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
