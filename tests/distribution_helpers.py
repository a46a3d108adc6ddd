"""A chi-square check that a sampled pipeline's first two tokens follow the target's
own two-token distribution, shared by the tests of the drafters that learn from the
target (copy heads, EAGLE)."""

from __future__ import annotations

from collections import Counter

from scipy.stats import chisquare

from specdec.decoders import Pipeline
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs
from specdec.decoders.models.session import ModelSession


def assert_first_two_tokens_follow_the_target(
    base: Pipeline, pipeline: Pipeline, prompt: list[int], sampling: SamplingConfig, runs: int, what: str
) -> None:
    """``runs`` seeded generations of 3 tokens: the pairs of first tokens are distributed
    as p(t1) p(t2 | t1) under ``sampling`` (chi-square p > 1e-3), and the drafts were
    accepted often enough (> 20 tokens) for the test to mean something."""
    samples, accepted = Counter(), 0
    for seed in range(runs):
        result = pipeline.generate(prompt, 3, seed=seed)
        samples[tuple(result.tokens[:2])] += 1
        accepted += result.stats.accepted
    assert accepted > 20, f"{what} were hardly ever accepted: the test would be weak"

    session = ModelSession(base.model)
    first_probs = processed_probs(session.forward(prompt)[-1], sampling)  # (vocab,)
    expected: dict[tuple[int, int], float] = {}
    for t1 in first_probs.nonzero().flatten().tolist():
        session.truncate(len(prompt))
        second_probs = processed_probs(session.forward([t1])[-1], sampling)  # (vocab,)
        for t2 in second_probs.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(first_probs[t1] * second_probs[t2])
    assert set(samples) <= set(expected)
    cells = sorted(expected)
    total = sum(samples.values())
    observed = [samples[c] for c in cells]
    predicted = [expected[c] * total for c in cells]
    scale = total / sum(predicted)
    assert chisquare(observed, [p * scale for p in predicted]).pvalue > 1e-3


def assert_greedy_identical(
    base: Pipeline, pipeline: Pipeline, prompts: list, lengths: tuple[int, ...], what: str
) -> None:
    """Each prompt, at each ``max_new_tokens``, decodes to standard greedy decoding's tokens,
    and some draft token was accepted (else the check exercised nothing)."""
    accepted = 0
    for prompt in prompts:
        for max_new in lengths:
            expected = base.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (prompt, max_new)
            accepted += result.stats.accepted
    assert accepted > 0, f"no {what} token was ever accepted: the test exercised nothing"
