"""processed_probs semantics (temperature, top-k, top-p), SamplingConfig validation,
and the non-finite logits guard."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.decoders.engine.sampling import (
    NonFiniteLogitsError,
    SamplingConfig,
    check_finite,
    next_token,
    processed_probs,
    sample,
)

LOGITS = torch.tensor([2.0, 0.5, 3.0, -1.0, 1.0, 0.0])  # order by value: 2, 0, 4, 1, 5, 3


def logits_strategy(min_vocab: int = 2, max_vocab: int = 12):
    """Distinct-ish finite logits (ties are allowed: hypothesis finds them)."""
    return st.lists(
        st.floats(min_value=-8, max_value=8, allow_nan=False, width=32),
        min_size=min_vocab,
        max_size=max_vocab,
    ).map(lambda values: torch.tensor(values, dtype=torch.float32))


def test_temperature_scales_logits_before_softmax():
    for temperature in (0.3, 1.0, 2.5):
        probs = processed_probs(LOGITS, SamplingConfig(temperature=temperature))
        torch.testing.assert_close(probs, (LOGITS / temperature).softmax(-1))


def test_temperature_zero_is_the_argmax_point_mass():
    probs = processed_probs(LOGITS, SamplingConfig(temperature=0.0))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_the_k_largest_renormalized():
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=3))
    kept = probs.nonzero().flatten().tolist()
    assert sorted(kept) == [0, 2, 4]
    torch.testing.assert_close(probs[kept], LOGITS[kept].softmax(-1))


def test_top_k_zero_or_at_least_vocab_is_off():
    full = processed_probs(LOGITS, SamplingConfig(temperature=1.0))
    for top_k in (0, len(LOGITS), len(LOGITS) + 5):
        torch.testing.assert_close(
            processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=top_k)), full
        )


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    probs = processed_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert probs.nonzero().flatten().tolist() == [1, 2, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    base = LOGITS.softmax(-1)  # sorted masses: .536 (2), .197 (0), .073 (4), .072 (1), ...
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    assert sorted(probs.nonzero().flatten().tolist()) == [0, 2]  # .536 < 0.7 <= .536 + .197
    torch.testing.assert_close(probs[[0, 2]], base[[0, 2]] / base[[0, 2]].sum())
    exact_boundary = float(base[2] + base[0])
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=exact_boundary * (1 - 1e-6)))
    assert sorted(probs.nonzero().flatten().tolist()) == [0, 2]


def test_tiny_top_p_keeps_only_the_argmax():
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=1e-6))
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_p_applies_to_the_top_k_distribution():
    """Order: temperature, then top-k, then top-p over the renormalized top-k mass."""
    # top-k=3 leaves masses .665 (2), .245 (0), .090 (4): 0.85 is reached by the first two.
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=3, top_p=0.85))
    assert sorted(probs.nonzero().flatten().tolist()) == [0, 2]
    # Over the full vocabulary the first two hold only .733 < 0.85: three tokens would stay.
    assert processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.85)).count_nonzero() == 3


@settings(max_examples=200, deadline=None)
@given(
    logits=logits_strategy(),
    temperature=st.floats(min_value=0.05, max_value=4.0),
    top_p=st.floats(min_value=1e-3, max_value=1.0),
)
def test_top_p_nucleus_properties(logits, temperature, top_p):
    probs = processed_probs(logits, SamplingConfig(temperature=temperature, top_p=top_p))
    base = (logits / temperature).softmax(-1)
    kept = probs > 0
    assert kept.any()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    if not kept.all():  # the nucleus holds the most likely tokens...
        assert base[kept].min() >= base[~kept].max()
    mass = float(base[kept].sum())
    smallest = float(base[kept].min())
    assert mass >= top_p - 1e-5  # ...reaches top_p...
    if kept.sum() > 1:
        assert mass - smallest < top_p + 1e-5  # ...and is the smallest such set
    torch.testing.assert_close(probs[kept], base[kept] / base[kept].sum())


@settings(max_examples=100, deadline=None)
@given(logits=logits_strategy(), top_k=st.integers(min_value=1, max_value=12))
def test_top_k_properties(logits, top_k):
    probs = processed_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k))
    kept = probs > 0
    assert kept.sum() >= min(top_k, len(logits))
    if not kept.all():
        assert logits[kept].min() > logits[~kept].max()
        assert int((logits > logits[~kept].max()).sum()) == int(kept.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_probs_are_float32_new_tensors_and_inputs_are_untouched(dtype, temperature):
    logits = LOGITS.to(dtype).reshape(2, 3)
    before = logits.clone()
    probs = processed_probs(logits, SamplingConfig(temperature=temperature, top_k=2, top_p=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (2, 3)
    assert torch.equal(logits, before)
    probs.zero_()
    assert torch.equal(logits, before)


def test_batched_rows_are_processed_independently():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 3])  # (3, vocab)
    config = SamplingConfig(temperature=0.8, top_k=4, top_p=0.8)
    batched = processed_probs(rows, config)
    for row, expected in zip(rows, batched):
        torch.testing.assert_close(processed_probs(row, config), expected)


def test_sample_never_draws_zero_probability_tokens():
    probs = processed_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    generator = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(5000, -1), generator)  # (5000,)
    assert set(draws.tolist()) == {0, 2}


def test_sample_draws_each_token_with_its_probability():
    """Inverse-CDF draws, rows unnormalised and batched: frequencies pass a chi-square
    test against the rows' shares, and zero-probability tokens (leading, inner and
    trailing) never come up."""
    from scipy.stats import chisquare

    rows = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [3.0, 0.0, 1.0, 0.0, 0.0, 0.0]])  # second sums to 4
    generator = torch.Generator().manual_seed(0)
    draws = sample(rows.repeat(20000, 1), generator).reshape(20000, 2)  # (draws, rows)
    for r, row in enumerate(rows):
        counts = torch.bincount(draws[:, r], minlength=len(row))
        support = row > 0
        assert counts[~support].sum() == 0
        expected = (row[support] / row.sum() * len(draws)).tolist()
        assert chisquare(counts[support].tolist(), expected).pvalue > 1e-3


def test_sample_keeps_the_leading_shape_and_is_reproducible():
    probs = processed_probs(
        torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(1)), SamplingConfig(1.0)
    )
    first = sample(probs, torch.Generator().manual_seed(7))
    assert first.shape == (3, 4) and first.dtype == torch.long
    assert torch.equal(first, sample(probs, torch.Generator().manual_seed(7)))
    assert sample(probs[0, 0], torch.Generator().manual_seed(7)).shape == ()


@pytest.mark.parametrize(
    "row", [[0.0, 0.0, 0.0], [0.5, -0.1, 0.6], [0.5, float("nan"), 0.5], [float("inf"), 0.0, 1.0]]
)
def test_sample_refuses_rows_that_are_not_distributions(row):
    with pytest.raises(ValueError, match="cannot sample"):
        sample(torch.tensor(row), torch.Generator().manual_seed(0))


def test_next_token_honours_the_sampling_settings():
    generator = torch.Generator().manual_seed(0)
    assert next_token(LOGITS, SamplingConfig(temperature=0.0), generator) == 2
    draws = {next_token(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7), generator) for _ in range(300)}
    assert draws == {0, 2}


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_p": -0.2}, "sampling.top_p"),
        ({"top_p": float("nan")}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
    ],
)
def test_invalid_sampling_values_are_refused_with_the_key_named(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_raise_naming_the_step(bad):
    logits = LOGITS.clone()
    logits[3] = bad
    with pytest.raises(NonFiniteLogitsError, match="draft model's forward pass"):
        check_finite(logits, "draft model's forward pass")
    check_finite(LOGITS, "anything")  # finite logits pass
