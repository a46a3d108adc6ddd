"""The dynamic tree mechanism (decoders/sizing/dynamic_tree.py) on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.decoders.engine.draft import Draft
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import AcceptanceStats
from specdec.decoders.sizing.dynamic_tree import DynamicTree, grow

VOCAB = 6


def fixed_expand(calls: list):
    """Children logits depending on the parent's row: row r prefers token (r + 1) % VOCAB."""

    def expand(frontier, rows, parents, depth):
        calls.append((list(frontier), depth))
        logits = torch.full((len(frontier), VOCAB), -4.0)
        for i, node in enumerate(frontier):
            logits[i, (rows[node] + 1) % VOCAB] = 2.0
            logits[i, (rows[node] + 2) % VOCAB] = 1.0
        return logits

    return expand


ROOT = torch.tensor([3.0, 2.5, 0.0, -1.0, -2.0, -3.0])


def test_grow_expands_the_best_frontier_into_its_top_children():
    calls: list = []
    candidates = grow(ROOT, fixed_expand(calls), width=2, depth=3, what="test")
    assert len(candidates) == 2 + 2 * 2 * 2
    assert candidates.rows[:2] == [0, 1] and candidates.parents[:2] == [-1, -1]
    assert [depth for _, depth in calls] == [0, 1]
    root_logp = torch.log_softmax(ROOT, -1)
    assert candidates.scores[0] == pytest.approx(float(root_logp[0]))
    for i, parent in enumerate(candidates.parents):
        if parent >= 0:
            assert candidates.rows[i] in (
                (candidates.rows[parent] + 1) % VOCAB,
                (candidates.rows[parent] + 2) % VOCAB,
            )
            assert candidates.scores[i] == pytest.approx(
                candidates.scores[parent] + math.log(candidates.probs[i])
            )
            assert candidates.depths[i] == candidates.depths[parent] + 1
    # level 2 expands the two best depth-1 nodes by cumulative score
    level1 = [i for i, d in enumerate(candidates.depths) if d == 1]
    best = sorted(sorted(level1, key=lambda i: -candidates.scores[i])[:2])
    assert calls[1][0] == best


def test_a_constraint_leaves_only_allowed_children_renormalised():
    """``allowed(path)``: each node's children are its best allowed rows, scored by the
    drafter's distribution over them; where nothing is allowed, nothing is drafted."""

    def odd_after_even(path: list[int]) -> torch.Tensor:
        return torch.tensor([(row % 2 == 1) == (len(path) % 2 == 0) for row in range(VOCAB)])

    candidates = grow(ROOT, fixed_expand([]), width=2, depth=3, what="test", allowed=odd_after_even)
    assert candidates.rows[:2] == [1, 3]  # the root's best odd rows, though 0 scores higher
    allowed_logp = torch.log_softmax(ROOT[[1, 3, 5]], -1)
    assert candidates.scores[0] == pytest.approx(float(allowed_logp[0]))
    for row, depth in zip(candidates.rows, candidates.depths):
        assert row % 2 == (1 if depth % 2 == 0 else 0)
    tree = DynamicTree(width=2, depth=3, budget=4, target_cost=flat_then_steep)
    nothing = tree.build(ROOT, fixed_expand([]), "test", lambda path: torch.zeros(VOCAB, dtype=torch.bool))
    assert len(nothing) == 0 and nothing.origin is not None  # the caller maps its (no) nodes back


def flat_then_steep(width: int = 4) -> CostCurve:
    """T(n) = 1 up to ``width`` tokens, then +0.5 per token."""
    return CostCurve({1: 1.0, width: 1.0, 64: 1.0 + 0.5 * (64 - width)})


def flat() -> CostCurve:
    return CostCurve({1: 1.0, 64: 1.0})


def test_integer_budget_keeps_the_most_probable_nodes_as_a_tree():
    tree = DynamicTree(width=2, depth=3, budget=4, target_cost=flat_then_steep)
    draft = tree.build(ROOT, fixed_expand([]), "test")
    assert len(draft) == 4 and draft.draft_probs is None
    Draft(draft.tokens, draft.parents)  # parents precede children
    assert draft.tokens[0] == 0  # the root's favourite


def test_auto_budget_keeps_the_size_with_the_most_expected_tokens_per_second():
    tree = DynamicTree(width=2, depth=3, budget="auto", target_cost=flat_then_steep)
    # Uncalibrated estimates (the drafter's own probabilities, bucketed): the best three
    # nodes ride in the free part of the pass; a 4th (estimated 0.31) would cost 50% more
    # time for 13% more expected tokens.
    assert len(tree.build(ROOT, fixed_expand([]), "test")) == 3
    # Measured never to be accepted: the smallest draft (one node, still free).
    for depth in range(4):
        for bucket in range(10):
            tree.stats.tried[(depth, bucket)] += 1000
    assert len(tree.build(ROOT, fixed_expand([]), "test")) == 1
    # A pass that costs the same at any width takes every candidate.
    assert len(DynamicTree(2, 3, "auto", flat).build(ROOT, fixed_expand([]), "test")) == 2 + 2 * 2 * 2


def test_auto_trees_stop_growing_where_the_next_level_cannot_pay_for_its_call():
    """An expand call (microseconds here) is worth growing for against a 1-second pass,
    not against a 1-microsecond one, where its time buys more than any level adds."""
    calls: list = []
    slow_pass = DynamicTree(width=2, depth=3, budget="auto", target_cost=flat)
    for _ in range(2):
        slow_pass.build(ROOT, fixed_expand(calls), "test")
    assert [(len(frontier), depth) for frontier, depth in calls] == [(2, 0), (2, 1)] * 2
    fast_pass = DynamicTree(2, 3, "auto", lambda: CostCurve({1: 1e-6, 64: 1e-6}))
    calls.clear()
    fast_pass.build(ROOT, fixed_expand(calls), "test")  # the first call, not yet measured, is made
    assert [depth for _, depth in calls] == [0]
    calls.clear()
    draft = fast_pass.build(ROOT, fixed_expand(calls), "test")
    assert calls == [] and max(draft.depths) == 0  # not one expand call
    assert fast_pass.describe()["mean_levels_grown"] == pytest.approx((2 + 1) / 2)


def test_auto_trees_expand_only_the_frontier_nodes_whose_children_could_be_kept():
    """A pass over 3 tokens is free: two nodes. The roots are estimated at 0.55 and 0.35
    (their buckets' priors); the best child of the first could reach 0.55 * 0.95 = 0.52,
    of the second 0.35 * 0.95 = 0.33, so the best two nodes are the first root and its
    child: only the first root is expanded."""
    tree = DynamicTree(width=2, depth=3, budget="auto", target_cost=lambda: flat_then_steep(3))
    tree.build(ROOT, fixed_expand([]), "test")  # measures an expand call
    calls: list = []
    tree.build(ROOT, fixed_expand(calls), "test")
    assert calls[0] == ([0], 0)


def test_calibration_counts_tried_and_accepted_nodes():
    calibration = AcceptanceStats.confident(buckets=10)
    draft = Draft([5, 6, 7, 8], [-1, -1, 0, 0])  # two roots; node 0 has children 2 and 3
    keys = [(0, 9), (0, 1), (1, 5), (1, 5)]
    assert calibration.rate((0, 9)) == pytest.approx(0.95)  # the prior: the bucket's own probability
    calibration.record(draft, keys, path=[0, 3])
    assert calibration.tried[(0, 9)] == 1 and calibration.accepted[(0, 9)] == 1
    assert calibration.tried[(0, 1)] == 1 and calibration.accepted[(0, 1)] == 0
    assert calibration.tried[(1, 5)] == 2 and calibration.accepted[(1, 5)] == 1
    calibration.record(draft, keys, path=[])  # nothing accepted: only the roots were tried
    assert calibration.tried[(1, 5)] == 2 and calibration.tried[(0, 9)] == 2


def test_by_level_prices_an_untried_depth_from_the_level_above():
    plain = AcceptanceStats.confident(buckets=10)
    stats = AcceptanceStats.confident(buckets=10, by_level=True)
    chain = Draft([1, 2, 3], [-1, 0, 1])
    keys = [(0, 5, "request"), (1, 5, "request"), (2, 5, "request")]
    for calibration in (plain, stats):
        for _ in range(40):
            calibration.record(chain, keys, path=[0, 1, 2])  # every level accepted every time
    # depth 0 reads the same either way; untried situations keep the bucket's middle
    assert stats.rate((0, 5, "request")) == pytest.approx(plain.rate((0, 5, "request")))
    assert stats.rate((0, 2, "memory")) == pytest.approx(0.25) == plain.rate((0, 2, "memory"))
    # depth 3 was never tried: the bucket's middle alone, or the level above's measured rate
    assert plain.rate((3, 5, "request")) == pytest.approx(0.55)
    assert stats.pooled((3, 5, "request")) == pytest.approx(stats.pooled((2, 5, "request")))
    assert stats.rate((3, 5, "request")) > 0.95
    # a deep node that then fails pulls its own rate down from that prior
    for _ in range(8):
        stats.record(Draft([1, 2, 3, 4], [-1, 0, 1, 2]), keys + [(3, 5, "request")], path=[0, 1, 2])
    assert stats.rate((3, 5, "request")) < 0.4


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="tree_width"):
        DynamicTree(width=0, depth=3, budget=4, target_cost=flat_then_steep)
    with pytest.raises(ValueError, match="tree_budget"):
        DynamicTree(width=2, depth=3, budget="big", target_cost=flat_then_steep)
