"""One training loop for the demo target and every draft: AdamW, warm-up + cosine, checkpoints, resume.

Resuming reproduces the interrupted run exactly: a step's batch is a pure function of the step index
(`batch_at(step)` draws from a generator seeded by `(seed, step)`), the optimizer's and the module's
states are saved together, and the step count the schedule runs to is fixed at the start (or, with
a time budget, after the first timed steps) and saved with them. So a run killed after checkpoint k
and resumed follows the same loss curve as one never killed, to the last bit on the same machine.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

CHECKPOINT = "checkpoint.pt"
LOSS_LOG = "loss.jsonl"
# With a time budget, the schedule's length is fixed from the speed of steps
# BUDGET_WARM_STEPS .. BUDGET_WARM_STEPS + BUDGET_PROBE_STEPS (the first ones compile and autotune).
BUDGET_WARM_STEPS = 5
BUDGET_PROBE_STEPS = 10

LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TrainSettings:
    """`steps` is the schedule's length unless `time_budget_s` is set: then the length is what fits in
    the budget at the speed of the first steps after warm-up (never more than `steps`)."""

    steps: int
    lr: float
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 500
    seed: int = 0
    time_budget_s: float | None = None
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        for name in ("steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")


def learning_rate(settings: TrainSettings, step: int, total: int) -> float:
    """Linear warm-up to `lr`, then cosine down to `min_lr_ratio · lr` at `total`."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = min(1.0, (step - settings.warmup) / max(1, total - settings.warmup))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a step draws its batch (and anything random in its loss) from."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + step)


class Trainer:
    """Trains `module`'s parameters that require grad on `loss_fn(batch_at(step))`.

    `out` receives `checkpoint.pt` (module + optimizer + progress, replaced atomically every
    `checkpoint_every` steps and at the end) and `loss.jsonl` (one line per step, rewritten up to the
    resumed step on resume). `autocast` runs the loss under bf16 autocast (CUDA); parameters and the
    optimizer stay fp32."""

    def __init__(
        self,
        module: nn.Module,
        batch_at: Callable[[int], Any],
        loss_fn: LossFn,
        settings: TrainSettings,
        out: Path,
        autocast: bool = False,
        progress: bool = True,
        description: str = "train",
    ):
        self.module, self.batch_at, self.loss_fn, self.settings = module, batch_at, loss_fn, settings
        self.out, self.autocast, self.progress, self.description = Path(out), autocast, progress, description
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters")
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay}]
        self.optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.params = params
        self.step = 0
        self.total = settings.steps if settings.time_budget_s is None else None
        self.history: list[dict[str, float]] = []

    @property
    def length(self) -> int:
        """The schedule's length: `settings.steps` until a time budget has fixed it."""
        return self.total or self.settings.steps

    def resume(self) -> bool:
        """Load `out/checkpoint.pt` when present (True if loaded)."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["settings"] != asdict(self.settings):
            raise ValueError(
                f"{path} was written with other settings ({state['settings']}); "
                f"start a new output directory or pass the same settings ({asdict(self.settings)})"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.total, self.history = state["step"], state["total"], state["history"]
        self._write_log()
        return True

    def run(self) -> list[dict[str, float]]:
        """Train to the end of the schedule (from the resumed step); returns every step's stats."""
        self.out.mkdir(parents=True, exist_ok=True)
        bar = tqdm(
            total=self.total, initial=self.step, desc=self.description, unit="step", disable=not self.progress
        )
        started, first = time.perf_counter(), self.step
        probe_start = None
        self.module.train()
        while self.step < self.length:
            stats = self._one_step()
            self.history.append(stats)
            with (self.out / LOSS_LOG).open("a") as log:
                log.write(json.dumps(stats) + "\n")
            self.step += 1
            if self.total is None and self.step - first == BUDGET_WARM_STEPS:
                probe_start = time.perf_counter()
            if self.total is None and self.step - first == BUDGET_WARM_STEPS + BUDGET_PROBE_STEPS:
                now = time.perf_counter()
                self.total = self._fit_budget(now - started, (now - probe_start) / BUDGET_PROBE_STEPS)
                bar.total = self.total
            bar.update()
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}")
            if self.step % self.settings.checkpoint_every == 0 or self.step == self.length:
                self.save()
        bar.close()
        self.module.eval()
        return self.history

    def _one_step(self) -> dict[str, float]:
        lr = learning_rate(self.settings, self.step, self.length)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.batch_at(self.step)
        device_type = self.params[0].device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, stats = self.loss_fn(batch)
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"step {self.step}: the loss is {value}")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        logged = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in stats.items()}
        return {"step": self.step, "loss": value, "lr": lr, "grad_norm": norm.item(), **logged}

    def _fit_budget(self, elapsed: float, per_step: float) -> int:
        remaining = max(0.0, self.settings.time_budget_s - elapsed)
        return max(self.step, min(self.settings.steps, self.step + int(remaining / per_step)))

    def save(self) -> None:
        """Write the checkpoint atomically (a killed write never leaves a torn checkpoint)."""
        state = {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "total": self.total,
            "history": self.history,
            "settings": asdict(self.settings),
        }
        path = self.out / CHECKPOINT
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, path)

    def _write_log(self) -> None:
        with (self.out / LOSS_LOG).open("w") as log:
            log.writelines(json.dumps(stats) + "\n" for stats in self.history)
