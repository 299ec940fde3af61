"""LoRA (train.lora) against full fine-tuning: train-step time and peak memory, bytes and seconds per weight update.

Two parts, each on the same model (`--model`: tiny, smollm2-135m-instruct, or a checkpoint directory):

    train step   benchmarks/train_step.py run twice as subprocesses (a fresh process each, so one's memory never
                 counts for the other): full fine-tuning, then train.lora.rank=R (alpha, targets as given), same
                 batch, same settings; its s/step (median of the timed steps), the peak resident set of the step
                 (VmHWM, reset before each step) and the level after loading
    weight sync  in this process (one rank: the FSDP gather is not timed, the rest is the trainer's own code):
                 publish = full: the HF checkpoint publish_hf writes (the model in its checkpoint dtype, what disk
                 sync ships without delta_sync); LoRA: train/lora_publish.py's adapter directory (the adapters in
                 fp32) with the identity of the merged weights; load = an embedded server (CPU, --served dtype)
                 taking the directory by /update_weights_from_disk over HTTP (read, validate, merge for LoRA,
                 swap); median of --repeats versions each, the adapters moved between versions

    python benchmarks/lora.py --out benchmarks/out/lora.json [--quick] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))
    )


def train_steps(model: str, args, tmp: str) -> dict:
    """train_step.py for full fine-tuning and for LoRA; returns both results."""
    out = {}
    common = ["--model", model, "--threads", str(args.threads)]
    if args.quick:
        common.append("--quick")
    if args.steps:
        common += ["--steps", str(args.steps)]
    lora = [f"train.lora.rank={args.rank}", f"train.lora.alpha={args.alpha}", f"train.lora.target_modules={TARGETS}"]
    for name, extra in (("full", []), ("lora", lora)):
        path = os.path.join(tmp, f"ts_{name}.json")
        cmd = [sys.executable, os.path.join(HERE, "train_step.py"), *common, "--out", path, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"train_step.py ({name}) failed:\n{proc.stderr[-3000:]}")
        with open(path) as f:
            r = json.load(f)
        first = r["by_threads"][str(args.threads)]
        out[name] = {
            "s_per_step": first["s_per_step"],
            "cpu_s_per_step": first["cpu_s_per_step"],
            "peak_rss_gb": first["peak_rss_gb"],
            "rss_after_load_gb": r["rss_after_load_gb"],
            "breakdown_s": first["breakdown_s"],
            "tokens_per_step": r["tokens_per_step"],
            "compute_dtype": r["compute_dtype"],
            "layout": r["step_layout"],
        }
    return out


async def weight_updates(path: str, args, tmp: str) -> dict:
    import torch
    import transformers

    from areal_async.inference.client import InferenceClient
    from areal_async.server.app import start_server
    from areal_async.train.lora import initial_adapters, inject_lora, lora_modules
    from areal_async.train.lora_publish import AdapterPublisher
    from areal_async.train.publish import publish_hf

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stored = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None) or torch.float32
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    out: dict = {}
    server = await start_server(path, port=0, device="cpu", dtype=args.served)
    client = InferenceClient([server.url])
    try:
        # full: what disk sync publishes and loads without train.lora
        pub_s, load_s, sizes = [], [], []
        for v in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            pub = publish_hf(model, source_dir=path, root=os.path.join(tmp, "full"), version=v, dtype=stored, skip=skip)
            pub_s.append(time.perf_counter() - t0)
            sizes.append(dir_bytes(pub.path))
            t0 = time.perf_counter()
            await client.update_weights_from_disk(pub.path, v)
            load_s.append(time.perf_counter() - t0)
        out["full"] = {
            "bytes_per_update": statistics.median(sizes),
            "weights_bytes": pub.num_bytes,
            "publish_s": statistics.median(pub_s),
            "load_s": statistics.median(load_s),
        }
        inject_lora(model, rank=args.rank, alpha=args.alpha, dropout=0.0, target_modules=TARGETS[1:-1].split(","))
        model.load_state_dict(initial_adapters(model, 1), strict=False)
        lora = {n: m.lora_scale for n, m in lora_modules(model).items()}
        publisher = AdapterPublisher()
        gen = torch.Generator().manual_seed(0)
        pub_s, load_s, ident_s, sizes, first_s = [], [], [], [], 0.0
        for v in range(args.repeats + 2):  # version 0 takes the one gather of the base: reported apart
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
            t0 = time.perf_counter()
            pub = publisher.publish(
                model,
                lora=lora,
                rank=args.rank,
                alpha=args.alpha,
                dropout=0.0,
                source_dir=path,
                root=os.path.join(tmp, "lora"),
                version=100 + v,
                keep=2,
                served=args.served,
                skip=skip,
            )
            t1 = time.perf_counter()
            await client.update_weights_from_disk(pub.path, 100 + v)
            t2 = time.perf_counter()
            verdicts = await client.verify_weights(pub.identity)
            if not all(x.ok for x in verdicts.values()):
                raise SystemExit(f"the server does not serve the adapter's merge: {verdicts}")
            if v == 0:
                first_s = t1 - t0
                continue
            pub_s.append(t1 - t0)
            ident_s.append(pub.identity_s)
            load_s.append(t2 - t1)
            sizes.append(dir_bytes(pub.path))
        out["lora"] = {
            "bytes_per_update": statistics.median(sizes),
            "weights_bytes": pub.num_bytes,
            "adapter_params": pub.changed,
            "publish_s": statistics.median(pub_s),
            "publish_identity_s": statistics.median(ident_s),
            "first_publish_s": first_s,
            "load_s": statistics.median(load_s),
            "identity_checked": True,
        }
    finally:
        await client.close()
        await server.close()
    out["bytes_ratio"] = out["full"]["bytes_per_update"] / out["lora"]["bytes_per_update"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, one step, one version")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="timed train steps (train_step.py's default otherwise)")
    ap.add_argument("--repeats", type=int, default=3, help="weight updates timed per kind")
    ap.add_argument("--served", default="bfloat16", help="the embedded server's dtype")
    ap.add_argument("--skip-train", action="store_true", help="weight updates only")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "tiny", 1
    import torch
    from inference_throughput import machine_info
    from train_step import resolve_model

    from areal_async.testing.tiny import make_tiny_checkpoint

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(os.path.join(tmp, "tiny"), "qwen2") if args.model == "tiny" else None
        path = path or resolve_model(args.model)
        result: dict = {"model": args.model, "rank": args.rank, "alpha": args.alpha, "served": args.served}
        if not args.skip_train:
            result["train_step"] = train_steps(args.model if args.model != "tiny" else "tiny", args, tmp)
        result["weight_update"] = asyncio.run(weight_updates(path, args, tmp))
    result["machine"] = machine_info(torch, load_start)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.model}: LoRA r={args.rank} alpha={args.alpha:g}, served {args.served}, {result['machine']['cpu']}")
    if "train_step" in result:
        print(f"{'train step':<12} {'s/step':>8} {'peak GB':>8} {'loaded GB':>9}")
        for k, s in result["train_step"].items():
            print(f"{k:<12} {s['s_per_step']:>8.2f} {s['peak_rss_gb']:>8.2f} {s['rss_after_load_gb']:>9.2f}")
    w = result["weight_update"]
    print(f"{'update':<12} {'MB':>10} {'publish s':>10} {'load s':>8}")
    for k in ("full", "lora"):
        print(f"{k:<12} {w[k]['bytes_per_update'] / 1e6:>10.3f} {w[k]['publish_s']:>10.3f} {w[k]['load_s']:>8.3f}")
    print(f"bytes per update, full / LoRA: {w['bytes_ratio']:.1f}x")
    return result


if __name__ == "__main__":
    main()
