"""Fuzzing the embedded server over real HTTP: random and mutated request bodies on every endpoint family, plus
raw garbage (truncated JSON, invalid UTF-8, NaN and huge numbers, deep nesting, huge arrays). The promise: never a
5xx, never a dropped connection, and afterwards the server still answers /health and makes the same greedy tokens.

Seeded; `AREAL_FUZZ_CASES` (per family, default 1000) makes a larger run, e.g. AREAL_FUZZ_CASES=20000.

Not fuzzed into validity: a well-formed /init_weights_update_group (it waits up to 10 minutes for the trainer to
join the group, by protocol), so a mutated body that would be one is sent with an out-of-range rank instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from typing import Any

import aiohttp
import pytest

CASES = int(os.environ.get("AREAL_FUZZ_CASES", "1000"))
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 20.0  # a mutated body may ask for a full-context generation: allowed, just slow

GREEDY = {"input_ids": [5, 9, 14, 3, 22, 7], "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}


def seeds(ckpt: str) -> dict[str, list[tuple[str, str, Any]]]:
    """Valid bodies per endpoint family: (method, path, body)."""
    sp = {"max_new_tokens": 4, "temperature": 0.0}
    return {
        "generate": [
            ("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}),
            ("POST", "/generate", {"text": "12+7=", "sampling_params": {**sp, "temperature": 1.0, "top_k": 5}}),
            (
                "POST",
                "/generate",
                {
                    "input_ids": [[5, 6], [7, 8, 9]],
                    "sampling_params": [sp, {**sp, "n": 2}],
                    "return_logprob": [True, False],
                    "rid": ["fz-a", "fz-b"],
                },
            ),
            (
                "POST",
                "/generate",
                {
                    "text": ["1+1=", "2+2="],
                    "sampling_params": {**sp, "stop": ["\n"]},
                    "stream": True,
                    "return_logprob": True,
                    "top_logprobs_num": 2,
                },
            ),
            (
                "POST",
                "/generate",
                {
                    "input_ids": [4, 4, 4],
                    "sampling_params": {
                        **sp,
                        "stop_token_ids": [1],
                        "min_new_tokens": 1,
                        "top_p": 0.9,
                        "ignore_eos": True,
                    },
                    "logprob_start_len": 0,
                    "return_logprob": True,
                    "priority": 3,
                },
            ),
        ],
        "openai": [
            ("POST", "/v1/completions", {"prompt": "3+4=", "max_tokens": 4, "temperature": 0}),
            (
                "POST",
                "/v1/completions",
                {
                    "prompt": [[5, 6, 7], "8+1="],
                    "max_tokens": 3,
                    "logprobs": 2,
                    "echo": True,
                    "n": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ),
            (
                "POST",
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "1+2?"}],
                    "max_tokens": 4,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            ),
            (
                "POST",
                "/v1/chat/completions",
                {
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "5+5?"}],
                    "max_completion_tokens": 3,
                    "stream": True,
                    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
                },
            ),
        ],
        "control": [
            ("POST", "/pause_generation", {"mode": "abort"}),
            ("POST", "/pause_generation", {"mode": "in_place"}),
            ("POST", "/continue_generation", {}),
            ("POST", "/abort_request", {"rid": "fz-nothing", "abort_all": False}),
            ("POST", "/flush_cache", None),
            ("GET", "/flush_cache", None),
        ],
        "weights": [
            (
                "POST",
                "/update_weights_from_disk",
                {"model_path": ckpt, "weight_version": "3", "flush_cache": True, "abort_all_requests": False},
            ),
            ("POST", "/update_weight_version", {"new_version": "4", "abort_all_requests": False}),
            (
                "POST",
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 5,
                    "world_size": 2,
                    "backend": "gloo",
                    "group_name": "fz",
                },
            ),
            (
                "POST",
                "/update_weights_from_distributed",
                {
                    "names": ["model.norm.weight"],
                    "dtypes": ["float32"],
                    "shapes": [[64]],
                    "group_name": "fz-none",
                    "weight_version": "5",
                },
            ),
        ],
        "info": [
            ("GET", p, None)
            for p in (
                "/health",
                "/health_generate",
                "/model_info",
                "/get_model_info",
                "/server_info",
                "/get_server_info",
                "/v1/models",
            )
        ],
    }


NASTY: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**31,
    2**63,
    -(2**63),
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e308,
    -1e-308,
    1e-12,
    "",
    "x",
    "abort",
    "in_place",
    "gloo",
    "nccl",
    "float32",
    "bogus",
    "\u0000",
    "\ud800",
    "😀" * 50,
    "a" * 5000,
    [],
    {},
    [0],
    [-1],
    [10**9],
    [[]],
    [[1, 2], 3],
    [1] * 3000,
    [{"role": "user"}],
    {"role": "user", "content": None},
    {"a": [{"b": None}]},
    [None, "x", 1.5],
    list(range(2000)),
]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.7 or depth > 3:
        return rng.choice(NASTY)
    if r < 0.85:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {
        rng.choice(["a", "text", "input_ids", "mode", "rid", "n", "role", "content"]): random_value(rng, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """One structural mutation somewhere in `value` (a copy)."""
    if isinstance(value, dict) and value and rng.random() < 0.8 and depth < 6:
        out = dict(value)
        key = rng.choice(list(out))
        op = rng.random()
        if op < 0.55:
            out[key] = mutate(out[key], rng, depth + 1)
        elif op < 0.7:
            del out[key]
        elif op < 0.85:
            out[rng.choice(["junk", key + "_", "sampling_params", "stream", "n", "model"])] = random_value(rng)
        else:
            out[rng.choice(["", " ", "x", "\u0000", "😀", key.upper()])] = out.pop(key)  # renamed
        return out
    if isinstance(value, list) and value and rng.random() < 0.7 and depth < 6:
        out = list(value)
        i = rng.randrange(len(out))
        op = rng.random()
        if op < 0.6:
            out[i] = mutate(out[i], rng, depth + 1)
        elif op < 0.8:
            del out[i]
        else:
            out.insert(i, random_value(rng))
        return out
    return random_value(rng)


def encode(body: Any, rng: random.Random) -> bytes:
    """JSON, sometimes with NaN/Infinity literals, sometimes damaged at the byte level."""
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.05 and len(raw) > 2:
        return raw[: rng.randrange(1, len(raw))]  # truncated
    if r < 0.08:
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\\", b'"', b"}"]) + raw[i:]
    if r < 0.10:
        return raw.replace(b"0", b"NaN", 1) if b"0" in raw else raw + b" Infinity"
    return raw


def raw_garbage() -> list[bytes]:
    return [
        b"",
        b" ",
        b"{",
        b"}",
        b"[",
        b"null",
        b"[]",
        b"0",
        b'"s"',
        b"NaN",
        b"-Infinity",
        b"true",
        b'{"input_ids": [1, 2',
        b'{"text": "\xff\xfe"}',
        b"\xff\xfe\xfd\xfc",
        b"\xef\xbb\xbf{}",
        b'{"input_ids": [1e400]}',
        b'{"input_ids": [' + b"9" * 5000 + b"]}",
        b"1" * 100000,
        b"[" * 100000,
        b'{"a":' * 50000,
        b"[" * 50000 + b"]" * 50000,
        b'{"input_ids": [' + b"5," * 400000 + b"5]}",
        b'{"text": "' + b"a" * 2_000_000 + b'", "sampling_params": {"max_new_tokens": 1}}',
        b'{"input_ids": [1], "input_ids": [2]}',
        b'{"sampling_params": {"max_new_tokens": 1e999}}',
        b'{"rid": "' + b"r" * 100000 + b'"}',
        b'{"mode": "abort", "mode": "bogus"}',
        b"\x00" * 1000,
        b'{"messages": [' + b'{"role": "user", "content": "x"},' * 20000 + b"{}]}",
        b'{"model_path": "/etc/passwd"}',
        b'{"model_path": "../../.."}',
        b'{"new_version": {"$gt": ""}}',
    ]


def would_wait(path: str, body: Any) -> bool:
    """A well-formed init request blocks by protocol (see the module docstring)."""
    if path != "/init_weights_update_group" or not isinstance(body, dict):
        return False
    r, w = body.get("rank_offset"), body.get("world_size")
    return (
        isinstance(r, int)
        and isinstance(w, int)
        and not isinstance(r, bool)
        and not isinstance(w, bool)
        and 0 < r < w
        and isinstance(body.get("master_address"), str)
        and isinstance(body.get("master_port"), int)
        and body.get("backend", "nccl") == "gloo"
    )


async def greedy(http: aiohttp.ClientSession, url: str) -> list[int]:
    async with http.post(url + "/generate", json=GREEDY) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["output_ids"]


async def fuzz(url: str, ckpt: str, rng: random.Random) -> tuple[list[str], dict[str, int]]:
    problems: list[str] = []
    counts: dict[str, int] = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        before = await greedy(http, url)

        async def send(
            family: str, method: str, path: str, data: bytes | None, ctype: str = "application/json"
        ) -> None:
            async with sem:
                try:
                    headers = {"Content-Type": ctype} if data is not None else {}
                    async with http.request(method, url + path, data=data, headers=headers) as r:
                        await r.read()  # streams included: the whole answer must arrive
                        counts[f"{family} {r.status}"] = counts.get(f"{family} {r.status}", 0) + 1
                        if r.status >= 500:
                            problems.append(f"{method} {path} -> {r.status}: {data[:300]!r}")
                except TimeoutError:
                    counts[f"{family} slow"] = counts.get(f"{family} slow", 0) + 1  # we hung up; not the server
                except aiohttp.ClientError as e:
                    problems.append(f"{method} {path}: connection failed ({type(e).__name__}: {e}): {data[:300]!r}")
                if path == "/pause_generation":  # a paused server holds every later generation
                    async with http.post(url + "/continue_generation", json={}) as r2:
                        await r2.read()

        families = seeds(ckpt)
        for family, seed_list in families.items():
            jobs = []
            for _ in range(CASES):
                method, path, body = rng.choice(seed_list)
                if method == "GET":  # GETs take no body: mutate the method, query and body instead
                    m = rng.choice(["GET", "GET", "POST", "PUT", "DELETE"])
                    q = rng.choice(["", "?x=1", "?" + "a" * 3000, "?%ff%fe", "?rid=%00"])
                    data = rng.choice([None, b"", b"{", b"\xff" * 10])
                    jobs.append(send(family, m, path + q, data))
                    continue
                mutated = body
                for _ in range(rng.randint(1, 3)):
                    mutated = mutate(mutated, rng)
                if would_wait(path, mutated):
                    mutated = {**mutated, "rank_offset": 0}
                jobs.append(
                    send(
                        family,
                        method,
                        path,
                        encode(mutated, rng),
                        rng.choice(["application/json"] * 9 + ["text/plain"]),
                    )
                )
            await asyncio.gather(*jobs)
        posts = sorted({(m, p) for fam in families.values() for m, p, _ in fam if m == "POST"})
        await asyncio.gather(*(send("garbage", m, p, g) for m, p in posts for g in raw_garbage()))

        async with http.post(url + "/continue_generation", json={}) as r:
            assert r.status == 200
        async with http.get(url + "/health") as r:
            assert r.status == 200
        after = await greedy(http, url)
        if after != before:
            problems.append(f"greedy tokens changed: {before} -> {after}")
    return problems, counts


@pytest.mark.slow
def test_fuzzed_bodies_never_break_the_server(tiny_ckpt):
    from areal_async.server.app import start_server

    async def main() -> tuple[list[str], dict[str, int]]:
        server = await start_server(tiny_ckpt, port=0, device="cpu", max_total_tokens=32768, max_running_requests=64)
        try:
            return await fuzz(server.url, tiny_ckpt, random.Random(20250315))
        finally:
            await server.close()

    problems, counts = asyncio.run(main())
    assert not problems, f"{len(problems)} problems, e.g.:\n" + "\n".join(problems[:20])
    # the fuzz reached past validation: some mutated bodies were valid and served, many were refused
    for family in ("generate", "openai", "control", "weights", "info"):
        assert counts.get(f"{family} 200", 0) > 0, counts
    assert sum(v for k, v in counts.items() if k.endswith(" 400")) > CASES, counts
