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
    args = ap.parse_args()
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
