"""How a constraint is given and compiled (decoders/engine/constraint_source.py): a schema,
regex or grammar that does not compile, or that no text matches, is refused in one line, in the
Python API and on the command line before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.decoders.engine.constraint_source import ConstraintError
from tests.conftest import REPO_ROOT
from tests.decoders.engine.test_constraint import SCHEMA


def test_bad_constraints_are_refused_in_one_line(tiny_pipeline, tmp_path):
    with pytest.raises(ConstraintError, match="constraint.regex is invalid"):
        tiny_pipeline.constraint({"regex": "(ab"})
    with pytest.raises(ConstraintError, match="not valid JSON"):
        tiny_pipeline.constraint({"json_schema": "{'type': 1"})
    with pytest.raises(ConstraintError, match="no such file"):
        tiny_pipeline.constraint({"json_schema": str(tmp_path / "missing.json")})
    with pytest.raises(ConstraintError, match="not regex and grammar"):
        tiny_pipeline.constraint({"regex": "a", "grammar": "start: 'a'"})
    with pytest.raises(ConstraintError, match="unknown name"):
        tiny_pipeline.constraint({"grammar": "start: foo"})
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert tiny_pipeline.constraint({"json_schema": str(schema_file)}).description.startswith("json_schema")
    done = subprocess.run(
        [sys.executable, "-m", "specdec.decoders.generate", "model=tiny-random", 'constraint.regex="(ab"'],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": REPO_ROOT},
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("error: constraint.regex is invalid")


def test_a_constraint_no_text_matches_is_refused_and_a_dead_end_is_said(tiny_pipeline):
    """A regex nothing matches let only the end token through: an empty output, reported as
    cut short by max_new_tokens. It is refused where it compiles (on the command line, before
    the model loads); a grammar that dead-ends later is reported as that, not as the budget."""
    from specdec.decoders.engine.constraint_source import ConstraintConfig, grammar_source
    from specdec.decoders.generate import constraint_verdict

    for config in ({"regex": r"[^\s\S]"}, {"regex": r"a[^\s\S]b"}, {"grammar": "start: /[^\\s\\S]/"}):
        with pytest.raises(ConstraintError, match="matches no text at all.*that some text matches"):
            grammar_source(ConstraintConfig(**config))
    assert tiny_pipeline.constraint({"regex": "a{0}"})  # the empty text matches: kept
    result = tiny_pipeline.generate([5, 6, 7], 16, constraint={"grammar": 'start: "a" x\nx: /[^\\s\\S]/'})
    assert len(result.tokens) < 16 and result.stats.constraint_complete is False
    verdict = constraint_verdict(result.stats, 16, stops=False)
    assert verdict == "INCOMPLETE (the grammar allows no text after this output)"
