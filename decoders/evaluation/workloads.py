"""Benchmark workloads: the project's own prompt set and Spec-Bench files.

Both use Spec-Bench's question.jsonl format, one JSON object a line:
``{"question_id": ..., "category": ..., "turns": [first user turn, ...]}``.
MT-bench's eight categories (writing, roleplay, ...) are reported as one
category, ``mt_bench``, as Spec-Bench does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.decoders.cli.config import store_schema, to_dataclass

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "default_prompts.jsonl"
# The project's own repetitive workload: four families of ten requests sharing structure
# (code edits returning their input, JSON extraction to one schema, notes rewritten into
# one email format, SQL over one schema). Its categories are "<family>/first" and
# "<family>/later", so the first request of a family, met with an empty memory, is
# reported apart from the later ones; the file order is the order they run in.
AGENTIC_PROMPTS = Path(__file__).parent / "data" / "agentic_prompts.jsonl"
# Structured generation: 32 requests, each with the JSON schema its answer must follow (the
# row's "constraint"), in three categories: field_extraction (from a given text), a tool call's
# arguments, classification into fixed labels.
STRUCTURED_PROMPTS = Path(__file__).parent / "data" / "structured_prompts.jsonl"
SHIPPED_PROMPTS = {"default": DEFAULT_PROMPTS, "agentic": AGENTIC_PROMPTS, "structured": STRUCTURED_PROMPTS}
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass
class WorkloadConfig:
    """``workload.*``, the schema every conf/workload/*.yaml extends (they hold overrides)."""

    name: str = "default"
    path: str | None = None  # null = the shipped file of ``name`` (default: data/default_prompts.jsonl)
    limit: int | None = None  # first N prompts of each category
    categories: list[str] | None = None  # e.g. [qa, rag]
    turns: int = 1  # 2 = also the second turn of multi-turn prompts, fed the model's first answer


store_schema("workload", "base", WorkloadConfig)


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]
    # the answer's constraint, {"json_schema" | "regex" | "grammar": ...} (None: unconstrained,
    # or the run's constraint.*)
    constraint: dict | None = None


def load_workload(cfg: WorkloadConfig, option: str = "workload.path") -> list[Prompt]:
    """The prompts of a workload, grouped by category in file order. ``option`` is what the
    messages tell the user to change (``train.eval.path`` reads a workload file too)."""
    if cfg.turns not in (1, 2):
        raise ValueError(f"workload.turns must be 1 or 2, got {cfg.turns}")
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"workload.limit must be >= 1, got {cfg.limit}")
    if not cfg.path and cfg.name not in SHIPPED_PROMPTS:
        raise ValueError(
            f"workload={cfg.name} needs workload.path=FILE (a Spec-Bench question.jsonl file); "
            f"the shipped workloads are {', '.join(SHIPPED_PROMPTS)}."
        )
    path = Path(cfg.path) if cfg.path else SHIPPED_PROMPTS[cfg.name]
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(
            f"workload file {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}); convert it (iconv -f latin1 -t utf-8) or pass another {option}"
        ) from None
    except OSError as error:
        shipped = ", or use workload=default" if option == "workload.path" else ""
        raise FileNotFoundError(
            f"cannot read workload file {path}: {error.strerror}. Pass {option}=FILE with a "
            f"Spec-Bench question.jsonl file{shipped}."
        ) from error
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category = row["category"]
            turns = row["turns"]
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError("turns must be a non-empty list of strings")
            constraint = row.get("constraint")
            if constraint is not None and not isinstance(constraint, dict):
                raise ValueError('constraint must be an object such as {"json_schema": {...}}')
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as error:
            raise ValueError(
                f"{path}:{number} is not a Spec-Bench question (need JSON with 'category' and "
                f"'turns'): {error}"
            ) from error
        if category in MT_BENCH_CATEGORIES:
            category = "mt_bench"
        prompts.append(Prompt(str(row.get("question_id", number)), category, turns[: cfg.turns], constraint))
    if cfg.categories:
        unknown = set(cfg.categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(
                f"workload.categories {sorted(unknown)} not in {path}; its categories are "
                f"{sorted({p.category for p in prompts})}"
            )
        prompts = [p for p in prompts if p.category in cfg.categories]
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    if cfg.limit is not None:
        by_category = {c: ps[: cfg.limit] for c, ps in by_category.items()}
    selected = [p for ps in by_category.values() for p in ps]
    if not selected:
        raise ValueError(f"workload {path} has no prompts")
    return selected


def workload_config(cfg: Any) -> WorkloadConfig:
    """The composed config's ``workload`` section as a WorkloadConfig."""
    return to_dataclass(WorkloadConfig, cfg.workload, "workload")
