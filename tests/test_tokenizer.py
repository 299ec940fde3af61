"""The torch-free Tokenizer against transformers: template files in every layout, rendering (SmolLM2's real
template and templates of our own, one per Jinja feature real templates use), encode/decode parity on mixed text,
EOS lists, and check_tokenizer's errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from areal_async.chat_template import ChatTemplateError
from areal_async.testing.real_model import smollm2_path
from areal_async.tokenizer import Tokenizer, TokenizerError, check_tokenizer

MIXED = [
    "plain text, numbers 12345 and 3.14159",
    "<|im_start|>user\nWhat is 7+8?<|im_end|>\n<|im_start|>assistant\nThe answer is 15.<|im_end|>",
    "special tokens glued:<|im_end|><|im_start|><|endoftext|>x<repo_name>y",
    "  leading spaces, \ttabs,\n\n\nnewlines   and trailing  ",
    "Ünïcödé — café, naïve, 日本語, emoji 😀👍🏽, math ∑∫√",
    "<|im_start|> half <|im_  and <|im_end| not tokens",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42."},
    {"role": "user", "content": "And 42 * 2? Ünï 😀"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers — exactly.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]

# Templates of our own, each using features real templates use (Qwen, Llama 3, DeepSeek, Mistral styles).
TEMPLATES = {
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}[{{ loop.index }}/{{ loop.length }}{{ '*' if loop.last }}]"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    ),
    "namespace": (
        "{% set ns = namespace(system='', n=0, last_user=-1) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}"
        "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}SYS={{ ns.system }} N={{ ns.n }} LAST={{ ns.last_user }}"
    ),
    "tools_tojson": (
        "{%- if tools %}<tools>\n{% for t in tools %}{{ t | tojson }}\n{{ t | tojson(indent=2) }}\n"
        "{{ t.function | tojson(separators=(',', ':'), sort_keys=true) }}\n{{ t | tojson(ensure_ascii=true) }}\n"
        "{% endfor %}</tools>\n{%- endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
        "{% endfor %}"
    ),
    "trim_lstrip": (
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'user' %}\n"
        "        <|user|>\n{{ message['content'] | trim }}\n"
        "    {% else %}\n"
        "        <|{{ message['role'] }}|>\n{{ message['content'] }}\n"
        "    {%- endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n    <|assistant|>\n{% endif %}\n"
    ),
    "special_tokens_and_kwargs": (
        "{{ bos_token }}{% for m in messages %}{{ m.role | upper }}: {{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
        "{{ pad_token ~ '|' ~ (custom_var | default('none')) }}"
    ),
    "dict_and_strings": (
        "{% set roles = dict(user='U', assistant='A', system='S') %}{% for m in messages %}"
        "{{ roles[m.role] }}{{ m.content.split(' ') | length }}:{{ m.content.strip().lower() }}"
        "{{ '!' if m.content.startswith('What') }}{{ m.content | replace('?', '¿') }};{% endfor %}"
        "{% for k, v in roles.items() | sort %}{{ k }}={{ v }}{% endfor %}"
    ),
    "reasoning_and_none": (
        "{% for m in messages %}{{ m.role }}"
        "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{% if 'content' in m %}{{ m.content }}{% else %}(no content){% endif %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
        "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}\n{% endfor %}"
    ),
    "documents": (
        "{% if documents %}{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n{% endfor %}"
        "{% endif %}{% for m in messages %}{{ m.content }}\n{% endfor %}"
    ),
    "generation": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "strftime": "Today is {{ strftime_now('%d %B %Y') }}.{% for m in messages %} {{ m.content }}{% endfor %}",
}


@pytest.fixture(scope="module")
def smollm2() -> str:
    return smollm2_path()


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2)


def _copy_tokenizer(src: str, dst: str, *, template_file: bool = True, config_template: object = "keep") -> str:
    """The tokenizer files of `src` in a new directory, with the chat template where a test wants it."""
    os.makedirs(dst, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    if not template_file and os.path.exists(os.path.join(dst, "chat_template.jinja")):
        os.remove(os.path.join(dst, "chat_template.jinja"))
    if template_file and os.path.exists(os.path.join(src, "chat_template.jinja")):
        shutil.copy(os.path.join(src, "chat_template.jinja"), dst)
    if config_template != "keep":
        path = os.path.join(dst, "tokenizer_config.json")
        cfg = json.load(open(path))
        if config_template is None:
            cfg.pop("chat_template", None)
        else:
            cfg["chat_template"] = config_template
        json.dump(cfg, open(path, "w"))
    return dst


# ---- SmolLM2's real template and tokenizer --------------------------------------------------------------------


@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_renders_and_tokenizes_as_transformers(smollm2, hf_smollm2, gen):
    tok = Tokenizer(smollm2)
    for msgs in (CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]):  # with and without a system message
        want = hf_smollm2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == want
        want_ids = hf_smollm2.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == list(want_ids)
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(CONVERSATION[1:2], tokenize=False)


def test_smollm2_encode_decode_parity_on_mixed_text(smollm2, hf_smollm2):
    tok = Tokenizer(smollm2)
    assert tok.vocab_size == len(hf_smollm2) == 49152
    for text in MIXED:
        ids = tok.encode(text)
        assert ids == hf_smollm2(text, add_special_tokens=False).input_ids, text
        assert tok.encode(text, add_special_tokens=True) == hf_smollm2(text).input_ids, text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(ids, skip_special_tokens=skip)
    ids = tok.encode(MIXED[1])
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") in ids
    assert tok.special_tokens_map == hf_smollm2.special_tokens_map
    assert tok.all_special_ids == sorted(hf_smollm2.all_special_ids)
    assert tok.eos_token_ids == [2] and tok.pad_token_id == hf_smollm2.pad_token_id == 2
    assert tok.bos_token_id == hf_smollm2.bos_token_id == 1


# ---- templates of our own, one feature each ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_feature_templates_render_as_transformers(smollm2, hf_smollm2, name, gen):
    tok = Tokenizer(smollm2)
    src = TEMPLATES[name]
    msgs = [dict(m) for m in CONVERSATION]
    kwargs: dict = {}
    if name == "reasoning_and_none":
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "reasoning": "12 * 2 = 84?",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
            },
            {"role": "tool", "content": "3"},
        ]
    if name == "special_tokens_and_kwargs":
        kwargs = {"enable_thinking": False, "custom_var": "x"}
    docs = [{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "béta"}] if name == "documents" else None
    tools = TOOLS if name == "tools_tojson" else None
    want = hf_smollm2.apply_chat_template(
        msgs, chat_template=src, tools=tools, documents=docs, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    got = tok.apply_chat_template(
        msgs, chat_template=src, tools=tools, documents=docs, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    assert got == want
    assert got.strip()  # each template renders something


def test_kwargs_override_special_tokens_and_continue_final_message(smollm2, hf_smollm2):
    tok = Tokenizer(smollm2)
    src = TEMPLATES["special_tokens_and_kwargs"]
    for kw in ({"eos_token": "<END>"}, {"bos_token": ""}):
        assert tok.apply_chat_template(
            CONVERSATION, chat_template=src, tokenize=False, **kw
        ) == hf_smollm2.apply_chat_template(CONVERSATION, chat_template=src, tokenize=False, **kw)
    prefill = CONVERSATION + [{"role": "assistant", "content": "Let me think: 42 * 2 = "}]
    want = hf_smollm2.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert (
        tok.apply_chat_template(prefill, continue_final_message=True, add_generation_prompt=False, tokenize=False)
        == want
    )
    assert want.endswith("42 * 2 = ") and "<|im_end|>" not in want[-12:]
    with pytest.raises(ValueError, match="not compatible"):
        tok.apply_chat_template(prefill, continue_final_message=True, add_generation_prompt=True)


def test_generation_blocks_give_the_same_assistant_mask_as_transformers(smollm2, hf_smollm2):
    tok = Tokenizer(smollm2)
    msgs = CONVERSATION + [{"role": "assistant", "content": "84, since 42 * 2 = 84."}]
    src = TEMPLATES["generation"]
    want = hf_smollm2.apply_chat_template(
        msgs, chat_template=src, return_assistant_tokens_mask=True, return_dict=True, add_generation_prompt=False
    )
    got = tok.apply_chat_template(
        msgs, chat_template=src, return_assistant_tokens_mask=True, add_generation_prompt=False
    )
    assert got["input_ids"] == list(want["input_ids"])
    assert got["assistant_masks"] == list(want["assistant_masks"])
    masked = [i for i, m in zip(got["input_ids"], got["assistant_masks"]) if m]
    assert tok.decode(masked, skip_special_tokens=False) == "42.<|im_end|>84, since 42 * 2 = 84.<|im_end|>"


def test_template_errors_match_transformers(smollm2, hf_smollm2):
    import jinja2

    tok = Tokenizer(smollm2)
    src = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user message') }}"
        "{% endif %}ok"
    )
    with pytest.raises(jinja2.TemplateError, match="must start with a user"):
        hf_smollm2.apply_chat_template(CONVERSATION, chat_template=src, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must start with a user"):
        tok.apply_chat_template(CONVERSATION, chat_template=src, tokenize=False)
    assert tok.apply_chat_template(CONVERSATION[1:], chat_template=src, tokenize=False) == "ok"
    escape = "{% set ns = namespace() %}{% set ns.__class__ = 1 %}x"
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf_smollm2.apply_chat_template(CONVERSATION, chat_template=escape, tokenize=False)
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        tok.apply_chat_template(CONVERSATION, chat_template=escape, tokenize=False)
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        tok.apply_chat_template(CONVERSATION, chat_template="{% for m in messages %}", tokenize=False)


# ---- where the template lives -----------------------------------------------------------------------------------


def _render_both(path: str, **kw) -> tuple[str, str]:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(path)
    return (
        Tokenizer(path).apply_chat_template(CONVERSATION, tokenize=False, **kw),
        hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, **kw),
    )


def test_template_layouts_read_as_transformers_reads_them(smollm2, tmp_path):
    real = open(os.path.join(smollm2, "chat_template.jinja")).read()
    # transformers 5 layout: chat_template.jinja only
    d = _copy_tokenizer(smollm2, str(tmp_path / "jinja_only"), config_template=None)
    ours, theirs = _render_both(d)
    assert ours == theirs and "system\nYou are terse.<|im_end|>" in ours
    assert Tokenizer(d).chat_template_names == ["default"]
    # the file wins over a tokenizer_config.json entry
    d = _copy_tokenizer(smollm2, str(tmp_path / "both"), config_template="CONFIG {{ messages[0].content }}")
    assert _render_both(d)[0] == _render_both(d)[1] == ours
    # tokenizer_config.json only, as a string
    d = _copy_tokenizer(smollm2, str(tmp_path / "config_str"), template_file=False, config_template=real)
    assert _render_both(d) == (ours, ours)
    # tokenizer_config.json only, as a named list; "tool_use" is chosen when tools are given
    named = [{"name": "default", "template": real}, {"name": "tool_use", "template": TEMPLATES["tools_tojson"]}]
    d = _copy_tokenizer(smollm2, str(tmp_path / "config_list"), template_file=False, config_template=named)
    assert _render_both(d) == (ours, ours)
    tool_ours, tool_theirs = _render_both(d, tools=TOOLS)
    assert tool_ours == tool_theirs and tool_ours.startswith("<tools>")
    assert Tokenizer(d).chat_template_names == ["default", "tool_use"]
    assert Tokenizer(d).get_chat_template("tool_use") == TEMPLATES["tools_tojson"]
    # transformers 5 layout for several templates: additional_chat_templates/NAME.jinja
    d = _copy_tokenizer(smollm2, str(tmp_path / "extra_dir"), config_template=None)
    os.makedirs(os.path.join(d, "additional_chat_templates"))
    with open(os.path.join(d, "additional_chat_templates", "tool_use.jinja"), "w") as f:
        f.write(TEMPLATES["tools_tojson"])
    assert _render_both(d) == (ours, ours)
    assert _render_both(d, tools=TOOLS) == (tool_ours, tool_ours)
    # named templates without a default: an error that lists the names (transformers refuses too)
    d = _copy_tokenizer(
        smollm2,
        str(tmp_path / "no_default"),
        template_file=False,
        config_template=[{"name": "chatml", "template": real}],
    )
    with pytest.raises(TokenizerError, match=r"none named 'default'; name one of \['chatml'\]"):
        Tokenizer(d).apply_chat_template(CONVERSATION)
    assert Tokenizer(d).apply_chat_template(CONVERSATION, chat_template="chatml", tokenize=False) == ours


def test_eos_lists_and_legacy_special_tokens(tmp_path, smollm2):
    d = _copy_tokenizer(smollm2, str(tmp_path / "eos"))
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    gen["eos_token_id"] = [2, 0]
    json.dump(gen, open(os.path.join(d, "generation_config.json"), "w"))
    assert Tokenizer(d).eos_token_ids == [2, 0]
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg.pop("eos_token")
    cfg["bos_token"] = {"content": "<|im_start|>", "__type": "AddedToken"}  # the older AddedToken-dict form
    json.dump(cfg, open(cfg_path, "w"))
    with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)  # read only because the config lists no added tokens
    tok = Tokenizer(d)
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|im_start|>" and tok.eos_token_ids == [2, 0]


def test_added_tokens_from_the_config_join_the_vocabulary(tmp_path, smollm2):
    import transformers

    d = _copy_tokenizer(smollm2, str(tmp_path / "added"))
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["added_tokens_decoder"] = {
        "49152": {
            "content": "<tool_call>",
            "special": False,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        },
        "49153": {
            "content": "<|reserved|>",
            "special": True,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        },
    }
    json.dump(cfg, open(cfg_path, "w"))
    ours, hf = Tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    text = 'call <tool_call>{"a": 1}<|reserved|> done<|im_end|>'
    assert ours.token_to_id("<tool_call>") == hf.convert_tokens_to_ids("<tool_call>") == 49152
    assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_char_tokenizer_parity(tiny_ckpt):
    import transformers

    ours, hf = Tokenizer(tiny_ckpt), transformers.AutoTokenizer.from_pretrained(tiny_ckpt)
    for text in ("Add 7 to 12 until above 50.\n12+7=19\n#### 54", "<|im_start|>user\nhi<|im_end|>\n"):
        assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "Add 7 to 12 until above 50."}]
    assert ours.apply_chat_template(msgs, tokenize=False) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


# ---- check_tokenizer ----------------------------------------------------------------------------------------------


def test_check_tokenizer_errors_name_the_path_and_what_is_missing(tmp_path, smollm2):
    assert check_tokenizer(smollm2, need_chat_template=True).has_chat_template
    with pytest.raises(TokenizerError, match="no such directory"):
        check_tokenizer(str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match=f"{empty}: no tokenizer.json"):
        check_tokenizer(str(empty))
    d = _copy_tokenizer(smollm2, str(tmp_path / "no_template"), template_file=False, config_template=None)
    check_tokenizer(d, need_chat_template=False)  # plain-text prompts need no template
    with pytest.raises(
        TokenizerError,
        match=r"no_template: the tokenizer has no chat template \(neither "
        r"chat_template\.jinja nor a chat_template entry",
    ):
        check_tokenizer(d, need_chat_template=True)
    d = _copy_tokenizer(smollm2, str(tmp_path / "bad_syntax"), config_template=None)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m.content }}\n{% if %}")
    with pytest.raises(TokenizerError, match=r"bad_syntax/chat_template\.jinja: syntax error at line 2"):
        check_tokenizer(d, need_chat_template=True)
    d = _copy_tokenizer(smollm2, str(tmp_path / "raises"), config_template=None)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{{ raise_exception('system message required') }}")
    with pytest.raises(TokenizerError, match="cannot render a one-message conversation: .*system message required"):
        check_tokenizer(d, need_chat_template=True)
    d = _copy_tokenizer(smollm2, str(tmp_path / "bad_json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(TokenizerError, match=r"bad_json/tokenizer_config\.json: not valid JSON"):
        check_tokenizer(d)
    d = _copy_tokenizer(smollm2, str(tmp_path / "no_eos"))
    for name, key in (
        ("generation_config.json", "eos_token_id"),
        ("config.json", "eos_token_id"),
        ("tokenizer_config.json", "eos_token"),
    ):
        p = os.path.join(d, name)
        cfg = json.load(open(p))
        cfg.pop(key, None)
        json.dump(cfg, open(p, "w"))
    with pytest.raises(TokenizerError, match="no end-of-sequence token"):
        check_tokenizer(d)
    d = _copy_tokenizer(smollm2, str(tmp_path / "small_vocab"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["vocab_size"] = 1000
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(TokenizerError, match="49152 tokens but config.json vocab_size is 1000"):
        check_tokenizer(d)
