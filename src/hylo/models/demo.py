"""The embedded default model: a tiny random-weight GLM-5.3-Flash that hylo writes itself.

It has the real architecture (KDA and DSA layers with a k-pool indexer, a shared indexer layer,
mHC, dense and MoE MLPs) at toy sizes, so `make serve` works on any machine with no download.
Its weights are random: it produces gibberish, by design. The directory is written once,
deterministically (same bytes on every write), under `$HYLO_HOME` (default `~/.cache/hylo`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hylo.config import ModelConfig
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import save_checkpoint
from hylo.models.random_init import randomize
from hylo.tokenizer import Tokenizer, write_byte_level_tokenizer

DEMO_NAME = "glm5-next-tiny-random-v1"
_SEED = 0
_TEXT_CONFIG = dict(
    model_type="glm5_next_text",
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=64,
    index_head_dim=32,
    index_n_heads=8,
    index_kpool=4,
    linear_head_dim=32,
    linear_num_heads=4,
    mlp_layer_types=["dense"] + ["sparse"] * 7,
    layer_types=["linear_attention"] * 3
    + ["indexed_attention"] * 2
    + ["linear_attention"] * 2
    + ["indexed_attention"],
    indexer_types=["full"] * 4 + ["shared"] + ["full"] * 3,
)


def default_model_dir() -> Path:
    home = Path(os.environ.get("HYLO_HOME", Path.home() / ".cache" / "hylo"))
    return home / DEMO_NAME


def ensure_default_model() -> Path:
    """The demo model's directory, written first if absent (atomically: a half-written directory is
    never visible, so concurrent first uses are safe)."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=target.parent))
    try:
        write_demo_model(staging)
        staging.chmod(0o755)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_demo_model(path: Path) -> None:
    """Tokenizer, config and seeded random weights of the demo model into `path`."""
    vocab = write_byte_level_tokenizer(path)
    tokenizer = Tokenizer.from_dir(path)
    stops = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    text = _TEXT_CONFIG | {"vocab_size": vocab, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": stops}
    raw = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
    }
    model = Glm5NextForCausalLM(ModelConfig.from_dict(raw))
    randomize(model, torch.Generator().manual_seed(_SEED))
    save_checkpoint(model, path, raw)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}, indent=2) + "\n")
