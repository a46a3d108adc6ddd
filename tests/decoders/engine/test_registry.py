"""Registries: decorator registration, lookup errors, options validation, plugins."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass

import pytest

from specdec.decoders.engine.draft import Draft
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import (
    RegistryError,
    build,
    import_plugins,
    import_plugins_from_argv,
    proposer_registry,
    register_proposer,
    verifier_registry,
)


def test_builtins_are_registered():
    assert {"ngram", "draft_model"} <= set(proposer_registry.names())
    assert {"greedy", "rejection"} <= set(verifier_registry.names())


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(RegistryError) as error:
        proposer_registry.get("nope")
    message = str(error.value)
    assert "unknown proposer 'nope'" in message
    for name in proposer_registry.names():
        assert name in message
    assert "plugins=" in message


def test_unknown_option_is_rejected(tiny_pipeline):
    with pytest.raises(ValueError, match="has no option"):
        build(proposer_registry, {"name": "ngram", "kk": 3}, context=tiny_pipeline.context)


def test_invalid_option_values_name_the_fix(tiny_pipeline):
    with pytest.raises(ValueError, match="proposer.k must be >= 1"):
        tiny_pipeline.with_components({"name": "ngram", "k": 0}, "greedy")
    with pytest.raises(ValueError, match="min_n"):
        tiny_pipeline.with_components({"name": "ngram", "min_n": 3, "max_n": 2}, "greedy")


def test_duplicate_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):

        @register_proposer("ngram")
        class Other(Proposer):
            @dataclass
            class Config:
                pass


def test_custom_proposer_registered_in_code_runs(tiny_pipeline):
    @register_proposer("test_repeat_last")
    class RepeatLast(Proposer):
        @dataclass
        class Config:
            k: int = 2

        def propose(self, state) -> Draft:
            return Draft.chain([state.tokens[-1]] * self.config.k)

    pipeline = tiny_pipeline.with_components({"name": "test_repeat_last", "k": 3}, "greedy")
    prompt = [5, 6, 7, 7, 7]
    assert pipeline.generate(prompt, 20).tokens == tiny_pipeline.generate(prompt, 20).tokens
    assert pipeline.proposer.config.k == 3


def test_plugins_are_imported_from_argv(tmp_path, monkeypatch):
    module = tmp_path / "my_test_plugin.py"
    module.write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            from specdec.decoders import Draft, register_proposer
            from specdec.decoders.engine.proposer import Proposer

            @register_proposer("argv_plugin")
            class ArgvPlugin(Proposer):
                @dataclass
                class Config:
                    k: int = 1

                def propose(self, state):
                    return Draft.empty()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import_plugins_from_argv(["model=tiny-random", "plugins=[my_test_plugin]"])
    assert "argv_plugin" in proposer_registry.names()
    with pytest.raises(ImportError, match="plugins"):
        import_plugins(["no_such_module_xyz"])
    sys.modules.pop("my_test_plugin", None)


def test_sampled_is_a_property_of_the_configured_proposer(tiny_pipeline):
    """``sampled`` is asked of an instance (a draft model's chains sample, its trees do
    not), never a class flag that instances overwrite."""
    import inspect

    for name in proposer_registry.names():
        assert isinstance(inspect.getattr_static(proposer_registry.get(name), "sampled"), property), name
    chain = tiny_pipeline.with_components(
        {"name": "draft_model", "tree": False, "k": 4}, "rejection"
    ).proposer
    tree = tiny_pipeline.with_components({"name": "draft_model", "tree": True}, "tree").proposer
    assert chain.sampled and not tree.sampled


def test_builtins_are_listed_before_they_are_imported():
    """The registry names its built-ins from its table; looking one up imports it."""
    from specdec.decoders.engine.registry import BUILTIN_PROPOSERS, BUILTIN_VERIFIERS

    assert set(BUILTIN_PROPOSERS) <= set(proposer_registry.names())
    assert set(BUILTIN_VERIFIERS) <= set(verifier_registry.names())
    for name, target in {**BUILTIN_PROPOSERS, **BUILTIN_VERIFIERS}.items():
        registry = proposer_registry if name in BUILTIN_PROPOSERS else verifier_registry
        cls = registry.get(name)
        assert f"{cls.__module__}:{cls.__qualname__}" == target


def test_declarations_drive_the_trainer_cli_and_presets():
    """Every drafter ``python -m specdec.train`` offers comes from a proposer's declaration (artifact,
    trainer), and preset labels resolve to the proposer that declares them."""
    from specdec.decoders.engine.registry import drafter_trainers, find_preset

    assert drafter_trainers() == {
        "draft_model": "specdec.train.draft_model",
        "eagle": "specdec.train.eagle",
        "early_exit": "specdec.train.early_exit",
        "medusa": "specdec.train.medusa",
    }
    name, preset = find_preset("copy_heads_chain")
    assert name == "copy_heads" and preset.options["tree"] is None
    assert find_preset("copy_heads") is None and find_preset("nope_chain") is None


def test_a_proposer_that_drafts_trees_gets_the_tree_verifier_by_default(tiny_pipeline):
    assert tiny_pipeline.with_components("draft_model", None).verifier.name == "tree"
    assert (
        tiny_pipeline.with_components({"name": "draft_model", "tree": False}, None).verifier.name == "greedy"
    )
    assert tiny_pipeline.with_components("ngram", None).verifier.name == "greedy"
