"""The continuous-batching engine, driven directly (no HTTP): outputs against transformers, stop rules, pause
modes, aborts, weight updates (disk and broadcast), the KV budget and input validation."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from error_bounds import U32, checkpoint_logit_bound, logsumexp_bound

from areal_async.protocol.engine_api import EngineChunk, EngineRequest, EngineSampling
from areal_async.server.engine import AsyncEngine
from areal_async.testing.tiny import make_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lively_ckpt(tmp_path_factory) -> str:
    """A tiny qwen2 with large random weights: greedy outputs vary from token to token, so comparisons bite."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lively") / "qwen2"), "qwen2", seed=5, init_std=0.3)


@pytest.fixture
async def make_engine():
    engines: list[AsyncEngine] = []

    async def make(path: str, **kw) -> AsyncEngine:
        engine = AsyncEngine(path, device="cpu", **kw)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.shutdown()


@functools.lru_cache(maxsize=4)
def _hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path: str, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[T, V]: row t is the log-distribution of token t + 1."""
    with torch.no_grad():
        logits = _hf(path)(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def req(rid: str, ids: list[int], **sampling) -> EngineRequest:
    extra = {k: sampling.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num") if k in sampling}
    return EngineRequest(rid=rid, input_ids=ids, sampling=EngineSampling(**sampling), **extra)


async def run(engine: AsyncEngine, r: EngineRequest) -> tuple[list[int], list[float], dict, list[EngineChunk]]:
    ids, lps, chunks = [], [], []
    async for c in engine.generate(r):
        ids += c.new_ids
        lps += c.new_logprobs
        chunks.append(c)
    return ids, lps, chunks[-1].finish_reason, chunks


def lp_gap_ok(ckpt: str, got: list[float], want: list[float], context: int) -> bool:
    """The engine's logprobs against transformers' (or against its own in another batch): two fp32 forwards that
    sum in different orders, within error_bounds.decoder_logit_bound at these logprobs' magnitude."""
    tol = checkpoint_logit_bound(ckpt, context, max(abs(w) for w in want))
    return max(abs(a - b) for a, b in zip(got, want)) <= tol


PROMPTS = ["hello 1 world", "2+3=", "abc", "The quick brown fox", "x" * 40, "(1+2)*3 = ?"]


async def test_greedy_matches_transformers_generate(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    for text in PROMPTS[:3]:
        ids = engine.encode(text)
        out, lps, finish, _ = await run(
            engine, req(text, ids, max_new_tokens=24, temperature=0.0, ignore_eos=True, return_logprob=True)
        )
        ref = (
            _hf(lively_ckpt)
            .generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(ids) :
            ]
            .tolist()
        )
        assert out == ref
        assert finish == {"type": "length", "length": 24}
        # greedy logprobs are log_softmax of the raw logits at the chosen token
        full = hf_logprobs(lively_ckpt, ids + out)
        want = [full[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]
        assert lp_gap_ok(lively_ckpt, lps, want, len(ids) + len(out))


async def test_batched_equals_one_at_a_time_and_is_deterministic(make_engine, lively_ckpt):
    # A small prefill chunk sends long prompts through several chunks while other requests decode; 20 requests with
    # prompts of 2 to 160 tokens make the decode rows split into several length buckets.
    engine = await make_engine(lively_ckpt, chunked_prefill_size=48)
    prompts = [engine.encode(t) for t in PROMPTS] + [engine.encode(f"{i}: " + "ab" * (i * i // 2)) for i in range(14)]
    alone = [
        (await run(engine, req(f"a{i}", p, max_new_tokens=40 + i, temperature=0.0, ignore_eos=True)))[0]
        for i, p in enumerate(prompts)
    ]
    together = await asyncio.gather(
        *[
            run(engine, req(f"b{i}", p, max_new_tokens=40 + i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
    )
    assert [t[0] for t in together] == alone
    assert len({tuple(a) for a in alone}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampled_logprobs_are_tempered_log_softmax(make_engine, lively_ckpt, temperature):
    engine = await make_engine(lively_ckpt, seed=1)
    ids = engine.encode("2+3=")
    outs = await asyncio.gather(
        *[
            run(
                engine,
                req(f"s{i}", ids, max_new_tokens=16, temperature=temperature, ignore_eos=True, return_logprob=True),
            )
            for i in range(3)
        ]
    )
    for out, lps, _, _ in outs:
        full = hf_logprobs(lively_ckpt, ids + out, temperature)
        want = [full[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]
        assert lp_gap_ok(lively_ckpt, lps, want, len(ids) + len(out))
    assert len({tuple(o[0]) for o in outs}) > 1  # actually sampled


async def test_seeded_requests_repeat_and_top_k_restricts(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("abc")
    a = await run(engine, req("a", ids, max_new_tokens=20, seed=7, ignore_eos=True))
    # the same seed gives the same sample even when another request shares the batch
    b, _ = await asyncio.gather(
        run(engine, req("b", ids, max_new_tokens=20, seed=7, ignore_eos=True)),
        run(engine, req("c", ids, max_new_tokens=20, ignore_eos=True)),
    )
    assert a[0] == b[0]
    # top_k=1 is greedy
    greedy = await run(engine, req("g", ids, max_new_tokens=20, temperature=0.0, ignore_eos=True))
    topk1 = await run(engine, req("k", ids, max_new_tokens=20, top_k=1, ignore_eos=True))
    assert topk1[0] == greedy[0]
    tiny_p = await run(engine, req("p", ids, max_new_tokens=20, top_p=1e-4, ignore_eos=True))
    assert tiny_p[0] == greedy[0]


async def test_input_logprobs_with_chunked_prefill(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt, chunked_prefill_size=5)
    ids = engine.encode("The quick brown fox jumps")
    full = hf_logprobs(lively_ckpt, ids)
    for start in (0, 3):
        out, _, finish, chunks = await run(engine, req(f"in{start}", ids, max_new_tokens=0, logprob_start_len=start))
        assert out == [] and finish == {"type": "length", "length": 0}
        got = chunks[0].input_logprobs
        assert len(got) == len(ids) - start
        if start == 0:
            assert got[0] is None
        want = {p: full[p - 1, ids[p]].item() for p in range(max(start, 1), len(ids))}
        assert lp_gap_ok(lively_ckpt, [got[p - start] for p in want], list(want.values()), len(ids))


async def test_stop_rules(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("hello 1 world")
    free, _, _, _ = await run(engine, req("free", ids, max_new_tokens=30, temperature=0.0, ignore_eos=True))
    text = engine.decode(free)
    # stop token id: ends at the first occurrence, token included (ignore_eos only concerns eos)
    tok = free[5]
    out, _, finish, _ = await run(
        engine, req("tid", ids, max_new_tokens=30, temperature=0.0, stop_token_ids=[tok], ignore_eos=True)
    )
    assert out == free[: free.index(tok) + 1] and finish == {"type": "stop", "matched": tok}
    # min_new_tokens bans stop tokens until reached
    out, _, finish, _ = await run(
        engine,
        req(
            "min",
            ids,
            max_new_tokens=30,
            temperature=0.0,
            stop_token_ids=[tok],
            min_new_tokens=free.index(tok) + 2,
            ignore_eos=True,
        ),
    )
    assert len(out) >= free.index(tok) + 2 and (finish["type"] == "length" or out[-1] == tok)
    # stop string: ends as soon as the decoded output contains it; ids keep the stop tokens
    stop = text[7:9]
    out, _, finish, _ = await run(
        engine, req("str", ids, max_new_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True)
    )
    assert finish == {"type": "stop", "matched": stop}
    assert stop in engine.decode(out) and stop not in engine.decode(out[:-1])
    # eos stops unless ignore_eos; max_new_tokens caps the length
    eos = engine.eos_token_ids
    assert eos == [1]
    lengths = await run(engine, req("len", ids, max_new_tokens=3, temperature=0.0, ignore_eos=True))
    assert lengths[0] == free[:3] and lengths[2] == {"type": "length", "length": 3}


async def test_eos_ends_generation_unless_ignored(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt, seed=3)
    ids = engine.encode("x")
    # Ban nothing, sample many short completions at high temperature: some hit eos (id 1) and stop on it.
    outs = await asyncio.gather(
        *[run(engine, req(f"e{i}", ids, max_new_tokens=60, temperature=3.0)) for i in range(12)]
    )
    stopped = [o for o in outs if o[2]["type"] == "stop"]
    assert stopped, "expected at least one eos at temperature 3"
    for out, _, finish, _ in stopped:
        assert finish == {"type": "stop", "matched": 1} and out[-1] == 1 and 1 not in out[:-1]
    ignored = await asyncio.gather(
        *[run(engine, req(f"i{i}", ids, max_new_tokens=60, temperature=3.0, ignore_eos=True)) for i in range(6)]
    )
    assert all(o[2]["type"] == "length" and len(o[0]) == 60 for o in ignored)


async def _first_chunk(gen) -> EngineChunk:
    return await gen.__anext__()


async def _rest(gen, first: EngineChunk) -> tuple[list[int], dict]:
    ids = list(first.new_ids)
    finish = first.finish_reason
    async for c in gen:
        ids += c.new_ids
        finish = c.finish_reason
    return ids, finish


async def test_abort_by_rid_prefix(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("abc")
    gens = {
        rid: engine.generate(req(rid, ids, max_new_tokens=900, temperature=0.0, ignore_eos=True, return_logprob=True))
        for rid in ("grp-a-0", "grp-a-1", "grp-b-0")
    }
    firsts = {rid: await _first_chunk(g) for rid, g in gens.items()}
    assert await engine.abort("grp-a") == 2
    results = {rid: await _rest(g, firsts[rid]) for rid, g in gens.items()}
    for rid in ("grp-a-0", "grp-a-1"):
        ids_, finish = results[rid]
        assert finish["type"] == "abort" and 0 < len(ids_) < 900
    assert results["grp-b-0"][1] == {"type": "length", "length": 900}
    assert await engine.abort("nobody") == 0


async def test_pause_abort_returns_partial_and_holds_new_requests(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("abc")
    gen = engine.generate(req("long", ids, max_new_tokens=900, temperature=0.0, ignore_eos=True, return_logprob=True))
    first = await _first_chunk(gen)
    await engine.pause("abort")
    assert engine.paused and engine.num_running() == 0
    chunks = [first] + [c async for c in gen]
    out = [t for c in chunks for t in c.new_ids]
    assert chunks[-1].finish_reason["type"] == "abort" and "message" in chunks[-1].finish_reason
    assert 0 < len(out) < 900 and len(out) == sum(len(c.new_logprobs) for c in chunks)
    # a request sent while paused waits, then runs after resume
    task = asyncio.create_task(run(engine, req("later", ids, max_new_tokens=5, temperature=0.0, ignore_eos=True)))
    await asyncio.sleep(0.3)
    assert not task.done() and engine.num_waiting() == 1
    await engine.resume()
    later, _, finish, _ = await asyncio.wait_for(task, 30)
    assert finish["type"] == "length" and later[: len(out)] == out[:5]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_and_resume_continue_the_same_output(make_engine, lively_ckpt, mode):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("(1+2)*3 = ?")
    reference, _, _, _ = await run(engine, req("ref", ids, max_new_tokens=600, temperature=0.0, ignore_eos=True))
    gen = engine.generate(req("p", ids, max_new_tokens=600, temperature=0.0, ignore_eos=True))
    got = list((await _first_chunk(gen)).new_ids)
    await engine.pause(mode)
    assert (engine.num_running(), engine.num_waiting()) == ((1, 0) if mode == "in_place" else (0, 1))
    # what was made before the pause arrives; then nothing while paused
    nxt = asyncio.create_task(gen.__anext__())
    while (await asyncio.wait({nxt}, timeout=0.3))[0]:
        got += nxt.result().new_ids
        nxt = asyncio.create_task(gen.__anext__())
    assert len(got) < 600
    await engine.resume()
    out, finish = await _rest(gen, await nxt)
    assert got + out == reference and finish == {"type": "length", "length": 600}


async def test_weight_update_from_disk_swaps_or_keeps_old(make_engine, tiny_ckpt, tiny_ckpt_b, tmp_path):
    engine = await make_engine(tiny_ckpt, weight_version="0")
    ids = engine.encode("2+3=")
    probe = req("x", ids, max_new_tokens=0, logprob_start_len=0)

    async def input_lps() -> list[float]:
        _, _, _, chunks = await run(engine, probe)
        return chunks[0].input_logprobs[1:]

    def hf(path: str) -> list[float]:
        full = hf_logprobs(path, ids)
        return [full[p - 1, ids[p]].item() for p in range(1, len(ids))]

    def close(a, b) -> bool:
        return lp_gap_ok(tiny_ckpt, a, b, len(ids))  # both checkpoints have the same shapes

    assert close(await input_lps(), hf(tiny_ckpt))
    # bad checkpoints: nothing changes
    from safetensors.torch import load_file, save_file

    bad = []
    for kind in ("missing", "shape", "corrupt"):
        dst = str(tmp_path / kind)
        shutil.copytree(tiny_ckpt_b, dst)
        f = os.path.join(dst, "model.safetensors")
        if kind == "corrupt":
            with open(f, "r+b") as fh:
                fh.truncate(500)
        else:
            t = load_file(f)
            if kind == "missing":
                t.pop("model.norm.weight")
            else:
                t["model.norm.weight"] = t["model.norm.weight"][:3].clone()
            save_file(t, f)
        bad.append(dst)
    bad.append(make_tiny_checkpoint(str(tmp_path / "llama"), "llama"))
    for path in bad:
        ok, msg, n = await engine.update_weights_from_disk(path, "bad")
        assert not ok and n == 0 and path in msg
        assert engine.weight_version == "0" and engine.model_path == tiny_ckpt
    assert close(await input_lps(), hf(tiny_ckpt))
    # a good one swaps; the version and path follow; chunks carry the new version
    ok, msg, _ = await engine.update_weights_from_disk(tiny_ckpt_b, "7")
    assert ok, msg
    assert engine.weight_version == "7" and engine.model_path == tiny_ckpt_b
    assert close(await input_lps(), hf(tiny_ckpt_b))
    _, _, _, chunks = await run(engine, req("v", ids, max_new_tokens=3, ignore_eos=True))
    assert {c.weight_version for c in chunks} == {"7"}
    ok, _, _ = await engine.update_weights_from_disk(tiny_ckpt, None)
    assert ok and engine.weight_version == "8"


async def test_weight_update_waits_for_running_or_aborts_them(make_engine, tiny_ckpt, tiny_ckpt_b):
    engine = await make_engine(tiny_ckpt, weight_version="0")
    ids = engine.encode("abc")
    # not paused: the update waits for the in-flight request, which finishes entirely on the old weights
    task = asyncio.create_task(run(engine, req("w", ids, max_new_tokens=400, ignore_eos=True)))
    await asyncio.sleep(0.05)
    ok, _, _ = await engine.update_weights_from_disk(tiny_ckpt_b, "1")
    assert ok and task.done()
    _, _, finish, chunks = task.result()
    assert finish["type"] == "length" and {c.weight_version for c in chunks} == {"0"}
    # abort_all_requests: in-flight requests end with abort at once
    gen = engine.generate(req("w2", ids, max_new_tokens=900, ignore_eos=True))
    first = await _first_chunk(gen)
    ok, _, _ = await engine.update_weights_from_disk(tiny_ckpt, "2", abort_all_requests=True)
    assert ok
    out, finish = await _rest(gen, first)
    assert finish["type"] == "abort" and len(out) < 900


async def test_unstreamed_requests_come_back_whole_and_split_only_at_a_version_change(
    make_engine, tiny_ckpt, tiny_ckpt_b
):
    """stream=False: the request is handed to the loop when it ends, not after every step (each hand-over wakes
    the loop, whose thread then takes a core from the step), so it comes back as one chunk holding exactly the
    tokens of a streamed twin that got many. Paused in place across a weight swap, its tokens still come back
    split exactly where the version changed."""
    engine = await make_engine(tiny_ckpt, weight_version="0")
    ids = engine.encode("abc")
    sampling = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    streamed = req("s", ids, **sampling)
    whole = EngineRequest(rid="w", input_ids=ids, sampling=EngineSampling(**sampling), stream=False)
    (s_ids, _, _, s_chunks), (w_ids, _, w_finish, w_chunks) = await asyncio.gather(
        run(engine, streamed), run(engine, whole)
    )
    assert len(s_chunks) > 1 and len(w_chunks) == 1
    assert w_ids == s_ids and w_finish == {"type": "length", "length": 300}

    long_ = EngineRequest(
        rid="v", input_ids=ids, sampling=EngineSampling(max_new_tokens=1000, ignore_eos=True), stream=False
    )
    task = asyncio.create_task(run(engine, long_))
    while engine.num_running() == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # some tokens under version 0
    await engine.pause("in_place")
    ok, msg, _ = await engine.update_weights_from_disk(tiny_ckpt_b, "1", flush_cache=False)
    assert ok, msg
    await engine.resume()
    out, _, finish, chunks = await task
    assert finish == {"type": "length", "length": 1000} and len(out) == 1000
    assert [c.weight_version for c in chunks] == ["0", "1"] and all(c.new_ids for c in chunks)


async def test_kv_budget_queues_requests_and_all_complete(make_engine, lively_ckpt):
    # 128 tokens of KV: each request reserves 64 (prompt + max_new_tokens rounded to pages), so two run at once.
    engine = await make_engine(lively_ckpt, max_total_tokens=128)
    prompts = [engine.encode(t)[:10] for t in PROMPTS]
    alone = (await run(engine, req("solo", prompts[0], max_new_tokens=40, temperature=0.0, ignore_eos=True)))[0]
    tasks = [
        asyncio.create_task(run(engine, req(f"q{i}", p, max_new_tokens=40, temperature=0.0, ignore_eos=True)))
        for i, p in enumerate(prompts)
    ]
    seen_waiting = 0
    while not all(t.done() for t in tasks):
        seen_waiting = max(seen_waiting, engine.num_waiting())
        assert engine.num_running() <= 2
        await asyncio.sleep(0.002)
    results = [t.result() for t in tasks]
    assert all(r[2] == {"type": "length", "length": 40} for r in results)
    assert results[0][0] == alone
    assert seen_waiting > 0
    with pytest.raises(ValueError, match="never fit"):
        engine.generate(req("huge", prompts[0], max_new_tokens=200))


async def test_bad_requests_raise_value_error(make_engine, tiny_ckpt):
    engine = await make_engine(tiny_ckpt)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(req("e", [], max_new_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(req("v", [3, engine.vocab_size], max_new_tokens=4))
    with pytest.raises(ValueError, match="context length"):
        engine.generate(req("c", [3] * 10, max_new_tokens=engine.context_len))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(req("p", [3], top_p=0.0))
    gen = engine.generate(req("dup", [3, 4], max_new_tokens=500, ignore_eos=True))
    await _first_chunk(gen)
    with pytest.raises(ValueError, match="already in flight"):
        async for _ in engine.generate(req("dup", [3, 4], max_new_tokens=4)):
            pass
    await engine.abort("dup")
    await gen.aclose()
    # the engine still serves after all that
    out, _, finish, _ = await run(engine, req("ok", [3, 4], max_new_tokens=4, ignore_eos=True))
    assert len(out) == 4 and finish["type"] == "length"


async def test_tokenizer_access(make_engine, tiny_ckpt):
    engine = await make_engine(tiny_ckpt)
    ids = engine.encode("1+1=2")
    assert engine.decode(ids) == "1+1=2" and len(ids) == 5
    chat = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert engine.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.context_len == 1024 and engine.vocab_size == 100
    args = engine.server_args()
    assert args["model_path"] == tiny_ckpt and args["max_total_tokens"] == 65536


# The trainer side of SGLang's broadcast weight sync, as a trainer written for SGLang does it.
SENDER = textwrap.dedent("""
    import os
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from safetensors.torch import load_file
    path = sys.argv[1]
    timeout = timedelta(seconds=60)
    # the store binds a free port itself and says which (no port picked by the test and bound here later)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    print("port", store.port, flush=True)
    store = dist.PrefixStore("wsync", store)
    pg, _ = c10d._new_process_group_helper(2, 0, [], "gloo", store, group_name="wsync", timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    tensors = load_file(path + "/model.safetensors")
    for name in sorted(tensors):
        dist.broadcast(tensors[name].contiguous(), src=0, group=pg)
    print("sent", len(tensors), flush=True)
    # Skip interpreter teardown: destroying this process's TCPStore server while the engine still holds a
    # connection to it aborts the process ("terminate called without an active exception").
    os._exit(0)
""")


async def test_weights_from_distributed_broadcast(make_engine, tiny_ckpt, tiny_ckpt_b):
    from safetensors import safe_open

    engine = await make_engine(tiny_ckpt, weight_version="0")
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, tiny_ckpt_b], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.to_thread(sender.stdout.readline)
        assert line.startswith("port "), (line, sender.stderr.read() if sender.poll() is not None else "")
        port = int(line.split()[1])
        ok, msg = await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "wsync", "gloo")
        assert ok, msg
        with safe_open(os.path.join(tiny_ckpt_b, "model.safetensors"), "pt") as f:
            names = sorted(f.keys())
            shapes = [list(f.get_slice(n).get_shape()) for n in names]
        ok, msg = await engine.update_weights_from_distributed(names, ["float32"] * len(names), shapes, "wsync", "9")
        assert ok, msg
        out, err = await asyncio.to_thread(sender.communicate, timeout=60)
        assert sender.returncode == 0, err
    finally:
        if sender.poll() is None:
            sender.kill()
    assert engine.weight_version == "9"
    ids = engine.encode("2+3=")
    _, _, _, chunks = await run(engine, req("x", ids, max_new_tokens=0, logprob_start_len=1))
    full = hf_logprobs(tiny_ckpt_b, ids)
    want = [full[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lp_gap_ok(tiny_ckpt_b, chunks[0].input_logprobs, want, len(ids))
    ok, msg = await engine.update_weights_from_distributed(["x"], ["float32"], [[1]], "nope", None)
    assert not ok and "nope" in msg


async def test_penalties_and_top_logprobs(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt)
    ids = engine.encode("abc")
    out, lps, _, chunks = await run(
        engine,
        req(
            "pen",
            ids,
            max_new_tokens=12,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            return_logprob=True,
            top_logprobs_num=3,
        ),
    )
    # replay with transformers: greedy over logits minus the penalties of the tokens generated so far
    seq, want, spread = list(ids), [], 0.0
    for _ in range(12):
        with torch.no_grad():
            logits = _hf(lively_ckpt)(torch.tensor([seq])).logits[0, -1].float()
        spread = max(spread, float(logits.max() - logits.min()) + 1.5 + 0.5 * 12)  # penalties widen it
        gen = seq[len(ids) :]
        for t in set(gen):
            logits[t] -= 1.5 + 0.5 * gen.count(t)
        want.append(int(logits.argmax()))
        seq.append(want[-1])
    assert out == want
    plain = (await run(engine, req("plain", ids, max_new_tokens=12, temperature=0.0, ignore_eos=True)))[0]
    assert plain != out
    tops = [t for c in chunks for t in c.new_top_logprobs]
    assert len(tops) == len(out)
    for tok, lp, top in zip(out, lps, tops):
        # the chosen logprob (greedy: logit - logsumexp) and the top list's (a log-softmax) over the same logits:
        # two logsumexps over the vocabulary apart at most
        assert len(top) == 3 and top[0][1] == tok
        assert abs(top[0][0] - lp) <= 2 * logsumexp_bound(logits.numel(), spread, abs(lp) + spread)
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_truncation_keeps_only_allowed_tokens():
    from areal_async.server.sampling import RowParams, sample

    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0]]).repeat(400, 1)  # [400, 5]
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(logits[0], dim=-1)
    for row, allowed in (
        (RowParams(temperature=1.0, top_k=2), {0, 1}),
        (RowParams(temperature=1.0, top_p=0.4), {0}),
        (RowParams(temperature=1.0, top_p=float(probs[:2].sum()) + 1e-3), {0, 1, 2}),
        (RowParams(temperature=1.0, min_p=0.5), {0, 1}),
        (RowParams(temperature=1.0), {0, 1, 2, 3, 4}),
    ):
        tokens, lps, _ = sample(logits.clone(), [row] * 400, gen)
        assert set(tokens.tolist()) == allowed
        # reported logprobs are the untruncated tempered distribution's
        # two fp32 log-softmaxes of the same 5 logits (spread 4, |lse| < 4), then log(p)'s rounding
        assert torch.allclose(lps, torch.log(probs)[tokens], atol=2 * logsumexp_bound(5, 4.0, 4.0) + 4 * U32, rtol=0)


# ---- shared prompt pages -------------------------------------------------------------------------------------------


async def test_shared_prompt_pages_give_the_same_outputs(make_engine, lively_ckpt):
    """Samples of one prompt sent together: the first computes the prompt, the others map its full pages (and say
    so in cached_tokens) and produce exactly what they produce alone; the pages outlive their first holder."""
    engine = await make_engine(lively_ckpt)
    prompt = engine.encode("shared prompt: " + "0123456789" * 4)[:45]  # 2 full pages of 16 and 13 more tokens
    other = engine.encode("x" * 45)
    alone, alone_lps, _, chunks = await run(
        engine, req("solo", prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True, return_logprob=True)
    )
    assert chunks[-1].cached_tokens == 0
    await engine.flush_cache()  # forget the solo run's pages: the group below starts from nothing
    together = await asyncio.gather(
        *[
            run(
                engine,
                req(
                    f"g{i}",
                    prompt if i < 4 else other,
                    max_new_tokens=20,
                    temperature=0.0,
                    ignore_eos=True,
                    return_logprob=True,
                ),
            )
            for i in range(6)
        ]
    )
    cached = [t[3][-1].cached_tokens for t in together]
    assert sorted(cached[:4]) == [0, 32, 32, 32]  # one computed the prompt, three mapped both full pages
    assert sorted(cached[4:]) == [0, 32]  # the other prompt shares only with its own copy
    for out, lps, finish, _ in together[:4]:
        assert out == alone and finish == {"type": "length", "length": 20}
        assert lp_gap_ok(lively_ckpt, lps, alone_lps, len(prompt) + 20)  # other batches: other matmul orders
    # nobody holds the pages now, yet they are still registered: a later request maps them
    out, _, _, chunks = await run(engine, req("later", prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True))
    assert out == alone and chunks[-1].cached_tokens == 32
    # prompt logprobs need every prompt position computed: no mapping
    _, _, _, chunks = await run(engine, req("lp", prompt, max_new_tokens=2, logprob_start_len=0))
    assert chunks[-1].cached_tokens == 0 and len(chunks[0].input_logprobs) == len(prompt)
    # a prompt of one page or less never maps (one token must be computed to sample from)
    short = prompt[:16]
    await run(engine, req("s1", short, max_new_tokens=2))
    assert (await run(engine, req("s2", short, max_new_tokens=2)))[3][-1].cached_tokens == 0


async def test_shared_prompt_pages_are_forgotten_at_a_weight_swap(make_engine, tiny_ckpt, tiny_ckpt_b):
    engine = await make_engine(tiny_ckpt)
    prompt = engine.encode("a prompt long enough for two pages: " + "xy" * 10)[:40]
    await run(engine, req("a", prompt, max_new_tokens=4, ignore_eos=True))
    assert (await run(engine, req("b", prompt, max_new_tokens=4, ignore_eos=True)))[3][-1].cached_tokens == 32
    ok, _, _ = await engine.update_weights_from_disk(tiny_ckpt_b, "1")
    assert ok
    out, lps, _, chunks = await run(
        engine, req("c", prompt, max_new_tokens=8, temperature=0.0, ignore_eos=True, return_logprob=True)
    )
    assert chunks[-1].cached_tokens == 0  # the old weights' pages are gone
    full = hf_logprobs(tiny_ckpt_b, prompt + out)
    want = [full[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]
    assert lp_gap_ok(tiny_ckpt_b, lps, want, len(prompt) + len(out))


async def test_cached_prompt_pages_are_evicted_when_pages_run_short(make_engine, lively_ckpt):
    # 192 tokens of KV = 12 pages; each request reserves 5 (40-token prompt + 40 new). Every finished prompt leaves
    # 2 registered pages, so from the sixth prompt on admissions must evict cached pages; every output stays right.
    engine = await make_engine(lively_ckpt, max_total_tokens=192)
    prompts = [engine.encode(f"{i}: " + "pq" * 30)[:40] for i in range(6)]
    alone = [
        (await run(engine, req(f"a{i}", p, max_new_tokens=40, temperature=0.0, ignore_eos=True)))[0]
        for i, p in enumerate(prompts)
    ]
    assert engine.pages.num_registered < 2 * len(prompts)  # the first prompts' pages were evicted
    pairs = [p for p in prompts for _ in range(2)]
    results = await asyncio.gather(
        *[
            run(engine, req(f"b{i}", p, max_new_tokens=40, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(pairs)
        ]
    )
    assert [r[0] for r in results] == [a for a in alone for _ in range(2)]
    assert sum(r[3][-1].cached_tokens == 32 for r in results) >= len(prompts)


async def test_prefix_cache_can_be_disabled(make_engine, lively_ckpt):
    engine = await make_engine(lively_ckpt, prefix_cache=False)
    prompt = engine.encode("shared prompt: " + "0123456789" * 4)[:45]
    results = await asyncio.gather(
        *[run(engine, req(f"g{i}", prompt, max_new_tokens=5, temperature=0.0)) for i in range(3)]
    )
    assert [r[3][-1].cached_tokens for r in results] == [0, 0, 0]
    assert len({tuple(r[0]) for r in results}) == 1
    assert engine.server_args()["disable_radix_cache"] is True


async def test_priority_requests_are_admitted_first(make_engine, lively_ckpt):
    """One running slot: queued requests run one at a time, a higher priority ahead of earlier lower ones, equal
    priorities in arrival order."""
    engine = await make_engine(lively_ckpt, max_running_requests=1)
    ids = engine.encode("abc")
    order: list[str] = []

    async def go(rid: str, priority: int = 0, n: int = 30) -> None:
        await run(
            engine,
            EngineRequest(
                rid=rid, input_ids=ids, priority=priority, sampling=EngineSampling(max_new_tokens=n, ignore_eos=True)
            ),
        )
        order.append(rid)

    first = asyncio.create_task(go("running", n=300))  # long enough for every other request to be queued
    while engine.num_running() == 0:
        await asyncio.sleep(0.001)
    tasks = [
        asyncio.create_task(go(rid, p))
        for rid, p in [("low1", 0), ("low2", 0), ("eval1", 1), ("eval2", 1), ("top", 5), ("low3", 0)]
    ]
    await asyncio.gather(first, *tasks)
    assert order == ["running", "top", "eval1", "eval2", "low1", "low2", "low3"]


def test_auto_device_names_the_current_cuda_device(monkeypatch):
    """A weight-update group and torch.cuda.set_device need an indexed device; "auto" must give one."""
    from areal_async.server.device import resolve_visible_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_visible_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_visible_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_visible_device("auto") == torch.device("cuda", 3) and resolve_visible_device("auto").index == 3
    assert resolve_visible_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_visible_device("cuda") == torch.device("cuda", 3)  # an index-less device gets the current one
    with pytest.raises(ValueError, match="sees 4 CUDA device"):  # not a CUDA error at the first allocation
        resolve_visible_device("cuda:4")
