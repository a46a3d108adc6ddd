"""The audit's statistics: chi-square tests of sampled token sequences, and
standard decoding's exact distribution by enumeration.

With a vocabulary of at most ``audit.max_enumerable_vocab`` tokens, standard
decoding's distribution is computed exactly by enumerating prefixes
(:func:`exact_distribution`) and the pipeline's samples (one per seed) get a
chi-square goodness-of-fit test. Otherwise the pipeline's and standard decoding's
samples (disjoint seeds) get a two-sample chi-square test. Both tests follow the
chain rule: position i's test covers the next token after every sampled prefix of
length i, each over the most frequent tokens with the rare ones binned together;
from the second token on, the token's marginal distribution is tested too.
Conditional tests, and independent prompts, add up. The reported p-value is
Bonferroni's over these tests (smallest p-value times their number).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specdec.decoders.engine.sampling import SamplingConfig, check_finite, processed_probs

Outcome = tuple[int, ...]  # the first generated tokens of one sample (shorter if EOS came first)
TestKey = tuple[int, str]  # (position among the generated tokens, "conditional" or "marginal")
ENDED = -1  # the "token" at a position a sequence did not reach (it ended with EOS before)


@dataclass
class ChiSquare:
    """A chi-square statistic with its degrees of freedom; sums of independent tests add."""

    statistic: float = 0.0
    dof: int = 0
    impossible: int = 0  # samples of outcomes whose exact probability is 0

    def __add__(self, other: ChiSquare) -> ChiSquare:
        return ChiSquare(
            self.statistic + other.statistic, self.dof + other.dof, self.impossible + other.impossible
        )

    @property
    def p_value(self) -> float:
        """P(chi2_dof >= statistic); 0 if an impossible outcome was seen, 1 without dof."""
        if self.impossible:
            return 0.0
        if self.dof == 0:
            return 1.0
        dof = torch.tensor(self.dof / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(dof, torch.tensor(self.statistic / 2, dtype=torch.float64)))


def _chi_square(bins: list[tuple[float, float]]) -> tuple[float, int]:
    """Pearson's statistic over (observed, expected) bins, and bins - 1 dof."""
    statistic = sum((observed - expected) ** 2 / expected for observed, expected in bins if expected > 0)
    return statistic, max(len(bins) - 1, 0)


def goodness_of_fit(observed: Counter, expected_probs: dict, min_expected: float = 5.0) -> ChiSquare:
    """Chi-square test of ``observed`` counts against exact probabilities of the same keys.

    Keys expected fewer than ``min_expected`` times are binned together (the bin
    joins the smallest kept one if it is itself too small).
    """
    total = sum(observed.values())
    impossible = sum(count for key, count in observed.items() if expected_probs.get(key, 0.0) <= 0)
    bins: list[tuple[float, float]] = []
    rest_observed, rest_expected = 0, 0.0
    for key, prob in sorted(expected_probs.items(), key=lambda item: -item[1]):
        if total * prob >= min_expected:
            bins.append((observed.get(key, 0), total * prob))
        else:
            rest_observed += observed.get(key, 0)
            rest_expected += total * prob
    if rest_expected > 0:
        if rest_expected < min_expected and bins:
            kept_observed, kept_expected = bins.pop()
            rest_observed, rest_expected = rest_observed + kept_observed, rest_expected + kept_expected
        bins.append((rest_observed, rest_expected))
    statistic, dof = _chi_square(bins)
    return ChiSquare(statistic, dof, impossible)


def two_sample(first: Counter, second: Counter, min_count: int = 10) -> ChiSquare:
    """Chi-square test that two samples of keys come from one distribution.

    Keys seen fewer than ``min_count`` times in both samples together are binned
    together (joining the least frequent kept key if still too rare).
    """
    first_total, second_total = sum(first.values()), sum(second.values())
    pooled = first + second
    columns = [(first[key], second[key]) for key, count in pooled.most_common() if count >= min_count]
    rest = (first_total - sum(a for a, _ in columns), second_total - sum(b for _, b in columns))
    if sum(rest) > 0:
        if sum(rest) < min_count and columns:
            a, b = columns.pop()
            rest = (rest[0] + a, rest[1] + b)
        columns.append(rest)
    total = first_total + second_total
    bins: list[tuple[float, float]] = []
    for a, b in columns:
        bins.append((a, (a + b) * first_total / total))
        bins.append((b, (a + b) * second_total / total))
    statistic, _ = _chi_square(bins)
    return ChiSquare(statistic, max(len(columns) - 1, 0))


def next_token_counts(outcomes: Counter) -> dict[Outcome, Counter]:
    """For every prefix of the sampled outcomes, how often each next token followed it."""
    children: dict[Outcome, Counter] = {}
    for outcome, count in outcomes.items():
        for depth in range(len(outcome)):
            children.setdefault(outcome[:depth], Counter())[outcome[depth]] += count
    return children


def sequential_goodness_of_fit(observed: Counter, expected_probs: dict[Outcome, float]) -> list[ChiSquare]:
    """Goodness of fit of sampled token sequences by the chain rule, one test per position.

    Position i's test sums, over the sampled prefixes of length i, the test of the
    next token given that prefix. Under the null hypothesis these conditional
    statistics are asymptotically independent chi-squares, so they add; unlike
    one test over whole sequences, rare sequences do not all land in one bin.
    """
    marginal: dict[Outcome, float] = {}
    for outcome, prob in expected_probs.items():
        for depth in range(len(outcome) + 1):
            marginal[outcome[:depth]] = marginal.get(outcome[:depth], 0.0) + prob
    expected_children: dict[Outcome, dict[int, float]] = {}
    for prefix, prob in marginal.items():
        if prefix:
            expected_children.setdefault(prefix[:-1], {})[prefix[-1]] = prob
    positions = [ChiSquare() for _ in range(max(map(len, expected_probs), default=0))]
    for prefix, counts in next_token_counts(observed).items():
        if marginal.get(prefix, 0.0) <= 0:
            continue  # an impossible prefix: its parent's test already counted it
        conditional = {token: prob / marginal[prefix] for token, prob in expected_children[prefix].items()}
        positions[len(prefix)] += goodness_of_fit(counts, conditional)
    return positions


def sequential_two_sample(first: Counter, second: Counter) -> list[ChiSquare]:
    """Two-sample test of token sequences by the chain rule, one test per position
    (see :func:`sequential_goodness_of_fit`): the first token, then the next token
    after every prefix both samples reached."""
    first_children, second_children = next_token_counts(first), next_token_counts(second)
    positions = [ChiSquare() for _ in range(max(map(len, first | second), default=0))]
    for prefix in first_children.keys() & second_children.keys():
        positions[len(prefix)] += two_sample(first_children[prefix], second_children[prefix])
    return positions


def tokens_at(outcomes: dict[Outcome, float] | Counter, position: int) -> dict[int, float]:
    """Marginal counts (or probabilities) of the token at ``position``; sequences that
    ended before it count as ENDED."""
    marginal: dict[int, float] = {}
    for outcome, weight in outcomes.items():
        token = outcome[position] if position < len(outcome) else ENDED
        marginal[token] = marginal.get(token, 0) + weight
    return marginal


def sequence_tests(
    observed: Counter, reference: Counter | dict[Outcome, float], exact: bool
) -> dict[TestKey, ChiSquare]:
    """All tests of one prompt's sampled sequences against ``reference`` (exact
    probabilities, or standard decoding's samples): for each position the next
    token given its prefix (chain rule) and, from the second token on, the token's
    marginal, which still has power when the prefixes are too spread out to test."""
    if exact:
        conditional = sequential_goodness_of_fit(observed, reference)
    else:
        conditional = sequential_two_sample(observed, reference)  # type: ignore[arg-type]
    tests: dict[TestKey, ChiSquare] = {(i, "conditional"): test for i, test in enumerate(conditional)}
    for position in range(1, len(conditional)):
        first, second = Counter(tokens_at(observed, position)), tokens_at(reference, position)
        tests[(position, "marginal")] = (
            goodness_of_fit(first, second) if exact else two_sample(first, Counter(second))
        )
    return tests


def combined_p_value(tests: Iterable[ChiSquare]) -> float:
    """Bonferroni over separate tests: the smallest p-value times their number.

    Testing each position separately keeps a difference at one position from
    being diluted by the degrees of freedom of the others.
    """
    tested = [test for test in tests if test.dof or test.impossible]
    return min(1.0, len(tested) * min(test.p_value for test in tested)) if tested else 1.0


# ------------------------------------------------------------ exact and sampled


@torch.inference_mode()
def exact_distribution(
    model: torch.nn.Module,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    length: int,
    eos_token_ids: Iterable[int] = (),
    batch_size: int = 512,
) -> dict[Outcome, float]:
    """Standard decoding's exact distribution of its first ``length`` tokens.

    Enumerates every prefix of positive probability, level by level, with plain
    (uncached) target passes; the processed probabilities (float32, as decoding
    uses them) are multiplied in float64. Outcomes ending in EOS are shorter.
    """
    eos = set(eos_token_ids)
    device = next(model.parameters()).device
    finished: dict[Outcome, float] = {}
    frontier: dict[Outcome, float] = {(): 1.0}
    for depth in range(length):
        prefixes = list(frontier)
        next_frontier: dict[Outcome, float] = {}
        for start in range(0, len(prefixes), batch_size):
            chunk = prefixes[start : start + batch_size]
            input_ids = torch.tensor([prompt_ids + list(p) for p in chunk], device=device)  # (b, len)
            logits = model(input_ids=input_ids, use_cache=False).logits[:, -1]  # (b, vocab)
            check_finite(logits, "audit's exact enumeration")
            probs = processed_probs(logits, sampling).double().cpu()  # (b, vocab)
            for prefix, row in zip(chunk, probs):
                for token in row.nonzero().flatten().tolist():
                    outcome = prefix + (token,)
                    mass = frontier[prefix] * float(row[token])
                    ended = token in eos or depth + 1 == length
                    (finished if ended else next_frontier)[outcome] = mass
        frontier = next_frontier
    return finished
