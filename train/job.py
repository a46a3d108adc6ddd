"""One training run: the loaded target, the composed config, where things go,
and the drafter registry.

A drafter plugs in as a module, named by its proposer's ``trainer`` (:func:`drafters`), that defines
``train(job: TrainJob) -> Path`` (the artifact directory it wrote) and a
``Config`` dataclass for its ``drafter.*`` options, stored as the ``drafter=<name>``
structured config (:func:`store_drafter_configs`), so it holds the only defaults. Everything else (self-distilled data, the training loop,
W&B, checkpoints) is shared through the job.

Under ``accelerate launch`` or ``torchrun`` every process runs the whole job: each
loads the target on its own device, generates its share of the data, and trains on
its share of every batch; only the main process logs, evaluates and writes the
artifact (drafters end with ``if not job.is_main_process: return``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from accelerate import PartialState
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specdec.decoders.cli.config import model_config, store_schema, to_dataclass
from specdec.decoders.engine.context import artifact_source
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.registry import drafter_trainers, store_named_config
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.train.data import DataConfig, Sequence, check_prompt_files, eval_sequences, self_distilled
from specdec.train.loop import RunLogger, ScaleConfig
from specdec.train.processes import process_state


def drafters() -> dict[str, str]:
    """Drafter name -> module defining ``Config`` and ``train(job)``: each proposer declares
    the drafter it reads (``artifact``) and the module that trains it (``trainer``)."""
    return drafter_trainers()


def drafter_module(name: str) -> ModuleType:
    trainers = drafters()
    if name not in trainers:
        raise KeyError(
            f"unknown drafter {name!r}; drafters: {', '.join(trainers)}. A new drafter is a module "
            "with `Config` and `train(job)`, named by its proposer's `trainer` (and `artifact`)."
        )
    return importlib.import_module(trainers[name])


def store_drafter_configs() -> None:
    """Make each drafter's ``Config`` the ``drafter=<name>`` choice of Hydra's ConfigStore
    (imports every drafter module, which imports this one: the command line calls it before
    it composes, not this module on import)."""
    for name in drafters():
        store_named_config("drafter", name, drafter_module(name).Config)


@dataclass
class EvalConfig:
    """``train.eval``: measure the drafter after training on prompts it never saw."""

    path: str | None = None  # Spec-Bench-format JSONL; null = no such measurement
    limit: int | None = None  # first N prompts of each category
    only: bool = False  # true: measure the existing artifact, don't train


@dataclass
class TrainConfig(ScaleConfig):
    """``train.*``: where the run writes, whether it resumes, how it executes
    (:class:`ScaleConfig`'s fields), what it trains on (``train.data``, from
    ``train_data=NAME``) and what it measures afterwards."""

    output: str | None = None  # artifact directory; null = ${artifacts_dir}/<target>/<drafter>
    data_dir: str | None = (
        None  # generation cache shared by all drafters; null = ${artifacts_dir}/<target>/data
    )
    resume: bool = True  # continue an interrupted run from its checkpoint
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)


store_schema("train_options", "base", TrainConfig, package="train")


@dataclass
class TrainJob:
    cfg: DictConfig
    pipeline: Pipeline
    logger: RunLogger

    @property
    def drafter(self) -> str:
        return self.cfg.drafter.name

    def drafter_config(self, config_cls: type):
        """The ``drafter`` section as the drafter's Config dataclass (unknown keys are errors)."""
        options = OmegaConf.to_container(self.cfg.drafter, resolve=True)
        options.pop("name")  # type: ignore[union-attr]
        return to_dataclass(config_cls, options, "drafter")

    @property
    def options(self) -> TrainConfig:
        return train_options(self.cfg)

    @property
    def data_config(self) -> DataConfig:
        return self.options.data

    @property
    def output_dir(self) -> Path:
        """Where the artifact goes: ``<artifacts_dir>/<target>/<drafter>`` unless train.output is set."""
        output = self.options.output
        return Path(output) if output else self.pipeline.context.own_artifact_path(self.drafter)

    @property
    def data_root(self) -> Path:
        """The generation cache, shared by all drafters of this target."""
        data_dir = self.options.data_dir
        context = self.pipeline.context
        return Path(data_dir) if data_dir else context.artifacts_dir / context.target_key / "data"

    @property
    def resume(self) -> bool:
        return self.options.resume

    @property
    def scale(self) -> ScaleConfig:
        """How the run executes: gradient accumulation and mixed precision (``train.*``)."""
        options = self.options
        return ScaleConfig(options.accumulation_steps, options.mixed_precision)

    def training_record(self, recipe, sequences: int, positions: int | None = None) -> dict:
        """What an artifact's metadata says of how it was trained: the drafter's recipe,
        the data settings, and how many sequences (and positions) it saw."""
        record = {"config": dataclasses.asdict(recipe), "data": dataclasses.asdict(self.data_config)}
        record["sequences"] = sequences
        if positions is not None:
            record["positions"] = positions
        return record

    @property
    def is_main_process(self) -> bool:
        """The process that evaluates and writes the artifact (the only one in a plain run)."""
        return process_state().is_main_process

    @property
    def eval_only(self) -> bool:
        """Measure the existing artifact (``train.eval.only=true``) instead of training."""
        return self.options.eval.only

    def measured_artifact(self, config_file: str) -> Path:
        """What ``train.eval.only=true`` measures: ``train.output`` if set, else the artifact
        the proposer loads (the user's own, else the copy shipped with the project)."""
        output = self.options.output
        context = self.pipeline.context
        directory = Path(output) if output else context.artifact_path(self.drafter)
        if not (directory / config_file).exists():
            raise FileNotFoundError(
                f"train.eval.only=true, but there is no {self.drafter} artifact at {directory}: "
                f"train one first with `{context.train_command(self.drafter, output)}`"
            )
        return directory

    def record_measurement(self, directory: Path, config_file: str, meta: dict, metrics: dict) -> Path:
        """Keep a ``train.eval.only`` measurement (``metrics``: "heldout" and the eval
        prompts' entries) in the artifact's metadata; a shipped artifact is package data and
        stays as shipped, so its measurement goes to the run's output folder. -> the file."""
        evaluated = {name: values for name, values in metrics.items() if name != "heldout"}
        measured = {**meta, "metrics": metrics["heldout"], "eval_metrics": evaluated}
        if artifact_source(directory)["shipped"]:
            folder = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()
            destination = folder / f"{self.drafter}_measured.json"
        else:
            destination = directory / config_file
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(json.dumps(measured, indent=2))
        print(f"[train] measured {directory}; recorded in {destination}", file=sys.stderr)
        return destination

    def sequences(self) -> list[Sequence]:
        """The self-distilled training data (generated on first use, then cached). The
        ``train.eval.path`` responses are generated here too, while every process can
        take a share; the main process reads them from the cache after training."""
        start = time.perf_counter()
        sequences = self_distilled(self.pipeline, self.data_config, self.data_root)
        self.eval_sequences()
        tokens = sum(len(s.response) for s in sequences)
        if self.is_main_process:
            print(f"[train] data: {len(sequences)} sequences, {tokens} response tokens "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)  # fmt: skip
        return sequences

    def eval_sequences(self) -> list[Sequence]:
        """Responses to ``train.eval.path`` (e.g. Spec-Bench), measured but never trained on."""
        evaluation = self.options.eval
        if not evaluation.path:
            return []
        return eval_sequences(
            self.pipeline, self.data_config, self.data_root, evaluation.path, evaluation.limit
        )


def train_options(cfg: DictConfig) -> TrainConfig:
    """The ``train`` section as :class:`TrainConfig` (unknown keys are errors)."""
    node = OmegaConf.to_container(cfg.train, resolve=True)
    evaluation = to_dataclass(EvalConfig, node.pop("eval", None) or {}, "train.eval")  # type: ignore[union-attr]
    data = to_dataclass(DataConfig, node.pop("data", None) or {}, "train.data")  # type: ignore[union-attr]
    return to_dataclass(TrainConfig, {**node, "eval": evaluation, "data": data}, "train")  # type: ignore[arg-type]


def run(cfg: DictConfig) -> Path:
    """Train ``cfg.drafter`` for ``cfg.model``; returns the artifact directory."""
    module = drafter_module(cfg.drafter.name)
    options = train_options(cfg)
    check_prompt_files(options.data, options.eval.path, options.eval.limit)  # before the model loads
    state = process_state()  # joins the process group under accelerate launch / torchrun
    model_cfg = process_model_config(model_config(cfg), state)
    target, tokenizer = load_model(model_cfg)
    pipeline = Pipeline(target, tokenizer, model_config=model_cfg, artifacts_dir=cfg.artifacts_dir)
    name = f"train-{cfg.drafter.name}-{pipeline.context.target_key}"
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = RunLogger(cfg.logger, config, name, active=state.is_main_process)  # type: ignore[arg-type]
    try:
        output = module.train(TrainJob(cfg, pipeline, logger))
    finally:
        logger.finish()
    if state.is_main_process and not cfg.train.eval.only:
        print(f"[train] {cfg.drafter.name} artifact written to {output}", file=sys.stderr)
    return output


def process_model_config(model_cfg: ModelConfig, state: PartialState) -> ModelConfig:
    """This process's target placement: ``device: auto`` means the device accelerate gives
    the process (its own GPU in a multi-GPU run, the CPU without CUDA or under ``--cpu``).
    ``device_map`` spreads one copy of the target over every GPU the process sees, so it
    takes one process per machine."""
    if model_cfg.device_map:
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            raise ValueError(
                "model.device_map spreads the target over every GPU of a machine: launch one process per "
                "machine (accelerate launch --num_processes <machines> --num_machines <machines>), or drop "
                "model.device_map to give each process a GPU of its own"
            )
        return model_cfg
    if model_cfg.device == "auto" and (state.num_processes > 1 or state.device.type == "cpu"):
        return dataclasses.replace(model_cfg, device=str(state.device))
    return model_cfg
