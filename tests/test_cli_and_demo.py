"""The embedded demo model and the `hylo generate` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import Caches

from hylo import LLM, SamplingParams
from hylo.models.demo import DEMO_NAME, ensure_default_model, write_demo_model
from hylo.models.loader import load_model
from hylo.tokenizer import Tokenizer


def run_hylo(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"HYLO_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "hylo.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_demo_model_is_deterministic_and_complete(tmp_path):
    write_demo_model(tmp_path / "a")
    write_demo_model(tmp_path / "b")
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


def test_ensure_default_model_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HYLO_HOME", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / DEMO_NAME
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_NAME]


def test_generate_streams_text_from_the_demo_model(tmp_path):
    out = run_hylo(
        "generate", "--prompt", "Hello", "--chat", "--max-tokens", "12", "--ignore-eos", home=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "embedded demo model" in out.stderr and "random weights" in out.stderr
    assert "max_total_num_tokens=" in out.stderr and "max_running_requests=" in out.stderr

    llm = LLM(str(tmp_path / DEMO_NAME), device="cpu")
    (expected,) = llm.chat(
        [{"role": "user", "content": "Hello"}],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(expected.token_ids) == 12
    assert out.stdout == expected.text + "\n"


def test_generate_rejects_bad_input(tmp_path):
    missing = run_hylo("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", home=tmp_path)
    assert missing.returncode == 2 and "config.json not found" in missing.stderr
    bad = run_hylo("generate", "--prompt", "x", "--top-p", "0", home=tmp_path)
    assert bad.returncode == 2 and "top_p" in bad.stderr
    bad_engine = run_hylo("generate", "--prompt", "x", "--page-size", "6", home=tmp_path)
    assert bad_engine.returncode == 2 and "page_size" in bad_engine.stderr
    no_prompt = run_hylo("generate", home=tmp_path)
    assert no_prompt.returncode == 2 and "--prompt" in no_prompt.stderr
