"""MTP speculative decoding: greedy losslessness, the drafts against a from-scratch reference built on
HF's decoder layer, the loader's key layout and errors, and the flags."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from allocation_meter import AllocationMeter, largest_fp32_bytes
from conftest import Caches, random_prompt, run_every_kth
from hf_reference import hf_model, tiny_text_config, write_hf_checkpoint
from safetensors.torch import load_file, save_file
from tolerance import assert_fp32_close, model_accumulation_terms

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.request import Status
from hylo.forward_batch import ForwardBatch
from hylo.layers.moe import FP8Experts, MoE
from hylo.memory.manager import weight_bytes
from hylo.memory.specs import TokenCacheSpec
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import CheckpointError, dequantize_fp8, load_model, load_mtp_layer
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.speculative.mtp import MTPProposer
from hylo.speculative.proposer import ProposerCaches, StepCommit

TARGET_LAYERS = 6
VOCAB, HIDDEN = 160, 64
LAYER = f"model.language_model.layers.{TARGET_LAYERS}."
WEIGHTS = "model.safetensors"
MTP_LAYER_KIND = {"layer_types": "indexed_attention", "indexer_types": "full", "mlp_layer_types": "sparse"}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [
    random_prompt(n, VOCAB, seed=400 + n)
    for n in (3, 9, 17, 25, 33, 41, 5, 12, 20, 28, 36, 44, 7, 15, 23, 31)
]


def mtp_extras(seed: int, own_embedding: bool = False, own_head: bool = True) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors beyond a decoder layer's, by their names under `layers.{N}.`."""
    gen = torch.Generator().manual_seed(seed)

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(HIDDEN, generator=gen)

    tensors = {
        "enorm.weight": norm(),
        "hnorm.weight": norm(),
        "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / (2 * HIDDEN) ** 0.5,
        "shared_head.norm.weight": norm(),
    }
    if own_head:
        tensors["shared_head.head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen)
    return tensors


def target_dir(hf: Path, dest: Path, extras: dict[str, torch.Tensor], drop: str | None = None) -> Path:
    """`hf`'s tensors (less those whose name contains `drop`) under a config of `TARGET_LAYERS` layers,
    so that its last layer becomes the MTP layer's decoder; `extras` go to a second file."""
    dest.mkdir()
    raw = json.loads((hf / "config.json").read_text())
    text = raw["text_config"]
    text["num_hidden_layers"] = TARGET_LAYERS
    for key in MTP_LAYER_KIND:
        text[key] = text[key][:TARGET_LAYERS]
    (dest / "config.json").write_text(json.dumps(raw))
    if drop is None:
        shutil.copyfile(hf / WEIGHTS, dest / WEIGHTS)
    else:
        save_file({k: v for k, v in load_file(hf / WEIGHTS).items() if drop not in k}, str(dest / WEIGHTS))
    if extras:
        save_file(extras, str(dest / "mtp.safetensors"))
    return dest


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(HF directory of a 7-layer glm5_next whose last layer is a DSA + MoE layer, the target directory
    made from it with an MTP layer, the MTP layer's extra tensors)."""
    root = tmp_path_factory.mktemp("mtp")
    config = tiny_text_config(4, 8, num_hidden_layers=TARGET_LAYERS + 1)
    for key, kind in MTP_LAYER_KIND.items():
        config[key] = [*config[key], kind]
    hf = write_hf_checkpoint(root / "hf", config, seed=31)
    extras = mtp_extras(seed=7)
    return hf, target_dir(hf, root / "target", {LAYER + k: v for k, v in extras.items()}), extras


def make_llm(path: Path, **kwargs) -> LLM:
    """Prefill steps of at most 100 tokens, so that some prompts are observed in two pieces; every
    decode step verifies (the adaptive policy off). A 128-token context holds every sequence here (at
    most 44 + 40 tokens and the drafts): the fixed-shape batches of `decode_graphs` span the whole
    context, and at the model's (the cache's ~60k tokens) each of their steps scored every page of the
    cache in the DSA indexer, 3x the eager run's time."""
    kwargs.setdefault("speculative_adaptive", False)
    return LLM(
        str(path), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25, chunked_prefill_size=100,
        context_length=128, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_outputs(checkpoints) -> list[list[int]]:
    outputs = make_llm(checkpoints[1]).generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False
    )
    return [o.token_ids for o in outputs]


@pytest.fixture(
    scope="module", params=[(1, False), (3, False), (3, True)], ids=["1-step", "3-step", "3-step-graphs"]
)
def mtp_run(request, checkpoints):
    """An MTP run over `PROMPTS`, eager or through the fixed-shape decode and verify batches (on the
    CPU the plain calls of what CUDA graphs replay): (llm, outputs, every proposal as (prompt,
    committed length n, anchor, drafts), the verify-graph steps run)."""
    steps, graphs = request.param
    llm = make_llm(
        checkpoints[1], speculative_algorithm="MTP", speculative_num_steps=steps, decode_graphs=graphs,
        max_running_requests=8, cuda_graph_max_bs=8,
    )  # fmt: skip
    engine, proposer = llm.engine, llm.engine.proposer
    assert proposer.verify_shape.drafts == steps
    proposals, replays = [], []
    propose, observe_and_propose = proposer.propose, proposer.observe_and_propose
    inside = []

    def record(batch, commit):
        running = {r.slot: r for r in engine.requests.values() if r.status is Status.RUNNING}
        seqs = commit.sampling
        rows = batch.state_slots[seqs].tolist()
        lengths = (batch.positions[batch.pad_index[seqs, 0]] + commit.counts[seqs]).tolist()
        for row, n, anchor in zip(rows, lengths, commit.anchors[seqs].tolist(), strict=True):
            if row in running:  # not a filler block's
                proposals.append((running[row].prompt_ids, n, anchor, proposer.drafts[row].tolist()))

    def recording_propose(batch, commit):
        propose(batch, commit)
        if not inside:
            record(batch, commit)

    def recording_observe_and_propose(batch, commit):
        inside.append(True)
        observe_and_propose(batch, commit)
        inside.pop()
        record(batch, commit)

    proposer.propose, proposer.observe_and_propose = recording_propose, recording_observe_and_propose
    if graphs:
        run = engine.runner.verify_graphs.run
        engine.runner.verify_graphs.run = lambda seqs, *rest: replays.append(len(seqs)) or run(seqs, *rest)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return llm, outputs, proposals, replays


def test_mtp_greedy_is_lossless_on_a_batch_of_16(plain_outputs, mtp_run):
    llm, outputs, proposals, replays = mtp_run
    assert [o.token_ids for o in outputs] == plain_outputs
    assert all(o.metrics.spec_verify_steps > 0 for o in outputs)
    assert max(len(d) for *_, d in proposals) == llm.engine.proposer.num_steps
    if llm.engine.runner.verify_graphs is not None:
        assert sum(replays) >= len(PROMPTS)  # the verify steps went through the fixed-shape batches
        assert llm.engine.runner.graphs.observes


class ReferenceMTP:
    """The documented MTP format written plainly, with no cache: target hiddens h_i (mean of the last
    layer's streams) of a whole token sequence, pairs (h_i, token i+1) -> eh_proj(cat[enorm(e),
    hnorm(h)]) copied into the hc streams -> HF's decoder layer over every pair so far -> MTP hidden g
    (mean of the streams) -> head(shared_head.norm(g))."""

    def __init__(self, target: Glm5NextForCausalLM, hf_layer, extras: dict[str, torch.Tensor]):
        self.target, self.hf_layer, self.extras = target, hf_layer, extras
        self.first_steps: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.target.config.rms_norm_eps
        return self.extras[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def target_hiddens(self, tokens: list[int]) -> torch.Tensor:
        caches = Caches(self.target, num_seqs=1, per_seq=64)
        m = caches.manager
        batch = ForwardBatch.build([caches.chunk(0, tokens, 0)], m.table.table, m.tokens, m.states, m.kpool)
        return self.target(batch, capture_layers=(TARGET_LAYERS - 1,)).features

    def hiddens(self, target_hiddens: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        """MTP hidden of every pair (target_hiddens[i], next_tokens[i])."""
        embeds = self.target.embed_tokens.weight[next_tokens]
        x = torch.cat([self._rms(embeds, "enorm.weight"), self._rms(target_hiddens, "hnorm.weight")], -1)
        x = x @ self.extras["eh_proj.weight"].t()
        n = len(x)
        streams = x[None, :, None, :].expand(-1, -1, self.target.config.hc_mult, -1).contiguous()
        out, _ = self.hf_layer(
            streams,
            attention_mask=torch.ones(1, n, dtype=torch.bool),
            position_ids=torch.arange(n)[None],
            position_embeddings=None,
            past_key_values=None,
        )
        return out[0].mean(1)

    def draft(self, hidden: torch.Tensor) -> int:
        normed = self._rms(hidden, "shared_head.norm.weight")
        return int((normed @ self.extras["shared_head.head.weight"].t()).argmax())

    def proposals(self, sequence: list[int], anchors_and_counts: list[tuple[int, int]]) -> list[list[int]]:
        """For each (anchor position n, k): the k chained drafts after `sequence[: n + 1]`. Everything is
        causal, so one pass over the whole sequence gives every first step; each later step reruns the
        layer over the prefix's pairs plus the drafted ones."""
        key = tuple(sequence)
        if key not in self.first_steps:
            h = self.target_hiddens(sequence[:-1])
            self.first_steps[key] = h, self.hiddens(h, sequence[1:])
        h, first = self.first_steps[key]
        out = []
        for n, count in anchors_and_counts:
            pair_h, pair_tokens, g = h[:n], sequence[1 : n + 1], first[n - 1]
            drafts = [self.draft(g)]
            for _ in range(count - 1):
                pair_h, pair_tokens = torch.cat([pair_h, g[None]]), [*pair_tokens, drafts[-1]]
                g = self.hiddens(pair_h, pair_tokens)[-1]
                drafts.append(self.draft(g))
            out.append(drafts)
        return out


@pytest.fixture(scope="module")
def reference(checkpoints) -> ReferenceMTP:
    hf, target, extras = checkpoints
    hf_layer = hf_model(hf).model.language_model.layers[TARGET_LAYERS]
    return ReferenceMTP(load_model(target, dtype=torch.float32, progress=False), hf_layer, extras)


@torch.inference_mode()
def test_mtp_drafts_equal_a_from_scratch_recomputation(reference, mtp_run):
    """Checks the incremental MTP caches (observe after prefill chunks and verifies, stale draft
    entries, k-pools completed by drafts): every proposal made for a short prompt, a long one prefilled
    in two steps, and any request that had a draft accepted equals the drafts recomputed from its full
    prefix."""
    _, outputs, proposals, _ = mtp_run
    checked = [i for i, o in enumerate(outputs) if i in (0, 5) or o.metrics.spec_accepted_tokens]
    for i in checked:
        prompt = PROMPTS[i]
        sequence = prompt + outputs[i].token_ids
        made = [(n, anchor, drafts) for p, n, anchor, drafts in proposals if p == prompt]
        assert len(made) >= 5
        # every anchor is the token the target picked after the n committed ones
        assert all(anchor == sequence[n] for n, anchor, _ in made if n < len(sequence))
        expected = reference.proposals(sequence, [(n, len(d)) for n, _, d in made])
        assert [d for *_, d in made] == expected, i


def test_deferred_observes_leave_the_mtp_caches_of_observing_every_step(checkpoints, monkeypatch):
    """Plain graph steps that draft nothing (a policy verifying every 40th step, past the deferred
    ring's positions) leave the MTP layer's observes for later: its caches then equal those of an
    engine that observes every step (but where a request finished before observing), same outputs."""
    import hylo.engine.cuda_graph as cuda_graph

    ring = 32
    monkeypatch.setattr(cuda_graph, "MAX_DEFERRED_TOKENS", ring)  # a ring the test fills
    params = GREEDY.model_copy(update={"max_tokens": 40})
    runs = []
    for defer in (True, False):
        llm = make_llm(
            checkpoints[1], speculative_algorithm="MTP", speculative_num_steps=3, decode_graphs=True,
            max_running_requests=4, cuda_graph_max_bs=4,
        )  # fmt: skip
        outputs, caught_up, never = run_every_kth(llm, PROMPTS[:3], params, 40, defer)
        runs.append(([o.token_ids for o in outputs], caught_up, never, llm.engine))
    (deferred, caught_up, never, engine), (observed, none, _, observing) = runs
    assert deferred == observed and not none and max(caught_up) == ring
    assert engine.runner.graphs.deferred_tokens == ring
    rows = torch.arange(engine.proposer.drafts.shape[0]) != engine.caches.scratch_slot  # not fillers'
    assert torch.equal(
        engine.proposer.drafts[rows], observing.proposer.drafts[rows]
    )  # graph and eager drafts
    mine, theirs = engine.proposer.cache, observing.proposer.cache
    seen = torch.ones(mine.latent.shape[1], dtype=torch.bool)
    seen[never] = False
    seen[engine.caches.table.table[engine.caches.scratch_slot].long()] = False  # filler blocks' page
    kpool = engine.proposer.layer.config.index_kpool
    pools = seen.view(-1, kpool).all(1)
    terms = model_accumulation_terms(engine.model.config)
    for name in ("latent", "index_key", "index_gate"):
        assert_fp32_close(getattr(mine, name)[:, seen], getattr(theirs, name)[:, seen], terms, name)
    assert_fp32_close(mine.pooled_key[:, pools], theirs.pooled_key[:, pools], terms, "pooled_key")


def test_mtp_layer_loads_flat_fp8_names_and_its_own_embedding(checkpoints, tmp_path):
    """`model.layers.{N}.*` names, an FP8 block-scaled eh_proj, an own embedding and no own head."""
    hf = checkpoints[0]
    extras = mtp_extras(seed=8, own_embedding=True, own_head=False)
    q, scale = quantize_fp8_blocks(extras.pop("eh_proj.weight"))
    flat = f"model.layers.{TARGET_LAYERS}."
    tensors = {flat + k: v for k, v in extras.items()}
    tensors |= {flat + "eh_proj.weight": q, flat + "eh_proj.weight_scale_inv": scale}
    path = target_dir(hf, tmp_path / "t", tensors)
    target = load_model(path, dtype=torch.float32, progress=False)
    layer = load_mtp_layer(path, target, progress=False)

    torch.testing.assert_close(layer.eh_proj.weight.data, dequantize_fp8(q, scale, torch.float32))
    assert layer.embedding(target) is layer.embed_tokens
    assert torch.equal(layer.embed_tokens.weight, extras["embed_tokens.weight"])
    assert layer.head(target) is target.lm_head
    assert torch.equal(layer.enorm.weight, extras["enorm.weight"])
    hf_tensors = load_file(hf / WEIGHTS)
    assert isinstance(layer.decoder.mlp, MoE)
    assert torch.equal(layer.decoder.attn_hc.fn, hf_tensors[LAYER + "hc_attn_fn"])
    assert torch.equal(
        layer.decoder.mlp.experts.gate_up_proj[3, :32], hf_tensors[LAYER + "mlp.experts.3.gate_proj.weight"]
    )
    fused = layer.decoder.self_attn.in_proj  # the indexer's wk rows in the DSA layer's one GEMM
    _, lo, hi = fused.rows()["indexer.wk"]
    assert torch.equal(fused.weight[lo:hi], hf_tensors[LAYER + "self_attn.indexer.wk.weight"])


@pytest.fixture
def config_only(checkpoints, tmp_path) -> Path:
    """The target's config.json and nothing else, for `load_format="dummy"`."""
    (tmp_path / "config.json").write_text((checkpoints[1] / "config.json").read_text())
    return tmp_path


def test_dummy_mtp_layer_needs_only_the_config(config_only):
    """Seeded random weights on the target's device and dtype, the same on every load, the MLP of the
    target's last layer, the target's embedding and head; no checkpoint is opened, and the loading
    holds the layer's weights and one fp32 tensor more."""
    target = load_model(config_only, dtype=torch.bfloat16, progress=False, random_weights=True)
    with AllocationMeter() as meter:
        layer = load_mtp_layer(config_only, target, random_weights=True)
    assert meter.peak <= weight_bytes(layer) + largest_fp32_bytes(layer)
    again = load_mtp_layer(config_only, target, random_weights=True)
    for (name, a), b in zip(layer.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b) and a.float().std() > 0, name
    assert layer.eh_proj.weight.dtype == torch.bfloat16
    assert isinstance(layer.decoder.mlp, MoE) == (target.config.mlp_layer_types[-1] == "sparse")
    assert layer.embedding(target) is target.embed_tokens and layer.head(target) is target.lm_head
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_mtp_layer(config_only, target)


def test_mtp_routed_experts_are_fp8_where_the_targets_are(tmp_path):
    """A target whose routed experts stay FP8 gets an MTP layer whose experts do too (dummy weights
    here; a checkpoint fills the same buffers), and the layer runs."""
    text = {"model_type": "glm5_next_text", **tiny_text_config(4, 8, moe_intermediate_size=128)}
    text["mlp_layer_types"] = ["sparse"] * len(text["mlp_layer_types"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    target = load_model(tmp_path, dtype=torch.float32, progress=False, fp8_experts=True, random_weights=True)
    layer = load_mtp_layer(tmp_path, target, random_weights=True)
    experts = layer.decoder.mlp.experts
    assert isinstance(experts, FP8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    bf16_target = load_model(tmp_path, dtype=torch.float32, progress=False, random_weights=True)
    bf16_layer = load_mtp_layer(tmp_path, bf16_target, random_weights=True)
    assert not isinstance(bf16_layer.decoder.mlp.experts, FP8Experts)
    caches = Caches(target, num_seqs=1, per_seq=64)
    m = caches.manager
    table = m.table.table
    pools = [TokenCacheSpec(layer.config, torch.float32).allocate(m.num_token_slots, "cpu")]
    proposer = MTPProposer(
        layer, target, ProposerCaches(table, torch.zeros(table.shape[0], 2).long(), pools), 2
    )
    batch = ForwardBatch.build([caches.chunk(0, random_prompt(9, VOCAB, 3), 0)], m.table.table, m.tokens,
                               m.states, m.kpool)  # fmt: skip
    forward = target(batch, capture_layers=proposer.capture_layers)
    counts = torch.tensor([9], dtype=torch.int32)
    commit = StepCommit(counts, torch.tensor([5]), torch.tensor([0]), forward.features)
    proposer.observe_and_propose(batch, commit)
    assert proposer.drafts[0].min() >= 0 and proposer.drafts[0].max() < VOCAB


def test_mtp_on_dummy_weights_is_lossless(config_only):
    prompts = PROMPTS[:4]
    plain = make_llm(config_only, load_format="dummy").generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False
    )
    mtp = make_llm(config_only, load_format="dummy", speculative_algorithm="MTP", speculative_num_steps=2)
    outputs = mtp.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.metrics.spec_verify_steps > 0 for o in outputs)


def test_checkpoint_without_an_mtp_layer_is_rejected_by_the_engine(checkpoints, tmp_path):
    path = target_dir(checkpoints[0], tmp_path / "t", {}, drop=LAYER)
    with pytest.raises(
        CheckpointError, match=rf"no MTP layer: no tensor named model\.layers\.{TARGET_LAYERS}\.\*"
    ):
        make_llm(path, speculative_algorithm="MTP")


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("eh_proj", rf"1 tensors missing.*layers\.{TARGET_LAYERS}\.eh_proj\.weight \(64, 128\)"),
        ("shared_head.norm", rf"missing.*layers\.{TARGET_LAYERS}\.shared_head\.norm\.weight"),
        ("self_attn.", rf"layers\.{TARGET_LAYERS}\.self_attn\.kv_a_proj_with_mqa\.weight is missing"),
        ("self_attn.indexer.", rf"layers\.{TARGET_LAYERS}\.self_attn\.indexer\.wk\.weight is missing"),
        ("input_layernorm", rf"missing.*layers\.{TARGET_LAYERS}\.input_layernorm\.weight"),
    ],
)
def test_missing_mtp_tensor_is_named(checkpoints, tmp_path, drop, message):
    hf, _, extras = checkpoints
    kept = {LAYER + k: v for k, v in extras.items() if drop not in k}
    path = target_dir(hf, tmp_path / "t", kept, drop=LAYER + drop)
    target = load_model(path, dtype=torch.float32, progress=False)
    with pytest.raises(CheckpointError, match=message):
        load_mtp_layer(path, target, progress=False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE"}, "must be DFLASH or MTP, got 'EAGLE'"),
        ({"speculative_algorithm": "DFLASH"}, "speculative_draft_model_path is required"),
        (
            {"speculative_algorithm": "MTP", "speculative_draft_model_path": "/draft"},
            "must not be set with speculative_algorithm MTP",
        ),
        ({"speculative_algorithm": "MTP", "speculative_num_steps": 0}, "speculative_num_steps must be >= 1"),
        (
            {
                "speculative_algorithm": "DFLASH",
                "speculative_draft_model_path": "/d",
                "speculative_num_steps": 2,
            },
            "speculative_num_steps applies to speculative_algorithm MTP only, got 'DFLASH'",
        ),
        ({"speculative_num_steps": 2}, "speculative_num_steps applies to speculative_algorithm MTP only"),
        (
            {"speculative_algorithm": "MTP", "speculative_num_steps": 2, "speculative_num_draft_tokens": 4},
            r"speculative_num_draft_tokens \(4\) must be speculative_num_steps \+ 1 \(3\)",
        ),
    ],
)
def test_bad_speculative_flags_are_rejected(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**flags)


def test_mtp_flags_reach_the_engine_config_from_the_command_line():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-algorithm", "MTP", "--speculative-num-steps", "3"])
    config = EngineConfig.from_cli(args)
    assert (config.speculative_algorithm, config.speculative_num_steps) == ("MTP", 3)
    assert (
        EngineConfig(speculative_algorithm="MTP", speculative_num_draft_tokens=2).speculative_num_steps
        is None
    )
