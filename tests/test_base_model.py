"""ensure_base_model: builds a real checkpoint (on a tiny quick setting), caches it, and loads with transformers."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from areal_async.tasks import base_model as bm

# a few warm-up steps of a very small model: seconds, not the real minutes
QUICK = dict(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    sft_steps=4,
    bare_phase_steps=2,
    batch_size=4,
    bucket_batches=2,
)


def _files_mtimes(path: str) -> dict[str, int]:
    return {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in sorted(os.listdir(path))}


def test_builds_caches_and_loads(tmp_path):
    import torch
    import transformers

    cache = str(tmp_path / "cache")
    path = bm.ensure_base_model(cache, seed=0, **QUICK)
    assert path.startswith(cache) and os.path.isdir(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", bm.MARKER):
        assert os.path.isfile(os.path.join(path, name)), name
    with open(os.path.join(path, bm.MARKER)) as f:
        info = json.load(f)
    assert info["settings"]["sft_steps"] == 4 and info["seed"] == 0 and info["format_version"] == bm.FORMAT_VERSION
    assert not [e for e in os.listdir(os.path.dirname(path)) if ".tmp-" in e]  # no leftovers

    # second call: same directory, nothing rewritten
    before = _files_mtimes(path)
    assert bm.ensure_base_model(cache, seed=0, **QUICK) == path
    assert _files_mtimes(path) == before

    # a real HF checkpoint: transformers loads model and tokenizer, EOS/pad as the project expects
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 32
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0 and model.generation_config.eos_token_id == 1
    ids = tok("Add 3 to 4 until above 10.\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert torch.isfinite(model(ids).logits).all()


def test_cache_key_covers_seed_and_every_setting(tmp_path):
    base = bm.cache_key(bm.make_spec(**QUICK), 0)
    assert bm.cache_key(bm.make_spec(**QUICK), 0) == base
    assert bm.cache_key(bm.make_spec(**QUICK), 1) != base
    for field, value in (("sft_steps", 5), ("lr", 1e-4), ("bare_answer_fraction", 0.1), ("hidden_size", 64)):
        assert bm.cache_key(bm.make_spec(**{**QUICK, field: value}), 0) != base, field
    with pytest.raises(ValueError, match="unknown base model setting"):
        bm.ensure_base_model(str(tmp_path), hiden_size=3)


def test_build_is_deterministic_for_a_seed(tmp_path):
    a = bm.ensure_base_model(str(tmp_path / "a"), seed=3, **QUICK)
    b = bm.ensure_base_model(str(tmp_path / "b"), seed=3, **QUICK)
    c = bm.ensure_base_model(str(tmp_path / "c"), seed=4, **QUICK)
    read = lambda p: open(os.path.join(p, "model.safetensors"), "rb").read()  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_incomplete_directory_is_rebuilt(tmp_path):
    path = bm.ensure_base_model(str(tmp_path), seed=0, **QUICK)
    os.remove(os.path.join(path, bm.MARKER))  # as if a build had been cut off before completing
    again = bm.ensure_base_model(str(tmp_path), seed=0, **QUICK)
    assert again == path and os.path.isfile(os.path.join(path, bm.MARKER))


def _build_in_child(cache: str, q) -> None:
    q.put(bm.ensure_base_model(cache, seed=0, **QUICK))


@pytest.mark.slow
def test_concurrent_builders_agree_and_leave_one_complete_model(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    paths = {q.get(timeout=5), q.get(timeout=5)}
    assert len(paths) == 1
    path = paths.pop()
    root = os.path.dirname(path)
    assert [e for e in os.listdir(root) if not e.endswith(".lock")] == [os.path.basename(path)]
    with open(os.path.join(path, bm.MARKER)) as f:
        assert json.load(f)["seed"] == 0


def test_cli_out_dir(tmp_path, capsys):
    out = str(tmp_path / "model")
    args = ["--out", out, "--seed", "2"] + [f"{k}={v}" for k, v in QUICK.items()]
    assert bm.main(args) == 0
    assert capsys.readouterr().out.strip() == out
    before = _files_mtimes(out)
    assert bm.main(args) == 0  # same settings: kept
    assert _files_mtimes(out) == before
    assert bm.main(["--out", out, "no_such_setting=1"]) == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        bm.main(["--out", str(foreign)] + [f"{k}={v}" for k, v in QUICK.items()])
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_CACHE", str(tmp_path))
    assert bm.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("AREAL_CACHE")
    assert bm.default_cache_dir().endswith(os.path.join(".cache", "areal_async"))


def test_default_model_is_the_shipped_build_checked_by_its_hash(tmp_path, monkeypatch):
    from areal_async.model_store import ModelPathError, resolve_model_path

    assert bm.ensure_base_model() == bm.SHIPPED_DIR == resolve_model_path("tiny", str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing built or cached for the default
    with open(os.path.join(bm.SHIPPED_DIR, bm.MARKER)) as f:
        info = json.load(f)
    assert info["sha256"]["model.safetensors"] == bm.SHIPPED_SHA256 and info["settings"] == bm.BaseModelSpec().__dict__
    # any other seed or setting is the recipe's, built into the cache
    assert bm.cached_path(str(tmp_path), seed=1).startswith(str(tmp_path))
    assert not bm.is_default(1, {}) and not bm.is_default(0, {"sft_steps": 1000}) and bm.is_default(0, {"lr": 1e-3})

    # a damaged copy is refused with a message, never loaded
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(bm.SHIPPED_DIR, damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(bm, "SHIPPED_DIR", str(damaged))
    monkeypatch.setattr(bm, "_shipped_ok", None)
    with pytest.raises(bm.ShippedModelError, match="sha256"):
        bm.ensure_base_model()
    with pytest.raises(ModelPathError, match="sha256"):
        resolve_model_path("tiny", str(tmp_path))


def _greedy_accuracy(model_dir: str, out: str) -> float:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        os.path.join(root, "benchmarks", "task_accuracy.py"),
        "--model",
        model_dir,
        "--datasets",
        "arith",
        "--reward",
        "arith",
        "--num",
        "200",
        "--no-chat-template",
        "--max-new-tokens",
        "96",
        "--threads",
        "1",
        "--out",
        out,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as f:
        return json.load(f)["results"][0]["accuracy"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_still_yields_a_model_in_the_shipped_band(tmp_path):
    """The recipe is the shipped model's source: built again (on this CPU; a whole-suite run starts the build in the
    background at session start), it must land in the band of held-out greedy accuracy that builds have measured
    across CPU kinds: 16.0% to 39.5% (an Intel with AMX: 25.0%; two AMD EPYCs, AVX2 and AVX-512: 27.5% and
    39.5%; short runs 16-25%). The band asserted, 10% to 55%, leaves room on both sides; below it the warm-up no
    longer teaches worked solutions, above it RL loses its headroom. The shipped build itself must still score what
    its record says, within 3 points (greedy near-ties can break another way on another CPU)."""
    with open(os.path.join(bm.SHIPPED_DIR, bm.MARKER)) as f:
        shipped_info = json.load(f)
    shipped = _greedy_accuracy(bm.ensure_base_model(), str(tmp_path / "shipped.json"))
    assert abs(shipped - shipped_info["held_out_greedy_accuracy"]) <= 0.03, shipped
    rebuilt_dir = bm.ensure_base_model(from_recipe=True)
    assert rebuilt_dir != bm.SHIPPED_DIR and bm.is_built(rebuilt_dir)
    rebuilt = _greedy_accuracy(rebuilt_dir, str(tmp_path / "rebuilt.json"))
    assert 0.10 <= rebuilt <= 0.55, rebuilt
