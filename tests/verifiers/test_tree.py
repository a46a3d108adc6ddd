"""Tree drafts and tree verification.

* the multi-draft acceptance rule emits exactly the target's distribution under
  the conditions verifiers/tree.py states (exact enumeration of its branches),
  and not when they are broken;
* greedy identity for every tree-producing proposer with verifier=tree;
* a chi-square test that tree decoding with sampling has standard decoding's
  distribution on a tiny small-vocabulary model;
* the draft model's dynamic tree, its cache sync, and the tree budget.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.decoders.engine.context import PipelineContext
from specdec.decoders.engine.decoding import decode
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import build, proposer_registry
from specdec.decoders.engine.request import StopConditions
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs, sample
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.loading import ModelConfig, tiny_draft_model, tiny_random_model
from specdec.decoders.models.session import ModelSession
from specdec.decoders.sizing.acceptance import AcceptanceStats
from specdec.decoders.sizing.draft_length import DraftLengthPolicy
from specdec.decoders.sizing.search import best_size
from specdec.decoders.sizing.tree_budget import TreeBudget, best_paths, node_probabilities, rank_keys
from specdec.proposers.ngram import tree_from_sequences
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.tree import TreeVerifier, multi_draft_walk, sibling_round
from specdec.verifiers.typical import TypicalVerifier
from tests.conftest import random_prompts

GREEDY = SamplingConfig()

# ------------------------------------------------------- exact multi-draft acceptance


def emitted_distribution(
    target_probs: torch.Tensor, tokens: list[int], draft_rows: list[torch.Tensor | None]
) -> torch.Tensor:
    """Exact distribution of the token one node's rounds emit, for given siblings:
    each sibling is accepted with its round's probability, else the next is tried,
    and the correction token comes from the final distribution."""
    emitted = torch.zeros_like(target_probs)
    reach = 1.0  # probability that every earlier sibling was rejected
    probs = target_probs
    for token, row in zip(tokens, draft_rows):
        accept_probability, probs_after = sibling_round(probs, token, row)
        emitted[token] += reach * accept_probability
        reach *= 1.0 - accept_probability
        probs = probs_after
    return emitted + reach * probs


def distributions(vocab: int):
    """Probability vectors with some exact zeros, in float64."""
    weight = st.one_of(st.just(0.0), st.floats(0.01, 1.0))
    return (
        st.lists(weight, min_size=vocab, max_size=vocab)
        .filter(lambda w: sum(w) > 0.05)
        .map(lambda w: torch.tensor(w, dtype=torch.float64) / sum(w))
    )


def support(probs: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(probs).flatten()]


EXACT = {"rtol": 0.0, "atol": 1e-9}


@settings(max_examples=60, deadline=None)
@given(siblings=st.sampled_from([2, 3]), target_probs=distributions(4), draft_probs=distributions(4))
def test_iid_sampled_siblings_emit_exactly_the_target_distribution(siblings, target_probs, draft_probs):
    total = torch.zeros_like(target_probs)
    for tokens in itertools.product(support(draft_probs), repeat=siblings):
        weight = float(torch.prod(draft_probs[list(tokens)]))
        total += weight * emitted_distribution(target_probs, list(tokens), [draft_probs] * siblings)
    torch.testing.assert_close(total, target_probs, **EXACT)


@settings(max_examples=40, deadline=None)
@given(
    target_probs=distributions(4),
    draft_a=distributions(4),
    draft_b=distributions(4),
    draft_c=distributions(4),
)
def test_independent_siblings_from_different_drafts_emit_the_target_distribution(
    target_probs, draft_a, draft_b, draft_c
):
    drafts = [draft_a, draft_b, draft_c]
    total = torch.zeros_like(target_probs)
    for tokens in itertools.product(*(support(q) for q in drafts)):
        weight = float(torch.prod(torch.stack([q[t] for q, t in zip(drafts, tokens)])))
        total += weight * emitted_distribution(target_probs, list(tokens), drafts)
    torch.testing.assert_close(total, target_probs, **EXACT)


@settings(max_examples=40, deadline=None)
@given(siblings=st.sampled_from([2, 3]), target_probs=distributions(5), draft_probs=distributions(5))
def test_siblings_sampled_without_replacement_emit_the_target_distribution(
    siblings, target_probs, draft_probs
):
    """Each sibling drawn from q renormalised over the tokens not drawn yet, recorded as its q_i."""
    if len(support(draft_probs)) < siblings:
        return
    total = torch.zeros_like(target_probs)
    for tokens in itertools.permutations(support(draft_probs), siblings):
        weight, rows, remaining = 1.0, [], draft_probs.clone()
        for token in tokens:
            row = remaining / remaining.sum()
            weight *= float(row[token])
            rows.append(row)
            remaining[token] = 0.0
        total += weight * emitted_distribution(target_probs, list(tokens), rows)
    torch.testing.assert_close(total, target_probs, **EXACT)


@settings(max_examples=60, deadline=None)
@given(target_probs=distributions(5), tokens=st.lists(st.integers(0, 4), min_size=2, max_size=3))
def test_deterministic_siblings_emit_exactly_the_target_distribution(target_probs, tokens):
    """Any fixed candidates (distinct or not) judged as point masses."""
    emitted = emitted_distribution(target_probs, tokens, [None] * len(tokens))
    torch.testing.assert_close(emitted, target_probs, **EXACT)


def test_merging_equal_iid_siblings_is_not_lossless():
    """Condition 2 of verifiers/tree.py matters: a trie of i.i.d. samples merges equal
    tokens, so the number of siblings depends on the sampled values."""
    target_probs = torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64)
    draft_probs = torch.tensor([0.0, 0.4, 0.6], dtype=torch.float64)
    kept, merged = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for tokens in itertools.product(support(draft_probs), repeat=2):
        weight = float(draft_probs[tokens[0]] * draft_probs[tokens[1]])
        unique = list(dict.fromkeys(tokens))
        kept += weight * emitted_distribution(target_probs, list(tokens), [draft_probs] * 2)
        merged += weight * emitted_distribution(target_probs, unique, [draft_probs] * len(unique))
    torch.testing.assert_close(kept, target_probs, **EXACT)
    torch.testing.assert_close(merged, torch.tensor([0.28, 0.72, 0.0], dtype=torch.float64), **EXACT)


def test_sibling_round_on_crafted_numbers():
    target_probs = torch.tensor([0.5, 0.3, 0.2])
    draft_probs = torch.tensor([0.2, 0.6, 0.2])
    accept, residual = sibling_round(target_probs, 1, draft_probs)
    assert accept == pytest.approx(0.5)  # p/q = 0.3 / 0.6
    torch.testing.assert_close(residual, torch.tensor([1.0, 0.0, 0.0]))  # norm(max(0, p - q))
    accept, residual = sibling_round(target_probs, 0, None)
    assert accept == pytest.approx(0.5)  # point mass: p(x)
    torch.testing.assert_close(residual, torch.tensor([0.0, 0.6, 0.4]))


def test_multi_draft_walk_follows_certain_branches():
    """Probabilities 0 and 1 make the walk's path predictable."""
    # root children: 0 (token 5), 1 (token 6); node 1's children: 2 (token 7), 3 (token 8)
    draft = Draft([5, 6, 7, 8], [-1, -1, 1, 1])
    target_probs = torch.zeros(5, 10)  # (n + 1, vocab)
    target_probs[0, 6] = 1.0  # after the pending token: certainly 6
    target_probs[2, 8] = 1.0  # after node 1: certainly 8
    target_probs[4, 3] = 1.0  # after node 3 (a leaf): the bonus token is 3
    for seed in range(5):
        acceptance = multi_draft_walk(draft, target_probs, torch.Generator().manual_seed(seed))
        assert acceptance.path == [1, 3] and acceptance.tokens == [6, 8, 3]
    target_probs[2] = 0.0
    target_probs[2, 9] = 1.0  # after node 1: certainly 9, no child has it -> correction 9
    acceptance = multi_draft_walk(draft, target_probs, torch.Generator().manual_seed(0))
    assert acceptance.path == [1] and acceptance.tokens == [6, 9]


def test_tree_verifier_processes_only_the_rows_its_walk_reaches(monkeypatch):
    """The verifier turns a row's logits into probabilities when its walk gets there:
    the verdicts of processing every row first, from the accepted path's rows alone."""
    from specdec.verifiers import tree as tree_module

    draft = Draft([5, 6, 7, 8, 2], [-1, -1, 1, 1, 3])  # a tree with a sibling at two levels
    sampling = SamplingConfig(temperature=0.8, top_k=6)
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    for row, token in [(0, 5), (0, 6), (2, 7), (2, 8), (4, 2)]:  # the tree's tokens likely, not certain
        logits[row, token] = 2.5
    processed: list[int] = []

    def counting(rows: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
        processed.append(rows.shape[:-1].numel())
        return processed_probs(rows, config)

    monkeypatch.setattr(tree_module, "processed_probs", counting)
    paths = set()
    for seed in range(40):
        everything = multi_draft_walk(
            draft, processed_probs(logits, sampling), torch.Generator().manual_seed(seed)
        )
        processed.clear()
        verified = TreeVerifier(TreeVerifier.Config()).verify(
            draft, logits, sampling, torch.Generator().manual_seed(seed)
        )
        assert verified == everything
        assert sum(processed) == verified.num_accepted + 1  # one row a node on the path, and the root's
        paths.add(tuple(verified.path))
    assert len(paths) > 2  # the seeds took several paths through the tree


# ------------------------------------------------- verifiers on crafted target logits


def crafted_logits(choices: list[int], vocab: int = 10) -> torch.Tensor:
    """(len(choices), vocab) logits whose argmax in row i is choices[i]."""
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_chain_verifier_given_a_tree_verifies_its_principal_path():
    tree = tree_from_sequences([[1, 2, 3], [1, 4], [5, 6]])  # nodes: 1 2 3 4 5 6
    chain = GreedyVerifier(GreedyVerifier.Config()).prepare(tree)
    assert chain.is_chain and chain.tokens == [1, 2, 3]
    assert TreeVerifier(TreeVerifier.Config()).prepare(tree) is tree
    # The target wants 1 then 4: the tree verifier finds it off the principal path.
    rows = crafted_logits([1, 4, 0, 0, 0, 0, 0])  # rows: pending, then each node
    tree_acceptance = TreeVerifier(TreeVerifier.Config()).verify(tree, rows, GREEDY, torch.Generator())
    assert tree_acceptance.tokens == [1, 4, 0] and tree_acceptance.path == [0, 3]
    chain_rows = crafted_logits([1, 4, 0, 0])
    chain_acceptance = GreedyVerifier(GreedyVerifier.Config()).verify(
        chain, chain_rows, GREEDY, torch.Generator()
    )
    assert chain_acceptance.tokens == [1, 4]


def test_typical_acceptance_bar_and_deepest_path():
    verifier = TypicalVerifier(TypicalVerifier.Config(posterior_threshold=0.09, posterior_alpha=0.3))
    assert not verifier.lossless and verifier.accepts_trees
    draft = Draft([0, 1, 2, 3], [-1, -1, 0, 1])  # 0 -> 2, 1 -> 3
    sampling = SamplingConfig(temperature=1.0)
    # Row 0 (after pending): uniform over 10 tokens, H = ln 10, bar = min(0.09, 0.3 / 10) = 0.03:
    # tokens 0 and 1 (p = 0.1) pass. Row 1 (after node 0): token 2 has p ~ 0.0003, fails.
    # Row 2 (after node 1): token 3 is near certain, passes.
    logits = torch.zeros(5, 10)
    logits[1, 5] = 10.0
    logits[2, 3] = 10.0
    acceptance = verifier.verify(draft, logits, sampling, torch.Generator().manual_seed(0))
    assert acceptance.path == [1, 3] and acceptance.tokens[:2] == [1, 3]
    # At temperature 0 it is greedy.
    greedy = verifier.verify(draft, crafted_logits([0, 2, 0, 0, 0]), GREEDY, torch.Generator())
    assert greedy.path == [0, 2]
    with pytest.raises(ValueError, match="posterior_threshold"):
        TypicalVerifier(TypicalVerifier.Config(posterior_threshold=0.0))


# --------------------------------------------------------------- greedy identity


TREE_PROPOSERS = [  # ngram without its length policy, whose cuts follow a cost curve measured on the spot
    {"name": "ngram", "branches": 3, "k": 4, "adaptive": False},
    {"name": "ngram", "branches": 2, "k": 7, "min_n": 2, "adaptive": False},
    {"name": "suffix", "k": 4, "max_nodes": 10, "adaptive": False},
    {"name": "draft_model", "tree": True, "k": 4, "tree_width": 3, "tree_budget": 10},
    {"name": "draft_model", "tree": True, "k": 6, "tree_width": 2, "tree_budget": 30},
    {"name": "draft_model", "tree": True, "k": 3, "tree_budget": "auto"},
]


@pytest.mark.parametrize("proposer", TREE_PROPOSERS, ids=lambda p: "-".join(f"{v}" for v in p.values()))
def test_tree_decoding_is_identical_to_standard_greedy(drafting_pays, tiny_pipeline, proposer):
    pipeline = tiny_pipeline.with_components(proposer, "tree")
    branched_rounds = accepted = 0
    for prompt in random_prompts(6, seed=5):
        for max_new in (1, 6, 30):
            expected = tiny_pipeline.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (proposer, prompt, max_new)
            accepted += result.stats.accepted
            branched_rounds += sum(size > proposer["k"] for size in result.stats.draft_sizes)
    assert accepted > 0 and branched_rounds > 0, "no tree was drafted or nothing accepted"


@pytest.mark.parametrize("proposer", TREE_PROPOSERS[::2], ids=lambda p: p["name"])
def test_eos_inside_a_tree_draft_stops_generation(tiny_pipeline, proposer):
    pipeline = tiny_pipeline.with_components(proposer, "tree")
    config = tiny_pipeline.model.generation_config
    saved = config.eos_token_id
    try:
        for prompt in random_prompts(6, seed=9):
            config.eos_token_id = saved
            free = tiny_pipeline.generate(prompt, 30).tokens
            eos = free[len(free) // 2]
            config.eos_token_id = eos
            expected = free[: free.index(eos) + 1]
            assert tiny_pipeline.generate(prompt, 30).tokens == expected
            assert pipeline.generate(prompt, 30).tokens == expected
    finally:
        config.eos_token_id = saved


def test_chain_verifier_with_a_tree_proposer_sees_chains_and_stays_identical(tiny_pipeline):
    proposer = {"name": "ngram", "branches": 3, "k": 4}
    pipeline = tiny_pipeline.with_components(proposer, "greedy")
    for prompt in random_prompts(6, seed=2):
        result = pipeline.generate(prompt, 20)
        assert result.tokens == tiny_pipeline.generate(prompt, 20).tokens
        assert max(result.stats.draft_sizes) <= proposer["k"]  # only the principal path was verified


# ------------------------------------------------------ the draft model's dynamic tree


def tiny_context(model: torch.nn.Module, **model_options) -> PipelineContext:
    return PipelineContext(model, None, ModelConfig(name="tiny-random", **model_options))


def test_dynamic_tree_nodes_are_the_draft_models_top_children(tiny_model, tiny_config):
    """Every node is among its parent's tree_width most probable tokens under the draft
    run as a plain chain, the tree respects the budget, and the draft's cache after a
    round equals a fresh run on the committed tokens."""
    model, _ = tiny_model
    config = {"name": "draft_model", "tree": True, "k": 3, "tree_width": 3, "tree_budget": 9}
    proposer = build(proposer_registry, config, context=PipelineContext(model, None, tiny_config))
    draft_model = proposer.model
    seen_trees = []

    def checked_draft_tree(root_logits, state):
        committed = list(proposer.session.cached)
        fresh = ModelSession(draft_model).forward(committed)[-1]
        torch.testing.assert_close(root_logits, fresh, rtol=0, atol=1e-10)
        tree = yield from original(root_logits, state)  # drafting steps (decoders/engine/drafting.py)
        seen_trees.append(tree)
        assert len(tree) <= 9 and tree.draft_probs is None
        for node in range(len(tree)):
            path = [i for i in range(len(tree)) if i == node or _is_ancestor(tree, i, node)]
            prefix = committed + [tree.tokens[i] for i in path[:-1]]
            top = ModelSession(draft_model).forward(prefix)[-1].topk(3).indices.tolist()
            assert tree.tokens[node] in top
        return tree

    original = proposer._draft_tree
    proposer._draft_tree = checked_draft_tree
    target = ModelSession(model)
    for prompt in random_prompts(3, seed=4):
        decode(target, prompt, StopConditions(12), GREEDY, proposer, TreeVerifier(TreeVerifier.Config()))
    assert any(not tree.is_chain for tree in seen_trees)


def _is_ancestor(draft: Draft, candidate: int, node: int) -> bool:
    while node >= 0:
        node = draft.parents[node]
        if node == candidate:
            return True
    return False


def test_nodes_in_maps_a_pruned_draft_back_to_the_proposed_one():
    tree = tree_from_sequences([[1, 2, 3], [1, 4], [5, 6]])  # 0:1 1:2 2:3 3:4 4:5 5:6
    assert tree.select([0, 1, 3]).select([0, 2]).nodes_in(tree) == [0, 3]  # through every select
    assert tree.as_chain().nodes_in(tree) == [0, 1, 2] and tree.nodes_in(tree) == list(range(6))
    # a draft built anew (no selection) is matched by (parent, token) from the root
    assert Draft.chain([1, 4, 9]).nodes_in(tree) == [0, 3, None]
    assert Draft.chain([5, 6, 7]).nodes_in(tree) == [4, 5, None]
    assert Draft.chain([7, 1]).nodes_in(tree) == [None, None]


def test_tree_option_is_validated(tiny_model, tiny_config):
    model, _ = tiny_model
    context = PipelineContext(model, None, tiny_config)
    with pytest.raises(ValueError, match="tree_budget must be a positive integer, auto or null"):
        build(proposer_registry, {"name": "draft_model", "tree": True, "tree_budget": "big"}, context=context)
    chain = build(proposer_registry, {"name": "draft_model", "tree": False, "k": 4}, context=context)
    assert chain.sampled and not chain.config.tree  # the chain stays the default


# ------------------------------------------------------------------- tree budget


def test_depth_rank_statistics_count_tried_and_accepted_nodes():
    tree = tree_from_sequences([[1, 2, 3], [1, 4], [5, 6]])  # root children 0 (1), 4 (5)
    stats = AcceptanceStats.measured()
    keys = rank_keys(tree)
    stats.record(tree, keys, [0, 3])  # accepted 1 then 4 (node 0's second child)
    assert stats.tried == Counter({(0, 0): 1, (0, 1): 1, (1, 0): 1, (1, 1): 1})
    assert stats.accepted == Counter({(0, 0): 1, (1, 1): 1})
    stats.record(tree, keys, [])
    assert stats.rate((0, 0)) == 0.5 and stats.rate((1, 1)) == 1.0 and stats.rate((5, 0)) == 0.0
    stats.record(tree, keys, [0], verified=[0, 1, 2])  # a chain verifier kept the principal path
    assert stats.tried[(1, 1)] == 1 and stats.tried[(0, 1)] == 2  # node 3 unseen, node 4 seen


def test_node_probabilities_and_best_size():
    stats = AcceptanceStats.measured()
    rates = {(0, 0): 0.8, (0, 1): 0.1, (1, 0): 0.5, (2, 0): 0.5}
    for key, rate in rates.items():
        stats.tried[key] = 10
        stats.accepted[key] = round(rate * 10)
    # paths (ranks): 0 -> 0.8, 0.0 -> 0.4, 0.0.0 -> 0.2, 1 -> 0.1, 1.0 -> 0.05, 1.0.0 -> 0.025;
    # depth 3 was never accepted, so nothing deeper.
    values = [0.8, 0.4, 0.2, 0.1, 0.05, 0.025]
    assert node_probabilities(stats, 10) == pytest.approx(values)
    assert node_probabilities(stats, 2) == pytest.approx(values[:2])
    flat = CostCurve({1: 1.0, 64: 1.0}).non_decreasing(21)  # wide passes are free: every node that gains 1%
    assert best_size(node_probabilities(stats, 20), flat)[0] == 5  # the 6th adds 0.025 / 2.55 < 1%
    assert best_size(node_probabilities(stats, 20), flat, min_gain=0.0)[0] == 6
    steep = CostCurve({1: 1.0, 2: 2.0, 64: 64.0}).non_decreasing(21)  # T(n) = n: only the first pays
    n, tokens_per_s = best_size(node_probabilities(stats, 20), steep)
    assert n == 1 and tokens_per_s == pytest.approx(1.8 / 2.0)
    # T(n) = 1 + 0.1 n with a draft cost of 0.5: brute force over n, each bigger tree
    # taken only if it beats the best smaller one by 1%
    linear = CostCurve({1: 1.1, 64: 7.4})
    best, best_rate = 1, 1.8 / 1.7
    for n in range(2, 20):
        rate = (1 + sum(values[:n])) / (1 + 0.1 * (n + 1) + 0.5)
        if rate > best_rate * 1.01:
            best, best_rate = n, rate
    assert best_size(node_probabilities(stats, 19), linear.non_decreasing(20), 0.5)[0] == best == 3


def test_best_paths_reshape_a_tree_from_measured_ranks():
    """Sampled siblings: a second draw at the root (rank 1) that is accepted more often than
    the first draw's child makes the best tree bushier than a greedy one; the paths come
    best first with their probabilities, and every prefix of the list is a tree."""
    stats = AcceptanceStats.measured()
    for key, rate in {(0, 0): 0.5, (0, 1): 0.4, (0, 2): 0.3, (1, 0): 0.2}.items():
        stats.tried[key] = 10
        stats.accepted[key] = round(rate * 10)
    paths = best_paths(stats, 5)
    assert [path for path, _ in paths] == [(0,), (1,), (2,), (0, 0), (1, 0)]
    assert [p for _, p in paths] == pytest.approx([0.5, 0.4, 0.3, 0.1, 0.08])
    for n in range(1, 6):
        kept = {path for path, _ in paths[:n]}
        assert all(path[:-1] in kept for path in kept if len(path) > 1)
    budget = TreeBudget(lambda: CostCurve({1: 1.0, 64: 1.0}), max_nodes=5)
    budget.stats = stats
    budget.retune()
    assert budget.paths == [path for path, _ in paths[: budget.budget]] and budget.budget == 5


def test_noisy_curve_does_not_grow_a_static_tree():
    """T(4) < T(3) is noise: a third node adding 0.5% more tokens must not look cheaper
    (the old static budget search, with neither guard, took it)."""
    noisy = CostCurve({1: 1.0, 2: 1.0, 3: 1.0, 4: 0.99})
    values = [0.9, 0.5, 0.012]
    assert best_size(values, [noisy(m) for m in range(1, 5)], min_gain=0.0)[0] == 3
    assert best_size(values, noisy.non_decreasing(4))[0] == 2


def test_tree_budget_explores_then_retunes_once_per_period():
    calls = []

    def curve() -> CostCurve:
        calls.append(1)
        return CostCurve({1: 1.0, 2: 2.0, 64: 64.0})

    budget = TreeBudget(curve, max_nodes=12, every=4)
    assert budget.budget == 12  # explores the full tree first
    for _ in range(8):
        budget.observe(Round.of(Draft.empty(), [], [0]))
    assert budget.budget == 1 and len(calls) == 1
    assert budget.describe() == {"acceptance_by_depth_rank": {}}


def test_a_chain_is_sized_alike_as_a_chain_and_as_a_one_branch_tree():
    """One search: the chain policy's length (survival products, a per-token drafting
    cost) equals the best size of the same chain given as a tree of path values."""
    curve = CostCurve({1: 1.0, 2: 1.02, 4: 1.1, 8: 1.5, 16: 3.0})
    policy = DraftLengthPolicy(8, lambda: curve, explore_every=10**6)
    for accepted in [8, 5, 3, 3, 2, 2, 1, 1, 0, 0, 6, 4]:
        policy.record("s", 8, accepted)
    chain = Draft.chain(list(range(8)))
    keys = [("s", depth + 1) for depth in chain.depths]
    tree_values = policy.stats.path_values(chain.parents, keys)  # a one-branch tree's node values
    for per_token in (0.0, 0.01, 0.05, 0.3):
        length = policy.choose("s", 8, per_token)
        n, _ = best_size(
            sorted(tree_values, reverse=True),
            curve.non_decreasing(9),
            seconds_per_node=per_token,
            allow_empty=True,
        )
        assert length == n, per_token
    assert policy.choose("s", 8, 0.0) > policy.choose("s", 8, 0.3)  # per-token cost shortens the chain


# ------------------------------------------- sampling: the target's distribution, end to end


class IidTreeProposer(Proposer):
    """A test proposer drawing sampled trees that meet verifiers/tree.py's conditions:
    three i.i.d. root children from the draft's q (duplicates kept apart), each with
    one child drawn from q given its own path."""

    def __init__(self, draft_model: torch.nn.Module) -> None:
        self.draft = draft_model

    def propose(self, state) -> Draft:
        session = ModelSession(self.draft)
        root_probs = processed_probs(session.forward(state.tokens)[-1], state.sampling)  # (vocab,)
        roots = [int(sample(root_probs, state.generator)) for _ in range(3)]
        child_probs = processed_probs(session.forward(roots, [-1, -1, -1]), state.sampling)  # (3, vocab)
        children = sample(child_probs, state.generator).tolist()
        draft_probs = torch.cat([root_probs.expand(3, -1), child_probs])  # (6, vocab)
        return Draft(roots + children, [-1, -1, -1, 0, 1, 2], draft_probs)


SMALL_VOCAB = 12


@pytest.fixture(scope="module")
def small_target() -> torch.nn.Module:
    return tiny_random_model(vocab_size=SMALL_VOCAB, hidden_size=64, num_layers=2, seed=0).double()


def exact_second_and_third_token_probs(model, prompt, sampling) -> torch.Tensor:
    """(vocab, vocab) exact P(2nd, 3rd generated token) under standard sampling."""
    with torch.no_grad():
        first = processed_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)  # (V,)
        contexts = torch.tensor([prompt + [a] for a in range(SMALL_VOCAB)])
        second = processed_probs(model(contexts).logits[:, -1], sampling)  # (V, V)
        contexts = torch.tensor([prompt + [a, b] for a in range(SMALL_VOCAB) for b in range(SMALL_VOCAB)])
        third = processed_probs(model(contexts).logits[:, -1], sampling).view(SMALL_VOCAB, SMALL_VOCAB, -1)
    joint = first[:, None, None] * second[:, :, None] * third  # (V, V, V) over tokens 1, 2, 3
    return joint.sum(0).double()


def chi_square_p_value(counts: Counter, expected_probs: torch.Tensor, samples: int) -> float:
    """Goodness of fit, cells with fewer than 5 expected samples pooled into one."""
    expected = (expected_probs.flatten() * samples).tolist()
    observed = [counts.get(divmod(cell, SMALL_VOCAB), 0) for cell in range(len(expected))]
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i, e in enumerate(expected) if e < 5]
    f_obs = [observed[i] for i in big] + [sum(observed[i] for i in small)]
    f_exp = [expected[i] for i in big] + [sum(expected[i] for i in small)]
    assert sum(f_obs) == samples
    assert sum(f_exp) == pytest.approx(samples, rel=1e-5)
    f_exp = [e * samples / sum(f_exp) for e in f_exp]  # float32 probabilities: exact totals
    return float(chisquare(f_obs, f_exp).pvalue)


def sampled_proposers(target: torch.nn.Module) -> dict[str, Proposer]:
    context = tiny_context(target, vocab_size=SMALL_VOCAB)
    return {
        "iid_sampled_tree": IidTreeProposer(tiny_draft_model(target)),
        "draft_model_tree": build(
            proposer_registry,
            {"name": "draft_model", "tree": True, "k": 2, "tree_width": 3, "tree_budget": 16},
            context=context,
        ),
    }


@pytest.mark.parametrize("proposer_name", ["iid_sampled_tree", "draft_model_tree"])
def test_tree_sampling_has_the_standard_distribution(small_target, proposer_name):
    """With max_new_tokens=3 the first round verifies the root siblings (the tree cut to
    depth 1, as the decode loop does near max_new_tokens): the 2nd and 3rd tokens are an
    accepted sibling and its bonus token, or a correction and the next round's token.
    Their joint frequencies over many seeds must fit the exact standard probabilities.
    (Sampled siblings stand for the i.i.d. rule, the draft model's deterministic top-k
    tree for the point-mass rule, which ngram trees share.)"""
    samples = 800
    sampling = SamplingConfig(temperature=1.0, top_k=8)
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, SMALL_VOCAB, (16,), generator=generator).tolist()
    proposer = sampled_proposers(small_target)[proposer_name]
    verifier = TreeVerifier(TreeVerifier.Config())
    target = ModelSession(small_target)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(samples):
        output = decode(target, prompt, StopConditions(3), replace(sampling, seed=seed), proposer, verifier)
        assert output.stats.draft_sizes[0] == 3  # three root siblings verified
        counts[tuple(output.tokens[1:3])] += 1
        accepted += output.stats.accepted
    assert accepted > samples // 5, "siblings were hardly ever accepted: the test exercised little"
    expected = exact_second_and_third_token_probs(small_target, prompt, sampling)
    p_value = chi_square_p_value(counts, expected, samples)
    assert p_value > 1e-3, p_value


def test_best_paths_give_siblings_consecutive_ranks_in_descending_order():
    """A later draw measured (by noise) above an earlier one waits for it, and is valued
    no higher, so the list stays in descending order and every sibling set is 0..r."""
    stats = AcceptanceStats.measured()
    for key, rate in {(0, 0): 0.5, (0, 1): 0.05, (0, 2): 0.3}.items():
        stats.tried[key] = 20
        stats.accepted[key] = round(rate * 20)
    paths = best_paths(stats, 3)
    assert [path for path, _ in paths] == [(0,), (1,), (2,)]
    assert [p for _, p in paths] == pytest.approx([0.5, 0.05, 0.05])


def test_static_tree_statistics_shrink_a_deep_level_toward_the_level_above():
    """0 of 9 tries at depth 1 does not zero its rate: 8 pseudo-observations at depth 0's rate."""
    budget = TreeBudget(lambda: CostCurve({1: 1.0, 64: 1.0}), max_nodes=4)
    budget.stats.tried.update({(0, 0): 30, (1, 0): 9})
    budget.stats.accepted.update({(0, 0): 9})
    assert budget.stats.rate((0, 0)) == pytest.approx(0.3)
    assert budget.stats.rate((1, 0)) == pytest.approx(8 * 0.3 / 17)
    assert budget.stats.rate((2, 0)) == pytest.approx(8 * 0.3 / 17)  # untried: the level above's rate
    assert budget.stats.rate((0, 1)) == 0.0  # depth 0 is measured alone
    assert [path for path, _ in best_paths(budget.stats, 10)] == [(0,), (0, 0)]  # no deeper than ever tried
