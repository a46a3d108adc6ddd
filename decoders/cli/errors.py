"""How the command-line entry points report a problem: one line, then exit.

The project raises ``ValueError`` (bad option values, workloads, sampling,
overlong prompts, incompatible tokenizers), ``FileNotFoundError`` (a missing
trained artifact or input file, with the command that makes it) and
``RegistryError`` (an unknown proposer or verifier, with the registered names),
and every such message already names the problem and its fix. A user of the CLI
needs that message, not the stack above it, so :func:`cli_errors` prints
``error: MESSAGE`` and exits with status 2. ``HYDRA_FULL_ERROR=1`` or
``debug=true`` keeps the traceback. A plugin's code that fails while decoding
(:class:`~specdec.decoders.engine.plugins.PluginError`: it names the plugin and the hook) is
no bad input: one line too, but status 1. Ctrl-C (and SIGTERM) exits with status 130 after
the interrupted command has said what it kept and where.

Hydra's own errors (an unknown option or group choice, a value of the wrong type, a
missing required value) are found before Hydra runs the command by :func:`check_command_line`,
which composes the same config and ends the command the same way: one ``error:`` line,
status 2. It also refuses ``+key=value`` overrides that add an option nothing reads.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from specdec.decoders.engine.plugins import PluginError
from specdec.decoders.engine.registry import RegistryError
from specdec.decoders.models.architecture import UnsupportedArchitectureError

USER_ERRORS = (ValueError, FileNotFoundError, RegistryError, UnsupportedArchitectureError)
USAGE_STATUS = 2
PLUGIN_STATUS = 1  # a plugin's code failed: the input may be fine
INTERRUPTED_STATUS = 130


def wants_traceback(cfg: Any) -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or bool(
        getattr(cfg, "get", lambda *_: False)("debug", False)
    )


def check_command_line(config_name: str, argv: list[str] | None = None) -> None:
    """Compose ``config_name`` with the command line's overrides as Hydra will, and end the
    command with one line (status 2) where that fails. Sweeps (``-m``) and Hydra's own flags
    are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from specdec.decoders.cli.config import CONF_DIR

    args = sys.argv[1:] if argv is None else argv
    for arg in args:  # bytes that are not UTF-8 reach Python as lone surrogates
        bad = next((c for c in arg if "\udc80" <= c <= "\udcff"), None)
        if bad is not None:
            key = arg.split("=", 1)[0]
            _exit_with(
                f"{key}=...: not UTF-8 text (byte 0x{ord(bad) - 0xDC00:02x}); give the value in UTF-8 "
                f"(e.g. iconv -f latin1 -t utf-8)"
            )
    if any(a.startswith("-") for a in args) or wants_traceback(_debug_override(args)):
        return
    added = [a for a in args if a.startswith("+") and not a.startswith("++")]
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            plain = compose(
                config_name, overrides=[a for a in args if a not in added], return_hydra_config=True
            )
            for override in added:  # before composing with them: a typed schema refuses them less clearly
                key = override[1:].split("=", 1)[0]
                if OmegaConf.select(plain, key, default=_ABSENT) is _ABSENT:
                    _exit_with(
                        f"{override}: adds an option no part of this command reads; remove it "
                        f"(`python -m ... --cfg job` lists the options)"
                    )
            cfg = compose(config_name, overrides=args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:
        _exit_with(hydra_message(error))
    missing = sorted(_missing_values(cfg))
    if missing:
        _exit_with(f"{missing[0]} has no value; give {missing[0]}=... on the command line")


_ABSENT = object()


def _missing_values(node, prefix: str = "") -> list[str]:
    """Keys left at ``???`` (Hydra's required values), without resolving interpolations."""
    from omegaconf import DictConfig, OmegaConf

    found = []
    for key in node.keys():
        if not prefix and key == "hydra":
            continue
        if OmegaConf.is_missing(node, key):
            found.append(f"{prefix}{key}")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_interpolation():
            found += _missing_values(child, f"{prefix}{key}.")
    return found


def _debug_override(args: list[str]) -> dict:
    return {"debug": any(a in ("debug=true", "debug=True") for a in args)}


def hydra_message(error: BaseException) -> str:
    """One line from a Hydra or OmegaConf error: its first line, the cause's first line,
    and the choices a group offers (Hydra lists them on lines of their own)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = lines[0] if lines else type(error).__name__
    if "Available options in" in str(error):
        options = [
            line for line in lines[1:] if not line.startswith(("Available", "Config search", "provider="))
        ]
        message += f"; choose one of: {', '.join(options)}"
    cause = error.__cause__
    if cause is not None and str(cause).strip():
        message += f" ({str(cause).strip().splitlines()[0]})"
    if message.startswith("Could not override '") and type(cause).__name__ == "ConfigAttributeError":
        key = message.split("'")[1]
        message = f"{key}: no such option ({str(cause).strip().splitlines()[0]}); --cfg job lists the options"
    if message.startswith("Ambiguous value for argument '"):
        message = _ambiguous_value_message(message, lines[1:])
    return message.replace("To append to your config use ", "")


def _ambiguous_value_message(message: str, hints: list[str]) -> str:
    """Hydra reads an unquoted comma as a list or a sweep and lists its remedies on lines of
    their own; the one a user usually wants, one string, needs quotes the shell keeps."""
    override = message[len("Ambiguous value for argument '") :].rsplit("'", 1)[0]
    key, _, value = override.partition("=")
    example = f"'{key}=\"{value}\"'" if '"' not in value else f"\"{key}='{value}'\""
    remedies = []
    for hint in hints:
        remedy = hint.split(". ", 1)[-1]  # "2. To use it as string, ..."
        remedy = remedy[:1].lower() + remedy[1:]
        if "quote the value" in remedy:
            remedy += f" (inside the shell's quotes: {example})"
        remedies.append(remedy)
    if not any("quote the value" in remedy for remedy in remedies):
        remedies.append(f"to use it as one string, quote the value inside the shell's quotes: {example}")
    return f"{key}={value}: Hydra reads an unquoted comma as a list or a sweep; {'; '.join(remedies)}"


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_STATUS)


def cli_errors(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a Hydra task function so the project's errors end the command in one line."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)  # said and kept as Ctrl-C is
        try:
            return task(cfg)
        except PluginError as error:
            if wants_traceback(cfg):
                raise
            print(f"error: {error}; debug=true shows the traceback", file=sys.stderr)
            sys.exit(PLUGIN_STATUS)
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
