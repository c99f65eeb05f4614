"""The embedded demo model, and the random-weight model tests build.

`default_model_dir()` is the shipped demo: a 7M-parameter GLM-5.3-Flash (KDA and DSA layers with a
k-pool indexer and a shared indexer layer, mHC, dense and MoE MLPs) trained on ShareGPT with its own
tokenizer, with a DFlash draft (`dflash/`), a DFlash2 draft (`dflash2/`) and its MTP layer
(`mtp.safetensors`) beside it; its `README.md` is the model card. It ships inside the package, so
`make serve` works on any machine with no download.

`write_random_model(path)` writes a smaller model of the same architecture with seeded random weights
and a tiny byte-level tokenizer, deterministically (same bytes on every write): what tests need when
a trained model would be slower and add nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hylo.config import ModelConfig
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import save_checkpoint
from hylo.models.random_init import randomize
from hylo.tokenizer import DEMO_STOP_TOKENS, Tokenizer, write_byte_level_tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "glm5-next-demo"
DEMO_DRAFTS = {"dflash": DEMO_DIR / "dflash", "dflash2": DEMO_DIR / "dflash2"}
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
    """The shipped demo model's directory; raises when the installation lacks it."""
    if not (DEMO_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"{DEMO_DIR}: the embedded demo model is missing from this installation (reinstall hylo, "
            "or pass --model)"
        )
    return DEMO_DIR


def write_random_model(path: Path) -> None:
    """Tokenizer, config and seeded random weights of the random test model into `path`."""
    vocab = write_byte_level_tokenizer(path)
    tokenizer = Tokenizer.from_dir(path)
    stops = [tokenizer.token_to_id(t) for t in DEMO_STOP_TOKENS]
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
