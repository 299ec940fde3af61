"""ensure_base_model: builds a real checkpoint (on a tiny quick setting), caches it, and loads with transformers."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from areal_async.tasks import base_model as bm

# a few warm-up steps of a very small model: seconds, not the real minutes
QUICK = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, sft_steps=4,
             bare_phase_steps=2, batch_size=4, bucket_batches=2)


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
