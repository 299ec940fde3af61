"""The verdict of benchmarks/lora_apply.py: what one version of configs/smollm2-lora.yaml's run serves, what each
way of serving LoRA costs per version there, and the printed table. Apart from the measurement so that each file
stays small; it reads only the measurement's JSON-ready dicts.
"""

from __future__ import annotations


def typical_version(cfg: dict, args) -> dict:
    """What one version of configs/smollm2-lora.yaml's run puts through the server's forward, three ways.
    `trained`: the samples one train step consumes (batch_size x group_size) x the mean response (a lower bound);
    `served`: also the groups generated and dropped (filter_uniform_reward), the evals' share, and their computed
    prompt tokens (the prefix cache computes a group's prompt once); `busy_s`: the server's CPU seconds per step in
    the measured run, which at a decode batch B serves busy_s / step_s(B) x B tokens (`conclude`), so that run-time
    application would cost busy_s x its extra fraction per version, whatever the response lengths were."""
    sched, roll, ev = cfg["schedule"], cfg["rollout"], cfg["eval"]
    groups = sched["batch_size"] * args.generated_per_trained
    evals = ev["num_prompts"] / sched["eval_every"] if sched.get("eval_every") else 0.0
    return {
        "batch_size": sched["batch_size"],
        "group_size": roll["group_size"],
        "max_concurrent_rows": sched["max_concurrent_groups"] * roll["group_size"],
        "mean_response_tokens": args.mean_response,
        "generated_per_trained_group": args.generated_per_trained,
        "prompt_tokens": args.prompt_tokens,
        "trained": {
            "decode_tokens": sched["batch_size"] * roll["group_size"] * args.mean_response,
            "prefill_tokens": 0,
        },
        "served": {
            "decode_tokens": (groups * roll["group_size"] + evals) * args.mean_response,
            "prefill_tokens": (groups + evals) * args.prompt_tokens,
        },
        "server_busy_s": args.server_busy_s,
    }


def conclude(model: dict, version: dict) -> dict:
    """Per thread count and decode batch: seconds per version of each path (run time: one prepare plus the extra
    per token, prompt tokens at the prefill step's rate), and the break-even in tokens."""
    m = model["merge"]
    merged_s = m["version_s"]
    system_s = merged_s + m["merge_s"]
    out: dict = {"merged_s_per_version": merged_s, "merged_s_with_identity": system_s, "by_threads": {}}
    for threads, res in model["by_threads"].items():
        pre = res.get("prefill", {}).get("extra_ms_per_token", 0.0)
        rows = {}
        for b, r in res["decode"].items():
            per_token = r["extra_ms_per_token"]
            row = {"break_even_tokens": (merged_s - m["prepare_s"]) * 1000 / per_token}
            for kind in ("trained", "served"):
                v = version[kind]
                runtime_s = m["prepare_s"] + (v["decode_tokens"] * per_token + v["prefill_tokens"] * pre) / 1000
                row[f"runtime_s_per_version_{kind}"] = runtime_s
                row[f"runtime_over_merged_{kind}"] = runtime_s / merged_s
            row["tokens_busy_s"] = version["server_busy_s"] * 1000 / r["step_ms"] * int(b)
            row["runtime_s_per_version_busy_s"] = m["prepare_s"] + version["server_busy_s"] * r["extra_frac"]
            row["runtime_over_merged_busy_s"] = row["runtime_s_per_version_busy_s"] / merged_s
            # merged also costs the trainer the same merge per version, for the identity of the served bits
            # (train/lora_publish.py; its digests not counted); run-time serving would name base + adapters instead
            row["runtime_over_merged_busy_s_with_identity"] = row["runtime_s_per_version_busy_s"] / system_s
            row["runtime_over_merged_served_with_identity"] = row["runtime_s_per_version_served"] / system_s
            rows[b] = row
        out["by_threads"][threads] = rows

    def verdict(kind: str) -> str:
        ratios = [r[f"runtime_over_merged_{kind}"] for t in out["by_threads"].values() for r in t.values()]
        return "merged" if min(ratios) > 1 else ("run time" if max(ratios) < 1 else "depends on the batch")

    out["faster"] = {kind: verdict(kind) for kind in ("trained", "served", "busy_s")}
    return out


def report(result: dict) -> None:
    mach, a, v = result["machine"], result["adapter"], result["typical_version"]
    print(
        f"LoRA r={a['rank']} alpha={a['alpha']:g}, {len(a['target_modules'])} projections; {mach['lscpu_model_name']}"
    )
    print(f"  start: {mach['uptime']}\n  end:   {mach['uptime_end']}")
    t, sv = v["trained"], v["served"]
    print(
        f"a version: {t['decode_tokens']:.0f} trained tokens; {sv['decode_tokens']:.0f} decoded + "
        f"{sv['prefill_tokens']:.0f} prompt tokens served; {v['server_busy_s']:.1f} server CPU s"
    )
    for name, m in result["models"].items():
        g = m["merge"]
        print(
            f"{name} ({m['dtype']}): merge {g['merge_s'] * 1000:.1f} ms + swap {g['swap_s'] * 1000:.1f} ms per version "
            f"(read {g['read_s'] * 1000:.1f}; run-time prepare {g['prepare_s'] * 1000:.1f}); run-time vs merged "
            f"logits {max(m['max_logit_diff_runtime_vs_merged'].values()):.1e}"
        )
        print(
            f"  {'thr':>3} {'rows':>5} {'step ms':>8} {'extra ms':>9} {'extra':>6} {'in-step':>8} {'layout':>10} "
            f"{'break-even':>10}   run time / merged: trained served busy_s +identity"
        )
        for threads, res in m["by_threads"].items():
            blocks = list(res["decode"].items()) + ([("pre", res["prefill"])] if "prefill" in res else [])
            for b, r in blocks:
                c = m["conclusion"]["by_threads"][threads].get(b)
                tail = (
                    ""
                    if c is None
                    else f"{c['break_even_tokens']:>10.0f}   "
                    + " ".join(
                        f"{c['runtime_over_merged_' + k]:.2f}"
                        for k in ("trained", "served", "busy_s", "busy_s_with_identity")
                    )
                )
                print(
                    f"  {threads:>3} {r['tokens_per_step']:>5} {r['step_ms']:>8.2f} {r['extra_ms']:>9.3f} "
                    f"{r['extra_frac']:>6.1%} {r['in_step_ms'][r['best_layout']]:>8.3f} {r['best_layout']:>10} {tail}"
                )
        print(f"  faster: {m['conclusion']['faster']}")
