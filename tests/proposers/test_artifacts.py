"""Where proposers find trained drafters: the user's artifacts dir first, then the
copies shipped with the project; training always writes to the user's dir."""

from __future__ import annotations

from specdec.decoders.engine import context as context_module
from specdec.decoders.engine.context import PipelineContext, artifact_source
from specdec.decoders.models.loading import ModelConfig


def test_a_users_artifact_wins_over_the_shipped_one(tmp_path, monkeypatch):
    shipped_root = tmp_path / "shipped"
    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", shipped_root)
    context = PipelineContext(None, None, ModelConfig(name="smollm2-135m"), tmp_path / "artifacts")  # type: ignore[arg-type]
    own = tmp_path / "artifacts" / "smollm2-135m" / "medusa"
    shipped = shipped_root / "smollm2-135m" / "medusa"

    assert context.artifact_path("medusa") == own  # neither exists: the error names the user's path
    shipped.mkdir(parents=True)
    assert context.artifact_path("medusa") == shipped
    assert artifact_source(shipped)["shipped"] is True
    own.mkdir(parents=True)
    assert context.artifact_path("medusa") == own
    assert artifact_source(own)["shipped"] is False
    assert context.own_artifact_path("medusa") == own  # where training writes, always


def test_sub_artifacts_fall_back_one_by_one(tmp_path, monkeypatch):
    """A user's exit for layer 16 does not hide the shipped exit for layer 8."""
    shipped_root = tmp_path / "shipped"
    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", shipped_root)
    context = PipelineContext(None, None, ModelConfig(name="smollm2-135m"), tmp_path / "artifacts")  # type: ignore[arg-type]
    (tmp_path / "artifacts" / "smollm2-135m" / "early_exit" / "layer-16").mkdir(parents=True)
    (shipped_root / "smollm2-135m" / "early_exit" / "layer-8").mkdir(parents=True)
    assert context.artifact_path("early_exit", "layer-8").is_relative_to(shipped_root)
    assert not context.artifact_path("early_exit", "layer-16").is_relative_to(shipped_root)
