"""Whose fault: a plugin's code that fails while decoding is named, not taken for bad input.

A proposer or verifier registered from outside the project (``plugins=[module]``, an entry
point) runs inside the decode loop. When its code raises, the user needs to know which plugin
failed and in which hook, and that the options given were not at fault (a ``ValueError`` the
plugin raised would otherwise read as bad input). :func:`plugin_code` turns such an exception
into a :class:`PluginError` naming the plugin, the hook the engine called and the plugin's own
function, with the original exception as its ``__cause__``; the command line prints it in one
line and exits with status 1. The project's own code raises through it unchanged, and so do
``KeyboardInterrupt`` and whatever a plugin's constructor raises (its options are checked
there, and a bad option is the user's input).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from specdec.decoders.engine.registry import proposer_registry, verifier_registry
from specdec.decoders.engine.verifier import Verifier


class PluginError(RuntimeError):
    """A plugin's code failed while decoding (or broke the contract the engine checks: a
    draft's token ids); the message names the plugin and where."""


def describe(component: Any) -> str:
    """``proposer 'name'`` (and its module, for a plugin)."""
    kind = "verifier" if isinstance(component, Verifier) else "proposer"
    text = f"{kind} {getattr(component, 'name', type(component).__name__)!r}"
    module = type(component).__module__
    return text if module.startswith("specdec.") else f"{text} (plugin {module})"


@contextmanager
def plugin_code(component: Any, hook: str) -> Iterator[None]:
    """Run one of ``component``'s hooks (``hook``: the engine's name for it): an exception
    raised in a plugin's code, the component's own or a plugin's that it called (a merge of
    plugins), becomes a :class:`PluginError`."""
    try:
        yield
    except PluginError:
        raise
    except Exception as error:
        culprit, function = _plugin_frame(error.__traceback__)
        if culprit is None and not isinstance(component, _plugin_classes()):
            raise  # the project's own code: its traceback is the report
        named = describe(culprit if culprit is not None else component)
        where = hook if function in (None, hook) else f"{hook} ({function})"
        first = (str(error).strip().splitlines() or [""])[0]
        raise PluginError(f"{named} failed in {where}: {type(error).__name__}: {first}") from error


def _plugin_classes() -> tuple[type, ...]:
    return (*proposer_registry.plugin_classes(), *verifier_registry.plugin_classes())


def _plugin_frame(traceback: TracebackType | None) -> tuple[Any, str | None]:
    """(the plugin object, its function) of the innermost frame of ``traceback`` that runs
    a plugin's method; (None, None) where none does."""
    classes = _plugin_classes()
    found: tuple[Any, str | None] = (None, None)
    while traceback is not None:
        frame = traceback.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, classes):
            found = (owner, frame.f_code.co_name)
        traceback = traceback.tb_next
    return found
