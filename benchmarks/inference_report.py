"""The inference benchmark's options, its llama.cpp runs, roofline and ratios, and its printed table (the measuring of
the Python-served sides is in engine_sides.py; the run itself in inference_throughput.py).

The ratios against llama.cpp come in two kinds, never mixed:
- `vs_llama_cpp.end_to_end`: useful tokens/s on the whole workload, engine / llama-server at the same precision,
  and `embedded_over_best_llama_server` against llama-server's fastest precision. This is scheduling as much as
  arithmetic: `tail_efficiency` (useful tokens/s over the same server's batch-64 decode rate) says how much of its
  own decode speed each server keeps through the long tail of finishing requests;
- `vs_llama_cpp.decode_batch64` / `decode_batch1`: decode tokens/s at a fixed batch, engine / llama.cpp, per
  precision: the kernels. Each side's best round; at the precisions the embedded server serves, llama.cpp's rounds
  alternate with the engine's (inference_throughput.py's embedded_decode), and `decode_batch64_paired` /
  `decode_batch1_paired` give the median of the rounds' own ratios beside them.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import llama_server_side as lss
import roofline as rl

DTYPES = ("fp32", "bf16")


def parse_args(description: str) -> argparse.Namespace:
    """The benchmark's command line (see inference_throughput.py's docstring)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny", help="tiny | smollm2-135m-instruct | a checkpoint directory")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload: a smoke test, not a measurement")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="threads for every side (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side, best kept (default 2; quick 1)")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode tokens per request in the decode runs")
    ap.add_argument("--decode-rounds", type=int, default=None, help="decode rounds per side, best kept (default 4)")
    ap.add_argument("--decode-batch", type=int, default=None, help="requests in the batch decode runs (default 64)")
    ap.add_argument("--pause-new", type=int, default=None, help="max_new_tokens of the pause-latency requests")
    ap.add_argument("--skip-hf", action="store_true", help="embedded side only (for A/B runs of engine changes)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for areal_async.serve")
    ap.add_argument("--embedded-dtypes", default="", help="also run the embedded server at these dtypes (comma list)")
    ap.add_argument("--sglang-python", default=None, help="also run the workload on real SGLang from this interpreter")
    ap.add_argument("--sglang-dtype", default="bfloat16", help="SGLang's --dtype (bfloat16: its fastest on a CPU)")
    ap.add_argument("--vllm-python", default=None, help="also run the workload on real vLLM from this interpreter")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp build dir (default: build_llama_cpp.py's cache)")
    ap.add_argument("--llama-cpp-avx2", default=None, help="the x86-64-v3 build for the AVX2 roofline (default: cache)")
    ap.add_argument("--llama-precisions", default="f32,bf16", help="GGUF types llama.cpp runs (f32, bf16, q8_0)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when a build is found")
    ap.add_argument(
        "--llama-cpp-wait",
        type=float,
        default=0.0,
        help="seconds to wait for build_llama_cpp.py's build to appear (a run started while it compiles)",
    )
    ap.add_argument("--roofline-isas", default=None, help="native,avx2 (default: native; quick: this process's)")
    ap.add_argument("--roofline-seconds", type=float, default=None, help="per backend and dtype (default 3)")
    args = ap.parse_args()
    args.embedded_dtypes = [d for d in args.embedded_dtypes.split(",") if d]
    return args


def guarded(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)`, or {"<name>_error": why} when it fails: each engine is optional to the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure of one engine is reported, not fatal
        traceback.print_exc()
        return {f"{name}_error": f"{type(e).__name__}: {e}"[:2000]}


def run_isa() -> str:
    """The ISA this process (and the servers it starts) runs at: avx2 when torch is held to it, else native."""
    return "avx2" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "native"


def _build_for(isa: str, args) -> Any:
    """The llama.cpp bin dir for `isa`: the flag naming it, or the cache; never auto-found in --quick (a smoke test
    must not depend on what a developer built)."""
    given = args.llama_cpp if isa == run_isa() else args.llama_cpp_avx2
    if args.no_llama_cpp or (args.quick and not given):
        return None
    return lss.find_build(isa, given)


def llama_bin(args) -> Any:
    """The llama.cpp bin dir of this run's ISA (waiting up to `--llama-cpp-wait` for a build in progress), or None."""
    isa = run_isa()
    bin_dir = _build_for(isa, args)
    deadline = time.monotonic() + args.llama_cpp_wait
    while bin_dir is None and time.monotonic() < deadline and not args.no_llama_cpp:
        time.sleep(10)
        bin_dir = _build_for(isa, args)
    return bin_dir


def decode_prompt_len(prompts: list[list[int]]) -> int:
    """llama-batched-bench's prompt length: the mean prompt + the 16 tokens the engine's decode runs start in."""
    return round(sum(map(len, prompts)) / len(prompts)) + 16


def llama_decoders(args, model_dir: str, prompts: list[list[int]]) -> dict[str, Callable[[], dict[int, float]]]:
    """{the engine's dtype name: one llama-batched-bench run at the same precision -> {batch: decode tokens/s}}, for
    the precisions of `--llama-precisions` the embedded server also serves; the engine's decode rounds alternate with
    these (engine_decode in inference_throughput.py). Empty when there is no build."""
    bin_dir = llama_bin(args)
    if bin_dir is None:
        return {}
    precs = [p for p in args.llama_precisions.split(",") if p in lss.PRECISIONS and lss.PRECISIONS[p] in DTYPES]
    batches, prompt_len = (1, args.decode_batch), decode_prompt_len(prompts)
    out = {}
    for p in precs:
        gguf = lss.find_gguf(model_dir, p)
        out[lss.PRECISIONS[p]] = functools.partial(
            lss.batched_decode, bin_dir, gguf, args.threads, prompt_len, args.decode_steps, batches
        )
    return out


def llama_cpp_runs(
    args, model_dir: str, prompts: list[list[int]], lengths: list[int], interleaved: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """llama-server on the workload and llama-batched-bench's decode rates, per precision, from the build of this
    run's ISA; {"llama_cpp": None} when there is no build. `interleaved` (llama.cpp precision -> decode rates) holds
    the rates already taken in alternation with the engine's: those precisions are not measured again."""
    isa = run_isa()
    bin_dir = llama_bin(args)
    if bin_dir is None:
        return {"llama_cpp": None}
    prompt_len = decode_prompt_len(prompts)
    precs = [p for p in args.llama_precisions.split(",") if p]
    rows = lss.llama_side(
        bin_dir, model_dir, precs, args.threads, prompts, lengths, args.repeats, prompt_len, args.decode_steps,
        decoded=interleaved,
    )  # fmt: skip
    return {
        "llama_cpp": {
            "build": str(bin_dir),
            "isa": isa,
            "threads": args.threads,
            "decode_tool": "llama-batched-bench (S_TG, non-unified KV)",
            "decode_prompt_tokens": prompt_len,
            "decode_steps": args.decode_steps,
            "decode_interleaved_with_engine": sorted(interleaved),
            "precisions": rows,
        }
    }


def roofline_and_mfu(args, cfg: dict, res: dict[str, Any], main_dtype: str) -> dict[str, Any]:
    """The roofline table (ISA -> dtype -> candidates and best) and the MFU figures taken against its best entry for
    this run's ISA and the embedded server's dtype. `gemm_roofline_torch_gflops` / `decode_mfu_torch` keep the
    torch-only figure that earlier runs reported, so results stay comparable."""
    fl = rl.model_flops(cfg)
    rows = res["decode_batch"]
    flops_per_token = fl["matmul_flops_per_token"] + fl["attn_flops_per_ctx_token"] * res["decode_mean_context"]
    here = run_isa()
    isas = (args.roofline_isas or ("native" if not args.quick else here)).split(",")
    seconds = args.roofline_seconds or (0.3 if args.quick else 3.0)
    dtypes = [main_dtype] if args.quick else list(DTYPES)
    table: dict[str, dict] = {}
    for isa in isas:
        torch_side = rl.torch_rates_in_child(isa, fl["shapes"], rows, args.threads, dtypes, seconds)
        build = _build_for(isa, args)
        table[isa] = {}
        for dt in dtypes:
            cand = dict(torch_side.get(dt, {}))
            if build is not None:
                cand["ggml"] = rl.ggml_rate(str(build / "ggml-gemm-bench"), dt, fl["shapes"], rows, args.threads,
                                            seconds)  # fmt: skip
            llama = (res.get("llama_cpp") or {}).get("precisions", {}).get(_llama_name(dt))
            if llama and isa == here and res["llama_cpp"]["isa"] == isa:
                cand["llama_decode"] = llama["decode_tokens_per_s"] * flops_per_token / 1e9
            table[isa][dt] = rl.combine(cand)
    mine = table.get(here, {}).get(main_dtype) or rl.combine({})
    best = mine["best_gflops"]
    torch_only = mine["candidates"].get("torch_mm")
    decode_gflops = res["decode_tokens_per_s"] * flops_per_token / 1e9
    out: dict[str, Any] = {
        "flops_per_token": flops_per_token,
        "roofline": table,
        "roofline_isa": here,
        "roofline_dtype": main_dtype,
        "gemm_roofline_gflops": best,
        "gemm_roofline_backend": mine["best_backend"],
        "gemm_roofline_torch_gflops": torch_only,
        "decode_gflops": decode_gflops,
    }
    if best:
        out["decode_mfu"] = decode_gflops / best
        out["roofline_tokens_per_s"] = best * 1e9 / fl["matmul_flops_per_token"]
        out["embedded_mfu"] = res["embedded_tokens_per_s"] * flops_per_token / 1e9 / best
    if torch_only:
        out["decode_mfu_torch"] = decode_gflops / torch_only
    for dt, row in res.get("embedded_by_dtype", {}).items():
        roof = table.get(here, {}).get(dt, {}).get("best_gflops")
        if roof:
            row["decode_mfu"] = row["decode_tokens_per_s"] * flops_per_token / 1e9 / roof
    return out


def _llama_name(dtype: str) -> str:
    return {"fp32": "f32", "bf16": "bf16"}.get(dtype, dtype)


def llama_cpp_ratios(res: dict[str, Any]) -> dict[str, Any]:
    """Engine / llama.cpp per precision, end to end and decode at batch 1 and 64 (see the module docstring)."""
    llama = res.get("llama_cpp")
    if not llama:
        return {}
    emb = res.get("embedded_by_dtype", {})
    out: dict[str, Any] = {"end_to_end": {}, "decode_batch64": {}, "decode_batch1": {}, "tail_efficiency": {}}
    out |= {"decode_batch64_paired": {}, "decode_batch1_paired": {}}
    for prec, row in llama["precisions"].items():
        server = row.get("server")
        if server:
            out["tail_efficiency"][f"llama_server_{prec}"] = server["tokens_per_s"] / row["decode_tokens_per_s"]
        mine = emb.get(lss.PRECISIONS.get(prec, prec))
        if not mine:
            continue
        if server:
            out["end_to_end"][prec] = mine["tokens_per_s"] / server["tokens_per_s"]
        out["decode_batch64"][prec] = mine["decode_tokens_per_s"] / row["decode_tokens_per_s"]
        out["decode_batch1"][prec] = mine["batch1_decode_tokens_per_s"] / row["batch1_decode_tokens_per_s"]
        # rounds taken in turns: the median of each round's own ratio, a view that no single lucky round decides
        paired = [r for r in mine.get("decode_rounds", []) if "llama_batch1" in r]
        if paired:
            for b in ("batch64", "batch1"):
                out[f"decode_{b}_paired"][prec] = statistics.median(r[b] / r[f"llama_{b}"] for r in paired)
    for dt, mine in emb.items():
        out["tail_efficiency"][f"embedded_{dt}"] = mine["tokens_per_s"] / mine["decode_tokens_per_s"]
    servers = {p: r["server"]["tokens_per_s"] for p, r in llama["precisions"].items() if r.get("server")}
    if servers:
        best = max(servers, key=lambda p: servers[p])
        out["best_llama_server"] = best
        out["embedded_over_best_llama_server"] = res["embedded_tokens_per_s"] / servers[best]
    return {"vs_llama_cpp": out}


def _f(x: Any, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def print_summary(result: dict[str, Any]) -> None:
    """The short table the benchmark prints (the JSON has everything)."""
    res, st = result, result["settings"]
    rows = [(f"embedded tokens/s (HTTP, {res.get('embedded_dtype')})", _f(res["embedded_tokens_per_s"]))]
    if "ratio" in res:
        rows += [
            ("transformers useful / padded tokens/s",
             f"{res['hf_tokens_per_s']:.0f} / {res['hf_padded_tokens_per_s']:.0f}"),
            ("ratio to useful (target >= 4)", f"{res['ratio']:.2f}"),
        ]  # fmt: skip
    for dt, row in res.get("embedded_by_dtype", {}).items():
        rows.append((f"embedded {dt}: workload / decode b1 / decode b64 tok/s",
                     f"{row['tokens_per_s']:.0f} / {row['batch1_decode_tokens_per_s']:.0f} / "
                     f"{row['decode_tokens_per_s']:.0f}"))  # fmt: skip
    llama = res.get("llama_cpp")
    for prec, row in (llama or {}).get("precisions", {}).items():
        srv = row.get("server") or {}
        rows.append((f"llama.cpp {prec}: server workload / decode b1 / decode b64 tok/s",
                     f"{_f(srv.get('tokens_per_s'))} / {row['batch1_decode_tokens_per_s']:.0f} / "
                     f"{row['decode_tokens_per_s']:.0f}"))  # fmt: skip
    vs = res.get("vs_llama_cpp")
    if vs:
        for kind in ("end_to_end", "decode_batch1", "decode_batch64", "decode_batch1_paired", "decode_batch64_paired"):
            rows.append((f"engine / llama.cpp, {kind}", ", ".join(f"{p} {v:.2f}x" for p, v in vs[kind].items()) or "-"))
        if "embedded_over_best_llama_server" in vs:
            rows.append((f"engine / best llama-server ({vs['best_llama_server']}) (target >= 2.5)",
                         f"{vs['embedded_over_best_llama_server']:.2f}x"))  # fmt: skip
        rows.append(("tail efficiency (workload / own b64 decode)",
                     ", ".join(f"{k} {v:.2f}" for k, v in vs["tail_efficiency"].items())))  # fmt: skip
    for name in ("sglang", "vllm"):
        if f"{name}_tokens_per_s" in res:
            rows.append((f"{name} {res[f'{name}_release']} ({res[f'{name}_dtype']}) tokens/s, embedded / {name}",
                         f"{res[f'{name}_tokens_per_s']:.0f}, {res[f'embedded_over_{name}']:.2f}x"))  # fmt: skip
    rows += [
        (f"decode tokens/s at batch {res['decode_batch']} / batch 1",
         f"{res['decode_tokens_per_s']:.0f} / {res['batch1_decode_tokens_per_s']:.0f}"),
        (f"roofline GFLOP/s ({res['roofline_isa']} {res['roofline_dtype']}: best {res['gemm_roofline_backend']}, "
         "torch mm)", f"{_f(res['gemm_roofline_gflops'])}, {_f(res['gemm_roofline_torch_gflops'])}"),
        ("decode MFU against best / torch mm", f"{_f(res.get('decode_mfu'), '.2f')} / "
         f"{_f(res.get('decode_mfu_torch'), '.2f')}"),
        ("whole-run MFU", _f(res.get("embedded_mfu"), ".2f")),
        ("pause to all returned ms (target < 50)", f"{res['pause_latency_ms']:.1f}"),
        ("max |logprob - transformers| (target < 1e-3)", f"{res['max_logprob_diff_vs_hf']:.2e}"),
        ("requests / tokens", f"{st['requests']} / {st['sum_new_tokens']} (longest {st['longest']})"),
        ("load average start -> end", f"{result['machine']['load_average_start']} -> "
         f"{result['machine']['load_average_end']}"),
    ]  # fmt: skip
    for isa, by_dt in res.get("roofline", {}).items():
        for dt, r in by_dt.items():
            cands = ", ".join(f"{k} {v:.0f}" for k, v in r["candidates"].items())
            rows.append((f"roofline {isa} {dt} GFLOP/s", cands))
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
