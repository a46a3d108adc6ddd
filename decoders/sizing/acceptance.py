"""Acceptance statistics: how often a tried draft node is accepted, per situation.

Every sizing decision in the project reads one :class:`AcceptanceStats`. Its keys
are whatever situation a proposer names: (match length, depth) for prompt lookup,
(depth, rank among siblings) for a static tree, (depth, confidence bucket) for a
dynamic tree, (depth, frequency bucket, source, match bucket) for suffix trees.

A node is *tried* when the target saw it and its parent was accepted (or it hangs
from the pending token); it is *accepted* when it lies on the accepted path. The
rate of a key is

    a(key) = (accepted + w * prior(key)) / (tried + w)      (0 when tried + w = 0)

with ``w`` pseudo-observations at the prior rate. One prior convention per use:

* :meth:`AcceptanceStats.optimistic` (w = 1, prior 1 at depth 1, below it the rate
  measured one depth up): chains that must explore (``draft_length``). An untried
  situation is drafted as far as the rates hold. A depth never tried is priced like the
  depth above it, not as certain: with drafts of up to 24 tokens, pricing untried depths
  at 1 sent the longest draft wherever the shallow depths held, and a replay of three runs
  projected ngram 2 to 5% slower for it;
* :meth:`AcceptanceStats.measured` (w = 0): only what was measured, 0 for an untried
  key;
* :meth:`AcceptanceStats.level_shrunk` (w = 8, prior the rate measured for the same
  rank one level up): static trees (``tree_budget``), which explore by starting from
  their full tree; deep nodes are tried only when every node above them was accepted,
  so a few unlucky tries must not rule a level out for good;
* :meth:`AcceptanceStats.confident` (w = 4, prior the middle of the key's
  confidence bucket): the drafter is taken at its word until measured (dynamic
  trees); with ``by_level`` (suffix trees) a key below depth 0 starts instead from
  the rate measured one level up in the same situation, so a situation whose
  shallow nodes are measured at 0.96 does not price its first deep node at the
  bucket's middle: copying that has held for three tokens tends to go on, and a
  deep node priced low is never sent, so never measured.

Treating levels as independent, a node is accepted with the product of its and its
ancestors' rates (:meth:`path_values`); a chain is the tree whose every node has one
child, so the same products give a chain's survival by depth.

**The request in hand, and its situation.** The rate above pools every request: it is
the *prior*, not the verdict. Acceptance comes in runs (a translation copies names and
figures, an answer quotes its document), and one request can differ from the ten before
it, so the rate a sizer reads is shrunk in two more steps:

    situation(key) = (accepted[key, s] + S * pooled(key)) / (tried[key, s] + S)
    rate(key)      = (request accepted[key, s] + R * situation(key)) / (request tried[key, s] + R)

``s`` is the situation the request is in: how its last drafted round ended (:data:`OPENING`
before any, :data:`MISSED` when its first tried node was rejected, :data:`PARTIAL` when
some were accepted before a rejection, :data:`WHOLE` when the draft was accepted to a leaf:
the drafter ran out, not the target). Counted over every request (``S`` = 4
pseudo-observations at the pooled rate): after a draft accepted whole the next is too,
most often, whatever the request. Counted in this request only (``R`` = 4 at the
situation's rate): a request that keeps accepting what earlier ones rejected is sized by
its own record within a few rounds. :meth:`start_request` clears the request's counts
(the engine calls it through :func:`start_request` as each request begins), and
:meth:`for_request` gives a request of a batch its own, over the shared pooled counts.

Chains explore (the optimistic convention): in the :data:`OPENING` and :data:`WHOLE`
situations the request's prior is at least ``explore`` (0.5). A request whose drafter
earlier requests switched off still sends a short draft in its first round, and has its
own acceptance measured; a draft accepted whole earns a longer one, a depth or two further
each round as long as they hold, since a chain that stopped where the sizer cut it (not
where the match ended) measured nothing beyond. (A drafter that keys its nodes by its own
confidence, or by how often a continuation occurred, has evidence of the request in its
keys already, and does not explore.)
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from specdec.decoders.engine.draft import Draft, Round

CONFIDENCE_BUCKETS = 10  # buckets of a drafter's probability in the confident convention's keys

# How the request's last drafted round ended: its situation (see the module).
OPENING, MISSED, PARTIAL, WHOLE = "opening", "missed", "partial", "whole"
SITUATION_WEIGHT = 4.0  # S: pseudo-observations of a situation's rate at the pooled rate
REQUEST_WEIGHT = 4.0  # R: pseudo-observations of the request's rate at its situation's
EXPLORE_RATE = 0.5  # the least rate of a key the request has not tried, before its first drafted round


def confidence_bucket(probability: float, buckets: int = CONFIDENCE_BUCKETS) -> int:
    """A key part from a drafter's probability: 0 .. buckets - 1, equal widths."""
    return min(int(probability * buckets), buckets - 1)


class AcceptanceStats:
    """Tried and accepted draft nodes, counted per key, with a prior (see the module)."""

    def __init__(
        self,
        prior: Callable[[Hashable], float] | float = 0.0,
        weight: float = 0.0,
        situation_weight: float = SITUATION_WEIGHT,
        request_weight: float = REQUEST_WEIGHT,
        explore: float = 0.0,
    ) -> None:
        self.prior = prior if callable(prior) else (lambda key, rate=float(prior): rate)
        self.weight = weight
        self.situation_weight = situation_weight
        self.request_weight = request_weight
        self.explore = explore
        # pooled over every request: per key, and per (key, situation)
        self.tried: Counter = Counter()
        self.accepted: Counter = Counter()
        self.situation_tried: Counter = Counter()
        self.situation_accepted: Counter = Counter()
        # the request in hand: its situation and its counts per (key, situation)
        self.situation: str = OPENING
        self.request_tried: Counter = Counter()
        self.request_accepted: Counter = Counter()

    def start_request(self) -> None:
        """A new request begins: its own counts start empty, in the opening situation."""
        self.situation = OPENING
        self.request_tried = Counter()
        self.request_accepted = Counter()

    def for_request(self) -> AcceptanceStats:
        """These statistics for another request decoded at the same time: the pooled counts
        shared, the request's own counts and situation its own."""
        other = copy.copy(self)
        other.start_request()
        return other

    @classmethod
    def optimistic(cls) -> AcceptanceStats:
        """Keys (situation, depth 1, 2, ...): 1 of 1 accepted at depth 1 before anything is
        measured, and a deeper depth starts from the rate measured one depth up in the same
        situation (a depth never tried is priced like the one above it, not as sure: drafts
        then grow a depth or two at a time instead of jumping to their longest); a request's
        first drafted round, and one after a draft accepted whole, read every rate at least
        at :data:`EXPLORE_RATE`."""
        stats = cls(1.0, 1.0, explore=EXPLORE_RATE)
        stats.prior = lambda key: stats.pooled((key[0], key[1] - 1)) if key[1] > 1 else 1.0
        return stats

    @classmethod
    def measured(cls) -> AcceptanceStats:
        """No prior: the measured share, 0 where never tried."""
        return cls(0.0, 0.0)

    @classmethod
    def level_shrunk(cls, weight: float = 8.0) -> AcceptanceStats:
        """Keys (depth, rank): ``weight`` observations at the rate measured for (depth - 1,
        rank); at depth 0 the measured share alone (0 where never tried)."""
        stats = cls(0.0, weight)

        def prior(key) -> float:
            depth, rank = key
            if depth > 0:
                return stats.pooled((depth - 1, rank))
            tried = stats.tried[key]
            return stats.accepted[key] / tried if tried else 0.0

        stats.prior = prior
        return stats

    @classmethod
    def confident(
        cls, buckets: int = CONFIDENCE_BUCKETS, weight: float = 4.0, by_level: bool = False
    ) -> AcceptanceStats:
        """Keys (depth, confidence bucket, ...): ``weight`` observations at the bucket's middle,
        or (``by_level``, depth > 0) at the rate of the same key one level up, whose own
        prior goes up in turn to depth 0's bucket middle."""

        def middle(key) -> float:
            return (key[1] + 0.5) / buckets

        stats = cls(middle, weight)
        if by_level:
            stats.prior = lambda key: stats.pooled((key[0] - 1, *key[1:])) if key[0] > 0 else middle(key)
        return stats

    def pooled(self, key: Hashable) -> float:
        """The rate over every request and situation, with this convention's prior."""
        tried = self.tried[key] + self.weight
        return (self.accepted[key] + self.weight * self.prior(key)) / tried if tried else 0.0

    def rate(self, key: Hashable) -> float:
        """The rate for the request in hand, in its situation (see the module)."""
        pooled = self.pooled(key)
        at = (key, self.situation)
        weight = self.situation_weight
        situation = (self.situation_accepted[at] + weight * pooled) / (self.situation_tried[at] + weight)
        if self.situation in (OPENING, WHOLE):  # explore: the request's first round, a streak
            situation = max(situation, self.explore)
        weight = self.request_weight
        return (self.request_accepted[at] + weight * situation) / (self.request_tried[at] + weight)

    def record(
        self, draft: Draft, keys: Sequence[Hashable], path: list[int], verified: list[int] | None = None
    ) -> None:
        """Count one verified round of ``draft`` (node i keyed ``keys[i]``): the children of
        the pending token and of every accepted node were tried, if the target saw them
        (``verified``, default all); those on ``path`` were accepted."""
        seen = None if verified is None or len(verified) == len(draft) else set(verified)
        on_path = set(path)
        tried_any = False
        for row in [0] + [node + 1 for node in path]:
            for child in draft.children[row]:
                if seen is None or child in seen:
                    key, accepted = keys[child], child in on_path
                    at = (key, self.situation)
                    for tried_count, accepted_count, counted in (
                        (self.tried, self.accepted, key),
                        (self.situation_tried, self.situation_accepted, at),
                        (self.request_tried, self.request_accepted, at),
                    ):
                        tried_count[counted] += 1
                        accepted_count[counted] += accepted
                    tried_any = True
        if tried_any:  # the situation of the request's next round
            last = path[-1] + 1 if path else 0  # the deepest accepted node's row
            ran_out = not any(seen is None or child in seen for child in draft.children[last])
            self.situation = WHOLE if ran_out else PARTIAL if path else MISSED

    def record_round(self, round: Round, keys: Sequence[Hashable]) -> None:
        self.record(round.draft, keys, round.path, round.verified)

    def path_values(self, parents: Sequence[int], keys: Sequence[Hashable]) -> list[float]:
        """Each node's estimated acceptance: its key's rate times its parent's value
        (parents before children)."""
        values: list[float] = []
        for parent, key in zip(parents, keys):
            values.append(self.rate(key) * (values[parent] if parent >= 0 else 1.0))
        return values

    def as_dict(self, label: Callable[[Hashable], str] = str) -> dict:
        """Tried counts and rates per measured key (for results files)."""
        return {
            label(key): {"tried": tried, "rate": round(self.rate(key), 4)}
            for key, tried in sorted(self.tried.items(), key=lambda item: item[0])
        }
