"""Trainer side: torchrun workers (FSDP2) and the pieces they are built from.

    worker.py         one torchrun rank: the RPC service the controller drives (`TrainerGroup` in client.py)
    engine.py         TrainEngine: the decoupled-PPO step and the weights-out methods, every one a collective
    dist.py           process group, device, `any_rank` / `agree` (failures agreed on before any collective)
    fsdp.py           loading an HF causal LM into FSDP2 shards, grad-norm clipping, RNG state
    shard.py          a TrainBatch checked and turned into this rank's tensors
    layouts.py        packed / padded rows / shared prefix: one object per layout with pack() and forward()
    logprobs.py       per-token logprobs of packed or padded-row micro-batches
    shared_prefix.py  each prompt group's common prefix run once
    lm_head.py        the LM head applied in chunks (logits never whole), with its own backward
    losses.py         decoupled PPO, GSPO, KL and entropy terms, the loss's stat keys and their summary
    stats.py          the step's stat sums, reduced across ranks once, and the step summary
    advantages.py     reward shaping, group baselines, batch normalisation
    packing.py        micro-batching and rank balancing on lengths alone (torch-free; the controller uses it)
    publish.py        the policy as an HF directory (disk weight sync)
    broadcast.py      the policy over a weight-update process group (SGLang's distributed update)
    checkpoint.py     resumable checkpoints (DCP)
    client.py         the controller's handle on all ranks (torch-free)
    errors.py         error kinds that keep their type across RPC (torch-free)
    messages.py       RPC messages types.py does not hold (torch-free)

Importing the package does no work.
"""
