"""One fixed script of HTTP exchanges with an SGLang server, run against a real server to record its answers
(scripts/record_sglang_fixtures.py writes them to tests/fixtures/sglang/<release>/answers.json) and against the fake
set up as that release (tests/test_sglang_conformance.py), so that the fake is held to what the real release sent.

Why a script of its own rather than the conformance checks: those assert what the client needs, this keeps what the
server *said* (every field, status and message), so a field the fake leaves out or a message it words otherwise is
seen even where no check reads it yet. Answers are compared by shape (`shape`, `differences`): key sets, value
types and statuses, plus the exact text of the messages the client matches on (`EXACT`); token ids, logprobs and
timings differ between a model and the fake's arithmetic and are not compared.

No torch here: it speaks HTTP only (aiohttp).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp

__all__ = ["EXACT", "MODEL_INFO_KEYS", "SERVER_INFO_KEYS", "differences", "load", "record", "shape", "write"]

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# the /get_server_info fields the project reads (the rest of SGLang's ServerArgs is hundreds of fields, many of them
# local paths): version detection, the broadcast layout, the in-place guard, the served dtype, stream kind
SERVER_INFO_KEYS = (
    "version",
    "model_path",
    "dtype",
    "tp_size",
    "dp_size",
    "pp_size",
    "enable_dp_attention",
    "disable_radix_cache",
    "incremental_streaming_output",
    "weights_delta",
    "api_key_required",
)
# of /model_info's (0.5.23 adds its embedding and cache setup: hundreds of values), those the project reads
MODEL_INFO_KEYS = ("model_path", "tokenizer_path", "is_generation", "weight_version")
# answers whose message text the client matches on (inference/lora_window.py, sglang_dialect.py, fleet.py): their
# strings must be the real ones word for word
EXACT = (
    "load_lora_adapter_off",
    "unload_lora_adapter_off",
    "generate_lora_off",
    "destroy_weights_update_group_missing",
    "distributed_outside_session",
    "begin_weight_update",
    "end_weight_update",
)
NORM = "model.norm.weight"  # the tensor read back through /get_weights_by_name


def _sampling(n: int, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}


def _generate(rid: str, n: int, **kw: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": _sampling(n), "return_logprob": True, "rid": rid, **kw}


async def _call(http: aiohttp.ClientSession, url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    """One exchange as recorded: the status and the body (JSON when it parses, else its text; SSE as the list of
    its events, each JSON or the literal text)."""
    kw: dict[str, Any] = {} if body is None else {"json": body}
    async with http.request(method, url + path, **kw) as r:
        raw = await r.read()
        kind = r.headers.get("Content-Type", "")
    text = raw.decode("utf-8", "replace")
    if "text/event-stream" in kind:
        events = [e.strip()[len("data:") :].strip() for e in text.split("\n\n") if e.strip()]
        return {"status": r.status, "events": [_maybe_json(e) for e in events]}
    return {"status": r.status, "body": _maybe_json(text)}


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def record(url: str, *, model: str, scratch: str, real: bool) -> dict[str, dict[str, Any]]:
    """Run the script against the server at `url` serving checkpoint `model`; `scratch` is an empty folder (a
    path that is no checkpoint). Returns name -> exchange. Leaves the server unpaused, at its launch weights,
    labelled "0"."""
    out: dict[str, dict[str, Any]] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    # a connection per exchange: a release that answers a request with a 500 closes the connection it reused
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as http:

        async def call(name: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
            out[name] = await _call(http, url, method, path, body)
            return out[name]

        _keep(await call("get_server_info", "GET", "/get_server_info"), SERVER_INFO_KEYS)
        _keep(await call("model_info", "GET", "/model_info"), MODEL_INFO_KEYS)
        _keep(await call("get_model_info", "GET", "/get_model_info"), MODEL_INFO_KEYS)
        await call("health", "GET", "/health")
        await call("generate_length", "POST", "/generate", _generate("rec-length", 4))
        await call(
            "generate_text_logprobs", "POST", "/generate", _generate("rec-text", 2, return_text_in_logprobs=True)
        )
        await call("generate_stream", "POST", "/generate", _generate("rec-stream", 3, stream=True))
        strict = _generate("rec-strict", 2)
        strict["sampling_params"]["no_such_key"] = 1
        await call("generate_unknown_key", "POST", "/generate", strict)

        task = asyncio.create_task(_call(http, url, "POST", "/generate", _generate("rec-abort", 3000)))
        await asyncio.sleep(2.0 if real else 0.3)
        await call("abort_request", "POST", "/abort_request", {"rid": "rec-abort"})
        out["generate_abort"] = await task

        await call("pause_abort", "POST", "/pause_generation", {"mode": "abort"})
        await call("continue_generation", "POST", "/continue_generation", {})
        await call("pause_in_place", "POST", "/pause_generation", {"mode": "in_place"})
        await call("update_weights_from_disk", "POST", "/update_weights_from_disk",
                   {"model_path": model, "weight_version": "1", "flush_cache": False})  # fmt: skip
        await call("continue_generation_after_update", "POST", "/continue_generation", {})
        await call("update_weights_from_disk_not_a_checkpoint", "POST", "/update_weights_from_disk",
                   {"model_path": scratch, "weight_version": "2", "flush_cache": False})  # fmt: skip
        await call("update_weight_version", "POST", "/update_weight_version", {"new_version": "0"})
        await call("flush_cache", "POST", "/flush_cache")
        await call("get_weights_by_name", "POST", "/get_weights_by_name", {"name": NORM, "truncate_size": 4})
        await call("get_weights_by_name_unknown", "POST", "/get_weights_by_name", {"name": "no.such.weight"})

        await call("begin_weight_update", "POST", "/begin_weight_update", {})
        await call("end_weight_update", "POST", "/end_weight_update", {})
        if out["begin_weight_update"]["status"] == 200:  # 0.5.21+: refused before the group is looked up
            bucket = {"names": [NORM], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "rec-none"}
            await call("distributed_outside_session", "POST", "/update_weights_from_distributed", bucket)
        await call("destroy_weights_update_group_missing", "POST", "/destroy_weights_update_group",
                   {"group_name": "rec-none"})  # fmt: skip

        await call("load_lora_adapter_off", "POST", "/load_lora_adapter", {"lora_name": "rec", "lora_path": scratch})
        await call("unload_lora_adapter_off", "POST", "/unload_lora_adapter", {"lora_name": "rec"})
        await call("generate_lora_off", "POST", "/generate", _generate("rec-lora", 1, lora_path="rec"))
    return _scrubbed(out, {model: "<model>", scratch: "<scratch>"})


def _keep(exchange: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Only `keys` of a JSON object answer (in place)."""
    if isinstance(exchange.get("body"), dict):
        exchange["body"] = {k: v for k, v in exchange["body"].items() if k in keys}


def _scrubbed(value: Any, paths: dict[str, str]) -> Any:
    """Local paths replaced by placeholders, inside strings too (an error message naming the folder)."""
    if isinstance(value, dict):
        return {k: _scrubbed(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v, paths) for v in value]
    if isinstance(value, str):
        for path, name in paths.items():
            value = value.replace(path, name)
    return value


def load(path: str) -> dict[str, dict[str, Any]]:
    """A recorded answers.json."""
    with open(path) as f:
        return json.load(f)["answers"]


def shape(value: Any) -> Any:
    """The part of an answer compared: dicts by keys, lists by their elements' shapes (a JSON array of mixed
    kinds, like a logprob triple, element by element), scalars by kind; null matches any kind (`differences`)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes = [shape(v) for v in value]
        distinct = [s for i, s in enumerate(shapes) if s not in shapes[:i]]
        return distinct if len(distinct) > 1 else distinct[:1]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else "str"


def _diff(want: Any, got: Any, where: str, out: list[str]) -> None:
    if want == "null" or got == "null":
        return
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in got:
                out.append(f"{where}.{k}: the real server sends it, the fake does not")
            elif k not in want:
                out.append(f"{where}.{k}: the fake sends it, the real server does not")
            else:
                _diff(want[k], got[k], f"{where}.{k}", out)
        return
    if isinstance(want, list) and isinstance(got, list):
        if want and got:  # an empty list fits any element shape
            for i, (w, g) in enumerate(zip(want, got)):
                _diff(w, g, f"{where}[{i}]", out)
            if len(want) != len(got):
                out.append(f"{where}: elements of {len(want)} kinds recorded, {len(got)} sent")
        return
    if want != got:
        out.append(f"{where}: {want!r} recorded, {got!r} sent")


def differences(recorded: dict[str, dict[str, Any]], fake: dict[str, dict[str, Any]]) -> list[str]:
    """Where the fake's exchanges differ from the recorded ones: a missing exchange, a status, a shape, or (for
    the `EXACT` ones) a message's text. Empty when the fake answers as the real release did."""
    out: list[str] = []
    for name in sorted(set(recorded) | set(fake)):
        if name not in fake or name not in recorded:
            out.append(f"{name}: only the {'real' if name in recorded else 'fake'} server was asked it")
            continue
        want, got = recorded[name], fake[name]
        if want["status"] != got["status"]:
            out.append(f"{name}: status {want['status']} recorded, {got['status']} sent")
            continue
        key = "events" if "events" in want else "body"
        if key not in got:
            out.append(f"{name}: recorded as {key}, the fake's answer is not")
            continue
        if name in EXACT and want[key] != got[key]:
            out.append(f"{name}: {want[key]!r} recorded, {got[key]!r} sent")
        elif key == "events":  # a stream event by event: how many, and each one's fields
            if len(want[key]) != len(got[key]):
                out.append(f"{name}: {len(want[key])} events recorded, {len(got[key])} sent")
            for i, (w, g) in enumerate(zip(want[key], got[key])):
                _diff(shape(w), shape(g), f"{name}[{i}]", out)
        else:
            _diff(shape(want[key]), shape(got[key]), name, out)
    return out


def write(path: str, release: str, answers: dict[str, dict[str, Any]]) -> None:
    """answers.json for `release` (the folder is made)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"release": release, "answers": answers}, f, indent=1, sort_keys=True)
        f.write("\n")
