"""Each command's whole config as one typed schema: the options every command shares
(:class:`CommonConfig`) and each command's own, with their only defaults.

A command's YAML file (``conf/<command>.yaml``) lists its schema first in its defaults
list, then ``common`` (Hydra's output folders) and the config groups it composes
(``model``, ``proposer``, ``bench``, ...). The groups are typed by their own schemas
(:class:`~specdec.decoders.models.loading.ModelConfig`, the proposers' ``Config``,
:class:`~specdec.decoders.evaluation.bench_config.BenchConfig`, ...); here they are
slots (``Any``). So Hydra checks every key and type of a command line while composing,
and a default is written once: a command's own options here (those the Python API shares,
from :mod:`specdec.decoders.engine.pipeline`), a group's in its schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specdec.decoders.engine.pipeline import ARTIFACTS_DIR, CHAT_TEMPLATE, MAX_NEW_TOKENS, ROUND_GATE


@dataclass
class CommonConfig:
    """What every command reads."""

    task_name: str = MISSING  # set by each command's YAML; names its output folders
    plugins: list[str] = field(
        default_factory=list
    )  # modules to import (their @register_* classes become choices)
    artifacts_dir: str = ARTIFACTS_DIR  # trained drafters: <artifacts_dir>/<target>/<drafter>
    # true: whether each round drafts at all is decided from earlier rounds
    # (decoders/sizing/round_gate.py). Off: in its A/B runs it has not paid yet (docs/round_gate.md).
    round_gate: bool = ROUND_GATE
    debug: bool = False  # true: keep the traceback of the project's errors (as HYDRA_FULL_ERROR=1 does)


@dataclass
class PipelineSlots:
    """The groups a command that builds pipelines composes (typed by their own schemas)."""

    model: Any = None
    proposer: Any = None
    verifier: Any = None
    sampling: Any = None
    constraint: Any = None


@dataclass
class GenerateCommand(PipelineSlots, CommonConfig):
    """``python -m specdec.decoders.generate``: one answer, streamed, then the run's stats."""

    prompt: str = "Write a short poem about the sea."
    max_new_tokens: int = MAX_NEW_TOKENS
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. ["\n\n"]
    chat_template: bool = CHAT_TEMPLATE  # wrap the prompt in the tokenizer's chat template


@dataclass
class BenchCommand(PipelineSlots, CommonConfig):
    """``python -m specdec.decoders.bench``: its options are ``bench.*`` (BenchConfig)."""

    workload: Any = None
    bench: Any = None
    logger: Any = None


@dataclass
class AuditCommand(PipelineSlots, CommonConfig):
    """``python -m specdec.decoders.audit``: its options are ``audit.*`` (AuditConfig)."""

    workload: Any = None
    audit: Any = None
    logger: Any = None


@dataclass
class ReplayCommand(CommonConfig):
    """``python -m specdec.decoders.replay``: a greedy bench run's recorded outputs replayed
    through pipelines, timed by T(n) (decoders/evaluation/replay.py)."""

    run: str = MISSING  # a bench run: its directory (outputs/bench/DATE_TIME) or its results.json
    # pipelines to replay, as in bench.pipelines; [] = the run's own (those that draft with
    # the target's inner layers, early exit and EAGLE, are skipped: they need its real passes)
    pipelines: list[Any] = field(default_factory=list)
    cost_curve: str | None = None  # a T(n) file ({"seconds": {"1": 0.039, "8": 0.043}}); null = the run's own
    # also each pipeline with its drafts cut to the path the target accepts ("NAME (oracle)"):
    # what sending less of its drafts could gain; with its sizing off (adaptive: false, a large
    # tree_budget) what a perfect choice among all its candidates would reach
    oracle: bool = False
    output: str = "${hydra:runtime.output_dir}/replay.json"
    plots: bool = True  # the bench's PNG plots (speedup per category, tau, T(n)) next to replay.json


@dataclass
class TrainCommand(CommonConfig):
    """``python -m specdec.train``: its options are ``train.*`` (TrainConfig, DataConfig) and
    ``drafter.*`` (the drafter's Config)."""

    model: Any = None
    drafter: Any = None
    train: Any = None
    logger: Any = None


COMMANDS = {
    "generate": GenerateCommand,
    "bench": BenchCommand,
    "audit": AuditCommand,
    "replay": ReplayCommand,
    "train": TrainCommand,
}

for _name, _schema in COMMANDS.items():
    ConfigStore.instance().store(name=f"{_name}_command", node=_schema)
