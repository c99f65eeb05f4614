"""The three-launch MoE step of a few tokens (`hylo.ops.moe.decode`) against the references and the
general path, under the Triton interpreter on the CPU.

The interpreter runs a launch's programs one after another, so the prologue's routing and alignment
run in its last program and the combine in each column tile's last program, as the ticket counters
decide on the GPU. As in test_moe_kernels.py, the "bf16" experts run on fp32 here (the interpreter's
bf16 `tl.dot` is wrong); the FP8 experts run on e4m3 with bf16 or fp32 activations.
"""

from __future__ import annotations

from pathlib import Path

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_moe_kernels import assert_alignment, rel_err  # noqa: E402

from hylo.config import ModelConfig  # noqa: E402
from hylo.layers.moe import FP8Experts, MoE  # noqa: E402
from hylo.ops import fp8 as fp8_ops  # noqa: E402
from hylo.ops import moe as moe_ops  # noqa: E402
from hylo.ops.moe import decode, kernels, reference, routing  # noqa: E402
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

LIMIT = 1.5  # low enough that the clamps bite on these inputs
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"


def random_routing(g: torch.Generator, hidden: int, num_experts: int, top_k: int, n_group=1, topk_group=1):
    weight = torch.randn(num_experts, hidden, generator=g) * hidden**-0.5
    bias = torch.randn(num_experts, generator=g) * 0.3  # large enough to change the choice
    return Routing(weight, bias, top_k, n_group, topk_group, True, 2.5)


# The interpreter runs the prologue's programs one by one, one per `block_e` router rows: the first three
# cases take the default single row; GLM-5.3-Flash's 288 experts take 64 rows a program (5 programs instead
# of 288), the last holding experts 256..287 and 32 masked rows.
@pytest.mark.parametrize(
    ("tokens", "hidden", "num_experts", "top_k", "groups", "normalize", "block_m", "dtype", "block_e"),
    [
        (1, 256, 16, 4, (4, 2), True, 16, torch.float32, 1),  # group-limited, two channel groups
        (5, 96, 12, 3, (1, 1), False, 16, torch.float32, 1),  # top-3 pads to 4, D a partial group
        (8, 64, 20, 8, (1, 1), True, 4, torch.float32, 1),  # 64 pairs, experts shared by tokens: 1-2 blocks
        (2, 128, 288, 8, (1, 1), True, 16, torch.bfloat16, 64),  # 288 experts pad to 512 lanes, bf16 router
        # 8 tokens over 6 programs of 4 router rows, D no power of two; then one program's rows for one
        # token and 4 more programs for x's 5 FP8 groups alone
        (8, 640, 24, 4, (1, 1), True, 16, torch.float32, 4),
        (1, 640, 4, 2, (1, 1), True, 16, torch.float32, 4),
    ],
)
def test_prologue_matches_reference(
    tokens, hidden, num_experts, top_k, groups, normalize, block_m, dtype, block_e
):
    g = torch.Generator().manual_seed(tokens * hidden + num_experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routing_ = random_routing(g, hidden, num_experts, top_k, *groups)._replace(normalize=normalize)
    routing_ = routing_._replace(weight=routing_.weight.to(dtype))
    ids, weights, layout, q, q_scale = decode.prologue(x, routing_, block_m, quantize=True, block_e=block_e)
    assert not decode.tickets(x.device).any()  # every counter the launch took is put back
    ref_ids, ref_weights = reference.route(x, routing_)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    if groups[0] > 1:  # the data makes the group limit matter: without it the choice differs
        assert not torch.equal(reference.route(x, routing_._replace(n_group=1, topk_group=1))[0], ref_ids)
    assert_alignment(layout, ids, num_experts, block_m)
    general = routing.align(ids, num_experts, block_m)  # the same blocks; the order inside may differ
    assert torch.equal(layout.block_expert, general.block_expert)
    assert torch.equal(layout.block_rows, general.block_rows)
    ref_q, ref_scale = fp8_ops.quantize_fp8_groups(x)
    assert torch.equal(q_scale, ref_scale)
    assert torch.equal(q.float(), ref_q.float())


@pytest.mark.parametrize(("tokens", "first_expert", "block_m"), [(1, 8, 16), (5, 4, 16), (8, 0, 4)])
def test_prologue_places_only_the_weights_experts_pairs(tokens, first_expert, block_m):
    """A rank of expert parallelism holding experts [first, first + 4) of 12: every token routed over
    all 12 (the ids are global), only this rank's pairs placed, in the general alignment's blocks."""
    g = torch.Generator().manual_seed(tokens + first_expert)
    x = torch.randn(tokens, 64, generator=g)
    routing_ = random_routing(g, 64, 12, 8 if tokens == 8 else 3)
    ids, _, layout, _, _ = decode.prologue(
        x, routing_, block_m, quantize=False, first_expert=first_expert, num_experts=4
    )
    assert torch.equal(ids, reference.route(x, routing_)[0])
    assert 0 < int(layout.block_rows.sum()) < ids.numel()  # some of the step's pairs are this rank's
    assert_alignment(layout, ids, 4, block_m, first_expert)
    general = routing.align(ids, 4, block_m, first_expert)
    assert torch.equal(layout.block_expert, general.block_expert)
    assert torch.equal(layout.block_rows, general.block_rows)
    with pytest.raises(ValueError, match=r"experts \[10, 10 \+ 4\) are not among the router's 12"):
        decode.prologue(x, routing_, block_m, quantize=False, first_expert=10, num_experts=4)


class Experts:
    """Random experts, bf16-style (`gate_up`, `down`) and their block-FP8 quantisation."""

    def __init__(self, g: torch.Generator, hidden: int, inter: int, num_experts: int):
        self.gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
        self.down = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
        (self.gate_up_q, self.gate_up_s), (self.down_q, self.down_s) = (
            fp8_ops.quantize_fp8_blocks(w) for w in (self.gate_up, self.down)
        )
        self.plain = ExpertWeights(self.gate_up, self.down)
        self.fp8 = ExpertWeights(self.gate_up_q, self.down_q, (self.gate_up_s, self.down_s))

    def shared(self, fp8: bool) -> SharedExpert:
        """Expert 0 as a shared expert: its own tensors, laid out as one routed expert's."""
        w = self.fp8 if fp8 else self.plain
        return SharedExpert(
            w.gate_up[0], w.down[0], None if w.scales is None else (w.scales[0][0], w.scales[1][0])
        )


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "num_experts", "top_k"), [(1, 64, 32, 8, 3), (6, 96, 48, 10, 4)]
)
def test_routed_experts_matches_the_general_path(tokens, hidden, inter, num_experts, top_k):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, num_experts, top_k), Experts(g, hidden, inter, num_experts)
    out = decode.routed_experts(x, routing_, experts.plain, LIMIT)
    choices = reference.route(x, routing_)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, kernels.experts(x, experts.plain, choices, LIMIT)) < 1e-6
    assert rel_err(out, reference.experts(x, experts.plain, choices, LIMIT)) < 2e-6


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
def test_routed_experts_fp8_matches_the_general_path(dtype, tolerance):
    """Same quantisation and GEMMs as `kernels.experts` with FP8 weights; only the combine's summation order
    differs (bf16: each row is rounded before the sum, as in the general path)."""
    g = torch.Generator().manual_seed(3)
    tokens, hidden, inter, num_experts, top_k = 4, 160, 128, 6, 3
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routing_, experts = random_routing(g, hidden, num_experts, top_k), Experts(g, hidden, inter, num_experts)
    routing_ = routing_._replace(weight=routing_.weight.to(dtype))
    out = decode.routed_experts(x, routing_, experts.fp8, LIMIT)
    choices = reference.route(x, routing_)
    general = kernels.experts(x, experts.fp8, choices, LIMIT)
    assert out.dtype == dtype
    assert rel_err(out, general) < tolerance
    # e4m3 activations: a few percent from the bf16 reference on the original weights
    assert rel_err(out, reference.experts(x.float(), experts.plain, choices, LIMIT)) < 0.1


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_routed_experts_of_one_rank_match_the_general_path(fp8):
    """Each of three ranks holding 4 of 12 experts: the three-launch step computes only its experts'
    pairs, as the general path does (same GEMM rows; the combine sums the placed rows, in its own
    order), and the ranks' outputs add up to the whole step's."""
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, top_k = 5, 128, 128, 4
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, 12, top_k), Experts(g, hidden, inter, 12)
    choices = reference.route(x, routing_)
    assert len(set((choices.ids // 4).flatten().tolist())) == 3  # every rank has pairs
    whole = experts.fp8 if fp8 else experts.plain

    def step(first: int | None):
        mine = slice(first or 0, 12 if first is None else first + 4)
        scales = None if whole.scales is None else tuple(s[mine] for s in whole.scales)
        w = ExpertWeights(whole.gate_up[mine], whole.down[mine], scales)
        out = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first)
        general = kernels.experts(x, w, choices, LIMIT, first_expert=first)
        if not fp8:
            assert rel_err(out, reference.experts(x, w, choices, LIMIT, first)) < 2e-6
        assert rel_err(out, general) < 1e-6
        return out

    assert rel_err(sum(step(first) for first in (0, 4, 8)), step(None)) < 1e-6


def test_the_addend_joins_the_combine_as_an_add_after_it():
    """The shared expert's output added in the combine: bit for bit the step's output plus it (the sum
    rounded to the dtype first, then the add rounded), on the FP8 and the plain path. fp32 only: the
    interpreter rounds fp32 to bf16 otherwise than the GPU and torch (which round to nearest even)."""
    g = torch.Generator().manual_seed(8)
    tokens, hidden = 3, 160
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, 6, 3), Experts(g, hidden, 64, 6)
    addend = torch.randn(tokens, hidden, generator=g)
    for w in (experts.fp8, experts.plain):
        alone = decode.routed_experts(x, routing_, w, LIMIT)
        joined = decode.routed_experts(x, routing_, w, LIMIT, addend=addend)
        assert torch.equal(joined, alone + addend)
    with pytest.raises(ValueError, match="addend must be"):
        decode.routed_experts(x, routing_, experts.fp8, LIMIT, addend=addend[:, :-1])


def test_tickets_are_left_zero_and_steps_repeat_bitwise():
    """Every launch puts its ticket counters back to zero, so the next launch (or graph replay) finds
    them ready; the fixed-order combine makes two steps bitwise equal."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g)
    routing_, experts = random_routing(g, 64, 8, 2), Experts(g, 64, 32, 8)
    first = decode.routed_experts(x, routing_, experts.fp8, LIMIT)
    assert not decode.tickets(x.device).any()
    again = decode.routed_experts(x, routing_, experts.fp8, LIMIT)
    assert torch.equal(first, again)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_a_split_gate_up_equals_the_whole_one(fp8):
    """At a rank whose experts one token barely reaches, each gate|up tile's K runs over several programs
    (`gate_up_splits`): the default step splits K = 2048 4 ways here (512 deep each; FP8's weight-major
    tiles 2 ways, 1024 deep) and, like forced splits of 4 and 8, gives the whole GEMM's output up to the
    order of the fp32 sums (FP8: an h element may round to its e4m3 neighbour), leaves its tickets at zero
    and repeats bitwise."""
    g = torch.Generator().manual_seed(11)
    tokens, hidden, inter, top_k = 2, 2048, 128, 2
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, 32, top_k), Experts(g, hidden, inter, 32)
    first = int(reference.route(x, routing_).ids[0, 0]) // 8 * 8  # the rank of token 0's first expert
    w = rank_experts(experts.fp8 if fp8 else experts.plain, first, 32, local=8)
    config = kernels.default_config(4, 8, fp8)
    assert decode.gate_up_splits(4, w.gate_up.shape, config) == (2 if fp8 else 4)
    base = kernels.default_config(tokens * top_k, 8, fp8, tma=False)
    unsplit = decode.routed_experts(x, routing_, w, LIMIT, base, first_expert=first)
    tolerance = 2e-3 if fp8 else 1e-6
    default = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first)
    assert rel_err(default, unsplit) < tolerance
    assert not decode.tickets(x.device).any()
    assert torch.equal(decode.routed_experts(x, routing_, w, LIMIT, first_expert=first), default)
    for splits in (4, 8):
        config = replace(base, gate_up=replace(base.gate_up, splits=splits))
        assert (
            rel_err(decode.routed_experts(x, routing_, w, LIMIT, config, first_expert=first), unsplit)
            < tolerance
        )
        assert not decode.tickets(x.device).any()


def test_gate_up_splits_leave_each_program_512_or_1024_deep():
    """GLM-5.3-Flash's gate|up (I 2048, D 4096, 16 column tiles of 128) splits, at a rank and at TP1 alike
    and whatever the step reaches, 8 ways (512 deep) with row-major tiles and 4 ways (1024 deep) with
    FP8's weight-major ones; K = 1536 2 ways with row-major tiles (768 deep; 4 would leave 384) and not at
    all with weight-major ones, K = 512 never; a layout whose tiles outnumber the ticket counters never
    splits."""
    weight_major = kernels.default_config(8, 36, True)
    row_major = replace(weight_major, gate_up=replace(weight_major.gate_up, swap_ab=False))
    assert weight_major.gate_up.swap_ab
    for config, whole, k1536 in ((row_major, 8, 2), (weight_major, 4, 1)):
        assert decode.gate_up_splits(9, torch.Size([36, 4096, 4096]), config) == whole
        assert decode.gate_up_splits(69, torch.Size([288, 4096, 4096]), config) == whole
        assert decode.gate_up_splits(9, torch.Size([36, 4096, 1536]), config) == k1536
        assert decode.gate_up_splits(9, torch.Size([36, 4096, 512]), config) == 1
        assert decode.gate_up_splits(decode.TICKET_SLOTS, torch.Size([36, 4096, 4096]), config) == 1


def test_bad_split_configurations_are_named():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, 256, generator=g)
    routing_, experts = random_routing(g, 256, 4, 2), Experts(g, 256, 128, 4)
    base = kernels.default_config(2, 4, True, tma=False)
    uneven = replace(base, gate_up=replace(base.gate_up, splits=4))  # 64-deep spans: not whole scale groups
    with pytest.raises(ValueError, match="splits 4 must cut K = 256 into whole 128-deep steps"):
        decode.routed_experts(x, routing_, experts.fp8, LIMIT, uneven)
    _, _, layout, q, q_scale = decode.prologue(x, routing_, base.block_m, True)
    halves = replace(base, gate_up=replace(base.gate_up, splits=2))
    with pytest.raises(ValueError, match="splits 2 need int32 tickets"):
        kernels.gate_up_stage(
            q, q_scale, experts.fp8.gate_up, experts.fp8.scales[0], layout, 2, LIMIT, halves
        )


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_weight_major_product_equals_the_row_major_one(fp8, splits):
    """`Tiles.swap_ab` (FP8's decode default: the weight tile as the MMA's rows, wgmma on both e4m3
    operands on Hopper) multiplies the same tiles transposed and sums them in the same order: the step
    equals the row-major one (the interpreter's products are exact; on the GPU they differ by the
    tensor cores' summation order within a step), with the K split and the shared expert in the launches."""
    g = torch.Generator().manual_seed(5 + splits)
    tokens, hidden, inter, num_experts, top_k = 3, 512, 128, 8, 2
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, num_experts, top_k), Experts(g, hidden, inter, num_experts)
    w, shared_expert = experts.fp8 if fp8 else experts.plain, Experts(g, hidden, inter, 1).shared(fp8)
    base = kernels.default_config(tokens * top_k, num_experts, fp8, tma=False)
    row_major = replace(
        base,
        gate_up=replace(base.gate_up, swap_ab=False, splits=splits),
        down=replace(base.down, swap_ab=False),
    )
    weight_major = replace(
        row_major,
        gate_up=replace(row_major.gate_up, swap_ab=True),
        down=replace(row_major.down, swap_ab=True),
    )
    expected = decode.routed_experts(x, routing_, w, LIMIT, row_major, shared=shared_expert)
    got = decode.routed_experts(x, routing_, w, LIMIT, weight_major, shared=shared_expert)
    assert torch.equal(got, expected)
    assert base.gate_up.swap_ab == base.down.swap_ab == fp8


def test_bad_weight_major_configurations_are_named():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 256, generator=g)
    routing_, experts = random_routing(g, 256, 4, 2), Experts(g, 256, 128, 4)
    base = kernels.default_config(4, 4, True, tma=False)
    narrow = replace(base, down=replace(base.down, block_n=32, swap_ab=True))
    with pytest.raises(ValueError, match=r"down.swap_ab takes .* 64-row MMA blocks \(here 32\)"):
        decode.routed_experts(x, routing_, experts.fp8, LIMIT, narrow)
    tma = replace(kernels.default_config(4096, 4, True, tma=True), down=replace(base.down, swap_ab=True))
    with pytest.raises(ValueError, match=r"down\.swap_ab takes the pointer kernels"):
        kernels.check_experts(x, experts.fp8, Choices(*reference.route(x, routing_)), tma)


def test_bad_inputs_are_named():
    g = torch.Generator().manual_seed(6)
    routing_, experts = random_routing(g, 64, 8, 4), Experts(g, 64, 32, 8)
    with pytest.raises(ValueError, match="x has 17 tokens"):
        decode.routed_experts(torch.randn(17, 64), routing_, experts.plain, LIMIT)
    with pytest.raises(ValueError, match="correction_bias"):
        decode.prologue(torch.randn(2, 64), routing_._replace(correction_bias=torch.zeros(7)), 16, True)
    with pytest.raises(ValueError, match="gate_up_scale_inv"):
        cut = experts.fp8._replace(scales=(experts.gate_up_s[:3], experts.down_s))
        decode.routed_experts(torch.randn(2, 64), routing_, cut, LIMIT)
    x = torch.randn(2, 64)
    ids, weights, layout, *_ = decode.prologue(x, routing_, 16, quantize=False)
    config = kernels.default_config(ids.numel(), 8, fp8=False)
    h, _ = kernels.gate_up_stage(x, None, experts.gate_up, None, layout, 4, LIMIT, config)
    with pytest.raises(ValueError, match="tickets must be int32 with at least 1"):
        kernels.down_combine_stage(
            h, None, experts.down, None, layout, weights, x.dtype, config, torch.zeros(0, dtype=torch.int32)
        )


# ---------------------------------------------------------------- the shared expert as one more pair


@pytest.mark.parametrize(("tokens", "first_expert", "block_m"), [(1, None, 16), (5, None, 4), (9, 4, 4)])
def test_prologue_places_the_shared_experts_pairs_first(tokens, first_expert, block_m):
    """With the shared expert, its blocks come first (token t's pair T·k + t in slot t; 5 and 9 tokens in
    4-row blocks leave a ragged last one), then the routed blocks exactly as without it."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    routing_ = random_routing(g, 64, 12, 3)
    local = 12 if first_expert is None else 4
    span = {"first_expert": first_expert, "num_experts": local}
    ids, _, layout, _, _ = decode.prologue(x, routing_, block_m, quantize=False, shared=True, **span)
    _, _, alone, _, _ = decode.prologue(x, routing_, block_m, quantize=False, **span)
    shared_blocks = -(-tokens // block_m)
    expert, rows = layout.block_expert, layout.block_rows
    assert (expert[:shared_blocks] == routing.SHARED_EXPERT.value).all()
    assert rows[:shared_blocks].tolist() == [min(block_m, tokens - b * block_m) for b in range(shared_blocks)]
    assert layout.pairs[:tokens].tolist() == [ids.numel() + t for t in range(tokens)]
    assert torch.equal(expert[shared_blocks:], alone.block_expert)
    assert torch.equal(rows[shared_blocks:], alone.block_rows)
    routed = routing.Alignment(
        layout.pairs[shared_blocks * block_m :], expert[shared_blocks:], rows[shared_blocks:], block_m
    )
    assert_alignment(routed, ids, local, block_m, first_expert)


def rank_experts(
    w: ExpertWeights, first_expert: int | None, num_experts: int, local: int = 4
) -> ExpertWeights:
    """The experts a rank holding `[first_expert, first_expert + local)` has (all `num_experts` for None)."""
    held = slice(first_expert or 0, num_experts if first_expert is None else first_expert + local)
    scales = None if w.scales is None else tuple(s[held] for s in w.scales)
    return ExpertWeights(w.gate_up[held], w.down[held], scales)


def shared_output(x: torch.Tensor, experts: Experts, fp8: bool) -> torch.Tensor:
    """The shared expert's output (expert 0) by the general kernel path, as a routed pair of weight 1:
    the rows the three launches add in their combine."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
    return kernels.experts(
        x, experts.fp8 if fp8 else experts.plain, Choices(ids, torch.ones(ids.shape)), LIMIT
    )


# (tokens, top_k, first_expert): one token; ragged 16-row blocks; every pair of the path (8 × 8 = 64),
# so 8 shared rows beside 64 routed; a rank holding experts [4, 8) of 12 (its pairs only, plus the shared)
FOLD_CASES = [(1, 3, None), (5, 4, None), (8, 8, None), (6, 4, 4)]


@pytest.mark.parametrize(("tokens", "top_k", "first_expert"), FOLD_CASES)
@pytest.mark.parametrize(
    ("fp8", "dtype"), [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)]
)
def test_the_shared_expert_joins_the_routed_launches(tokens, top_k, first_expert, fp8, dtype):
    """The shared expert computed as one more pair of each token in the same three launches: its own
    tensors (not stacked with the routed ones), against the step with its output as the addend and
    against the reference of routed + shared.

    Tolerances: against the addend step, the same quantisation and GEMM rows; only the fp32 sums of the
    shared rows' K products may run in another order (a few ulps of fp32: 1e-6), and bf16 rows round
    once each as there (one bf16 ulp, 2^-8, on a few elements: 4e-3). Against the reference: exact
    fp32 math up to summation order on the plain weights (2e-6); e4m3 activations on the FP8 weights,
    a few percent (0.1, as for the routed step alone). Leaving the shared expert out misses by ~0.5."""
    g = torch.Generator().manual_seed(10 * tokens + top_k)
    hidden, inter, num_experts = 160, 128, 12
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routing_ = random_routing(g, hidden, num_experts, top_k)
    routing_ = routing_._replace(weight=routing_.weight.to(dtype))
    experts, shared_experts = Experts(g, hidden, inter, num_experts), Experts(g, hidden, inter, 1)
    w = rank_experts(experts.fp8 if fp8 else experts.plain, first_expert, num_experts)
    shared = shared_experts.shared(fp8)
    out = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first_expert, shared=shared)
    assert not decode.tickets(x.device).any()
    rows = shared_output(x, shared_experts, fp8)
    joined = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first_expert, addend=rows)
    close = 1e-6 if dtype == torch.float32 else 4e-3
    assert out.dtype == dtype and rel_err(out, joined) < close
    choices = reference.route(x, routing_)
    plain = rank_experts(experts.plain, first_expert, num_experts)
    truth = reference.experts(x.float(), plain, choices, LIMIT, first_expert, shared_experts.shared(False))
    assert rel_err(out, truth) < (0.1 if fp8 else 2e-6)
    routed_only = reference.experts(x.float(), plain, choices, LIMIT, first_expert)
    assert rel_err(routed_only, truth) > 0.2  # the shared expert's part is large enough to be seen


@pytest.mark.parametrize(("tokens", "first_expert"), [(1, 4), (5, None)])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_a_narrower_shared_expert_joins_the_routed_launches(tokens, first_expert, fp8):
    """A tensor-parallel rank's slice of the shared expert (intermediate 128 beside the routed experts'
    256) joins the three launches too: its blocks end their column tiles at its width and its down
    walks its own K. One token at a rank of 4 of 12 experts also splits the gate|up K (4 ways here).
    Tolerances as in the test above (fp32 rows, one shared block's sums in another order)."""
    g = torch.Generator().manual_seed(20 + tokens)
    hidden, inter, width, num_experts, top_k = 512, 256, 128, 12, 4
    x = torch.randn(tokens, hidden, generator=g)
    routing_ = random_routing(g, hidden, num_experts, top_k)
    experts, shared_experts = Experts(g, hidden, inter, num_experts), Experts(g, hidden, width, 1)
    w = rank_experts(experts.fp8 if fp8 else experts.plain, first_expert, num_experts)
    shared = shared_experts.shared(fp8)
    assert kernels.shared_refusal(w, shared) is None
    out = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first_expert, shared=shared)
    assert not decode.tickets(x.device).any()
    rows = shared_output(x, shared_experts, fp8)
    joined = decode.routed_experts(x, routing_, w, LIMIT, first_expert=first_expert, addend=rows)
    assert rel_err(out, joined) < 1e-6
    choices = reference.route(x, routing_)
    plain = rank_experts(experts.plain, first_expert, num_experts)
    truth = reference.experts(x, plain, choices, LIMIT, first_expert, shared_experts.shared(False))
    assert rel_err(out, truth) < (0.1 if fp8 else 2e-6)


def test_the_reference_adds_the_shared_expert_after_the_routed_sum():
    """`reference.experts` with the shared expert is the routed sum in x's dtype plus `shared_expert`, the
    SwiGLU-clamp MLP of its dequantised weights (gate rows first)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 128, generator=g)
    routing_, experts = random_routing(g, 128, 6, 2), Experts(g, 128, 128, 6)
    choices = reference.route(x, routing_)
    gate_up, down = experts.gate_up[0], experts.down[0]
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    mlp = reference.swiglu_clamp(gate, up, LIMIT) @ down.t()
    assert torch.equal(reference.shared_expert(x, experts.shared(False), LIMIT), mlp)
    routed = reference.experts(x, experts.plain, choices, LIMIT)
    assert torch.equal(
        reference.experts(x, experts.plain, choices, LIMIT, shared=experts.shared(False)), routed + mlp
    )
    fp8 = reference.shared_expert(x, experts.shared(True), LIMIT)
    dequantized = [
        fp8_ops.dequantize_fp8_blocks(q, s, x.dtype)
        for q, s in ((experts.gate_up_q[0], experts.gate_up_s[0]), (experts.down_q[0], experts.down_s[0]))
    ]
    assert torch.equal(fp8, reference.shared_expert(x, SharedExpert(*dequantized), LIMIT))


def test_a_shared_expert_of_another_layout_is_refused():
    """The kernels read the shared expert through the routed experts' tiles: a wider intermediate, a
    narrower one in partial FP8 scale blocks, another format or row stride is named; a narrower one
    (a tensor-parallel slice) is taken."""
    g = torch.Generator().manual_seed(12)
    experts, narrow, wide = Experts(g, 128, 128, 4), Experts(g, 128, 64, 1), Experts(g, 128, 256, 1)
    assert kernels.shared_refusal(experts.plain, experts.shared(False)) is None
    assert kernels.shared_refusal(experts.fp8, experts.shared(True)) is None
    assert kernels.shared_refusal(experts.plain, narrow.shared(False)) is None
    assert "256 is not at most a routed expert's (128)" in kernels.shared_refusal(
        experts.plain, wide.shared(False)
    )
    assert "in whole 128-wide scale blocks" in kernels.shared_refusal(experts.fp8, narrow.shared(True))
    assert "not both FP8" in kernels.shared_refusal(experts.fp8, experts.shared(False))
    strided = experts.shared(False)._replace(down=torch.cat([experts.down[0]] * 2, dim=1)[:, ::2])
    assert "strides" in kernels.shared_refusal(experts.plain, strided)
    x = torch.randn(2, 128, generator=g)
    routing_ = random_routing(g, 128, 4, 2)
    with pytest.raises(ValueError, match="is not at most a routed expert's"):
        decode.routed_experts(x, routing_, experts.plain, LIMIT, shared=wide.shared(False))
    with pytest.raises(ValueError, match="pass one of the two"):
        decode.routed_experts(x, routing_, experts.plain, LIMIT, addend=x, shared=experts.shared(False))


def forced_use_kernel(op, tensor, verify=None, **_):
    """`dispatch.use_kernel` as for a CUDA tensor: the verifier decides (the kernels run interpreted)."""
    return verify is None or verify() is None


def test_the_dispatcher_folds_the_shared_expert_where_the_rule_allows(monkeypatch):
    """`moe_ops.shared_refusal` is the one rule: off CUDA, and on CUDA past the decode path's pairs or for
    a shared expert of another layout, it names why, and `routed_experts` refuses `shared=`; where it
    is None, `routed_experts` runs the three launches with the shared expert."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 64, generator=g)
    routing_, experts = random_routing(g, 64, 8, 4), Experts(g, 64, 128, 8)
    shared = Experts(g, 64, 128, 1).shared(False)
    assert moe_ops.shared_refusal(x, 4, experts.plain, shared) == "not on a CUDA device"
    with pytest.raises(ValueError, match="cannot join the routed launches: not on a CUDA device"):
        moe_ops.routed_experts(x, routing_, experts.gate_up, experts.down, LIMIT, shared=shared)
    monkeypatch.setattr(moe_ops, "use_kernel", forced_use_kernel)
    assert moe_ops.shared_refusal(x, 4, experts.plain, shared) is None
    many = torch.randn(17, 64, generator=g)
    assert "more than the decode path's 64 pairs" in moe_ops.shared_refusal(many, 4, experts.plain, shared)
    wide = Experts(g, 64, 256, 1).shared(False)
    assert "is not at most a routed expert's" in moe_ops.shared_refusal(x, 4, experts.plain, wide)
    out = moe_ops.routed_experts(x, routing_, experts.gate_up, experts.down, LIMIT, shared=shared)
    assert torch.equal(out, decode.routed_experts(x, routing_, experts.plain, LIMIT, shared=shared))


def moe_layer(fp8: bool) -> MoE:
    """A small MoE layer (8 experts, top-2, D = I = 128, one shared expert of the routed experts' shape),
    its experts and shared MLP FP8 (block-quantised from the random weights) or fp32."""
    config = ModelConfig(
        hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"],
        indexer_types=["full"], swiglu_limit=LIMIT,
    )  # fmt: skip
    torch.manual_seed(14)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=128**-0.5)
    moe.requires_grad_(False)  # inference: the kernels have no backward
    if fp8:
        moe.experts = FP8Experts.from_experts(moe.experts)
        for linear in (moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj):
            weight, scale = fp8_ops.quantize_fp8_blocks(linear.weight.detach())
            linear.to_fp8_()
            linear.weight.data.copy_(weight)
            linear.weight_scale_inv.copy_(scale)
    return moe


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_the_moe_layer_folds_its_shared_expert_into_the_decode_launches(monkeypatch, fp8):
    """With the kernels dispatched as on CUDA, a decode-sized step of `MoE` runs its shared expert inside
    the routed launches (its MLP never runs) and gives the reference path's output; a step past the
    decode path's pairs runs the MLP and adds its output. Tolerances as for the routed step: fp32 math
    up to summation order (1e-5), e4m3 activations on the FP8 weights (0.1)."""
    moe = moe_layer(fp8)
    mlp_runs = []
    moe.shared_experts.register_forward_hook(lambda *_: mlp_runs.append(1))
    x, prefill = torch.randn(3, 128), torch.randn(40, 128)  # 6 pairs; 80 pairs, past the 64 of the path
    expected = moe(x)  # off CUDA: the references, the MLP apart
    assert len(mlp_runs) == 1
    monkeypatch.setattr(moe_ops, "use_kernel", forced_use_kernel)
    assert moe.shared_expert() is not None
    out = moe(x)
    assert len(mlp_runs) == 1, "the folded step runs no MLP of its own"
    assert rel_err(out, expected) < (0.1 if fp8 else 1e-5)
    routed_only = moe.routed(x)
    assert rel_err(routed_only, expected) > 0.2  # the shared expert's part is large enough to be seen
    moe(prefill)
    assert len(mlp_runs) == 2


def test_a_shared_mlp_unlike_one_expert_stays_apart():
    """`MoE.shared_expert` is None where the MLP's gate|up is not one weight of gate rows then up rows (here
    its up part is left unquantised, in the dense weight): its MLP runs apart."""
    moe = moe_layer(fp8=False)
    assert moe.shared_expert() is not None
    moe.shared_experts.gate_up_proj.to_fp8_(["gate_proj"])  # up moves to the dense (model dtype) weight
    assert moe.shared_expert() is None


_HOPPER_COMPILE = """
import sys
sys.path.insert(0, BENCHMARKS)
import code_size

step = code_size.moe_experts(TOKENS, RANKS, FP8, WIDTH, GENERAL)
print(" ".join(sorted({launch["kernel"] for launch in code_size.compiled_launches(step)})))
"""


# (FP8, shared expert width (0: none), ranks (1: every expert, 8: rank 0 of a TP8/EP8 split), tokens,
# the general path instead of the decode path)
HOPPER_CASES = {
    "fp8": (True, 0, 1, 8, False),
    "fp8-shared": (True, 2048, 1, 1, False),
    "fp8-rank-shared": (True, 2048, 8, 8, False),
    "fp8-rank-slice-split": (True, 256, 8, 1, False),
    "bf16-shared": (False, 2048, 1, 8, False),
    "fp8-general": (True, 0, 1, 100, True),
    "fp8-general-tma": (True, 0, 1, 8192, True),
}
DECODE_LAUNCHES = ["_down_combine_kernel", "_gate_up_kernel", "_prologue_kernel"]


@pytest.mark.parametrize("case", HOPPER_CASES)
def test_the_decode_kernels_compile_for_hopper(case):
    """The three launches of a decode step with FP8 or bf16 weights, with and without the shared
    expert, at a TP8/EP8 rank (its pairs only; one token with the shared expert's slice: the gate|up K
    split 8 ways), and the general path's GEMMs (the TMA ones at 8192 tokens), compiled for sm_90a as
    the GPU builds them (no GPU needed: `code_size`'s compile): the interpreter does not check Triton's
    typing rules (the per-block choice of the shared or a stacked expert's pointers, the operand
    bundles' fields), nor its rounding of fp32 to bf16 (see the addend test)."""
    fp8, width, ranks, tokens, general = HOPPER_CASES[case]
    script = f"FP8, WIDTH, RANKS, TOKENS, GENERAL = {fp8}, {width}, {ranks}, {tokens}, {general}\n"
    script = f"BENCHMARKS = {str(BENCHMARKS)!r}\n" + script + _HOPPER_COMPILE
    kernels_compiled = run_compiled_for_hopper(script).split()
    if general:  # 16-row blocks at 100 tokens, the TMA kernels at 8192
        gemms = (
            {"_gate_up_tma_kernel", "_down_tma_kernel"}
            if tokens > 100
            else {"_gate_up_kernel", "_down_kernel"}
        )
        assert gemms <= set(kernels_compiled), kernels_compiled
    else:
        assert kernels_compiled == DECODE_LAUNCHES
