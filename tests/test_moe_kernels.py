"""MoE Triton kernels (routing, permutation, grouped GEMMs bf16 and FP8) against the torch references,
under the Triton interpreter on the CPU.

Shapes are small (D = 64..128, I = 32..256, E = 8..16, top-2..4, T = 1..40) with experts that get no
token and pair counts that are not multiples of `block_m`. The "bf16" GEMMs run on fp32 and fp16
tiles here (the interpreter's bf16 `tl.dot` is wrong, DESIGN §8); bf16 at real shapes is checked by
`benchmarks/kernels/moe.py` on the GPU. The interpreter does run the e4m3 GEMMs: its fp8 dot is exact,
and the kernels round to the e4m3 grid in fp32 before casting (the interpreter's own cast mis-rounds),
so the FP8 path is checked bit-exactly for its quantised activations, tightly against a torch
emulation of the same quantisation, and within block-quantisation error against the bf16 reference
on dequantised weights.
"""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.config import ModelConfig  # noqa: E402
from hylo.layers.moe import FP8Experts, MoE  # noqa: E402
from hylo.ops import fp8 as fp8_ops  # noqa: E402
from hylo.ops.fp8 import kernels as fp8_kernels  # noqa: E402
from hylo.ops.moe import kernels, reference, routing  # noqa: E402
from hylo.ops.moe.kernels import MoeConfig, Tiles  # noqa: E402
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

LIMIT = 1.5  # low enough that the clamps bite on these inputs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class Case:
    """Random experts and a routing of T tokens that leaves the last `unused` experts without tokens."""

    def __init__(self, seed, tokens, hidden, inter, num_experts, top_k, unused=2, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, hidden, generator=g).to(dtype)
        self.gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
        self.down = (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
        used = num_experts - unused
        self.ids = torch.rand(tokens, used, generator=g).argsort(-1)[:, :top_k]
        self.weights = torch.rand(tokens, top_k, generator=g) + 0.1

    @property
    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.gate_up, self.down)

    @property
    def choices(self) -> Choices:
        return Choices(self.ids, self.weights)

    def reference(self):
        return reference.experts(self.x, self.experts, self.choices, LIMIT)


def fp8_experts(gate_up, gate_up_scale, down, down_scale) -> ExpertWeights:
    """FP8 experts from `quantize_fp8_blocks` of gate_up and of down, in that order."""
    return ExpertWeights(gate_up, down, (gate_up_scale, down_scale))


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "n_group", "topk_group", "normalize"),
    [
        (9, 16, 4, 4, 2, True),  # group-limited
        (5, 12, 2, 1, 1, False),
        (4, 12, 3, 1, 1, True),  # top-3 pads to 4 choices, the padding must not enter the sum
        (3, 288, 8, 1, 1, True),  # GLM-5.3-Flash: 288 experts pad to 512 lanes
    ],
)
def test_route_matches_reference(tokens, num_experts, top_k, n_group, topk_group, normalize):
    g = torch.Generator().manual_seed(tokens * num_experts)
    x = torch.randn(tokens, 32, generator=g)
    weight = torch.randn(num_experts, 32, generator=g)
    bias = torch.randn(num_experts, generator=g) * 0.3  # large enough to change the choice
    router = Routing(weight, bias, top_k, n_group, topk_group, normalize, 2.5)
    ids, weights = routing.route(x, router)
    ref_ids, ref_weights = reference.route(x, router)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    if n_group > 1:  # the data makes the group limit matter: without it the choice differs
        free_ids, _ = reference.route(x, router._replace(n_group=1, topk_group=1))
        assert not torch.equal(free_ids, ref_ids)


# ---------------------------------------------------------------- permutation


@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m"),
    # one program up to 256 pairs (GLM-5.3-Flash decode: 16 tokens × top-8 over 288 experts), then the
    # count and place launches; experts of one to three blocks
    [(1, 2, 8, 16), (7, 3, 16, 16), (60, 4, 8, 32), (16, 8, 288, 16), (100, 3, 10, 16)],
)
def test_align_invariants(tokens, top_k, num_experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, num_experts - 3, generator=g).argsort(-1)[:, :top_k]  # 3 experts unused
    assert_alignment(routing.align(ids, num_experts, block_m), ids, num_experts, block_m)


@pytest.mark.parametrize(
    ("tokens", "top_k", "first_expert", "block_m"),
    # 12 experts, this rank's 4 from `first_expert`: the one-program kernel, then count and place
    [(1, 4, 4, 16), (7, 3, 0, 16), (13, 4, 8, 4), (90, 3, 4, 16)],
)
def test_align_places_only_the_weights_experts_pairs(tokens, top_k, first_expert, block_m):
    """A rank of expert parallelism: global ids, only the pairs of experts [first, first + 4) placed,
    as experts 0..3; the others take no row and no block (the bound is a rank's own experts')."""
    g = torch.Generator().manual_seed(tokens + first_expert)
    ids = torch.rand(tokens, 12, generator=g).argsort(-1)[:, :top_k]
    layout = routing.align(ids, 4, block_m, first_expert)
    assert_alignment(layout, ids, 4, block_m, first_expert)
    mine = int(((ids >= first_expert) & (ids < first_expert + 4)).sum())
    assert 0 < mine < ids.numel() and int(layout.block_rows.sum()) == mine


def assert_alignment(
    layout: routing.Alignment,
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    first_expert: int | None = None,
) -> None:
    """`layout` sorts the pairs of `ids` by expert into blocks as `routing.align` promises: with
    `first_expert`, exactly the pairs of the global experts [first_expert, first_expert + num_experts)
    are placed, as experts 0.., and no other."""
    local = ids.flatten() - (first_expert or 0)
    placed = ((local >= 0) & (local < num_experts)).nonzero().squeeze(1)
    counts = torch.bincount(local[placed], minlength=num_experts)
    bound = routing.max_blocks(ids.numel(), num_experts, block_m)
    assert layout.block_expert.shape == (bound,) and layout.pairs.shape == (bound * block_m,)
    real = int((layout.block_expert >= 0).sum())
    assert real == int(((counts + block_m - 1) // block_m).sum())
    assert (layout.block_expert[real:] == -1).all() and (layout.block_rows[real:] == 0).all()
    experts = layout.block_expert[:real].long()
    assert (experts.diff() >= 0).all(), "each expert's blocks are contiguous, experts in order"
    rows = layout.block_rows[:real].long()
    assert ((rows >= 1) & (rows <= block_m)).all()
    assert torch.equal(torch.zeros(num_experts, dtype=torch.long).index_add_(0, experts, rows), counts)
    valid = torch.arange(block_m)[None, :] < rows[:, None]
    pairs = layout.pairs.view(bound, block_m)[:real][valid].long()
    assert torch.equal(pairs.sort().values, placed), "every placed pair exactly once"
    assert torch.equal(local[pairs], experts[:, None].expand(-1, block_m)[valid])


# ---------------------------------------------------------------- grouped GEMMs


CONFIGS = {
    "default": None,
    "m16-uneven-k": MoeConfig(16, Tiles(32, 64, 4, 1), Tiles(32, 32, 4, 1), group_m=2),
    "m32": MoeConfig(32, Tiles(64, 32, 4, 1), Tiles(64, 64, 4, 1)),
}


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "num_experts", "top_k", "config"),
    [
        (1, 64, 32, 8, 2, "default"),
        (13, 96, 48, 12, 3, "default"),
        (13, 96, 48, 12, 3, "m16-uneven-k"),
        (13, 96, 48, 12, 3, "m32"),
        (40, 64, 32, 8, 4, "default"),  # > 16 pairs per expert: the 64-row prefill tiles
    ],
)
def test_experts_matches_reference(tokens, hidden, inter, num_experts, top_k, config):
    case = Case(tokens + hidden, tokens, hidden, inter, num_experts, top_k)
    out = kernels.experts(case.x, case.experts, case.choices, LIMIT, CONFIGS[config])
    assert out.shape == case.x.shape and out.dtype == case.x.dtype
    assert rel_err(out, case.reference()) < 2e-6


@pytest.mark.parametrize(
    ("tokens", "config"),
    [(5, "default"), (13, "m16-uneven-k"), (40, "default")],  # 40 tokens: the 64-row prefill tiles
)
def test_experts_of_one_rank_match_the_reference(tokens, config):
    """A rank of expert parallelism (global ids, the weights of experts 4..7 of 12): the output of only
    its experts' pairs, as the reference's; the three ranks' outputs add up to all experts' output."""
    case = Case(tokens, tokens, 64, 32, 12, 3, unused=0)
    parts = []
    for first in (0, 4, 8):
        mine = slice(first, first + 4)
        args = (case.x, ExpertWeights(case.gate_up[mine], case.down[mine]), case.choices, LIMIT)
        out = kernels.experts(*args, CONFIGS[config], first_expert=first)
        assert rel_err(out, reference.experts(*args, first)) < 2e-6
        parts.append(out)
    assert rel_err(sum(parts), case.reference()) < 2e-6


def test_experts_fp8_of_one_rank_are_the_whole_steps_local_rows():
    """FP8, a rank holding experts 2..3 of 6: each placed pair's row is the one the whole step computes
    (same quantisation of x and h), so the output equals the whole step's with the other pairs' routing
    weights zeroed, up to the combine's summation order."""
    case = Case(8, 9, 160, 128, 6, 3, unused=0)
    quantized = (*fp8_ops.quantize_fp8_blocks(case.gate_up), *fp8_ops.quantize_fp8_blocks(case.down))
    rank = fp8_experts(*(w[2:4] for w in quantized))
    out = kernels.experts(case.x, rank, case.choices, LIMIT, first_expert=2)
    local = (case.ids >= 2) & (case.ids < 4)
    assert local.any() and not local.all(1).any()
    whole = kernels.experts(
        case.x, fp8_experts(*quantized), Choices(case.ids, case.weights.where(local, 0)), LIMIT
    )
    assert rel_err(out, whole) < 1e-6
    ref = reference.experts(case.x, rank, case.choices, LIMIT, 2)
    assert rel_err(out, ref) < 0.08


def test_combine_sums_only_the_placed_rows():
    """`kernels.combine`: Σ_k of a token's rows whose expert lies in the span, in fp32 and rounded once;
    the other rows (unset in a step: NaN here) are never read."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 12, (21, 4), generator=g)
    routed = torch.randn(ids.numel(), 80, generator=g).half()
    local = ((ids >= 4) & (ids < 8)).flatten()
    routed[~local] = float("nan")
    out = kernels.combine(routed, ids, 4, 4)
    expected = routed.float().where(local[:, None], 0).view(21, 4, 80).sum(1)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, rtol=1e-3, atol=1e-3)  # one fp16 rounding


def test_experts_half_precision_and_int32_ids():
    case = Case(5, 40, 64, 32, 16, 4, unused=5, dtype=torch.float16)
    out = kernels.experts(case.x, case.experts, Choices(case.ids.int(), case.weights), LIMIT)
    ref = reference.experts(
        case.x.float(), ExpertWeights(case.gate_up.float(), case.down.float()), case.choices, LIMIT
    )
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 5e-3


def test_quantize_groups_is_torch_rounding():
    """Equal to torch's e4m3 cast, including ties to even, subnormals and values that round up
    into the next binade (the ones the interpreter's own cast gets wrong)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 200, generator=g) * torch.logspace(-4, 2, 200)
    x[0, :5] = torch.tensor([448.0, 1.0625, 1.1875, 3 * 2.0**-10, 31.9])  # amax 448: scale exactly 1
    q, scale = fp8_kernels.quantize_groups(x)
    ref_q, ref_scale = fp8_ops.quantize_fp8_groups(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.float(), ref_q.float())  # values: the interpreter stores -0 as +0
    assert q[0, :5].float().tolist() == [448.0, 1.0, 1.25, 2 * 2.0**-9, 32.0]


def emulated_fp8(case: Case, gate_up_q, gate_up_s, down_q, down_s) -> torch.Tensor:
    """The FP8 path's arithmetic in torch: activations quantised per token-group of 128 (x, then the
    SwiGLU output), weights dequantised, fp32 everywhere else."""

    def dequantized_groups(a):
        q, s = fp8_ops.quantize_fp8_groups(a)
        return q.float() * s.repeat_interleave(fp8_ops.FP8_BLOCK, 1)[:, : a.shape[1]]

    gate_up = fp8_ops.dequantize_fp8_blocks(gate_up_q, gate_up_s, torch.float32)[case.ids]  # [T, k, 2I, D]
    down = fp8_ops.dequantize_fp8_blocks(down_q, down_s, torch.float32)[case.ids]
    gate, up = torch.einsum("td,tknd->tkn", dequantized_groups(case.x), gate_up).chunk(2, dim=-1)
    h = dequantized_groups(reference.swiglu_clamp(gate, up, LIMIT).flatten(0, 1)).view_as(gate)
    return torch.einsum("tki,tkdi,tk->td", h, down, case.weights)


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "config"),
    [
        (1, 64, 48, None),  # decode-sized, one 64-wide tile holds the whole intermediate row
        (30, 64, 256, None),  # > 16 pairs per expert: the 64-row prefill tiles
        (4, 64, 96, MoeConfig(16, Tiles(256, 64, 4, 1), Tiles(32, 64, 4, 1))),  # a tile reaching past I
        (6, 96, 256, MoeConfig(16, Tiles(256, 64, 4, 1), Tiles(32, 128, 4, 1))),  # 2 groups in a tile
        (5, 160, 256, MoeConfig(32, Tiles(128, 64, 4, 1), Tiles(64, 64, 4, 1))),  # 2 tiles of 1 group
    ],
)
def test_experts_fp8_matches_reference(tokens, hidden, inter, config):
    case = Case(tokens, tokens, hidden, inter, 5, 3, unused=1)
    quantized = (*fp8_ops.quantize_fp8_blocks(case.gate_up), *fp8_ops.quantize_fp8_blocks(case.down))
    out = kernels.experts(case.x, fp8_experts(*quantized), case.choices, LIMIT, config)
    assert out.shape == case.x.shape and out.dtype == case.x.dtype
    assert rel_err(out, emulated_fp8(case, *quantized)) < 1e-5
    # e4m3 keeps 3 mantissa bits: a few percent from x, the weights and the SwiGLU output together
    err = rel_err(out, reference.experts(case.x, fp8_experts(*quantized), case.choices, LIMIT))
    assert err < 0.08
    assert rel_err(out, case.reference()) < 0.1


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "config"),
    [
        (30, 256, 256, MoeConfig(32, Tiles(128, 128, 4, 1), Tiles(64, 128, 4, 1), tma=True)),
        (13, 128, 128, MoeConfig(16, Tiles(128, 128, 8, 1), Tiles(128, 128, 8, 1), tma=True)),
    ],
)
# the padding rows of h are left unset: the interpreter warns on their garbage, masked off at the stores
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_tma_kernels_match_the_pointer_kernels(tokens, hidden, inter, config):
    """x gathered into slot order and both GEMMs on TMA descriptors, one weight scale per tile: the
    same products as the pointer kernels, on blocks with padding rows and blocks past the real count."""
    case = Case(tokens + 7, tokens, hidden, inter, 6, 3, unused=1)
    quantized = (*fp8_ops.quantize_fp8_blocks(case.gate_up), *fp8_ops.quantize_fp8_blocks(case.down))
    args = (case.x, fp8_experts(*quantized), case.choices, LIMIT)
    out = kernels.experts(*args, config)
    assert rel_err(out, kernels.experts(*args, replace(config, tma=False))) < 1e-6
    # torch sums in another order: an e4m3 rounding of h may flip
    assert rel_err(out, emulated_fp8(case, *quantized)) < 1e-3


@pytest.mark.parametrize(("rows", "groups"), [(32, 1), (8, 2)])  # a program: one group, or both
def test_gather_rows_puts_each_token_row_in_its_slots(rows, groups):
    case = Case(2, 11, 256, 128, 6, 3, unused=2)
    q, scale = fp8_kernels.quantize_groups(case.x)
    layout = routing.align(case.ids, 6, 16)
    with pytest.raises(ValueError, match="groups 4 must divide"):
        kernels.gather_rows(q, scale, layout, 3, groups=4)
    rows, row_scales = kernels.gather_rows(q, scale, layout, 3, rows=rows, groups=groups)
    real = int((layout.block_expert >= 0).sum())
    valid = torch.arange(16)[None, :] < layout.block_rows[:real, None]
    slots = torch.arange(real * 16).view(real, 16)[valid]
    tokens = layout.pairs[slots].long() // 3
    assert torch.equal(rows[slots].float(), q[tokens].float()) and torch.equal(
        row_scales[slots], scale[tokens]
    )
    padding = torch.arange(real * 16).view(real, 16)[~valid]
    assert (rows[padding].float() == 0).all() and (row_scales[padding] == 0).all()


def test_bad_inputs_are_named():
    case = Case(1, 3, 64, 48, 8, 2)
    gq, gs, dq, ds = (*fp8_ops.quantize_fp8_blocks(case.gate_up), *fp8_ops.quantize_fp8_blocks(case.down))
    args = (case.choices, LIMIT)
    with pytest.raises(ValueError, match="gate_up_scale_inv"):
        kernels.experts(case.x, fp8_experts(gq, gs[:4], dq, ds), *args)
    with pytest.raises(ValueError, match="down must be float8"):
        kernels.experts(case.x, fp8_experts(gq, gs, case.down, ds), *args)
    with pytest.raises(ValueError, match=r"gate_up\.block_n"):
        kernels.experts(
            case.x,
            fp8_experts(gq, gs, dq, ds),
            *args,
            MoeConfig(16, Tiles(32, 128, 4, 1), Tiles(32, 128, 4, 1)),
        )
    tma = MoeConfig(16, Tiles(128, 128, 4, 1), Tiles(128, 128, 4, 1), tma=True)
    with pytest.raises(ValueError, match=r"config\.tma applies to FP8"):
        kernels.experts(case.x, case.experts, *args, tma)
    with pytest.raises(ValueError, match=r"D 64 and I 48"):  # not multiples of 128
        kernels.experts(case.x, fp8_experts(gq, gs, dq, ds), *args, tma)
    wide = Case(1, 3, 128, 128, 8, 2)
    wq, ws, vq, vs = (*fp8_ops.quantize_fp8_blocks(wide.gate_up), *fp8_ops.quantize_fp8_blocks(wide.down))
    strided = torch.cat([vq, vq], dim=1)[:, ::2]  # [E, D, I] rows two apart: a TMA descriptor cannot view it
    with pytest.raises(ValueError, match=r"config\.tma needs down contiguous"):
        kernels.experts(wide.x, fp8_experts(wq, ws, strided, vs), wide.choices, LIMIT, tma)
    with pytest.raises(ValueError, match="down"):
        kernels.experts(case.x, ExpertWeights(case.gate_up, case.down[:, :, :5]), *args)
    with pytest.raises(ValueError, match="ids"):
        kernels.experts(case.x, case.experts, Choices(case.ids[:1], case.weights), LIMIT)


# ---------------------------------------------------------------- layer


def test_moe_layer_with_fp8_experts_runs_the_dequantised_reference():
    """On the CPU the layer goes through the dispatcher to the references; FP8 experts there equal the
    bf16 reference on their dequantised weights."""
    config = ModelConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
        indexer_types=["full"],
    )
    torch.manual_seed(0)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 64)
    fp8 = FP8Experts.from_experts(moe.experts)
    assert fp8.gate_up_proj.dtype == torch.float8_e4m3fn and fp8.down_proj_scale_inv.shape == (8, 1, 1)
    moe.experts.gate_up_proj.data = fp8_ops.dequantize_fp8_blocks(
        fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, torch.float32
    )
    moe.experts.down_proj.data = fp8_ops.dequantize_fp8_blocks(
        fp8.down_proj, fp8.down_proj_scale_inv, torch.float32
    )
    expected = moe(x)
    moe.experts = fp8
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=0)


# shared memory per block on Hopper (H100/H200: 227 KiB)
HOPPER_SHARED_BYTES = 232448


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("pairs", [16, 1 << 16])
def test_default_tiles_fit_hoppers_shared_memory(element_size, pairs):
    """The pipelined stages of each unquantised default (a block of x rows and the weight tile(s) per
    stage: gate and up for gate|up) fit in a Hopper block's shared memory, fp32 included: with the
    bf16 stages, fp32 gate|up needed 327680 bytes (an H200 refused the launch)."""
    c = kernels.default_config(pairs, 288, fp8=False, element_size=element_size)
    gate_up = (c.block_m + 2 * c.gate_up.block_n) * c.gate_up.block_k * c.gate_up.num_stages
    down = (c.block_m + c.down.block_n) * c.down.block_k * c.down.num_stages
    assert max(gate_up, down) * element_size <= HOPPER_SHARED_BYTES
