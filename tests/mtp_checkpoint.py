"""A target checkpoint with an MTP layer (test_mtp's layout: the HF model's last layer becomes the MTP
layer's decoder, its extra tensors in a second file) over any tiny layer mix, for tests of the engine
around MTP whose steps' time is the layers' forwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hf_reference import tiny_text_config, write_hf_checkpoint
from safetensors.torch import save_file
from test_mtp import MTP_LAYER_KIND, WEIGHTS, mtp_extras


def write_mtp_target(root: Path, mix: str, seed: int = 31, **overrides) -> Path:
    """The target directory: the `mix` layers of `tiny_text_config(4, 8, mix, **overrides)` and, after
    them, an MTP layer of test_mtp's kind (DSA with a full indexer, MoE) and extra tensors
    (`mtp_extras(7)`)."""
    config = tiny_text_config(4, 8, mix, **overrides)
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers + 1
    for key, kind in MTP_LAYER_KIND.items():
        config[key] = [*config[key], kind]
    hf = write_hf_checkpoint(root / "hf", config, seed=seed)
    target = root / "target"
    target.mkdir()
    raw = json.loads((hf / "config.json").read_text())
    raw["text_config"] |= {"num_hidden_layers": layers} | {
        key: config[key][:layers] for key in MTP_LAYER_KIND
    }
    (target / "config.json").write_text(json.dumps(raw))
    shutil.copyfile(hf / WEIGHTS, target / WEIGHTS)
    prefix = f"model.language_model.layers.{layers}."
    save_file({prefix + k: v for k, v in mtp_extras(seed=7).items()}, str(target / "mtp.safetensors"))
    return target
