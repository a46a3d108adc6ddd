"""Command lines as a shell hands them over: the README's commands parse as written, and a
value Hydra cannot read is one line with Hydra's own remedies, quoting included."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def readme_command(starting: str) -> list[str]:
    """The README command that starts with ``starting``, its continuation lines joined, split
    into arguments as a POSIX shell splits them."""
    text = (Path(REPO_ROOT) / "README.md").read_text()
    start = text.index(starting)
    command = re.split(r"(?<!\\)\n", text[start:], maxsplit=1)[0].replace("\\\n", " ")
    return shlex.split(command)


def test_the_readme_structured_generation_example_runs_as_written(monkeypatch, capsys, tmp_path):
    """Its prompt has commas: unquoted inside the shell's quotes, Hydra read it as a list."""
    from specdec.decoders import generate
    from specdec.decoders.cli.errors import check_command_line

    args = readme_command("python -m specdec.decoders.generate 'prompt=")[3:]
    assert args[0] == 'prompt="Alice Smith, 42, lives in Paris. Answer in JSON with name, age, city."'
    args += ["model=tiny-random", "max_new_tokens=6"]  # the default model is not the point here
    check_command_line("generate", args)  # what the command does first: ends it where Hydra would fail
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["specdec.decoders.generate", *args])
    generate.main()
    err = capsys.readouterr().err
    assert "[merge+tree]" in err and "constraint" in err and "error" not in err


def test_an_ambiguous_value_is_one_line_with_hydras_quoting_hint(capsys):
    from specdec.decoders.cli.errors import USAGE_STATUS, check_command_line

    with pytest.raises(SystemExit) as exit_:
        check_command_line("generate", ["prompt=Alice Smith, 42, lives in Paris."])
    assert exit_.value.code == USAGE_STATUS
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: prompt=Alice Smith, 42, lives in Paris.: ")
    assert "to use it as string, quote the value" in line  # Hydra's hint, which the line used to drop
    assert """'prompt="Alice Smith, 42, lives in Paris."'""" in line  # and how to write it in a shell
    assert "to use it as a list, use key=[value1,value2]" in line and "--multirun" in line
