"""mixed_precision=auto follows the CPU: bf16 only where the hardware has a bf16 dot product that torch may use."""

from __future__ import annotations

from areal_async.host.cpu_features import (
    CpuInfo,
    cpu_bf16_choice,
    model_hidden_size,
    read_cpu_info,
    resolve_mixed_precision,
)

AMX = CpuInfo("Intel Xeon", "x86_64", frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
ZEN5 = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
AVX2 = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx2", "fma"}))
ARM = CpuInfo("Neoverse", "aarch64", frozenset({"asimd", "bf16"}))


def test_bf16_only_with_a_bf16_dot_product():
    assert cpu_bf16_choice(AMX, {})[0] and cpu_bf16_choice(ZEN5, {})[0]
    fast, why = cpu_bf16_choice(AVX2, {})
    assert not fast and "emulated" in why
    assert not cpu_bf16_choice(ARM, {})[0]
    assert AMX.isa == "amx" and ZEN5.isa == "avx512" and AVX2.isa == "avx2"


def test_a_cap_on_torch_wins_over_the_hardware():
    for env in (
        {"ONEDNN_MAX_CPU_ISA": "AVX2"},
        {"ONEDNN_MAX_CPU_ISA": "avx512_core"},
        {"DNNL_MAX_CPU_ISA": "AVX2"},
        {"ATEN_CPU_CAPABILITY": "avx2"},
    ):
        fast, why = cpu_bf16_choice(ZEN5, env)
        assert not fast and next(iter(env)) in why, (env, why)
    # a cap at or above the hardware's bf16 level leaves bf16 on
    assert cpu_bf16_choice(ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})[0]
    assert cpu_bf16_choice(AMX, {"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"})[0]
    # the rule keys on the strongest bf16 unit: an AMX CPU capped below AMX falls back to fp32 (conservative)
    assert not cpu_bf16_choice(AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})[0]


def test_resolve_mixed_precision():
    assert resolve_mixed_precision("fp32", "cuda") == ("fp32", "set in the config")
    assert resolve_mixed_precision("auto", "cuda")[0] == "bf16"
    assert resolve_mixed_precision("auto", "cpu", 576, AVX2, {})[0] == "fp32"
    assert resolve_mixed_precision("auto", "cpu", 576, ZEN5, {})[0] == "bf16"
    assert resolve_mixed_precision("auto", "cpu", None, ZEN5, {})[0] == "bf16"
    mp, why = resolve_mixed_precision("auto", "cpu", 128, ZEN5, {})  # the tiny default model: not GEMM-bound
    assert mp == "fp32" and "hidden size 128" in why
    assert resolve_mixed_precision("bf16", "cpu", 128, AVX2, {})[0] == "bf16"  # an explicit choice is kept


def test_hidden_size_from_the_checkpoint(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))
    assert model_hidden_size(str(tmp_path)) == 576
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 2048}}))
    assert model_hidden_size(str(tmp_path)) == 2048
    assert model_hidden_size(str(tmp_path / "nowhere")) is None


def test_reads_this_machine(tmp_path):
    info = read_cpu_info()
    assert info.arch and isinstance(info.flags, frozenset)
    fake = tmp_path / "cpuinfo"
    fake.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\n"
        "flags\t\t: fpu avx2 fma avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    got = read_cpu_info(str(fake))
    assert got.model == "AMD EPYC 9B45" and "avx512_bf16" in got.flags and got.isa == "avx512"
    assert read_cpu_info(str(tmp_path / "missing")).flags == frozenset()
