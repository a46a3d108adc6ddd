"""Files the project writes for later runs and readers: atomically, with the user's permissions.

Results, audits and suffix memories all go through :func:`write_json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def write_json(path: Path, payload: dict, indent: int | None = 2) -> None:
    """Atomic write: an interrupted run never leaves a truncated results file. The file gets
    the permissions any new file of the user's gets (its umask), not the temporary file's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=indent)
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, path)


def check_writable(path: Path, option: str) -> None:
    """Refuse, before any work starts, an output the run could not write at its end: its
    folder is made if missing and a probe file written and removed there."""
    path = Path(path)
    folder = path.parent
    problem = None
    if path.is_dir():
        problem = f"{path} is a folder"
    else:
        existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
        if existing.exists() and not existing.is_dir():  # mkdir's "File exists" names no culprit
            problem = f"{existing} is a file, not a folder"
    try:
        if problem is None:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=folder, suffix=".probe")
            os.close(fd)
            os.remove(probe)
    except OSError as error:
        problem = error.strerror or str(error)
    if problem is not None:
        raise ValueError(
            f"{option}={path}: cannot write in {folder} ({problem}); give {option} a file path in a writable folder"
        )


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def readable_artifact(directory: Path, train_command: str):
    """Inside: load a trained artifact from ``directory``. A file there that cannot be read (torn
    by a killed copy, corrupted, another format) ends in one line naming the folder and how to
    make it again, instead of the reader's traceback. A missing artifact keeps its own message."""
    from safetensors import SafetensorError

    try:
        yield
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError, json.JSONDecodeError) as error:
        if isinstance(error, ValueError) and str(error).startswith(str(directory)):
            raise  # already one line about this artifact
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise ValueError(
            f"{directory}: the trained artifact cannot be read ({type(error).__name__}: {first}); "
            f"it may be corrupted: delete it and train it again with `{train_command}`"
        ) from None
