"""Generation speed of the embedded server over HTTP, against transformers' batched `generate` and against this
machine's own GEMM limit, plus how fast a pause empties a busy server and how close the logprobs are.

    python benchmarks/inference_throughput.py --model smollm2-135m-instruct --threads 2 \
        --out benchmarks/out/inference_throughput_smollm2.json
    python benchmarks/inference_throughput.py --model tiny --out benchmarks/out/inference_throughput.json
    python benchmarks/inference_throughput.py --quick --out /tmp/x.json          # smoke test, not a measurement

`--model` is `tiny` (a Qwen2-style model built here: hidden 256, 4 layers), `smollm2-135m-instruct` (resolved by
`areal_async.model_store`), or any HF checkpoint directory.

Workload: `--requests` prompts (default 64): chat-templated user messages of random words for a model with a chat
template, else 16-64 random tokens; completion lengths lognormal (median 96, sigma 0.8, capped at 384), greedy,
ignore_eos, so both sides make exactly the same tokens.
- embedded: `python -m areal_async.serve` in its own process, driven by the real InferenceClient with every request
  in flight at once (continuous batching lets short requests leave early).
- hf: the same prompts as one left-padded batch through `model.generate` (KV cache, greedy, fp32 on CPU), which runs
  every row to the longest request. Useful tokens/s counts what the requests asked for (what a user gets); padded
  tokens/s counts every row to the longest (what the hardware did).
- decode MFU: 64 requests of the same length, run twice (16 and 16 + `--decode-steps` new tokens); the difference
  is pure decode at batch 64. Model FLOPs per token (2 x parameters in matmuls, LM head included, plus attention
  at the mean context) x decode tokens/s, divided by the GEMM roofline: the model's own matmul shapes at 64 rows
  timed in a plain loop in this process, same thread count, measured in this run.
- pause latency: `--requests` long requests decoding (non-streamed, with logprobs, as the RL client sends them),
  then pause(abort): the time until every one has come back with its partial output.
- logprobs: a few completions re-scored by transformers (teacher forcing); the largest difference is reported.
Both sides use the same torch thread count and never run at the same time; timed runs alternate (best of
`--repeats` each), so that load changing on a shared machine hits both alike.
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

MODEL_NAMES = ("tiny", "smollm2-135m-instruct")
WORDS = (
    "the cat sat on a mat while seven quick foxes ran over lazy dogs near old red barns under bright "
    "stars and one small bird sang songs about rivers mountains numbers apples code tests trains"
).split()


def machine_info(torch, load_start: tuple[float, float, float]) -> dict[str, Any]:
    """What the figures ran on: the CPU, the ISA torch dispatches to (ATEN_CPU_CAPABILITY and friends can hold it
    below the CPU's), the C kernels' target, and the load average (1/5/15 min) at the start and the end."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_march": os.environ.get("AREAL_KERNEL_MARCH", "native"),
        "isa_env": {
            k: os.environ[k]
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if k in os.environ
        },
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }


def resolve_model(name: str, tmp: str, seed: int, quick: bool) -> str:
    """A checkpoint directory for `name` (see the module docstring)."""
    if os.path.isdir(name):
        return name
    if name == "tiny":
        from areal_async.testing.tiny import make_tiny_checkpoint

        kw = (
            dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
            if quick
            else dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768)
        )
        return make_tiny_checkpoint(os.path.join(tmp, "model"), "qwen2", seed=seed, max_position_embeddings=1024, **kw)
    try:
        from areal_async.model_store import resolve_model_path
    except ImportError:
        raise SystemExit(
            f"--model {name}: areal_async.model_store is not available here; pass a checkpoint directory instead"
        ) from None
    return resolve_model_path(name)


def _lengths(rng, n: int, median: float, sigma: float, max_new: int) -> list[int]:
    return np.clip(rng.lognormal(np.log(median), sigma, size=n), 8, max_new).astype(int).tolist()


def make_workload(
    n: int, seed: int, vocab_lo: int, vocab_hi: int, median: float, sigma: float, max_new: int
) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16-64 random token ids in [vocab_lo, vocab_hi) and lognormal completion lengths (also used by
    benchmarks/client_streaming.py)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(16, 65))).tolist() for _ in range(n)]
    return prompts, _lengths(rng, n, median, sigma, max_new)


def make_chat_workload(
    tok, n: int, seed: int, median: float, sigma: float, max_new: int
) -> tuple[list[list[int]], list[int]]:
    """Chat-templated user messages of 8-40 random words, and lognormal completion lengths."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 40))))
        text = tok.apply_chat_template([{"role": "user", "content": words}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts, _lengths(rng, n, median, sigma, max_new)


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


async def wait_healthy(client) -> None:
    for _ in range(600):
        if all((await client.health()).values()):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("server never became healthy")


async def embedded_run(client, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list]:
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
        raise RuntimeError(f"embedded server made {made} tokens, expected {sum(lengths)}")
    return wall, results


def real_engine_run(
    python: str, model_dir: str, threads: int, prompts: list[list[int]], lengths: list[int], repeats: int, dtype: str
) -> dict[str, Any]:
    """The same workload through a real SGLang server started as `server.backend=sglang` starts one (its own
    interpreter, the CPU engine, `threads` threads), driven by the same client: useful tokens/s, best of `repeats`."""
    import urllib.request

    from areal_async.inference.client import InferenceClient
    from areal_async.launch.processes import free_port
    from areal_async.launch.sglang_server import installed_release, sglang_server_cmd
    from areal_async.types import SamplingParams

    port = free_port()
    cmd = sglang_server_cmd(
        model_dir, host="127.0.0.1", port=str(port), api_key=None, extra_args=[], dtype=dtype, python=python,
        device="cpu", threads=threads,
    )  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="sglang_bench_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SGLang did not come up; log: {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1.0)

        async def run() -> float:
            async with InferenceClient([url], probe_interval_s=0.2) as client:
                warm = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
                await asyncio.gather(*(client.agenerate(p, warm) for p in prompts))
                return min([(await embedded_run(client, prompts, lengths))[0] for _ in range(repeats)])

        wall = asyncio.run(run())
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "sglang_release": installed_release(python, "sglang"),
        "sglang_dtype": dtype,
        "sglang_tokens_per_s": sum(lengths) / wall,
        "sglang_wall_s": wall,
    }


async def raw_generate(client, prompt: list[int], n: int, logprobs: bool = False) -> dict:
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


# ---- transformers and the roofline --------------------------------------------------------------------------------


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


def model_flops(cfg: dict) -> dict[str, Any]:
    """Matmul shapes of one token through the model ([in, out] and count), and FLOPs per token."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    shapes = [
        ((h, (heads + 2 * kv) * d), layers),
        ((heads * d, h), layers),
        ((h, 2 * i), layers),
        ((i, h), layers),
        ((h, cfg["vocab_size"]), 1),
    ]
    per_token = sum(2 * a * b * n for (a, b), n in shapes)
    return {
        "shapes": shapes,
        "matmul_flops_per_token": per_token,
        "attn_flops_per_ctx_token": 4 * layers * heads * d,
    }  # q.k and p.v, per token of context


def gemm_roofline(shapes: list, rows: int, threads: int, seconds: float = 3.0) -> float:
    """FLOP/s of the model's own matmuls ([rows, in] x [in, out], each as often as the model has it) in a plain
    loop: what this machine does for exactly this work with nothing else in the way. Best of several rounds."""
    import torch

    torch.set_num_threads(threads)
    mats = [(torch.randn(rows, a), torch.randn(b, a), n) for (a, b), n in shapes]
    flops = sum(2 * rows * a * b * n for (a, b), n in shapes)

    def once() -> float:
        t0 = time.perf_counter()
        for x, w, n in mats:
            for _ in range(n):
                torch.mm(x, w.t())
        return time.perf_counter() - t0

    once()
    best, t_end = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        best = min(best, once())
    return flops / best


# ---- the run ------------------------------------------------------------------------------------------------------


async def bench(
    url: str, model_dir: str, cfg: dict, prompts: list[list[int]], lengths: list[int], args, threads: int
) -> dict[str, Any]:
    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    hf = HFGenerate(model_dir, prompts)
    hf.run(4)  # warm-up
    longest = max(lengths)
    res: dict[str, Any] = {}
    async with InferenceClient([url], probe_interval_s=0.2) as client:
        await wait_healthy(client)
        await asyncio.gather(
            *(client.agenerate(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts)
        )  # warm-up
        emb_wall, hf_wall, results = math.inf, math.inf, []
        for _ in range(args.repeats):
            wall, out = await embedded_run(client, prompts, lengths)
            if wall < emb_wall:
                emb_wall, results = wall, out
            if not args.skip_hf:
                hf_wall = min(hf_wall, hf.run(longest))
        made = sum(lengths)
        lat = sorted(r.latency_s for r in results)
        res.update(
            {
                "embedded_tokens_per_s": made / emb_wall,
                "embedded_wall_s": emb_wall,
                "tokens": made,
                "embedded_latency_p50_s": lat[len(lat) // 2],
                "embedded_latency_max_s": lat[-1],
            }
        )
        if not args.skip_hf:
            res.update(
                {
                    "hf_tokens_per_s": made / hf_wall,
                    "hf_wall_s": hf_wall,
                    "hf_padded_tokens_per_s": len(prompts) * longest / hf_wall,
                }
            )

        # decode at a fixed batch: the difference of two runs of the same prompts is pure decode
        batch = prompts[: args.decode_batch] * -(-args.decode_batch // len(prompts))
        batch = batch[: args.decode_batch]
        short, long_ = 16, 16 + args.decode_steps
        walls = {short: math.inf, long_: math.inf}
        for _ in range(args.repeats):
            for n in (short, long_):
                t0 = time.perf_counter()
                await asyncio.gather(*(raw_generate(client, p, n) for p in batch))
                walls[n] = min(walls[n], time.perf_counter() - t0)
        decode_tps = len(batch) * args.decode_steps / (walls[long_] - walls[short])
        mean_ctx = sum(map(len, batch)) / len(batch) + 16 + args.decode_steps / 2
        fl = model_flops(cfg)
        flops_per_token = fl["matmul_flops_per_token"] + fl["attn_flops_per_ctx_token"] * mean_ctx
        roof = gemm_roofline(fl["shapes"], len(batch), threads)
        res.update(
            {
                "decode_batch": len(batch),
                "decode_steps": args.decode_steps,
                "decode_tokens_per_s": decode_tps,
                "decode_mean_context": mean_ctx,
                "flops_per_token": flops_per_token,
                "gemm_roofline_gflops": roof / 1e9,
                "decode_gflops": decode_tps * flops_per_token / 1e9,
                "decode_mfu": decode_tps * flops_per_token / roof,
                "roofline_tokens_per_s": roof / fl["matmul_flops_per_token"],
                "embedded_mfu": made * flops_per_token / emb_wall / roof,
            }
        )

        outs = await asyncio.gather(
            *(raw_generate(client, p, min(n, 64), logprobs=True) for p, n in zip(prompts[:4], lengths[:4]))
        )
        res["max_logprob_diff_vs_hf"] = max(hf.max_logprob_diff(p, o) for p, o in zip(prompts[:4], outs))
        res.update(await pause_latency(client, url, prompts, args.pause_new, walls[short]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny", help=f"{' | '.join(MODEL_NAMES)} | a checkpoint directory")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload: a smoke test, not a measurement")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side, best kept (default 2; quick 1)")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode tokens per request in the MFU runs")
    ap.add_argument("--decode-batch", type=int, default=None, help="requests in the MFU runs (default 64)")
    ap.add_argument("--pause-new", type=int, default=None, help="max_new_tokens of the pause-latency requests")
    ap.add_argument("--skip-hf", action="store_true", help="embedded side only (for A/B runs of engine changes)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for areal_async.serve")
    ap.add_argument("--sglang-python", default=None, help="also run the workload on real SGLang from this interpreter")
    ap.add_argument("--sglang-dtype", default="bfloat16", help="SGLang's --dtype (bfloat16: its fastest on a CPU)")
    args = ap.parse_args()
    if args.quick:
        n_req, median, sigma, max_new = args.requests or 8, 12.0, 0.5, 32
    else:
        n_req, median, sigma, max_new = args.requests or 64, 96.0, 0.8, 384
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.decode_steps = args.decode_steps or (16 if args.quick else 64)
    args.decode_batch = args.decode_batch or (8 if args.quick else 64)
    threads = args.threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_inf_") as tmp:
        model_dir = resolve_model(args.model, tmp, args.seed, args.quick)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        tok = AutoTokenizer.from_pretrained(model_dir)
        chat = bool(getattr(tok, "chat_template", None)) and args.model != "tiny" and not args.quick
        if chat:
            prompts, lengths = make_chat_workload(tok, n_req, args.seed, median, sigma, max_new)
        else:
            prompts, lengths = make_workload(n_req, args.seed, 10, cfg["vocab_size"], median, sigma, max_new)
        ctx = cfg.get("max_position_embeddings", 1024)
        args.pause_new = args.pause_new or min(900, ctx - max(map(len, prompts)) - 1)

        proc, url = start_server(model_dir, threads, args.server_arg)
        try:
            res = asyncio.run(bench(url, model_dir, cfg, prompts, lengths, args, threads))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        if args.sglang_python:  # after the embedded server stopped: the two never share the cores
            res.update(
                real_engine_run(
                    args.sglang_python, model_dir, threads, prompts, lengths, args.repeats, args.sglang_dtype
                )
            )
            res["embedded_over_sglang"] = res["embedded_tokens_per_s"] / res["sglang_tokens_per_s"]
    if "hf_tokens_per_s" in res:
        res["ratio"] = res["embedded_tokens_per_s"] / res["hf_tokens_per_s"]
    result = {
        **res,
        "settings": {
            "model": args.model,
            "quick": args.quick,
            "requests": n_req,
            "threads": threads,
            "repeats": args.repeats,
            "chat_prompts": chat,
            "prompt_tokens": {"min": min(map(len, prompts)), "max": max(map(len, prompts))},
            "max_new_tokens_lognormal": {"median": median, "sigma": sigma, "max": max_new},
            "sum_new_tokens": sum(lengths),
            "longest": max(lengths),
            "pause_max_new_tokens": args.pause_new,
            "server_args": args.server_arg,
            "greedy": True,
            "ignore_eos": True,
        },
        "machine": machine_info(torch, load_start),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    rows = [("embedded tokens/s (HTTP)", f"{res['embedded_tokens_per_s']:.0f}")]
    if "ratio" in res:
        rows += [
            (
                "transformers useful / padded tokens/s",
                f"{res['hf_tokens_per_s']:.0f} / {res['hf_padded_tokens_per_s']:.0f}",
            ),
            ("ratio to useful (target >= 4)", f"{res['ratio']:.2f}"),
        ]
    if "sglang_tokens_per_s" in res:
        rows.append(
            (
                f"SGLang {res['sglang_release']} ({res['sglang_dtype']}) tokens/s, embedded / SGLang",
                f"{res['sglang_tokens_per_s']:.0f}, {res['embedded_over_sglang']:.2f}x",
            )
        )
    rows += [
        (f"decode tokens/s at batch {res['decode_batch']}", f"{res['decode_tokens_per_s']:.0f}"),
        ("GEMM roofline GFLOP/s (same rows, threads)", f"{res['gemm_roofline_gflops']:.0f}"),
        ("decode MFU (target >= 0.5)", f"{res['decode_mfu']:.2f}"),
        ("whole-run MFU", f"{res['embedded_mfu']:.2f}"),
        ("pause to all returned ms (target < 50)", f"{res['pause_latency_ms']:.1f}"),
        ("max |logprob - transformers| (target < 1e-3)", f"{res['max_logprob_diff_vs_hf']:.2e}"),
        ("requests / tokens", f"{n_req} / {sum(lengths)} (longest {max(lengths)})"),
    ]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
