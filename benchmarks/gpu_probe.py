"""What one GPU can prove about the CUDA paths, for benchmarks/gpu_check.sh: one JSON file of figures and verdicts.

    python benchmarks/gpu_probe.py unbound OUT.json     # a process of its own: it owns the default group
    python benchmarks/gpu_probe.py real_shape OUT.json  # Qwen2.5-1.5B shapes, random weights built on the device

`unbound`: the regression check for the weight-update group split from a device-bound default group. The default
group is nccl, world 1, bound to cuda:0 (as torchrun's ranks bind theirs); the weight-update group is made with
nccl through `new_custom_group` (world 1: one GPU cannot hold two nccl ranks), one broadcast goes through it, and
the default backend's `comm_split_count()` must still be 0 (a split would have made the new group a child of the
trainers' communicator instead of a fresh one with the servers).

`real_shape`: a random checkpoint with Qwen2.5-1.5B's config (vocab 151,936, hidden 1,536, 28 layers, 12 heads,
2 KV heads, intermediate 8,960; no download), written to a scratch directory in bf16. Measured on it, each part on
its own (one failing part leaves the others standing):
- lm_head: the trainer's chunked LM head (train/lm_head.py) at the real vocabulary, forward + backward.
- train_step: peak memory and time of one forward + backward + fused AdamW step of the plain transformers model
  (fp32 weights, bf16 autocast, packed rows through train/logprobs.py): an upper bound for one FSDP rank of one,
  not TrainEngine itself.
- decode: tokens/s of the embedded engine (server/engine.py) for concurrent greedy requests: its KV is gathered
  per step and attention runs through SDPA with a float mask, with no CUDA graphs, so this is far from SGLang.
- broadcast: the full weights through `WeightBroadcaster` to a receiver process over gloo (what a one-GPU run uses:
  trainer and server on one GPU cannot form an nccl group), with GB/s.
Every figure is what this machine measured; nothing is extrapolated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def _part(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one measurement; its figures, or its error, go under `name`."""
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = {"ok": True, **out, "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as e:  # reported, not raised: the other parts still run
        results[name] = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-3000:],
            "seconds": round(time.perf_counter() - t0, 2),
        }
    print(f"{name}: {json.dumps(results[name])[:600]}", flush=True)


def unbound() -> dict[str, Any]:
    """See the module docstring. Needs CUDA; a process of its own (it owns the default group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from areal_async.net.custom_group import new_custom_group, open_store

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    default = c10d._get_default_group()
    bound = default.bound_device_id
    backend = default._get_backend(dev)
    before = backend.comm_split_count()
    store = open_store("127.0.0.1", 0, 1, 60.0)
    pg = new_custom_group("nccl", store, world_size=1, rank=0, group_name="gpu-check-wug", device=dev, timeout_s=60.0)
    t = torch.arange(1 << 20, dtype=torch.bfloat16, device=dev)  # [1M]
    dist.broadcast(t, group=pg, group_src=0)
    torch.cuda.synchronize(dev)
    after = backend.comm_split_count()
    rebound = c10d._get_default_group().bound_device_id
    dist.destroy_process_group(pg)
    dist.destroy_process_group()
    ok = bound is not None and before == 0 and after == 0 and rebound == bound
    return {
        "ok": ok,
        "default_bound_to": str(bound),
        "comm_split_count_before": before,
        "comm_split_count_after": after,
        "binding_restored": rebound == bound,
        "cumem": os.environ.get("NCCL_CUMEM_ENABLE", "<unset>"),
    }


def build_checkpoint(path: str) -> dict[str, Any]:
    """Random bf16 weights of Qwen2.5-1.5B's shape, initialised on the device, saved with the char tokenizer (the
    ids the checks send are all below its vocabulary; the rest of the 151,936 rows are never produced as text)."""
    import torch
    import transformers

    from areal_async.tasks.char_tokenizer import save_char_tokenizer

    os.makedirs(path, exist_ok=True)
    save_char_tokenizer(path)
    cfg = transformers.Qwen2Config(
        **QWEN25_15B,
        use_sliding_window=False,
        initializer_range=0.02,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return {"path": path, "params": params}


def lm_head_check() -> dict[str, Any]:
    import torch

    from areal_async.train.lm_head import LMHead, logprobs_from_hidden

    dev = torch.device("cuda")
    v, h, m = QWEN25_15B["vocab_size"], QWEN25_15B["hidden_size"], 8192
    hidden = (torch.randn(m, h, device=dev) * 2).bfloat16().requires_grad_()  # [M, H]
    weight = (torch.randn(v, h, device=dev) * 0.02).bfloat16().requires_grad_()  # [V, H]
    targets = torch.randint(0, v, (m,), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    lp, ent = logprobs_from_hidden(hidden, LMHead(weight, None), targets, compute_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    torch.cuda.synchronize()
    return {
        "tokens": m,
        "vocab": v,
        "fwd_bwd_s": round(time.perf_counter() - t0, 3),
        "peak_above_inputs_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
        "finite": bool(torch.isfinite(lp).all() and torch.isfinite(weight.grad.float()).all()),
    }


def train_step_check(path: str) -> dict[str, Any]:
    import torch
    import transformers

    from areal_async.train.logprobs import packed_forward_logprobs

    dev = torch.device("cuda")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(
        dev
    )
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    lens = [1024, 1024, 1024, 1024]
    ids = torch.randint(2, 60, (sum(lens),), device=dev)  # [N]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = packed_forward_logprobs(model, ids, lens)
    lp.mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    out = {
        "tokens": sum(lens),
        "step_s": round(time.perf_counter() - t0, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "params": sum(p.numel() for p in model.parameters()),
    }
    del model, opt
    torch.cuda.empty_cache()
    return out


def decode_check(path: str, requests: int = 32, prompt: int = 128, new: int = 128) -> dict[str, Any]:
    import asyncio

    from areal_async.protocol.engine_api import EngineRequest, EngineSampling
    from areal_async.server.engine import AsyncEngine

    async def run() -> dict[str, Any]:
        engine = AsyncEngine(
            path,
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=requests * (prompt + new) * 2,
            max_running_requests=requests,
        )
        await engine.start()
        try:

            async def one(i: int) -> int:
                req = EngineRequest(
                    rid=f"d{i}",
                    input_ids=[2 + (i + k) % 50 for k in range(prompt)],
                    sampling=EngineSampling(max_new_tokens=new, temperature=0.0, ignore_eos=True),
                )
                made = 0
                async for chunk in engine.generate(req):
                    made += len(chunk.new_ids)
                return made

            await one(-1)  # warm-up: first kernels, allocator
            t0 = time.perf_counter()
            made = await asyncio.gather(*(one(i) for i in range(requests)))
            wall = time.perf_counter() - t0
        finally:
            await engine.shutdown()
        return {
            "requests": requests,
            "prompt_tokens": prompt,
            "new_tokens_each": new,
            "tokens": sum(made),
            "wall_s": round(wall, 2),
            "tokens_per_s": round(sum(made) / wall, 1),
        }

    return asyncio.run(run())


_RECEIVER = textwrap.dedent("""
    import json, sys, time, torch
    from areal_async.server.weights import init_custom_group, receive_tensors
    port, plan = int(sys.argv[1]), json.loads(sys.argv[2])
    pg = init_custom_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "gpu-check-bcast", torch.device("cpu"), 300)
    t0 = time.perf_counter()
    n = 0
    for names, dtypes, shapes in plan:
        got = receive_tensors(pg, names, dtypes, shapes, torch.device("cpu"))
        n += sum(t.numel() * t.element_size() for t in got.values())
    print(json.dumps({"received_bytes": n, "seconds": time.perf_counter() - t0}), flush=True)
""")


def broadcast_check(path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers

    from areal_async.train.broadcast import WeightBroadcaster, plan_buckets
    from areal_async.types import InitBroadcastRequest

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    buckets = plan_buckets(model, skip=tied, dtype=torch.bfloat16, bucket_bytes=512 << 20)
    plan = [[b.names, b.dtypes, b.shapes] for b in buckets]
    wb = WeightBroadcaster(timeout_s=300.0)
    port = wb.open_store("gpu-check-bcast", 2, "127.0.0.1", 0)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    recv = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, str(port), json.dumps(plan)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        wb.init_group(
            InitBroadcastRequest(
                group_name="gpu-check-bcast", world_size=2, master_address="127.0.0.1", master_port=port, backend="gloo"
            ),
            torch.device("cuda"),
        )
        res = wb.broadcast(model, group_name="gpu-check-bcast", skip=tied, dtype=torch.bfloat16, bucket_bytes=512 << 20)
        got = json.loads(recv.communicate(timeout=300)[0].strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
        wb.close()
    return {
        "backend": "gloo (trainer on CUDA, receiver on the host)",
        "bytes": res.num_bytes,
        "buckets": len(buckets),
        "seconds": round(res.seconds, 2),
        "gb_per_s": round(res.num_bytes / res.seconds / 1e9, 3),
        "received_bytes": got["received_bytes"],
        "held_peak_mib": round(res.held_peak_bytes / 2**20, 1),
    }


def real_shape(scratch: str) -> dict[str, Any]:
    results: dict[str, Any] = {"config": QWEN25_15B}
    path = os.path.join(scratch, "qwen2.5-1.5b-shape")
    _part(results, "checkpoint", lambda: build_checkpoint(path))
    _part(results, "lm_head", lm_head_check)
    if results["checkpoint"]["ok"]:
        _part(results, "train_step", lambda: train_step_check(path))
        _part(results, "decode", lambda: decode_check(path))
        _part(results, "broadcast", lambda: broadcast_check(path))
    return results


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("unbound", "real_shape"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    what, out_path = args
    import torch

    if not torch.cuda.is_available():
        result: dict[str, Any] = {"ok": False, "skipped": "no CUDA device"}
    elif what == "unbound":
        result = {}
        _part(result, "unbound", unbound)
        result = result["unbound"]
    else:
        result = real_shape(os.path.dirname(os.path.abspath(out_path)))
        result["ok"] = all(v.get("ok") for k, v in result.items() if isinstance(v, dict) and "ok" in v)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
