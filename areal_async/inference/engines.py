"""Which engine a server runs, asked once per server process: the dialect the pool speaks to it through.

    GET /get_server_info (or /server_info) -> 200
        carries `api_key_required`  -> the embedded server (it speaks the client's protocol as it is)
        otherwise                   -> SGLang of the release its `version` says
    404                             -> vLLM when its GET /version answers (inference/vllm_dialect.py), else
                                       GET /server_info as above (SGLang's newer name)
    anything else                   -> not known yet (starting, unauthorised): asked again at the next exchange

No torch here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from areal_async.inference.dialect import Dialect, RawSend, parse_release
from areal_async.inference.sglang_dialect import SGLangDialect
from areal_async.inference.vllm_dialect import detect_vllm, is_vllm_server_info

__all__ = ["EmbeddedDialect", "detect", "dialect_from_info"]


class EmbeddedDialect(Dialect):
    """areal_async's own server: SGLang's protocol with exact `weight_version_spans`, /health answered at once."""

    engine = "embedded"
    version_spans = True


def dialect_from_info(info: Any) -> Dialect | None:
    """The dialect a /get_server_info answer names; None when it is not such an answer."""
    if not isinstance(info, dict):
        return None
    if "api_key_required" in info:  # a field of the embedded server's answer that SGLang's ServerArgs lacks
        return EmbeddedDialect(parse_release(info.get("version")), info)
    return SGLangDialect(parse_release(info.get("version")), info)


async def detect(raw: RawSend) -> Dialect | None:
    """The server's dialect, or None when it cannot tell yet. Connection errors propagate (the caller's)."""
    for path in ("/get_server_info", "/server_info"):
        status, data = await raw("GET", path, None, None)
        if status == 200:
            try:
                info = msgspec.json.decode(data)
            except msgspec.DecodeError:
                return None
            if is_vllm_server_info(info):  # vLLM's dev mode has a /server_info of its own
                return await detect_vllm(raw)
            return dialect_from_info(info)
        if status != 404:
            return None
        if path == "/get_server_info":  # vLLM before SGLang's newer name: vLLM's first /server_info takes ~10 s
            found = await detect_vllm(raw)
            if found is not None:
                return found
    return None
