"""Results files the benchmark and the audit write (atomically: :func:`write_json`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from specdec.decoders.engine.files import check_writable, write_json  # noqa: F401  (the bench's and the audit's)


@contextlib.contextmanager
def held_output(path: Path, option: str) -> Iterator[None]:
    """This run's hold on its output file for the block: another run given the same ``option``
    meanwhile is refused before any work, naming the holder. (Two audits given one
    audit.output both said "wrote" and one record was lost; a run after this one ends
    overwrites it, as any output is.) The hold is an advisory lock on ``PATH.lock``, which
    names the holding process and is removed when the block ends."""
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform: unguarded, as before
        yield
        return
    lock = Path(path).with_name(Path(path).name + ".lock")
    while True:
        handle = open(lock, "a+")  # noqa: SIM115  (held open for the block)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise ValueError(
                f"{option}={path}: another run (process {holder}) is writing it now; give each run "
                f"at once an {option} of its own"
            ) from None
        if lock.exists() and os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # locked a file its last holder had just removed: lock the one there now
    try:
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still held: a run waiting on it then finds it gone
        handle.close()


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
