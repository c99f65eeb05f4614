"""The batch-metadata kernel's typed operand bundles (`kernels.uniform_metadata`): the sequences, the
request table, the outputs, the step's shape and the in-flight first tokens, so that a launch passes five
named operands instead of twenty-three positional ones. Triton unpacks a NamedTuple argument into its
fields with the same specialisation as loose ones. The fields keep the order of the kernel's former flat
arguments (the 32-bit ones paired as before), so the compiled kernel is the same."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hylo.ops.batch_metadata.reference import InFlight


class Sequences(NamedTuple):
    """Each sequence b's prefix length `prefix[b]`, request-table row `rows[b]` and new-token count
    `lengths[b]` (`[B]` each, contiguous; `lengths` is `prefix`, unread, unless the launch has
    HAS_LENGTHS)."""

    prefix: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, prefix: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor | None) -> Sequences:
        return cls(prefix, rows, lengths if lengths is not None else prefix)


class RequestTable(NamedTuple):
    """The request table `slots [rows, context]` int32: the cache slot of row r's token at position p at
    `slots + r·row_stride + p`."""

    slots: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, req_to_token: torch.Tensor) -> RequestTable:
        """`req_to_token`, whose last stride must be 1."""
        return cls(req_to_token, req_to_token.stride(0))


class Metadata(NamedTuple):
    """The outputs, int64, contiguous, of `reference.uniform_metadata`'s sizes: `positions`, `token_rows`
    and `new_slots [B·width]` (sequence b's token t at b·width + t), `state_slots [B]`, `completed_pools
    [B·candidates]` (its candidate c at b·candidates + c) and `pool_table [B, pool_columns]`."""

    positions: torch.Tensor
    token_rows: torch.Tensor
    new_slots: torch.Tensor
    state_slots: torch.Tensor
    completed_pools: torch.Tensor
    pool_table: torch.Tensor

    @classmethod
    def of(cls, out: dict[str, torch.Tensor]) -> Metadata:
        """The tensors of `out` by name (the package's `FIELDS`)."""
        return cls(*(out[name] for name in cls._fields))


class StepShape(NamedTuple):
    """`width` tokens a sequence, `kpool` tokens a pool, `candidates` = ⌈width / kpool⌉ pools a
    sequence's tokens may complete, `pool_columns` = the table's width // kpool, and the `filler_row`
    (0, unread, unless the launch has HAS_FILLER)."""

    width: int
    kpool: int
    candidates: int
    pool_columns: int
    filler_row: int

    @classmethod
    def of(cls, width: int, kpool: int, req_to_token: torch.Tensor, filler_row: int | None) -> StepShape:
        filler = filler_row if filler_row is not None else 0
        return cls(width, kpool, -(-width // kpool), req_to_token.shape[1] // kpool, filler)


class FirstTokens(NamedTuple):
    """An `InFlight` as the kernel reads it (see it for the meaning): sequence b's resolved first token
    goes to `ids + b·ids_stride`. Without IN_FLIGHT every tensor is a placeholder, unread, and the ints
    are 0; without AFTER so are `after` and `last_committed`."""

    first: torch.Tensor
    marker: int
    last_sampled: torch.Tensor
    ids: torch.Tensor
    ids_stride: int
    after: torch.Tensor
    last_committed: torch.Tensor

    @classmethod
    def of(cls, in_flight: InFlight | None, placeholder: torch.Tensor) -> FirstTokens:
        """`in_flight`'s tensors, `placeholder` for those it lacks (all of them without one)."""
        f = in_flight
        if f is None:
            return cls(placeholder, 0, placeholder, placeholder, 0, placeholder, placeholder)
        if f.after is None:
            return cls(f.first, f.marker, f.last_sampled, f.ids, f.ids.stride(0), placeholder, placeholder)
        return cls(f.first, f.marker, f.last_sampled, f.ids, f.ids.stride(0), f.after, f.last_committed)
