"""Registries that map config names to proposer and verifier classes.

A class joins a registry through a decorator (``@register_proposer("mine")``).
Each registered class carries a ``Config`` dataclass; registration also stores
that dataclass in Hydra's ConfigStore under the registry's config group, so
``proposer=mine proposer.k=3`` is composed and type-checked by Hydra like any
built-in choice.

Built-ins are known by name only (``BUILTIN_PROPOSERS``, ``BUILTIN_VERIFIERS``:
name -> ``"module:Class"``, the one line a built-in adds here; everything else about it
is declared on its class: :class:`specdec.decoders.engine.proposer.Proposer`) and imported the
first time they are looked up, so the
engine never imports a plugin package: ``proposers`` and ``verifiers`` depend on
the engine, never the reverse. Listing a registry names the built-ins without
importing them. Hydra needs every choice's Config stored before it composes, so
the command-line layer (:mod:`specdec.decoders.cli.config`) calls :func:`load_builtins`.

Third-party packages register through the entry-point groups
``specdec.proposers`` and ``specdec.verifiers`` (each entry point names a module
to import); a user's own modules are imported through the ``plugins`` config
key (see :func:`import_plugins`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown name was looked up; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of classes with a decorator for registration."""

    def __init__(
        self, kind: str, group: str, entry_point_group: str, builtins: dict[str, str] | None = None
    ) -> None:
        self.kind = kind
        self.group = group
        self.entry_point_group = entry_point_group
        self.builtins = dict(builtins or {})  # name -> "module:Class", imported on first lookup
        self._classes: dict[str, type[T]] = {}
        self._entry_points_loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: ``@registry.register("name")``."""

        def decorator(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                existing = self._classes[name]
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered by "
                    f"{existing.__module__}.{existing.__qualname__}; pick another name."
                )
            builtin = self.builtins.get(name)
            if builtin is not None and builtin != f"{cls.__module__}:{cls.__qualname__}":
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered by the built-in {builtin}; pick another name."
                )
            config_cls = getattr(cls, "Config", None)
            if config_cls is None or not dataclasses.is_dataclass(config_cls):
                raise TypeError(
                    f"{self.kind} {cls.__qualname__} needs a nested dataclass `Config` "
                    "holding its options (an empty one is fine)."
                )
            cls.name = name
            self._classes[name] = cls
            store_named_config(self.group, name, config_cls)
            return cls

        return decorator

    def get(self, name: str) -> type[T]:
        self.load_entry_points()
        if name not in self._classes and name in self.builtins:
            self._import_builtin(name)
        try:
            return self._classes[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}. Registered {self.kind}s: "
                f"{', '.join(self.names())}. To add your own, decorate a class with "
                f"@register_{self.kind}({name!r}) in a module and list that module in "
                f"`plugins=[your.module]`."
            ) from None

    def names(self) -> list[str]:
        """Every registered name, built-ins included (without importing them)."""
        self.load_entry_points()
        return sorted(set(self._classes) | set(self.builtins))

    def __contains__(self, name: str) -> bool:
        self.load_entry_points()
        return name in self._classes or name in self.builtins

    def plugin_classes(self) -> list[type[T]]:
        """The registered classes that are no part of the project (plugins, entry points)."""
        return [cls for cls in self._classes.values() if not cls.__module__.startswith("specdec.")]

    def load_builtins(self) -> None:
        """Import every built-in (their decorators register them and store their Configs)."""
        for name in self.builtins:
            if name not in self._classes:
                self._import_builtin(name)

    def _import_builtin(self, name: str) -> None:
        module, _, qualname = self.builtins[name].partition(":")
        importlib.import_module(module)  # its @register_* decorator registers the class
        registered = self._classes.get(name)
        if registered is None or registered.__qualname__ != qualname:
            raise RuntimeError(f"built-in {self.kind} {name!r}: {module} did not register {qualname}")

    def load_entry_points(self) -> None:
        """Import every module advertised under this registry's entry-point group."""
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for entry_point in importlib.metadata.entry_points(group=self.entry_point_group):
            entry_point.load()


def store_named_config(group: str, name: str, config_cls: type) -> None:
    """Make ``group=name`` a Hydra choice backed by the class's Config dataclass."""
    from hydra.core.config_store import ConfigStore

    # The stored node carries `name` so the composed config says which class to build.
    fields = [("name", str, dataclasses.field(default=name))]
    node_cls = dataclasses.make_dataclass(
        f"{config_cls.__name__}Node_{group}_{name}".replace("-", "_"),
        fields,
        bases=(config_cls,),
    )
    ConfigStore.instance().store(group=group, name=name, node=node_cls)


def build(registry: Registry[T], cfg: Any, **kwargs: Any) -> T:
    """Instantiate the class named by ``cfg.name`` with its validated Config.

    ``cfg`` may be a DictConfig, a dict, or a plain name string.
    """
    if isinstance(cfg, str):
        options: dict[str, Any] = {}
        name = cfg
    else:
        options = _to_dict(cfg)
        name = options.pop("name")
    cls = registry.get(name)
    config_cls = cls.Config  # type: ignore[attr-defined]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"{registry.kind} {name!r} has no option(s) {unknown}; its options are {sorted(known)}."
        )
    return cls(config_cls(**options), **kwargs)  # type: ignore[call-arg]


def _to_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, dict):
        return dict(cfg)
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def import_plugins(modules: Iterable[str]) -> None:
    """Import user modules so their ``@register_*`` decorators run."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(
                f"could not import plugin module {module!r} listed in `plugins` ({error}); "
                "make sure it is importable (installed, or on PYTHONPATH)"
            ) from error


def import_plugins_from_argv(argv: list[str] | None = None) -> None:
    """Import ``plugins=[a.b,c]`` modules named on the command line before Hydra composes.

    Hydra validates ``proposer=mine`` against the registered choices while composing,
    so a plugin's registration must run before composition; the ``plugins`` key in
    the composed config is then only a record of what was imported.
    """
    for arg in argv if argv is not None else sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key.lstrip("+") != "plugins" or not value:
            continue
        value = value.strip().strip("[]")
        try:
            import_plugins(m.strip().strip("'\"") for m in value.split(",") if m.strip())
        except ImportError as error:  # on the command line: one line and status 2, as other errors
            if "debug=true" in (argv if argv is not None else sys.argv[1:]):
                raise
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)


BUILTIN_PROPOSERS = {
    "draft_model": "specdec.proposers.draft_model:DraftModelProposer",
    "eagle": "specdec.proposers.eagle.proposer:EagleProposer",
    "early_exit": "specdec.proposers.early_exit:EarlyExitProposer",
    "grammar": "specdec.proposers.grammar:GrammarProposer",
    "copy_heads": "specdec.proposers.medusa.copy_heads:CopyHeadsProposer",
    "medusa": "specdec.proposers.medusa.proposer:MedusaProposer",
    "merge": "specdec.proposers.merge:MergeProposer",
    "ngram": "specdec.proposers.ngram:NgramProposer",
    "span": "specdec.proposers.span:SpanProposer",
    "suffix": "specdec.proposers.suffix:SuffixProposer",
}
BUILTIN_VERIFIERS = {
    "greedy": "specdec.verifiers.greedy:GreedyVerifier",
    "rejection": "specdec.verifiers.rejection:RejectionVerifier",
    "tree": "specdec.verifiers.tree:TreeVerifier",
    "typical": "specdec.verifiers.typical:TypicalVerifier",
}

proposer_registry: Registry[Any] = Registry("proposer", "proposer", "specdec.proposers", BUILTIN_PROPOSERS)
verifier_registry: Registry[Any] = Registry("verifier", "verifier", "specdec.verifiers", BUILTIN_VERIFIERS)


def load_builtins() -> None:
    """Import every built-in proposer and verifier (the command line needs all their
    Configs in Hydra's ConfigStore before it composes)."""
    proposer_registry.load_builtins()
    verifier_registry.load_builtins()


def find_preset(label: str) -> tuple[str, Any] | None:
    """(proposer name, :class:`specdec.decoders.engine.proposer.Preset`) of the preset named
    ``label``, declared by the proposer whose name is the label's longest prefix; None if
    no proposer declares it."""
    for name in sorted(proposer_registry.names(), key=len, reverse=True):
        if label.startswith(name + "_"):
            for preset in getattr(proposer_registry.get(name), "presets", ()):
                if preset.label == label:
                    return name, preset
    return None


def drafter_trainers() -> dict[str, str]:
    """Drafter name -> the module that trains it, from every proposer's declaration
    (``artifact`` and ``trainer``): what ``python -m specdec.train drafter=NAME`` offers."""
    proposer_registry.load_builtins()
    trainers: dict[str, str] = {}
    for name in proposer_registry.names():
        cls = proposer_registry.get(name)
        if getattr(cls, "trainer", None):
            trainers.setdefault(cls.artifact, cls.trainer)
    return dict(sorted(trainers.items()))


def register_proposer(name: str) -> Callable[[type[T]], type[T]]:
    """Register a Proposer subclass as ``proposer=<name>``."""
    return proposer_registry.register(name)


def register_verifier(name: str) -> Callable[[type[T]], type[T]]:
    """Register a Verifier subclass as ``verifier=<name>``."""
    return verifier_registry.register(name)


SIZING_MODULE = "specdec.decoders.sizing.policy"


def default_sizing(cost_curve: Callable[[], Any], batch_curve: Callable[[int], Any] | None = None) -> Any:
    """A pipeline's sizing policy unless it is given one (``decoders/sizing/policy.py``:
    every draft's size and the round gate), reached by module name like the built-in
    proposers: the sizing layer sits above the engine that uses it."""
    return importlib.import_module(SIZING_MODULE).SizingPolicy(cost_curve, batch_curve=batch_curve)
