"""DSA k-pool indexer ops. Only the torch reference exists so far."""

from hylo.ops.indexer.reference import compress_pools, select_rows

__all__ = ["compress_pools", "select_rows"]
