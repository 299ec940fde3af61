"""The trainer's CUDA paths (marked `gpu`: skipped without CUDA, see conftest.py): a bf16 train step, an nccl weight
broadcast between two processes with the trainer's default group bound to its device (the case where torch would
split the weight-update group from the trainers' communicator), and flash-attention packing against padded rows.
Each runs in a subprocess of its own, so this process never creates a CUDA context or a default group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_bf16_train_step_on_cuda(tiny_ckpt):
    """A world of one on cuda:0, mixed precision auto (bf16 compute, fp32 master weights): two steps train, the
    loss is finite, the weights move, and the published checkpoint keeps the base model's dtype."""
    out = _run(f"""
        import json, tempfile, numpy as np, torch
        from areal_async.config import TrainConfig, from_dict
        from areal_async.train.engine import TrainEngine, init_distributed
        from areal_async.types import Trajectory, pack_trajectories

        device = init_distributed("auto")
        assert device.type == "cuda" and device.index is not None
        cfg = from_dict({{"micro_batch_tokens": 64, "optim": {{"lr": 1e-3}}}}, TrainConfig)
        engine = TrainEngine({tiny_ckpt!r}, cfg, device=device)
        rng = np.random.default_rng(0)
        trajs = []
        for g in range(4):
            prompt = rng.integers(2, 90, 6).tolist()
            for _ in range(4):
                r = int(rng.integers(3, 20))
                trajs.append(Trajectory(input_ids=prompt + rng.integers(2, 90, r).tolist(),
                                        loss_mask=[0] * 6 + [1] * r, logprobs=[0.0] * 6 + [-4.0] * r,
                                        versions=[-1] * 6 + [0] * r, reward=float(rng.integers(0, 2)),
                                        group_id=g, prompt_len=6))
        w0 = {{k: v.full_tensor().float().cpu() for k, v in engine.model.state_dict().items()}}
        stats = []
        for step in range(2):
            for t in trajs:
                t.versions = [-1] * 6 + [step] * (len(t.input_ids) - 6)
            batch = pack_trajectories(trajs, step, sum(t.response_len for t in trajs), len(trajs))
            stats.append(engine.train_step(batch)[1])
        w1 = {{k: v.full_tensor().float().cpu() for k, v in engine.model.state_dict().items()}}
        moved = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
        pub = engine.publish(tempfile.mkdtemp(), engine.version)
        print(json.dumps({{"compute": str(engine.compute_dtype), "master": str(next(engine.model.parameters()).dtype),
                          "loss": [s["loss"] for s in stats], "grad_norm": [s["grad_norm"] for s in stats],
                          "moved": moved, "layout": engine.last_step_layout, "bytes": pub.num_bytes}}))
    """)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["compute"] == "torch.bfloat16" and res["master"] == "torch.float32"
    assert all(abs(x) < 1e3 for x in res["loss"]) and all(g > 0 for g in res["grad_norm"])
    assert res["moved"] > 1e-5 and res["layout"] == "prefix"
    assert res["bytes"] > 0


@pytest.mark.skipif(_cuda_count() < 2, reason="an nccl group needs two GPUs (NCCL refuses two ranks on one device)")
def test_nccl_broadcast_between_two_processes(tmp_path):
    """Trainer: default group bound to cuda:0 (as torchrun's ranks are), hosts the store on a free port, forms the
    nccl group as rank 0 and broadcasts. Receiver: a separate process that sees only GPU 1 and passes the
    index-less device "cuda" (what "auto" resolves to). Before the fix the trainer's group was split from its own
    communicator: with one trainer rank it returned at once and the receiver waited until its timeout."""
    port_file = tmp_path / "port"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time, torch
        from areal_async.train.dist import init_distributed
        from areal_async.net.custom_group import new_custom_group, open_store
        import torch.distributed as dist
        dev = init_distributed("cuda:0")
        from torch.distributed import distributed_c10d as c10d
        assert c10d._get_default_group().bound_device_id is not None
        store = open_store("127.0.0.1", 0, 2, 120.0)
        open({str(port_file)!r} + ".tmp", "w").write(str(store.port))
        import os; os.replace({str(port_file)!r} + ".tmp", {str(port_file)!r})
        pg = new_custom_group("nccl", store, world_size=2, rank=0, group_name="wug", device=dev, timeout_s=120)
        t = torch.arange(1024, dtype=torch.bfloat16, device=dev)
        dist.broadcast(t, group=pg, group_src=0)
        torch.cuda.synchronize()
        print("sent")
    """),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NCCL_CUMEM_ENABLE": "0"},
    )  # both ends as the launcher runs them (server/cli.py, worker.py)
    try:
        for _ in range(600):
            if port_file.exists() or trainer.poll() is not None:
                break
            import time

            time.sleep(0.1)
        assert port_file.exists(), trainer.communicate(timeout=30)[1][-3000:]
        port = int(port_file.read_text())
        recv = _run(
            f"""
            import torch, torch.distributed as dist
            from areal_async.server.weights import init_custom_group, receive_tensors
            pg = init_custom_group("nccl", "tcp://127.0.0.1:{port}", 2, 1, "wug", torch.device("cuda"), 120)
            got = receive_tensors(pg, ["t"], ["bfloat16"], [[1024]], torch.device("cuda"))["t"]
            assert torch.equal(got.float().cpu(), torch.arange(1024, dtype=torch.bfloat16).float()), got[:8]
            print("received")
        """,
            env={"CUDA_VISIBLE_DEVICES": "1", "NCCL_CUMEM_ENABLE": "0"},
            timeout=200,
        )
        t_out, t_err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert recv.returncode == 0 and "received" in recv.stdout, recv.stderr[-4000:]
    assert trainer.returncode == 0 and "sent" in t_out, t_err[-4000:]


def test_flash_attention_packing_matches_padded_rows(tiny_ckpt):
    """With flash attention the engine packs sequences end to end (varlen kernels from position_ids); the per-token
    logprobs must match the padded-rows layout (sdpa) of the same bf16 model."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    out = _run(f"""
        import torch, transformers
        from areal_async.train.logprobs import needs_dense_packing_mask, packed_forward_logprobs, rows_forward_logprobs
        kw = dict(dtype=torch.bfloat16)
        fa = transformers.AutoModelForCausalLM.from_pretrained({tiny_ckpt!r}, attn_implementation="flash_attention_2",
                                                               **kw).cuda()
        sd = transformers.AutoModelForCausalLM.from_pretrained({tiny_ckpt!r}, attn_implementation="sdpa", **kw).cuda()
        assert not needs_dense_packing_mask(fa) and needs_dense_packing_mask(sd)
        g = torch.Generator().manual_seed(0)
        lens = [7, 19, 3, 30]
        ids = torch.randint(2, 90, (sum(lens),), generator=g).cuda()
        with torch.no_grad():
            a, _ = packed_forward_logprobs(fa, ids, lens)
            b, _ = rows_forward_logprobs(sd, ids, lens)
        gap = float((a - b).abs().max())
        assert gap < 5e-2, gap  # bf16 kernels differ in rounding, not in what attends to what
        print("gap", gap)
    """)
    assert out.returncode == 0, out.stderr[-4000:]
