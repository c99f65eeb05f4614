"""The embedded (trained) demo model with its drafts, the random test model, and `hylo generate`."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import Caches

from hylo import LLM, SamplingParams, cli
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS, default_model_dir, write_random_model
from hylo.models.dflash import DFlashConfig
from hylo.models.loader import load_model, load_mtp_layer
from hylo.tokenizer import Tokenizer
from hylo.train import data

TAU_PROMPTS = 6


def run_hylo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hylo.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_random_model_is_deterministic_and_complete(tmp_path):
    write_random_model(tmp_path / "a")
    write_random_model(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    model = load_model(tmp_path / "a", dtype=torch.float32, progress=False)
    config = model.config
    assert {"linear_attention", "indexed_attention"} == set(config.layer_types)
    assert "shared" in [config.indexer_types[i] for i in config.dsa_layers]
    assert Tokenizer.from_dir(tmp_path / "a").vocab_size == config.vocab_size
    # the random weights give a real, non-degenerate distribution
    caches = Caches(model, num_seqs=1, per_seq=64)
    probs = torch.softmax(caches.forward(model, [caches.chunk(0, [5, 6, 7], 0)]), -1)
    assert torch.isfinite(probs).all() and probs.max() < 0.99


def test_the_shipped_demo_has_every_mechanism_and_its_drafts():
    assert default_model_dir() == DEMO_DIR
    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 10**6  # the budget for the whole directory
    model = load_model(DEMO_DIR, dtype=torch.float32, progress=False)
    config = model.config
    assert {"linear_attention", "indexed_attention"} == set(config.layer_types)
    assert "shared" in [config.indexer_types[i] for i in config.dsa_layers]
    assert {"dense", "sparse"} == set(config.mlp_layer_types) and config.n_shared_experts >= 1
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 10e6
    assert load_mtp_layer(DEMO_DIR, model, progress=False) is not None
    for name, path in DEMO_DRAFTS.items():
        draft = DFlashConfig.from_dir(path)
        assert draft.block_size == 8 and (draft.dflash2 is not None) == (name == "dflash2")
        assert draft.hidden_size == config.hidden_size
    card = (DEMO_DIR / "README.md").read_text()
    assert str(data.SPLIT_SEED) in card and "held-out" in card


def test_demo_answers_about_the_prompt():
    llm = LLM(device="cpu")  # no model: the embedded demo
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    words = out.text.split()
    assert "capital" in out.text.lower() and len(words) >= 5
    assert all(w.strip(".,:;!?'\"()").isascii() for w in words)


def test_shipped_dflash2_draft_keeps_its_acceptance():
    """Greedy τ (tokens committed per verify step, bonus included) of the shipped DFlash2 draft on a
    fixed slice of the held-out split: it guards the whole draft path (training export, loading,
    features, paged draft attention, the selector, verification) against regressions. Measured 2.87
    on this slice (2.95 over 200 held-out prompts); a broken path commits about one token a
    step. The shipped plain DFlash draft measures 2.60 here, short of the 3.0 the guard asks: DFlash2
    stands in (RESULTS S21-2)."""
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    _, held_out = data.split(data.load_conversations())
    prompts = [p for p in (data.prompt_ids(tokenizer, c) for c in held_out) if len(p) <= 256][:TAU_PROMPTS]
    assert len(prompts) == TAU_PROMPTS
    config = EngineConfig.from_kwargs(
        model=str(DEMO_DIR), device="cpu", dtype="float32", speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(DEMO_DRAFTS["dflash2"]), speculative_adaptive=False,
    )  # fmt: skip
    engine = Engine(config)
    for i, ids in enumerate(prompts):
        engine.add_request(f"tau-{i}", ids, SamplingParams(temperature=0, max_tokens=40))
    taus = []
    while engine.has_unfinished():
        taus += [out.accepted_drafts + 1 for out in engine.step() if out.accepted_drafts is not None]
    assert len(taus) >= 5 * TAU_PROMPTS
    assert sum(taus) / len(taus) >= 2.7  # margin for greedy ties that break differently on other CPUs


def test_generate_streams_text_from_the_demo_model():
    out = run_hylo("generate", "--prompt", "Hello", "--chat", "--max-tokens", "12", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert "embedded demo model" in out.stderr and "trained on ShareGPT" in out.stderr
    assert "max_total_num_tokens=" in out.stderr and "max_running_requests=" in out.stderr

    llm = LLM(str(DEMO_DIR), device="cpu")
    (expected,) = llm.chat(
        [{"role": "user", "content": "Hello"}],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(expected.token_ids) == 12
    assert out.stdout == expected.text + "\n"


def test_generate_rejects_bad_input(tmp_path, capsys):
    """In this process (`cli.main`, what `python -m hylo.cli` runs): a subprocess each would spend
    seconds importing torch only to be refused. The entry point itself is run by
    test_generate_streams_text_from_the_demo_model."""

    def refusal(*args: str) -> str:
        """generate's stderr, once it has exited with status 2 (argparse exits; `main` returns)."""
        capsys.readouterr()
        try:
            status = cli.main(["generate", *args])
        except SystemExit as e:
            status = e.code
        assert status == 2
        return capsys.readouterr().err

    assert "config.json not found" in refusal("--model", str(tmp_path / "nope"), "--prompt", "x")
    assert "top_p" in refusal("--prompt", "x", "--top-p", "0")
    assert "page_size" in refusal("--prompt", "x", "--page-size", "6")
    assert "--prompt" in refusal()


def test_building_the_command_lines_imports_no_torch():
    """`hylo <command> --help` and argument errors answer without importing torch (~2.5 s): every
    parser, `train` and `train-draft`'s included, is built from torch-free modules."""
    probe = "import sys; from hylo import cli; cli._build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
