"""proposer=merge: members' drafts joined into one tree, each member seeing its own acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import RegistryError, build, proposer_registry
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.policy import SizingPolicy
from specdec.decoders.sizing.search import best_size
from specdec.proposers.merge import MAX_JOINED_NODES, MergeProposer
from tests.conftest import CONSTRAINT_ONLY_PROPOSERS, TEXT_PROPOSERS, random_prompts


class FixedProposer(Proposer):
    """Always proposes the same draft; remembers what it observed."""

    name = "fixed"

    @dataclass
    class Config:
        pass

    def __init__(self, draft: Draft) -> None:
        super().__init__(self.Config(), None)
        self.draft = draft
        self.observed: list[Round] = []
        self.skipped = 0

    def propose(self, state) -> Draft:
        return self.draft

    def skip(self, state) -> None:
        self.skipped += 1

    def observe(self, state, round) -> None:
        self.observed.append(round)


def merged(
    *drafts: Draft, joint_curve: CostCurve | None = None, fallback: int = 0
) -> tuple[MergeProposer, list[FixedProposer]]:
    """A merge of fixed members; with ``joint_curve``, sizing the joined tree under that T(n)."""
    proposer = MergeProposer.__new__(MergeProposer)
    members = [FixedProposer(d) for d in drafts]
    proposer.config = MergeProposer.Config(
        members=[], joint_budget=joint_curve is not None, fallback=fallback
    )
    proposer.members, proposer._drafts, proposer._joined, proposer._seconds = members, [], [], []
    proposer.merged_nodes, proposer.own_nodes, proposer.cut_nodes = 0, [0] * len(members), 0
    proposer.fallback_rounds = 0
    proposer.sizer = SizingPolicy(lambda: joint_curve).ranked(MAX_JOINED_NODES)
    return proposer, members


def test_shared_prefixes_become_shared_nodes_and_the_first_member_leads():
    chain = Draft.chain([1, 2, 3])
    tree = Draft([1, 5, 4, 2], [-1, 0, -1, 0])  # 1 -> {5, 2}, 4
    proposer, _ = merged(chain, tree)
    draft = proposer.propose(None)
    paths = set()
    for node in range(len(draft)):
        path, n = [], node
        while n >= 0:
            path.insert(0, draft.tokens[n])
            n = draft.parents[n]
        paths.add(tuple(path))
    assert paths == {(1,), (1, 2), (1, 2, 3), (1, 5), (4,)}
    assert len(draft) == 5 and draft.draft_probs is None
    assert [draft.tokens[i] for i in draft.principal_path()] == [1, 2, 3]
    assert proposer.merged_nodes == 2 and proposer.own_nodes == [3, 2]


def test_a_lone_proposing_member_is_passed_on_unchanged():
    sampled = Draft.chain([1, 2], torch.full((2, 4), 0.25))
    proposer, _ = merged(sampled, Draft.empty())
    assert proposer.propose(None) is sampled  # its draft_probs kept: rejection sampling as if alone
    proposer, _ = merged(Draft.empty(), Draft.empty())
    assert len(proposer.propose(None)) == 0


def test_sampled_nodes_stay_separate_and_keep_their_rows():
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0]])
    sampled = Draft.chain([1, 2], q)
    lookup = Draft.chain([1, 3])  # deterministic: the same first token as the sampled chain
    other = Draft.chain([1, 3, 0])  # deterministic: joins the lookup chain
    proposer, _ = merged(sampled, lookup, other)
    draft = proposer.propose(None)
    assert draft.tokens == [1, 2, 1, 3, 0] and draft.parents == [-1, 0, -1, 2, 3]
    torch.testing.assert_close(draft.draft_probs[:2], q)
    for node, token in [(2, 1), (3, 3), (4, 0)]:  # point masses on deterministic nodes
        assert draft.draft_probs[node].tolist() == [float(t == token) for t in range(4)]
    assert [draft.tokens[i] for i in draft.principal_path()] == [1, 2]


def test_each_member_observes_its_own_accepted_path():
    chain = Draft.chain([1, 2, 3])
    tree = Draft([4, 1, 5], [-1, -1, 1])  # 4; 1 -> 5
    proposer, (first, second) = merged(chain, tree)
    joined = proposer.propose(None)
    proposer.observe(None, Round.of(joined, [0, 4], [1, 5, 9]))  # merged nodes: 1 then 5
    assert first.observed[-1].path == [0] and first.observed[-1].tokens == [1, 5, 9]
    assert second.observed[-1].path == [1, 2]
    assert first.observed[-1].draft is chain and second.observed[-1].draft is tree
    assert first.observed[-1].verified == [0, 1, 2] and second.observed[-1].verified == [0, 1, 2]


def test_members_see_only_the_nodes_the_target_saw():
    """A chain verifier keeps the joined principal path: the second member's own nodes
    were not tried, and a path through a shared node is the member's path too."""
    chain = Draft.chain([1, 2, 3])
    other = Draft.chain([1, 7])  # shares node 1 with the chain
    proposer, (first, second) = merged(chain, other)
    joined = proposer.propose(None)
    principal = joined.principal_path()  # the chain's nodes
    proposer.observe(None, Round(joined, principal[:1], principal, [1, 5]))
    assert first.observed[-1].path == [0] and first.observed[-1].verified == [0, 1, 2]
    assert second.observed[-1].path == [0] and second.observed[-1].verified == [0]


def test_a_fallback_member_drafts_only_where_the_others_have_nothing():
    """``fallback: 1``: the last member is asked only in rounds where the members before it
    proposed nothing; in the others it is skipped (and not told of the round)."""
    proposer, (first, second, heads) = merged(
        Draft.chain([1, 2]), Draft.empty(), Draft.chain([7]), fallback=1
    )
    draft = proposer.propose(None)
    assert draft is first.draft and heads.skipped == 1
    proposer.observe(None, Round.of(draft, [0], [1, 2]))
    assert len(first.observed) == 1 and len(second.observed) == 1 and heads.observed == []
    first.draft = Draft.empty()  # nothing from the others: the fallback drafts
    draft = proposer.propose(None)
    assert draft is heads.draft and heads.skipped == 1 and proposer.fallback_rounds == 1
    proposer.observe(None, Round.of(draft, [0], [7, 3]))
    assert heads.observed[-1].path == [0]


@pytest.mark.parametrize("verifier", ["tree", "greedy"])
def test_a_merge_with_a_fallback_stays_lossless(tiny_pipeline, verifier):
    members = [{"name": "ngram", "k": 3}, {"name": "draft_model", "tree": True, "k": 3, "tree_width": 2}]
    pipeline = tiny_pipeline.with_components({"name": "merge", "members": members, "fallback": 1}, verifier)
    for prompt in random_prompts(4, seed=5):
        assert pipeline.generate(prompt, 20).tokens == tiny_pipeline.generate(prompt, 20).tokens
    assert 0 < pipeline.proposer.describe()["fallback_rounds"]


def test_a_joint_budget_keeps_no_more_of_the_joined_tree_than_pays():
    """Two members' estimates, one shared root (counted once, at the better estimate):
    under T(m) = 1 + 0.1 (m - 1) the joined tree keeps exactly the best-first nodes that
    pay for the wider pass (brute force), under a flat T(n) every node."""
    chain = Draft.chain([1, 2, 3], values=[0.9, 0.5, 0.05])
    other = Draft([1, 7], [-1, 0], values=[0.8, 0.3])  # shares the root with the chain
    linear = CostCurve({1: 1.0, 64: 7.3})
    proposer, (first, second) = merged(chain, other, joint_curve=linear)
    draft = proposer.propose(None)
    ranked = [0.9, 0.5, 0.3, 0.05]  # the joined tree's four nodes
    best, best_rate = 0, 1.0 / linear(1)
    for n in range(1, 5):  # no bigger tree gains 1% over the best smaller one
        rate = (1 + sum(ranked[:n])) / linear(n + 1)
        if rate > best_rate * 1.01:
            best, best_rate = n, rate
    assert len(draft) == best == best_size(ranked, linear.non_decreasing(5), allow_empty=True)[0] == 3
    assert draft.tokens == [1, 2, 7] and draft.parents == [-1, 0, 0] and proposer.cut_nodes == 1
    proposer.observe(None, Round.of(draft, [0, 2], [1, 7, 4]))  # the root, then 7
    assert first.observed[-1].path == [0] and first.observed[-1].verified == [0, 1]  # node 2 was cut
    assert second.observed[-1].path == [0, 1] and second.observed[-1].verified == [0, 1]
    flat, _ = merged(chain, other, joint_curve=CostCurve({1: 1.0, 64: 1.0}))
    assert len(flat.propose(None)) == 4


def test_a_joint_budget_keeps_sampled_and_unestimated_nodes():
    """Nodes whose members give no estimate, and sampled nodes (a cut must not depend on
    a sampled token), stay, with their ancestors, however dear the pass."""
    steep = CostCurve({1: 1.0, 64: 64.0})
    sampled = Draft.chain([1, 2], torch.full((2, 4), 0.25))
    unestimated = Draft.chain([3, 0])
    estimated = Draft.chain([3, 0, 2], values=[0.2, 0.1, 0.05])
    proposer, _ = merged(sampled, unestimated, estimated, joint_curve=steep)
    draft = proposer.propose(None)
    assert draft.tokens == [1, 2, 3, 0] and draft.parents == [-1, 0, -1, 2]  # the estimated leaf cut


MEMBERS = [
    [{"name": "ngram", "k": 4}, {"name": "draft_model", "tree": False, "k": 3}],
    [
        {"name": "draft_model", "tree": True, "k": 3, "tree_width": 2, "tree_budget": 5},
        {"name": "ngram", "branches": 2},
    ],
    [
        {"name": "suffix", "k": 4, "max_nodes": 6, "adaptive": False},
        {"name": "draft_model", "tree": True, "k": 2, "tree_width": 2, "tree_budget": 4},
    ],
]


def test_a_joint_budget_stays_lossless(tiny_pipeline):
    members = [{"name": "suffix", "k": 4, "max_nodes": 6}, {"name": "draft_model", "tree": True, "k": 3,
               "tree_width": 2, "tree_budget": "auto"}, {"name": "ngram", "branches": 2}]  # fmt: skip
    for verifier in ("tree", "greedy"):
        pipeline = tiny_pipeline.with_components(
            {"name": "merge", "members": members, "joint_budget": True}, verifier
        )
        for prompt in random_prompts(4, seed=7):
            assert pipeline.generate(prompt, 20).tokens == tiny_pipeline.generate(prompt, 20).tokens
        assert pipeline.proposer.describe()["joint_budget"] is True


@pytest.mark.parametrize("joint_budget", [True, False], ids=["joint", "whole"])
@pytest.mark.parametrize("members", MEMBERS, ids=["chain+chain", "tree+tree", "suffix+tree"])
@pytest.mark.parametrize("verifier", ["tree", "greedy"])
def test_greedy_output_equals_standard_decoding(tiny_pipeline, members, verifier, joint_budget):
    merge = {"name": "merge", "members": members, "joint_budget": joint_budget}
    pipeline = tiny_pipeline.with_components(merge, verifier)
    accepted = 0
    for prompt in random_prompts(5, seed=3):
        for max_new in (1, 7, 30):
            expected = tiny_pipeline.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (members, verifier, prompt, max_new)
            accepted += result.stats.accepted
    assert accepted > 0


def member_pairs() -> list[tuple[str, str]]:
    """Every ordered pair of distinct registered proposers (merge itself excepted)."""
    names = [name for name in proposer_registry.names() if name != "merge"]
    silent = CONSTRAINT_ONLY_PROPOSERS | TEXT_PROPOSERS  # (tests/conftest.py) draft ~nothing on random ids
    return [(a, b) for a in names for b in names if a != b and not {a, b} <= silent]


@pytest.mark.parametrize(("first", "second"), member_pairs(), ids=[f"{a}+{b}" for a, b in member_pairs()])
def test_every_pair_of_proposers_merges_losslessly(drafting_pays, trained_pipeline, first, second):
    """Greedy identity for the merge of any two proposers, in both orders, including
    members that draft with the target's own layers (early exit)."""
    pipeline = trained_pipeline.with_components({"name": "merge", "members": [first, second]}, "tree")
    proposed = 0
    for prompt in random_prompts(3, seed=8):
        for max_new in (1, 12):
            expected = trained_pipeline.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (first, second, prompt, max_new)
            proposed += result.stats.proposed
    assert proposed > 0, "neither member drafted: the pair was not exercised"


def test_bad_members_are_refused(tiny_pipeline):
    context = tiny_pipeline.context
    with pytest.raises(ValueError, match="at least one member"):
        build(proposer_registry, {"name": "merge", "members": []}, context=context)
    with pytest.raises(ValueError, match="another merge"):
        build(proposer_registry, {"name": "merge", "members": ["ngram", {"name": "merge"}]}, context=context)
    with pytest.raises(ValueError, match="at most one member that drafts with the target's own layers"):
        build(proposer_registry, {"name": "merge", "members": ["early_exit", "early_exit"]}, context=context)
    with pytest.raises(ValueError, match="proposer.fallback must be between 0 and 1"):
        build(
            proposer_registry,
            {"name": "merge", "members": ["ngram", "suffix"], "fallback": 2},
            context=context,
        )
    with pytest.raises(ValueError, match="cannot be a fallback member"):
        build(
            proposer_registry,
            {"name": "merge", "members": ["ngram", "early_exit"], "fallback": 1},
            context=context,
        )
    with pytest.raises(RegistryError, match="unknown proposer 'nope'"):
        build(proposer_registry, {"name": "merge", "members": ["nope"]}, context=context)
