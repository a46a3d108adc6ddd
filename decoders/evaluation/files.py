"""Results files the benchmark and the audit write (atomically: :func:`write_json`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from specdec.decoders.engine.files import write_json  # noqa: F401  (the bench's and the audit's writer)


def check_writable(path: Path, option: str) -> None:
    """Refuse, before any work starts, an output the run could not write at its end: its
    folder is made if missing and a probe file written and removed there."""
    folder = Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, suffix=".probe")
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            f"{option}={path}: cannot write in {folder} ({error.strerror or error}); "
            f"give {option} a path in a writable folder"
        ) from None


def read_results(path: Path, what: str) -> dict:
    """A bench results.json, or one line naming the file and what is wrong with it."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable results.json ({error}); {what}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("pipelines"), list):
        raise ValueError(f"{path}: not a results.json written by python -m specdec.decoders.bench; {what}")
    return payload
