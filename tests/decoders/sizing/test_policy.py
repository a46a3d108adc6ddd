"""The sizing policy is the one place a draft's size is decided: the pipeline injects it,
every proposer takes its sizer from it, and a policy given to a pipeline changes how big
every proposer's drafts are."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.registry import proposer_registry
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.dynamic_tree import TreeOptions, tree_shape
from specdec.decoders.sizing.policy import SizingPolicy
from tests.conftest import random_prompts

REPO_ROOT = Path(__file__).resolve().parents[3]


class RecordingPolicy(SizingPolicy):
    """The default policy, noting every sizer it hands out."""

    def __init__(self, cost_curve) -> None:
        super().__init__(cost_curve)
        self.handed: list[tuple[str, object]] = []

    def _note(self, kind: str, sizer):
        self.handed.append((kind, sizer))
        return sizer

    def chain(self, *args, **kwargs):
        return self._note("chain", super().chain(*args, **kwargs))

    def dynamic_tree(self, *args, **kwargs):
        return self._note("dynamic_tree", super().dynamic_tree(*args, **kwargs))

    def static_tree(self, *args, **kwargs):
        return self._note("static_tree", super().static_tree(*args, **kwargs))

    def ranked(self, *args, **kwargs):
        return self._note("ranked", super().ranked(*args, **kwargs))

    def round_gate(self, *args, **kwargs):
        return self._note("round_gate", super().round_gate(*args, **kwargs))


FLAT = CostCurve({1: 1.0, 256: 1.0})
STEEP = CostCurve({1: 1.0, 2: 100.0, 256: 25500.0})  # no node is worth its width


@pytest.mark.parametrize(
    "proposer, kinds",
    [
        ("ngram", ["chain"]),
        ("suffix", ["ranked"]),
        ({"name": "early_exit", "exit_layer": 1}, ["chain"]),
        ("draft_model", ["dynamic_tree"]),
        ("copy_heads", ["dynamic_tree", "static_tree"]),  # its tree, and its shape when sampling
        ({"name": "medusa", "tree": None, "tree_budget": None}, ["chain"]),
        ({"name": "medusa", "tree": [[0], [1], [0, 0]], "tree_budget": "auto"}, ["static_tree"]),
        ({"name": "eagle", "tree": True}, ["dynamic_tree"]),
        ({"name": "eagle", "tree": False}, ["chain"]),
        ("merge", ["ranked", "ranked", "dynamic_tree", "static_tree"]),  # its joined tree, and its members
    ],
)
def test_every_proposer_takes_its_sizer_from_the_pipelines_policy(
    proposer, kinds, tiny_model, tiny_config, trained_artifacts
):
    model, tokenizer = tiny_model
    policy = RecordingPolicy(lambda: FLAT)
    pipeline = Pipeline(
        model, tokenizer, proposer, model_config=tiny_config, artifacts_dir=trained_artifacts, sizing=policy
    )
    assert pipeline.sizing is policy and pipeline.context.sizing is policy
    assert sorted(kind for kind, _ in policy.handed) == sorted(kinds)
    held = {id(value) for value in vars(pipeline.proposer).values()}
    for member in getattr(pipeline.proposer, "members", []):
        held |= {id(value) for value in vars(member).values()}
    assert all(id(sizer) in held for _, sizer in policy.handed)  # what it drafts by


def test_the_round_gate_comes_from_the_policy(tiny_model, tiny_config):
    model, tokenizer = tiny_model
    policy = RecordingPolicy(lambda: FLAT)
    pipeline = Pipeline(model, tokenizer, "ngram", model_config=tiny_config, round_gate=True, sizing=policy)
    assert [kind for kind, _ in policy.handed] == ["chain", "round_gate"]
    assert pipeline.gate is policy.handed[-1][1]
    assert pipeline.with_components("suffix", None).sizing is policy  # kept by its other pipelines


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_a_policy_given_to_the_pipeline_sizes_its_drafts(proposer, tiny_model, tiny_config):
    """The same proposer over the same target drafts all it has under a policy that finds a
    pass's width free, and (probes aside) nothing under one where no node pays for it."""
    model, tokenizer = tiny_model
    proposed = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        pipeline = Pipeline(
            model, tokenizer, proposer, "greedy", model_config=tiny_config, max_new_tokens=48,
            sizing=SizingPolicy(lambda curve=curve: curve),
        )  # fmt: skip
        proposed[name] = sum(pipeline.generate(prompt).stats.proposed for prompt in random_prompts(3, seed=4))
    assert proposed["flat"] > 20
    assert proposed["steep"] <= proposed["flat"] / 4


def test_proposers_size_nothing_themselves():
    """No proposer builds a sizer or runs the size search: from the sizing layer they import
    the policy's module at most (and use it for its situation keys)."""
    import ast

    offenders = []
    for path in sorted((REPO_ROOT / "proposers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec.decoders.sizing"):
                if node.module != "specdec.decoders.sizing.policy":
                    offenders.append(f"{path.relative_to(REPO_ROOT)}: from {node.module}")
    assert not offenders, offenders


def test_a_batchs_drafts_are_chosen_together_by_the_whole_pass():
    """SizingPolicy.joint: over every request's nodes, ranked by value (a child's capped by
    its parent's), the pass keeps the best prefix by its tokens per second. Under a T(n)
    flat to 4 rows then steep, two requests' pending rows leave two free rows: they go to
    the two most valuable nodes of the batch, one per request here, not to the first
    request's chain."""
    curve = CostCurve({1: 1.0, 4: 1.0, 5: 3.0, 64: 121.0})
    policy = SizingPolicy(lambda: curve)
    chain = [-1, 0, 1]
    assert policy.joint([(chain, [0.9, 0.8, 0.7]), ([-1, 0], [0.95, 0.2])]) == [[0], [0]]
    # a child is worth no more than its parent: node 1 (0.99, under a root of 0.3) ranks
    # after the second root's branch, and no node is kept without its parent
    assert policy.joint([([-1, 0, -1], [0.3, 0.99, 0.5])]) == [[0, 1, 2]]
    assert policy.joint([([-1, 0, -1, 2], [0.3, 0.99, 0.5, 0.45])]) == [[0, 2, 3]]
    # a draft without values is kept whole and fills the flat part: nothing else pays
    assert policy.joint([([-1, 0], None), (chain, [0.9, 0.8, 0.7])]) == [[0, 1], []]
    # the batch's own curve where the policy has one
    steep = CostCurve({1: 1.0, 64: 64.0})
    batched = SizingPolicy(lambda: curve, batch_curve=lambda requests: steep)
    assert batched.joint([(chain, [0.9, 0.8, 0.7]), ([-1, 0], [0.95, 0.2])]) == [[], []]


@pytest.mark.parametrize("proposer", ["draft_model", "eagle", "medusa", "copy_heads"])
def test_tree_options_are_declared_once(proposer):
    """Every tree-drafting proposer takes the same tree options, of one type, from one
    declaration (``TreeOptions``); a static tree is medusa's alone, refused elsewhere in one line."""
    config = proposer_registry.get(proposer).Config
    assert issubclass(config, TreeOptions)
    types = {f.name: f.type for f in dataclasses.fields(config) if f.name.startswith("tree")}
    assert types == {f.name: f.type for f in dataclasses.fields(TreeOptions)}
    static = proposer in ("medusa", "copy_heads")
    assert tree_shape(True, proposer, static) == tree_shape("dynamic", proposer, static) == "dynamic"
    assert tree_shape(False, proposer, static) is None and tree_shape(None, proposer, static) is None
    if static:
        assert tree_shape([[0], [1]], proposer, static) == [[0], [1]]
    else:
        with pytest.raises(
            ValueError, match=r"proposer.tree=\[\[0\]\]: proposer .* takes null \(a chain\) or dynamic$"
        ):
            tree_shape([[0]], proposer, static)
