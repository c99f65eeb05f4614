"""Peak GPU memory while loading the 8-layer real-size slice with `load_format="dummy"`, bf16 and FP8
(issue 22's loading point: peak ≤ 1.05× the weights; FP8 weights ≤ 0.55× the bf16 ones).

    PYTHONPATH=src python3 benchmarks/device/load_peak.py [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from hylo.memory.manager import LoadPeak, weight_bytes
from hylo.models.loader import load_model


def slice_config(path: Path, layers: int, fp8: bool) -> Path:
    raw = {
        "model_type": "glm5_next",
        "text_config": {"model_type": "glm5_next_text", "num_hidden_layers": layers},
    }
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        path = slice_config(Path(tempfile.mkdtemp()), args.layers, fp8)
        with LoadPeak(device) as peak:
            model = load_model(path, device, torch.bfloat16, random_weights=True, progress=False)
        weights = weight_bytes(model)
        report[name] = {
            "weights_gib": round(weights / 2**30, 2),
            "load_peak_gib": round(peak.bytes / 2**30, 2),
            "peak_over_weights": round(peak.bytes / weights, 3),
        }
        del model
        torch.cuda.empty_cache()
    report["fp8_over_bf16_weights"] = round(report["fp8"]["weights_gib"] / report["bf16"]["weights_gib"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
