"""Every command's config is typed from the top (decoders/cli/commands.py): Hydra checks each
key and type while composing, and each command's own options have one default, in its schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

import specdec.decoders.evaluation.audit  # noqa: F401  (stores audit=default, as the command does)
import specdec.decoders.evaluation.bench_config  # noqa: F401  (stores bench=default)
import specdec.train.job  # noqa: F401  (stores train's options; tests/conftest.py the drafters)
from specdec.decoders.cli.commands import COMMANDS, CommonConfig
from specdec.decoders.cli.config import CONF_DIR


def composed(command: str, *overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(command, overrides=list(overrides))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_composes_into_its_schema(command):
    cfg = composed(command, *(["run=somewhere"] if command == "replay" else []))
    assert OmegaConf.get_type(cfg) is COMMANDS[command]
    assert cfg.task_name == command and cfg.round_gate is False and list(cfg.plugins) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_wrong_type_or_unknown_key_is_refused_while_composing(command):
    with pytest.raises(Exception) as wrong_type:
        composed(command, "round_gate=maybe")
    assert isinstance(wrong_type.value.__cause__ or wrong_type.value, ValidationError)
    with pytest.raises(Exception) as unknown:
        composed(command, "nosuch_option=1")
    assert f"Key 'nosuch_option' not in '{COMMANDS[command].__name__}'" in str(unknown.value.__cause__)


def test_the_command_files_restate_no_default_of_their_schema():
    """A command's own options and the common ones are defaulted in the dataclasses only:
    the YAML files set ``task_name`` and list their groups, nothing the schemas default."""
    for command, schema in COMMANDS.items():
        own = yaml.safe_load((Path(CONF_DIR) / f"{command}.yaml").read_text()) or {}
        restated = {f.name for f in dataclasses.fields(schema) if f.name in own and f.name != "task_name"} - {
            "bench",
            "audit",
        }  # those two set only an output path inside their section
        assert not restated, f"conf/{command}.yaml restates {sorted(restated)}"
    common = yaml.safe_load((Path(CONF_DIR) / "common.yaml").read_text())
    assert set(common) == {"hydra"}, "conf/common.yaml holds Hydra's folders only"
    assert {f.name for f in dataclasses.fields(CommonConfig)} <= {
        f.name for schema in COMMANDS.values() for f in dataclasses.fields(schema)
    }


def test_the_command_lines_take_the_python_apis_defaults():
    """`generate` and `Pipeline(...)` agree on every default they share: declared once, in
    decoders/engine (the schemas import them)."""
    import inspect

    from specdec.decoders.cli.commands import GenerateCommand
    from specdec.decoders.engine.pipeline import Pipeline

    api = inspect.signature(Pipeline.__init__).parameters
    command = GenerateCommand()
    for name in ("artifacts_dir", "max_new_tokens", "chat_template", "round_gate"):
        assert getattr(command, name) == api[name].default, name
