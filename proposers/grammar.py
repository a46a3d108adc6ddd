"""The grammar's forced continuation, drafted for free (SGLang's jump-forward, as a draft).

Under a constraint (decoders/engine/constraint.py), wherever the grammar allows one
continuation only (a JSON object's next key, its quotes and separators, the rest of an
enum value once its first letters are written), that continuation is drafted as a chain
of its canonical tokens. It costs a grammar lookup (microseconds) and no model pass; the
target verifies it with the rest of the pass, and accepts it wherever the constrained
target's choice is the canonical spelling (almost always).

Where forced bytes are left that no forced token covers (the `` "`` before a string
value), it drafts the token the target wrote for them before, valued at how often it did
(:class:`specdec.decoders.engine.constraint.LayoutHabits`), and goes on with what the
grammar forces after it.

Where the grammar forces nothing, or the request has no constraint, the draft is empty
and the round is a standard decoding step. ``merge`` joins it with any other proposer:
``proposer=merge "proposer.members=[{name:grammar},{name:medusa,tree:dynamic,tree_budget:auto}]"``.
(The engine also appends forced tokens to the leaves of every draft under a constraint:
this proposer adds the forced tokens from the pending token itself.)
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.decoders.engine.draft import Draft
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import register_proposer


@register_proposer("grammar")
class GrammarProposer(Proposer):
    @dataclass
    class Config:
        k: int = 32  # the longest forced continuation drafted

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")

    def propose(self, state) -> Draft:
        if state.grammar is None:
            return Draft.empty()
        tokens, values = state.grammar.continuation(self.config.k)  # forced: 1; layout tokens: their share
        return Draft.chain(tokens, values=values)  # point masses
