"""Every (proposer, lossless verifier) pair reproduces standard greedy decoding exactly."""

from __future__ import annotations

import pytest

from decoders.engine.registry import proposer_registry, verifier_registry
from tests.conftest import random_prompts


def lossless_verifiers() -> list[str]:
    return [v for v in verifier_registry.names() if verifier_registry.get(v).lossless]


def pipeline_or_skip(base, proposer, verifier):
    try:
        return base.with_components(proposer, verifier)
    except FileNotFoundError as missing:  # needs a trained artifact: its own tests cover it
        pytest.skip(str(missing))


@pytest.mark.parametrize("verifier", lossless_verifiers())
@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_greedy_output_equals_standard(trained_pipeline, proposer, verifier):
    tiny_pipeline = trained_pipeline  # heads trained for the tiny model: no proposer is skipped
    pipeline = pipeline_or_skip(tiny_pipeline, proposer, verifier)
    total_accepted = 0
    for k in (1, 4):
        pipeline.proposer.config.k = k
        for prompt in random_prompts(5, seed=k):
            for max_new in (1, 6, 24):
                expected = tiny_pipeline.generate(prompt, max_new).tokens
                result = pipeline.generate(prompt, max_new)
                assert result.tokens == expected, (proposer, verifier, k, prompt, max_new)
                assert result.stats.new_tokens == len(expected) <= max_new
                total_accepted += result.stats.accepted
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
    full = pipeline_or_skip(tiny_pipeline, {"name": proposer, "k": 4}, "greedy")
    cautious = tiny_pipeline.with_components({"name": proposer, "k": 4, "min_confidence": 0.5}, "greedy")
    never = tiny_pipeline.with_components({"name": proposer, "k": 4, "min_confidence": 1.01}, "greedy")
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
