"""The two contracts between proposers, the target and verifiers.

Vocabulary used across the project:

* **pending token**: the last committed token, whose KV entry the target has not
  computed yet. Every target pass starts with it.
* **draft**: tokens guessed by a proposer, arranged as a tree. Node ``i`` has
  token ``tokens[i]`` and parent ``parents[i]``; ``-1`` means "child of the
  pending token". A chain has parents ``[-1, 0, 1, ...]``. Parents always come
  before their children.
* **accepted tokens**: draft tokens the verifier keeps, forming one root-to-node
  path of the tree.
* **correction token**: the token the target emits where it rejected a draft node.
* **bonus token**: the token the target emits after the last node of a fully
  accepted path. Every round emits exactly one of the two, so a round emits
  ``len(path) + 1`` tokens.
* **round**: one draft, one target pass, one verdict. A proposer learns of its
  round through a :class:`Round`: its own draft, the accepted path in that
  draft's numbering (whatever the engine and the verifier pruned on the way),
  and the round's drafting and verification seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class Draft:
    """What a proposer returns.

    tokens:  n draft token ids.
    parents: n parent indices (-1 = child of the pending token), parents[i] < i.
    draft_probs: optional (n, vocab) float32 tensor; row i is the distribution
        node i's token was drawn from, after the same temperature/top-k/top-p
        processing the target gets. ``None`` means the tokens were chosen
        deterministically, and verifiers treat each as a point mass.
    values: optional n floats, the proposer's calibrated estimate that node i (its
        whole path) is accepted (decoders/sizing); a joined tree (``merge``) sizes
        itself from them. ``None``: not estimated.
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    values: list[float] | None = None
    # set by :meth:`select`: (the draft this one was selected from, its node of each of ours)
    # (None for a node the engine added, such as a grammar's forced token)
    origin: tuple[Draft, list[int | None]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"draft node {i} has parent {parent}; parents must come before children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs must have one row per draft node")
        if self.values is not None and len(self.values) != len(self.tokens):
            raise ValueError("values must hold one estimate per draft node")

    @classmethod
    def chain(
        cls, tokens: list[int], draft_probs: torch.Tensor | None = None, values: list[float] | None = None
    ) -> Draft:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs, values=values)

    @classmethod
    def empty(cls) -> Draft:
        return cls([], [])

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> list[int]:
        """Depth of each node; children of the pending token have depth 0."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths

    @cached_property
    def children(self) -> list[list[int]]:
        """children[0] lists the root-level nodes; children[i + 1] those of node i."""
        children: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, parent in enumerate(self.parents):
            children[parent + 1].append(i)
        return children

    def principal_path(self) -> list[int]:
        """Node indices along the first child at every level."""
        path: list[int] = []
        kids = self.children[0]
        while kids:
            path.append(kids[0])
            kids = self.children[kids[0] + 1]
        return path

    def select(self, nodes: list[int]) -> Draft:
        """The sub-draft made of ``nodes`` (a set closed under taking parents)."""
        index = {old: new for new, old in enumerate(nodes)}
        return Draft(
            [self.tokens[i] for i in nodes],
            [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in nodes],
            None if self.draft_probs is None else self.draft_probs[nodes],
            values=None if self.values is None else [self.values[i] for i in nodes],
            origin=(self, list(nodes)),
        )

    def nodes_in(self, ancestor: Draft) -> list[int | None]:
        """Our nodes' indices in ``ancestor``, a draft we were made from: through the
        :meth:`select` calls that made us, else by matching (parent, token) from the root
        (None for a node ``ancestor`` lacks)."""
        nodes: list = list(range(len(self)))
        draft = self
        while draft is not ancestor and draft.origin is not None:
            draft, index = draft.origin
            nodes = [None if i is None else index[i] for i in nodes]
        if draft is ancestor:
            return nodes
        matched: list[int | None] = []
        for token, parent in zip(self.tokens, self.parents):
            row = 0 if parent < 0 else None if matched[parent] is None else matched[parent] + 1
            siblings = [] if row is None else ancestor.children[row]
            matched.append(next((c for c in siblings if ancestor.tokens[c] == token), None))
        return matched

    def truncated(self, max_depth: int) -> Draft:
        """This draft without nodes deeper than ``max_depth`` levels (0 = empty)."""
        if max_depth <= 0:
            return Draft.empty()
        if not self.tokens or max(self.depths) < max_depth:
            return self
        return self.select([i for i, d in enumerate(self.depths) if d < max_depth])

    def limited(self, max_nodes: int) -> Draft:
        """This draft's first ``max_nodes`` nodes (parents come first, so still a tree)."""
        return self if len(self.tokens) <= max_nodes else self.select(list(range(max(max_nodes, 0))))

    def as_chain(self) -> Draft:
        """This draft pruned to its principal path (a chain verifier's view)."""
        return self if self.is_chain else self.select(self.principal_path())


@dataclass
class Acceptance:
    """What a verifier returns.

    path:   accepted draft node indices, root to deepest (empty if none accepted).
    tokens: emitted tokens = accepted draft tokens + one correction or bonus token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


@dataclass
class Round:
    """What a proposer learns of its round (:meth:`Proposer.observe`).

    draft:    the draft the proposer returned, as returned.
    path:     the accepted nodes, root to deepest, in ``draft``'s numbering.
    verified: the nodes of ``draft`` the target saw (the engine drops nodes past
              ``max_new_tokens``, chain verifiers keep the principal path); a node
              outside it was neither tried nor rejected.
    tokens:   emitted tokens (accepted tokens + one correction or bonus token).
    draft_seconds:  the engine's measure of drafting (``propose`` and the pruning).
    verify_seconds: the target's pass, the verdict and the KV commit.
    """

    draft: Draft
    path: list[int]
    verified: list[int]
    tokens: list[int]
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @classmethod
    def of(cls, draft: Draft, path: list[int], tokens: list[int], draft_seconds: float = 0.0) -> Round:
        """A round in which the target saw the whole draft."""
        return cls(draft, path, list(range(len(draft))), tokens, draft_seconds)

    @property
    def num_accepted(self) -> int:
        return len(self.path)
