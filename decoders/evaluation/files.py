"""Results files the benchmark and the audit write (atomically: :func:`write_json`)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.decoders.engine.files import check_writable, write_json  # noqa: F401  (the bench's and the audit's)


def read_results(path: Path, what: str) -> dict:
    """A bench results.json, or one line naming the file and what is wrong with it."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable results.json ({error}); {what}") from None
    batch = (
        isinstance(payload, dict) and payload.get("mode") == "batch" and isinstance(payload.get("rows"), list)
    )
    if not batch and (not isinstance(payload, dict) or not isinstance(payload.get("pipelines"), list)):
        raise ValueError(f"{path}: not a results.json written by python -m specdec.decoders.bench; {what}")
    return payload  # a batch-mode run's ("mode": "batch") holds rows per batch size instead of pipelines


def batch_run(payload: dict) -> str | None:
    """How a batch-mode run's results were asked for (``bench.batch_size=[1, 4]``), None for a
    per-prompt run: replay and report read per-prompt runs only."""
    if payload.get("mode") != "batch":
        return None
    return f"bench.batch_size={payload.get('batch_sizes')}"
