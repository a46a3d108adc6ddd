"""What proposers and verifiers may know about the pipeline they serve."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from specdec.decoders.engine.registry import default_sizing
from specdec.decoders.models.cost import CostCurve, fixed_by_environment
from specdec.decoders.models.loading import ModelConfig, cache_dir
from specdec.decoders.models.target import Target, as_target

# Trained drafters of the default target, shipped as package data (only what differs
# from the target is stored); a user's own artifact of the same drafter wins.
SHIPPED_ARTIFACTS = Path(__file__).resolve().parents[2] / "proposers" / "shipped"
ARTIFACTS_DIR = "artifacts"  # the user's trained drafters: <artifacts_dir>/<target>/<drafter>


@runtime_checkable
class Sizing(Protocol):
    """What the engine and proposers ask of a pipeline's sizing policy: the one place a
    draft's size is decided. The built-in is :class:`specdec.decoders.sizing.policy.SizingPolicy`,
    a layer above the engine, bound by name (``registry.SIZING_MODULE``); ``Pipeline(...,
    sizing=...)`` takes any object with these methods. The sizers it hands out answer
    ``choose(...)`` and learn from ``observe(round)`` (``decoders/sizing/``)."""

    def chain(self, max_len: int, explore_every: int = ...) -> Any: ...  # a chain's length

    def dynamic_tree(self, width: int, depth: int, budget: Any) -> Any: ...  # a tree grown by confidence

    def static_tree(self, max_nodes: int, every: int = ...) -> Any: ...  # a fixed tree's best prefix

    def ranked(self, max_nodes: int, explore_every: int | None = ...) -> Any: ...  # ranked candidates

    def round_gate(self) -> Any: ...  # whether a round drafts at all (decoding.RoundGate)

    def batch_gate(self) -> Any: ...  # whether a batch's round drafts at all

    def pass_seconds(self, max_tokens: int) -> Any: ...  # T(1) .. T(max_tokens), non-decreasing

    def beside(self, rows: int, tokens: float, requests: int = ...) -> None: ...  # the pass's other rows

    def joint(
        self, drafts: list[tuple[list[int], list[float] | None]], requests: int | None = ...
    ) -> list[list[int]]: ...  # a batch's drafts chosen together

    def pass_curve(self, requests: int = ...) -> CostCurve: ...  # T(n) of the pass drafts join

    def check_budget(self, budget: Any) -> Any: ...  # a tree_budget option, checked

    def start_request(self, proposer: Any) -> None: ...  # a request begins: its sizers follow it

    def confidence(self, probability: float) -> int: ...  # a chain's situation key

    def node_key(self, depth: int, probability: float) -> tuple[int, int]: ...  # a node's situation key


SIZING_METHODS = sorted(name for name in vars(Sizing) if not name.startswith("_"))


@dataclass
class PipelineContext:
    target: Target  # the target's passes, parts and cost: what a proposer may use of it
    tokenizer: PreTrainedTokenizerBase | None
    model_config: ModelConfig = field(default_factory=ModelConfig)
    artifacts_dir: Path = field(default_factory=lambda: Path(ARTIFACTS_DIR))
    fixed_cost_curve: CostCurve | None = None  # given: used instead of the measured T(n)
    # how big a draft is: the pipeline's SizingPolicy (decoders/sizing/policy.py), whose
    # sizers proposers take (``context.sizing.chain(k)``); None: the default policy over cost_curve
    sizing: Sizing | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target, torch.nn.Module):  # a bare module runs its passes as they are
            self.target = as_target(self.target)
        if self.sizing is None:
            self.sizing = default_sizing(  # looked up when read
                lambda: self.cost_curve(), lambda requests: self.batch_cost_curve(requests)
            )
        if not isinstance(self.sizing, Sizing):
            missing = [name for name in SIZING_METHODS if not hasattr(self.sizing, name)]
            raise TypeError(f"sizing={type(self.sizing).__name__}: not a sizing policy (lacks {missing})")

    @property
    def target_key(self) -> str:
        """Names the target in artifact paths and caches."""
        cfg = self.model_config
        if cfg.name == "tiny-random":
            return f"tiny-random-v{cfg.vocab_size}-h{cfg.hidden_size}-l{cfg.num_layers}-s{cfg.seed}"
        if cfg.gguf_file:  # the file's name without .gguf (a folder's name where a folder holds it)
            return Path(cfg.gguf_file.rstrip("/")).name.removesuffix(".gguf")
        if cfg.name_or_path:
            return Path(cfg.name_or_path.rstrip("/")).name or cfg.name_or_path.replace("/", "--")
        return cfg.name

    def own_artifact_path(self, drafter: str, *parts: str) -> Path:
        """Where training writes drafter ``drafter`` for this target (the artifacts dir)."""
        return self.artifacts_dir.joinpath(self.target_key, drafter, *parts)

    def artifact_path(self, drafter: str, *parts: str) -> Path:
        """Where proposers read drafter ``drafter`` for this target: the artifacts dir
        if it has one, else the copy shipped with the project, else the artifacts dir
        (whose path the missing-artifact error then names)."""
        own = self.own_artifact_path(drafter, *parts)
        shipped = SHIPPED_ARTIFACTS.joinpath(self.target_key, drafter, *parts)
        return shipped if not own.exists() and shipped.exists() else own

    def train_command(self, drafter: str, output: str | None = None) -> str:
        """The command line that trains ``drafter`` for this target (into ``output`` if
        given): what a missing-artifact error tells the user to run."""
        model = self.model_config
        parts = [f"python -m specdec.train drafter={drafter}", f"model={model.name}"]
        if model.name_or_path:
            parts.append(f"model.name_or_path={model.name_or_path}")
        if model.gguf_file:
            parts.append(f"model.gguf_file={model.gguf_file}")
        if model.name == "tiny-random":
            parts += [
                f"model.vocab_size={model.vocab_size}",
                f"model.hidden_size={model.hidden_size}",
                f"model.num_layers={model.num_layers}",
                f"model.seed={model.seed}",
            ]
        if str(self.artifacts_dir) != ARTIFACTS_DIR:
            parts.append(f"artifacts_dir={self.artifacts_dir}")
        if output:
            parts.append(f"train.output={output}")
        return " ".join(parts)

    @property
    def cost_cache_dir(self) -> Path:
        return cache_dir() / "costs"

    def cost_curve(self) -> CostCurve:
        """The target's T(n): the fixed curve if one was given, else from the shared
        cache (measured there on first use), followed live by the passes the decode
        loop times (``model.live_cost``; :meth:`specdec.decoders.models.target.Target.pass_times`)."""
        if self.fixed_cost_curve is not None:
            return self.fixed_cost_curve
        curve = self.target.cost_curve(self.target_key, self.cost_cache_dir)
        if not self.model_config.live_cost or fixed_by_environment():
            return curve
        return self.target.pass_times(curve).curve

    @property
    def live_cost(self) -> bool:
        """Whether the pipeline follows what its passes take (else its T(n) is fixed: given,
        ``SPECDEC_COST_CURVE``, or ``model.live_cost=false``, and its decisions are the
        curve's alone)."""
        return self.fixed_cost_curve is None and self.model_config.live_cost and not fixed_by_environment()

    def batch_cost_curve(self, requests: int) -> CostCurve | None:
        """T(n) of a packed pass over ``requests`` requests, followed live like
        :meth:`cost_curve` (from its curve until the batch's passes are timed); None where
        the T(n) is fixed (given, or not followed live): the sizers' own curve then."""
        if not self.live_cost:
            return None
        curve = self.target.cost_curve(self.target_key, self.cost_cache_dir)
        return self.target.pass_times(curve, requests).curve


def artifact_source(directory: Path) -> dict:
    """For results files: which artifact a pipeline ran, and whether it was shipped."""
    directory = Path(directory).resolve()
    return {"path": str(directory), "shipped": directory.is_relative_to(SHIPPED_ARTIFACTS)}
