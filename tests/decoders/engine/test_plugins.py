"""A plugin's failure is the plugin's, named: its hooks' exceptions become a PluginError naming
it and the hook (the original as its cause), a draft holding an id outside the vocabulary is
refused before the target's pass, and the project's own exceptions pass unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specdec.decoders import Draft, Proposer, register_proposer
from specdec.decoders.engine.plugins import PluginError
from specdec.decoders.engine.registry import proposer_registry

PROMPT = [5, 6, 7, 8] * 4


class DraftsId(Proposer):
    """Drafts ``token`` after a valid one, every round."""

    @dataclass
    class Config:
        token: int = 10**6

    def propose(self, state) -> Draft:
        return Draft.chain([5, self.config.token])


class Fails(Proposer):
    """Raises ``error`` in ``hook``; drafts one token otherwise."""

    @dataclass
    class Config:
        hook: str = "propose"
        error: str = "ValueError"

    def _maybe_fail(self, hook: str) -> None:
        if hook == self.config.hook:
            raise (KeyboardInterrupt if self.config.error == "KeyboardInterrupt" else ValueError)("boom")

    def begin(self, state) -> None:
        self._maybe_fail("begin")

    def propose(self, state) -> Draft:
        self._maybe_fail("propose")
        return Draft.chain([state.tokens[-1]])

    def observe(self, state, round) -> None:
        self._maybe_fail("observe")


@pytest.fixture(autouse=True)
def plugins_registered():
    """The faulty plugins, registered for this module's tests only: registered at import, they
    would join every other module's matrix of registered proposers (collection imports all)."""
    for name, cls in (("test_plugin_drafts_id", DraftsId), ("test_plugin_fails", Fails)):
        register_proposer(name)(cls)
    yield
    for name in ("test_plugin_drafts_id", "test_plugin_fails"):
        proposer_registry._classes.pop(name, None)


@pytest.mark.parametrize("token", [10**6, 320, -1])
def test_a_draft_id_outside_the_vocabulary_is_refused_before_the_pass(tiny_pipeline, token, monkeypatch):
    pipeline = tiny_pipeline.with_components({"name": "test_plugin_drafts_id", "token": token}, "greedy")
    passes, forward = [], pipeline.session.forward
    monkeypatch.setattr(
        pipeline.session, "forward", lambda t, *a, **k: passes.append(t) or forward(t, *a, **k)
    )
    with pytest.raises(PluginError) as raised:
        pipeline.generate(PROMPT, 8)
    message = str(raised.value)
    assert f"proposer 'test_plugin_drafts_id' (plugin {__name__}) drafted token id {token}" in message
    assert "vocabulary of 320 ids (0 to 319)" in message
    assert passes == [PROMPT]  # the prefill only: no pass read the draft


@pytest.mark.parametrize("hook", ["begin", "propose", "observe"])
def test_an_exception_in_a_plugins_hook_names_the_plugin_and_the_hook(tiny_pipeline, hook):
    """A ValueError inside a plugin is no bad option: a PluginError, the original its cause."""
    pipeline = tiny_pipeline.with_components({"name": "test_plugin_fails", "hook": hook}, "greedy")
    with pytest.raises(PluginError, match=rf"proposer 'test_plugin_fails' \(plugin {__name__}\) failed in {hook} \(_maybe_fail\): ValueError: boom") as raised:  # fmt: skip
        pipeline.generate(PROMPT, 8)
    assert type(raised.value.__cause__) is ValueError


def test_a_plugin_failing_in_a_batch_or_inside_a_merge_is_named(tiny_pipeline):
    failing = {"name": "test_plugin_fails", "hook": "observe"}
    with pytest.raises(PluginError, match="proposer 'test_plugin_fails'.* failed in observe"):
        tiny_pipeline.with_components(failing, "greedy").generate_batch([PROMPT, PROMPT[:6]], 8)
    merged = {"name": "merge", "members": ["ngram", failing]}
    with pytest.raises(PluginError, match="proposer 'test_plugin_fails'.* failed in observe"):
        tiny_pipeline.with_components(merged, "greedy").generate(PROMPT, 8)


def test_keyboard_interrupt_and_the_projects_own_errors_pass_unchanged(tiny_pipeline, monkeypatch):
    pipeline = tiny_pipeline.with_components(
        {"name": "test_plugin_fails", "hook": "propose", "error": "KeyboardInterrupt"}, "greedy"
    )
    with pytest.raises(KeyboardInterrupt):
        pipeline.generate(PROMPT, 8)
    builtin = tiny_pipeline.with_components("ngram", "greedy")

    def broken(state):
        raise IndexError("a bug of the project's")

    monkeypatch.setattr(builtin.proposer, "propose", broken)
    with pytest.raises(IndexError, match="a bug of the project's"):
        builtin.generate(PROMPT, 8)
