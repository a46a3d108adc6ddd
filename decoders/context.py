"""What proposers and verifiers may know about the pipeline they serve."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from decoders.cost import CostCurve, cached_cost_curve
from decoders.models import ModelConfig, cache_dir


@dataclass
class PipelineContext:
    target: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase | None
    model_config: ModelConfig = field(default_factory=ModelConfig)
    artifacts_dir: Path = field(default_factory=lambda: Path("artifacts"))

    @property
    def target_key(self) -> str:
        """Names the target in artifact paths and caches."""
        cfg = self.model_config
        if cfg.name == "tiny-random":
            return f"tiny-random-v{cfg.vocab_size}-h{cfg.hidden_size}-l{cfg.num_layers}-s{cfg.seed}"
        if cfg.name_or_path:
            return Path(cfg.name_or_path.rstrip("/")).name or cfg.name_or_path.replace("/", "--")
        return cfg.name

    def artifact_path(self, drafter: str) -> Path:
        """Where the trained drafter ``drafter`` for this target lives."""
        return self.artifacts_dir / self.target_key / drafter

    @property
    def cost_cache_dir(self) -> Path:
        return cache_dir() / "costs"

    def cost_curve(self) -> CostCurve:
        """The target's T(n), from the shared cache (measured there on first use)."""
        return cached_cost_curve(self.target, self.target_key, self.cost_cache_dir)
