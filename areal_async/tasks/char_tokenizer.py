"""A character-level tokenizer saved in Hugging Face format (tokenizer.json + tokenizer_config.json).

Why characters: the tiny default model must learn arithmetic from scratch in seconds on a CPU; one token per
character keeps the vocabulary tiny and the worked solutions' lengths honest. Saving it in HF format means the
embedded server, transformers and SGLang all load it the same way, chat template included.
"""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_CHARS = "0123456789+-*/=()., ?:;!#'\"<>abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n_[]{}%&$@^|~`\\"

# ChatML, as Qwen models use; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(chars: str = DEFAULT_CHARS):
    """Return a `tokenizers.Tokenizer`: special tokens first (pad=0, eos=1), then one id per character.

    It is a byte-level BPE with no merges, the same pipeline as Qwen's tokenizers, so loaders that rebuild a
    Qwen2 tokenizer from vocab and merges (transformers 5 does for model_type qwen2) get the same ids back.
    Every character must be ASCII: one byte, one symbol.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for ch in dict.fromkeys(chars):
        if ord(ch) > 127:
            raise ValueError(f"char tokenizer supports ASCII only, got {ch!r}")
        sym = _BYTE_TO_UNICODE[ord(ch)]
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table used by byte-level BPE."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_UNICODE = _bytes_to_unicode()


def save_char_tokenizer(path: str, chars: str = DEFAULT_CHARS) -> int:
    """Write tokenizer files into `path`; returns the vocabulary size."""
    os.makedirs(path, exist_ok=True)
    tok = build_char_tokenizer(chars)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "bos_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}, f, indent=2)
    return tok.get_vocab_size()
