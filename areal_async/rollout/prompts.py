"""A sample's prompt as token ids, the same way for rollouts and for held-out evals. No torch here."""

from __future__ import annotations

from areal_async.tokenizer import Tokenizer
from areal_async.types import Sample


def uses_chat_template(sample: Sample, apply_chat_template: bool) -> bool:
    return sample.messages is not None or apply_chat_template


def prompt_ids(tokenizer: Tokenizer, sample: Sample, apply_chat_template: bool = False) -> list[int]:
    """Chat samples (`sample.messages`) and every sample under `data.apply_chat_template` are rendered with the
    tokenizer's chat template, ending with the assistant's generation prompt; plain prompts are encoded as they are."""
    if uses_chat_template(sample, apply_chat_template):
        messages = sample.messages or [{"role": "user", "content": sample.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids
    return tokenizer.encode(sample.prompt)
