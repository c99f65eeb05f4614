"""What the Triton draft-attention kernels accept, as one verifier per op that names the first reason
it refuses a call (None: the kernel takes it). Pure torch, so the dispatcher can ask without Triton.
The device type is the dispatcher's business: under TRITON_INTERPRET=1 the kernels run on CPU tensors."""

from __future__ import annotations

import torch

from hylo.ops.draft_attention.reference import ContextTable, ContextTokens, DraftBlock, KeyTransform, KVCache

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# B * (Hq / Hkv) query rows are one tile's M dimension; past 128 the fp32 accumulator spills.
MAX_QUERY_ROWS = 128
MAX_HEAD_DIM = 256


def _norm_rope_refusal(dtype: torch.dtype, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """What the RMSNorm + rotary kernels (`kernels._norm_rope`) need of the rows' dtype, width and the
    rotary tables, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"unsupported dtype {dtype} (supported: {KERNEL_DTYPES})"
    if head_dim & (head_dim - 1) or head_dim < 2:
        return f"head_dim must be a power of two, got {head_dim}"
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape[-1] * 2 != head_dim:
        return "cos and sin must be fp32 [max_pos, d // 2]"
    return None


def _unit_last_stride(named: dict[str, torch.Tensor]) -> str | None:
    for name, t in named.items():
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} needs a contiguous last dimension (stride {t.stride(-1)})"
    return None


def paged_draft_attention_refusal(
    block: DraftBlock, cache: KVCache, table: ContextTable, window: int | None
) -> str | None:
    """Why `kernels.paged_draft_attention` cannot take this call, or None."""
    q, k_block, v_block, k_cache, v_cache = block.q, block.k, block.v, cache.k, cache.v
    req_to_token, rows, ctx_lens = table.req_to_token, table.rows, table.ctx_lens
    tensors = {"q": q, "k_block": k_block, "v_block": v_block, "k_cache": k_cache, "v_cache": v_cache}
    if len({t.device for t in (*tensors.values(), req_to_token, rows, ctx_lens)}) > 1:
        return "all tensors must be on one device"
    if q.dim() != 4 or k_block.dim() != 4 or k_cache.dim() != 3:
        return "q, k_block need [R, B, H, d] and k_cache [num_slots, Hkv, d]"
    if q.dtype not in KERNEL_DTYPES:
        return f"unsupported dtype {q.dtype} (supported: {KERNEL_DTYPES})"
    if any(t.dtype != q.dtype for t in tensors.values()):
        return "q, k_block, v_block, k_cache and v_cache must share one dtype"
    num_requests, block_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be a power of two in [16, {MAX_HEAD_DIM}], got {head_dim}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    if block_size * (num_heads // num_kv_heads) > MAX_QUERY_ROWS:
        return f"block size x GQA group = {block_size * num_heads // num_kv_heads} > {MAX_QUERY_ROWS} rows"
    if k_block.shape != v_block.shape or k_block.shape != (num_requests, block_size, num_kv_heads, head_dim):
        return "k_block and v_block must be [R, B, Hkv, d] with q's R, B, d"
    if v_cache.shape != k_cache.shape or k_cache.shape[2] != head_dim:
        return "k_cache and v_cache must be [num_slots, Hkv, d] with q's d"
    if req_to_token.dtype not in (torch.int32, torch.int64) or req_to_token.dim() != 2:
        return "req_to_token must be a 2-D int32/int64 table"
    if rows.shape != (num_requests,) or ctx_lens.shape != (num_requests,):
        return "rows and ctx_lens must be [R]"
    if rows.dtype not in (torch.int32, torch.int64) or ctx_lens.dtype not in (torch.int32, torch.int64):
        return "rows and ctx_lens must be int32/int64"
    if window is not None and window < 1:
        return f"window must be >= 1, got {window}"
    return _unit_last_stride({**tensors, "req_to_token": req_to_token, "rows": rows, "ctx_lens": ctx_lens})


def store_context_kv_refusal(tokens: ContextTokens, keys: KeyTransform, cache: KVCache) -> str | None:
    """Why `kernels.store_context_kv` cannot take this call, or None."""
    k_raw, v, positions, slots = tokens.k_raw, tokens.v, tokens.positions, tokens.slots
    k_norm_weight, cos, sin, k_cache, v_cache = keys.k_norm_weight, keys.cos, keys.sin, cache.k, cache.v
    tensors = {"k_raw": k_raw, "v": v, "k_norm_weight": k_norm_weight, "cos": cos, "sin": sin}
    tensors.update(k_cache=k_cache, v_cache=v_cache)
    if len({t.device for t in (*tensors.values(), positions, slots)}) > 1:
        return "all tensors must be on one device"
    if k_raw.dim() != 4 or v.shape != k_raw.shape:
        return "k_raw and v must both be [Lyr, N, Hkv, d]"
    num_layers, num_tokens, _, head_dim = k_raw.shape
    # RMSNorm multiplies in the promoted dtype; the kernel rounds the product to k_raw's dtype.
    if k_norm_weight.dtype != k_raw.dtype or k_norm_weight.shape != (num_layers, head_dim):
        return "k_norm_weight must be [Lyr, d] in k_raw's dtype"
    if (reason := _norm_rope_refusal(k_raw.dtype, head_dim, cos, sin)) is not None:
        return reason
    if k_cache.dim() != 4 or k_cache.shape[0] != num_layers or k_cache.shape[2:] != k_raw.shape[2:]:
        return "k_cache must be [Lyr, num_slots, Hkv, d] with k_raw's Lyr, Hkv, d"
    if v_cache.shape != k_cache.shape:
        return "v_cache must have k_cache's shape"
    if positions.shape != (num_tokens,) or slots.shape != (num_tokens,):
        return "positions and slots must be [N]"
    if positions.dtype not in (torch.int32, torch.int64) or slots.dtype not in (torch.int32, torch.int64):
        return "positions and slots must be int32/int64"
    return _unit_last_stride({**tensors, "positions": positions, "slots": slots})


def normed_rotated_refusal(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> str | None:
    """Why `kernels.normed_rotated` cannot take this call, or None."""
    tensors = {"x": x, "weight": weight, "cos": cos, "sin": sin}
    if len({t.device for t in (*tensors.values(), positions)}) > 1:
        return "all tensors must be on one device"
    if x.dim() != 3:
        return "x must be [N, H, d]"
    head_dim = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (head_dim,):
        return "weight must be [d] in x's dtype"
    if (reason := _norm_rope_refusal(x.dtype, head_dim, cos, sin)) is not None:
        return reason
    if positions.shape != (x.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        return "positions must be int32/int64 [N]"
    if x.shape[0] > 1 and positions.stride(0) != 1:
        return "positions must be contiguous"
    return _unit_last_stride(tensors)
