"""A plugin that fails is named, and is not taken for bad input (status 1, one line); input no
run can use is one `error:` line naming its option (status 2) before the model loads. Each
case failed before these fixes: a traceback, "error: boom" with status 2, or a run that
ended at once and misreported why."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from tests.decoders.cli.test_checked_first import no_model, one_line  # noqa: F401  (no_model: a fixture)
from tests.decoders.cli.test_nothing_lost import command, one_error_line

PLUGIN = textwrap.dedent(
    """
    from dataclasses import dataclass

    from specdec.decoders import Draft, Proposer, register_proposer


    @register_proposer("cli_plugin")
    class CliPlugin(Proposer):
        @dataclass
        class Config:
            fail: str = "propose"  # propose: raise there; draft: draft the id `token`
            token: int = 10**6
            k: int = 1

        def __init__(self, config, context=None):
            if config.k < 1:
                raise ValueError(f"proposer.k={config.k}: must be at least 1")
            super().__init__(config, context)

        def propose(self, state) -> Draft:
            if self.config.fail == "propose":
                raise ValueError("boom inside propose")
            return Draft.chain([self.config.token])
    """
)


def run_plugin(tmp_path, *overrides: str):
    (tmp_path / "cli_plugin_module.py").write_text(PLUGIN)
    return command("specdec.decoders.generate", "model=tiny-random", "prompt=hi", "max_new_tokens=8",
                   "plugins=[cli_plugin_module]", "proposer=cli_plugin", *overrides, cwd=tmp_path,
                   env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"})  # fmt: skip


def one_plugin_line(done) -> str:
    """Status 1 (not bad input), one `error:` line naming the plugin, no traceback."""
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: proposer 'cli_plugin' (plugin cli_plugin_module)"), last
    assert last.endswith("debug=true shows the traceback"), last
    return last


def test_a_plugin_raising_in_propose_is_named_with_status_1(tmp_path):
    last = one_plugin_line(run_plugin(tmp_path))
    assert "failed in propose: ValueError: boom inside propose" in last
    debugged = run_plugin(tmp_path, "debug=true")
    assert debugged.returncode == 1 and "Traceback" in debugged.stderr
    assert 'raise ValueError("boom inside propose")' in debugged.stderr  # the plugin's own line


@pytest.mark.parametrize("token", [10**6, -1])
def test_a_plugin_drafting_an_id_outside_the_vocabulary_is_named_with_status_1(tmp_path, token):
    last = one_plugin_line(run_plugin(tmp_path, "proposer.fail=draft", f"proposer.token={token}"))
    assert f"drafted token id {token}, outside the vocabulary of 320 ids (0 to 319)" in last


def test_a_plugins_bad_option_is_still_bad_input(tmp_path):
    one_error_line(run_plugin(tmp_path, "proposer.k=0"), "proposer.k=0: must be at least 1")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.device=meta"], "model.device=meta: meta tensors hold no values"),
        (["model.dtype=int8"], "model.dtype=int8: not a dtype for a model's weights; use auto, float32"),
        (["stop=['']"], "stop=['']: an empty stop string ends every output at once; remove it"),
        (["constraint.regex='[^\\s\\S]'"], "constraint.regex=[^\\s\\S] matches no text at all"),
    ],
)
@pytest.mark.usefixtures("no_model")
def test_input_no_run_can_use_is_refused_before_the_model_loads(monkeypatch, capsys, overrides, expected):
    line = one_line(monkeypatch, capsys, "specdec.decoders.generate", *overrides)
    assert expected in line, line
