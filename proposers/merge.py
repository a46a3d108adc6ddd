"""Several proposers' drafts verified as one tree.

Drafters fail in different places: Medusa heads guess the target's phrasing
from its hidden state but cannot copy a rare name out of the prompt, while
prompt lookup copies well and guesses nothing else. ``proposer=merge`` asks each
member for its draft and joins them into one token tree (shared prefixes
become shared nodes), so the target checks every member's guesses in the same
pass. The first member's principal path stays the principal path (what a chain
verifier keeps). A round where only one member proposes anything sends that
member's draft unchanged (with its draft_probs, if sampled).

Each member sizes its own draft from its own config and sees, after the
round, a :class:`~specdec.decoders.engine.draft.Round` of its own: its draft, the
accepted path mapped back to that draft's nodes (a member's node is accepted
when the joined node it became is), the nodes the target saw, and its own
drafting seconds (timed here, one member at a time), so adaptive members
(``ngram``'s length policy, Medusa's budget) keep learning as if alone.

Sampling stays lossless under the tree verifier's conditions (verifiers/tree.py):
only deterministic nodes (members with draft_probs None, e.g. prompt lookup, and
every member at temperature 0) are joined by equal (parent, token). A sampled
member's nodes stay separate siblings with their own q rows, even where a token
repeats another sibling's, since joining equal samples would make the tree's
shape depend on the sampled values. In a tree that holds sampled nodes, a
deterministic node's row is the point mass on its token (the q-rule with a
point mass is the point-mass rule), so sampled nodes keep the min(1, p/q)
acceptance they would get alone.

The joined tree is sized as a whole (``joint_budget``, on by default): every
deterministic node a member estimated (``Draft.values``, its calibrated chance
that the node's path is accepted; a shared node takes the best estimate, and
counts once) competes in one :func:`specdec.decoders.sizing.search.best_size` against
the target's T(n) and the round's measured drafting seconds (every member's);
the nodes that do not pay for the wider pass are cut. Sampled nodes, and nodes
of members that give no estimates, are always kept (with their ancestors), so
the cut never depends on a sampled token and sampling stays lossless. Members
still size their own drafts first, each as if alone; the joint cut removes what
the joined pass cannot afford. (Without it, measured on an AVX2-only CPU where
wide passes cost most, the merge of suffix decoding and the copy heads' dynamic
tree ran 1.27x and 1.19x against 1.42x and 1.31x with it: docs/merge.md, "Merging
drafters".) ``joint_budget=false`` sends every member's draft whole.

At temperature > 0 the default heads member drafts a sampled tree (its
``when_sampling``), which is kept whole; suffix decoding's point masses are cut.

A drafter that costs model calls can be a fallback (``fallback: K``, the last K members): it is
asked only in rounds where every member before it proposed nothing, and skipped (as a round
gate skips a proposer) in the others. Prompt lookup and a grammar's forced tokens cost
nothing and, where they have a guess, are usually right; the heads then draft only where
they have none (ArcticInference pairs suffix decoding with a model drafter the same way).
On the structured workload in float32 it measured worse than leaving the heads out
(docs/structured.md), so no default uses it.

Example: ``proposer=merge "proposer.members=[suffix,{name:copy_heads,tree_width:3}]"``, or
``"proposer.members=[grammar,span,copy_heads]" proposer.fallback=1``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.drafting import DraftSteps, run_alone
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import build, proposer_registry, register_proposer

MAX_JOINED_NODES = 256  # the widest joined pass the joint budget considers


@register_proposer("merge")
class MergeProposer(Proposer):
    per_request = frozenset({"_drafts"})  # the members' drafts of the round

    @dataclass
    class Config:
        # member proposers: names or {name: ..., options...}, as for `proposer`
        members: list[Any] = field(
            default_factory=lambda: [
                {"name": "suffix"},
                {"name": "copy_heads"},
            ]
        )
        # size the joined tree as a whole from the members' estimates (see the module docstring);
        # false: every member's draft is sent whole
        joint_budget: bool = True
        # the last ``fallback`` members are asked only in rounds where every member before them
        # proposed nothing (a drafter whose model calls cost drafting time, asked where the free
        # ones have no guess); in other rounds they are skipped, as a round gate skips a proposer
        fallback: int = 0

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if not config.members:
            raise ValueError("proposer=merge needs at least one member in proposer.members")
        names = [m if isinstance(m, str) else m.get("name") for m in config.members]
        if "merge" in names:
            raise ValueError("proposer.members cannot hold another merge; list its members directly")
        if not 0 <= config.fallback < len(config.members):
            raise ValueError(
                f"proposer.fallback must be between 0 and {len(config.members) - 1} (the members after the "
                f"first one), got {config.fallback}"
            )
        self.members: list[Proposer] = [build(proposer_registry, m, context=context) for m in config.members]
        # A member that drafts with the target's own layers (early exit) leaves their KV
        # entries in the target's cache, so it alone may run the verification pass: it
        # reuses them for its own chain and drops them before any other pass.
        reusing = [m for m in self.members if m.drafts_in_target]
        if len(reusing) > 1:
            raise ValueError(
                f"proposer=merge can hold at most one member that drafts with the target's own layers; "
                f"got {', '.join(m.name for m in reusing)}: keep one of them in proposer.members"
            )
        self._pass_owner: Proposer | None = reusing[0] if reusing else None
        if self._pass_owner in self.members[len(self.members) - config.fallback :]:
            raise ValueError(
                f"proposer {self._pass_owner.name!r} drafts with the target's own layers and runs the pass: "
                "it cannot be a fallback member; list it before the last proposer.fallback members"
            )
        self._drafts: list[Draft] = []
        self._joined: list[list[int]] = []  # per member: its nodes' indices in the joined draft
        self._seconds: list[float] = []  # per member: its propose's seconds this round
        self._asked: list[bool] = []  # per member: whether it proposed this round (not a fallback skipped)
        self.fallback_rounds = 0  # rounds the fallback members were asked
        # the joined tree's size; it measures the rounds' drafting seconds, every member's
        self.sizer = context.sizing.ranked(MAX_JOINED_NODES)
        self.cut_nodes = 0  # nodes the joint budget cut, over all rounds
        self.merged_nodes = 0  # nodes saved by shared prefixes, over all rounds
        self.own_nodes = [0] * len(self.members)  # nodes only this member proposed

    @property
    def drafts_trees(self) -> bool:
        return True  # the members' drafts joined into one tree

    @property
    def sampled(self) -> bool:
        return any(member.sampled for member in self.members)  # a member's sampled drafts stay sampled

    @property
    def drafts_in_target(self) -> bool:
        return self._pass_owner is not None

    @property
    def reads_target_layers(self) -> bool:
        return any(member.reads_target_layers for member in self.members)

    def begin(self, state) -> None:
        for member in self.members:
            member.begin(state)

    @property
    def batches_drafting(self) -> bool:
        return any(member.batches_drafting for member in self.members)

    def propose(self, state) -> Draft:
        return run_alone(self.drafting(state))

    def drafting(self, state) -> DraftSteps:
        """Each member's draft in turn (as steps: a batch shares the members' model calls),
        then joined."""
        self._drafts, self._seconds, self._asked = [], [], []
        clock = getattr(state, "clock", time.perf_counter)  # (a bare state in unit tests has none)
        primary = len(self.members) - self.config.fallback
        for m, member in enumerate(self.members):
            asked = m < primary or not any(len(draft) for draft in self._drafts[:primary])
            tick = clock()
            if asked:
                self._drafts.append((yield from member.drafting(state)))
            else:
                member.skip(state)
                self._drafts.append(Draft.empty())
            self._seconds.append(clock() - tick)
            self._asked.append(asked)
        self.fallback_rounds += self.config.fallback > 0 and self._asked[-1]
        self._joined = [list(range(len(draft))) for draft in self._drafts]
        proposing = [m for m, draft in enumerate(self._drafts) if len(draft)]
        if len(proposing) <= 1:
            for m in proposing:
                self.own_nodes[m] += len(self._drafts[m])
            return self._drafts[proposing[0]] if proposing else Draft.empty()
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor | None] = []  # a sampled node's q; None = a point mass on its token
        node_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> deterministic merged node
        values: list[float] = []  # the best member estimate of each merged node
        anyway: set[int] = set()  # merged nodes a sampled or unestimating member proposed
        for m, draft in enumerate(self._drafts):
            sampled = draft.draft_probs is not None
            mapped: list[int] = []
            for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
                key = (mapped[parent] if parent >= 0 else -1, token)
                node = None if sampled else node_of.get(key)
                if node is None:
                    node = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                    rows.append(draft.draft_probs[i] if sampled else None)
                    values.append(0.0)
                    if not sampled:
                        node_of[key] = node
                    self.own_nodes[m] += 1
                else:
                    self.merged_nodes += 1
                if sampled or draft.values is None:
                    anyway.add(node)
                else:
                    values[node] = max(values[node], draft.values[i])
                mapped.append(node)
            self._joined[m] = mapped
        joined = Draft(tokens, parents, _rows(tokens, rows))
        return self._joint_cut(joined, values, anyway) if self.config.joint_budget else joined

    def skip(self, state) -> None:
        for member in self.members:
            member.skip(state)

    def _joint_cut(self, joined: Draft, values: list[float], anyway: set[int]) -> Draft:
        """The nodes of ``joined`` that pay for the joined pass: those kept ``anyway`` and
        their ancestors, then the estimated nodes best first, as many as :func:`best_size`
        finds worth their width."""

        def with_ancestors(nodes) -> set[int]:
            closed: set[int] = set()
            for node in nodes:
                while node >= 0 and node not in closed:
                    closed.add(node)
                    node = joined.parents[node]
            return closed

        kept = with_ancestors(anyway)
        ranked = sorted(
            (i for i in range(len(joined)) if i not in kept), key=lambda i: (-values[i], joined.depths[i], i)
        )
        size = self.sizer.choose([values[i] for i in ranked], len(kept), sum(values[i] for i in kept))
        keep = sorted(kept | with_ancestors(ranked[:size]))
        if len(keep) == len(joined):
            return joined
        self.cut_nodes += len(joined) - len(keep)
        index = {old: new for new, old in enumerate(keep)}
        self._joined = [[index.get(node) for node in mapped] for mapped in self._joined]
        return joined.select(keep)

    def verify_forward(self, target, tokens: list[int], parents: list[int] | None) -> torch.Tensor:
        """The member that drafted inside the target runs the pass (see ``__init__``)."""
        if self._pass_owner is not None:
            return self._pass_owner.verify_forward(target, tokens, parents)
        return super().verify_forward(target, tokens, parents)

    def observe(self, state, round: Round) -> None:
        self.sizer.observe(round)
        verified = set(round.verified)
        for member, draft, joined, seconds, asked in zip(
            self.members, self._drafts, self._joined, self._seconds, self._asked
        ):
            if not asked:  # a skipped fallback: no observe follows a skip
                continue
            member_of = {}  # joined node -> the member's node
            for node, joined_node in enumerate(joined):
                if joined_node is not None:  # None: cut by the joint budget
                    member_of.setdefault(joined_node, node)
            path: list[int] = []
            for joined_node in round.path:  # the member's nodes along the accepted path, from the root
                node = member_of.get(joined_node)
                if node is None or draft.parents[node] != (path[-1] if path else -1):
                    break
                path.append(node)
            seen = [
                node
                for node, joined_node in enumerate(joined)
                if joined_node is not None and joined_node in verified
            ]
            member.observe(state, Round(draft, path, seen, round.tokens, seconds, round.verify_seconds))

    def finish(self, state) -> None:
        for member in self.members:
            member.finish(state)

    def forget(self) -> None:
        for member in self.members:
            member.forget()

    def describe(self) -> dict:
        return {
            "members": [{"name": member.name, **member.describe()} for member in self.members],
            "nodes_from_each_member": self.own_nodes,
            "nodes_shared": self.merged_nodes,
            "joint_budget": self.config.joint_budget,
            "nodes_cut_by_joint_budget": self.cut_nodes,
            "fallback": self.config.fallback,
            "fallback_rounds": self.fallback_rounds,
        }


def _rows(tokens: list[int], rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """(n, vocab) draft_probs: q rows as given, point masses for deterministic nodes; None
    when every node is deterministic."""
    like = next((row for row in rows if row is not None), None)
    if like is None:
        return None
    probs = like.new_zeros(len(rows), like.shape[-1])  # (n, vocab)
    for i, (token, row) in enumerate(zip(tokens, rows)):
        if row is None:
            probs[i, token] = 1.0
        else:
            probs[i] = row
    return probs
