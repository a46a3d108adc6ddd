"""A draft tree's size (node budget) chosen from the target's cost and the measured acceptance.

A bigger tree accepts more tokens per round but widens the target's pass. With

    E(n)    expected tokens emitted per round by the best n-node tree (bonus included),
    T(n+1)  seconds of the target's pass over the pending token and n nodes
            (the cached cost curve of decoders/models/cost.py),
    D       seconds the proposer spends drafting per round (measured),

the budget is the n that maximises E(n) / (T(n + 1) + D), the expected tokens per second.

E(n) comes from acceptance counted per (depth, rank): a(d, r) is the share of the
nodes at depth d that were their parent's r-th child (draft order, 0 = the
draft's favourite) and were accepted, among those that were tried (their parent
was accepted, or they hang from the pending token). Treating levels as
independent, a node is accepted with the product of a(d, r) along its path.
These products only shrink going down a path, so the n most probable nodes form
a tree, and E(n) = 1 + their sum.

Used by static trees (``proposer=medusa proposer.tree=auto proposer.tree_budget=auto``):
the proposer starts with its full tree (to measure every depth and rank), then
re-chooses the budget every ``every`` rounds from what it has measured. Dynamic
trees, whose shape changes every round, size each round instead
(decoders/sizing/dynamic_tree.py).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from decoders.engine.draft import Draft
from decoders.models.cost import CostCurve


@dataclass
class AcceptanceProfile:
    """Tried and accepted draft nodes, counted per (depth, rank among siblings)."""

    tried: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    rounds: int = 0

    def record(self, draft: Draft, path: list[int]) -> None:
        """Count one verified round: the children of the pending token and of every
        accepted node were tried; those on ``path`` were accepted."""
        self.rounds += 1
        on_path = set(path)
        for row in [0] + [node + 1 for node in path]:
            for rank, child in enumerate(draft.children[row]):
                key = (draft.depths[child], rank)
                self.tried[key] += 1
                self.accepted[key] += child in on_path

    def rate(self, depth: int, rank: int) -> float:
        """a(depth, rank); 0 where never tried."""
        tried = self.tried[(depth, rank)]
        return self.accepted[(depth, rank)] / tried if tried else 0.0

    def node_probabilities(self, limit: int) -> list[float]:
        """Acceptance probabilities of the ``limit`` most probable nodes of the best
        tree the counts describe, in descending order (best-first search)."""
        ranks = range(1 + max((rank for _, rank in self.tried), default=-1))
        frontier = [(-self.rate(0, rank), 0) for rank in ranks]  # (-probability, depth)
        heapq.heapify(frontier)
        probabilities: list[float] = []
        while frontier and len(probabilities) < limit:
            negative, depth = heapq.heappop(frontier)
            if negative >= 0:  # only never-accepted nodes are left
                break
            probabilities.append(-negative)
            for rank in ranks:
                heapq.heappush(frontier, (negative * self.rate(depth + 1, rank), depth + 1))
        return probabilities

    def as_dict(self) -> dict:
        """Per-depth, per-rank tried counts and acceptance rates (for results files)."""
        return {
            f"depth{depth}_rank{rank}": {"tried": tried, "rate": round(self.rate(depth, rank), 4)}
            for (depth, rank), tried in sorted(self.tried.items())
        }


def best_budget(
    profile: AcceptanceProfile, target_cost: CostCurve, draft_seconds: float, max_nodes: int
) -> tuple[int, float]:
    """(n, expected tokens per second) maximising E(n) / (T(n + 1) + D) for 1 <= n <= max_nodes."""
    probabilities = profile.node_probabilities(max_nodes)
    best = (1, 0.0)
    expected_tokens = 1.0  # the correction or bonus token
    for n in range(1, max_nodes + 1):
        if n <= len(probabilities):
            expected_tokens += probabilities[n - 1]
        tokens_per_s = expected_tokens / (target_cost(n + 1) + draft_seconds)
        if tokens_per_s > best[1]:
            best = (n, tokens_per_s)
    return best


class BudgetTuner:
    """Keeps a proposer's tree budget at :func:`best_budget` as rounds accumulate.

    ``target_cost`` is called once, at the first re-choice, so a cost curve that
    still has to be measured is measured only when a budget is needed.
    """

    def __init__(
        self,
        profile: AcceptanceProfile,
        target_cost: Callable[[], CostCurve],
        max_nodes: int,
        every: int = 32,
    ) -> None:
        self.profile = profile
        self.max_nodes = max_nodes
        self.every = every
        self.budget = max_nodes  # explore every depth and rank until measured
        self.expected_tokens_per_s: float | None = None
        self._target_cost = target_cost
        self._curve: CostCurve | None = None
        self._draft_seconds = 0.0
        self._draft_rounds = 0

    def observe_draft_seconds(self, seconds: float) -> None:
        """Add one round's drafting time; re-choose the budget every ``every`` rounds."""
        self._draft_seconds += seconds
        self._draft_rounds += 1
        if self._draft_rounds % self.every == 0:
            self.retune()

    def retune(self) -> None:
        if self._curve is None:
            self._curve = self._target_cost()
        draft_seconds = self._draft_seconds / max(self._draft_rounds, 1)
        self.budget, self.expected_tokens_per_s = best_budget(
            self.profile, self._curve, draft_seconds, self.max_nodes
        )
