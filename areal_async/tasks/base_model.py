"""The default base model: a tiny Qwen2 trained from scratch on the arith task, in a few minutes on one CPU core.

`ensure_base_model()` returns an HF checkpoint directory (config.json, model.safetensors, the char tokenizer with
its chat template) that every loader in the project reads like a downloaded model.

The same start everywhere: the default model (seed 0, default settings) ships with the package
(`tasks/base_weights/`, 4 MB, its sha256 checked on use), built once by the recipe below. Floating-point sums differ
between CPU kinds, so the recipe yields a slightly different model on each (held-out greedy accuracy measured 16% to
40% across machines); shipping one build makes the default run start from the same model on every machine, and
spares a new user the few-minute build. The recipe stays the reference: `--from-recipe` (or any setting or seed
other than the default) builds a model and caches it; the cache key hashes every setting, `FORMAT_VERSION` and the
build code itself (the syntax trees of this module, the task and the tokenizer; see
`areal_async.cache.code_fingerprint`), so changing anything that shapes the model builds a new one instead of
silently reusing a stale one. A test checks that the recipe still yields a model in the shipped one's accuracy band.

Why the warm-up has two phases: RL needs headroom. The first phase teaches worked solutions only (see
`areal_async.tasks.arith`) until the model follows the procedure reliably; the last `bare_phase_steps` mix in bare
answers (`#### 54`, no work shown) as the majority style. The model keeps both skills: greedy decoding follows the
majority style and mostly guesses, so held-out greedy accuracy starts low, while sampling at temperature 1 writes
worked solutions often enough that most prompts get some correct samples. Rewarding correct answers then teaches the
model to work the problem out, and greedy accuracy climbs fast while responses grow longer - the effect RL is used
for on real models, visible in minutes on a laptop.

Building: a plain single-process torch loop (transformers' Qwen2ForCausalLM, AdamW, warm-up + cosine schedule),
sequences bucketed by length to avoid padding, loss on the answer tokens only. Deterministic for a seed on a given
kind of machine (the build runs on a fixed number of CPU threads, `torch_threads`). Writes go to a temporary
directory renamed into place, under a file lock, so concurrent builders neither corrupt the cache nor train twice.
Importing this module and computing `cached_path()` need no torch; callers that must not import torch (the
controller) build through `areal_async.model_store`, which runs the CLI below in a subprocess.

CLI: `python -m areal_async.tasks.base_model [--from-recipe] [--out DIR] [--seed S] [--cache-dir DIR] [key=value ...]`
(`--out` always builds by the recipe).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from areal_async import cache, progress
from areal_async.tasks import arith
from areal_async.tasks.char_tokenizer import save_char_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the build procedure changes in a way the settings do not capture
MARKER = "areal_base_model.json"  # written last into the temporary directory; its presence means complete
# the modules whose code shapes the model: their fingerprint is part of the cache key
BUILD_MODULES = ("areal_async.tasks.base_model", "areal_async.tasks.arith", "areal_async.tasks.char_tokenizer")


@dataclasses.dataclass(frozen=True)
class BaseModelSpec:
    """Every setting of the base model and its warm-up; all of them enter the cache key."""

    # architecture (Qwen2)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # supervised warm-up; small batches: at this scale more updates beat larger batches per token (measured)
    sft_steps: int = 2650  # 2400 worked-solution steps reach ~92% on held-out problems (measured), then the bare phase
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bare_phase_steps: int = 250  # the last steps mix in bare answers (see the module docstring)
    bare_answer_fraction: float = 0.65  # share of bare answers during that phase
    bucket_batches: int = 16  # batches drawn at once and sorted by length, so a batch has little padding
    torch_threads: int = 1  # CPU threads of the build: fixed, so a seed rebuilds the same model (same CPU kind)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        if self.sft_steps < 0 or self.batch_size < 1:
            raise ValueError("sft_steps must be >= 0 and batch_size >= 1")
        if not 0 <= self.bare_phase_steps <= self.sft_steps:
            raise ValueError("bare_phase_steps must be in [0, sft_steps]")
        if not 0.0 <= self.bare_answer_fraction <= 1.0:
            raise ValueError("bare_answer_fraction must be in [0, 1]")
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")


default_cache_dir = cache.default_cache_dir

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base_weights")
# the shipped build's weights (its areal_base_model.json records where, how and with what accuracy it was built)
SHIPPED_SHA256 = "868568d17d35326ab459a17d5f293d772c0307e610604e705cded276ca1392c4"
_shipped_ok: str | None = None


class ShippedModelError(RuntimeError):
    """The shipped base model is missing or its weights are not the ones released (a damaged install)."""


def shipped_model() -> str:
    """The shipped default base model's directory, after checking its weights' sha256 (once per process)."""
    global _shipped_ok
    if _shipped_ok is not None:
        return _shipped_ok
    weights = os.path.join(SHIPPED_DIR, "model.safetensors")
    if not is_built(SHIPPED_DIR) or not os.path.isfile(weights):
        raise ShippedModelError(
            f"the shipped base model is incomplete at {SHIPPED_DIR}; reinstall the package, or "
            "build one with `python -m areal_async.tasks.base_model --from-recipe`"
        )
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != SHIPPED_SHA256:
        raise ShippedModelError(
            f"{weights} has sha256 {digest.hexdigest()}, expected {SHIPPED_SHA256} (a damaged or "
            "modified install); reinstall the package"
        )
    _shipped_ok = SHIPPED_DIR
    return SHIPPED_DIR


def is_default(seed: int, overrides: dict[str, Any]) -> bool:
    """Whether (seed, settings) names the shipped build: seed 0 and every setting at its default."""
    return seed == 0 and make_spec(**overrides) == BaseModelSpec()


def build_code_fingerprint() -> str:
    return cache.code_fingerprint(list(BUILD_MODULES))


def cache_key(spec: BaseModelSpec, seed: int) -> str:
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "seed": seed,
            "task": dataclasses.asdict(arith.ArithSpec()),
            "code": build_code_fingerprint(),
            **dataclasses.asdict(spec),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_spec(**overrides: Any) -> BaseModelSpec:
    """`BaseModelSpec` with overrides; an unknown name is an error listing the valid ones."""
    names = {f.name for f in dataclasses.fields(BaseModelSpec)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown base model setting(s) {unknown}; valid: {sorted(names)}")
    return BaseModelSpec(**overrides)


def cached_path(cache_dir: str | None = None, seed: int = 0, **overrides: Any) -> str:
    """Where the base model for (settings, seed) lives in the cache, built or not; needs no torch."""
    spec = make_spec(**overrides)
    return os.path.join(cache_dir or default_cache_dir(), "base_models", f"arith-qwen2-{cache_key(spec, seed)}")


def is_built(path: str) -> bool:
    return cache.is_complete(path, MARKER)


def ensure_base_model(cache_dir: str | None = None, seed: int = 0, from_recipe: bool = False, **overrides: Any) -> str:
    """The checkpoint directory of the base model for (settings, seed): the shipped build for the defaults (unless
    `from_recipe`), else built on first use by the recipe and cached (in this process: it imports torch; see
    `areal_async.model_store.resolve_model_path` for the torch-free way)."""
    if not from_recipe and is_default(seed, overrides):
        return shipped_model()
    final = cached_path(cache_dir, seed, **overrides)
    if is_built(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with cache.file_lock(final + ".lock"):
        if is_built(final):  # another process built it while we waited
            return final
        build_into(final, make_spec(**overrides), seed)
    return final


def build_into(final: str, spec: BaseModelSpec, seed: int) -> None:
    """Train into a fresh temporary sibling of `final`, then rename it into place. Call under the lock."""
    tmp = cache.fresh_tmp_dir(final)
    try:
        build_base_model(tmp, spec, seed)
        cache.follow_umask(tmp)  # safetensors writes 0600; teammates sharing the cache should read it
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- the warm-up ------------------------------------------------------------------------------------------------


def warmup_text(problem: arith.Problem, rng: random.Random, bare_answer_fraction: float) -> str:
    """The answer the warm-up teaches for `problem`: bare or worked (see the module docstring)."""
    if rng.random() < bare_answer_fraction:
        return f"{arith.ANSWER_PREFIX} {problem.answer}"
    return arith.worked_solution(problem)


def _warmup_batches(
    tokenizer, spec: BaseModelSpec, rng: random.Random, eos_id: int, bare_fraction: float
) -> Iterator[tuple[list, list]]:
    """Endless (token lists, loss masks) batches of training-split problems, bucketed by length."""
    task = arith.ArithSpec()
    while True:
        texts: list[tuple[str, str]] = []
        while len(texts) < spec.batch_size * spec.bucket_batches:
            p = arith.random_problem(rng, task)
            prompt = arith.prompt_of(p)
            if not arith.is_eval_problem(prompt, task):  # never train on held-out problems
                texts.append((prompt, warmup_text(p, rng, bare_fraction)))
        prompts = tokenizer.encode_batch([t[0] for t in texts], add_special_tokens=False)
        answers = tokenizer.encode_batch([t[1] for t in texts], add_special_tokens=False)
        seqs = [(p.ids + a.ids + [eos_id], len(p.ids)) for p, a in zip(prompts, answers)]
        seqs.sort(key=lambda x: len(x[0]))
        chunks = [seqs[i : i + spec.batch_size] for i in range(0, len(seqs), spec.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [s for s, _ in chunk], [n for _, n in chunk]


def build_base_model(
    out_dir: str, spec: BaseModelSpec = BaseModelSpec(), seed: int = 0, device: str | None = None
) -> dict[str, Any]:
    """Train the base model from scratch and save it (with tokenizer and `MARKER`) into `out_dir`; returns stats.

    Runs with `spec.torch_threads` CPU threads (restored afterwards): float sums depend on the thread count, so a
    fixed count is what lets a seed rebuild the same weights on the same kind of CPU and torch version."""
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(spec.torch_threads)
    try:
        return _train_and_save(out_dir, spec, seed, device)
    finally:
        torch.set_num_threads(threads_before)


def _train_and_save(out_dir: str, spec: BaseModelSpec, seed: int, device: str | None) -> dict[str, Any]:
    import torch
    import transformers
    from tokenizers import Tokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(out_dir, exist_ok=True)
    vocab_size = save_char_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    eos_id, pad_id = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|pad|>")

    cfg = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.init_std,
        tie_word_embeddings=True,
        use_sliding_window=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).to(device=dev, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "building the tiny base model (%.2fM params, %d warm-up steps on %s) into %s",
        n_params / 1e6,
        spec.sft_steps,
        dev,
        out_dir,
    )

    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to min_lr_ratio
        warm = min(1.0, (step + 1) / max(1, spec.warmup_steps))
        progress = min(1.0, step / max(1, spec.sft_steps))
        return warm * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = random.Random(f"areal_async.base_model/{seed}")
    bare_from = spec.sft_steps - spec.bare_phase_steps + 1
    batches = _warmup_batches(tokenizer, spec, rng, eos_id, 0.0)
    model.train()
    t0 = time.perf_counter()
    loss_ema, tokens = float("nan"), 0
    log_every = max(1, spec.sft_steps // 10)
    shown = progress.bar(spec.sft_steps, "base model warm-up", unit="step")  # on a terminal only; then no log lines
    for step in range(1, spec.sft_steps + 1):
        if step == bare_from:  # second phase: worked solutions mixed with bare answers
            batches = _warmup_batches(tokenizer, spec, rng, eos_id, spec.bare_answer_fraction)
        seqs, prompt_lens = next(batches)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, T]
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)  # [B, T], -100 = no loss
        mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
        for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, n : len(s)] = ids[i, n : len(s)]  # learn the answer and its EOS, not the random prompt
            mask[i, : len(s)] = 1
        tokens += int(mask.sum())
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        sched.step()
        loss = out.loss.item()
        loss_ema = loss if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * loss
        shown.update(1)
        if step % 10 == 0:
            shown.set_postfix_str(f"loss {loss_ema:.3f}", refresh=False)
        if isinstance(shown, progress.NoBar) and (step % log_every == 0 or step == spec.sft_steps):
            log.info(
                "base model warm-up step %d/%d loss %.3f (%.1f s)",
                step,
                spec.sft_steps,
                loss_ema,
                time.perf_counter() - t0,
            )
    shown.close()
    seconds = time.perf_counter() - t0

    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out_dir, safe_serialization=True)
    stats = {
        "format_version": FORMAT_VERSION,
        "code": build_code_fingerprint(),
        "seed": seed,
        "settings": dataclasses.asdict(spec),
        "task": dataclasses.asdict(arith.ArithSpec()),
        "num_params": n_params,
        "sft_seconds": round(seconds, 2),
        "final_loss": round(loss_ema, 4),
        "tokens": tokens,
        "device": str(dev),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump(stats, f, indent=2)
    log.info("base model ready in %.1f s (loss %.3f): %s", seconds, loss_ema, out_dir)
    return stats


# ---- CLI --------------------------------------------------------------------------------------------------------


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"overrides are key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_async.tasks.base_model",
        description="Build (or find in the cache) the tiny default base model.",
    )
    ap.add_argument("--out", help="write the checkpoint here instead of the cache (rebuilt if settings differ)")
    ap.add_argument("--cache-dir", help="cache root (default $AREAL_CACHE or ~/.cache/areal_async)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--from-recipe",
        action="store_true",
        help="build the default model by the recipe (cached) instead of using the shipped build",
    )
    ap.add_argument("overrides", nargs="*", help="BaseModelSpec settings, e.g. sft_steps=300")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        overrides = _parse_overrides(args.overrides)
        if args.out:
            spec = make_spec(**overrides)
            marker = os.path.join(args.out, MARKER)
            same = False
            if os.path.isfile(marker):
                with open(marker) as f:
                    old = json.load(f)
                same = (
                    old.get("format_version") == FORMAT_VERSION
                    and old.get("seed") == args.seed
                    and old.get("code") == build_code_fingerprint()
                    and old.get("settings") == dataclasses.asdict(spec)
                )
            if not same:
                if os.path.exists(args.out) and os.listdir(args.out) and not os.path.isfile(marker):
                    raise SystemExit(f"{args.out} exists and is not a base model directory; refusing to replace it")
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with cache.file_lock(os.path.abspath(args.out) + ".lock"):
                    build_into(args.out, spec, args.seed)
            path = args.out
        else:
            path = ensure_base_model(args.cache_dir, args.seed, args.from_recipe, **overrides)
    except (ValueError, ShippedModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
