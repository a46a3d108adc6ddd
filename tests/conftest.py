"""Shared fixtures: tiny seeded models in float64 so exact equality can be asserted."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)  # tiny models gain nothing from threads; CI has 2 shared cores

from decoders import Pipeline  # noqa: E402
from decoders.models import ModelConfig, load_model  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig(name="tiny-random", dtype="float64", device="cpu")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return load_model(tiny_config)


@pytest.fixture()
def tiny_pipeline(tiny_model, tiny_config, tmp_path) -> Pipeline:
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=tmp_path / "artifacts")


def random_prompts(count: int, vocab: int = 256, seed: int = 0, repetitive: bool = True) -> list[list[int]]:
    """Token-id prompts; repetitive ones give prompt lookup something to find."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        length = int(torch.randint(4, 40, (1,), generator=generator))
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        if repetitive and i % 2 == 0:
            ids = ids + ids[: length // 2] + ids
        prompts.append(ids)
    return prompts
