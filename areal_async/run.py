"""`python -m areal_async.run [--config FILE] [key=value ...]`: one asynchronous RL run, end to end.

With no arguments it trains the project's tiny model on the synthetic arithmetic task on this machine's CPU:
one embedded inference server, one torchrun trainer, async mode (configs/default.yaml). Everything a run makes lands
in `run_dir`: metrics.jsonl, TensorBoard events, progress.png, logs/, checkpoints/, the final HF checkpoint and
summary.json. A run directory with a checkpoint is resumed (resume=false starts over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

from areal_async.config import ConfigError, RunConfig, load_config, to_dict

log = logging.getLogger("areal_async.run")

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


def parse_args(argv: list[str] | None) -> tuple[str | None, list[str]]:
    p = argparse.ArgumentParser(prog="python -m areal_async.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml when present)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. mode=sync eta=2 train.optim.lr=1e-4")
    args = p.parse_args(argv)
    path = args.config
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    return path, args.overrides


def setup_logging(run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    fileh = logging.FileHandler(os.path.join(run_dir, "run.log"))
    fileh.setFormatter(fmt)
    root.addHandler(console)
    root.addHandler(fileh)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def resolve_model(cfg: RunConfig) -> str:
    if cfg.model.path == "tiny":
        from areal_async.tasks.base_model import ensure_base_model

        return ensure_base_model()
    if not os.path.isdir(cfg.model.path) and cfg.server.backend == "embedded":
        raise ConfigError(f"model.path: {cfg.model.path} is not a directory")
    return cfg.model.path


async def run(cfg: RunConfig, workflow: Any = None) -> dict[str, Any]:
    """Launch servers and trainers, run the controller, write the outputs; always tear the children down.

    `workflow` replaces the one `rollout.workflow` names, so a Python caller (an agent environment, a notebook) can
    hand in its own without making it importable by name: either a Workflow (an object with
    `async run(client, sample) -> list[Trajectory] | None`) or a factory `f(cfg, tokenizer, score) -> Workflow`
    called once the tokenizer and the reward runner exist (`score` is the configured reward, run off the loop).
    """
    import msgspec

    from areal_async.inference.client import InferenceClient
    from areal_async.launcher import Launcher
    from areal_async.metrics import MetricsLogger, plot_run
    from areal_async.rewards.runner import RewardRunner
    from areal_async.rollout.controller import AsyncRLController, RunState, ScheduleConfig, load_state
    from areal_async.rollout.evaluate import evaluate
    from areal_async.rollout.samples import SampleStream
    from areal_async.rollout.workflows import build_workflow
    from areal_async.tasks.datasets import load_samples
    from areal_async.tokenizer import Tokenizer
    from areal_async.train.client import TrainerGroup

    run_dir = cfg.run_dir
    t_setup = time.monotonic()
    model_path = resolve_model(cfg)
    tokenizer = Tokenizer(model_path)
    train_samples, eval_samples = load_samples(cfg.data)
    eval_samples = eval_samples[: cfg.eval.num_prompts]
    log.info("model %s; %d train / %d eval samples", model_path, len(train_samples), len(eval_samples))

    resumed = load_state(run_dir) if cfg.resume else None
    if not cfg.resume and os.path.isdir(os.path.join(run_dir, "checkpoints")):
        shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    old_metrics = os.path.join(run_dir, "metrics.jsonl")
    if not resumed and os.path.exists(old_metrics):  # a fresh run: its records must not follow an older run's
        kept = os.path.join(run_dir, time.strftime("metrics.before-%Y%m%d-%H%M%S.jsonl"))
        os.replace(old_metrics, kept)
        log.info("a new run in %s: the previous metrics.jsonl is kept as %s", run_dir, os.path.basename(kept))
    state = resumed[0] if resumed else RunState()
    if resumed:
        log.info("resuming from %s at version %d (data position %d)", resumed[1], state.version,
                 state.data_position)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)

    train_cfg = msgspec.structs.replace(
        cfg.train, optim=msgspec.structs.replace(cfg.train.optim, total_steps=cfg.total_steps),
        temperature=cfg.rollout.temperature)
    secret = os.urandom(32)
    launcher = Launcher(run_dir)
    client = trainers = runner = None
    logger = MetricsLogger(run_dir)
    try:
        srv = cfg.server
        if srv.backend == "external":
            urls = list(srv.urls)
        else:
            started = []
            for i in range(srv.num_servers):
                port = srv.port + i if srv.port else 0
                if srv.backend == "embedded":
                    started.append(launcher.start_embedded_server(
                        i, model_path, host=srv.host, port=port, device=srv.device,
                        max_total_tokens=srv.max_total_tokens, max_running_requests=srv.max_running_requests,
                        api_key=srv.api_key, torch_threads=srv.torch_threads, prefix_cache=srv.prefix_cache))
                else:
                    started.append(launcher.start_sglang_server(
                        i, model_path, host=srv.host, port=port, api_key=srv.api_key, extra_args=srv.extra_args,
                        base_gpu_id=srv.base_gpu_id, gpus_per_server=srv.gpus_per_server))
            urls = [u for _, u in started]
        launcher.start_trainers(
            model=model_path, nproc=train_cfg.nproc, config_json=msgspec.json.encode(train_cfg).decode(),
            seed=cfg.seed, secret_hex=secret.hex(), torch_threads=train_cfg.torch_threads,
            resume=os.path.join(resumed[1], "trainer") if resumed else None, torchrun_args=train_cfg.torchrun_args,
            cuda_visible_devices=train_cfg.cuda_visible_devices)
        if srv.backend != "external":
            await _race(launcher.wait_healthy(started, srv.startup_timeout_s, srv.api_key), launcher.watch())
        client = InferenceClient(urls, api_key=srv.api_key)
        trainers = await _race(TrainerGroup.connect(run_dir, train_cfg.nproc, secret, timeout=300.0),
                               launcher.watch())
        log.info("servers %s and %d trainer rank(s) ready in %.1fs", urls, train_cfg.nproc,
                 time.monotonic() - t_setup)

        runner = RewardRunner()

        async def score(completion: str, answer: str, prompt: str) -> tuple[float, str | None]:
            return await runner.score(cfg.data.reward, completion, answer, prompt=prompt,
                                      timeout_s=cfg.rollout.reward_timeout_s)

        if resumed:  # the servers start from the base model: bring them to the resumed version
            pub = await trainers.publish(state.version, os.path.join(run_dir, "weights"), train_cfg.keep_versions)
            await client.update_weights_from_disk(pub.path, state.version)

        if train_cfg.weight_sync == "broadcast":
            info = (await trainers.info())[0]
            backend = "nccl" if info.device.startswith("cuda") else "gloo"
            await trainers.init_broadcast_group(client, num_server_ranks=len(urls), backend=backend)
        if workflow is None:
            workflow = build_workflow(cfg, tokenizer, score)
        elif not hasattr(workflow, "run"):
            workflow = workflow(cfg, tokenizer, score)

        eval_priority = cfg.eval.priority
        if eval_priority is None and cfg.server.backend == "embedded":
            eval_priority = 1

        async def evaluator() -> dict[str, float]:
            return await evaluate(client, tokenizer, eval_samples, score, max_new_tokens=cfg.eval.max_new_tokens,
                                  use_chat_template=cfg.data.apply_chat_template, priority=eval_priority)

        sched = ScheduleConfig(
            batch_size=cfg.rollout.batch_size, total_steps=cfg.total_steps, eta=cfg.rollout.effective_eta,
            interruptible=cfg.rollout.interruptible, max_concurrent_groups=cfg.rollout.max_concurrent_groups,
            filter_uniform_reward=cfg.rollout.filter_uniform_reward, eval_every=cfg.eval.every_steps,
            checkpoint_every=cfg.train.checkpoint_every, keep_versions=train_cfg.keep_versions,
            max_wall_s=cfg.max_wall_s, weight_sync=train_cfg.weight_sync)
        ctrl = AsyncRLController(sched, client, trainers, workflow, SampleStream(train_samples, seed=cfg.seed),
                                 run_dir, evaluator=evaluator if eval_samples else None, logger=logger, state=state,
                                 busy_probe=lambda: _server_busy_s(urls, srv.api_key))
        state = await _race(ctrl.run(), launcher.watch())
        await _race(ctrl.save_checkpoint(), launcher.watch())
        final_dir = os.path.join(run_dir, "final")
        final_src = await _race(ctrl.publish_final(), launcher.watch())
        if final_src:
            if os.path.isdir(final_dir):
                shutil.rmtree(final_dir)
            shutil.copytree(final_src, final_dir)
        summary = {
            "mode": cfg.rollout.mode,
            "eta": cfg.rollout.effective_eta,
            "interruptible": cfg.rollout.interruptible,
            "base_accuracy": state.base_accuracy,
            "final_accuracy": ctrl.evals[-1]["accuracy"] if ctrl.evals else None,
            "wall_s": state.wall_s,
            "steps": state.version,
            "trained_samples": state.trained_samples,
            "trained_samples_per_s": state.trained_samples / max(state.wall_s, 1e-9),
            "max_staleness_seen": state.max_staleness_seen,
            "staleness_hist": state.staleness_hist,
            "rollout": ctrl.rollout.stats.__dict__,
            "timings": ctrl.timings,
            # compute seconds summed over servers during the training loop (embedded servers report it)
            "server_busy_s": ctrl.timings.get("server_busy_s"),
            "num_servers": len(urls),
            "evals": ctrl.evals,
            "final_checkpoint": final_dir if final_src else None,
            "model": model_path,
        }
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        logger.close()
        plot_run(run_dir)
        print_summary(summary)
        return summary
    finally:
        with contextlib.suppress(Exception):
            logger.close()
        if trainers is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(trainers.shutdown(), 30)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner.close()
        launcher.shutdown()


async def _race(main, watcher):
    """Await `main`; if `watcher` (the children's health) raises first, cancel `main` and raise that."""
    main_t = asyncio.ensure_future(main)
    watch_t = asyncio.ensure_future(watcher)
    try:
        done, _ = await asyncio.wait({main_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        if watch_t in done:
            main_t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await main_t
            watch_t.result()
        return main_t.result()
    finally:
        for t in (main_t, watch_t):
            t.cancel()
        await asyncio.gather(main_t, watch_t, return_exceptions=True)


async def _server_busy_s(urls: list[str], api_key: str | None) -> float | None:
    """Seconds the servers spent computing (the embedded engine reports `busy_s` in /server_info; others don't)."""
    import aiohttp

    total = 0.0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for url in urls:
                async with session.get(url + "/server_info", headers=headers) as r:
                    busy = (await r.json()).get("busy_s")
                    if busy is None:
                        return None
                    total += float(busy)
    except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
        return None
    return total


def print_summary(s: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    gain = (None if s["base_accuracy"] is None or s["final_accuracy"] is None
            else s["final_accuracy"] - s["base_accuracy"])
    rows = [
        ("mode", f"{s['mode']} (eta={s['eta']}, interruptible={s['interruptible']})"),
        ("held-out accuracy", f"{pct(s['base_accuracy'])} -> {pct(s['final_accuracy'])}"
                              + (f"  ({100 * gain:+.1f} pts)" if gain is not None else "")),
        ("train steps", str(s["steps"])),
        ("trained samples", f"{s['trained_samples']}  ({s['trained_samples_per_s']:.1f}/s)"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("max staleness seen", str(s["max_staleness_seen"])),
        ("final checkpoint", str(s["final_checkpoint"])),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "=" * 60)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print("=" * 60)


def main(argv: list[str] | None = None, workflow: Any = None) -> int:
    """The command line entry point, also callable from Python: `main(["total_steps=20"], workflow=make_workflow)`
    runs with the same config handling, logging and exit codes, and the given workflow (see `run`)."""
    try:
        path, overrides = parse_args(argv)
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run_dir)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(run(cfg, workflow))
    except KeyboardInterrupt:
        log.warning("interrupted; children stopped")
        return 130
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        log.error("run failed: %s: %s", type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
