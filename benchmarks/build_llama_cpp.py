"""Build llama.cpp here, from PyPI, so the inference benchmark can compare the embedded engine with what a CPU user
would actually pick, on the same machine and workload.

    python benchmarks/build_llama_cpp.py                       # native + avx2 builds, F32/BF16/Q8_0 GGUFs of SmolLM2
    python benchmarks/build_llama_cpp.py --isa native --gguf f32 --gguf bf16

Why PyPI: this project reaches no network but the package registries, and the `llama-cpp-python` sdist vendors a
whole llama.cpp tree (with `convert_hf_to_gguf.py` and its `gguf-py`). `pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36` fetches it; only `vendor/llama.cpp` is used (llama.cpp commit 0c1e57098, per the sdist).

Two builds, cached under ~/.cache/areal_async/llama.cpp/<version>-<isa>/ and skipped when their binaries exist:
- `native`: `-DGGML_NATIVE=ON`, every instruction this CPU has (AVX-512, AVX512_BF16 on Zen 5);
- `avx2`: `GGML_NATIVE=OFF` with AVX, AVX2, FMA, F16C and BMI2 on and every AVX-512 flag off: the x86-64-v3 ISA, the
  peer of the engine run with torch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2 ...`, `AREAL_KERNEL_MARCH=x86-64-v3`).
Targets: llama-server (the end-to-end side), llama-batched-bench (decode at batch 1 and 64), llama-bench (a batch-1
cross-check), and ggml-gemm-bench (benchmarks/ggml_gemm_bench.c linked against the build's ggml: ggml's matmul rate
on the model's shapes for the roofline). test-backend-ops is not built: its perf mode runs its own shapes with half
the cores, one thread here. Static libraries, no OpenSSL and no web-UI download, so a build is self-contained and
needs no network.

GGUFs: the checkpoint (default: the project's SmolLM2-135M-Instruct) converted by the vendored converter to F32, BF16
and Q8_0, under ~/.cache/areal_async/llama.cpp/gguf/. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST = "llama-cpp-python"
VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench")
GEMM_BENCH = "ggml-gemm-bench"  # benchmarks/ggml_gemm_bench.c, linked against the build's static ggml
HERE = Path(__file__).resolve().parent
ISA_FLAGS: dict[str, list[str]] = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2")),
        *(f"-DGGML_{f}=OFF" for f in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_TILE")),
    ],
}
GGUF_TYPES = ("f32", "bf16", "q8_0")


def cache_root() -> Path:
    """~/.cache/areal_async/llama.cpp (AREAL_LLAMA_CPP_CACHE overrides): outside the clone, so a rebuild or a fresh
    checkout reuses the 10-minute builds."""
    env = os.environ.get("AREAL_LLAMA_CPP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areal_async" / "llama.cpp"


def build_dir(isa: str, version: str = VERSION) -> Path:
    """Where the `isa` build of `version` lives (its binaries in bin/)."""
    return cache_root() / f"{version}-{isa}"


def build_ready(isa: str, version: str = VERSION) -> bool:
    """Every target of the `isa` build is there."""
    return all((build_dir(isa, version) / "bin" / t).is_file() for t in (*TARGETS, GEMM_BENCH))


def fetch_sources(version: str = VERSION) -> Path:
    """The vendored llama.cpp tree of the `llama-cpp-python` sdist, downloaded once through pip and kept under the
    cache (only `vendor/llama.cpp` is extracted)."""
    src = cache_root() / f"src-{version}"
    tree = src / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    with tempfile.TemporaryDirectory(prefix="llama_sdist_") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", tmp,
             f"{SDIST}=={version}"],
            check=True,
        )  # fmt: skip
        (archive,) = Path(tmp).glob("*.tar.gz")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        staging = Path(tmp) / "x"
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            tf.extractall(staging, members=members, filter="data")
        src.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / prefix), str(tree))
    return tree


def cmake_args(isa: str) -> list[str]:
    """The configure flags of one build: Release, static, only the CPU backend, no network features."""
    return [
        "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_EXAMPLES=ON",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
        *ISA_FLAGS[isa],
    ]  # fmt: skip


def compile_gemm_bench(tree: Path, work: Path, exe: Path, isa: str) -> None:
    """Link benchmarks/ggml_gemm_bench.c against the static ggml of `work`, with the same ISA flags as the build
    (only the kernels inside ggml-cpu matter; the bench's own code is setup)."""
    libs = [work / "ggml" / "src" / n for n in ("libggml.a", "libggml-cpu.a", "libggml-base.a")]
    march = "-march=native" if isa == "native" else "-march=x86-64-v3"
    subprocess.run(
        ["gcc", "-O2", march, "-I", str(tree / "ggml" / "include"), str(HERE / "ggml_gemm_bench.c"), *map(str, libs),
         "-o", str(exe), "-fopenmp", "-lstdc++", "-lpthread", "-lm"],
        check=True,
    )  # fmt: skip


def build(isa: str, jobs: int, version: str = VERSION) -> Path:
    """Configure and build the `isa` flavour of llama.cpp, copy the targets to <build>/bin and record how it was made
    (build.json). Skipped when the targets are already there."""
    out = build_dir(isa, version)
    if build_ready(isa, version):
        return out
    tree = fetch_sources(version)
    work = out / "cmake"
    t0 = time.time()
    subprocess.run(["cmake", "-S", str(tree), "-B", str(work), *cmake_args(isa)], check=True)
    subprocess.run(["cmake", "--build", str(work), "-j", str(jobs), "--target", *TARGETS], check=True)
    (out / "bin").mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        shutil.copy2(work / "bin" / t, out / "bin" / t)
    compile_gemm_bench(tree, work, out / "bin" / GEMM_BENCH, isa)
    info = {
        "sdist": f"{SDIST}=={version}",
        "llama_cpp_commit": "0c1e57098",
        "isa": isa,
        "cmake_args": cmake_args(isa),
        "compiler": subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        "machine": platform.machine(),
        "build_s": round(time.time() - t0, 1),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(work, ignore_errors=True)  # object files: ~1 GB, not needed once the static binaries are copied
    return out


def default_model() -> str:
    """The project's SmolLM2-135M-Instruct checkpoint (as the tests and the benchmark resolve it)."""
    from areal_async.testing.real_model import smollm2_path

    return str(smollm2_path())


def gguf_path(model_dir: str, outtype: str) -> Path:
    """Where the `outtype` GGUF of `model_dir` is cached: named by the checkpoint directory and its weights' size and
    mtime, so a changed checkpoint is converted again."""
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    key = "|".join(f"{w.name}:{w.stat().st_size}:{int(w.stat().st_mtime)}" for w in weights)
    tag = hashlib.sha256(f"{os.path.abspath(model_dir)}|{key}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{Path(model_dir).name}-{tag}-{outtype}.gguf"


def converter_deps() -> Path:
    """A directory with `sentencepiece`, which the converter imports for every Llama-family model even when the
    checkpoint has only a tokenizer.json. Installed with `pip install --target` into the cache, so the project's
    venv is left as it is."""
    deps = cache_root() / "converter-deps"
    if not (deps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps), "sentencepiece"],
                       check=True)  # fmt: skip
    return deps


def convert(model_dir: str, outtype: str, version: str = VERSION) -> Path:
    """`model_dir` as a GGUF of `outtype` (f32, bf16, q8_0) through the vendored convert_hf_to_gguf.py and its
    gguf-py (on PYTHONPATH, nothing installed in the venv). Skipped when cached."""
    out = gguf_path(model_dir, outtype)
    if out.is_file():
        return out
    tree = fetch_sources(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    path = [str(tree / "gguf-py"), str(converter_deps()), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), model_dir, "--outtype", outtype, "--outfile", str(tmp)],
        check=True,
        env=env,
    )
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", action="append", choices=sorted(ISA_FLAGS), help="builds to make (default: all)")
    ap.add_argument("--gguf", action="append", choices=GGUF_TYPES, help="GGUF types to convert (default: all)")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the project's SmolLM2)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-build", action="store_true", help="only convert")
    args = ap.parse_args()
    if not args.no_build:
        for isa in args.isa or sorted(ISA_FLAGS):
            print(f"{isa}: {build(isa, args.jobs)}", flush=True)
    model = args.model or default_model()
    for t in args.gguf or GGUF_TYPES:
        print(f"{t}: {convert(model, t)}", flush=True)


if __name__ == "__main__":
    main()
