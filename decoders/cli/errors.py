"""How the command-line entry points report a problem: one line, then exit.

The project raises ``ValueError`` (bad option values, workloads, sampling,
overlong prompts, incompatible tokenizers), ``FileNotFoundError`` (a missing
trained artifact or input file, with the command that makes it) and
``RegistryError`` (an unknown proposer or verifier, with the registered names),
and every such message already names the problem and its fix. A user of the CLI
needs that message, not the stack above it, so :func:`cli_errors` prints
``error: MESSAGE`` and exits with status 2. ``HYDRA_FULL_ERROR=1`` or
``debug=true`` keeps the traceback. Ctrl-C exits with status 130 after the
interrupted command has said what it kept and where.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from decoders.engine.registry import RegistryError
from decoders.models.architecture import UnsupportedArchitectureError

USER_ERRORS = (ValueError, FileNotFoundError, RegistryError, UnsupportedArchitectureError)
USAGE_STATUS = 2
INTERRUPTED_STATUS = 130


def wants_traceback(cfg: Any) -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or bool(
        getattr(cfg, "get", lambda *_: False)("debug", False)
    )


def cli_errors(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a Hydra task function so the project's errors end the command in one line."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        try:
            return task(cfg)
        except USER_ERRORS as error:
            if wants_traceback(cfg):
                raise
            print(f"error: {error}", file=sys.stderr)
            sys.exit(USAGE_STATUS)
        except KeyboardInterrupt:
            if wants_traceback(cfg):
                raise
            sys.exit(INTERRUPTED_STATUS)

    return wrapper
