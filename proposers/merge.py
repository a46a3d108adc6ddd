"""Several proposers' drafts verified as one tree.

Drafters fail in different places: Medusa heads guess the target's phrasing
from its hidden state but cannot copy a rare name out of the prompt, while
prompt lookup copies well and guesses nothing else. ``proposer=merge`` asks each
member for its draft and joins them into one token tree (shared prefixes
become shared nodes), so the target checks every member's guesses in the same
pass. The first member's principal path stays the principal path (what a chain
verifier keeps).

Each member sizes its own draft from its own config and sees, after the
round, the acceptance of its own draft (its nodes along the tokens the target
committed), so adaptive members (``ngram``'s length policy, Medusa's budget)
keep learning as if alone. The merged tree is deterministic (draft_probs None):
the tree verifier's point-mass rule is lossless for any set of candidates
chosen independently of the verifier's own randomness, which sampled members'
tokens are.

Example: ``proposer=merge "proposer.members=[{name:medusa,tree:auto,tree_budget:auto},{name:ngram}]"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decoders.draft import Acceptance, Draft, follow_tokens
from decoders.registry import build, proposer_registry, register_proposer
from proposers.base import Proposer


@register_proposer("merge")
class MergeProposer(Proposer):
    @dataclass
    class Config:
        # member proposers: names or {name: ..., options...}, as for `proposer`
        members: list[Any] = field(default_factory=lambda: [{"name": "medusa"}, {"name": "ngram"}])

    sampled = False

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if not config.members:
            raise ValueError("proposer=merge needs at least one member in proposer.members")
        names = [m if isinstance(m, str) else m.get("name") for m in config.members]
        if "merge" in names:
            raise ValueError("proposer.members cannot hold another merge; list its members directly")
        self.members: list[Proposer] = [build(proposer_registry, m, context=context) for m in config.members]
        self._drafts: list[Draft] = []
        self.merged_nodes = 0  # nodes saved by shared prefixes, over all rounds
        self.own_nodes = [0] * len(self.members)  # nodes only this member proposed

    def begin(self, state) -> None:
        for member in self.members:
            member.begin(state)

    def propose(self, state) -> Draft:
        self._drafts = [member.propose(state) for member in self.members]
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
        for m, draft in enumerate(self._drafts):
            mapped: list[int] = []
            for token, parent in zip(draft.tokens, draft.parents):
                key = (mapped[parent] if parent >= 0 else -1, token)
                node = node_of.get(key)
                if node is None:
                    node = node_of[key] = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                    self.own_nodes[m] += 1
                else:
                    self.merged_nodes += 1
                mapped.append(node)
        return Draft(tokens, parents)

    def observe(self, state, acceptance: Acceptance) -> None:
        for member, draft in zip(self.members, self._drafts):
            member.observe(state, Acceptance(follow_tokens(draft, acceptance.tokens), acceptance.tokens))

    def describe(self) -> dict:
        return {
            "members": [{"name": member.name, **member.describe()} for member in self.members],
            "nodes_from_each_member": self.own_nodes,
            "nodes_shared": self.merged_nodes,
        }
