"""Reference computations for tests of the trainer's forward paths: the slow, obviously correct way.

Every packed / padded / folded logprob path is checked against the same thing: the model run on one sequence at a
time with a plain log_softmax. Kept here, once, so that the reference itself cannot drift between test files.
"""

from __future__ import annotations

import torch


def load_model(path: str, attn: str = "sdpa") -> torch.nn.Module:
    """An HF checkpoint as an fp32 eval-mode transformers model with the given attention implementation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


def random_sequences(vocab: int, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Token sequences of the given lengths, ids in [2, vocab) (clear of pad 0 and EOS 1), deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g) for n in lens]


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, seqs: list[torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logp and entropy of each sequence run alone, concatenated: [N], [N] with N = total length.

    The alignment of areal_async/types.py: value t is about token t given the tokens before it, 0 at first tokens."""
    lps, ents = [], []
    for s in seqs:
        z = model(input_ids=s[None]).logits[0].float() / temperature  # [T, V]
        lsm = torch.log_softmax(z, -1)  # [T, V]
        lps.append(torch.cat([torch.zeros(1), lsm[:-1].gather(-1, s[1:, None]).squeeze(-1)]))
        ents.append(torch.cat([torch.zeros(1), -(lsm.exp() * lsm).sum(-1)[:-1]]))
    return torch.cat(lps), torch.cat(ents)
