"""Speculative sampling (verifiers/rejection.py) is lossless: proof by exact
enumeration, agreement of the code with the math, and end-to-end statistics.

What is exactly checkable. One round over a chain of n draft tokens emits 1 to
n + 1 tokens. To compare it with the target we complete every emission to n + 1
tokens with the target's own conditionals, which is what the next round does
(by induction it is lossless) and what standard decoding does. The claim is then

    P(round, then target, emits s_1..s_{n+1}) = p_1(s_1) p_2(s_2 | s_1) ... p_{n+1}(s_{n+1} | s_1..s_n)

for every sequence, where p_{i+1}(. | s_1..s_i) is the target's processed
distribution after the first i tokens. The target's conditionals (and the
draft's, q_{i+1}(. | x_1..x_i)) are therefore tables keyed by the prefix: at
depth 2 the target's distribution depends on which first token was drafted.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.verifiers.rejection as rejection
from specdec.decoders import Pipeline
from specdec.decoders.engine.draft import Draft
from specdec.decoders.engine.registry import proposer_registry
from specdec.decoders.engine.sampling import NonFiniteLogitsError, SamplingConfig, processed_probs, sample
from specdec.decoders.evaluation.audit import sample_outcomes
from specdec.decoders.evaluation.audit_statistics import (
    combined_p_value,
    exact_distribution,
    goodness_of_fit,
    sequential_goodness_of_fit,
)
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.verifiers.greedy import greedy_walk
from specdec.verifiers.rejection import RejectionVerifier, point_mass, residual_distribution
from tests.conftest import TEST_DEVICE, pipeline_or_skip, spy_drafts

Prefix = tuple[int, ...]
SAMPLED = SamplingConfig(temperature=1.0)

# ------------------------------------------------------------- exact enumeration


def emitted_distribution(target: dict[Prefix, torch.Tensor], draft: dict[Prefix, object], depth: int) -> dict:
    """Exact distribution of the tokens one round emits, by enumerating the branches
    of speculative_sample_chain's rule (in float64):

    target[prefix]: p after the accepted prefix; draft[prefix]: either q (a
    tensor: the draft token is drawn from it) or a token id (a deterministic
    draft, a point mass). Draft token x is accepted with min(1, p(x) / q(x)); the
    first rejection emits a token from residual_distribution(p, q); a fully
    accepted chain emits a bonus token from p.
    """
    emitted: dict[Prefix, float] = {}

    def emit(prefix: Prefix, probs: torch.Tensor, weight: float) -> None:
        for token in probs.nonzero().flatten().tolist():
            key = prefix + (token,)
            emitted[key] = emitted.get(key, 0.0) + weight * float(probs[token])

    def walk(prefix: Prefix, weight: float) -> None:
        target_probs = target[prefix]
        if len(prefix) == depth:
            emit(prefix, target_probs, weight)  # bonus token
            return
        proposal = draft[prefix]
        if isinstance(proposal, int):
            draft_probs = point_mass(proposal, target_probs)
            choices = [(proposal, 1.0)]
        else:
            draft_probs = proposal
            choices = [(x, float(draft_probs[x])) for x in draft_probs.nonzero().flatten().tolist()]
        for token, drawn in choices:
            accept = min(1.0, float(target_probs[token]) / float(draft_probs[token]))
            if accept > 0:
                walk(prefix + (token,), weight * drawn * accept)
            if accept < 1:
                emit(prefix, residual_distribution(target_probs, draft_probs), weight * drawn * (1 - accept))

    walk((), 1.0)
    return emitted


def continued_by_target(
    emitted: dict[Prefix, float], target: dict[Prefix, torch.Tensor], length: int
) -> dict:
    """Each emitted sequence completed to ``length`` tokens with the target's conditionals."""
    full: dict[Prefix, float] = {}
    stack = list(emitted.items())
    while stack:
        prefix, weight = stack.pop()
        if len(prefix) == length:
            full[prefix] = full.get(prefix, 0.0) + weight
            continue
        probs = target[prefix]
        stack.extend((prefix + (t,), weight * float(probs[t])) for t in probs.nonzero().flatten().tolist())
    return full


def assert_lossless(target: dict, draft: dict, depth: int) -> None:
    emitted = emitted_distribution(target, draft, depth)
    assert math.isclose(sum(emitted.values()), 1.0, abs_tol=1e-12)
    produced = continued_by_target(emitted, target, depth + 1)
    expected = continued_by_target({(): 1.0}, target, depth + 1)
    for sequence in produced.keys() | expected.keys():
        assert produced.get(sequence, 0.0) == pytest.approx(expected.get(sequence, 0.0), abs=1e-12), sequence
    first_token = Counter()
    for sequence, weight in emitted.items():
        first_token[sequence[0]] += weight
    for token, prob in enumerate(target[()].tolist()):  # the marginal of the first token is p_1
        assert first_token.get(token, 0.0) == pytest.approx(prob, abs=1e-12)


def prefixes(vocab: int, max_len: int) -> list[Prefix]:
    return [p for n in range(max_len + 1) for p in itertools.product(range(vocab), repeat=n)]


@st.composite
def distributions(draw, vocab: int) -> torch.Tensor:
    """Random, one-hot, uniform, or sparse (zeros) float64 distributions over ``vocab``."""
    kind = draw(st.sampled_from(["random", "one_hot", "uniform", "sparse"]))
    if kind == "one_hot":
        return point_mass(draw(st.integers(0, vocab - 1)), torch.zeros(vocab, dtype=torch.float64))
    if kind == "uniform":
        return torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    weight = st.floats(0.01, 1.0) if kind == "random" else st.one_of(st.just(0.0), st.floats(0.01, 1.0))
    values = torch.tensor(draw(st.lists(weight, min_size=vocab, max_size=vocab)), dtype=torch.float64)
    if values.sum() == 0:
        values[draw(st.integers(0, vocab - 1))] = 1.0
    return values / values.sum()


@st.composite
def chain_cases(draw, depth: int) -> tuple[dict, dict]:
    """Target tables for every prefix up to ``depth`` and draft tables below it."""
    vocab = draw(st.integers(2, 4))
    target = {p: draw(distributions(vocab)) for p in prefixes(vocab, depth)}
    deterministic = draw(st.booleans())
    draft: dict[Prefix, object] = {}
    for p in prefixes(vocab, depth - 1):
        if deterministic:
            draft[p] = draw(st.integers(0, vocab - 1))
        elif draw(st.integers(0, 5)) == 0:
            draft[p] = target[p].clone()  # q == p: everything is accepted
        else:
            draft[p] = draw(distributions(vocab))
    return target, draft


@settings(max_examples=200, deadline=None)
@given(case=chain_cases(depth=1))
def test_one_token_chain_is_exactly_lossless(case):
    target, draft = case
    assert_lossless(target, draft, depth=1)


@settings(max_examples=120, deadline=None)
@given(case=chain_cases(depth=2))
def test_two_token_chain_is_exactly_lossless(case):
    target, draft = case
    assert_lossless(target, draft, depth=2)


def tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    "target_row, draft_row",
    [
        (tensor(0, 1, 0), tensor(1, 0, 0)),  # disjoint one-hots: always rejected
        (tensor(0.5, 0.5, 0), tensor(0, 0.2, 0.8)),  # zeros in p and in q
        (tensor(0.2, 0.3, 0.5), tensor(0.2, 0.3, 0.5)),  # q == p: never rejected
        (tensor(1, 0, 0), tensor(1 / 3, 1 / 3, 1 / 3)),
        (tensor(0.6, 0.4, 0), 2),  # deterministic draft of a token the target never emits
        (tensor(0, 1, 0), 1),  # deterministic draft of the target's only token
        (tensor(0.1, 0.7, 0.2), 1),
    ],
)
def test_edge_cases_are_exactly_lossless(target_row, draft_row):
    vocab = len(target_row)
    torch.manual_seed(0)
    target = {p: torch.rand(vocab, dtype=torch.float64).softmax(-1) for p in prefixes(vocab, 2)}
    draft: dict[Prefix, object] = {
        p: torch.rand(vocab, dtype=torch.float64).softmax(-1) for p in prefixes(vocab, 1)
    }
    target[()] = target_row
    draft[()] = draft_row
    for token in range(vocab):  # the same edge case at depth 2, after every first token
        target[(token,)] = target_row
        draft[(token,)] = draft_row
    assert_lossless(target, draft, depth=2)


# ----------------------------------------------- the code agrees with the math


def as_logits(probs: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (zeros stay exactly zero in float32)."""
    return probs.log().clamp(min=-1e4)


def crafted_case(vocab: int, deterministic: bool, seed: int = 3) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(seed)

    def row() -> torch.Tensor:
        logits = torch.randn(vocab, generator=generator, dtype=torch.float64) * 1.5
        logits[torch.randint(vocab, (1,), generator=generator)] = -math.inf  # a zero in every row
        return logits.softmax(-1)

    target = {p: row() for p in prefixes(vocab, 2)}
    draft: dict[Prefix, object] = {}
    for p in prefixes(vocab, 1):
        draft[p] = int(torch.randint(vocab, (1,), generator=generator)) if deterministic else row()
    return target, draft


def run_verifier(target: dict, draft: dict, seeds: range, verifier=None) -> Counter:
    """Draft a 2-token chain (from q, or the deterministic table), verify it with
    RejectionVerifier on the target's logits, count the emitted sequences."""
    verifier = verifier or RejectionVerifier(RejectionVerifier.Config())
    counts: Counter = Counter()
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        rows = []
        for _ in range(2):
            proposal = draft[tuple(tokens)]
            if isinstance(proposal, int):
                tokens.append(proposal)
            else:
                tokens.append(int(sample(proposal.float(), generator)))
                rows.append(proposal.float())
        draft_probs = torch.stack(rows) if rows else None  # (2, vocab) float32 or None
        target_logits = torch.stack(
            [as_logits(target[tuple(tokens[:i])]) for i in range(3)]
        ).float()  # (3, vocab)
        acceptance = verifier.verify(Draft.chain(tokens, draft_probs), target_logits, SAMPLED, generator)
        counts[tuple(acceptance.tokens)] += 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True])
def test_verifier_frequencies_match_the_exact_distribution(deterministic):
    target, draft = crafted_case(vocab=4, deterministic=deterministic)
    expected = emitted_distribution(target, draft, depth=2)
    observed = run_verifier(target, draft, range(4000))
    test = goodness_of_fit(observed, expected)
    assert test.impossible == 0
    assert test.dof >= (3 if deterministic else 10)  # a deterministic chain has few outcomes
    assert test.p_value > 0.001, (test, observed.most_common(8))


def test_the_frequency_test_catches_a_wrong_residual(monkeypatch):
    """Power check: correcting from p instead of norm(max(0, p - q)) (a classic bug)
    is detected by the same test."""
    target, draft = crafted_case(vocab=4, deterministic=False)
    expected = emitted_distribution(target, draft, depth=2)
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    observed = run_verifier(target, draft, range(4000))
    assert goodness_of_fit(observed, expected).p_value < 1e-6


# ------------------------------------------------ bugs seen in other implementations


def random_chain(vocab: int, n: int, generator: torch.Generator, sampled: bool) -> tuple[Draft, torch.Tensor]:
    """A chain draft of n tokens (sampled from random q, or deterministic) and (n + 1, vocab) target logits."""
    target_logits = torch.randn(n + 1, vocab, generator=generator) * 3  # (n + 1, vocab)
    if not sampled:
        return Draft.chain(torch.randint(vocab, (n,), generator=generator).tolist()), target_logits
    draft_probs = processed_probs(torch.randn(n, vocab, generator=generator) * 3, SAMPLED)  # (n, vocab)
    return Draft.chain(sample(draft_probs, generator).tolist(), draft_probs), target_logits


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize(
    "sampling",
    [SAMPLED, SamplingConfig(temperature=0.7, top_k=5, top_p=0.8), SamplingConfig(temperature=0.0)],
)
def test_verify_leaves_its_inputs_untouched(sampled, sampling):
    verifier = RejectionVerifier(RejectionVerifier.Config())
    generator = torch.Generator().manual_seed(0)
    outcomes = Counter()
    for _ in range(200):
        draft, target_logits = random_chain(vocab=6, n=3, generator=generator, sampled=sampled)
        logits_before = target_logits.clone()
        probs_before = None if draft.draft_probs is None else draft.draft_probs.clone()
        acceptance = verifier.verify(draft, target_logits, sampling, generator)
        assert torch.equal(target_logits, logits_before)
        if probs_before is not None:
            assert torch.equal(draft.draft_probs, probs_before)
        outcomes[acceptance.num_accepted] += 1
    assert len(outcomes) >= 2  # both rejections and acceptances were exercised


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0, top_k=1), SamplingConfig(temperature=1.3, top_p=1e-4)]
)
@pytest.mark.parametrize("sampled", [False, True])
def test_correction_and_bonus_tokens_use_the_sampling_settings(sampling, sampled):
    """With top_k=1 (or a tiny nucleus) the target is greedy, so every emitted token,
    accepted, correction or bonus, is the target's argmax at its position."""
    verifier = RejectionVerifier(RejectionVerifier.Config())
    generator = torch.Generator().manual_seed(1)
    corrections = bonuses = 0
    for _ in range(300):
        draft, target_logits = random_chain(vocab=5, n=2, generator=generator, sampled=sampled)
        acceptance = verifier.verify(draft, target_logits, sampling, generator)
        for position, token in enumerate(acceptance.tokens):
            assert token == int(target_logits[position].argmax())
        corrections += acceptance.num_accepted < len(draft)
        bonuses += acceptance.num_accepted == len(draft)
    assert corrections and bonuses


def test_correction_and_bonus_tokens_stay_in_the_nucleus():
    sampling = SamplingConfig(temperature=1.0, top_p=0.5)
    verifier = RejectionVerifier(RejectionVerifier.Config())
    generator = torch.Generator().manual_seed(2)
    for _ in range(300):
        draft, target_logits = random_chain(vocab=8, n=2, generator=generator, sampled=False)
        nucleus = processed_probs(target_logits, sampling) > 0  # (3, vocab)
        acceptance = verifier.verify(draft, target_logits, sampling, generator)
        last = len(acceptance.tokens) - 1
        assert nucleus[last, acceptance.tokens[last]], "correction/bonus token outside the target's nucleus"


def test_probabilities_are_float32_whatever_the_logits_dtype():
    """bfloat16 logits are verified exactly as their float32 values: the same
    acceptance decisions and tokens, seed by seed."""
    verifier = RejectionVerifier(RejectionVerifier.Config())
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    make = torch.Generator().manual_seed(4)
    for seed in range(100):
        draft, target_logits = random_chain(vocab=7, n=3, generator=make, sampled=seed % 2 == 0)
        low = target_logits.to(torch.bfloat16)
        first = verifier.verify(draft, low, sampling, torch.Generator().manual_seed(seed))
        second = verifier.verify(draft, low.float(), sampling, torch.Generator().manual_seed(seed))
        assert first == second
    assert processed_probs(low, sampling).dtype == torch.float32


@pytest.mark.parametrize("sampled", [False, True])
def test_temperature_zero_rejection_is_greedy_verification(sampled):
    verifier = RejectionVerifier(RejectionVerifier.Config())
    generator = torch.Generator().manual_seed(5)
    accepted = 0
    for _ in range(300):
        draft, target_logits = random_chain(vocab=3, n=3, generator=generator, sampled=sampled)
        acceptance = verifier.verify(draft, target_logits, SamplingConfig(temperature=0.0), generator)
        assert acceptance == greedy_walk(draft, target_logits)
        accepted += acceptance.num_accepted
    assert accepted > 0


# ------------------------------------------------------------- through the pipeline


@pytest.fixture(scope="module")
def small_vocab() -> tuple[torch.nn.Module, ModelConfig]:
    """A float64 tiny model over 8 tokens (no tokenizer): its outputs are enumerable."""
    config = ModelConfig(name="tiny-random", vocab_size=8, dtype="float64", device=TEST_DEVICE)
    model, _ = load_model(config)
    return model, config


def small_pipeline(small_vocab, tmp_path, sampling: SamplingConfig) -> Pipeline:
    model, config = small_vocab
    return Pipeline(model, None, sampling=sampling, model_config=config, artifacts_dir=tmp_path)


REPETITIVE_PROMPT = [1, 5, 2, 7, 1, 5, 2, 7, 1, 5]  # prompt lookup finds drafts in it


@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_rejection_at_temperature_zero_reproduces_greedy_decoding(small_vocab, tmp_path, proposer):
    standard = small_pipeline(small_vocab, tmp_path, SamplingConfig(temperature=0.0))
    speculative = pipeline_or_skip(standard, proposer)
    accepted = 0
    for prompt in (REPETITIVE_PROMPT, [3, 3, 3, 3], [0, 6, 4]):
        result = speculative.generate(prompt, 20)
        assert result.tokens == standard.generate(prompt, 20).tokens
        accepted += result.stats.accepted
    assert accepted > 0


E2E_SAMPLING = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)


@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_first_tokens_have_standard_decodings_distribution(drafting_pays, small_vocab, tmp_path, proposer):
    """Chi-square of 300 speculative samples (one per seed) of the first 3 tokens
    against standard decoding's exact distribution, enumerated from the model."""
    standard = small_pipeline(small_vocab, tmp_path, E2E_SAMPLING)
    speculative = pipeline_or_skip(standard, proposer, sampling=E2E_SAMPLING)
    if hasattr(speculative.proposer.config, "k"):
        speculative.proposer.config.k = 2  # rounds draft at most 2 tokens here: don't pay for more
    expected = exact_distribution(standard.model, REPETITIVE_PROMPT, E2E_SAMPLING, 3)
    assert math.isclose(sum(expected.values()), 1.0, abs_tol=1e-6)  # float32 probabilities
    observed = sample_outcomes(speculative, REPETITIVE_PROMPT, 3, range(300))
    positions = sequential_goodness_of_fit(observed, expected)
    assert sum(test.impossible for test in positions) == 0
    assert min(test.dof for test in positions) >= 3
    assert combined_p_value(positions) > 0.001, positions
    stats = speculative.generate(REPETITIVE_PROMPT, 4, seed=0).stats
    assert stats.proposed > 0  # the proposer did draft within the compared tokens


@pytest.mark.parametrize("proposer", ["draft_model", "early_exit"])
def test_confidence_stopped_drafts_keep_the_distribution(small_vocab, tmp_path, proposer):
    """min_confidence ends drafts where the drafter's top probability is low; the stop
    depends on q only, never on the drawn token, so the output stays p (chi-square).
    The early exit's adaptive length is off: it would learn to draft nothing here."""
    standard = small_pipeline(small_vocab, tmp_path, E2E_SAMPLING)
    options = {"name": proposer, "k": 2, "min_confidence": 0.5} | (
        {"tree": False} if proposer == "draft_model" else {}
    )
    if proposer == "early_exit":
        options["adaptive"] = False
    speculative = standard.with_components(options, "rejection", E2E_SAMPLING)
    expected = exact_distribution(standard.model, REPETITIVE_PROMPT, E2E_SAMPLING, 3)
    observed = sample_outcomes(speculative, REPETITIVE_PROMPT, 3, range(300))
    positions = sequential_goodness_of_fit(observed, expected)
    assert sum(test.impossible for test in positions) == 0
    assert combined_p_value(positions) > 0.001, positions
    sizes = [len(d) for _, d in recorded_drafts(speculative, REPETITIVE_PROMPT, 12)]
    assert 0 < sum(sizes) < 2 * len(sizes), sizes  # some drafts were cut, some were not empty


# ---------------------------------------------------- proposers' draft distributions


def recorded_drafts(pipeline: Pipeline, prompt: list[int], max_new_tokens: int, seed: int = 0) -> list:
    """(tokens before the round, draft) for every round of one generation."""
    rounds = []
    spy_drafts(pipeline.proposer, lambda state, draft: rounds.append((list(state.tokens), draft)))
    pipeline.generate(prompt, max_new_tokens, seed=seed)
    return rounds


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_draft_model_probs_are_its_processed_distribution(tmp_path, dtype):
    """q must be the distribution the draft token was drawn from, processed with the
    target's temperature / top-k / top-p, in float32: not the raw softmax."""
    config = ModelConfig(name="tiny-random", vocab_size=32, dtype=dtype, device=TEST_DEVICE)
    model, _ = load_model(config)
    sampling = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    pipeline = Pipeline(
        model,
        None,
        {"name": "draft_model", "tree": False, "k": 4},
        "rejection",
        sampling,
        model_config=config,
        artifacts_dir=tmp_path,
    )
    draft_model = pipeline.proposer.model
    rounds = recorded_drafts(pipeline, REPETITIVE_PROMPT, 24)
    assert rounds
    for tokens, draft in rounds:
        assert draft.draft_probs is not None and draft.draft_probs.dtype == torch.float32
        context = torch.tensor([tokens + draft.tokens[:-1]])
        with torch.inference_mode():
            logits = draft_model(input_ids=context).logits[0, len(tokens) - 1 :]  # (k, vocab)
        expected = processed_probs(logits, sampling)
        tolerance = 1e-6 if dtype == "float64" else 0.05  # bf16: cached vs full pass rounding
        torch.testing.assert_close(draft.draft_probs, expected, atol=tolerance, rtol=0)
        assert bool((draft.draft_probs[torch.arange(len(draft)), draft.tokens] > 0).all())


@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_sampled_proposers_process_q_like_the_target(small_vocab, tmp_path, proposer):
    """Every sampled proposer's rows (``sampled`` as configured, by default) are float32
    distributions filtered by the same top-k as the target, and contain the token drawn
    from them."""
    sampling = SamplingConfig(temperature=0.9, top_k=3)
    pipeline = pipeline_or_skip(small_pipeline(small_vocab, tmp_path, sampling), proposer, sampling=sampling)
    if not pipeline.proposer.sampled:
        pytest.skip(f"{proposer} chooses its drafts deterministically in its default configuration")
    rounds = recorded_drafts(pipeline, REPETITIVE_PROMPT, 16)
    drafted = [draft for _, draft in rounds if len(draft)]
    assert drafted
    for draft in drafted:
        probs = draft.draft_probs  # (n, vocab)
        assert probs is not None and probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(draft)))
        assert bool(((probs > 0).sum(-1) <= 3).all()), "draft rows ignore sampling.top_k"
        assert bool((probs[torch.arange(len(draft)), draft.tokens] > 0).all())


# --------------------------------------------------------------- non-finite logits


def test_nan_target_logits_raise_naming_the_prefill(tmp_path):
    config = ModelConfig(name="tiny-random", vocab_size=8, dtype="float32", device=TEST_DEVICE)
    model, _ = load_model(config)
    model.model.lm_head.weight.data[3, 0] = math.nan
    pipeline = Pipeline(
        model, None, "ngram", "rejection", SAMPLED, model_config=config, artifacts_dir=tmp_path
    )
    with pytest.raises(NonFiniteLogitsError, match="prefill"):
        pipeline.generate(REPETITIVE_PROMPT, 4)


def test_inf_target_logits_raise_naming_the_verification_pass(small_vocab, tmp_path, monkeypatch):
    pipeline = pipeline_or_skip(small_pipeline(small_vocab, tmp_path, SAMPLED), "ngram")
    forward = pipeline.session.forward
    calls = []

    def overflowing(tokens, parents=None, **options):
        logits = forward(tokens, parents, **options)
        calls.append(len(tokens))
        return logits if len(calls) == 1 else logits.index_fill(-1, torch.tensor([2]), math.inf)

    monkeypatch.setattr(pipeline.session, "forward", overflowing)
    with pytest.raises(NonFiniteLogitsError, match="verification pass"):
        pipeline.generate(REPETITIVE_PROMPT, 4)


def test_nan_draft_logits_raise_naming_the_draft_model(tmp_path):
    config = ModelConfig(name="tiny-random", vocab_size=8, dtype="float64", device=TEST_DEVICE)
    model, _ = load_model(config)
    pipeline = Pipeline(
        model,
        None,
        {"name": "draft_model", "tree": False, "k": 4},
        "rejection",
        SAMPLED,
        model_config=config,
        artifacts_dir=tmp_path,
    )
    pipeline.proposer.model.lm_head.weight.data[:, 0] = math.nan
    with pytest.raises(NonFiniteLogitsError, match="draft model"):
        pipeline.generate(REPETITIVE_PROMPT, 4)
