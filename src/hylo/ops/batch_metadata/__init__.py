"""A fixed-shape batch's metadata from the request table (`uniform_metadata`): the torch reference and
the Triton kernel behind one dispatcher.

CUDA calls the kernel takes (`refusal` is None) go to `kernels.uniform_metadata`, one launch in place
of the reference's ~25 (and of `reference.resolve_in_flight`'s few, with `in_flight`: a step's first
tokens and in-flight commits); everything else to `reference.uniform_metadata`. With `out` (tensors of a
captured batch) the results are written there: by the kernel directly, after the reference by copies.
"""

from __future__ import annotations

import torch

from hylo.ops.batch_metadata import reference
from hylo.ops.batch_metadata.reference import InFlight
from hylo.ops.dispatch import use_kernel

__all__ = ["FIELDS", "InFlight", "output_sizes", "refusal", "uniform_metadata"]

INDEX_DTYPES = (torch.int32, torch.int64)
# what `uniform_metadata` returns, by name: the `ForwardBatch` fields of the same names
FIELDS = ("positions", "token_rows", "new_slots", "state_slots", "completed_pools", "pool_table")


def output_sizes(sequences: int, width: int, req_to_token: torch.Tensor, kpool: int) -> dict[str, tuple]:
    """The shape of each tensor `uniform_metadata` returns (the `FIELDS`, in their order)."""
    tokens = sequences * width
    return {
        "positions": (tokens,),
        "token_rows": (tokens,),
        "new_slots": (tokens,),
        "state_slots": (sequences,),
        "completed_pools": (sequences * -(-width // kpool),),
        "pool_table": (sequences, req_to_token.shape[1] // kpool),
    }


def refusal(
    prefix: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
    kpool: int,
    lengths: torch.Tensor | None,
    out: dict[str, torch.Tensor] | None,
    in_flight: InFlight | None = None,
) -> str | None:
    """Why `kernels.uniform_metadata` cannot take this call, or None."""
    if in_flight is not None:
        f, sequences = in_flight, prefix.shape[0]
        per_sequence = {"first": f.first, "ids": f.ids, "after": f.after}
        for name, t in per_sequence.items():
            if t is not None and (t.dim() != 1 or t.shape[0] != sequences or t.device != prefix.device):
                return (
                    f"in_flight.{name} must be a 1-D tensor of one entry per sequence on the table's device"
                )
        for name, t in (("last_sampled", f.last_sampled), ("last_committed", f.last_committed)):
            if t is not None and (t.dim() != 1 or t.stride(0) != 1 or t.device != prefix.device):
                return f"in_flight.{name} must be a contiguous 1-D tensor (an entry a row) on the device"
        if (f.after is None) != (f.last_committed is None):
            return "in_flight.after and in_flight.last_committed come together"
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        return "req_to_token must be a 2-D int32 table with a unit last stride"
    for name, t in (("prefix", prefix), ("rows", rows), ("lengths", lengths)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != prefix.shape[0] or t.dtype not in INDEX_DTYPES:
            return f"{name} must be a 1-D int32 or int64 tensor of one entry per sequence"
        if t.shape[0] > 1 and t.stride(0) != 1:
            return f"{name} must be contiguous"
        if t.device != req_to_token.device:
            return f"{name} must be on the table's device"
    if width < 1 or kpool < 1:
        return f"width and kpool must be >= 1, got {width} and {kpool}"
    if out is not None:
        for name, size in output_sizes(prefix.shape[0], width, req_to_token, kpool).items():
            t = out[name]
            if (
                t.shape != size
                or t.dtype != torch.int64
                or not t.is_contiguous()
                or t.device != prefix.device
            ):
                return (
                    f"out[{name!r}] must be a contiguous int64 tensor of shape {size} on the table's device"
                )
    return None


def uniform_metadata(
    prefix: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
    kpool: int,
    filler_row: int | None = None,
    lengths: torch.Tensor | None = None,
    out: dict[str, torch.Tensor] | None = None,
    in_flight: InFlight | None = None,
) -> dict[str, torch.Tensor]:
    """`reference.uniform_metadata` (see it for the contract); with `out`, written into its tensors
    (every name the reference returns) and `out` returned. With `in_flight`, at the prefix lengths
    `reference.resolve_in_flight` gives, which also writes the sequences' first tokens (in the same
    launch on CUDA). Safe in a CUDA graph: no host value read."""
    if lengths is not None and filler_row is None:
        raise ValueError("lengths: padding tokens write the filler row, and none was given")
    if use_kernel(
        "batch_metadata.uniform_metadata",
        req_to_token,
        lambda: refusal(prefix, rows, width, req_to_token, kpool, lengths, out, in_flight),
    ):
        from hylo.ops.batch_metadata import kernels

        if out is None:
            sizes = output_sizes(prefix.shape[0], width, req_to_token, kpool)
            out = {
                name: torch.empty(size, dtype=torch.long, device=prefix.device)
                for name, size in sizes.items()
            }
        return kernels.uniform_metadata(
            prefix, rows, width, req_to_token, kpool, filler_row, lengths, out, in_flight
        )
    if in_flight is not None:
        prefix = reference.resolve_in_flight(prefix, rows, in_flight)
    meta = reference.uniform_metadata(prefix, rows, width, req_to_token, kpool, filler_row, lengths)
    if out is None:
        return meta
    for name, value in meta.items():
        out[name].copy_(value)
    return out
