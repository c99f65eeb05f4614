"""Run a fixed set of prompts to completion on one model, with caches private to the call.

This is the plain loop behind `hylo generate` until the continuous-batching engine exists: one
prefill forward over all prompts (mixed lengths), then one decode forward per step over every
unfinished sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.models.glm5_next import Glm5NextForCausalLM


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the top-p mass."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of `logits [B, V]`."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(
    model: Glm5NextForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: Sampling,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Generated token ids per prompt (stop token included when one ends the sequence).

    `on_tokens(i, ids)` is called with each new token of prompt i as soon as it is sampled.
    """
    config = model.config
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    kpool = config.index_kpool
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if max(p) >= config.vocab_size or min(p) < 0:
            raise ValueError(f"prompt {i} has a token id outside [0, {config.vocab_size})")
    capacity = [-(-(len(p) + params.max_new_tokens) // kpool) * kpool for p in prompts]
    starts = [sum(capacity[:i]) for i in range(len(prompts))]
    tokens = TokenCache(config, sum(capacity), dtype, device)
    states = StateCache(config, len(prompts), dtype, device)
    slots = [list(range(s, s + c)) for s, c in zip(starts, capacity, strict=True)]
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)

    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    chunks = [SequenceChunk(list(p), 0, slots[i], i) for i, p in enumerate(prompts)]
    while active:
        logits = model(ForwardBatch.build(chunks, tokens, states, kpool))
        next_ids = sample(logits, params, generator).tolist()
        still = []
        for i, token in zip(active, next_ids, strict=True):
            outputs[i].append(token)
            if on_tokens is not None:
                on_tokens(i, [token])
            if token not in params.stop_token_ids and len(outputs[i]) < params.max_new_tokens:
                still.append(i)
        active = still
        chunks = [
            SequenceChunk([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, slots[i], i)
            for i in active
        ]
    return outputs
