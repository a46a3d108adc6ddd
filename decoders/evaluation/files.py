"""Results files the benchmark and the audit write."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: Path, payload: dict) -> None:
    """Atomic write: an interrupted run never leaves a truncated results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(tmp, path)
