"""The decoder against transformers' forward of the same checkpoints, and checkpoint loading/validation."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from error_bounds import spec_logit_bound

from areal_async.server.model import DecoderModel, ModelSpec, UnsupportedModelError, rope_inv_freq
from areal_async.server.weights import WeightError, load_checkpoint
from areal_async.testing.tiny import make_tiny_checkpoint

torch.set_num_threads(1)


def _hf_logprobs(path: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), dim=-1) for s in seqs]


def _ours(path: str) -> DecoderModel:
    spec, tensors = load_checkpoint(path)
    model = DecoderModel(spec, "cpu", torch.float32)
    model.load_tensors(tensors)
    return model


# lengths cover one token, less than a page, exactly a page and several pages, in one batch
SEQS = [[5], [7, 8, 9, 10, 11], list(range(4, 20)), [(i * 7) % 90 + 4 for i in range(45)]]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_logprobs_match_transformers(tiny_ckpts_all_archs, arch):
    path = tiny_ckpts_all_archs[arch]
    model = _ours(path)
    ours = [torch.log_softmax(x, dim=-1) for x in model.score(SEQS)]
    for mine, ref in zip(ours, _hf_logprobs(path, SEQS)):
        assert mine.shape == ref.shape
        # two fp32 forwards summing in different orders (error_bounds.decoder_logit_bound)
        assert (mine - ref).abs().max().item() <= spec_logit_bound(model.spec, len(ref), ref.abs().max().item())


def test_untied_head_and_llama_biases_match_transformers(tmp_path):
    """The switches the tiny fixtures leave off: a separate lm_head (both), and Llama's attention_bias / mlp_bias."""
    import transformers

    from areal_async.tasks.char_tokenizer import save_char_tokenizer

    untied = make_tiny_checkpoint(str(tmp_path / "untied"), "qwen3", tie_word_embeddings=False, init_std=0.1)
    biased = str(tmp_path / "biased")
    vocab = save_char_tokenizer(biased)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        attention_bias=True,
        mlp_bias=True,
        initializer_range=0.1,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(biased, safe_serialization=True)
    for path in (untied, biased):
        ours = _ours(path)
        assert not ours.spec.tie_word_embeddings
        mine = [torch.log_softmax(x, dim=-1) for x in ours.score(SEQS)]
        for a, b in zip(mine, _hf_logprobs(path, SEQS)):
            # two fp32 forwards summing in different orders (error_bounds.decoder_logit_bound)
            assert (a - b).abs().max().item() <= spec_logit_bound(ours.spec, len(b), b.abs().max().item())


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    """A llama checkpoint whose config asks for scaled RoPE: positions well past the original window agree."""
    path = make_tiny_checkpoint(str(tmp_path / "llama"), "llama", seed=3, init_std=0.1)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    model = _ours(path)
    assert model.spec.rope_type == scaling["rope_type"]
    assert not torch.equal(
        rope_inv_freq(model.spec),
        rope_inv_freq(ModelSpec.from_hf_config({**cfg, "rope_parameters": {"rope_theta": 10000.0}})),
    )
    seq = [(i * 13) % 90 + 4 for i in range(200)]
    mine = torch.log_softmax(model.score([seq])[0], dim=-1)
    ref = _hf_logprobs(path, [seq])[0]
    # two fp32 forwards summing in different orders (error_bounds.decoder_logit_bound)
    assert (mine - ref).abs().max().item() <= spec_logit_bound(model.spec, len(seq), ref.abs().max().item())


def test_old_style_rope_config_is_read():
    """Checkpoints written before transformers 5 carry `rope_theta` and `rope_scaling` with `type`."""
    spec = ModelSpec.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert spec.rope_theta == 500000.0 and spec.rope_type == "linear" and dict(spec.rope_params) == {"factor": 2.0}


def test_unsupported_config_is_a_clear_error():
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM"):
        ModelSpec.from_hf_config({**base, "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelSpec.from_hf_config(
            {**base, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelSpec.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})


def test_sharded_checkpoint_loads(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "sharded"
    shutil.copytree(tiny_ckpt, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(dst / file))
        weight_map.update({n: file for n in part})
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    _, loaded = load_checkpoint(str(dst))
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[n], tensors[n]) for n in names)


def _broken_copy(src: str, dst: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_bad_checkpoints_are_rejected_with_the_reason(tiny_ckpt, tmp_path):
    spec, _ = load_checkpoint(tiny_ckpt)
    name = "model.layers.0.self_attn.q_proj.weight"
    missing = _broken_copy(tiny_ckpt, str(tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(WeightError, match="missing tensors.*q_proj"):
        load_checkpoint(missing, spec)
    shape = _broken_copy(tiny_ckpt, str(tmp_path / "shape"), lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(WeightError, match="shape"):
        load_checkpoint(shape, spec)
    nan = _broken_copy(tiny_ckpt, str(tmp_path / "nan"), lambda t: t[name].__setitem__((0, 0), float("nan")))
    with pytest.raises(WeightError, match="NaN"):
        load_checkpoint(nan, spec)
    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(tiny_ckpt, corrupt)
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(WeightError, match="cannot read"):
        load_checkpoint(corrupt, spec)
    other = make_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    with pytest.raises(WeightError, match="different architecture"):
        load_checkpoint(other, spec)
    with pytest.raises(WeightError, match="not found"):
        load_checkpoint(str(tmp_path / "nowhere"), spec)
    pickled = str(tmp_path / "pickled")
    shutil.copytree(tiny_ckpt, pickled)
    os.rename(os.path.join(pickled, "model.safetensors"), os.path.join(pickled, "pytorch_model.bin"))
    with pytest.raises(WeightError, match="safetensors"):
        load_checkpoint(pickled, spec)
