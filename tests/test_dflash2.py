"""DFlash2 drafts: the grouped block conv and candidate selector against a plain re-implementation,
greedy losslessness through the engine, and config validation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import random_prompt
from dflash_reference import (
    per_tap_block_conv,
    reference_dflash2,
    sequential_selector_path,
    write_dflash_checkpoint,
)
from hf_reference import tiny_text_config, write_hf_checkpoint
from tolerance import assert_fp32_close, draft_accumulation_terms

from hylo import LLM, SamplingParams
from hylo.layers.vocab import VocabHead
from hylo.models.dflash import CandidateSelector, DFlashConfig, DFlashDraftModel, GroupedBlockConv
from hylo.models.loader import load_flat
from hylo.ops.topk import top_k

HIDDEN, VOCAB, BLOCK = 64, 160, 4
OPTIONS = {
    "conv_kernel_size": 3,
    "conv_group_size": 16,
    "selector_rank": 8,
    "selector_top_k": 6,
    "output_multiplier": 0.7,
    "final_logit_softcapping": 2.5,
    "input_embedding_scale": 1.3,
}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return write_dflash_checkpoint(
        tmp_path_factory.mktemp("dflash2"),
        HIDDEN,
        VOCAB,
        [0, 2, 4],
        seed=7,
        block_size=BLOCK,
        dflash2=OPTIONS,
    )


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("speculative_adaptive", False)  # every decode step verifies
    return LLM(str(path), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25, **kwargs)


def test_draft_forward_and_selector_match_the_plain_reimplementation(draft):
    """Two requests with different context lengths drafted in one batch (so a conv leaking across
    block boundaries, or mapping channels to the wrong group, would show), against the reference
    computed one request at a time from the checkpoint's tensors."""
    c = DFlashConfig.from_dir(draft)
    assert c.dflash2 is not None and c.dflash2.selector_top_k == OPTIONS["selector_top_k"]
    model = DFlashDraftModel(c)
    load_flat(model, draft)
    gen = torch.Generator().manual_seed(3)
    starts = [9, 5]
    features = [torch.randn(n, 3 * HIDDEN, generator=gen) for n in starts]
    blocks = torch.randn(2, BLOCK, HIDDEN, generator=gen)
    anchors = torch.tensor([11, 42])
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=HIDDEN**-0.5, generator=gen)

    longest = max(starts)
    ctx_pos = torch.arange(longest).expand(2, -1)
    ctx_valid = ctx_pos < torch.tensor(starts)[:, None]
    padded = [torch.cat([f, torch.zeros(longest - len(f), f.shape[1])]) for f in features]
    per_layer = [model.context_kv(p, torch.arange(longest)) for p in padded]
    ctx_kv = [
        tuple(torch.stack(kv) for kv in zip(*layer, strict=True)) for layer in zip(*per_layer, strict=True)
    ]
    positions = torch.tensor(starts)[:, None] + torch.arange(BLOCK)
    with torch.no_grad():
        hidden = model(blocks, positions, ctx_kv, ctx_pos, ctx_valid)
        drafts = model.propose(hidden[:, 1:], anchors, head)

    for r in range(2):
        expected_hidden, expected_drafts = reference_dflash2(
            draft, features[r], blocks[r], int(anchors[r]), head.weight.detach()
        )
        assert_fp32_close(hidden[r], expected_hidden, draft_accumulation_terms(model.config))
        assert drafts[r].tolist() == expected_drafts
    # The selector's pairwise term decides somewhere: plain argmax would propose other tokens.
    with torch.no_grad():
        assert not torch.equal(drafts, model.logits(hidden[:, 1:], head).argmax(-1))


@pytest.mark.parametrize(
    ("rows", "block", "taps"),
    [(1, 8, 4), (3, 8, 4), (2, 3, 4), (2, 1, 3), (2, 5, 1), (2, 4, 4)],
    ids=["demo-R1", "demo-R3", "block-shorter-than-taps", "one-row", "one-tap", "block-equals-taps"],
)
def test_block_conv_equals_the_per_tap_loop(rows, block, taps):
    """The windowed contraction against the tap-by-tap loop, forward and gradients. Both form the same
    products; only the order of each output's `taps`-term sum differs (and, in the gradients, the
    order of the sums over rows and over a group's channels), so K is the longest of those sums."""
    group, gen = 16, torch.Generator().manual_seed(100 * rows + 10 * block + taps)
    conv = GroupedBlockConv(HIDDEN, taps, group)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=gen))
    x = torch.randn(rows, block, HIDDEN, generator=gen, requires_grad=True)
    deltas = torch.randn(rows, block, taps, HIDDEN // group, generator=gen, requires_grad=True)
    terms = max(taps, group, rows * block)
    for side in (0, 1):
        out = conv.convolve(x, deltas, side)
        expected = per_tap_block_conv(x, conv.base_kernel[side], deltas, group)
        assert_fp32_close(out, expected, terms, f"side {side}")
        upstream = torch.randn(out.shape, generator=gen)
        inputs = (x, deltas, conv.base_kernel)
        grads = torch.autograd.grad(out, inputs, upstream)
        expected_grads = torch.autograd.grad(expected, inputs, upstream)
        for name, got, want in zip(("x", "deltas", "base_kernel"), grads, expected_grads, strict=True):
            assert_fp32_close(got, want, terms, f"side {side}, grad of {name}")


def _random_selector(top_k: int, gen: torch.Generator, integers: bool) -> CandidateSelector:
    """Random weights; `integers`: each in {-1, 0, 1}, mostly 0, so that (with integer hidden states
    and logits) every score is a small integer, exact in fp32 in any summation order, and exact ties
    are common."""
    selector = CandidateSelector(HIDDEN, VOCAB, OPTIONS["selector_rank"], top_k)
    with torch.no_grad():
        for weight in selector.parameters():
            if integers:  # a quarter non-zero: pair terms of a few units, like the logits' spread
                nonzero = torch.rand(weight.shape, generator=gen) < 0.25
                weight.copy_(torch.randint(-1, 2, weight.shape, generator=gen) * nonzero)
            else:
                weight.copy_(torch.randn(weight.shape, generator=gen) * weight.shape[-1] ** -0.5)
    return selector


def _tied_rows(selector, hidden, logits, anchors, path) -> int:
    """How many rows of `path` were chosen among several candidates of exactly the best score."""
    unary, candidates = top_k(logits, selector.top_k)
    previous = torch.cat([anchors[:, None], path[:, :-1]], 1)
    pair = torch.einsum(
        "rpd,rpd,rpkd->rpk", selector.predecessor_codebook[previous], selector.hidden_projection(hidden),
        selector.successor_codebook[candidates],
    )  # fmt: skip
    scores = unary + pair
    return int(((scores == scores.amax(-1, keepdim=True)).sum(-1) > 1).sum())


@pytest.mark.parametrize(
    ("rows", "drafted", "top_k"),
    [(1, 7, 8), (8, 7, 8), (3, 1, 4), (4, 2, 5), (2, 3, 6), (5, 8, 3), (3, 13, 6)],
)
@pytest.mark.parametrize("integers", [False, True], ids=["random", "exact-ties"])
def test_selector_path_equals_the_sequential_walk(rows, drafted, top_k, integers):
    """The batched scores and composed path against the row-by-row walk. With random fp32 weights the
    pair scores differ only in summation order (a tie to the last bit is vanishingly unlikely); with
    integer weights, hidden states and logits every score is exact, so the exact ties must resolve
    alike (to the first of the tied candidates in `ops.topk` order)."""
    gen = torch.Generator().manual_seed(1000 * rows + 10 * drafted + top_k)
    selector = _random_selector(top_k, gen, integers)
    if integers:
        hidden = torch.randint(-1, 2, (rows, drafted, HIDDEN), generator=gen).float()
        logits = torch.randint(0, 4, (rows, drafted, VOCAB), generator=gen).float()
    else:
        hidden = torch.randn(rows, drafted, HIDDEN, generator=gen)
        logits = torch.randn(rows, drafted, VOCAB, generator=gen)
    anchors = torch.randint(0, VOCAB, (rows,), generator=gen)
    with torch.no_grad():
        path = selector(hidden, logits, anchors)
        expected = sequential_selector_path(selector, hidden, logits, anchors)
        ties = _tied_rows(selector, hidden, logits, anchors, expected)
    assert torch.equal(path, expected)
    assert (ties > 0) == integers, f"{ties} rows chose among tied candidates"


# --- Candidates from the head's raw output (propose) against the capped logits' top-k (the composition
# propose used before, and training still uses). The old composition is written here, apart from the
# model, so that a wrong transform in the model cannot hide on both sides.
TOP_K = OPTIONS["selector_top_k"]
ROWS, DRAFTED = 4, BLOCK - 1


def _capped_logits(raw: torch.Tensor, multiplier: float, cap: float | None) -> torch.Tensor:
    """The proposal logits over the whole vocabulary, as `propose` formed them before taking the top-k:
    the head's output in fp32, scaled, then soft-capped."""
    logits = raw.float() * multiplier
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _transform_rounding(cap: float | None) -> float:
    """How far a kept value may be from the capped logits' own: the same fp32 ops on the same inputs,
    but tanh runs over k entries instead of V, so an entry may take torch's vectorised CPU tanh in one
    and its scalar tail in the other; each is within 2 ulp of tanh (2^-24 below 1), so they are within
    4 · 2^-24 of each other, times cap, plus the product's rounding on each side (half an ulp of a value
    below cap: cap · 2^-24): 6 · cap · 2^-24. Without a cap the transform is one IEEE multiply: exact.
    A transform left out or done in bf16 is off by 2^-9 of the value or more."""
    return 0.0 if cap is None else 6 * cap * 2**-24


class _GivenHead(torch.nn.Module):
    """A head whose output `raw [R, P, V]` is given (its dtype is the head's), whatever the rows."""

    def __init__(self, raw: torch.Tensor):
        super().__init__()
        self.raw = raw

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw


def _proposing_draft(draft, multiplier: float, cap: float | None, gen, integers: bool) -> DFlashDraftModel:
    """The fixture's DFlash2 draft with this scale and cap and a random selector (`_random_selector`)."""
    c = DFlashConfig.from_dir(draft)
    v2 = dataclasses.replace(c.dflash2, output_multiplier=multiplier, final_logit_softcapping=cap)
    model = DFlashDraftModel(dataclasses.replace(c, dflash2=v2))
    model.candidate_selector = _random_selector(TOP_K, gen, integers)
    return model


def _distinct_raw(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """`[ROWS, DRAFTED, VOCAB]` head output without ties: a shuffle of V distinct values per row (in
    bf16 steps of 12/159 > bf16's spacing of 2^-5 at 6; fp32 draws never tie in practice)."""
    if dtype == torch.float32:
        return 2 * torch.randn(ROWS, DRAFTED, VOCAB, generator=gen)
    values = torch.linspace(-6, 6, VOCAB).to(dtype)
    assert values.unique().numel() == VOCAB
    return values[torch.rand(ROWS, DRAFTED, VOCAB, generator=gen).argsort(-1)]


def _rows_inputs(gen: torch.Generator, integers: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafted rows' hidden states `[ROWS, DRAFTED, H]` and anchors `[ROWS]`."""
    if integers:
        hidden = torch.randint(-1, 2, (ROWS, DRAFTED, HIDDEN), generator=gen).float()
    else:
        hidden = torch.randn(ROWS, DRAFTED, HIDDEN, generator=gen)
    return hidden, torch.randint(0, VOCAB, (ROWS,), generator=gen)


def _assert_kept_values(unary, candidates, logits, cap) -> None:
    """`unary` are `logits`' values at `candidates`, up to the transforms' rounding."""
    assert unary.dtype == torch.float32
    torch.testing.assert_close(unary, logits.gather(-1, candidates), rtol=0, atol=_transform_rounding(cap))


SCALES = [(1.0, None), (0.7, None), (0.7, 2.5)]
SCALE_IDS = ["plain", "scaled", "scaled-capped"]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize(("multiplier", "cap"), SCALES, ids=SCALE_IDS)
def test_candidates_from_the_raw_head_equal_the_capped_logits_top_k(draft, dtype, multiplier, cap):
    """Without ties, the same candidates in the same order, the same values (a wrong transform of the
    kept values, such as a missing cap or one applied in bf16, is off by far more than the rounding
    bound), and the same drafts."""
    gen = torch.Generator().manual_seed(17)
    model = _proposing_draft(draft, multiplier, cap, gen, integers=False)
    hidden, anchors = _rows_inputs(gen, integers=False)
    raw = _distinct_raw(dtype, gen)
    logits = _capped_logits(raw, multiplier, cap)
    expected = top_k(logits, TOP_K)
    assert (top_k(logits, TOP_K + 1).values.diff(dim=-1) < 0).all(), "the test wants no ties in the top k + 1"
    with torch.no_grad():
        unary, candidates = model.top_candidates(hidden, _GivenHead(raw))
        drafts = model.propose(hidden, anchors, _GivenHead(raw))
        composed = model.candidate_selector(hidden, logits, anchors)
    assert torch.equal(candidates, expected.indices)
    _assert_kept_values(unary, candidates, logits, cap)
    assert torch.equal(drafts, composed)


@DTYPES
def test_exact_ties_keep_the_capped_logits_top_k_order(draft, dtype):
    """Integer head values in 0..3 (exact in bf16), integer selector weights and hidden states: many
    candidates tie in their logit, and the selector's total ties among them often enough that the
    draft is the first tied candidate in `ops.topk` order. Equal head values are equal after the transforms
    and no two distinct ones merge (|x / cap| <= 0.84), so `top_k` on either tensor must order them
    alike: the candidates in the same order and the same drafts. Reversing the order of equal
    candidates, or any other tie rule, changes them."""
    multiplier, cap = 0.7, 2.5
    gen = torch.Generator().manual_seed(23)
    model = _proposing_draft(draft, multiplier, cap, gen, integers=True)
    hidden, anchors = _rows_inputs(gen, integers=True)
    raw = torch.randint(0, 4, (ROWS, DRAFTED, VOCAB), generator=gen).to(dtype)
    logits = _capped_logits(raw, multiplier, cap)
    with torch.no_grad():
        unary, candidates = model.top_candidates(hidden, _GivenHead(raw))
        drafts = model.propose(hidden, anchors, _GivenHead(raw))
        composed = model.candidate_selector(hidden, logits, anchors)
        ties = _tied_rows(model.candidate_selector, hidden, logits, anchors, composed)
    assert torch.equal(candidates, top_k(logits, TOP_K).indices)
    _assert_kept_values(unary, candidates, logits, cap)
    assert torch.equal(drafts, composed)
    assert ties > 0, "no draft was chosen among tied candidates: the test would not see a wrong order"


@DTYPES
@pytest.mark.parametrize("saturated", [3, TOP_K + 2], ids=["inside-top-k", "across-the-k-th"])
def test_a_saturating_cap(draft, dtype, saturated):
    """`saturated` head values per row so large (x / cap >= 11, where fp32 tanh is exactly 1) that the
    capped logits tie at cap, and 40 so negative that they tie at -cap. The raw top-k ranks the
    saturated tokens by their head value, the capped top-k by its tie order:

    - inside the top k, the candidate sets are equal and only the order of the equal-valued saturated
      candidates may differ, which the selector cannot see (its random pair terms never tie): the same
      drafts;
    - across the k-th place, the raw top-k keeps the k highest head values, a valid top-k of the capped
      logits (every kept value is cap) that may differ from the one `top_k` picks among the tied: drafts
      may then differ, which is lossless since the target verifies them."""
    multiplier, cap = 0.7, 2.5
    gen = torch.Generator().manual_seed(29)
    model = _proposing_draft(draft, multiplier, cap, gen, integers=False)
    hidden, anchors = _rows_inputs(gen, integers=False)
    raw = _distinct_raw(dtype, gen)
    order = torch.rand(ROWS, DRAFTED, VOCAB, generator=gen).argsort(-1)
    huge = (40 + 4 * torch.arange(saturated)).to(dtype)  # exact in bf16
    raw.scatter_(-1, order[..., :saturated], huge.expand(ROWS, DRAFTED, -1))
    raw.scatter_(-1, order[..., saturated : saturated + 40], -huge[:1].expand(ROWS, DRAFTED, 40))
    logits = _capped_logits(raw, multiplier, cap)
    assert ((logits == cap).sum(-1) == saturated).all() and ((logits == -cap).sum(-1) == 40).all()
    with torch.no_grad():
        unary, candidates = model.top_candidates(hidden, _GivenHead(raw))
        drafts = model.propose(hidden, anchors, _GivenHead(raw))
    assert torch.equal(candidates, top_k(raw.float(), TOP_K).indices)  # the highest head values first
    _assert_kept_values(unary, candidates, logits, cap)
    torch.testing.assert_close(unary, top_k(logits, TOP_K).values, rtol=0, atol=_transform_rounding(cap))
    if saturated < TOP_K:
        expected = top_k(logits, TOP_K).indices
        assert torch.equal(candidates.sort(-1).values, expected.sort(-1).values)
        assert torch.equal(drafts, model.candidate_selector(hidden, logits, anchors))


def test_a_token_map_head_with_a_saturating_cap_keeps_its_candidates_in_the_map(draft):
    """A hot-token head (`speculative_token_map`) gives -inf outside its map. Capped, those became -cap:
    with most of the map's logits saturated at -cap too, the capped logits' top-k took tokens outside
    the map. The raw top-k ranks -inf below every map token: its candidates are map tokens (global ids),
    the k best of the map by head value. Rows' logits are set through the head's first weight column
    (hidden[..., 0] = 1, the other columns 0): 3 moderate map tokens, 5 saturating at -cap."""
    multiplier, cap = 0.7, 2.5
    gen = torch.Generator().manual_seed(31)
    model = _proposing_draft(draft, multiplier, cap, gen, integers=False)
    hidden, anchors = _rows_inputs(gen, integers=False)
    hidden[..., 0] = 1
    token_map = torch.randperm(VOCAB, generator=gen)[: TOP_K + 2].sort().values
    head = VocabHead(HIDDEN, VOCAB)
    head.weight.data.zero_()
    map_logits = torch.tensor([0.5, 1.0, 1.5, -40.0, -44.0, -48.0, -52.0, -56.0])
    head.weight.data[token_map[torch.randperm(TOP_K + 2, generator=gen)], 0] = map_logits
    hot = head.restricted(token_map)
    with torch.no_grad():
        logits = _capped_logits(hot(hidden), multiplier, cap)
        unary, candidates = model.top_candidates(hidden, hot)
        drafts = model.propose(hidden, anchors, hot)
    assert not torch.isin(top_k(logits, TOP_K).indices, token_map).all(), "the capped top-k stayed in the map"
    assert torch.isin(candidates, token_map).all() and torch.isin(drafts, token_map).all()
    best = head.weight.data[:, 0].masked_fill(~torch.isin(torch.arange(VOCAB), token_map), float("-inf"))
    assert torch.equal(candidates, top_k(best, TOP_K).indices.expand_as(candidates))
    _assert_kept_values(unary, candidates, logits, cap)


def test_a_token_map_head_proposes_as_the_capped_logits_do(draft):
    """Without saturation a hot-token head's drafts are the composition's: the candidates are global
    token ids (the head scatters its map's logits into the vocabulary), not indices into the map."""
    multiplier, cap = 0.7, 2.5
    gen = torch.Generator().manual_seed(37)
    model = _proposing_draft(draft, multiplier, cap, gen, integers=False)
    hidden, anchors = _rows_inputs(gen, integers=False)
    head = VocabHead(HIDDEN, VOCAB)
    torch.nn.init.normal_(head.weight, std=HIDDEN**-0.5, generator=gen)
    hot = head.restricted(torch.randperm(VOCAB, generator=gen)[:40].sort().values)
    with torch.no_grad():
        logits = _capped_logits(hot(hidden), multiplier, cap)
        drafts = model.propose(hidden, anchors, hot)
        assert torch.equal(drafts, model.candidate_selector(hidden, logits, anchors))
    assert torch.isin(drafts, hot.ids).all()


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("vocab", [8192, 154880], ids=["demo-vocab", "glm-vocab"])
def test_topk_orders_bf16_ties_as_their_fp32_transforms(device, vocab):
    """The tie argument at serving sizes, on the CPU and on the GPU (where `ops.topk.top_k` is the Triton
    kernel, on the CPU the reference): bf16 head values with many exact ties (multiples of 1/4 in
    -8..8), capped without merging (|x / cap| <= 0.19), k = 8 as the demo's: `top_k` on the bf16 values
    and on their fp32 transforms keeps the same indices in the same order, and the kept values
    transformed are the transforms' top-k values (bit for bit on CUDA, one result per input value;
    within the tanh bound on the CPU)."""
    multiplier, cap, k = 0.7, 30.0, 8
    gen = torch.Generator(device=device).manual_seed(41)
    raw = (torch.randint(-32, 33, (4, 7, vocab), generator=gen, device=device) / 4).bfloat16()
    logits = _capped_logits(raw, multiplier, cap)
    values, indices = top_k(raw, k)
    expected = top_k(logits, k)
    assert torch.equal(indices, expected.indices)
    tolerance = 0.0 if device == "cuda" else _transform_rounding(cap)
    torch.testing.assert_close(
        _capped_logits(values, multiplier, cap), expected.values, rtol=0, atol=tolerance
    )


def test_dflash2_greedy_is_lossless_on_a_batch_of_16(tmp_path, draft):
    target = write_hf_checkpoint(tmp_path / "target", tiny_text_config(4, 8), seed=21)
    prompts = [
        random_prompt(n, VOCAB, seed=500 + n)
        for n in (3, 9, 17, 25, 33, 41, 5, 12, 20, 28, 36, 44, 7, 15, 23, 31)
    ]
    plain = make_llm(target).generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    spec_llm = make_llm(target, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    selections = []
    selector = spec_llm.engine.proposer.draft.candidate_selector
    choose = selector.choose

    def recording_choose(*args):
        path = choose(*args)
        selections.append(path.shape)
        return path

    selector.choose = recording_choose
    spec = spec_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.metrics.spec_verify_steps > 0 for o in spec)
    assert selections and all(shape[1] == BLOCK - 1 for shape in selections)


def test_dflash2_vocabulary_must_match_the_target(tmp_path):
    target = write_hf_checkpoint(tmp_path / "target", tiny_text_config(4, 8), seed=2)
    draft = write_dflash_checkpoint(tmp_path / "d", HIDDEN, VOCAB - 8, [0], seed=1, dflash2=OPTIONS)
    with pytest.raises(ValueError, match="vocab_size 152 != target vocab_size 160"):
        make_llm(target, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 64"),
        ({"selector_top_k": VOCAB + 1}, "selector_top_k 161 exceeds vocab_size 160"),
        ({"conv_kernel_size": 0}, "conv_kernel_size must be a positive integer"),
        ({"conv_kernel_size": BLOCK + 1}, "conv_kernel_size 5 exceeds block_size 4"),
        ({"selector_rank": 2.5}, "selector_rank must be a positive integer"),
        ({"selector_rank": None}, "lacks selector_rank"),
        ({"output_multiplier": 0}, "output_multiplier must be positive"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be >= 0"),
    ],
)
def test_config_errors_name_the_field(draft, tmp_path, change, field):
    config = json.loads((draft / "config.json").read_text())
    options = config["dflash_config"]
    for key, value in change.items():
        if value is None:
            del options[key]
        else:
            options[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        DFlashConfig.from_dir(tmp_path)


def test_a_dflash_draft_ignores_dflash2_keys_and_has_no_conv_or_selector(draft, tmp_path):
    """The architecture, not the presence of keys, decides the format."""
    config = json.loads((draft / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = DFlashConfig.from_dir(tmp_path)
    names = {n for n, _ in DFlashDraftModel(c).named_parameters()}
    assert c.dflash2 is None and not any("conv" in n or "selector" in n for n in names)
