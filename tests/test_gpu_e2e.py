"""The inference side and a whole run on CUDA (marked `gpu`: skipped without CUDA, see conftest.py), next to the
trainer's CUDA tests in tests/test_gpu_train.py.

- The embedded server on CUDA (`python -m areal_async.serve --device auto`, a process of its own): "auto" names the
  GPU with its index, the weights are bf16, prompt logprobs through the padded SDPA path (prefill, a mask, grouped
  query heads) agree with transformers in fp32 to bf16 accuracy, and concurrent greedy requests (decode rows of
  different lengths in one batch) are deterministic and agree with one request at a time.
- `python -m areal_async.run` with the code defaults (device auto) for a few steps, with disk and with broadcast
  weight sync: servers and trainers on CUDA, the GPU placement of launch/placement.py, and for the broadcast the
  backend the GPUs allow (nccl with a GPU each, gloo on a single GPU the server and the trainer share).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def cuda_server(tiny_ckpt, tmp_path):
    """An embedded server on CUDA in its own process; yields its URL."""
    from areal_async.server.cli import READY_PREFIX

    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.serve",
            "--model",
            tiny_ckpt,
            "--port",
            "0",
            "--device",
            "auto",
            "--max-total-tokens",
            "16384",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    log.close()
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), (line, log_path.read_text()[-3000:])
        yield line[len(READY_PREFIX) :].strip()
    finally:
        proc.terminate()
        proc.wait(60)


async def test_embedded_engine_on_cuda_matches_transformers(cuda_server, tiny_ckpt):
    import asyncio

    import aiohttp
    import torch
    import transformers

    async with aiohttp.ClientSession() as http:
        async with http.get(cuda_server + "/get_server_info") as r:
            info = await r.json()
        assert re.fullmatch(r"cuda:\d+", info["device"]) and info["dtype"] == "bfloat16", info
        assert info["gpu_uuid"] and info["tp_size"] == 1

        prompts = [[5 + i % 40 for i in range(n)] for n in (7, 33, 90, 150)]

        async def score(ids):  # prompt logprobs: a prefill through the padded SDPA path
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            async with http.post(cuda_server + "/generate", json=body) as r:
                return [t[0] for t in (await r.json())["meta_info"]["input_token_logprobs"]][1:]

        async def greedy(ids):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
            async with http.post(cuda_server + "/generate", json=body) as r:
                return (await r.json())["output_ids"]

        got = await asyncio.gather(*(score(p) for p in prompts))
        together = await asyncio.gather(*(greedy(p) for p in prompts))
        alone = [await greedy(p) for p in prompts]

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for ids, lps in zip(prompts, got):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        gap = float((torch.tensor(lps) - ref).abs().max())
        assert gap < 0.1, (len(ids), gap)  # bf16 weights and activations against fp32
    assert all(len(t) == 24 for t in together)
    # batched decode rows of different lengths give what each request gives alone (greedy, same kernels up to
    # batch composition). The random tiny model's logits are near-uniform, and cuBLAS/SDPA kernels differ by batch
    # shape, so an early divergence is allowed only where the two best next tokens are a near-tie under the fp32
    # model (bf16 rounding of the logits is ~1e-2, so a gap below TIE can flip the argmax)
    TIE = 0.05
    for ids, a, b in zip(prompts, together, alone):
        k = next((i for i in range(4) if a[i] != b[i]), None)
        if k is None:
            continue
        with torch.no_grad():
            last = model(torch.tensor([ids + b[:k]])).logits[0, -1].float()
        top2 = torch.log_softmax(last, -1).topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, (len(ids), k, gap, a[:4], b[:4])  # a real divergence, not a near-tie


def _run(tiny_ckpt: str, run_dir: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    args = [
        f"model.path={tiny_ckpt}",
        f"run_dir={run_dir}",
        "mode=async",
        "eta=1",
        "total_steps=4",
        "schedule.batch_size=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=64",
        "eval.num_prompts=8",
        "eval.max_new_tokens=16",
        "schedule.eval_every=0",
        "data.num_train=200",
        "data.num_eval=8",
        "server.max_total_tokens=16384",
        *extra,
    ]
    p = subprocess.run([sys.executable, "-m", "areal_async.run", *args], capture_output=True, text=True, timeout=360)
    summary = {}
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    log = ""
    if os.path.exists(os.path.join(run_dir, "run.log")):
        with open(os.path.join(run_dir, "run.log")) as f:
            log = f.read()
    return p, summary, log


@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_run_on_cuda(tiny_ckpt, tmp_path, sync):
    run_dir = str(tmp_path / sync)
    p, summary, log = _run(tiny_ckpt, run_dir, f"train.weight_sync={sync}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert summary["steps"] == 4 and summary["trained_samples"] == 4 * 4 * 4
    assert summary["max_staleness_seen"] <= 1
    with open(os.path.join(run_dir, "logs", "trainer.log")) as f:
        trainer_log = f.read()
    assert re.search(r"device cuda:\d", trainer_log), trainer_log[-2000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert all(abs(r["train/loss"]) < 1e3 and r["train/grad_norm"] > 0 for r in train)  # finite (bf16 compute)
    if sync == "broadcast":
        backend = "nccl" if _gpus() >= 2 else "gloo"  # one GPU: the server shares the trainer's
        assert re.search(rf"weight-update group areal-[0-9a-f]+-1 \({backend}\)", log), log[-3000:]
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
