"""Turning a composed Hydra config into the project's objects.

Every entry point (generate, bench, audit, train) composes a config from
``conf/`` and the structured configs in Hydra's ConfigStore, then calls these
helpers. Where a dataclass holds a section's options (``ModelConfig``, ``SamplingConfig``,
``WorkloadConfig``, ``AuditConfig``, ``ConstraintConfig``, the proposers', verifiers' and drafters'
``Config``), it is stored as that section's structured config
(:func:`store_schema`) and holds the only defaults: the YAML files hold
overrides, and Hydra checks every key and type while composing. The module
defining a dataclass stores it (this one stores ``sampling`` and the ``model`` schema).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

import specdec.decoders.cli.commands  # noqa: F401  (stores each command's typed schema)
from specdec.decoders.engine.constraint_source import ConstraintConfig
from specdec.decoders.engine.registry import import_plugins, load_builtins, proposer_registry
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.models.loading import ModelConfig


def run_id() -> str:
    """What makes this process's output folder its own: the date and time Hydra names it by
    are shared by every run started in the same second (two benches started together wrote
    one results.json), so the folder also carries the process id and a random tag."""
    return f"{os.getpid()}-{secrets.token_hex(2)}"


# resolved once per process (use_cache), so every mention of the folder names the same one
OmegaConf.register_new_resolver("run_id", run_id, use_cache=True, replace=True)

# Hydra validates `proposer=NAME` against the Configs in its ConfigStore while it
# composes, so every built-in is imported (and its Config stored) before any entry
# point composes; the engine alone imports none of them.
load_builtins()

# Absolute, so the Hydra entry points also find it when imported and called in-process (tests).
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def to_dataclass(cls: type, node: Any, what: str) -> Any:
    """Build dataclass ``cls`` from a config node, naming unknown keys clearly."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"{what} has no option(s) {unknown}; its options are {sorted(known)}")
    return cls(**values)  # type: ignore[arg-type]


def store_schema(group: str, name: str, node: type, package: str | None = None) -> None:
    """Make ``group=name`` (or, for a ``base`` schema, what the group's YAML files
    extend through their defaults list) a Hydra choice backed by dataclass ``node``."""
    ConfigStore.instance().store(group=group, name=name, node=node, package=package)


store_schema("sampling", "default", SamplingConfig)
store_schema("model", "base", ModelConfig)  # conf/model/*.yaml extend it
store_schema("constraint", "default", ConstraintConfig)  # none of the three: unconstrained


def model_config(cfg: DictConfig) -> ModelConfig:
    return to_dataclass(ModelConfig, cfg.model, "model")


def sampling_config(cfg: DictConfig) -> SamplingConfig:
    return to_dataclass(SamplingConfig, cfg.sampling, "sampling")


def constraint_config(cfg: DictConfig) -> ConstraintConfig | None:
    """The ``constraint`` section, or None where it names no schema, regex or grammar."""
    node = cfg.get("constraint")
    if node is None:
        return None
    config = to_dataclass(ConstraintConfig, node, "constraint")
    return config if config.kind is not None else None


def component(cfg: DictConfig, key: str) -> dict | None:
    """The proposer/verifier section as a dict (with ``name``), or None if unset."""
    node = cfg.get(key)
    if node is None:
        return None
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]


def load_plugins(cfg: DictConfig) -> None:
    import_plugins(cfg.get("plugins") or [])


def check_proposer_options(cfg: DictConfig) -> None:
    """Build the Config of every proposer the command names (``proposer``, the proposers of
    ``bench.pipelines``, a merge's members) before the model loads: a Config checks its own
    values (the suffix memory's path is one that would otherwise fail after decoding)."""
    specs = [component(cfg, "proposer")]
    bench = cfg.get("bench")
    if bench is not None and bench.get("pipelines"):
        entries = OmegaConf.to_container(bench.pipelines, resolve=True)
        specs += [entry.get("proposer") for entry in entries if isinstance(entry, dict)]  # type: ignore[union-attr]
    for spec in specs:
        _check_proposer_spec(spec)


def _check_proposer_spec(spec: Any) -> None:
    if isinstance(spec, list):
        for item in spec:
            _check_proposer_spec(item)
    if not isinstance(spec, dict):
        return
    name = spec.get("name")
    if isinstance(name, str) and name in proposer_registry:
        options = {key: value for key, value in spec.items() if key != "name"}
        to_dataclass(proposer_registry.get(name).Config, options, f"proposer {name!r}")
    for value in spec.values():  # a merge's members
        _check_proposer_spec(value)
