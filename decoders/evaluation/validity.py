"""Whether a constrained output is what its constraint asked for, judged apart from the
grammar engine that produced it: a JSON schema's output must parse and validate
(``jsonschema``), a regex's must match whole (Python's ``re``); a Lark grammar's is
checked by llguidance itself (there is no second engine to ask)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from specdec.decoders.engine.constraint import Constraint
from specdec.decoders.engine.constraint_source import ConstraintConfig, text_or_file


def output_valid(text: str, tokens: list[int], spec: ConstraintConfig, constraint: Constraint) -> bool:
    """Whether ``text`` (the decoded ``tokens``, end token excluded) satisfies ``spec``."""
    kind = spec.kind
    if kind == "json_schema":
        schema: Any = spec.json_schema
        if not isinstance(schema, dict):
            schema = json.loads(text_or_file(str(schema), kind))
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(str(spec.regex), text) is not None
    return constraint.accepts(tokens)
