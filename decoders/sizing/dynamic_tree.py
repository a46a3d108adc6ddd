"""Dynamic draft trees: grown each round from the drafter's own confidence, sized from cost.

A static tree spends its nodes on the same ranks every round. A dynamic tree
(EAGLE-2, Li et al. 2024) spends them where the drafter is unsure: when the
first guess is near certain the nodes go deeper along it, when it is not they
go to its siblings. Any proposer that can give the logits of a node's children
uses the one mechanism here (the draft model feeds the frontier to its own
model, Medusa heads step their sequential state):

``grow``
    level by level, the ``width`` candidates with the highest cumulative
    log-probability are expanded into their ``width`` most probable children,
    one ``expand`` call per level, ``depth`` levels in all;
``DynamicTree.build``
    keeps a subset of the candidates. With an integer budget, the best
    ``budget`` by cumulative log-probability. With ``budget="auto"``, each
    round's own best size: every candidate gets an estimated acceptance
    probability, the product along its path of the acceptance measured for
    nodes of its depth and confidence (:meth:`AcceptanceStats.confident`: the
    drafter's own probability until measured), and the tree keeps the n best, n
    from :func:`specdec.decoders.sizing.search.best_size`: the most expected tokens per
    second, (1 + sum of the n best estimates) / (T(n + 1) + D), with T the
    target's pass cost curve and D the drafting seconds per round measured so
    far (the engine's measure, :class:`~specdec.decoders.engine.draft.Round`). A node never outranks its parent (a
    product of factors <= 1, ties broken by depth), so any best-n set is a tree.
    Growth also stops early, at the level whose frontier is too unlikely to be
    accepted to pay for one more ``expand`` call (``DynamicTree._worth_expanding``), and
    expands only the frontier nodes whose children could make the tree:
    most rounds keep a few nodes, and the levels grown for nothing would cost
    more drafting time than a chain.

The tree is deterministic (the verifier's point-mass rule keeps sampling
lossless for any deterministic tree, whatever shaped it).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.drafting import DraftSteps, run_alone
from specdec.decoders.engine.sampling import check_finite
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import CONFIDENCE_BUCKETS, AcceptanceStats, confidence_bucket
from specdec.decoders.sizing.search import MIN_GAIN, Beside, PassSeconds, Sizer, best_size, check_budget

# expand(frontier, rows, parents, depth) -> (len(frontier), n) logits of the children of the
# frontier nodes (all at ``depth``), or a generator of drafting steps returning them (a batch
# then shares its model calls); rows/parents describe every candidate grown so far (rows
# index the drafter's output rows).
Expand = Callable[[list[int], list[int], list[int], int], "torch.Tensor | DraftSteps"]
# a constraint's rows: path of rows (root first) -> (n,) bool, the rows allowed after it
Allowed = Callable[[list[int]], torch.Tensor]


@dataclass
class Candidates:
    """Every node a round grew, parents before children."""

    rows: list[int]  # the drafter's output row (token id, or a reduced vocabulary's row)
    parents: list[int]  # -1 = child of the pending token
    scores: list[float]  # cumulative log-probability along the path
    probs: list[float]  # the node's probability under its parent's distribution
    depths: list[int]

    def __len__(self) -> int:
        return len(self.rows)


def grow(*args, **kwargs) -> Candidates:
    """:func:`grow_steps` (same arguments) driven alone: each model call its own."""
    return run_alone(grow_steps(*args, **kwargs))


def grow_steps(
    root_logits: torch.Tensor,
    expand: Expand,
    width: int,
    depth: int,
    what: str,
    prune: Callable[[Candidates, list[int]], list[int]] | None = None,
    allowed: Allowed | None = None,
) -> DraftSteps:
    """Candidates of a dynamic tree from ``root_logits`` (n,), the pending token's children's logits.
    As drafting steps (:mod:`specdec.decoders.engine.drafting`): ``expand`` may return its
    logits or a generator of the model calls that give them.

    ``prune(candidates, frontier)``, asked before each ``expand``: the frontier nodes worth
    expanding (an empty list ends the growth there). ``allowed(path)``, under a constraint:
    the (n,) bool mask of the rows allowed after a node's path of rows (root first); a node's
    children are then its best allowed rows, scored by the drafter's distribution renormalised
    over them."""
    rows: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    probs: list[float] = []
    depths: list[int] = []
    frontier = [-1]
    logits = root_logits[None]  # (f, n)
    for level in range(depth):
        check_finite(logits, what)
        if allowed is not None:
            masks = torch.stack([allowed(_path(node, rows, parents)) for node in frontier])  # (f, n)
            logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
        top = torch.log_softmax(logits.float(), -1).topk(min(width, logits.shape[-1]), dim=-1)  # (f, width)
        values, indices = top.values.tolist(), top.indices.tolist()
        level_nodes: list[int] = []
        for r, node in enumerate(frontier):
            base = scores[node] if node >= 0 else 0.0
            for value, row in zip(values[r], indices[r]):
                if not value > float("-inf"):  # not allowed (or no row allowed at all: NaN)
                    continue
                level_nodes.append(len(rows))
                rows.append(row)
                parents.append(node)
                scores.append(base + value)
                probs.append(math.exp(value))
                depths.append(level)
        if level + 1 == depth or not level_nodes:
            break
        frontier = sorted(sorted(level_nodes, key=lambda i: -scores[i])[:width])
        if prune is not None:
            frontier = prune(Candidates(rows, parents, scores, probs, depths), frontier)
            if not frontier:
                break
        logits = yield from _stepped(expand(frontier, rows, parents, level))
    return Candidates(rows, parents, scores, probs, depths)


def _stepped(result) -> DraftSteps:
    """An ``expand``'s result as steps: its generator's, or its logits as they are."""
    if isinstance(result, Generator):
        return (yield from result)
    return result


def _path(node: int, rows: list[int], parents: list[int]) -> list[int]:
    """The rows from the root to ``node`` (empty for the pending token, -1)."""
    path: list[int] = []
    while node >= 0:
        path.append(rows[node])
        node = parents[node]
    return path[::-1]


@dataclass
class TreeOptions:
    """The tree options of every proposer that drafts trees, declared once: its ``Config``
    derives from this (and may change a default to its best measured configuration)."""

    # null (or false) = a chain; dynamic (or true) = a tree grown each round from the drafter's
    # confidence (this module); medusa also takes a list of rank paths or auto (its stored tree)
    tree: Any = None
    tree_width: int = 4  # dynamic trees: children per expanded node, nodes expanded per level
    # nodes kept: an int; auto = each round's best size from T(n) and the acceptance measured
    # per depth and confidence (static trees: the best prefix of their paths); null = all
    tree_budget: Any = "auto"


def tree_shape(value: Any, proposer: str, static: bool = False) -> Any:
    """``tree`` in one spelling: None (a chain), ``"dynamic"``, or, where ``static`` trees are
    taken, ``"auto"`` or the list of rank paths as given; anything else refused in one line."""
    if value is None or value is False:
        return None
    if value is True or value == "dynamic":
        return "dynamic"
    if static and (value == "auto" or (not isinstance(value, str) and hasattr(value, "__iter__"))):
        return value
    choices = "null (a chain) or dynamic" + (", auto or a list of rank paths" if static else "")
    raise ValueError(f"proposer.tree={value!r}: proposer {proposer!r} takes {choices}")


def confidence_key(depth: int, probability: float, max_depth: int = 3) -> tuple[int, int]:
    """A dynamic tree node's key in :meth:`AcceptanceStats.confident` statistics:
    (depth, capped at ``max_depth``; the bucket of the drafter's probability)."""
    return min(depth, max_depth), confidence_bucket(probability)


def confidence_label(key: tuple) -> str:
    return f"depth{key[0]}_p{key[1] / CONFIDENCE_BUCKETS:.1f}"


class DynamicTree(Sizer):
    """A proposer's dynamic tree: shape options, the budget rule, and the acceptance
    statistics it learns from verified rounds (:meth:`observe`)."""

    def __init__(
        self,
        width: int,
        depth: int,
        budget: Any,
        target_cost: Callable[[], CostCurve],
        min_gain: float = MIN_GAIN,
        beside: Beside | None = None,
    ) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"proposer.tree_width must be >= 1, got {width}")
        check_budget(budget)
        self.width = width
        self.depth = depth
        self.budget = budget
        self.min_gain = min_gain
        self.stats = AcceptanceStats.confident()  # keys: confidence_key(depth, probability)
        self._pass_seconds = PassSeconds(target_cost, self.max_nodes + 1, beside)
        self._keys: list[tuple[int, int]] | None = None  # keys of the last tree's nodes
        self._expand_seconds = 0.0  # summed over every expand call
        self._expands = 0
        self.sizes: Counter = Counter()  # nodes kept per round
        self.levels: Counter = Counter()  # levels grown per round

    @property
    def max_nodes(self) -> int:
        return self.width + (self.depth - 1) * self.width * self.width

    def build(
        self, root_logits: torch.Tensor, expand: Expand, what: str, allowed: Allowed | None = None
    ) -> Draft:
        """:meth:`build_steps` driven alone (each model call its own)."""
        return run_alone(self.build_steps(root_logits, expand, what, allowed))

    def build_steps(
        self,
        root_logits: torch.Tensor,
        expand: Expand,
        what: str,
        allowed: Allowed | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> DraftSteps:
        """This round's tree, with the drafter's rows as tokens (the caller maps them to
        ids); :meth:`Draft.nodes_in` of the candidates' draft gives each node's candidate.
        ``allowed``: a constraint's rows, as in :func:`grow`. As drafting steps; ``clock``
        times the ``expand`` calls (the request's share of a batch's joint calls)."""
        auto = self.budget == "auto"
        candidates = yield from grow_steps(
            root_logits,
            self._timed(expand, clock),
            self.width,
            self.depth,
            what,
            self._worth_expanding if auto else None,
            allowed,
        )
        if not candidates.rows:  # a constraint allows none of the drafter's rows
            self._keys = []
            return Draft([], [], values=[]).select([])  # (empty, made from the empty candidates)
        keys = [confidence_key(d, p) for d, p in zip(candidates.depths, candidates.probs)]
        self.levels[1 + max(candidates.depths)] += 1
        values = self.stats.path_values(candidates.parents, keys)
        if auto:
            order = sorted(range(len(candidates)), key=lambda i: (-values[i], candidates.depths[i], i))
            keep = order[: self._best([values[i] for i in order])[0]]
        else:
            order = sorted(
                range(len(candidates)), key=lambda i: (-candidates.scores[i], candidates.depths[i], i)
            )
            keep = order[: self.budget or len(order)]
        keep.sort()
        draft = Draft(candidates.rows, candidates.parents, values=values).select(keep)
        self._keys = [keys[i] for i in keep]
        self.sizes[len(draft)] += 1
        return draft

    def _timed(self, expand: Expand, clock: Callable[[], float]) -> Expand:
        def timed(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> DraftSteps:
            tick = clock()
            logits = yield from _stepped(expand(frontier, rows, parents, depth))
            self._expand_seconds += clock() - tick
            self._expands += 1
            return logits

        return timed

    def _worth_expanding(self, candidates: Candidates, frontier: list[int]) -> list[int]:
        """The nodes of ``frontier`` worth an ``expand`` call (none: stop growing).

        At most one child of a node is accepted, and only if the node is, so the best a
        frontier node's children can do is one child accepted as often as the node times
        the best rate measured at the children's depth. Take the best tree over the
        candidates already grown plus those optimistic children, its drafting dearer by
        one measured ``expand`` call: if it beats the best tree without them, expand the
        frontier nodes whose optimistic child it keeps. (The levels below add little once
        a level cannot pay.)"""
        if self._expands == 0:
            return frontier  # nothing measured yet
        keys = [confidence_key(d, p) for d, p in zip(candidates.depths, candidates.probs)]
        values = self.stats.path_values(candidates.parents, keys)
        depth = candidates.depths[frontier[0]] + 1
        best_rate = max(
            self.stats.rate(confidence_key(depth, (b + 0.5) / CONFIDENCE_BUCKETS))
            for b in range(CONFIDENCE_BUCKETS)
        )
        grown = sorted(values, reverse=True)
        _, now = self._best(grown)
        optimistic = {node: values[node] * best_rate for node in frontier}
        ranked = sorted([(v, None) for v in grown] + [(v, node) for node, v in optimistic.items()],
                        key=lambda pair: -pair[0])  # fmt: skip
        size, then = self._best([v for v, _ in ranked], self._expand_seconds / self._expands)
        if then <= now:
            return []
        return sorted(node for _, node in ranked[:size] if node is not None)

    def _best(self, values: list[float], extra_seconds: float = 0.0) -> tuple[int, float]:
        """(n, expected tokens per second) of the best n-node tree, ``values`` in descending order."""
        return best_size(
            values,
            self._pass_seconds(),
            self.mean_draft_seconds + extra_seconds,
            min_gain=self.min_gain,
            base_tokens=self._pass_seconds.base_tokens,
        )

    def observe(self, round: Round) -> None:
        """After verification of the last tree built (``round.draft``: that tree, its tokens
        mapped to ids or not)."""
        super().observe(round)
        if self._keys is not None:
            self.stats.record_round(round, self._keys)
        self._keys = None

    def describe(self) -> dict:
        rounds = sum(self.sizes.values())
        return {
            "tree": "dynamic",
            "tree_width": self.width,
            "tree_depth": self.depth,
            "tree_budget": self.budget,
            "tree_candidates": self.max_nodes,
            "mean_levels_grown": round(sum(n * c for n, c in self.levels.items()) / rounds, 3)
            if rounds
            else None,
            "mean_tree_nodes": round(sum(n * c for n, c in self.sizes.items()) / rounds, 3)
            if rounds
            else None,
            "expand_calls": self._expands,
            "expand_seconds": round(self._expand_seconds / self._expands, 6) if self._expands else None,
            "acceptance_by_depth_confidence": self.stats.as_dict(confidence_label),
        }
