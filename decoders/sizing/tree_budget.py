"""A static draft tree's size (node budget) chosen from the target's cost and the measured acceptance.

A bigger tree accepts more tokens per round but widens the target's pass. Acceptance
is counted per (depth, rank) in an :class:`AcceptanceStats` (``level_shrunk``: a
few pseudo-observations at the rate of the same rank one level up, so that a deep
level tried a handful of times is not ruled out by bad luck): a(d, r) is the share
of the nodes at depth d that were their parent's r-th child (draft order, 0 = the
draft's favourite) and were accepted, among those that were tried. Treating levels as independent, a node is accepted
with the product of a(d, r) along its path. These products only shrink going down
a path, so the n most probable nodes form a tree (:func:`node_probabilities`, best
first), and :func:`specdec.decoders.sizing.search.best_size` takes the n with the most
expected tokens per second, the drafting seconds per round included.

Used by static trees (``proposer=medusa proposer.tree=auto proposer.tree_budget=auto``):
the proposer starts with its full tree (to measure every depth and rank), then
every ``every`` rounds re-chooses the budget and the shape from what it has
measured: the tree of the ``budget`` most probable rank paths (:attr:`TreeBudget.paths`),
which at temperature > 0, where the ranks are sampled siblings' draw order, can
differ much from the greedy tree the artifact stores. Dynamic
trees, whose shape changes every round, size each round instead
(decoders/sizing/dynamic_tree.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import AcceptanceStats
from specdec.decoders.sizing.search import MIN_GAIN, Beside, PassSeconds, Sizer, best_size


def rank_keys(draft: Draft) -> list[tuple[int, int]]:
    """Each node's (depth, rank among its siblings in draft order)."""
    keys: list[tuple[int, int]] = [(0, 0)] * len(draft)
    for siblings in draft.children:
        for rank, child in enumerate(siblings):
            keys[child] = (draft.depths[child], rank)
    return keys


def best_paths(stats: AcceptanceStats, limit: int) -> list[tuple[tuple[int, ...], float]]:
    """The ``limit`` most probable nodes of the best tree that (depth, rank) statistics
    describe, as (path of ranks from the root, acceptance probability), in descending
    order (best-first search; every prefix of the list is a tree whose siblings hold
    consecutive ranks from 0, as sampled siblings, numbered by draw, must)."""
    ranks = 1 + max((rank for _, rank in stats.tried), default=-1)  # only depths and ranks ever tried
    depths = 1 + max((depth for depth, _ in stats.tried), default=-1)
    if not ranks:
        return []
    frontier = [(-stats.rate((0, 0)), (0,), 1.0)]  # (-probability, path, its parent's probability)
    found: list[tuple[tuple[int, ...], float]] = []
    while frontier and len(found) < limit:
        negative, path, parent = heapq.heappop(frontier)
        if negative >= 0:  # only never-accepted nodes are left
            break
        found.append((path, -negative))
        if path[-1] + 1 < ranks:  # the next sibling
            sibling = path[:-1] + (path[-1] + 1,)
            value = min(parent * stats.rate((len(path) - 1, path[-1] + 1)), -negative)  # kept in order
            heapq.heappush(frontier, (-value, sibling, parent))
        if len(path) < depths:  # the first child
            heapq.heappush(frontier, (negative * stats.rate((len(path), 0)), path + (0,), -negative))
    return found


def node_probabilities(stats: AcceptanceStats, limit: int) -> list[float]:
    """Acceptance probabilities of the ``limit`` most probable nodes of the best tree
    that (depth, rank) statistics describe, in descending order."""
    return [probability for _, probability in best_paths(stats, limit)]


class TreeBudget(Sizer):
    """Keeps a static tree's budget at the best size as rounds accumulate."""

    def __init__(
        self,
        target_cost: Callable[[], CostCurve],
        max_nodes: int,
        every: int = 32,
        min_gain: float = MIN_GAIN,
        beside: Beside | None = None,
    ) -> None:
        super().__init__()
        self.stats = AcceptanceStats.level_shrunk()
        self.max_nodes = max_nodes
        self.every = every
        self.min_gain = min_gain
        self.budget = max_nodes  # explore every depth and rank until measured
        # the best tree's rank paths under the measured rates, best first (None until the
        # first retune): a proposer that can reshape its tree drafts these
        self.paths: list[tuple[int, ...]] | None = None
        self.expected_tokens_per_s: float | None = None
        self._pass_seconds = PassSeconds(target_cost, max_nodes + 1, beside)

    def observe(self, round: Round) -> None:
        """Count the round's nodes; re-choose the budget every ``every`` rounds."""
        super().observe(round)
        self.stats.record_round(round, rank_keys(round.draft))
        if self.rounds % self.every == 0:
            self.retune()

    def retune(self) -> None:
        best = best_paths(self.stats, self.max_nodes)
        self.budget, self.expected_tokens_per_s = best_size(
            [probability for _, probability in best],
            self._pass_seconds(),
            self.mean_draft_seconds,
            min_gain=self.min_gain,
            base_tokens=self._pass_seconds.base_tokens,
        )
        self.paths = [path for path, _ in best[: self.budget]] or None

    def as_dict(self) -> dict:
        """Per-depth, per-rank tried counts and acceptance rates (for results files)."""
        return self.stats.as_dict(lambda key: f"depth{key[0]}_rank{key[1]}")

    def describe(self) -> dict:
        return {"acceptance_by_depth_rank": self.as_dict()}
