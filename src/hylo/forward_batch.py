"""Metadata of one model forward over a batch of sequences, built once on the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache


@dataclass
class SequenceChunk:
    """One sequence's share of a forward: `token_ids` are appended after `prefix_len` cached tokens.

    `token_slots[p]` is the token-cache slot of position `p` for every `p < prefix_len + len(token_ids)`;
    `state_slot` is the sequence's KDA state slot.
    """

    token_ids: Sequence[int]
    prefix_len: int
    token_slots: Sequence[int]
    state_slot: int


@dataclass
class ForwardBatch:
    """Tensors every layer of one forward shares. Tokens are packed sequence after sequence.

    Invariants: built from CPU-side lengths only (no device read); `pad_index[b, t]` is the packed
    index of sequence b's t-th new token where `pad_valid[b, t]`; `pool_table[b, p]` is the pooled-key
    slot of sequence b's p-th complete pool after this forward (-1 past its last complete pool);
    `completed_pools` lists the pooled-key slots of pools whose last token is in this forward.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its sequence
    token_seq: torch.Tensor  # [T] sequence index of each token
    new_slots: torch.Tensor  # [T] token-cache slot each token writes
    req_to_token: torch.Tensor  # [B, max_len] token-cache slot of every position
    state_slots: torch.Tensor  # [B]
    pad_index: torch.Tensor  # [B, max_new]
    pad_valid: torch.Tensor  # [B, max_new]
    pool_table: torch.Tensor  # [B, max_pools]
    completed_pools: torch.Tensor  # [P]
    logits_index: torch.Tensor  # packed indices whose logits the forward returns
    extend_lens: list[int]
    prefix_lens: list[int]
    tokens: TokenCache
    states: StateCache

    @classmethod
    def build(
        cls,
        chunks: Sequence[SequenceChunk],
        tokens: TokenCache,
        states: StateCache,
        kpool: int,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """Pack `chunks`; logits are returned for every token if `all_logits`, else each sequence's last."""
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        device = tokens.latent.device
        extend = [len(c.token_ids) for c in chunks]
        prefix = [c.prefix_len for c in chunks]
        totals = [p + e for p, e in zip(prefix, extend, strict=True)]
        for i, (c, e, total) in enumerate(zip(chunks, extend, totals, strict=True)):
            if e == 0:
                raise ValueError(f"sequence {i} has no new tokens")
            if len(c.token_slots) < total:
                raise ValueError(
                    f"sequence {i}: token_slots covers {len(c.token_slots)} of {total} positions"
                )
        batch_size, max_len, max_new = len(chunks), max(totals), max(extend)
        req_to_token = torch.full((batch_size, max_len), -1, dtype=torch.long)
        for b, (c, total) in enumerate(zip(chunks, totals, strict=True)):
            req_to_token[b, :total] = torch.as_tensor(c.token_slots[:total], dtype=torch.long)
        _check_pool_alignment(req_to_token, totals, kpool)

        lens = torch.tensor(extend)
        starts = torch.cumsum(lens, 0) - lens
        token_seq = torch.repeat_interleave(torch.arange(batch_size), lens)
        packed = torch.arange(int(lens.sum()))
        positions = torch.tensor(prefix)[token_seq] + packed - starts[token_seq]
        steps = torch.arange(max_new)
        pad_valid = steps[None, :] < lens[:, None]
        pad_index = torch.where(pad_valid, starts[:, None] + steps[None, :], 0)

        max_pools = max(t // kpool for t in totals)
        pool_ids = torch.arange(max_pools)
        pool_table = (
            req_to_token[:, : max_pools * kpool : kpool] // kpool if max_pools else req_to_token[:, :0]
        )
        pool_table = torch.where(pool_ids[None] < torch.tensor(totals)[:, None] // kpool, pool_table, -1)
        completed = [
            req_to_token[b, p * kpool].item() // kpool
            for b in range(batch_size)
            for p in range(prefix[b] // kpool, totals[b] // kpool)
        ]
        logits_index = packed if all_logits else starts + lens - 1

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            input_ids=dev(torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)),
            positions=dev(positions),
            token_seq=dev(token_seq),
            new_slots=dev(req_to_token[token_seq, positions]),
            req_to_token=dev(req_to_token),
            state_slots=dev(torch.tensor([c.state_slot for c in chunks], dtype=torch.long)),
            pad_index=dev(pad_index),
            pad_valid=dev(pad_valid),
            pool_table=dev(pool_table),
            completed_pools=dev(torch.tensor(completed, dtype=torch.long)),
            logits_index=dev(logits_index),
            extend_lens=extend,
            prefix_lens=prefix,
            tokens=tokens,
            states=states,
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` packed -> `[B, max_new, ...]`, zeros where a sequence has no token."""
        mask = self.pad_valid.view(*self.pad_valid.shape, *([1] * (packed.dim() - 1)))
        return packed[self.pad_index] * mask

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Inverse of `pad`: `[B, max_new, ...]` -> `[T, ...]`."""
        return padded[self.pad_valid]


def _check_pool_alignment(req_to_token: torch.Tensor, totals: list[int], kpool: int) -> None:
    """Every k-pool must sit in an aligned run of `kpool` slots (see `TokenCache`)."""
    for b, total in enumerate(totals):
        full = total - total % kpool
        row = req_to_token[b, :full].view(-1, kpool)
        first = row[:, :1]
        if bool((first % kpool).any()) or bool((row != first + torch.arange(kpool)).any()):
            raise ValueError(
                f"sequence {b}: the token slots of each k-pool ({kpool} tokens) must be one aligned run"
            )
        tail = req_to_token[b, full:total]
        if tail.numel() and bool((tail != tail[:1] + torch.arange(tail.numel())).any() or tail[0] % kpool):
            raise ValueError(
                f"sequence {b}: the incomplete k-pool's slots must start an aligned contiguous run"
            )
