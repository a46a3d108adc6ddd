"""Running the bench CLI in-process on the tiny model, for the bench, report and tracking tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# Three prompts in two categories, each with a second turn; repetitive text gives
# prompt lookup something to find.
TINY_WORKLOAD = [
    {
        "question_id": "a",
        "category": "qa",
        "turns": ["the cat sat on the mat. the cat sat on the", "and then?"],
    },
    {
        "question_id": "b",
        "category": "rag",
        "turns": ["one two three one two three one two", "again, slower"],
    },
    {"question_id": "c", "category": "qa", "turns": ["abc abc abc abc abc", "more"]},
]


def write_workload(directory: Path) -> Path:
    path = directory / "workload.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in TINY_WORKLOAD) + "\n")
    return path


def tiny_overrides(workload: Path, *extra: str) -> list[str]:
    """The tiny model in float64 (exact greedy equality), a short generation, no W&B, and
    T(n) measured into the run directory (the user's cost cache is left alone)."""
    return [
        "model=tiny-random",
        "model.dtype=float64",
        f"workload.path={workload}",
        "bench.max_new_tokens=8",
        "logger=disabled",
        "bench.cost_cache=false",
        *extra,
    ]


def run_bench(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> None:
    """``python -m specdec.decoders.bench OVERRIDES`` in this process (so tests can monkeypatch it)."""
    from specdec.decoders import bench

    monkeypatch.setattr(sys, "argv", ["specdec.decoders.bench", *overrides])
    bench.main()
