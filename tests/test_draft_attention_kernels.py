"""DFlash draft attention: the Triton kernels against the torch references, the references against
the model (`DraftAttention` in hylo.models.dflash), and the dispatcher's choices.

Without a GPU the kernels run under TRITON_INTERPRET=1 at small shapes on fp32 and fp16 tiles (the
interpreter's bf16 `tl.dot` is wrong, DESIGN §8); bf16, real shapes and CUDA-graph replay run on a
GPU (the `cuda` tests; `benchmarks/kernels/draft_attention.py` repeats them before timing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreter import run_compiled_for_hopper, use_interpreter

CUDA = torch.cuda.is_available()
if not CUDA:
    use_interpreter()  # before the kernels are decorated

from hylo.models.dflash import DFlashConfig, DraftAttention, RotaryTable  # noqa: E402
from hylo.ops import draft_attention as ops  # noqa: E402
from hylo.ops.draft_attention import kernels  # noqa: E402
from hylo.ops.draft_attention.reference import (  # noqa: E402
    ContextTable,
    ContextTokens,
    DraftBlock,
    KeyTransform,
    KVCache,
    normed_rotated_reference,
    paged_draft_attention_reference,
    rotary_tables,
    store_context_kv_reference,
)

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

DEV = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="bf16, real shapes and CUDA graphs run on the GPU")
# Tolerances against an fp64 reference. Scores, softmax and accumulation are fp32 in both, so fp32
# tiles differ by fp32 rounding under the interpreter (TF32 dots on the GPU: ~1e-3 relative). fp16
# tiles add the fp16 rounding of the probabilities fed to the P·V dot and of the output (2^-11 each,
# ~5e-4 relative), so ~1e-3; values and outputs are O(1), so the same figure serves as atol.
TOL = {
    torch.float32: {"rtol": 5e-3, "atol": 5e-3} if CUDA else {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}
BLOCK_N = 16  # interpreter tile: the context lengths below are not multiples of it
CONTEXT_LENS = [0, 5, 37, 70]  # an empty context, one partial tile, several tiles
TABLE_ROWS = [5, 0, 3, 2]  # requests sit in scattered rows of a 6-row table


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def paged_case(ctx_lens, block, num_kv_heads, group, head_dim, dtype, seed, max_len=96):
    """Random q / block K/V and a paged cache whose slots are a random permutation (no two positions
    share a slot, consecutive positions are scattered), with table rows `TABLE_ROWS`."""
    g = gen(seed)
    num_requests, num_slots = len(ctx_lens), 6 * max_len + 11
    q = torch.randn(num_requests, block, num_kv_heads * group, head_dim, generator=g)
    k_block, v_block = (torch.randn(num_requests, block, num_kv_heads, head_dim, generator=g) for _ in "kv")
    k_cache, v_cache = (torch.randn(num_slots, num_kv_heads, head_dim, generator=g) for _ in "kv")
    table = torch.randperm(num_slots, generator=g)[: 6 * max_len].view(6, max_len).int()
    rows = torch.tensor(TABLE_ROWS[:num_requests])
    lens = torch.tensor(ctx_lens)
    floats = [t.to(DEV, dtype) for t in (q, k_block, v_block, k_cache, v_cache)]
    return (*floats, table.to(DEV), rows.to(DEV), lens.to(DEV))


def paged(case):
    """The typed operands (block, cache, table) of a `paged_case`, sharing its tensors."""
    return DraftBlock(*case[:3]), KVCache(*case[3:5]), ContextTable(*case[5:])


def reference64(case, scale, window):
    """The reference on fp64 copies of the float inputs: the target every kernel result is held to."""
    floats, ints = case[:5], case[5:]
    return paged_draft_attention_reference(*paged([*(t.double() for t in floats), *ints]), scale, window)


# ---------------------------------------------------------------- paged draft attention


@pytest.mark.parametrize(
    ("block", "group", "window", "dtype", "num_splits", "merge_block_d"),
    [
        (1, 1, None, torch.float32, 1, None),  # one row per request: M padded to 16
        (4, 4, None, torch.float32, 3, 16),  # GQA, context split in three, some splits empty; d in 2 slices
        (8, 4, None, torch.float16, 2, None),
        (8, 1, 20, torch.float32, 3, None),  # window shorter than two contexts: leading tiles skipped
        (4, 4, 20, torch.float16, 1, 16),
        (8, 4, 3, torch.float32, 2, None),  # window shorter than the block: block keys masked too
        (4, 1, None, torch.float32, None, None),  # default split count
    ],
)
def test_paged_draft_attention_kernel_matches_reference(
    block, group, window, dtype, num_splits, merge_block_d
):
    case = paged_case(CONTEXT_LENS, block, 2, group, 32, dtype, seed=block * 10 + group)
    scale = 32**-0.5
    expected = reference64(case, scale, window)
    out = kernels.paged_draft_attention(
        *paged(case), scale, window, num_splits=num_splits, block_n=BLOCK_N, merge_block_d=merge_block_d
    )
    assert out.shape == case[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


def test_paged_draft_attention_int64_tables_and_lengths():
    q, kb, vb, kc, vc, table, rows, lens = paged_case([9, 0, 40], 4, 1, 4, 16, torch.float32, seed=7)
    expected = reference64((q, kb, vb, kc, vc, table, rows, lens), 0.3, 30)
    out = kernels.paged_draft_attention(
        *paged((q, kb, vb, kc, vc, table.long(), rows, lens.int())), 0.3, 30, num_splits=2, block_n=BLOCK_N
    )
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])


def test_paged_reference_matches_draft_attention_forward():
    """The reference, fed the model's own q / k / v scattered into pages, reproduces
    `DraftAttention.forward` on the dense padded context, full and sliding."""
    c = DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=4, mask_token_id=0,
        target_layer_ids=(0,), layer_types=("sliding_attention",), sliding_window=6,
    )  # fmt: skip
    torch.manual_seed(0)
    lens = torch.tensor([3, 0, 11])
    num_requests, block, longest = len(lens), c.block_size, int(lens.max())
    x = torch.randn(num_requests, block, c.hidden_size)
    ctx = torch.randn(num_requests, longest, c.hidden_size)
    positions = lens[:, None] + torch.arange(block)
    ctx_pos = torch.arange(longest).expand(num_requests, -1)
    ctx_valid = ctx_pos < lens[:, None]
    table = torch.randperm(64)[:48].view(4, 12).int()
    rows = torch.tensor([2, 0, 3])
    for sliding in (False, True):
        attn = DraftAttention(c, sliding).eval()
        with torch.no_grad():
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
            ctx_k, ctx_v = attn.key_value(ctx, ctx_pos)
            k_cache = torch.zeros(64, c.num_key_value_heads, c.head_dim)
            v_cache = torch.zeros_like(k_cache)
            for r, length in enumerate(lens.tolist()):
                slots = table[rows[r], :length].long()
                k_cache[slots], v_cache[slots] = ctx_k[r, :length], ctx_v[r, :length]
            q, k_block, v_block = attn.project(x, positions)
            out = paged_draft_attention_reference(
                DraftBlock(q, k_block, v_block), KVCache(k_cache, v_cache), ContextTable(table, rows, lens),
                c.head_dim**-0.5, attn.window,
            )  # fmt: skip
            expected = attn(x, positions, ctx_k, ctx_v, ctx_pos, ctx_valid)
            torch.testing.assert_close(attn.o_proj(out.flatten(-2)), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- context K/V store


def store_case(num_layers, num_tokens, num_kv_heads, head_dim, dtype, seed, num_slots=40, max_pos=64):
    g = gen(seed)
    k_raw, v = (torch.randn(num_layers, num_tokens, num_kv_heads, head_dim, generator=g) for _ in "kv")
    weight = 1 + 0.3 * torch.randn(num_layers, head_dim, generator=g)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[[1, num_tokens - 2]] = -1  # rejected tokens: their cache rows stay as they were
    k_cache, v_cache = (torch.randn(num_layers, num_slots, num_kv_heads, head_dim, generator=g) for _ in "kv")
    cos, sin = rotary_tables(max_pos, head_dim, 10000.0, DEV)
    floats = [t.to(DEV, dtype) for t in (k_raw, v, weight)]
    caches = [t.to(DEV, dtype) for t in (k_cache, v_cache)]
    return (*floats, 1e-6, cos, sin, positions.to(DEV), slots.to(DEV), *caches)


def stored(args, k_cache=None, v_cache=None):
    """The typed operands (tokens, keys, cache) of a `store_case`, sharing its tensors; the cache
    `k_cache`, `v_cache` instead of its own where given."""
    k_raw, v, weight, eps, cos, sin, positions, slots = args[:8]
    cache = KVCache(args[8], args[9]) if k_cache is None else KVCache(k_cache, v_cache)
    return ContextTokens(k_raw, v, positions, slots), KeyTransform(weight, eps, cos, sin), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [2, 3])  # 3: a padded head tile
def test_store_context_kv_kernel_matches_reference(dtype, num_kv_heads):
    args = store_case(2, 9, num_kv_heads, 32, dtype, seed=num_kv_heads)
    slots, k_before, v_before = args[7], args[8].clone(), args[9].clone()
    expected_k, expected_v = k_before.clone(), v_before.clone()
    store_context_kv_reference(*stored(args, expected_k, expected_v))
    kernels.store_context_kv(*stored(args))
    k_cache, v_cache = args[8], args[9]
    assert torch.equal(v_cache, expected_v)
    # Keys differ from torch by fp32 rounding of the mean square's summation order only: nothing in
    # fp32 and at most one step of a 16-bit dtype where that flips its rounding.
    torch.testing.assert_close(k_cache, expected_k, rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)
    untouched = torch.ones(k_cache.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache[:, untouched], k_before[:, untouched])
    assert untouched.sum() == k_cache.shape[1] - (slots >= 0).sum()


def test_store_reference_matches_draft_attention_key_value():
    """The table-driven store writes exactly what `DraftAttention.key_value` computes, layer by layer."""
    c = DFlashConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=4, mask_token_id=0,
        target_layer_ids=(0,), layer_types=("full_attention",) * 2, sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(1)
    layers = [DraftAttention(c, sliding=False).eval() for _ in range(c.num_hidden_layers)]
    ctx = torch.randn(6, c.hidden_size)
    positions = torch.tensor([0, 1, 2, 17, 30, 31])
    slots = torch.tensor([4, -1, 9, 0, 12, 3])
    shape = (c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    with torch.no_grad():
        for attn in layers:
            attn.k_norm.weight.uniform_(0.5, 1.5)
        heads = (2, c.num_key_value_heads, c.head_dim)
        k_raw, v = torch.stack([(ctx @ attn.kv_weight.T).unflatten(-1, heads) for attn in layers]).unbind(2)
        weight = torch.stack([attn.k_norm.weight for attn in layers])
        cos, sin = rotary_tables(32, c.head_dim, c.rope_theta)
        store_context_kv_reference(
            ContextTokens(k_raw, v, positions, slots),
            KeyTransform(weight, c.rms_norm_eps, cos, sin),
            KVCache(k_cache, v_cache),
        )
        kept = slots >= 0
        for layer, attn in enumerate(layers):
            keys, values = attn.key_value(ctx, positions)
            torch.testing.assert_close(k_cache[layer, slots[kept]], keys[kept])
            torch.testing.assert_close(v_cache[layer, slots[kept]], values[kept], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads", [4, 3])  # 3: a padded head tile
def test_normed_rotated_kernel_matches_reference(dtype, num_heads):
    """A draft block's queries or keys normed and rotated in one launch: the reference's values (the
    same tolerance as the store's keys: the mean square's summation order alone)."""
    args = store_case(1, 11, num_heads, 32, dtype, seed=10 + num_heads)
    x, weight, eps, cos, sin, positions = args[0][0], args[2][0], *args[3:7]
    expected = normed_rotated_reference(x, weight, eps, cos, sin, positions)
    got = kernels.normed_rotated(x, weight, eps, cos, sin, positions)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)


def test_draft_queries_and_keys_through_the_table_equal_rope_of_the_norm():
    """`DraftAttention.project` / `key_value` with the rotary table built (the fused op) give what the
    norm and `rope` give without it."""
    c = DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=4, mask_token_id=0,
        target_layer_ids=(0,), layer_types=("full_attention",), sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(2)
    attn = DraftAttention(c, sliding=False).eval()
    x = torch.randn(3, 4, c.hidden_size)
    positions = torch.tensor([[0, 1, 2, 3], [17, 18, 19, 20], [5, 6, 7, 8]])
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
        plain = *attn.project(x, positions), *attn.key_value(x, positions)
        attn.rotary = RotaryTable(*rotary_tables(32, c.head_dim, c.rope_theta))
        fused = *attn.project(x, positions), *attn.key_value(x, positions)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- dispatch and refusals


def on_cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def test_dispatch_sends_cpu_calls_to_the_references():
    case = on_cpu(paged_case([3, 20], 4, 2, 2, 16, torch.float32, seed=3))
    out = ops.paged_draft_attention(*paged(case), 0.25, 8)
    torch.testing.assert_close(out, paged_draft_attention_reference(*paged(case), 0.25, 8), rtol=0, atol=0)
    args = on_cpu(store_case(2, 5, 2, 16, torch.float32, seed=4))
    expected_k, expected_v = args[8].clone(), args[9].clone()
    store_context_kv_reference(*stored(args, expected_k, expected_v))
    ops.store_context_kv(*stored(args))
    assert torch.equal(args[8], expected_k) and torch.equal(args[9], expected_v)


@cuda_only
def test_dispatch_sends_cuda_calls_to_the_kernels(monkeypatch):
    case = paged_case([3, 20], 4, 2, 2, 16, torch.float32, seed=3)
    args = store_case(2, 5, 2, 16, torch.float32, seed=4)
    calls = []
    for name in ("paged_draft_attention", "store_context_kv"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a)
        )
    ops.paged_draft_attention(*paged(case), 0.25, 8)
    ops.store_context_kv(*stored(args))
    assert calls == ["paged_draft_attention", "store_context_kv"]


def test_refusals_name_the_reason():
    case = paged_case([3], 4, 2, 2, 16, torch.float32, seed=5)
    q, kb, vb, kc, vc, table, rows, lens = case
    assert ops.paged_draft_attention_refusal(*paged(case), None) is None
    odd = paged_case([3], 4, 2, 2, 24, torch.float32, seed=5)
    assert "power of two" in ops.paged_draft_attention_refusal(*paged(odd), None)
    assert "share one dtype" in ops.paged_draft_attention_refusal(*paged((q.half(), *case[1:])), None)
    assert "window" in ops.paged_draft_attention_refusal(*paged(case), 0)
    wide = paged_case([3], 16, 1, 16, 16, torch.float32, seed=5)  # 16 rows x 16 heads
    assert "rows" in ops.paged_draft_attention_refusal(*paged(wide), None)
    strided = kc.transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in ops.paged_draft_attention_refusal(
        *paged((q, kb, vb, strided, vc, table, rows, lens)), None
    )
    with pytest.raises(ValueError, match="power of two"):
        kernels.paged_draft_attention(*paged(odd), 0.25)
    # the kernels step the index vectors by one element: every other entry of a longer one is refused
    two = paged_case([3, 20], 4, 2, 2, 16, torch.float32, seed=5)
    every_other = torch.stack([two[6], two[6]], 1)[:, 0]
    assert "rows needs a contiguous" in ops.paged_draft_attention_refusal(
        *paged((*two[:6], every_other, two[7])), None
    )
    args = store_case(1, 4, 2, 16, torch.float32, seed=6)
    assert ops.store_context_kv_refusal(*stored(args)) is None
    half_weight = (*args[:2], args[2].half(), *args[3:])
    assert "k_norm_weight" in ops.store_context_kv_refusal(*stored(half_weight))
    strided_slots = (*args[:7], torch.stack([args[7], args[7]], 1)[:, 0], *args[8:])
    assert "slots needs a contiguous" in ops.store_context_kv_refusal(*stored(strided_slots))


# ---------------------------------------------------------------- sm_90 compile (no GPU needed)

# The real launches at the real shape in bf16 (`code_size.compiled_launches` compiles each with the operands
# the launch functions pass, typed bundles included, instead of running it); prints each one's spilled bytes.
_HOPPER_COMPILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")!r})
import torch
from code_size import compiled_launches
from hylo.ops.draft_attention import kernels as K
from hylo.ops.draft_attention.reference import ContextTable, ContextTokens, DraftBlock, KeyTransform, KVCache

bf16, block, heads, kv_heads, d, layers, n = torch.bfloat16, 8, 32, 8, 128, 5, 16
q = torch.zeros(2, block, heads, d, dtype=bf16)
draft = DraftBlock(q, *(torch.zeros(2, block, kv_heads, d, dtype=bf16) for _ in "kv"))
cache = KVCache(*(torch.zeros(1024, kv_heads, d, dtype=bf16) for _ in "kv"))
table = ContextTable(torch.zeros(2, 512, dtype=torch.int32), torch.arange(2), torch.tensor([100, 300]))
cos, sin = (torch.zeros(1024, d // 2) for _ in "cs")
raw = (torch.zeros(layers, n, kv_heads, d, dtype=bf16) for _ in "kv")
tokens = ContextTokens(*raw, torch.arange(n), torch.arange(n))
keys = KeyTransform(torch.ones(layers, d, dtype=bf16), 1e-6, cos, sin)
layer_caches = KVCache(*(torch.zeros(layers, 64, kv_heads, d, dtype=bf16) for _ in "kv"))
x = torch.zeros(n, heads, d, dtype=bf16)

def launch_all():
    K.paged_draft_attention(draft, cache, table, 0.1, 2048)
    K.store_context_kv(tokens, keys, layer_caches)
    K.normed_rotated(x, torch.ones(d, dtype=bf16), 1e-6, cos, sin, torch.arange(n))

print(" ".join(f"{{launch['kernel']}}:{{launch['stack_bytes']}}" for launch in compiled_launches(launch_all)))
"""


def test_kernels_compile_for_hopper_without_spills():
    """bf16 at the real shape (B = 8, Hq 32 over Hkv 8, d = 128), which the interpreter cannot check:
    the four kernels compile for sm_90 and keep everything in registers at the default tiles."""
    names = (
        "_context_split_kernel",
        "_block_merge_kernel",
        "_store_context_kv_kernel",
        "_normed_rotated_kernel",
    )
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == [f"{name}:0" for name in names]


# ---------------------------------------------------------------- GPU only


@cuda_only
@pytest.mark.parametrize("window", [None, 2048])
def test_paged_draft_attention_bf16_real_shape(window):
    case = paged_case([0, 1000, 4099], 8, 8, 4, 128, torch.bfloat16, seed=8, max_len=4200)
    expected = reference64(case, 128**-0.5, window)
    out = kernels.paged_draft_attention(*paged(case), 128**-0.5, window)
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-2


@cuda_only
def test_paged_draft_attention_cuda_graph_replays_new_lengths():
    """Captured once, the launch pair stays right when the lengths and the table change on the device."""
    case = list(paged_case([10, 300, 77], 8, 2, 4, 64, torch.float16, seed=9, max_len=400))
    kernels.paged_draft_attention(*paged(case), 0.125, 100)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_draft_attention(*paged(case), 0.125, 100)
    for lens, seed in (([0, 399, 64], 10), ([250, 1, 300], 11)):
        fresh = paged_case(lens, 8, 2, 4, 64, torch.float16, seed=seed, max_len=400)
        for static, new in zip(case, fresh, strict=True):
            static.copy_(new)
        graph.replay()
        torch.testing.assert_close(out.double(), reference64(case, 0.125, 100), **TOL[torch.float16])
