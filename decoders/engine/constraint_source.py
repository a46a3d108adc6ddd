"""How a constraint is given and compiled: ``constraint.*`` (:class:`ConstraintConfig`: a JSON
schema, a regex or a Lark/GBNF grammar, inline or in a file) turned into llguidance's grammar
text (:func:`grammar_source`), every mistake a one-line :class:`ConstraintError` before any model
loads. JSON is laid out as instruct models write it (:data:`JSON_LAYOUT`). What a compiled
grammar does while decoding (masks, the draft's cut, forced tokens) is
:mod:`specdec.decoders.engine.constraint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# JSON laid out the way instruct models write it: ", " and ": " and no free whitespace,
# so every key, quote and brace is forced. (llguidance's own default lets whitespace vary.)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "grammar")


class ConstraintError(ValueError):
    """A schema, regex or grammar the engine cannot compile; the message names it."""


@dataclass
class ConstraintConfig:
    """``constraint.*``: at most one of the three kinds. A value is inline text, or a path
    to a file holding it (json_schema, grammar)."""

    json_schema: Any = None  # a JSON schema: a file, JSON text, or a mapping
    regex: str | None = None  # the whole output matches this regular expression
    grammar: str | None = None  # a Lark (or GBNF) grammar: a file or its text
    # how many forced tokens the engine appends to each leaf of a draft (0: none)
    forced_per_leaf: int = 16

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, "")]
        if len(given) > 1:
            raise ConstraintError(
                f"constraint: give one of constraint.json_schema, constraint.regex or constraint.grammar, "
                f"not {' and '.join(given)}"
            )
        if self.forced_per_leaf < 0:
            raise ConstraintError(f"constraint.forced_per_leaf must be >= 0, got {self.forced_per_leaf}")

    @property
    def kind(self) -> str | None:
        return next((kind for kind in KINDS if getattr(self, kind) not in (None, "")), None)


def text_or_file(value: str, kind: str) -> str:
    """``value`` itself, or the contents of the file it names."""
    stripped = value.strip()
    if stripped and stripped[0] not in "{[" and "\n" not in stripped and len(stripped) < 4096:
        path = Path(stripped).expanduser()
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise ConstraintError(f"constraint.{kind}={value}: cannot read the file: {error}") from None
        if kind == "json_schema" or path.suffix in (".json", ".lark", ".gbnf", ".ebnf"):
            raise ConstraintError(
                f"constraint.{kind}={value}: no such file (give a file or the {kind} itself)"
            )
    return value


def grammar_source(config: ConstraintConfig) -> tuple[str, str]:
    """(llguidance grammar text, a short description) of a constraint; one-line errors."""
    import llguidance

    kind = config.kind
    value = getattr(config, kind)
    try:
        if kind == "json_schema":
            if not isinstance(value, dict):
                text = text_or_file(str(value), kind)
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as error:
                    raise ConstraintError(
                        f"constraint.json_schema is not valid JSON ({error.msg} at line {error.lineno} "
                        f"column {error.colno}); give a JSON schema or a file holding one"
                    ) from None
            if not isinstance(value, dict):
                raise ConstraintError("constraint.json_schema must be a JSON object (a schema)")
            source = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
            title = value.get("title") or "schema"
        elif kind == "regex":
            source, title = llguidance.LLMatcher.grammar_from_regex(str(value)), f"regex {value!r}"
        else:
            text = text_or_file(str(value), kind)
            source, title = llguidance.grammar_from("grammar", text), "grammar"
    except ConstraintError:
        raise
    except (ValueError, RuntimeError, TypeError) as error:
        raise ConstraintError(f"constraint.{kind}: {first_line(error)}") from None
    problem = llguidance.LLMatcher.validate_grammar(source)
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(f"constraint.{kind} is invalid: {first_line(problem)}")
    # A grammar no text matches allows only the end token from the start: decoding would end
    # at once, empty and incomplete. Over bytes, so it is known before any model loads.
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), source, log_level=0)
    if not matcher.is_error():  # (one naming the model's own special tokens is left to its tokenizer)
        matcher.compute_bitmask()
        if matcher.is_stopped() and not matcher.is_accepting():
            raise ConstraintError(
                f"constraint.{kind}={getattr(config, kind)} matches no text at all, so nothing could be "
                f"generated under it; give a {kind.replace('_', ' ')} that some text matches"
            )
    return source, f"{kind}: {title}"


def first_line(error: object) -> str:
    """An error's first line (its type's name where it says nothing): the one-line errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
