"""The training loop every drafter shares: batches, AdamW with warm-up and
cosine decay, tqdm progress, W&B logging, checkpoints and resumption.

A drafter supplies the module (only parameters with ``requires_grad`` are
trained and checkpointed), the training rows as tensors with the same first
dimension, and a loss function ``loss_fn(batch) -> (loss, metrics)``.
A checkpoint is written every ``checkpoint_every`` steps, and on Ctrl-C, to
``<artifact>/checkpoint.pt``; rerunning the same command continues from it if
its fingerprint (the drafter and data settings) matches.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm

LossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class FitConfig:
    """Optimisation settings (fields of every drafter's config)."""

    epochs: float = 1.0  # passes over the training rows (fractions allowed)
    batch_size: int = 256  # rows per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # share of the steps with a linearly rising learning rate
    max_grad_norm: float = 1.0
    log_every: int = 10  # steps between W&B points
    checkpoint_every: int = 100  # steps between checkpoints
    seed: int = 0


class RunLogger:
    """A W&B run for one training job (``logger.mode``: offline, online or disabled).

    W&B failures are reported once and then ignored: logging must never stop training.
    """

    def __init__(self, logger_cfg: DictConfig, config: dict, name: str) -> None:
        self.run: Any = None
        if logger_cfg.mode == "disabled":
            return
        try:
            import wandb

            directory = Path(logger_cfg.dir)
            directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                mode=logger_cfg.mode,
                project=logger_cfg.project,
                entity=logger_cfg.entity,
                group=logger_cfg.group,
                tags=list(logger_cfg.tags or []),
                dir=str(directory),
                name=name,
                job_type="train",
                config=config,
                reinit="finish_previous",
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as error:  # noqa: BLE001
            self._fail(error)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as error:  # noqa: BLE001
                self._fail(error)

    def summary(self, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            try:
                self.run.summary.update(metrics)
            except Exception as error:  # noqa: BLE001
                self._fail(error)

    def finish(self) -> None:
        if self.run is not None:
            run_dir = Path(self.run.dir).parent
            self.run.finish()
            print(f"[train] W&B run in {run_dir} (offline runs: `wandb sync {run_dir}`)", file=sys.stderr)
            self.run = None

    def _fail(self, error: Exception) -> None:
        print(f"[train] W&B logging off after an error ({type(error).__name__}: {error}); "
              "use logger=disabled to skip W&B", file=sys.stderr)  # fmt: skip
        self.run = None


def fit(
    module: torch.nn.Module,
    rows: dict[str, torch.Tensor],
    loss_fn: LossFn,
    cfg: FitConfig,
    checkpoint: Path,
    fingerprint: str,
    logger: RunLogger,
    resume: bool = True,
) -> dict[str, float]:
    """Train ``module``'s trainable parameters on ``rows``; returns the last logged metrics."""
    count = len(next(iter(rows.values())))
    steps_per_epoch = max(math.ceil(count / cfg.batch_size), 1)
    total_steps = max(math.ceil(cfg.epochs * steps_per_epoch), 1)
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    optimizer = torch.optim.AdamW(trainable.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup_steps = int(cfg.warmup * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, warmup_steps, total_steps)
    )
    step = _restore(checkpoint, fingerprint, trainable, optimizer, scheduler) if resume else 0

    def save() -> None:
        state = {
            "fingerprint": fingerprint,
            "step": step,
            "trainable": {name: p.detach() for name, p in trainable.items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_name(checkpoint.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, checkpoint)

    module.train()
    window: dict[str, list[float]] = {}
    last: dict[str, float] = {}
    progress = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    try:
        while step < total_steps:
            batch_index = _batch_indices(count, cfg.batch_size, cfg.seed, step, steps_per_epoch)
            loss, metrics = loss_fn({key: value[batch_index] for key, value in rows.items()})
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable.values(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                window.setdefault(key, []).append(value)
            progress.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                last = {f"train/{key}": sum(v) / len(v) for key, v in window.items()}
                last["train/lr"] = scheduler.get_last_lr()[0]
                last["train/epoch"] = step / steps_per_epoch
                logger.log(last, step)
                progress.set_postfix(loss=f"{last['train/loss']:.3f}")
                window = {}
            if step % cfg.checkpoint_every == 0:
                save()
    except KeyboardInterrupt:
        save()
        print(f"\n[train] interrupted at step {step}/{total_steps}; checkpoint saved to {checkpoint}. "
              "Run the same command again to continue.", file=sys.stderr)  # fmt: skip
        raise
    finally:
        progress.close()
        module.eval()
    return last


def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _batch_indices(count: int, batch_size: int, seed: int, step: int, steps_per_epoch: int) -> torch.Tensor:
    """Rows of global step ``step``: epoch e is a permutation seeded by (seed, e), so a
    resumed run continues with exactly the batches it would have seen."""
    epoch, offset = divmod(step, steps_per_epoch)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(count, generator=generator)
    return order[offset * batch_size : (offset + 1) * batch_size]


def _restore(checkpoint: Path, fingerprint: str, trainable: dict, optimizer, scheduler) -> int:
    """Load a matching checkpoint; returns the step to continue from (0 = fresh start)."""
    if not checkpoint.exists():
        return 0
    state = torch.load(checkpoint, weights_only=True)
    if state.get("fingerprint") != fingerprint:
        print(
            f"[train] ignoring {checkpoint}: it belongs to other settings; starting afresh", file=sys.stderr
        )
        return 0
    with torch.no_grad():
        for name, value in state["trainable"].items():
            trainable[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    print(f"[train] resuming from {checkpoint} at step {state['step']}", file=sys.stderr)
    return int(state["step"])
