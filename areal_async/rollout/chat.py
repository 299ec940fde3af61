"""Chat rendering for conversations whose earlier tokens must never change (multi-turn workflows, the agent proxy).

Token in, token out: a multi-turn trajectory is the previous turn's ids + the generated ids + the ids of what came
next, never a re-rendering of the whole conversation (re-tokenising the model's text can give other ids than it
sampled, and then the behaviour logprobs no longer belong to the tokens trained). `ChatTokens` renders only what
is appended. No torch here.
"""

from __future__ import annotations

from areal_async.tokenizer import Tokenizer

_STAND_IN = [{"role": "user", "content": "areal-stand-in"}, {"role": "assistant", "content": "areal-stand-in"}]
_MARK = "\x00AREAL-TURN-END\x00"


class ChatTokens:
    """Token ids for appending messages to a conversation whose earlier tokens must not change.

    Why a stand-in conversation: chat templates render whole conversations, and many emit different text for a
    message depending on what precedes it (the first system block, tool-response grouping). Rendering
    `stand_in + new` and subtracting the rendering of `stand_in` gives the text the template would put after a
    finished assistant turn, which is what a new user or tool message looks like mid-conversation.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        closed = tokenizer.apply_chat_template(
            _STAND_IN[:1] + [{"role": "assistant", "content": _MARK}], add_generation_prompt=False, tokenize=False
        )
        assert isinstance(closed, str)
        if _MARK not in closed:
            raise ValueError("the chat template drops assistant content; cannot find its end-of-turn text")
        self.turn_end = closed.split(_MARK, 1)[1]  # e.g. "<|im_end|>\n"

    def delta_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of `messages` rendered as the continuation of a conversation that ended with an assistant turn."""
        base = self.tok.apply_chat_template(_STAND_IN, add_generation_prompt=False, tokenize=False)
        full = self.tok.apply_chat_template(
            _STAND_IN + list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert isinstance(base, str) and isinstance(full, str)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders earlier turns differently once more messages follow; "
                "appending feedback tokens is not possible with it"
            )
        return self.tok.encode(full[len(base) :])

    def close_turn_ids(self, output_ids: list[int]) -> list[int]:
        """The end-of-turn tokens the template puts after an assistant message, minus what the model generated.

        If the model stopped on a token whose text starts the template's end-of-turn text (ChatML's <|im_end|>),
        only the rest (the newline) is added; if it stopped for length or on another EOS, all of it is.
        """
        if output_ids:
            last = self.tok.decode([output_ids[-1]], skip_special_tokens=False)
            if last and self.turn_end.startswith(last):
                rest = self.turn_end[len(last) :]
                return self.tok.encode(rest) if rest else []
        return self.tok.encode(self.turn_end)
