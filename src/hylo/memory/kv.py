"""Per-token caches of the DSA layers: MLA latents and the indexer's keys, gate scores and pooled keys."""

from __future__ import annotations

import torch

from hylo.config import ModelConfig


class TokenCache:
    """Token-slot pools shared by every sequence; a sequence's positions map to slots through its
    `req_to_token` row (built by the caller).

    Invariants: slot `s` of one pool belongs to at most one sequence position at a time; a k-pool's
    `index_kpool` tokens occupy an aligned run of slots (`first_slot % index_kpool == 0`), so the
    pooled key of the pool starting at slot `s` lives at `pooled_key[:, s // index_kpool]`. Callers
    guarantee this by allocating slots in pages whose size is a multiple of `index_kpool`.

    `indexer_dtype` is the pooled keys' dtype (default: `dtype`); with `torch.float8_e4m3fn` each
    pooled key row has a power-of-two fp32 scale in `pooled_key_scale` (None otherwise) and the
    indexer scores in FP8.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        indexer_dtype: torch.dtype | None = None,
    ):
        if num_slots % config.index_kpool:
            raise ValueError(
                f"num_slots ({num_slots}) must be a multiple of index_kpool ({config.index_kpool})"
            )
        self.num_slots = num_slots
        self.kpool = config.index_kpool
        n_dsa, n_idx, d = len(config.dsa_layers), len(config.indexer_layers), config.index_head_dim
        self.latent = torch.zeros(n_dsa, num_slots, config.kv_lora_rank, dtype=dtype, device=device)
        self.index_key = torch.zeros(n_idx, num_slots, d, dtype=dtype, device=device)
        self.index_gate = torch.zeros(n_idx, num_slots, d, dtype=dtype, device=device)
        n_pools = num_slots // config.index_kpool
        indexer_dtype = indexer_dtype or dtype
        self.pooled_key = torch.zeros(n_idx, n_pools, d, dtype=indexer_dtype, device=device)
        self.pooled_key_scale = (
            torch.ones(n_idx, n_pools, dtype=torch.float32, device=device)
            if indexer_dtype == torch.float8_e4m3fn
            else None
        )
        self.dsa_index = {layer: i for i, layer in enumerate(config.dsa_layers)}
        self.indexer_index = {layer: i for i, layer in enumerate(config.indexer_layers)}

    @staticmethod
    def bytes_per_token(
        config: ModelConfig, dtype: torch.dtype, indexer_dtype: torch.dtype | None = None
    ) -> float:
        """Cache bytes one token costs across all DSA layers (pooled keys and their FP8 scales
        amortised over the pool)."""
        n_idx, d, kpool = len(config.indexer_layers), config.index_head_dim, config.index_kpool
        size = torch.finfo(dtype).bits / 8
        pooled_row = d * torch.finfo(indexer_dtype or dtype).bits / 8
        if indexer_dtype == torch.float8_e4m3fn:
            pooled_row += 4  # the row's fp32 scale
        per_token = (len(config.dsa_layers) * config.kv_lora_rank + n_idx * 2 * d) * size
        return per_token + n_idx * pooled_row / kpool

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Every layer's entries of slots `src .. src + n - 1` into `dst ..` (both runs aligned to whole
        k-pools, so the pooled keys of those pools are copied with them)."""
        kpool = self.kpool
        assert src % kpool == 0 and dst % kpool == 0 and n % kpool == 0
        for pool in (self.latent, self.index_key, self.index_gate):
            pool[:, dst : dst + n] = pool[:, src : src + n]
        pools = (src // kpool, dst // kpool, n // kpool)
        for pool in (self.pooled_key, self.pooled_key_scale):
            if pool is not None:
                pool[:, pools[1] : pools[1] + pools[2]] = pool[:, pools[0] : pools[0] + pools[2]]
