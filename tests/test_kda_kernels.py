"""KDA Triton kernels against their torch references, under the Triton interpreter on the CPU.

Shapes are small (2 heads, d = 16/32); inputs are fp32 or fp16 (the interpreter's `tl.dot` on bf16 is
not trustworthy). Errors are FLA's measure, rms(out - ref) / rms(ref): ≤ 5e-3 (FLA's bound) for fp16,
≤ 3e-6 for fp32, where both sides are exact up to rounding. Pool slots the step does not own are
checked to be bit-for-bit untouched. The references are checked against per-token
formulas written the way FLA's `naive.py` writes them.
"""

from __future__ import annotations

from pathlib import Path

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hylo.ops.kda import (  # noqa: E402
    KDAInputs,
    KDAParams,
    KDASlots,
    OutputNorm,
    chunk,
    recurrent,
    reference,
    rmsnorm,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # masked-out scores overflow in numpy
    pytest.mark.usefixtures("strict_launch_arguments"),
]


RATIO = 3e-6  # fp32
RATIO_HALF = 5e-3


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


class Problem:
    """Random layer parameters and slot pools for H heads of size d (fresh draws per seed)."""

    def __init__(
        self, seed: int, h: int = 2, d: int = 16, width: int = 4, slots: int = 7, dtype=torch.float32
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.h, self.d, self.dtype = h, d, dtype
        hd = h * d
        self.conv_weight = self.randn(3 * hd, width, dtype=torch.float32) * 0.5
        self.dt_bias = self.randn(hd, dtype=torch.float32)
        self.a_log = self.randn(h, dtype=torch.float32) * 0.5
        self.conv_pool = self.randn(slots, width - 1, 3 * hd)
        self.state_pool = self.randn(slots, h, d, d, dtype=torch.float32) * 0.3

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(dtype or self.dtype)

    def inputs(self, *lead) -> list[torch.Tensor]:
        hd = self.h * self.d
        return [self.randn(*lead, hd) for _ in range(4)] + [self.randn(*lead, self.h)]

    def params(self, lower_bound: float | None = -5.0) -> KDAParams:
        return KDAParams(self.conv_weight, self.dt_bias, self.a_log, lower_bound)

    def pools(self):
        return self.conv_pool.clone(), self.state_pool.clone()


def check_pools(conv, state, conv_ref, state_ref, touched, ratio=RATIO):
    untouched = [s for s in range(conv.shape[0]) if s not in set(touched)]
    assert torch.equal(conv[untouched], conv_ref[untouched])
    assert torch.equal(state[untouched], state_ref[untouched])
    assert torch.equal(conv[touched], conv_ref[touched])
    assert err(state[touched], state_ref[touched]) < ratio


# The interpreter runs the first launch's (chunk, head, sub-tile) programs one by one, so a case costs about
# its chunks × its heads × its sub-tiles (3·64/conv_rows + d/gate_cols); each case keeps only the sequences
# its tiling needs. Every case has a sequence ending inside a later chunk (rows masked past its end, taps
# reading back across the chunk boundary). The window paths do not depend on the tiling (the row block at a
# sequence's start reads and rewrites it whatever its rows): sequences shorter than the window (W - 1 = 3),
# whose new window mixes old rows and new inputs, are in the default-tile and 32-row cases. A full chunk
# after the first runs the row-block code of the first chunk's later blocks (same masks, another base): the
# 32-row case holds one. Two heads wherever the tiling orders the programs differently (the default
# head-first order at d = 16, chunk order, 32-row head-first at d = 32); the fp16 case, on the default
# tiling of the first, takes one.
@pytest.mark.parametrize(
    ("lens", "dtype", "h", "d", "seed", "tuning"),
    [
        # default tiles, fp32, one gate block: length 1 (two old window rows) and 70 (6 rows in chunk 1)
        ([70, 1], torch.float32, 2, 16, 0, {}),
        # default tiles, fp16, d = 32: a length of W - 1, one token past a chunk (a sequence of exactly one
        # chunk: test_prefill_of_a_padded_batch_from_device_offsets)
        ([3, 65], torch.float16, 1, 32, 1, {}),
        # 8-row conv blocks, four gate column blocks (one writes β), chunk order: 65 fills all eight row
        # blocks of chunk 0, then one live row in chunk 1 (a ragged first block reading back a chunk); no
        # short sequence (the 8-row block at a sequence start reads and rewrites the window as the others)
        ([65], torch.float32, 2, 16, 2, dict(conv_rows=8, gate_cols=4, conv_warps=4, conv_order="chunk")),
        # 32-row conv blocks, two gate blocks of d = 32, one warp: three chunks (a full one after the first,
        # state carried twice), three rows in the last
        ([2, 131], torch.float32, 2, 32, 3, dict(conv_rows=32, gate_cols=16, conv_warps=1)),
        # the recurrence in two 16-column value tiles of a 32-wide head (a rank's few heads may take narrow
        # tiles for more programs): each tile carries its own columns of the state across two chunks
        ([70], torch.float32, 1, 32, 5, dict(block_v=16)),
    ],
)
def test_prefill_matches_reference(lens, dtype, h, d, seed, tuning):
    """Varlen prefill into random slots: short sequences whose conv reads the old window, chunk-spanning
    ones, and (d = 32) Gram sums over more than one column block; the first launch in its default tiles
    and in narrower ones (8-row conv blocks, so a chunk's first block holds only 8 rows, and the gate in
    four column blocks of which one also writes β, launched chunk after chunk), and 32-row conv blocks with
    one warp."""
    check_prefill(Problem(seed, h=h, d=d, dtype=dtype), lens, tuning)


def test_few_heads_take_narrow_value_tiles():
    """The recurrence keeps 64 programs where it can: 64 heads (TP1) 64 columns a program, a TP4 rank's
    16 heads of one sequence 32, a TP8 rank's 8 heads 16 (measured fastest there), 8 heads of 4
    sequences 64."""
    cases = ((64, 1), (16, 1), (8, 1), (8, 4), (1, 1))
    assert [chunk.value_tile(h, n, 128) for h, n in cases] == [64, 32, 16, 64, 16]


def check_prefill(p: Problem, lens: list[int], tuning: dict) -> None:
    """The chunked prefill of sequences of `lens` tokens into random slots against the reference: the
    output and the pools, within the dtype's ratio."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = KDAInputs(*p.inputs(cu[-1]))
    slots = torch.randperm(7, generator=p.gen)[: len(lens)]
    conv_ref, state_ref = p.pools()
    o_ref = reference.prefill(x, p.params(), KDASlots(conv_ref, state_ref, slots), None, cu)
    conv, state = p.pools()
    cu_dev = torch.tensor(cu, dtype=torch.int32)
    o = chunk.prefill(x, p.params(), KDASlots(conv, state, slots), cu_dev, cu, **tuning)
    ratio = RATIO if p.dtype == torch.float32 else RATIO_HALF
    assert o.dtype == p.dtype and err(o, o_ref) < ratio
    check_pools(conv, state, conv_ref, state_ref, slots.tolist(), ratio)


class SaturatedGates(Problem):
    """Every gate at its lower bound (f far above dt_bias's scale): a chunk's gate sums span the widest range
    the Gram's split factors must hold (2^±58 at 16-row sub-blocks)."""

    def inputs(self, *lead) -> list[torch.Tensor]:
        q, k, v, f, b = super().inputs(*lead)
        return [q, k, v, torch.full_like(f, 30.0), b]


def test_prefill_with_every_gate_at_its_bound():
    check_prefill(SaturatedGates(5, h=1, d=16), [130], {})


@pytest.mark.parametrize(("d", "products"), [(32, "tf32"), (64, "bf16")])
def test_narrow_heads_take_fp32_output_products_in_bf16(d, products, monkeypatch):
    """bf16 w/u products 32 columns wide end in an illegal address on the H100 (RESULTS S50-2): below 64-wide
    heads the in-chunk launch takes them with fp32 operands; from 64 on, bf16 as measured fastest."""
    launches, kernel = [], chunk._intra_kernel

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(chunk, "_intra_kernel", Recorded())
    p = Problem(5, h=1, d=d, dtype=torch.bfloat16)
    slots = KDASlots(*p.pools(), torch.tensor([0]))
    chunk.prefill(KDAInputs(*p.inputs(5)), p.params(), slots, torch.tensor([0, 5], dtype=torch.int32), [0, 5])
    assert [launch["OUT_PREC"] for launch in launches] == [products]


def test_recurrence_locates_sequences_past_one_tile_of_offsets(monkeypatch):
    """The recurrence sums the chunks of the sequences before its own `SEQ_TILE` offsets at a time (no
    constexpr follows the sequence count, so one compiled kernel serves every batch): with 2-offset
    tiles, the third and fourth sequences' first chunks come from two loop steps, one of them past a
    two-chunk sequence; a batch of one sequence launches it with the same constexprs."""
    monkeypatch.setattr(chunk, "SEQ_TILE", 2)
    launches, kernel = [], chunk._recur_kernel

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(chunk, "_recur_kernel", Recorded())
    p = Problem(4, h=1, d=16, dtype=torch.float32)
    check_prefill(p, [3, 70, 2, 5], {})
    one = KDASlots(*p.pools(), torch.tensor([0]))
    chunk.prefill(KDAInputs(*p.inputs(5)), p.params(), one, torch.tensor([0, 5], dtype=torch.int32), [0, 5])
    assert len(launches) == 2 and launches[0] == launches[1]


# Compiles `chunk.prep`'s launches for sm_90 as the GPU does (fast sigmoid on: the interpreter cannot run
# inline PTX) in a fresh interpreter-free process; prints whether the first is the conv and gate launch,
# whether its PTX holds the fast reciprocal, and how many fp32 divisions it keeps.
_HOPPER_COMPILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")!r})
import torch
from code_size import compiled_launches
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, chunk

h, d, n, bf16 = 4, 128, 64, torch.bfloat16
x = KDAInputs(*(torch.zeros(n, h * d, dtype=bf16) for _ in range(4)), torch.zeros(n, h, dtype=bf16))
params = KDAParams(torch.zeros(3 * h * d, 4), torch.zeros(h * d), torch.zeros(h), -5.0)
pools = torch.zeros(2, 3, 3 * h * d, dtype=bf16), torch.zeros(2, h, d, d)
slots, cu = KDASlots(*pools, torch.zeros(1, dtype=torch.int32)), torch.tensor([0, n], dtype=torch.int32)
first = compiled_launches(lambda: chunk.prep(x, params, slots, cu, [0, n]), with_ptx=True)[0]
ptx = first["ptx"]
print(first["kernel"] == "_conv_gate_kernel", "rcp.approx.ftz.f32" in ptx, ptx.count("div.full"))
"""


@pytest.fixture(scope="module")
def hopper_compiles() -> list[str]:
    """Stdout lines of `_HOPPER_COMPILE` (one) then `_DECODE_COMPILE` (two), run in one process: each such
    process starts torch and Triton anew, which takes seconds of the CPU's time."""
    return run_compiled_for_hopper(_HOPPER_COMPILE + _DECODE_COMPILE).splitlines()


def test_first_launch_fast_sigmoid_compiles_for_hopper(hopper_compiles):
    """The GPU-only fast sigmoid: ptxas takes its inline PTX, and the conv and gate tiles lose their fp32
    divisions (17 remain, for the per-row norms and β; with tl.sigmoid there these settings compile to 81)."""
    compiled, has_fast_reciprocal, divisions = hopper_compiles[0].split()
    assert compiled == has_fast_reciprocal == "True"
    assert int(divisions) < 32


@pytest.mark.parametrize(
    ("tuning", "message"),
    [
        (dict(conv_rows=2), "conv_rows must be 8, 16, 32 or 64 and at least 3"),
        (dict(gate_cols=6), "gate_cols"),
        (dict(conv_order="rows"), "conv_order must be 'chunk' or 'head'"),
    ],
)
def test_prefill_rejects_first_launch_tiles_it_cannot_take(tuning, message):
    p = Problem(7)
    slots = KDASlots(*p.pools(), torch.tensor([0]))
    with pytest.raises(ValueError, match=message):
        chunk.prefill(KDAInputs(*p.inputs(5)), p.params(), slots, torch.tensor([0, 5]), [0, 5], **tuning)


def decode_case(p: Problem, lower_bound, pools, batch: int = 3):
    """(inputs, params, slots) of a decode step of `batch` sequences over `pools` (conv, state): q, k and v
    views of one projection's rows, as the layer passes them."""
    qkvb = p.randn(batch, 3 * p.h * p.d + p.h)
    q, k, v, b = qkvb.split([p.h * p.d] * 3 + [p.h], dim=-1)
    x = KDAInputs(q, k, v, p.randn(batch, p.h * p.d), b)
    slots = KDASlots(*pools, torch.tensor([5, 0, 3][:batch]))
    return x, p.params(lower_bound), slots


@pytest.mark.parametrize(
    ("lower_bound", "d", "with_norm"), [(-5.0, 32, True), (None, 16, False), (None, 16, True)]
)
def test_decode_matches_reference(lower_bound, d, with_norm):
    """Decode's two launches (the step with the conv inside; the window step alone or with the gated
    output norm) against the reference: o to fp32 rounding (RATIO), windows bit for bit (copies)."""
    p = Problem(2 + d, d=d)
    x, params, ref_slots = decode_case(p, lower_bound, p.pools())
    norm = OutputNorm(p.randn(3, p.h, d), p.randn(d), 1e-5) if with_norm else None
    o_ref = reference.decode(x, params, ref_slots, norm)
    slots = KDASlots(*p.pools(), ref_slots.slot_ids)
    o = recurrent.decode(x, params, slots, norm, block_v=16)
    assert err(o, o_ref) < RATIO
    check_pools(slots.conv_pool, slots.state_pool, ref_slots.conv_pool, ref_slots.state_pool, [5, 0, 3])


def test_decode_is_two_launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    names, run = [], InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    p = Problem(1)
    x, params, slots = decode_case(p, -5.0, p.pools(), batch=1)
    recurrent.decode(x, params, slots, OutputNorm(p.randn(1, p.h, p.d), p.randn(p.d), 1e-5))
    assert names == ["_recurrent_kernel", "_gated_norm_kernel"]


@pytest.mark.parametrize(("t", "block_v", "block_k"), [(5, 8, 4), (13, 16, 16)])
def test_block_verify_and_commit_match_reference(t, block_v, block_k):
    """The block kernels (8-row blocks for T ≤ 8, else 16): verify leaves the pools untouched, the commit
    of any accepted prefix (0 and T included) from its replay operands gives the reference's state and
    window, and a request that accepts nothing keeps its slot bit-for-bit."""
    p = Problem(10 + t)
    x = KDAInputs(*p.inputs(4, t))
    slots = torch.tensor([6, 1, 2, 4])
    n_acc = torch.tensor([1, t, 0, 3])
    conv_ref, state_ref = p.pools()
    ref_slots = KDASlots(conv_ref, state_ref, slots)
    o_ref, cache_ref = reference.verify(x, p.params(), ref_slots)
    reference.commit(cache_ref, p.params(), ref_slots, n_acc)
    conv, state = p.pools()
    o, cache = recurrent.verify(x, p.params(), KDASlots(conv, state, slots), block_v=block_v)
    assert isinstance(cache, recurrent.ReplayCache) and err(o, o_ref) < RATIO
    assert torch.equal(conv, p.conv_pool) and torch.equal(state, p.state_pool)
    recurrent.commit(cache, p.params(), KDASlots(conv, state, slots), n_acc, block_k=block_k)
    check_pools(conv, state, conv_ref, state_ref, [6, 1, 4])
    assert torch.equal(conv[2], p.conv_pool[2]) and torch.equal(state[2], p.state_pool[2])


def test_block_commit_rejects_a_row_block_that_does_not_divide_the_head():
    p = Problem(6)
    cache = recurrent.ReplayCache(
        KDAInputs(*p.inputs(1, 2)), replay=p.randn(3, 1, 2, p.h, p.d, dtype=torch.float32)
    )
    slots = KDASlots(*p.pools(), torch.tensor([0]))
    with pytest.raises(ValueError, match="block_k=3 must divide the head size 16"):
        recurrent.block_commit(cache, p.params(), slots, torch.tensor([2]), block_k=3)


def test_block_verify_rejects_long_blocks():
    p = Problem(5)
    x = KDAInputs(*p.inputs(1, 17))
    qkv = torch.cat([x.q, x.k, x.v], -1)
    with pytest.raises(ValueError, match="T ≤ 16"):
        recurrent.block_verify(qkv, x, p.params(), KDASlots(*p.pools(), torch.tensor([0])))


def test_sequential_verify_steps_and_commits():
    """Verify saving every step's state (the per-step-state alternative): outputs, states and both of
    its commits (copy of a saved state, sequential replay) against the reference."""
    p = Problem(3)
    t = 4
    x = KDAInputs(*p.inputs(4, t))
    slots = torch.tensor([6, 1, 2, 4])
    n_acc = torch.tensor([1, 4, 0, 3])
    conv0, state0 = p.pools()
    steps_ref = torch.empty(4, t, p.h, p.d, p.d)
    o_ref, cache_ref = reference.verify(x, p.params(), KDASlots(conv0, state0, slots), step_states=steps_ref)
    conv, state = p.pools()
    steps = torch.full_like(steps_ref, float("nan"))
    o, cache = recurrent.verify(x, p.params(), KDASlots(conv, state, slots), step_states=steps)
    assert err(o, o_ref) < RATIO and err(steps, steps_ref) < RATIO
    assert torch.equal(conv, p.conv_pool) and torch.equal(state, p.state_pool)

    # the verified outputs are what decoding the tokens one by one gives
    conv_seq, state_seq = p.pools()
    seq_slots = KDASlots(conv_seq, state_seq, slots)
    outs = [reference.decode(x.rows((slice(None), i)), p.params(), seq_slots) for i in range(t)]
    assert err(o, torch.stack(outs, 1)) < RATIO

    reference.commit(cache_ref, p.params(), KDASlots(conv0, state0, slots), n_acc)
    replay_conv, replay_state = p.pools()
    recurrent.commit(cache, p.params(), KDASlots(replay_conv, replay_state, slots), n_acc, block_v=8)
    check_pools(replay_conv, replay_state, conv0, state0, [6, 1, 4])

    step_conv, step_state = p.pools()
    recurrent.commit_steps(cache, steps, KDASlots(step_conv, step_state, slots), n_acc)
    check_pools(step_conv, step_state, conv0, state0, [6, 1, 4])
    ref_conv, ref_state = p.pools()
    reference.commit_steps(cache_ref, steps_ref, KDASlots(ref_conv, ref_state, slots), n_acc)
    check_pools(ref_conv, ref_state, conv0, state0, [6, 1, 4])


def test_conv_steps_window_paths():
    p = Problem(4, dtype=torch.float16)
    inputs = KDAInputs(*p.inputs(3, 5))
    slots = torch.tensor([2, 0, 5])
    x = torch.cat([inputs.q, inputs.k, inputs.v], -1)
    y_ref, win_ref = reference.causal_conv(x, p.conv_pool[slots], p.conv_weight, torch.tensor([5, 2, 0]))
    conv = p.conv_pool.clone()
    y = recurrent.conv_steps(inputs, p.conv_weight, KDASlots(conv, p.state_pool, slots))
    assert err(y, y_ref) < RATIO_HALF and torch.equal(conv, p.conv_pool)
    recurrent.conv_steps(
        inputs, None, KDASlots(conv, p.state_pool, slots), write_y=False, write_window=True,
        n_keep=torch.tensor([5, 2, 0]),
    )  # fmt: skip
    assert torch.equal(conv[slots], win_ref)


def test_gated_norm_matches_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, 32, generator=gen).half()
    gate = torch.randn(9, 96, generator=gen).half()
    weight = torch.randn(32, generator=gen)
    y = rmsnorm.gated_rms_norm(x, OutputNorm(gate, weight, 1e-5))
    assert (
        y.dtype == x.dtype
        and err(y, reference.gated_rms_norm(x, gate.view(9, 3, 32), weight, 1e-5)) < RATIO_HALF
    )


# ---- the packed references against per-token formulas (FLA naive.py style) ---------------------------


def naive_sequence(q, k, v, f, b, conv_weight, dt_bias, a_log, window, state, lower_bound):
    """One sequence, token by token: conv over [window, x], FLA's naive lower-bound gate and recurrence."""
    h, d = state.shape[:2]
    x = torch.cat([window, torch.cat([q, k, v], -1)]).float()
    width = conv_weight.shape[1]
    y = F.silu(F.conv1d(x.T[None], conv_weight[:, None, :], groups=x.shape[1])[0].T).to(q.dtype).float()
    qq, kk, vv = (t.unflatten(-1, (h, d)) for t in y.chunk(3, -1))
    raw = f.float().unflatten(-1, (h, d)) + dt_bias.view(h, d)
    g = lower_bound * torch.sigmoid(a_log.exp()[:, None] * raw)
    s = state.clone()
    outs = []
    for t in range(q.shape[0]):
        qt = F.normalize(qq[t], dim=-1, eps=0) * d**-0.5
        kt = F.normalize(kk[t], dim=-1, eps=0)
        s = s * g[t].exp()[..., None]
        delta = vv[t] - torch.einsum("hk,hkv->hv", kt, s)
        s = s + torch.einsum("hk,hv->hkv", torch.sigmoid(b[t].float())[:, None] * kt, delta)
        outs.append(torch.einsum("hk,hkv->hv", qt, s))
    return torch.stack(outs), s, x[-(width - 1) :]


def test_reference_prefill_matches_naive_per_sequence():
    p = Problem(6)
    lens = [5, 1, 40]
    cu = [0, 5, 6, 46]
    x = KDAInputs(*p.inputs(cu[-1]))
    slots = torch.tensor([3, 6, 0])
    conv, state = p.pools()
    o = reference.prefill(x, p.params(), KDASlots(conv, state, slots), None, cu)
    for i, (s0, n) in enumerate(zip(cu[:-1], lens, strict=True)):
        o_n, s_n, w_n = naive_sequence(
            *x.rows(slice(s0, s0 + n)).tensors, p.conv_weight, p.dt_bias, p.a_log, p.conv_pool[slots[i]],
            p.state_pool[slots[i]], -5.0,
        )  # fmt: skip
        torch.testing.assert_close(o[s0 : s0 + n], o_n, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state[slots[i]], s_n, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conv[slots[i]], w_n)


# (64, 192): a sequence of exactly one chunk, then two chunks of padding alone
@pytest.mark.parametrize(("n", "width"), [(5, 128), (64, 192), (70, 128)])
def test_prefill_of_a_padded_batch_from_device_offsets(n, width):
    """One sequence of n tokens packed in `width` (a prefill graph's batch): given the device offsets
    alone, the kernel launches for the most chunks `width` tokens hold, and the chunks past the
    sequence's change nothing: outputs, window and state equal the call on the n tokens alone (the
    same kernels: exactly), padding outputs are zeros; so does the reference."""
    p = Problem(11 + n, d=16)
    # A chunk past the sequence is told apart in `_locate` and masked by its row count, the same for every
    # row block: the coarsest conv tiling (64 rows, a third of the default's programs) checks it.
    tiles = dict(conv_rows=64)
    x = KDAInputs(*p.inputs(width))
    slots = torch.tensor([3])
    cu_dev = torch.tensor([0, n], dtype=torch.int32)
    conv_ref, state_ref = p.pools()
    alone = KDASlots(conv_ref, state_ref, slots)
    o_ref = chunk.prefill(x.rows(slice(n)), p.params(), alone, cu_dev, [0, n], **tiles)
    conv, state = p.pools()
    o = chunk.prefill(x, p.params(), KDASlots(conv, state, slots), cu_dev, None, **tiles)
    assert o.shape[0] == width and torch.equal(o[:n], o_ref) and not o[n:].any()
    assert torch.equal(conv, conv_ref) and torch.equal(state, state_ref)
    conv_r, state_r = p.pools()
    o_r = reference.prefill(x, p.params(), KDASlots(conv_r, state_r, slots), cu_dev, None)
    conv_e, state_e = p.pools()
    o_e = reference.prefill(x.rows(slice(n)), p.params(), KDASlots(conv_e, state_e, slots), None, [0, n])
    # (elementwise ops over more rows may take other vector paths: last bits)
    assert err(o_r[:n], o_e) < RATIO and not o_r[n:].any()
    assert torch.equal(conv_r, conv_e) and err(state_r, state_e) < RATIO
    assert err(o, o_r) < RATIO


def test_device_offsets_are_refused_where_they_would_be_read_back():
    from hylo.ops.kda import device_offsets_refusal

    cuda = torch.device("cuda")
    assert (
        device_offsets_refusal(cuda, -5.0) is None
        and device_offsets_refusal(torch.device("cpu"), None) is None
    )
    assert "safe gate" in device_offsets_refusal(cuda, None) and "got -6.0" in device_offsets_refusal(
        cuda, -6.0
    )


def test_prefill_leaves_snapshots_at_chunk_ends(monkeypatch):
    """Snapshots after chunk 0 of the first sequence and chunks 0 and 1 of the second (packed chunks
    0, 2 and 3: at a sequence's first chunk, after a later one, past another sequence's chunks), none after
    either sequence's last, partial chunk: kernel and reference each leave exactly the window and state
    their own prefill of that prefix alone ends with, and the kernel's outputs and states are those of
    the call without snapshots."""
    p = Problem(5, d=16)
    # Snapshots are `recur`'s work; the first launch (`prep`) only feeds it, and its tilings agree
    # (test_prefill_matches_reference). Every kernel call here takes its coarsest legal tiling, 64-row conv
    # blocks: a third of the programs the interpreter runs one by one (32 s -> ~14 s on the CPU).
    tiles = dict(conv_rows=64)
    cu = [0, 70, 200]  # sequences of 70 and 130 tokens
    x = KDAInputs(*p.inputs(cu[-1]))
    slots = torch.tensor([2, 5])
    chunk_ids = torch.tensor([4, -1, 0, 6, -1])  # 2 + 3 chunks
    cu_dev = torch.tensor(cu, dtype=torch.int32)

    def pools(n):
        return torch.zeros(n, *p.conv_pool.shape[1:]), torch.zeros(n, *p.state_pool.shape[1:])

    snap_conv, snap_state = pools(8)
    snaps = reference.ChunkSnapshots(chunk_ids, snap_conv, snap_state)
    # `prep` never sees the snapshots (and alone writes the windows): the call without them is `recur` again
    # on the buffers this call's `prep` returned
    prep, preps = chunk.prep, []
    with monkeypatch.context() as spied:
        spied.setattr(chunk, "prep", lambda *args, **kwargs: preps.append(prep(*args, **kwargs)) or preps[-1])
        conv, state = p.pools()
        o = chunk.prefill(x, p.params(), KDASlots(conv, state, slots), cu_dev, cu, snapshots=snaps, **tiles)
    _, state_ref = p.pools()
    o_ref = torch.empty_like(o)
    chunk.recur(preps[0], o_ref, KDASlots(conv, state_ref, slots), cu_dev)
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)

    ref_conv, ref_state = pools(8)
    conv_r, state_r = p.pools()
    o_r = reference.prefill(
        x, p.params(), KDASlots(conv_r, state_r, slots), cu_dev, None,
        reference.ChunkSnapshots(chunk_ids, ref_conv, ref_state),
    )  # fmt: skip
    assert err(o, o_r) < RATIO and torch.equal(conv_r, conv) and err(state_r, state) < RATIO
    for sid, seq, tokens in [(4, 0, 64), (0, 1, 64), (6, 1, 128)]:
        lo, slot = cu[seq], slots[seq : seq + 1]
        part = x.rows(slice(lo, lo + tokens))
        one_conv, one_state = p.pools()
        reference.prefill(part, p.params(), KDASlots(one_conv, one_state, slot), None, [0, tokens])
        assert torch.equal(ref_conv[sid], one_conv[slot[0]]) and torch.equal(
            ref_state[sid], one_state[slot[0]]
        )
        one_conv, one_state = p.pools()
        one_cu = torch.tensor([0, tokens], dtype=torch.int32)
        chunk.prefill(part, p.params(), KDASlots(one_conv, one_state, slot), one_cu, [0, tokens], **tiles)
        assert torch.equal(snap_conv[sid], one_conv[slot[0]]) and torch.equal(
            snap_state[sid], one_state[slot[0]]
        )
    untouched = [1, 2, 3, 5, 7]
    assert not snap_conv[untouched].any() and not snap_state[untouched].any()


def test_model_decode_step_with_kernels_matches_reference_path(monkeypatch):
    """A decode step of a KDA layer with its kernels (the output norm inside the decode's second launch)
    against the reference path, after the same prefill: the logits and the advanced windows and states."""
    from conftest import Caches

    import hylo.ops.kda as kda_ops
    from hylo.config import ModelConfig
    from hylo.forward_batch import ForwardBatch, SequenceChunk
    from hylo.models import demo
    from hylo.models.glm5_next import Glm5NextForCausalLM
    from hylo.models.random_init import randomize

    text = demo._TEXT_CONFIG | dict(
        vocab_size=96, pad_token_id=0, hidden_size=64, num_hidden_layers=1, layer_types=["linear_attention"],
        mlp_layer_types=["dense"], indexer_types=["full"], hc_sinkhorn_iters=3,
    )  # fmt: skip
    model = Glm5NextForCausalLM(ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text}))
    randomize(model, torch.Generator().manual_seed(0))

    def prefill_then_decode():
        caches = Caches(model, num_seqs=2, per_seq=32)
        m = caches.manager
        caches.forward(model, [SequenceChunk([3, 4, 5, 6, 7], 0, 0, 0), SequenceChunk([8, 9], 0, 1, 1)])
        step = [SequenceChunk([10], 5, 0, 0), SequenceChunk([11], 2, 1, 1)]
        batch = ForwardBatch.build(step, m.table.table, m.tokens, m.states, m.kpool)
        with monkeypatch.context() as patched:
            patched.setattr(kda_ops, "use_kernel", lambda op, x, verify=None: op in kernel_ops)
            logits = model(batch).logits
        return logits, m.states.conv.clone(), m.states.recurrent.clone()

    kernel_ops = set()
    ref = prefill_then_decode()
    kernel_ops, decodes, decode = {"kda.decode"}, [], recurrent.decode
    monkeypatch.setattr(recurrent, "decode", lambda *args: decodes.append(args[3]) or decode(*args))
    got = prefill_then_decode()
    assert len(decodes) == 1 and decodes[0] is not None  # the layer's step ran the kernels, with its norm
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)  # fp32 through one layer and the head
    assert torch.equal(got[1], ref[1])  # windows: copies
    assert err(got[2], ref[2]) < RATIO


# Compiles decode's two launches for sm_90 as the GPU does (bf16 inputs and pools, GLM-5.3-Flash's head
# size, the window step inside the norm launch) in a fresh interpreter-free process: the interpreter runs
# their programs one after another and never compiles them. The launches are the real ones
# (`code_size.compiled_launches` compiles each with the operands `recurrent.decode` passes, typed bundles
# included, instead of running it); prints the kernels that came out with a cubin.
_DECODE_COMPILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")!r})
import torch
from code_size import compiled_launches
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, OutputNorm, recurrent

h, d, bf16 = 8, 128, torch.bfloat16
q, k, v = torch.zeros(1, 3 * h * d, dtype=bf16).split(h * d, dim=-1)
x = KDAInputs(q, k, v, torch.zeros(1, h * d, dtype=bf16), torch.zeros(1, h, dtype=bf16))
params = KDAParams(torch.zeros(3 * h * d, 4), torch.zeros(h * d), torch.zeros(h), -5.0)
pools = torch.zeros(2, 3, 3 * h * d, dtype=bf16), torch.zeros(2, h, d, d)
slots = KDASlots(*pools, torch.zeros(1, dtype=torch.int32))
norm = OutputNorm(torch.zeros(1, h * d, dtype=bf16), torch.ones(d, dtype=bf16), 1e-5)
launches = compiled_launches(lambda: recurrent.decode(x, params, slots, norm, block_v=16, num_warps=4))
print(" ".join(launch["kernel"] for launch in launches if launch["instructions"] > 0))
"""


def test_decode_launches_compile_for_hopper(hopper_compiles):
    assert hopper_compiles[1:] == ["_recurrent_kernel _gated_norm_kernel"]
