"""Weight sync from the trainer to an inference server: publish-to-disk + load versus broadcast, per GB of weights.

For each model size (random checkpoints made with `make_tiny_checkpoint`, fp32, sizes from a few hundred MB up), a
torchrun trainer (train/worker.py, `--nproc` ranks) and an embedded inference server (in this process, CPU) start
from the same checkpoint; the controller side (`TrainerGroup`, `InferenceClient`) then times:

    publish      TrainerGroup.publish: FSDP gather, safetensors write, fsync, atomic rename (wall, as the caller
                 sees it)
    load         InferenceClient.update_weights_from_disk on the published directory (read, validate, swap)
    disk total   publish + load: what a version change costs with weight_sync=disk
    broadcast    TrainerGroup.broadcast_weights: gather + gloo broadcast + the server's receive/validate/swap,
                 bucketed (--bucket-mb); the group is set up once beforehand (its set-up time is reported apart)

Each measurement is the median of --repeats runs; seconds per GB divide by the fp32 weight bytes. CPU, gloo,
loopback: the numbers describe this machine's memory and disk bandwidth, not NVLink/NCCL.

Memory of trainer rank 0 during a broadcast (`BroadcastResult`): `held` = the most bytes of gathered full tensors it
held at once (it waits for each bucket to be received before gathering the next, so this is the largest bucket,
against the whole model before), `peak` = its peak memory above its level at the start of the broadcast (the
process's RSS high-water mark on CPU, the CUDA allocator's peak on CUDA).

    python benchmarks/weight_sync.py --out /tmp/weight_sync.json [--quick] [--sizes 256,1024] [--nproc 1]

With `--model smollm2-135m-instruct` it measures delta sync and policy identity on the real model instead, trained
by a torchrun trainer with configs/smollm2.yaml's train section (Adam at its learning rate, bf16 compute where the
CPU has it) on batches of random tokens with random 0/1 rewards (Adam's step is ~lr per element whatever the
gradient's scale, so the sparsity of the served bits depends on the learning rate and the weights, hardly on the
data). For each served dtype (bf16, then fp32) an embedded server is started, and every step:

    train       one train step
    delta       publish_delta (gather, cast to the served dtype, XOR against the last version, deflate, write)
                + the server's load (read, checksum, inflate, XOR, check the result's digests) + the identity check
    full        the same version published again as a full snapshot (the fp32 HF checkpoint) + load + check
    bit_exact   the server's digests after the delta load == the trainer's identity == after the full load

The JSON's `smollm2` entry holds, per served dtype, the medians over steps 2..n (step 1 is the first full
snapshot): `full_bytes_per_update` (the model in the served dtype: what shipping its bits in full costs),
`checkpoint_bytes_per_update` (what the full HF checkpoint writes: fp32), `delta_bytes_per_update`, the fraction of
elements changed per step, seconds per update for each, and the identity check's seconds. The top level repeats the
bf16 figures (`full_bytes_per_update`, `delta_bytes_per_update`, `bit_exact`).

    python benchmarks/weight_sync.py --model smollm2-135m-instruct --out /tmp/weight_sync_smollm2.json [--steps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import shutil
import statistics
import sys
import tempfile
import time

# model shapes by approximate fp32 size in MB (vocab is the char tokenizer's ~100 tokens, so the layers dominate)
SHAPES = {
    2: dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    256: dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=4096),
    512: dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=4096),
    1024: dict(hidden_size=1536, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=6144),
    2048: dict(hidden_size=2048, num_layers=10, num_heads=16, num_kv_heads=4, intermediate_size=8192),
}


async def _measure(model_dir: str, work: str, args: argparse.Namespace) -> dict:
    from areal_async.inference.client import InferenceClient
    from areal_async.launch import Processes
    from areal_async.server.app import start_server
    from areal_async.train.client import TrainerGroup

    secret = secrets.token_bytes(32)
    launcher = Processes(os.path.join(work, "run"))
    cfg = json.dumps({"torch_threads": args.threads})
    child = launcher.start_trainers(
        model=model_dir, nproc=args.nproc, config_json=cfg, seed=1, secret_hex=secret.hex(), torch_threads=args.threads
    )
    server = client = group = None
    try:
        server = await start_server(model_dir, port=0, device="cpu", max_total_tokens=1024, max_running_requests=4)
        group = await TrainerGroup.connect(launcher.run_dir, args.nproc, secret, timeout=900)
        client = InferenceClient([server.url])
        plan = await group.weight_plan(args.bucket_mb << 20)
        gb = plan.num_bytes / 1e9
        publish, load, bcast, bcast_trainer, held, peak = [], [], [], [], [], []
        root = os.path.join(work, "weights")
        for i in range(args.repeats):
            t0 = time.perf_counter()
            pub = await group.publish(i + 1, root, keep=1)
            t1 = time.perf_counter()
            await client.update_weights_from_disk(pub.path, i + 1)
            t2 = time.perf_counter()
            publish.append(t1 - t0)
            load.append(t2 - t1)
        t0 = time.perf_counter()
        await group.init_broadcast_group(client, num_server_ranks=1, backend="gloo")
        init_s = time.perf_counter() - t0
        for i in range(args.repeats):
            t0 = time.perf_counter()
            res = await group.broadcast_weights(client, 100 + i, bucket_bytes=args.bucket_mb << 20)
            bcast.append(time.perf_counter() - t0)
            bcast_trainer.append(res.seconds)
            held.append(res.held_peak_bytes)
            peak.append(res.memory_peak_bytes)
        med = statistics.median
        row = {
            "weights_gb": gb,
            "num_buckets": len(plan.buckets),
            "nproc": args.nproc,
            "publish_s": med(publish),
            "load_s": med(load),
            "disk_total_s": med(publish) + med(load),
            "broadcast_s": med(bcast),
            "broadcast_trainer_s": med(bcast_trainer),
            "broadcast_init_s": init_s,
            # rank 0 during a broadcast: the most gathered bytes it held at once (bounded by the largest bucket),
            # and its peak memory above the level at the start (host RSS high-water mark here, on CPU)
            "largest_bucket_gb": max(sum(math.prod(sh) * 4 for sh in b.shapes) for b in plan.buckets) / 1e9,
            "held_peak_gb": max(held) / 1e9,
            "memory_peak_gb": max(peak) / 1e9,
        }
        for key in ("publish_s", "load_s", "disk_total_s", "broadcast_s"):
            row[key[:-2] + "_s_per_gb"] = row[key] / gb
        row["broadcast_speedup_vs_disk"] = row["disk_total_s"] / row["broadcast_s"]
        return row
    finally:
        if group is not None:
            try:
                await asyncio.wait_for(group.shutdown(), 60)
                child.proc.wait(60)
            except Exception:
                pass
        launcher.shutdown()
        if client is not None:
            await client.close()
        if server is not None:
            await server.close()


def _smollm2_train_config(args: argparse.Namespace) -> dict:
    from areal_async.config.files import read_yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    train = dict(read_yaml(os.path.join(root, "configs", "smollm2.yaml")).get("train", {}))
    for key in ("nproc", "torch_threads"):
        train.pop(key, None)
    train.update({"device": "cpu", "delta_sync": True, "delta_full_every": 1000, "torch_threads": args.threads})
    return train


def _random_batch(rng, version: int, vocab: int) -> list:
    from areal_async.types import Trajectory

    trajs = []
    for g in range(2):
        for _ in range(4):
            p, r = 24, 40
            trajs.append(
                Trajectory(
                    input_ids=[rng.randrange(2, vocab) for _ in range(p + r)],
                    loss_mask=[0] * p + [1] * r,
                    logprobs=[0.0] * p + [-3.0] * r,
                    versions=[-1] * p + [version] * r,
                    reward=float(rng.randrange(2)),
                    group_id=g,
                    prompt_len=p,
                )
            )
    return trajs


async def _measure_model(model_dir: str, work: str, args: argparse.Namespace) -> dict:
    """Delta vs full sync and the identity check on a real model (module docstring)."""
    import random

    from areal_async.inference.client import InferenceClient
    from areal_async.launch import Processes
    from areal_async.server.app import start_server
    from areal_async.train.client import TrainerGroup

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    secret = secrets.token_bytes(32)
    launcher = Processes(os.path.join(work, "run"))
    cfg = _smollm2_train_config(args)
    child = launcher.start_trainers(
        model=model_dir,
        nproc=1,
        config_json=json.dumps(cfg),
        seed=1,
        secret_hex=secret.hex(),
        torch_threads=args.threads,
    )
    group = None
    out: dict = {"train_config": cfg, "steps": args.steps, "served": {}}
    try:
        group = await TrainerGroup.connect(launcher.run_dir, 1, secret, timeout=900)
        initial = (await group.save_checkpoint(os.path.join(work, "initial"))).path
        rng = random.Random(1)
        for served in ("bfloat16", "float32"):
            await group.load_checkpoint(initial)  # both dtypes see the same training
            rng.seed(1)
            server = await start_server(model_dir, port=0, device="cpu", dtype=served, max_total_tokens=1024)
            client = InferenceClient([server.url])
            root = os.path.join(work, f"weights-{served}")
            rows = []
            try:
                for _ in range(args.steps + 1):
                    t0 = time.perf_counter()
                    v = (await group.train_step(_random_batch(rng, group.version, vocab), group.version)).version
                    t1 = time.perf_counter()
                    row = {"version": v, "train_s": t1 - t0}
                    for kind in ("delta", "full"):
                        t2 = time.perf_counter()
                        pub = await group.publish_delta(v, root, keep=2, served_dtype=served, force_full=kind == "full")
                        t3 = time.perf_counter()
                        await client.update_weights_from_disk(pub.path, v)
                        t4 = time.perf_counter()
                        verdict = (await client.verify_weights(pub.identity))[server.url]
                        t5 = time.perf_counter()
                        key = pub.kind  # the first step has no base: its "delta" is a full snapshot
                        row[f"{kind}_as"] = key
                        row[f"{kind}_bytes"] = pub.num_bytes
                        row[f"{kind}_publish_s"] = t3 - t2
                        row[f"{kind}_load_s"] = t4 - t3
                        row[f"{kind}_identity_s"] = t5 - t4
                        row[f"{kind}_s"] = t5 - t2
                        row[f"{kind}_ok"] = verdict.ok
                        row[f"{kind}_digests"] = pub.identity.combined
                        row["trainer_digest_s"] = pub.identity_s
                        row["served_bytes"] = pub.full_bytes
                        if pub.kind == "delta":
                            row["changed_frac"] = pub.changed / pub.total
                    row["bit_exact"] = (
                        row["delta_ok"] and row["full_ok"] and row["delta_digests"] == row["full_digests"]
                    )
                    rows.append(row)
                    print(
                        f"  {served} v{v}: {json.dumps({k: row[k] for k in row if 'digests' not in k})}",
                        file=sys.stderr,
                    )
                if served == "bfloat16" and args.broadcast:
                    out["broadcast_bf16"] = await _measure_broadcast(group, client, server.url, rng, vocab, args)
            finally:
                await client.close()
                await server.close()
            deltas = [r for r in rows if r["delta_as"] == "delta"]
            med = statistics.median
            out["served"][served] = {
                "full_bytes_per_update": med(r["served_bytes"] for r in deltas),
                "checkpoint_bytes_per_update": med(r["full_bytes"] for r in deltas),
                "delta_bytes_per_update": med(r["delta_bytes"] for r in deltas),
                "changed_frac_per_step": [r["changed_frac"] for r in deltas],
                "delta_s_per_update": med(r["delta_s"] for r in deltas),
                "full_s_per_update": med(r["full_s"] for r in deltas),
                "delta_publish_s": med(r["delta_publish_s"] for r in deltas),
                "delta_load_s": med(r["delta_load_s"] for r in deltas),
                "full_publish_s": med(r["full_publish_s"] for r in deltas),
                "full_load_s": med(r["full_load_s"] for r in deltas),
                "identity_check_s": med(r["delta_identity_s"] for r in deltas),
                "trainer_digest_s": med(r["trainer_digest_s"] for r in deltas),
                "bit_exact": all(r["bit_exact"] for r in rows),
                "rows": rows,
            }
            s_ = out["served"][served]
            s_["bytes_ratio"] = s_["full_bytes_per_update"] / max(s_["delta_bytes_per_update"], 1)
        return out
    finally:
        if group is not None:
            try:
                await asyncio.wait_for(group.shutdown(), 60)
                child.proc.wait(60)
            except Exception:
                pass
        launcher.shutdown()


async def _measure_broadcast(group, client, url: str, rng, vocab: int, args: argparse.Namespace) -> dict:
    """Delta vs full over a gloo broadcast (ElasticBroadcastSync with train.delta_sync), bf16 serving: per step
    the delta update (prepare + send + the server's checks + identity), then the same version again as a full
    broadcast (gather + send + the server's cast + identity, a gather on the trainer since it sends fp32)."""
    from areal_async.rollout.broadcast_sync import ElasticBroadcastSync

    sync = ElasticBroadcastSync(group, client, "127.0.0.1", ranks_per_server=1, backend="gloo", settle_s=1)
    await sync.form_group()
    rows = []
    for _ in range(args.steps + 1):
        v = (await group.train_step(_random_batch(rng, group.version, vocab), group.version)).version
        before = dict(sync.stats)
        await client.pause()
        try:
            t0 = time.perf_counter()
            await sync.apply(v, flush_cache=True)
            t1 = time.perf_counter()
            await group.broadcast_weights(client, v, group_name=sync.group_name)
            await sync._verify(v)
            t2 = time.perf_counter()
        finally:
            await client.resume()
        kind = "delta" if sync.stats["delta_updates"] > before["delta_updates"] else "full"
        verdict = (await client.verify_weights(await group.identity("bfloat16")))[url]
        row = {
            "version": v,
            "first_as": kind,
            "first_s": t1 - t0,
            "full_s": t2 - t1,
            "delta_bytes": sync.stats["delta_bytes"] - before["delta_bytes"],
            "full_bytes": sync.stats["full_bytes"] - before["full_bytes"],
            "ok": verdict.ok,
        }
        rows.append(row)
        print(f"  broadcast bf16 v{v}: {json.dumps(row)}", file=sys.stderr)
    deltas = [r for r in rows if r["first_as"] == "delta"]
    med = statistics.median
    return {
        "delta_bytes_per_update": med(r["delta_bytes"] for r in deltas),
        "full_bytes_per_update": med(r["full_bytes"] for r in deltas),
        "delta_s_per_update": med(r["first_s"] for r in deltas),
        "full_s_per_update": med(r["full_s"] for r in deltas),
        "identity_ok": all(r["ok"] for r in rows),
        "rows": rows,
    }


def _main_model(args: argparse.Namespace) -> None:
    from areal_async.model_store import resolve_model_path

    model_dir = resolve_model_path(args.model)
    work = tempfile.mkdtemp(prefix="weight_sync_model_", dir=args.workdir)
    try:
        res = asyncio.run(_measure_model(model_dir, work, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bf16 = res["served"]["bfloat16"]
    out = {
        "benchmark": "weight_sync",
        "model": args.model,
        "device": "cpu",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "full_bytes_per_update": bf16["full_bytes_per_update"],
        "delta_bytes_per_update": bf16["delta_bytes_per_update"],
        "bit_exact": bf16["bit_exact"] and res["served"]["float32"]["bit_exact"],
        "smollm2": res,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    heads = [("served", 10), ("full MB", 10), ("delta MB", 10), ("ratio", 8), ("changed", 9), ("full s", 8)]
    heads += [("delta s", 9), ("ident s", 9)]
    print("".join(f"{h:>{w}}" for h, w in heads))
    for served, r in res["served"].items():
        print(
            f"{served:>10}{r['full_bytes_per_update'] / 1e6:>10.1f}{r['delta_bytes_per_update'] / 1e6:>10.1f}"
            f"{r['bytes_ratio']:>8.1f}{statistics.median(r['changed_frac_per_step']):>9.4f}"
            f"{r['full_s_per_update']:>8.2f}{r['delta_s_per_update']:>9.2f}{r['identity_check_s']:>9.3f}"
        )
    print(f"bit_exact: {out['bit_exact']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--quick", action="store_true", help="one tiny model, one repeat (smoke test)")
    ap.add_argument("--sizes", default="256,1024", help=f"approximate fp32 sizes in MB, from {sorted(SHAPES)}")
    ap.add_argument("--nproc", type=int, default=1, help="trainer ranks (torchrun --nproc_per_node)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per trainer rank")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--model", default=None, help="a real model (smollm2-135m-instruct): delta sync and identity")
    ap.add_argument("--steps", type=int, default=4, help="with --model: train steps measured after the first")
    ap.add_argument("--no-broadcast", dest="broadcast", action="store_false", help="with --model: disk only")
    args = ap.parse_args()
    if args.model is not None:
        _main_model(args)
        return
    sizes = [2] if args.quick else [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.repeats = 1
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown sizes {unknown}; choose from {sorted(SHAPES)}")

    from areal_async.testing.tiny import make_tiny_checkpoint

    work_root = tempfile.mkdtemp(prefix="weight_sync_", dir=args.workdir)
    rows = []
    try:
        for size in sizes:
            work = os.path.join(work_root, f"m{size}")
            model_dir = make_tiny_checkpoint(
                os.path.join(work, "base"),
                "qwen2",
                max_position_embeddings=2048,
                tie_word_embeddings=False,
                **SHAPES[size],
            )
            row = {"size_label_mb": size, **asyncio.run(_measure(model_dir, work, args))}
            rows.append(row)
            shutil.rmtree(work, ignore_errors=True)
            print(
                f"  {size} MB model done: broadcast {row['broadcast_s']:.2f}s, publish+load {row['disk_total_s']:.2f}s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    out = {
        "benchmark": "weight_sync",
        "quick": args.quick,
        "nproc": args.nproc,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        "device": "cpu",
        "backend": "gloo",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    cols = [
        ("weights_gb", "GB", "{:.3f}"),
        ("publish_s", "publish s", "{:.2f}"),
        ("load_s", "load s", "{:.2f}"),
        ("disk_total_s_per_gb", "disk s/GB", "{:.2f}"),
        ("broadcast_s", "bcast s", "{:.2f}"),
        ("broadcast_s_per_gb", "bcast s/GB", "{:.2f}"),
        ("broadcast_speedup_vs_disk", "bcast x", "{:.2f}"),
        ("largest_bucket_gb", "bucket GB", "{:.3f}"),
        ("held_peak_gb", "held GB", "{:.3f}"),
        ("memory_peak_gb", "peak GB", "{:.3f}"),
    ]
    print("".join(f"{title:>12}" for _, title, _ in cols))
    for row in rows:
        print("".join(f"{fmt.format(row[key]):>12}" for key, _, fmt in cols))


if __name__ == "__main__":
    main()
