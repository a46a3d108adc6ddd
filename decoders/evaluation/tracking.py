"""Weights & Biases logging: one W&B run per benchmark invocation.

A sweep (``python -m specdec.decoders.bench -m ...``) makes one run per job, grouped by
the sweep's directory name (or ``logger.group``), so W&B compares the jobs side
by side. Each run carries the resolved config, summary metrics per pipeline
(``<pipeline>/speedup``, ``<pipeline>/mean_accepted_tokens``, ...), a table of
per-prompt records with the decoded outputs, and the plots as images.

The mode comes from ``logger.mode``: ``offline`` (default; the run is written
under ``logger.dir``/wandb and uploaded later with ``wandb sync DIR``),
``online`` (needs ``wandb login`` or WANDB_API_KEY), ``disabled``. W&B is
called only after results.json is written, and any W&B error is reported and
swallowed, so tracking can never lose results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from specdec.decoders.evaluation.metrics import Divergence

SUMMARY_KEYS = (
    "tokens_per_s",
    "speedup",
    "speedup_mean",
    "speedup_std",
    "mean_accepted_tokens",
    "acceptance_rate",
    "identical_outputs",
    "ideal_speedup",
    "efficiency",
)
RECORD_COLUMNS = (
    "pipeline",
    "kind",
    "prompt_id",
    "category",
    "turn",
    "repeat",
    "new_tokens",
    "wall_time",
    "tokens_per_s",
    "target_passes",
    "mean_accepted_tokens",
    "proposed",
    "accepted",
    "diverges_at",
    "text",
)


def log_benchmark(cfg: DictConfig, payload: dict, images: list[Path]) -> Path | None:
    """Log a finished benchmark to W&B; returns the W&B run directory (None if off or failed)."""
    logger = cfg.logger
    if logger.mode == "disabled":
        return None
    try:
        import wandb

        directory = Path(logger.dir)
        directory.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            mode=logger.mode,
            project=logger.project,
            entity=logger.entity,
            group=logger.group or sweep_group(),
            name=run_name(),
            tags=list(logger.tags or []),
            dir=str(directory),
            job_type="bench",
            config=payload.get("config"),
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True),
        )
        try:
            run.summary.update(summary_metrics(payload))
            media: dict[str, Any] = {
                "records": wandb.Table(columns=list(RECORD_COLUMNS), data=record_rows(payload))
            }
            media.update({f"plots/{image.stem}": wandb.Image(str(image)) for image in images})
            run.log(media)
        finally:
            run.finish()
    except Exception as error:  # noqa: BLE001 - tracking must never lose a finished benchmark
        print(
            f"[bench] W&B logging failed ({type(error).__name__}: {error}); the results are in "
            f"{cfg.bench.output}. Use logger=disabled to skip W&B.",
            file=sys.stderr,
        )
        return None
    run_dir = Path(run.dir).parent
    hint = f" (upload with `wandb sync {run_dir}`)" if logger.mode == "offline" else ""
    print(f"[bench] W&B {logger.mode} run in {run_dir}{hint}", file=sys.stderr)
    return run_dir


def sweep_group() -> str | None:
    """The multirun's sweep directory name, so a sweep's jobs form one W&B group."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None


def run_name() -> str | None:
    """A sweep job's overrides (``proposer.k=4``), else the run's output directory name."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return hydra_cfg.job.override_dirname or f"job{hydra_cfg.job.num}"
    return Path(hydra_cfg.runtime.output_dir).name


def summary_metrics(payload: dict) -> dict[str, Any]:
    """Flat ``<pipeline>/<metric>`` summary, per-category speedups included."""
    summary: dict[str, Any] = {"prompts": payload["prompts"]}
    for entry in payload["pipelines"]:
        name = entry["name"]
        summary.update({f"{name}/{key}": entry[key] for key in SUMMARY_KEYS if entry.get(key) is not None})
        for category, metrics in entry["categories"].items():
            summary[f"{name}/categories/{category}/speedup"] = metrics["speedup"]
    return summary


def record_rows(payload: dict) -> list[list[Any]]:
    """One row per pipeline, prompt, turn and repeat (the columns of RECORD_COLUMNS)."""
    rows = []
    for entry in payload["pipelines"]:
        for record in entry.get("records", []):
            passes = record["target_passes"]
            tau = sum(record["emitted_per_round"]) / passes if passes else None
            rate = record["new_tokens"] / record["wall_time"] if record["wall_time"] else 0.0
            values = {**record, "pipeline": entry["name"], "kind": entry["kind"], "tokens_per_s": rate}
            values["mean_accepted_tokens"] = tau
            rows.append([values.get(column) for column in RECORD_COLUMNS])
    return rows


def log_audit(cfg: DictConfig, payload: dict) -> None:
    """Record the audit's headline figures as a W&B run (logger.mode=disabled: nothing)."""
    logger = cfg.logger
    if logger.mode == "disabled":
        return
    try:
        import wandb

        Path(logger.dir).mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            mode=logger.mode, project=logger.project, entity=logger.entity,
            group=logger.group or sweep_group(), name=run_name(), tags=list(logger.tags or []),
            dir=str(logger.dir), job_type="audit", config=payload["config"],
            reinit="finish_previous", settings=wandb.Settings(console="off"),
        )  # fmt: skip
        try:
            keys = (
                "passed",
                "greedy_identical",
                "bit_identical",
                "sampling_p_value",
                "pipeline_samples",
                "standard_samples",
            )
            run.summary.update({key: payload[key] for key in keys if payload[key] is not None})
            columns = list(Divergence.__dataclass_fields__)
            run.log(
                {
                    "divergences": wandb.Table(
                        columns=columns, data=[list(d.values()) for d in payload["divergences"]]
                    )
                }
            )
        finally:
            run.finish()
    except Exception as error:  # noqa: BLE001 - tracking must never lose a finished audit
        print(
            f"[audit] W&B logging failed ({type(error).__name__}: {error}); use logger=disabled to skip W&B.",
            file=sys.stderr,
        )
