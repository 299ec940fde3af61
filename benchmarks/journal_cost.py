"""What the generation journal costs the controller: writing the tokens as they come back, the snapshot each
checkpoint takes of the groups in flight, and reading it all back at a resume.

    python benchmarks/journal_cost.py --out benchmarks/out/journal_cost.json [--groups 64] [--calls 8]
        [--tokens 512] [--segments 4]

The journal is the real one (areal_async.rollout.journal) on the real filesystem under a temporary directory; the
workload is shaped like the configs/smollm2.yaml run with 64 groups in flight: every group has `--calls` samples,
each of `--tokens` tokens that come back in `--segments` pieces (one per weight update that interrupts it). Reported:
the event loop's time per journaled token and per segment, the checkpoint snapshot's seconds and bytes, and the
resume's load seconds, each the median of --repeats. Writes JSON to --out and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

from areal_async.rollout.checkpoints import checkpoint_dir
from areal_async.rollout.journal import SNAPSHOT_FILE, GenerationJournal, call_digest
from areal_async.types import SamplingParams


def one_round(root: str, groups: int, calls: int, tokens: int, segments: int) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(dir=root)
    journal = GenerationJournal(run_dir, 0)
    sp = SamplingParams(max_new_tokens=tokens)
    per_seg = max(1, tokens // segments)
    seqs = {}
    t0 = time.perf_counter()
    for d in range(groups):
        journal.start(d, 0)
        for c in range(calls):
            seqs[d, c] = journal.new_call(d, call_digest(list(range(100 + d)), sp))
    for k in range(segments):  # at each weight update every call's segment comes back
        for (d, _c), seq in seqs.items():
            ids = list(range(k * per_seg, (k + 1) * per_seg))
            journal.add_tokens(d, seq, ids, [-0.6931] * per_seg, [k] * per_seg, "tok " * per_seg)
    write_s = time.perf_counter() - t0
    ckpt = checkpoint_dir(run_dir, segments)
    os.makedirs(ckpt)
    t1 = time.perf_counter()
    journal.checkpoint(ckpt, segments, list(range(groups)))
    journal.rotate(segments)
    snap_s = time.perf_counter() - t1
    journal.close()
    t2 = time.perf_counter()
    resumed = GenerationJournal(run_dir, segments, resume=True)
    load_s = time.perf_counter() - t2
    kept = resumed.report.tokens_kept
    resumed.close()
    n_tokens = groups * calls * per_seg * segments
    assert kept == n_tokens, (kept, n_tokens)
    return {
        "tokens": n_tokens,
        "write_us_per_token": write_s / n_tokens * 1e6,
        "write_ms_per_segment_batch": write_s / segments * 1e3,  # all calls' segments of one weight update
        "snapshot_s": snap_s,
        "snapshot_mb": os.path.getsize(os.path.join(ckpt, SNAPSHOT_FILE)) / 2**20,
        "load_s": load_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--calls", type=int, default=8, help="samples per group")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sample")
    ap.add_argument("--segments", type=int, default=4, help="pieces each sample's tokens come back in")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rounds = [one_round(root, args.groups, args.calls, args.tokens, args.segments) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {
        "args": vars(args),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1m": os.getloadavg()[0],
        "median": med,
        "rounds": rounds,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    table = (
        "| groups x samples x tokens | journal us/token | per weight update ms | snapshot s | snapshot MB | "
        "resume load s |\n|---|---|---|---|---|---|\n"
        f"| {args.groups} x {args.calls} x {args.tokens} | {med['write_us_per_token']:.2f} | "
        f"{med['write_ms_per_segment_batch']:.1f} | {med['snapshot_s']:.3f} | {med['snapshot_mb']:.1f} | "
        f"{med['load_s']:.3f} |\n"
    )
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
