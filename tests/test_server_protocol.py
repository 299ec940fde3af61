"""Request parsing/validation and response shaping of the SGLang protocol (pure functions, no model, no HTTP).

The tokenizer is the project's real char tokenizer (tokenizers library), so texts and ids are what the server sees.
"""

from __future__ import annotations

import json

import pytest

from areal_async.protocol import openai_requests, openai_responses
from areal_async.protocol import sglang as sglang_protocol
from areal_async.protocol.engine_api import EngineChunk, EngineRequest, EngineSampling
from areal_async.tasks.char_tokenizer import save_char_tokenizer
from areal_async.tokenizer import Tokenizer

LIMITS = sglang_protocol.Limits(vocab_size=100, context_len=256)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("chartok"))
    save_char_tokenizer(path)
    return Tokenizer(path)


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def gen(tok, obj) -> sglang_protocol.GeneratePlan:
    return sglang_protocol.parse_generate(body(obj), tok, LIMITS)


# ---- /generate parsing --------------------------------------------------------------------------------------------


def test_single_text_defaults(tok):
    plan = gen(tok, {"text": "1+1=", "unknown_key": {"ignored": True}})
    assert not plan.batched and not plan.stream and len(plan.requests) == 1
    r = plan.requests[0]
    assert r.input_ids == tok.encode("1+1=") and len(r.rid) == 32
    assert r.sampling == EngineSampling()  # SGLang's defaults: max_new_tokens 128, temperature 1, ...
    assert r.return_logprob is False and r.logprob_start_len == -1


def test_null_max_new_tokens_fills_the_context(tok):
    plan = gen(tok, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": None}})
    assert plan.requests[0].sampling.max_new_tokens == LIMITS.context_len - 3


def test_full_sglang_frontend_sampling_params_accepted(tok):
    sp = {
        "max_new_tokens": 8,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
        "spaces_between_special_tokens": True,
        "skip_special_tokens": True,
        "no_stop_trim": False,
    }
    r = gen(tok, {"text": "ab", "sampling_params": sp}).requests[0]
    assert r.sampling.max_new_tokens == 8 and r.sampling.temperature == 0.0 and r.sampling.stop == []


def test_input_ids_batch_and_rid_suffixes(tok):
    plan = gen(tok, {"input_ids": [[5, 6], [7]], "rid": "job", "sampling_params": {"max_new_tokens": 4}})
    assert plan.batched
    assert [r.rid for r in plan.requests] == ["job_0", "job_1"]
    assert [r.input_ids for r in plan.requests] == [[5, 6], [7]]


def test_text_batch_with_rid_list_and_per_item_sampling(tok):
    plan = gen(
        tok,
        {
            "text": ["a", "bb"],
            "rid": ["x", "y"],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5, "stop": "q"}],
            "return_logprob": [True, False],
            "logprob_start_len": [0, -1],
        },
    )
    a, b = plan.requests
    assert (a.rid, b.rid) == ("x", "y")
    assert (a.sampling.max_new_tokens, b.sampling.max_new_tokens) == (3, 5)
    assert b.sampling.stop == ["q"]
    assert a.return_logprob and a.logprob_start_len == 0 and not b.return_logprob


def test_n_gives_every_sample_its_own_rid_prompt_major(tok):
    plan = gen(tok, {"input_ids": [[5], [6]], "rid": ["p", "q"], "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert plan.batched
    assert [r.rid for r in plan.requests] == ["p_0", "p_1", "q_0", "q_1"]
    assert [r.input_ids for r in plan.requests] == [[5], [5], [6], [6]]
    single = gen(tok, {"text": "a", "rid": "r", "sampling_params": {"n": 3, "max_new_tokens": 2}})
    assert single.batched and [r.rid for r in single.requests] == ["r_0", "r_1", "r_2"]


def test_logprob_fields_only_with_return_logprob(tok):
    r = gen(tok, {"input_ids": [5, 6], "logprob_start_len": 0, "top_logprobs_num": 3}).requests[0]
    assert r.logprob_start_len == -1 and r.top_logprobs_num == 0
    r = gen(tok, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3}).requests[
        0
    ]
    assert r.logprob_start_len == 1 and r.top_logprobs_num == 3


BAD_GENERATE = [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "Expected `object`"),
    (b"", "empty"),
    (body({"sampling_params": {}}), "missing prompt"),
    (body({"text": "a", "input_ids": [1]}), "exactly one of"),
    (body({"text": 5}), "$.text"),
    (body({"input_ids": []}), "empty"),
    (body({"input_ids": [[5], []]}), "prompt 1 is empty"),
    (body({"input_ids": [5, 100]}), "outside the vocabulary"),
    (body({"input_ids": [-1]}), "outside the vocabulary"),
    (body({"input_ids": [5, [6]]}), "not a mix"),
    (body({"text": []}), "empty batch"),
    (body({"input_ids": [5] * 256}), "context length"),
    (body({"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 250}}), "context length"),
    (body({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}), "max_new_tokens"),
    (body({"input_ids": [5], "sampling_params": {"max_new_tokens": "8"}}), "$.sampling_params.max_new_tokens"),
    (body({"input_ids": [5], "sampling_params": {"temperature": -0.1}}), "temperature"),
    (body({"input_ids": [5], "sampling_params": {"top_p": 0}}), "top_p"),
    (body({"input_ids": [5], "sampling_params": {"top_p": 1.5}}), "top_p"),
    (body({"input_ids": [5], "sampling_params": {"top_k": 0}}), "top_k"),
    (body({"input_ids": [5], "sampling_params": {"top_k": -2}}), "top_k"),
    (body({"input_ids": [5], "sampling_params": {"min_p": 1.5}}), "min_p"),
    (body({"input_ids": [5], "sampling_params": {"n": 0}}), "n must be"),
    (body({"input_ids": [5], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}), "min_new_tokens"),
    (body({"input_ids": [5], "sampling_params": {"repetition_penalty": 0}}), "repetition_penalty"),
    (body({"input_ids": [5], "sampling_params": {"stop": [""]}}), "stop"),
    (body({"input_ids": [5], "sampling_params": {"stop_token_ids": [500]}}), "stop_token_ids"),
    (body({"input_ids": [5], "sampling_params": {"regex": "a+"}}), "not supported"),
    (body({"input_ids": [5], "return_logprob": True, "logprob_start_len": 1}), "logprob_start_len"),
    (body({"input_ids": [5], "return_logprob": True, "top_logprobs_num": -1}), "top_logprobs_num"),
    (body({"input_ids": [[5], [6]], "rid": ["a"]}), "rid has 1 entries"),
    (body({"input_ids": [[5], [6]], "rid": ["a", "a"]}), "duplicate rid"),
    (body({"input_ids": [5], "rid": ["a"]}), "not a batch"),
    (body({"input_ids": [[5], [6]], "sampling_params": [{}]}), "sampling_params has 1 entries"),
    (body({"input_ids": [5], "stream": "yes"}), "$.stream"),
]


@pytest.mark.parametrize("raw,needle", BAD_GENERATE, ids=[n for _, n in BAD_GENERATE])
def test_bad_generate_requests(tok, raw, needle):
    with pytest.raises(sglang_protocol.ProtocolError) as ei:
        sglang_protocol.parse_generate(raw, tok, LIMITS)
    assert needle in str(ei.value)
    assert ei.value.status == 400


# ---- accumulation and response shapes -----------------------------------------------------------------------------


def _req(tok, *, stop=(), stop_ids=(), no_trim=False, logprob=False, start=-1, top=0, skip=True):
    s = EngineSampling(
        max_new_tokens=16,
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        no_stop_trim=no_trim,
        skip_special_tokens=skip,
    )
    return EngineRequest(
        rid="r1",
        input_ids=tok.encode("ab"),
        sampling=s,
        return_logprob=logprob,
        logprob_start_len=start,
        top_logprobs_num=top,
    )


def _chunk(ids, lps=None, fr=None, **kw):
    return EngineChunk(rid="r1", new_ids=ids, new_logprobs=lps or [], finish_reason=fr, weight_version="7", **kw)


def test_stop_string_trimmed_but_ids_kept(tok):
    acc = sglang_protocol.Accumulator(_req(tok, stop=["x="]), tok)
    ids = tok.encode("12x=")
    acc.add(_chunk(ids[:2]))
    acc.add(_chunk(ids[2:], fr={"type": "stop", "matched": "x="}))
    out = acc.generate_response()
    assert out["text"] == "12" and out["output_ids"] == ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "x="}
    assert out["meta_info"]["completion_tokens"] == 4 and out["meta_info"]["weight_version"] == "7"
    kept = sglang_protocol.Accumulator(_req(tok, stop=["x="], no_trim=True), tok)
    kept.add(_chunk(ids, fr={"type": "stop", "matched": "x="}))
    assert kept.text() == "12x="


def test_stop_token_and_eos_kept_in_ids_dropped_from_text(tok):
    nl = tok.encode("\n")[0]
    acc = sglang_protocol.Accumulator(_req(tok, stop_ids=[nl]), tok)
    acc.add(_chunk(tok.encode("ok\n"), fr={"type": "stop", "matched": nl}))
    assert acc.text() == "ok" and acc.output_ids[-1] == nl
    eos = sglang_protocol.Accumulator(_req(tok), tok)
    eos.add(_chunk(tok.encode("ok") + [1], fr={"type": "stop", "matched": 1}))
    assert eos.text() == "ok" and eos.output_ids[-1] == 1


def test_streaming_text_withholds_a_possible_stop_prefix(tok):
    acc = sglang_protocol.Accumulator(_req(tok, stop=["###"]), tok)
    acc.add(_chunk(tok.encode("ab#")))
    assert acc.text() == "ab"  # '#' may start '###'
    acc.add(_chunk(tok.encode("#c")))
    assert acc.text() == "ab##c"
    acc.add(_chunk(tok.encode("d"), fr={"type": "length", "length": 6}))
    assert acc.text() == "ab##cd" and acc.finished


def test_logprob_triples_and_input_logprobs(tok):
    req = _req(tok, logprob=True, start=0, top=2)
    acc = sglang_protocol.Accumulator(req, tok, text_in_logprobs=True)
    a, b = tok.encode("xy")
    acc.add(_chunk([a], [-0.5], input_logprobs=[None, -1.25], new_top_logprobs=[[(-0.5, a), (-2.0, b)]]))
    acc.add(_chunk([b], [-0.25], fr={"type": "length", "length": 2}, new_top_logprobs=[[(-0.25, b), (-3.0, a)]]))
    m = acc.meta_info()
    assert m["output_token_logprobs"] == [[-0.5, a, "x"], [-0.25, b, "y"]]
    assert m["input_token_logprobs"] == [[None, req.input_ids[0], "a"], [-1.25, req.input_ids[1], "b"]]
    assert m["output_top_logprobs"] == [[[-0.5, a, "x"], [-2.0, b, "y"]], [[-0.25, b, "y"], [-3.0, a, "x"]]]
    plain = sglang_protocol.Accumulator(_req(tok, logprob=True), tok)
    plain.add(_chunk([a], [-0.5], fr={"type": "length", "length": 1}))
    m = plain.meta_info()
    assert m["output_token_logprobs"] == [[-0.5, a, None]]
    assert "input_token_logprobs" not in m and "output_top_logprobs" not in m
    assert "output_token_logprobs" not in sglang_protocol.Accumulator(_req(tok), tok).meta_info()


def test_abort_reason_shape(tok):
    acc = sglang_protocol.Accumulator(_req(tok), tok)
    acc.abort_reason("gone")
    assert acc.finish_reason == {"type": "abort", "message": "gone", "status_code": None, "err_type": None}


# ---- OpenAI-compatible --------------------------------------------------------------------------------------------


def test_every_endpoint_tells_the_engine_whether_the_client_streams(tok):
    """The engine hands unstreamed requests over only at their end (engine.py): each parser must pass `stream` on."""
    for streamed in (False, True):
        plan = gen(tok, {"text": ["a", "b"], "sampling_params": {"n": 2}, "stream": streamed})
        assert len(plan.requests) == 4 and {r.stream for r in plan.requests} == {streamed}
        plan = openai_requests.parse_completion(body({"prompt": ["a", "b"], "stream": streamed}), tok, LIMITS)
        assert {r.stream for r in plan.requests} == {streamed}
        chat = {"messages": [{"role": "user", "content": "h"}], "n": 2, "stream": streamed}
        plan = openai_requests.parse_chat(body(chat), tok, LIMITS, _template(tok))
        assert len(plan.requests) == 2 and {r.stream for r in plan.requests} == {streamed}


def test_completion_prompt_forms(tok):
    assert openai_requests.parse_completion(body({"prompt": "ab"}), tok, LIMITS).prompts == [tok.encode("ab")]
    plan = openai_requests.parse_completion(body({"prompt": ["a", "b"], "n": 2, "max_tokens": 3}), tok, LIMITS)
    assert len(plan.requests) == 4 and plan.requests[0].sampling.max_new_tokens == 3
    assert openai_requests.parse_completion(body({"prompt": [5, 6]}), tok, LIMITS).prompts == [[5, 6]]
    assert openai_requests.parse_completion(body({"prompt": [[5], [6, 7]]}), tok, LIMITS).prompts == [[5], [6, 7]]
    plan = openai_requests.parse_completion(body({"prompt": "ab", "logprobs": 2, "echo": True}), tok, LIMITS)
    r = plan.requests[0]
    assert r.return_logprob and r.top_logprobs_num == 2 and r.logprob_start_len == 0 and plan.echo_texts == ["ab"]
    assert plan.requests[0].sampling.max_new_tokens == 16  # OpenAI's default


@pytest.mark.parametrize(
    "obj,needle",
    [
        ({}, "missing `prompt`"),
        ({"prompt": []}, "empty list"),
        ({"prompt": ["a", 5]}, "not a mix"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens must be >= 0"),
        ({"prompt": "a", "max_tokens": 1000}, "context length"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "logprobs": -1}, "logprobs"),
        ({"prompt": "a", "n": 0}, "n must be"),
        ({"prompt": "a", "stop": 5}, "$.stop"),
    ],
)
def test_bad_completion_requests(tok, obj, needle):
    with pytest.raises(sglang_protocol.ProtocolError) as ei:
        openai_requests.parse_completion(body(obj), tok, LIMITS)
    assert needle in str(ei.value)


def _template(tok):
    def apply(messages, tools):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if tools:
            text = "T" + text
        return tok.encode(text)

    return apply


def test_chat_parsing(tok):
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = openai_requests.parse_chat(
        body(
            {"messages": msgs, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2, "tools": tools, "n": 2}
        ),
        tok,
        LIMITS,
        _template(tok),
    )
    assert plan.prompts == [tok.encode("T<system>s<user>hi")] and plan.tools == tools
    assert [r.sampling.max_new_tokens for r in plan.requests] == [5, 5] and plan.logprobs == 2
    none = openai_requests.parse_chat(
        body({"messages": msgs, "tools": tools, "tool_choice": "none", "max_tokens": 3}), tok, LIMITS, _template(tok)
    )
    assert none.tools == [] and none.prompts == [tok.encode("<system>s<user>hi")]
    dflt = openai_requests.parse_chat(body({"messages": msgs}), tok, LIMITS, _template(tok))
    assert dflt.requests[0].sampling.max_new_tokens == LIMITS.context_len - len(dflt.prompts[0])


@pytest.mark.parametrize(
    "obj,needle",
    [
        ({}, "missing `messages`"),
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "requires logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "not supported"),
    ],
)
def test_bad_chat_requests(tok, obj, needle):
    with pytest.raises(sglang_protocol.ProtocolError) as ei:
        openai_requests.parse_chat(body(obj), tok, LIMITS, _template(tok))
    assert needle in str(ei.value)


def test_parse_tool_calls():
    """Complete, valid blocks naming an offered tool become calls; everything else stays in the content as written
    (the one behaviour of the server and the agent proxy)."""
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = openai_responses.parse_tool_calls(text, {"add"})
    assert content == "Let me add."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    two = (
        '<tool_call>{"name": "add", "arguments": "{}"}</tool_call><tool_call>{"name": "mul", "arguments": {}}'
        "</tool_call>"
    )
    content, calls = openai_responses.parse_tool_calls(two, {"add", "mul"})
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert calls[0]["function"]["arguments"] == "{}" and len({c["id"] for c in calls}) == 2
    for bad in (
        "no call here",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "rm"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}',
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>',
    ):
        # not JSON, unknown tool, cut short, wrong shapes
        assert openai_responses.parse_tool_calls(bad, {"add"}) == (bad, [])
    mixed = (
        'A <tool_call>{"name": "rm", "arguments": {}}</tool_call> B <tool_call>{"name": "add", "arguments": '
        '{"a": 1}}</tool_call> C <tool_call>{"name": "add"'
    )
    content, calls = openai_responses.parse_tool_calls(mixed, {"add"})
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert content == 'A <tool_call>{"name": "rm", "arguments": {}}</tool_call> B  C <tool_call>{"name": "add"'
    _, calls = openai_responses.parse_tool_calls('<tool_call>{"name": "anything", "parameters": {"x": 1}}</tool_call>')
    assert calls[0]["function"]["name"] == "anything" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def _finished_acc(tok, req, text, fr=None, lps=None):
    acc = sglang_protocol.Accumulator(req, tok)
    ids = tok.encode(text)
    acc.add(
        EngineChunk(
            rid=req.rid,
            new_ids=ids,
            new_logprobs=lps or [-0.1] * len(ids),
            weight_version="3",
            finish_reason=fr or {"type": "length", "length": len(ids)},
        )
    )
    return acc


def test_chat_response_with_tool_call(tok):
    tools = [{"type": "function", "function": {"name": "add"}}]
    plan = openai_requests.parse_chat(
        body(
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": tools,
                "max_tokens": 40,
                "logprobs": True,
                "return_token_ids": True,
            }
        ),
        tok,
        LIMITS,
        _template(tok),
    )
    out_text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    acc = _finished_acc(tok, plan.requests[0], out_text, fr={"type": "stop", "matched": 1})
    resp = openai_responses.chat_response(plan, [acc], "m", "id1", 0)
    ch = resp["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    assert ch["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert ch["token_ids"] == acc.output_ids and resp["prompt_token_ids"] == plan.prompts[0]
    assert len(ch["logprobs"]["content"]) == len(acc.output_ids)
    assert ch["logprobs"]["content"][0]["bytes"] == list(b"<")
    assert resp["usage"] == {
        "prompt_tokens": len(plan.prompts[0]),
        "completion_tokens": len(acc.output_ids),
        "total_tokens": len(plan.prompts[0]) + len(acc.output_ids),
    }
    assert resp["metadata"] == {"weight_version": "3"}


def test_completion_response_logprobs_and_echo(tok):
    plan = openai_requests.parse_completion(
        body({"prompt": "ab", "logprobs": 1, "echo": True, "max_tokens": 3, "return_token_ids": True}), tok, LIMITS
    )
    req = plan.requests[0]
    acc = sglang_protocol.Accumulator(req, tok)
    ids = tok.encode("cd")
    acc.add(
        EngineChunk(
            rid=req.rid,
            new_ids=ids,
            new_logprobs=[-1.0, -2.0],
            input_logprobs=[None, -0.5],
            new_top_logprobs=[[(-1.0, ids[0])], [(-2.0, ids[1])]],
            finish_reason={"type": "length", "length": 2},
        )
    )
    ch = openai_responses.completion_response(plan, [acc], "m", "c1", 0)["choices"][0]
    assert ch["text"] == "abcd" and ch["finish_reason"] == "length"
    lp = ch["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d"] and lp["token_logprobs"] == [None, -0.5, -1.0, -2.0]
    assert lp["text_offset"] == [0, 1, 2, 3] and lp["top_logprobs"] == [None, None, {"c": -1.0}, {"d": -2.0}]
    assert ch["token_ids"] == ids and ch["prompt_token_ids"] == tok.encode("ab")


def test_stream_deltas_concatenate_to_final_text(tok):
    tools = [{"type": "function", "function": {"name": "add"}}]
    plan = openai_requests.parse_chat(
        body({"messages": [{"role": "user", "content": "x"}], "tools": tools, "max_tokens": 50}),
        tok,
        LIMITS,
        _template(tok),
    )
    req = plan.requests[0]
    acc = sglang_protocol.Accumulator(req, tok)
    st = openai_responses.StreamDelta(hold_tool_calls=True)
    pieces, calls, finish = [], [], None
    text = 'hi <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for k, tid in enumerate(tok.encode(text)):
        last = k == len(text) - 1
        acc.add(
            EngineChunk(
                rid=req.rid,
                new_ids=[tid],
                new_logprobs=[-0.1],
                finish_reason={"type": "stop", "matched": 1} if last else None,
            )
        )
        ev = openai_responses.chat_chunk(plan, 0, acc, st, "m", "id", 0)
        if ev is None:
            continue
        d = ev["choices"][0]["delta"]
        pieces.append(d.get("content") or "")
        calls += d.get("tool_calls") or []
        finish = ev["choices"][0]["finish_reason"] or finish
        assert "<" not in (d.get("content") or "")  # the tool-call markup is never streamed as content
    assert "".join(pieces) == "hi " and finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["add"] and calls[0]["index"] == 0

    cplan = openai_requests.parse_completion(body({"prompt": "a", "max_tokens": 5, "stop": "zz"}), tok, LIMITS)
    creq = cplan.requests[0]
    cacc = sglang_protocol.Accumulator(creq, tok)
    cst = openai_responses.StreamDelta()
    out = []
    for k, tid in enumerate(tok.encode("xyzz")):
        cacc.add(
            EngineChunk(
                rid=creq.rid,
                new_ids=[tid],
                new_logprobs=[],
                finish_reason={"type": "stop", "matched": "zz"} if k == 3 else None,
            )
        )
        ev = openai_responses.completion_chunk(cplan, 0, cacc, cst, "m", "id", 0)
        if ev is not None:
            out.append(ev["choices"][0]["text"])
    assert "".join(out) == "xy"


def test_control_bodies():
    assert sglang_protocol.parse_pause(b"") == "abort" and sglang_protocol.parse_pause(b"{}") == "abort"
    assert sglang_protocol.parse_pause(body({"mode": "in_place"})) == "in_place"
    with pytest.raises(sglang_protocol.ProtocolError, match="unknown pause mode"):
        sglang_protocol.parse_pause(body({"mode": "later"}))
    u = sglang_protocol.decode_body(body({"model_path": "/x", "weight_version": 3}), sglang_protocol.UpdateFromDiskIn)
    assert sglang_protocol.version_str(u.weight_version) == "3" and u.flush_cache and not u.abort_all_requests
    with pytest.raises(sglang_protocol.ProtocolError, match="model_path"):
        sglang_protocol.decode_body(body({}), sglang_protocol.UpdateFromDiskIn)
    d = sglang_protocol.decode_body(
        body({"names": ["a"], "dtypes": [], "shapes": [[1]]}), sglang_protocol.UpdateFromDistributedIn
    )
    with pytest.raises(sglang_protocol.ProtocolError, match="equal lengths"):
        d.check()


class _ByteTokenizer:
    """Token id = one UTF-8 byte: a multi-byte character spans several tokens, as with byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_never_splits_a_character_and_matches_full_decode():
    bt = _ByteTokenizer()
    final = "héllo wörld — ✓ done"
    ids = bt.encode(final)
    req = EngineRequest(rid="r", input_ids=[104], sampling=EngineSampling(max_new_tokens=64))
    acc = sglang_protocol.Accumulator(req, bt)
    seen = []
    for k, t in enumerate(ids):
        acc.add(
            EngineChunk(
                rid="r",
                new_ids=[t],
                new_logprobs=[],
                finish_reason={"type": "length", "length": len(ids)} if k == len(ids) - 1 else None,
            )
        )
        text = acc.text()
        assert "\ufffd" not in text and final.startswith(text)
        seen.append(text)
    assert seen[-1] == final and seen[1] == "h"  # after 'h' and the first byte of 'é', only 'h' is out


def test_streamed_completion_logprobs_have_running_text_offsets(tok):
    plan = openai_requests.parse_completion(
        body({"prompt": "ab", "max_tokens": 4, "logprobs": 0, "echo": True}), tok, LIMITS
    )
    req = plan.requests[0]
    acc = sglang_protocol.Accumulator(req, tok)
    st = openai_responses.StreamDelta()
    offsets, texts = [], []
    for k, tid in enumerate(tok.encode("wxyz")):
        acc.add(
            EngineChunk(
                rid=req.rid,
                new_ids=[tid],
                new_logprobs=[-1.0],
                input_logprobs=[None, -0.5] if k == 0 else None,
                finish_reason={"type": "length", "length": 4} if k == 3 else None,
            )
        )
        ev = openai_responses.completion_chunk(plan, 0, acc, st, "m", "id", 0)
        offsets += ev["choices"][0]["logprobs"]["text_offset"]
        texts.append(ev["choices"][0]["text"])
    assert "".join(texts) == "abwxyz" and offsets == [0, 1, 2, 3, 4, 5]


def test_priority_per_request_or_per_item(tok):
    assert [r.priority for r in gen(tok, {"text": "1+1="}).requests] == [0]
    assert [r.priority for r in gen(tok, {"text": "1+1=", "priority": 3}).requests] == [3]
    plan = gen(tok, {"text": ["a", "b"], "priority": [1, 0], "sampling_params": {"n": 2}})
    assert [r.priority for r in plan.requests] == [1, 1, 0, 0]
    with pytest.raises(sglang_protocol.ProtocolError, match="priority"):
        gen(tok, {"text": ["a", "b"], "priority": [1]})
    with pytest.raises(sglang_protocol.ProtocolError):
        gen(tok, {"text": "a", "priority": "high"})


def test_weight_version_spans_mark_where_the_version_changed(tok):
    acc = sglang_protocol.Accumulator(_req(tok), tok)
    assert acc.meta_info()["weight_version_spans"] == []  # no output yet
    chunks = [
        EngineChunk(rid="r1", new_ids=ids, new_logprobs=[], weight_version=v)
        for ids, v in [([], "3"), ([5, 6], "3"), ([7], "3"), ([], "4"), ([8, 9, 10], "4"), ([11], "5")]
    ]
    seen = []
    for ch in chunks:
        acc.add(ch)
        seen.append(acc.generate_response()["meta_info"]["weight_version_spans"])
    # an empty chunk never opens a span; the same version continues the last one; offsets index output_ids
    assert seen == [[], [[0, "3"]], [[0, "3"]], [[0, "3"]], [[0, "3"], [3, "4"]], [[0, "3"], [3, "4"], [6, "5"]]]
    assert acc.output_ids == [5, 6, 7, 8, 9, 10, 11]
    acc.add(
        EngineChunk(
            rid="r1", new_ids=[], new_logprobs=[], weight_version="6", finish_reason={"type": "abort", "message": "x"}
        )
    )
    meta = acc.meta_info()
    assert meta["weight_version"] == "6" and meta["weight_version_spans"][-1] == [6, "5"]
    meta["weight_version_spans"][0][1] = "changed"  # the response holds copies
    assert acc.meta_info()["weight_version_spans"][0] == [0, "3"]
