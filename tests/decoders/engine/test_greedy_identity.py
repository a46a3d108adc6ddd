"""Every (proposer, lossless verifier) pair reproduces standard greedy decoding exactly."""

from __future__ import annotations

import pytest

from specdec.decoders.engine.registry import proposer_registry
from tests.conftest import (
    CONSTRAINT_ONLY_PROPOSERS,
    TEXT_PROPOSERS,
    lossless_verifiers,
    pipeline_or_skip,
    random_prompts,
)


@pytest.mark.parametrize("verifier", lossless_verifiers())
@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_greedy_output_equals_standard(drafting_pays, trained_pipeline, proposer, verifier):
    tiny_pipeline = (
        trained_pipeline  # heads trained for the tiny model: no proposer is skipped; flat T(n): they draft
    )
    pipeline = pipeline_or_skip(tiny_pipeline, proposer, verifier)
    total_accepted = total_proposed = 0
    for k in (1, 4):
        pipeline.proposer.config.k = k
        for prompt in random_prompts(5, seed=k):
            for max_new in (1, 6, 24):
                expected = tiny_pipeline.generate(prompt, max_new).tokens
                result = pipeline.generate(prompt, max_new)
                assert result.tokens == expected, (proposer, verifier, k, prompt, max_new)
                assert result.stats.new_tokens == len(expected) <= max_new
                total_accepted += result.stats.accepted
                total_proposed += result.stats.proposed
    if proposer in TEXT_PROPOSERS:  # (tests/conftest.py) never accepted on a random model
        assert total_proposed > 0, "nothing was drafted: the test exercised nothing"
    else:
        assert total_accepted > 0, "no draft token was ever accepted: the test exercised nothing"


@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_eos_inside_a_draft_stops_generation(trained_pipeline, proposer):
    """Make a token the model produces mid-sequence an EOS: output stops right there,
    even when the EOS arrives inside an accepted draft."""
    tiny_pipeline = trained_pipeline
    pipeline = pipeline_or_skip(tiny_pipeline, proposer, "greedy")
    for prompt in random_prompts(6, seed=11):
        free = tiny_pipeline.generate(prompt, 30).tokens
        eos = free[len(free) // 2]
        expected = free[: free.index(eos) + 1]
        tiny_pipeline.model.generation_config.eos_token_id = eos
        try:
            assert tiny_pipeline.generate(prompt, 30).tokens == expected
            assert pipeline.generate(prompt, 30).tokens == expected
        finally:
            tiny_pipeline.model.generation_config.eos_token_id = 257


@pytest.mark.parametrize("proposer", ["draft_model", "early_exit"])
def test_confidence_stop_keeps_output_and_shortens_drafts(tiny_pipeline, proposer):
    """min_confidence ends a draft at a doubted token: same output, shorter drafts;
    at 1.01 nothing is ever confident enough, so every round is a plain step."""
    chain = {"name": proposer, "k": 4} | ({"tree": False} if proposer == "draft_model" else {})
    full = pipeline_or_skip(tiny_pipeline, chain, "greedy")
    cautious = tiny_pipeline.with_components({**chain, "min_confidence": 0.5}, "greedy")
    never = tiny_pipeline.with_components({**chain, "min_confidence": 1.01}, "greedy")
    proposed = {"full": 0, "cautious": 0}
    for prompt in random_prompts(4, seed=5):
        expected = tiny_pipeline.generate(prompt, 20).tokens
        for name, pipeline in (("full", full), ("cautious", cautious)):
            result = pipeline.generate(prompt, 20)
            assert result.tokens == expected
            proposed[name] += result.stats.proposed
        result = never.generate(prompt, 20)
        assert result.tokens == expected and result.stats.proposed == 0
        assert result.stats.target_passes == len(expected) - 1  # the first token comes from the prefill
    assert proposed["cautious"] < proposed["full"]


#: Each built-in proposer's draft shapes (chains, static and dynamic trees, branches);
#: a proposer not listed here (a plugin) runs in its default configuration.
DRAFT_SHAPES: dict[str, list[dict]] = {
    "ngram": [{}, {"branches": 2}],
    "suffix": [{}],
    "draft_model": [{}, {"tree": False, "k": 4}, {"tree": True, "k": 3, "tree_budget": 8}],
    "eagle": [{}, {"tree": True}],
    "early_exit": [{}, {"kv_reuse": False}],
    "medusa": [{}, {"tree": "auto"}, {"tree": "dynamic"}],
    "copy_heads": [{}, {"tree": None, "tree_budget": None}],
    "merge": [{}],
    "grammar": [{}],
    "span": [
        {},
        {"endings": 0, "min_chars": 1, "adaptive": False},
    ],  # drafts only under a constraint: tests/decoders/engine/test_constraint.py
}


def shape_cases(constrained: bool = False) -> list[tuple[dict, str]]:
    """Every (proposer in each draft shape, lossless verifier); ``constrained``: also the
    proposers that draft only under a constraint."""
    return [
        ({"name": proposer, **options}, verifier)
        for proposer in proposer_registry.names()
        if constrained or proposer not in CONSTRAINT_ONLY_PROPOSERS
        for options in DRAFT_SHAPES.get(proposer, [{}])
        for verifier in lossless_verifiers()
    ]


def shape_id(case: tuple[dict, str]) -> str:
    spec, verifier = case
    options = ",".join(f"{key}={value}" for key, value in spec.items() if key != "name")
    return f"{spec['name']}[{options}]+{verifier}"


def test_every_builtin_proposer_has_its_draft_shapes_listed():
    from specdec.decoders.engine.registry import BUILTIN_PROPOSERS

    assert set(BUILTIN_PROPOSERS) == set(DRAFT_SHAPES)


@pytest.mark.parametrize("case", shape_cases(), ids=[shape_id(c) for c in shape_cases()])
def test_every_draft_shape_of_every_pair_reproduces_standard_greedy(drafting_pays, trained_pipeline, case):
    """Float64 tiny target, trained heads: each (proposer in each of its draft shapes,
    lossless verifier) pair emits standard greedy decoding's tokens exactly, and drafts
    (under a flat T(n), so adaptive proposers keep drafting)."""
    spec, verifier = case
    pipeline = pipeline_or_skip(trained_pipeline, spec, verifier)
    proposed = 0
    for prompt in random_prompts(3, seed=21):
        for max_new in (1, 16):
            expected = trained_pipeline.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (spec, verifier, prompt, max_new)
            proposed += result.stats.proposed
    assert proposed > 0, "nothing was drafted: the pair was not exercised"
