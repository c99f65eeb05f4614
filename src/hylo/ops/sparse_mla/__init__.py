"""Sparse MLA attention ops. Only the torch reference exists so far."""

from hylo.ops.sparse_mla.reference import sparse_mla

__all__ = ["sparse_mla"]
