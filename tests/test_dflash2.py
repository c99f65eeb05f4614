"""DFlash2 drafts: the grouped block conv and candidate selector against a plain re-implementation,
greedy losslessness through the engine, and config validation."""

from __future__ import annotations

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
from hylo.models.dflash import CandidateSelector, DFlashConfig, DFlashDraftModel, GroupedBlockConv
from hylo.models.loader import load_flat

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
    unary, candidates = logits.topk(selector.top_k, dim=-1)
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
    alike (to the first of the tied candidates in `topk` order)."""
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
    selector.register_forward_hook(lambda module, args, out: selections.append(out.shape))
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
