"""Compiled passes (model.compile): the setting, the load-time compilation counted and timed,
exact mode kept eager, and a compiled target decoding as its eager self does."""

from __future__ import annotations

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.models.compiled import wants_compile
from specdec.decoders.models.loading import ModelConfig, load_model
from tests.conftest import random_prompts

CPU = torch.device("cpu")


def test_the_setting_resolves_and_is_checked_in_one_line():
    assert wants_compile("auto", CPU, exact=False)[0] is False
    assert wants_compile(False, CPU, exact=False) == (False, "model.compile=false")
    assert wants_compile("true", CPU, exact=False) == (True, "model.compile=true")
    kept, why = wants_compile(True, CPU, exact=True)
    assert not kept and "exact mode is on" in why and "model.exact=false" in why
    with pytest.raises(ValueError, match=r"model.compile='sometimes': use auto, true or false.") as error:
        wants_compile("sometimes", CPU, exact=False)
    assert "\n" not in str(error.value)


def test_exact_mode_keeps_its_passes_eager_and_says_so(capsys):
    target, _ = load_model(ModelConfig(name="tiny-random", dtype="float32", exact="true", compile="true"))
    assert target.exact and not target.compile_stats.loaded and target.variant == ""
    assert "[compile] model.compile=true, but exact mode is on" in capsys.readouterr().err


@pytest.mark.slow  # inductor compiles a few graphs: about a minute on two cores
def test_a_compiled_target_is_compiled_once_at_load_and_decodes_as_its_eager_self(capsys):
    config = ModelConfig(name="tiny-random", dtype="float32", exact="false", compile="true")
    compiled, _ = load_model(config)
    stats = compiled.compile_stats
    assert stats.loaded and stats.graphs >= 1 and stats.seconds > 0
    assert f"[compile] {stats.graphs} graphs compiled in" in capsys.readouterr().err
    assert compiled.variant == "-compiled" and not compiled.fused
    eager, _ = load_model(ModelConfig(name="tiny-random", dtype="float32", exact="false", compile="false"))
    prompt = random_prompts(1, seed=4)[0]
    a, b = compiled.session(), eager.session()
    torch.testing.assert_close(a.forward(prompt), b.forward(prompt), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.forward([3, 4, 5]), b.forward([3, 4, 5]), rtol=1e-4, atol=1e-4)
    base = Pipeline(compiled, None, model_config=config)
    tokens = base.generate(prompt, 16).tokens
    assert tokens == Pipeline(eager, None, model_config=config).generate(prompt, 16).tokens
    assert base.with_components("ngram", "greedy").generate(prompt, 16).tokens == tokens
    assert stats.record() == {
        "graphs": stats.graphs,
        "seconds": round(stats.seconds, 2),
        "during_run": stats.during_run,
    }
    compiled.close()
    assert compiled.decoder()._compiled_call_impl is None
