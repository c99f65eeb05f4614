"""The same seed gives the same tokens whatever the schedule: plain decoding, DFlash, DFlash2 and MTP
speculation (the draft-length policy adaptive, or forced to alternate verify and plain steps), the
overlap schedule on and off, a request alone or in a batch with others (`hylo.speculative.verify`'s
proof, end to end on the CPU test models)."""

from __future__ import annotations

import pytest
from conftest import EveryKth, random_prompt
from dflash_reference import write_dflash_checkpoint
from mtp_checkpoint import write_mtp_target

from hylo import LLM, SamplingParams
from hylo.speculative.proposer import Proposer, write_drafts
from hylo.speculative.verify import VerifyShape

VOCAB, HIDDEN, BLOCK = 160, 64, 4
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True)
    for seed, n in ((1234, 24), (77, 19), (2**64 - 5, 22))
]
PROMPTS = [random_prompt(n, VOCAB, seed=600 + n) for n in (5, 13, 21)]
# the others in the batch: unseeded sampling, greedy, another temperature, a longer prompt
OTHERS = [
    (random_prompt(9, VOCAB, seed=1), SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)),
    (random_prompt(30, VOCAB, seed=2), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    (random_prompt(3, VOCAB, seed=3), SamplingParams(temperature=1.3, top_k=20, max_tokens=26)),
]


class KnownContinuations(Proposer):
    """Drafts each request's continuation as plain decoding made it (`truth`: prompt -> output), wrong
    at every 5th output position, zeros for a prompt it does not know: drafts fixed by the committed
    prefix, as every real proposer's are, and accepted far more often than a random draft's (it drafts
    on the host, after the step's read)."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]]):
        self.truth, self.verify_shape = truth, VerifyShape(BLOCK)

    def propose(self, batch, commit):
        rows, drafts = [], []
        for c in commit.host:
            if c.new_tokens:
                n = len(c.request.output_ids) + len(c.new_tokens)  # the step's tokens are not appended yet
                known = self.truth.get(tuple(c.request.prompt_ids), [])[n : n + BLOCK - 1]
                rows.append(c.request.slot)
                drafts.append([(t + 1) % VOCAB if (n + j) % 5 == 4 else t for j, t in enumerate(known)])
        write_drafts(self.drafts, rows, drafts)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(a target with an MTP layer over the 4-layer mix of every layer kind, a DFlash draft for it, a
    DFlash2 draft for it). Which steps verify and which noise a position reads do not depend on the depth;
    3 Sinkhorn iterations of the mHC weights (the model's 20 are checked in test_mhc_kernels and
    test_hf_parity): that loop was ~20% of each CPU step."""
    root = tmp_path_factory.mktemp("schedule")
    target = write_mtp_target(root, "each-kind", hc_sinkhorn_iters=3)
    dflash = write_dflash_checkpoint(root / "dflash", HIDDEN, VOCAB, [0, 1, 2], seed=5, block_size=BLOCK)
    dflash2 = write_dflash_checkpoint(
        root / "dflash2", HIDDEN, VOCAB, [0, 1, 2], seed=9, block_size=BLOCK, dflash2=DFLASH2
    )
    return target, dflash, dflash2


def seeded_runs(llm: LLM) -> tuple[list, list]:
    """The seeded requests' outputs run one at a time, then in one batch behind the others."""
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0]
        for p, s in zip(PROMPTS, SEEDED, strict=True)
    ]
    prompts = [p for p, _ in OTHERS] + PROMPTS
    params = [s for _, s in OTHERS] + SEEDED
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return alone, batched[len(OTHERS) :]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(str(models[0]), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25)
    alone, batched = seeded_runs(llm)
    assert tokens(alone) == tokens(batched)
    return tokens(alone)


@pytest.mark.parametrize(
    ("algorithm", "policy", "overlap"),
    [
        ("DFLASH", "adaptive", True),
        ("DFLASH", "adaptive", False),
        ("MTP", "adaptive", True),
        ("MTP", "adaptive", False),
        ("DFLASH2", "adaptive", True),
        ("known", "alternating", True),
        ("known", "alternating", False),
    ],
)
def test_seeded_sampling_gives_plain_decodings_tokens_under_speculation(
    models, plain, algorithm, policy, overlap
):
    """DFlash, DFlash2 and MTP drafts (random drafts: rarely accepted; on the CPU the adaptive policy
    runs both verify and plain steps) and drafts of plain decoding's continuation (accepted in most
    blocks, rejected at every 5th position) under a policy that alternates the two."""
    target, dflash, dflash2 = models
    if algorithm == "known":
        spec = {"proposer": KnownContinuations(dict(zip(map(tuple, PROMPTS), plain, strict=True)))}
    elif algorithm == "MTP":
        spec = {"speculative_algorithm": "MTP", "speculative_num_steps": BLOCK - 1}
    else:
        path = dflash if algorithm == "DFLASH" else dflash2
        spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(path)}
    llm = LLM(
        str(target), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25,
        disable_overlap_schedule=not overlap, speculative_adaptive=True, **spec,
    )  # fmt: skip
    engine = llm.engine
    if policy == "alternating":  # a verify step every 3rd decode step, plain steps between
        engine.policy = EveryKth(3)
    alone, batched = seeded_runs(llm)
    assert tokens(alone) == plain
    assert tokens(batched) == plain
    if algorithm == "known":  # the sampled rows accepted drafts
        assert sum(o.metrics.spec_accepted_tokens for o in alone + batched) > len(plain) * 10
    if policy == "adaptive":
        assert min(engine.policy.choices.values()) > 0, engine.policy.choices
