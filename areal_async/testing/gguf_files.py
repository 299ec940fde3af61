"""Small real GGUF files for tests, cut from a real one: the first layers of a model with its full metadata.

Why cut a real file rather than write one from scratch: the tokenizer metadata (vocabulary, merges, token types,
special ids, chat template) and the quantized tensor layouts are then exactly what llama.cpp's converter wrote, so
tests of "any .gguf file" exercise transformers' GGUF loader on real data, at a few seconds per conversion instead
of the full model's.
"""

from __future__ import annotations

import re

_BLOCK = re.compile(r"blk\.(\d+)\.")


def shrink_gguf(
    src: str,
    dst: str,
    num_layers: int = 2,
    num_tokens: int | None = None,
    *,
    chat_template: str | None = None,
    drop_chat_template: bool = False,
) -> str:
    """Write `dst`: `src` with only its first `num_layers` transformer blocks and (when given) its first
    `num_tokens` vocabulary entries (the BPE merges among them, the matching embedding rows), quantized data
    copied as is, and optionally another chat template (or none). Returns `dst`.

    Cutting the vocabulary is what makes the file quick to load: transformers parses the GGUF metadata in Python,
    token by token, three times per conversion. The special tokens of SmolLM2 come first in its vocabulary and the
    byte alphabet right after, so a few thousand tokens still encode any text."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if num_layers < 1 or num_layers > reader.get_field(block_key).contents():
        raise ValueError(f"num_layers must be in [1, {reader.get_field(block_key).contents()}]")
    tokens = reader.get_field(gguf.Keys.Tokenizer.LIST).contents()
    n_tok = len(tokens) if num_tokens is None else num_tokens
    if not 1 <= n_tok <= len(tokens):
        raise ValueError(f"num_tokens must be in [1, {len(tokens)}]")
    kept_vocab = set(tokens[:n_tok])
    per_token = {gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.TOKEN_TYPE, gguf.Keys.Tokenizer.SCORES}
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        name = field.name
        if name == gguf.Keys.General.ARCHITECTURE or name.startswith("GGUF."):
            continue  # the writer adds these itself
        if name.startswith(gguf.Keys.Tokenizer.CHAT_TEMPLATE) and (chat_template is not None or drop_chat_template):
            continue
        value = field.contents()
        if name == block_key:
            value = num_layers
        elif name == gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch):
            value = n_tok
        elif name in per_token:
            value = value[:n_tok]
        elif name == gguf.Keys.Tokenizer.MERGES:
            value = [m for m in value if _merge_kept(m, kept_vocab)]
        elif name.startswith("tokenizer.ggml.") and name.endswith("_token_id") and value >= n_tok:
            raise ValueError(f"{name}={value} is cut off by num_tokens={n_tok}")
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    kept = []
    for t in reader.tensors:
        if (m := _BLOCK.match(t.name)) and int(m.group(1)) >= num_layers:
            continue
        data = t.data[:n_tok] if t.name in ("token_embd.weight", "output.weight") else t.data  # rows = tokens
        kept.append((t, data))
    for t, data in kept:
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data in kept:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def _merge_kept(merge: str, vocab: set[str]) -> bool:
    left, sep, right = merge.partition(" ")
    return bool(sep) and left in vocab and right in vocab and left + right in vocab
