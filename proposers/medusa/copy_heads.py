"""The ``copy_heads`` proposer: the Medusa proposer (:mod:`specdec.proposers.medusa.proposer`)
with the copy heads' best measured configuration as its defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.decoders.engine.proposer import Preset
from specdec.decoders.engine.registry import register_proposer
from specdec.proposers.medusa.proposer import MedusaProposer


@register_proposer("copy_heads")
class CopyHeadsProposer(MedusaProposer):
    """The copy heads: the heads ``python -m specdec.train drafter=medusa`` trains by default, each
    mixing its vocabulary distribution with a pointer into the committed context
    (:mod:`specdec.proposers.copy_attention`). Its defaults are its best measured configuration on
    the default target: a dynamic tree grown from the heads' confidence, sized each round
    from T(n) and the acceptance measured (``tree_budget: auto``), verified by ``tree``."""

    presets = (Preset("copy_heads_chain", {"tree": None, "tree_budget": None}),)

    @dataclass
    class Config(MedusaProposer.Config):
        tree: Any = "dynamic"
        tree_budget: Any = "auto"  # (the copy heads' best measured: a dynamic tree sized from T(n))
