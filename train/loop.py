"""The training loop every drafter shares, on Hugging Face ``accelerate``: AdamW with
warm-up and cosine decay, gradient clipping and accumulation, mixed precision,
tqdm progress and W&B logging (main process), checkpoints and resumption.

A drafter supplies the module (only parameters with ``requires_grad`` are
trained and checkpointed), the training rows as tensors with the same first
dimension, and a loss function ``loss_fn(batch) -> (loss, metrics)``.

The same code runs in one process or data-parallel in many (``accelerate launch``,
``torchrun``, ``srun``): ``batch_size`` is the global batch of one optimizer step,
which accelerate splits across processes and accumulation micro-steps, so a run's
optimisation does not depend on how many processes it has (:mod:`specdec.train.batches`).
A checkpoint is written every ``checkpoint_every`` steps to ``<artifact>/checkpoint``
(:mod:`specdec.train.checkpoints`); rerunning the same command continues from it if its
fingerprint (the drafter and data settings) matches. Ctrl-C or SIGTERM (SLURM
preemption, ``torchrun`` stopping its workers) ends training after the current step,
with a checkpoint, on every process at the same step; a second Ctrl-C stops at once,
keeping the last checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from omegaconf import DictConfig
from tqdm import tqdm

from specdec.train import checkpoints
from specdec.train.batches import Rows, StepBatches, whole_batch
from specdec.train.processes import process_state

LossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
PRECISIONS = ("auto", "no", "bf16", "fp16")


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
    checkpoint_every: int = 50  # steps between checkpoints
    seed: int = 0


@dataclass
class ScaleConfig:
    """``train.*`` settings of how a run executes, not what it learns (not in the fingerprint)."""

    accumulation_steps: int = 1  # micro-steps per optimizer step; the global batch stays batch_size
    mixed_precision: str = "auto"  # auto = the launcher's --mixed_precision, else bf16 on CUDA that has it

    def precision(self, accelerator_device: torch.device) -> str:
        """The ``mixed_precision`` for accelerate. ``auto`` takes ``accelerate launch
        --mixed_precision`` when it is not ``no`` (the launcher always sets one), else bf16
        on CUDA devices that have it, and keeps CPUs in float32 (the drafters' recipes and
        figures are float32 there; ``bf16`` opts in)."""
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(
                f"train.mixed_precision={self.mixed_precision!r}: use one of {', '.join(PRECISIONS)}"
            )
        if self.mixed_precision != "auto":
            return self.mixed_precision
        launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if launcher != "no":
            return launcher
        cuda = accelerator_device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if cuda else "no"


class RunLogger:
    """A W&B run for one training job (``logger.mode``: offline, online or disabled).

    W&B failures are reported once and then ignored: logging must never stop training.
    Only the main process of a multi-process run logs (``active=False`` elsewhere).
    """

    def __init__(self, logger_cfg: DictConfig, config: dict, name: str, active: bool = True) -> None:
        self.run: Any = None
        if logger_cfg.mode == "disabled" or not active:
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
    scale: ScaleConfig | None = None,
) -> dict[str, float]:
    """Train ``module``'s trainable parameters on ``rows``; returns the last logged metrics
    (averaged over processes). Every process of a run calls this with the same arguments;
    on return the module holds the same trained weights in each."""
    scale = scale or ScaleConfig()
    if scale.accumulation_steps < 1:
        raise ValueError(f"train.accumulation_steps={scale.accumulation_steps}: use 1 or more")
    trainable = checkpoints.trainable_parameters(module)
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    accelerator = Accelerator(
        gradient_accumulation_steps=scale.accumulation_steps,
        mixed_precision=scale.precision(process_state().device),
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    shards = accelerator.num_processes * scale.accumulation_steps
    if cfg.batch_size % shards:
        raise ValueError(
            f"the batch size ({cfg.batch_size} rows per step) must split evenly over {accelerator.num_processes} "
            f"processes x {scale.accumulation_steps} accumulation steps: set the drafter's batch size to a "
            f"multiple of {shards} (e.g. {math.ceil(cfg.batch_size / shards) * shards})"
        )
    count = len(next(iter(rows.values())))
    steps_per_epoch = math.ceil(count / cfg.batch_size)  # the last one runs into the next epoch's rows
    total_steps = max(math.ceil(cfg.epochs * steps_per_epoch), 1)
    optimizer = torch.optim.AdamW(trainable.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup_steps = int(cfg.warmup * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, warmup_steps, total_steps)
    )
    objective, optimizer, scheduler = accelerator.prepare(_Objective(module, loss_fn), optimizer, scheduler)
    hooks = checkpoints.register_trainable_state(accelerator, module)
    step = checkpoints.restore(accelerator, checkpoint, fingerprint) if resume else 0
    saved_step = step
    micro_batches = StepBatches(count, cfg.batch_size // scale.accumulation_steps, cfg.seed,
                                step * scale.accumulation_steps, total_steps * scale.accumulation_steps)  # fmt: skip
    loader = accelerator.prepare(
        torch.utils.data.DataLoader(Rows(rows), batch_sampler=micro_batches, collate_fn=whole_batch)
    )

    def save() -> None:
        nonlocal saved_step
        if saved_step != step:
            checkpoints.save(accelerator, checkpoint, step, fingerprint)
            saved_step = step

    module.train()
    window: dict[str, list[float]] = {}
    last: dict[str, float] = {}
    progress = tqdm(total=total_steps, initial=step, desc="training", unit="step",
                    disable=not accelerator.is_main_process)  # fmt: skip
    try:
        with _StopRequests() as stop:
            for batch in loader:
                with accelerator.accumulate(objective):
                    loss, metrics = objective(batch)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(trainable.values(), cfg.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                for key, value in {"loss": float(loss.detach()), **metrics}.items():
                    window.setdefault(key, []).append(value)
                if not accelerator.sync_gradients:
                    continue
                step += 1
                progress.update(1)
                if step % cfg.log_every == 0 or step == total_steps:
                    last = _mean_over_processes(accelerator, window)
                    last["train/lr"] = scheduler.get_last_lr()[0]
                    last["train/epoch"] = step / steps_per_epoch
                    logger.log(last, step)
                    progress.set_postfix(loss=f"{last['train/loss']:.3f}")
                    window = {}
                if step % cfg.checkpoint_every == 0:
                    save()
                if _any_process(accelerator, stop.signal is not None):
                    save()
                    if accelerator.is_main_process:
                        print(f"\n[train] stopped at step {step}/{total_steps}; checkpoint saved to {checkpoint}. "
                              "Run the same command again to continue.", file=sys.stderr)  # fmt: skip
                    stop.reraise()
    except KeyboardInterrupt:
        if saved_step != step and accelerator.is_main_process:
            print(f"\n[train] stopped at once at step {step}/{total_steps}; the last checkpoint (step {saved_step}) "
                  f"in {checkpoint} is kept. Run the same command again to continue from it.", file=sys.stderr)  # fmt: skip
        raise
    finally:
        progress.close()
        module.eval()
        for hook in hooks:
            hook.remove()
    accelerator.wait_for_everyone()
    return last


class _Objective(torch.nn.Module):
    """The drafter and its loss as one module whose forward is the loss.

    accelerate's wrappers act on a model's forward (DDP's gradient sync, autocast), and
    drafters' losses call whichever of their submodules they need (a PEFT wrapper, the
    decoder alone); wrapping the loss makes all of that the forward."""

    def __init__(self, drafter: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.drafter = drafter
        self.loss_fn = loss_fn

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss_fn(batch)


class _StopRequests:
    """SIGINT / SIGTERM during training ask to stop after the current step (every process
    stops at the same one, with a checkpoint); a second SIGINT stops at once.

    By hand because a signal arrives at each process at its own moment: turning it into a
    flag that the processes agree on at a step boundary is what makes the checkpoint
    consistent. ``torchrun`` answers Ctrl-C by sending its workers SIGTERM, so a SIGTERM
    after a SIGINT is the same request, not a second one."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signum

    def reraise(self) -> None:
        """After the checkpoint: end the run as the signal would have."""
        if self.signal == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM)
        raise KeyboardInterrupt


def _any_process(accelerator: Accelerator, flag: bool) -> bool:
    """Whether ``flag`` is set on any process (one tiny gather a step when there are several)."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.gather(torch.tensor([flag], device=accelerator.device)).any())


def _mean_over_processes(accelerator: Accelerator, window: dict[str, list[float]]) -> dict[str, float]:
    """``train/<key>``: each metric's mean over the window, averaged over the processes."""
    keys = sorted(window)
    means = torch.tensor([sum(window[k]) / len(window[k]) for k in keys], dtype=torch.float64)
    if accelerator.num_processes > 1:
        means = accelerator.reduce(means.to(accelerator.device), "mean").cpu()
    return {f"train/{key}": float(value) for key, value in zip(keys, means)}


def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
