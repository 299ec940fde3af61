"""Generation speed of the embedded server over HTTP against what else could serve the same model on this CPU
(transformers' batched `generate`, llama.cpp's llama-server, real SGLang and vLLM) and against this machine's own GEMM
limit, plus how fast a pause empties a busy server and how close the logprobs are.

    python benchmarks/inference_throughput.py --model smollm2-135m-instruct --threads 2 \
        --llama-precisions f32,bf16 --embedded-dtypes bfloat16 \
        --sglang-python ~/.cache/areal_async/engines/sglang-0.5.23/bin/python \
        --vllm-python ~/.cache/areal_async/engines/vllm-0.32.0/bin/python \
        --out benchmarks/results/inference_throughput_smollm2.json
    python benchmarks/inference_throughput.py --model tiny --out benchmarks/out/inference_throughput.json
    python benchmarks/inference_throughput.py --quick --out /tmp/x.json          # smoke test, not a measurement

`--model` is `tiny` (a Qwen2-style model built here: hidden 256, 4 layers), `smollm2-135m-instruct` (resolved by
`areal_async.model_store`), or any HF checkpoint directory.

Workload: `--requests` prompts (default 64): chat-templated user messages of random words for a model with a chat
template, else 16-64 random tokens; completion lengths lognormal (median 96, sigma 0.8, capped at 384), greedy,
ignore_eos, so every side makes exactly the same number of tokens.
- embedded: `python -m areal_async.serve` in its own process, driven by the real InferenceClient with every request
  in flight at once (continuous batching lets short requests leave early). `--embedded-dtypes` adds runs of the
  server at other dtypes (workload and decode rates only), for per-precision ratios.
- hf: the same prompts as one left-padded batch through `model.generate` (KV cache, greedy, fp32 on CPU), which runs
  every row to the longest request. Useful tokens/s counts what the requests asked for (what a user gets); padded
  tokens/s counts every row to the longest (what the hardware did).
- decode: the workload's prompts at batch 64 (`decode_tokens_per_s`) and batch 1 (`batch1_decode_tokens_per_s`),
  run twice (16 and 16 + `--decode-steps` new tokens); the difference is pure decode. Best of `--decode-rounds`
  rounds (default 4); every round's rates are in `decode_rounds`.
- llama.cpp (benchmarks/llama_server_side.py), when a build of benchmarks/build_llama_cpp.py is found (or
  `--llama-cpp DIR`): llama-server `-np 64` on the workload per precision, and llama-batched-bench's decode rates at
  batch 1 and 64. Written as two separate comparisons: end to end (scheduling: who keeps the cores busy through the
  long tail of finishing requests) and decode (kernels: tokens/s at a fixed batch). At the precisions the embedded
  server runs, llama-batched-bench runs once in every decode round, right after the engine's rates, while the
  server idles (see embedded_decode): both sides' rates come from the same minutes of the host.
- SGLang / vLLM (benchmarks/engine_sides.py): real servers from their own interpreters, through the same client.
- roofline and MFU (benchmarks/roofline.py): model FLOPs per token (2 x parameters in matmuls, LM head included,
  plus attention at the mean context) x decode tokens/s, divided by the best rate measured in this run on the
  model's own matmul shapes at 64 rows and the same threads, across torch, oneDNN, MKL and ggml, per dtype and ISA
  (native, and AVX2 when `--roofline-isas` names it).
- pause latency: `--requests` long requests decoding (non-streamed, with logprobs, as the RL client sends them),
  then pause(abort): the time until every one has come back with its partial output.
- logprobs: a few completions re-scored by transformers (teacher forcing); the largest difference is reported.
Every side uses the same thread count and no two ever run at the same time; embedded and transformers runs alternate
(best of `--repeats` each), so that load changing on a shared machine hits both alike. The JSON records the CPU, its
ISA flags and the load average at the start and end: on a shared machine read speeds with the load beside them.
There, run it with OMP_WAIT_POLICY=PASSIVE (every side inherits it; the JSON records it): with more runnable threads
than cores, OpenMP threads spinning at barriers cost ggml's 2-thread GEMMs 3-4x and torch's far less, so the default
policy would measure the load rather than the kernels. On a quiet machine leave it unset: passive threads sleep
between parallel regions, and the engine's decode step opens several a layer where ggml opens one a step (held to
AVX2, batch-64 decode measured 0.96x llama.cpp's with it and 1.11x without, same hour).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# start_server, wait_healthy and friends are imported from this module by other benchmarks: re-exported here
from engine_sides import (  # noqa: E402,F401
    HFGenerate,
    decode_rate,
    embedded_run,
    pause_latency,
    raw_generate,
    server_info,
    sglang_side,
    start_server,
    stop,
    vllm_side,
    wait_healthy,
)
from roofline import model_flops  # noqa: E402,F401

MODEL_NAMES = ("tiny", "smollm2-135m-instruct")
ISA_FLAGS_OF_NOTE = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
                     "amx_bf16")  # fmt: skip
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}  # the server's dtype -> the roofline's / llama.cpp's name
LLAMA_OF = {"fp32": "f32", "bf16": "bf16"}
WORDS = (
    "the cat sat on a mat while seven quick foxes ran over lazy dogs near old red barns under bright "
    "stars and one small bird sang songs about rivers mountains numbers apples code tests trains"
).split()


def machine_info(torch, load_start: tuple[float, float, float]) -> dict[str, Any]:
    """What the figures ran on: the CPU, the ISA torch dispatches to (ATEN_CPU_CAPABILITY and friends can hold it
    below the CPU's), the C kernels' target, and the load average (1/5/15 min) at the start and the end."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    except OSError:
        pass
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        uptime = ""
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "isa_flags": [f for f in ISA_FLAGS_OF_NOTE if f in flags],
        "uptime_end": uptime,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_march": os.environ.get("AREAL_KERNEL_MARCH", "native"),
        "isa_env": {
            k: os.environ[k]
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_WAIT_POLICY")
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


# ---- the run ------------------------------------------------------------------------------------------------------


async def embedded_decode(
    client, prompts: list[list[int]], args, rival: Callable[[], dict[int, float]] | None = None
) -> dict[str, Any]:
    """The embedded server's decode rates at batch `--decode-batch` (64) and 1 (see decode_rate), best of
    `--decode-rounds` rounds. With `rival` (one llama-batched-bench run at the server's precision: {batch:
    tokens/s}), every round runs it right after the engine's two rates, while the server idles, and its best rates
    come back as `llama_decode`. Why in turns: under a VM the host moves a batch-1 step by up to ~1.4x for tens of
    seconds at a time (2-core AMD EPYC Zen 5: the same process's step went 8.3 -> 11 ms and back with its threads
    on the same cores; both engines read every weight once a token, so both follow the host's memory bandwidth).
    Rates taken minutes apart then compare two moments of the host as much as two engines; in turns, every round
    gives both sides the same stretch of time, and each side keeps its best round."""
    rounds: list[dict[str, float]] = []
    big: dict[str, Any] = {}
    one: dict[str, Any] = {}
    theirs: dict[int, float] = {}
    for _ in range(args.decode_rounds):
        b = await decode_rate(client, prompts, args.decode_batch, args.decode_steps, 1)
        o = await decode_rate(client, prompts, 1, args.decode_steps, 1)
        big = b if not big or b["tokens_per_s"] > big["tokens_per_s"] else big
        one = o if not one or o["tokens_per_s"] > one["tokens_per_s"] else one
        rnd = {"batch64": b["tokens_per_s"], "batch1": o["tokens_per_s"]}
        if rival is not None:
            try:
                rates = await asyncio.to_thread(rival)
            except Exception:  # noqa: BLE001 - llama.cpp is optional: its rates are then taken apart, later
                traceback.print_exc()
                rival, theirs = None, {}
                rounds = [{k: v for k, v in r.items() if not k.startswith("llama_")} for r in rounds]
            else:
                rnd |= {"llama_batch64": rates[args.decode_batch], "llama_batch1": rates[1]}
                theirs = {k: max(theirs.get(k, 0.0), r) for k, r in rates.items()}
        rounds.append(rnd)
    out = {
        "decode_batch": args.decode_batch,
        "decode_steps": args.decode_steps,
        "decode_tokens_per_s": big["tokens_per_s"],
        "decode_mean_context": big["mean_context"],
        "batch1_decode_tokens_per_s": one["tokens_per_s"],
        "batch1_decode_mean_context": one["mean_context"],
        "decode_proportional": big["proportional"] or one["proportional"],
        "decode_rounds": rounds,
        "_prefill_s": big["short_wall_s"],
    }
    if rival is not None:
        out["llama_decode"] = {
            "batch1_decode_tokens_per_s": theirs[1],
            "decode_tokens_per_s": theirs[args.decode_batch],
            "decode_interleaved_rounds": len(rounds),
        }
    return out


async def bench(
    url: str, model_dir: str, prompts: list[list[int]], lengths: list[int], args, rivals: dict[str, Callable]
) -> dict[str, Any]:
    """The embedded server against transformers (alternating, best of `--repeats` each), its decode rates (in turns
    with llama.cpp's at the server's precision, `rivals`), the pause of a busy server, and its logprobs against
    transformers'."""
    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    hf = HFGenerate(model_dir, prompts)
    hf.run(4)  # warm-up
    longest = max(lengths)
    res: dict[str, Any] = {"embedded_dtype": (await server_info(url)).get("dtype")}
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
        rival = rivals.get(DTYPE_NAMES.get(res["embedded_dtype"], res["embedded_dtype"]))
        res.update(await embedded_decode(client, prompts, args, rival))
        outs = await asyncio.gather(
            *(raw_generate(client, p, min(n, 64), logprobs=True) for p, n in zip(prompts[:4], lengths[:4]))
        )
        res["max_logprob_diff_vs_hf"] = max(hf.max_logprob_diff(p, o) for p, o in zip(prompts[:4], outs))
        res.update(await pause_latency(client, url, prompts, args.pause_new, res.pop("_prefill_s")))
    return res


def embedded_at(
    model_dir: str, dtype: str, prompts: list[list[int]], lengths: list[int], args, rivals: dict[str, Callable]
) -> dict[str, Any]:
    """The embedded server started with `--dtype dtype`: the workload's useful tokens/s and the decode rates (in
    turns with llama.cpp's at the same precision, `rivals`)."""
    from areal_async.inference.client import InferenceClient

    proc, url = start_server(model_dir, args.threads, [*args.server_arg, "--dtype", dtype])
    try:

        async def run() -> dict[str, Any]:
            async with InferenceClient([url], probe_interval_s=0.2) as client:
                await wait_healthy(client)
                served = (await server_info(url)).get("dtype")
                await embedded_run(client, prompts, [8] * len(prompts))  # warm-up
                wall = min([(await embedded_run(client, prompts, lengths))[0] for _ in range(args.repeats)])
                rival = rivals.get(DTYPE_NAMES.get(served, served))
                dec = await embedded_decode(client, prompts, args, rival)
                dec.pop("_prefill_s")
                return {"dtype": served, "tokens_per_s": sum(lengths) / wall, "wall_s": wall, **dec}

        return asyncio.run(run())
    finally:
        stop(proc, 30)


def main() -> None:
    import inference_report as rep

    args = rep.parse_args(__doc__.split("\n")[0])
    if args.quick:
        n_req, median, sigma, max_new = args.requests or 8, 12.0, 0.5, 32
    else:
        n_req, median, sigma, max_new = args.requests or 64, 96.0, 0.8, 384
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.decode_steps = args.decode_steps or (16 if args.quick else 64)
    args.decode_rounds = args.decode_rounds or (1 if args.quick else 4)
    args.decode_batch = args.decode_batch or (8 if args.quick else 64)
    args.threads = threads = args.threads or os.cpu_count() or 1
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

        try:  # llama.cpp's decode runs at the engine's precisions, taken in turns with the engine's own
            rivals = rep.llama_decoders(args, model_dir, prompts)
        except Exception:  # noqa: BLE001 - llama.cpp is optional to the run: its rates are then taken apart
            traceback.print_exc()
            rivals = {}
        proc, url = start_server(model_dir, threads, args.server_arg)
        try:
            res = asyncio.run(bench(url, model_dir, prompts, lengths, args, rivals))
        finally:
            stop(proc, 30)
        main_dtype = DTYPE_NAMES.get(res["embedded_dtype"], res["embedded_dtype"])
        interleaved = {LLAMA_OF[main_dtype]: res.pop("llama_decode")} if "llama_decode" in res else {}
        by_dtype = {
            main_dtype: {k: res[k] for k in ("decode_tokens_per_s", "batch1_decode_tokens_per_s", "decode_rounds")}
            | {"tokens_per_s": res["embedded_tokens_per_s"], "dtype": res["embedded_dtype"]}
        }
        for dt in args.embedded_dtypes:  # one server at a time: each after the last one stopped
            row = embedded_at(model_dir, dt, prompts, lengths, args, rivals)
            name = DTYPE_NAMES.get(row["dtype"], row["dtype"])
            if "llama_decode" in row:
                interleaved[LLAMA_OF[name]] = row.pop("llama_decode")
            by_dtype[name] = row
        res["embedded_by_dtype"] = by_dtype

        # the other engines, one after the other, each after the previous one stopped; one that fails is recorded
        # as an error and the rest still run (a 20-minute run should not be lost to one engine's start-up)
        if args.sglang_python:
            res.update(rep.guarded("sglang", sglang_side, args.sglang_python, model_dir, threads, prompts, lengths,
                                   args.repeats, args.sglang_dtype))  # fmt: skip
        if args.vllm_python:
            res.update(rep.guarded("vllm", vllm_side, args.vllm_python, model_dir, threads, prompts, lengths,
                                   args.repeats, args.vllm_dtype))  # fmt: skip
        res.update(rep.guarded("llama_cpp", rep.llama_cpp_runs, args, model_dir, prompts, lengths, interleaved))
        for name in ("sglang", "vllm"):
            if f"{name}_tokens_per_s" in res:
                res[f"embedded_over_{name}"] = res["embedded_tokens_per_s"] / res[f"{name}_tokens_per_s"]
        res.update(rep.roofline_and_mfu(args, cfg, res, main_dtype))
    if "hf_tokens_per_s" in res:
        res["ratio"] = res["embedded_tokens_per_s"] / res["hf_tokens_per_s"]
    res.update(rep.llama_cpp_ratios(res))
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
    rep.print_summary(result)


if __name__ == "__main__":
    main()
