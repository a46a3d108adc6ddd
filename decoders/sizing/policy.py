"""How big a draft is: the one place that decides it.

The pipeline builds one :class:`SizingPolicy` from its target's T(n) and gives it to its
proposers as ``context.sizing`` (and to its round gate). A proposer says what it has (its
candidates and their confidences) and the policy's sizer for that kind of draft answers
how many to send:

- :meth:`SizingPolicy.chain`: a chain, from the acceptance measured per situation and
  depth (ngram, span, early exit, chains of heads and EAGLE;
  :class:`~specdec.decoders.sizing.draft_length.DraftLengthPolicy`);
- :meth:`SizingPolicy.dynamic_tree`: a tree grown from a drafter's confidence, cut to the
  nodes that pay (draft model, copy heads, EAGLE;
  :class:`~specdec.decoders.sizing.dynamic_tree.DynamicTree`);
- :meth:`SizingPolicy.static_tree`: a fixed tree's budget, re-chosen as rounds accumulate
  (Medusa's trees; :class:`~specdec.decoders.sizing.tree_budget.TreeBudget`);
- :meth:`SizingPolicy.ranked`: candidates ranked by estimated value, each prefix a tree
  (suffix decoding, merge's joined tree; :class:`RankedNodes`);
- :meth:`SizingPolicy.round_gate`: whether a round drafts at all
  (:class:`~specdec.decoders.sizing.round_gate.RoundGate`);
- :meth:`SizingPolicy.joint` and :meth:`SizingPolicy.batch_gate`: a batch's drafts chosen
  together for its pass, and whether its rounds draft at all
  (:class:`~specdec.decoders.sizing.batch_gate.BatchGate`).

Each sizer weighs the expected tokens of a size against its pass with the one search,
:func:`~specdec.decoders.sizing.search.best_size`. A proposer keeps its sizer (what it
measured is its own) but builds none itself: replacing the policy (``Pipeline(...,
sizing=...)``) changes how every proposer of the pipeline sizes its drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import AcceptanceStats, confidence_bucket
from specdec.decoders.sizing.batch_gate import BatchGate
from specdec.decoders.sizing.draft_length import DraftLengthPolicy
from specdec.decoders.sizing.dynamic_tree import (  # noqa: F401  (TreeOptions, tree_shape: proposers' tree options)
    DynamicTree,
    TreeOptions,
    confidence_key,
    tree_shape,
)
from specdec.decoders.sizing.round_gate import RoundGate
from specdec.decoders.sizing.search import (
    MIN_GAIN,
    Beside,
    PassSeconds,
    Probe,
    Sizer,
    best_size,
    check_budget,
    start_request,
)
from specdec.decoders.sizing.tree_budget import TreeBudget


class RankedNodes(Sizer):
    """Ranked candidates, each with an estimated acceptance probability (best first, each
    prefix a tree): how many of them to send, possibly none. :attr:`stats` calibrates the
    estimates for a proposer that keys its nodes (suffix decoding); a probe keeps a
    situation switched off measured (``explore_every``)."""

    def __init__(
        self,
        target_cost: Callable[[], CostCurve],
        max_nodes: int,
        explore_every: int | None = None,
        min_gain: float = MIN_GAIN,
        beside: Beside | None = None,
    ) -> None:
        super().__init__()
        self.max_nodes = max_nodes
        self.min_gain = min_gain
        self.stats = AcceptanceStats.confident(by_level=True)
        self._pass_seconds = PassSeconds(target_cost, max_nodes + 1, beside)
        self._probe = Probe(explore_every) if explore_every else None

    def choose(self, values: list[float], kept: int = 0, kept_tokens: float = 0.0) -> int:
        """How many of ``values`` (best first) to send beside ``kept`` nodes sent anyway,
        which are expected to give ``kept_tokens``."""
        size, _ = best_size(
            values,
            self._pass_seconds()[kept:],
            self.mean_draft_seconds,
            min_gain=self.min_gain,
            allow_empty=True,
            base_tokens=self._pass_seconds.base_tokens + kept_tokens,
        )
        return self._probe(None, size) if self._probe is not None else size


class SizingPolicy:
    """Every sizer of one pipeline, built over its target's T(n) (``cost_curve``, read on
    first use). See the module."""

    def __init__(
        self,
        cost_curve: Callable[[], CostCurve],
        min_gain: float = MIN_GAIN,
        batch_curve: Callable[[int], CostCurve | None] | None = None,
    ) -> None:
        self.cost_curve = cost_curve
        self.min_gain = min_gain
        # T(n) of a packed pass over that many requests (None: cost_curve's)
        self.batch_curve = batch_curve
        self._beside = Beside()  # read by every sizer handed out (a batch's other rows)

    def beside(self, rows: int, tokens: float, requests: int = 0) -> None:
        """The rest of the pass the next draft joins: ``rows`` of other requests, expected
        to yield ``tokens``, in a packed pass over ``requests`` requests (a batch tells it
        before each request drafts; alone: 0, 0, 0). Every sizer then weighs a draft by the
        whole pass's tokens per second: its nodes priced at T(rows + 1 + n), T of the packed
        passes over that many requests where ``batch_curve`` gives one, its tokens added to
        the others'."""
        beside = self._beside
        beside.rows, beside.tokens = rows, tokens
        beside.curve = self._packed_curve(requests)

    def pass_curve(self, requests: int = 0) -> CostCurve:
        """T(n) of a packed pass over ``requests`` requests where ``batch_curve`` gives one,
        else of a request's own pass."""
        curve = self._packed_curve(requests)
        return curve if curve is not None else self.cost_curve()

    def _packed_curve(self, requests: int) -> CostCurve | None:
        return self.batch_curve(requests) if requests and self.batch_curve is not None else None

    def joint(
        self, drafts: list[tuple[list[int], list[float] | None]], requests: int | None = None
    ) -> list[list[int]]:
        """A batch's drafts chosen together for its one pass: ``drafts`` are every request's
        (parents, values), values the estimated chance that each node is accepted (None: a
        draft kept whole). Every valued node of every request is ranked by its value (capped
        by its parent's, so each prefix of the ranking is a set of trees), and the best
        prefix is the one the whole pass yields most tokens per second with: T(n) over every
        request's pending row, the drafts kept whole and the nodes taken. Returns the nodes
        each draft keeps, in order. ``requests``: the pass's requests, whose packed passes'
        T(n) prices it (default: one per draft; 0: a request's own pass, alone)."""
        rows, tokens = 0, 0.0  # what the pass holds anyway
        keep: list[list[int]] = []
        ranked: list[tuple[float, int, int]] = []  # (-value, request, node)
        for request, (parents, values) in enumerate(drafts):
            rows, tokens = rows + 1, tokens + 1.0
            if values is None:
                rows += len(parents)
                keep.append(list(range(len(parents))))
                continue
            keep.append([])
            capped: list[float] = []
            for node, (parent, value) in enumerate(zip(parents, values)):
                capped.append(min(value, capped[parent]) if parent >= 0 else value)
                ranked.append((-capped[node], request, node))
        if not ranked:
            return keep
        ranked.sort()  # best first; a parent before its children (value >= theirs, index lower)
        curve = self.pass_curve(len(drafts) if requests is None else requests)
        seconds = curve.non_decreasing(rows + len(ranked))[rows - 1 :]  # T(rows + m)
        taken, _ = best_size(
            [-value for value, _, _ in ranked],
            seconds,
            min_gain=self.min_gain,
            allow_empty=True,
            base_tokens=tokens,
        )
        for _, request, node in ranked[:taken]:
            keep[request].append(node)
        return [sorted(nodes) for nodes in keep]

    def chain(self, max_len: int, explore_every: int = 16) -> DraftLengthPolicy:
        """A chain's length, 0 .. ``max_len``, per situation (``choose(key, available)``)."""
        return DraftLengthPolicy(max_len, self.cost_curve, explore_every, self.min_gain, self._beside)

    def dynamic_tree(self, width: int, depth: int, budget: Any) -> DynamicTree:
        """A tree of ``depth`` levels, ``width`` children per node, grown from the drafter's
        confidence and cut to ``budget`` nodes (an int), the nodes that pay (``"auto"``) or
        none (null)."""
        return DynamicTree(width, depth, check_budget(budget), self.cost_curve, self.min_gain, self._beside)

    def static_tree(self, max_nodes: int, every: int = 32) -> TreeBudget:
        """A fixed tree of ``max_nodes`` rank paths: the best prefix, re-chosen every ``every`` rounds."""
        return TreeBudget(self.cost_curve, max_nodes, every, self.min_gain, self._beside)

    def ranked(self, max_nodes: int, explore_every: int | None = None) -> RankedNodes:
        """Up to ``max_nodes`` candidates ranked by estimated value."""
        return RankedNodes(self.cost_curve, max_nodes, explore_every, self.min_gain, self._beside)

    def round_gate(self) -> RoundGate:
        """Whether each round drafts at all, from what the drafted rounds gave and cost."""
        return RoundGate(self.cost_curve)

    def batch_gate(self) -> BatchGate:
        """Whether each round of a batch drafts at all, from the throughput of the drafted
        and the plain rounds over as many requests (one per pipeline)."""
        return BatchGate()

    def pass_seconds(self, max_tokens: int) -> PassSeconds:
        """T(1) .. T(max_tokens), non-decreasing: for a proposer that prices its own drafting
        in passes of the target (early exit)."""
        return PassSeconds(self.cost_curve, max_tokens)

    @staticmethod
    def start_request(proposer: Any) -> None:
        """A request begins for ``proposer`` (after its ``begin``): every sizer it holds starts
        the request's own acceptance counts, over those pooled across requests
        (:mod:`specdec.decoders.sizing.acceptance`, "The request in hand")."""
        start_request(proposer)

    @staticmethod
    def check_budget(budget: Any) -> Any:
        """A ``tree_budget`` option: a positive integer, ``auto`` or null (every node)."""
        return check_budget(budget)

    # The situation keys sizers count acceptance under, from a drafter's probabilities.
    @staticmethod
    def confidence(probability: float) -> int:
        """A chain's situation: the drafter's probability of its first token, bucketed."""
        return confidence_bucket(probability)

    @staticmethod
    def node_key(depth: int, probability: float) -> tuple[int, int]:
        """A node's situation: its depth and its drafter probability, bucketed."""
        return confidence_key(depth, probability)
