"""The one best-size search: how many of a draft's ranked nodes pay for their pass.

With the candidates' estimated acceptance probabilities v_1 >= v_2 >= ... (each
prefix a tree: a node never outranks its parent), a draft of the first n nodes
emits on average E(n) = 1 + v_1 + ... + v_n tokens per round (the 1: the
correction or bonus token), and costs

    T(n + 1) + D + c n

seconds: the target's pass over the pending token and n nodes, D the drafting
seconds per round, c the drafting seconds per node (an autoregressive chain pays
per token). :func:`best_size` takes the n maximising E(n) / (T(n + 1) + D + c n).
Two guards keep measurement noise from steering it: T is made non-decreasing
(:meth:`CostCurve.non_decreasing`, a wider pass never looks cheaper), and a bigger
draft must beat a smaller one by ``min_gain`` (1%).

Every sizer uses it: chain lengths (values = the survival products along the
chain), static tree budgets (values = the best tree's node products, best first),
dynamic trees and suffix trees (each round's candidates). ``min_confidence``
(draft_model, early_exit) stays a separate shortcut: it ends a chain where the
drafter's top probability is low, a rule that depends on q only (so sampling
stays lossless) and needs no measurement.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from specdec.decoders.engine.draft import Round
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import AcceptanceStats

MIN_GAIN = 0.01  # a bigger draft must promise this much more tokens per second


def best_size(
    values: list[float],
    pass_seconds: list[float],
    draft_seconds: float = 0.0,
    seconds_per_node: float = 0.0,
    min_gain: float = MIN_GAIN,
    allow_empty: bool = False,
    base_tokens: float = 1.0,
) -> tuple[int, float]:
    """(n, expected tokens per second) of the best draft made of the n first ``values``.

    ``values`` in descending order; ``pass_seconds[m]`` = T(m + 1), non-decreasing
    (n is at most len(pass_seconds) - 1). With ``allow_empty``, n = 0 (a plain decoding
    step) competes; otherwise the smallest draft has one node (worth 0 if ``values``
    is empty). ``base_tokens``: what a round emits without the candidates (the
    correction or bonus token, plus the estimates of nodes kept anyway; their pass
    width is then in ``pass_seconds``' offset)."""
    values = values[: len(pass_seconds) - 1] or ([] if allow_empty else [0.0])
    best = 0 if allow_empty else 1
    expected = base_tokens + sum(values[:best])
    best_rate = expected / (pass_seconds[best] + draft_seconds + seconds_per_node * best)
    for n in range(best + 1, len(values) + 1):
        expected += values[n - 1]
        rate = expected / (pass_seconds[n] + draft_seconds + seconds_per_node * n)
        if rate > best_rate * (1 + min_gain):
            best, best_rate = n, rate
    return best, best_rate


def check_budget(budget: object) -> object:
    """A ``tree_budget`` option: a positive integer, ``auto`` or null (every node)."""
    if not (budget is None or budget == "auto" or (isinstance(budget, int) and budget >= 1)):
        raise ValueError(f"proposer.tree_budget must be a positive integer, auto or null, got {budget!r}")
    return budget


def survival(rates: list[float]) -> list[float]:
    """A chain's node values: node d is accepted only if every node before it is."""
    values, survive = [], 1.0
    for rate in rates:
        survive *= rate
        values.append(survive)
    return values


@dataclass
class Beside:
    """What else the pass a draft joins holds: in a batch, the other requests' rows and the
    tokens they are expected to yield (:mod:`specdec.decoders.engine.batch`); alone, nothing."""

    rows: int = 0
    tokens: float = 0.0
    curve: CostCurve | None = None  # the T(n) of the batch's packed passes (None: the sizer's own)


class PassSeconds:
    """T(1) .. T(max_tokens), non-decreasing, read from the target's cost curve on first
    use (so a curve that still has to be measured is measured only when needed) and
    again whenever the curve's ``version`` changes (a live curve,
    :class:`specdec.decoders.models.pass_times.PassTimes`). With ``beside``, the widths are
    counted on top of the rows already in the pass: entry m is T(rows + m + 1), and
    :attr:`base_tokens` counts the tokens they are expected to yield."""

    def __init__(
        self, target_cost: Callable[[], CostCurve], max_tokens: int, beside: Beside | None = None
    ) -> None:
        self._target_cost = target_cost
        self.max_tokens = max_tokens
        self.beside = beside or Beside()
        self._seconds: list[float] | None = None
        self._curve: CostCurve | None = None
        self._version: tuple[int, int, int] = (0, -1, 0)

    def __call__(self) -> list[float]:
        curve = self.beside.curve
        if curve is None:
            if self._curve is None:
                self._curve = self._target_cost()
            curve = self._curve
        rows = self.beside.rows
        if self._seconds is None or (id(curve), curve.version, rows) != self._version:
            self._version = (id(curve), curve.version, rows)
            self._seconds = curve.non_decreasing(self.max_tokens + rows)[rows:]
        return self._seconds

    @property
    def base_tokens(self) -> float:
        """What a pass yields without the draft being sized: the draft's own correction or
        bonus token, and the tokens of the rest of the pass."""
        return 1.0 + self.beside.tokens


class Sizer:
    """What a proposer's sizing keeps between rounds: it learns from each verified
    round (:meth:`observe`, the keys of the nodes it sized are its own business) and
    reports what it measured (:meth:`describe`, merged into the proposer's results)."""

    def __init__(self) -> None:
        self.draft_seconds = 0.0  # summed over observed rounds (the engine's measure)
        self.rounds = 0

    def for_request(self) -> Sizer:
        """This sizer for another request decoded at the same time: what it measured over
        every request (its statistics' pooled counts) shared; the request's own counts, its
        probes and its note of the last choice (set anew at each) its own."""
        other = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, AcceptanceStats | Probe):
                setattr(other, name, value.for_request())
        return other

    def start_request(self) -> None:
        """A request begins: its statistics start its own counts (the pooled ones stay) and
        its probes their waits (:func:`start_request` calls it for every sizer of a proposer)."""
        for value in vars(self).values():
            if isinstance(value, AcceptanceStats | Probe):
                value.start_request()

    @property
    def mean_draft_seconds(self) -> float:
        return self.draft_seconds / max(self.rounds, 1)

    def observe(self, round: Round) -> None:
        self.draft_seconds += round.draft_seconds
        self.rounds += 1

    def describe(self) -> dict:
        return {}


class Probe:
    """Keeps measuring a situation sized to no draft, so that one switched off can recover:
    after ``every`` such rounds of a key it gets one node. A probe that does not switch
    its situation back on doubles the wait before the next one, up to ``every`` x
    ``MAX_BACKOFF``; a round sized above zero resets it. A drafter that never pays (an
    early exit at temperature 1, whose one-token probe costs 0.4 T(1) here) then pays
    for a probe every 128 rounds, not every 16."""

    MAX_BACKOFF = 8

    def __init__(self, every: int) -> None:
        self.every = every
        self.skipped: Counter = Counter()  # rounds sized to nothing since the last probe, per key
        self.wait: dict[Hashable, int] = {}  # rounds between probes, per key (every when absent)
        self._probed: set[Hashable] = set()  # keys whose last round was a probe

    def start_request(self) -> None:
        """A request begins: the waits go back to ``every`` (the rounds skipped so far still
        count, so that short requests are probed too)."""
        self.wait.clear()
        self._probed.clear()

    def for_request(self) -> Probe:
        other = copy.copy(self)
        other.skipped, other.wait, other._probed = Counter(self.skipped), {}, set()
        return other

    def __call__(self, key: Hashable, size: int) -> int:
        probed = key in self._probed
        self._probed.discard(key)
        if size:
            self.wait.pop(key, None)
            self.skipped[key] = 0
            return size
        wait = self.wait.get(key, self.every)
        if probed:  # the probe was measured and the situation stays off
            wait = self.wait[key] = min(2 * wait, self.every * self.MAX_BACKOFF)
        self.skipped[key] += 1
        if self.skipped[key] < wait:
            return 0
        self.skipped[key] = 0
        self._probed.add(key)
        return 1


def start_request(proposer: object, seen: set[int] | None = None) -> None:
    """A request begins for ``proposer``: every sizer it holds (and the proposers it holds
    hold: a merge's members, a wrapped proposer) starts the request's own counts
    (:meth:`Sizer.start_request`). The engine calls it after ``Proposer.begin``, so that
    sizing follows each request whatever the proposer's own ``begin`` does."""
    seen = set() if seen is None else seen
    if id(proposer) in seen:
        return
    seen.add(id(proposer))
    for value in vars(proposer).values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, Sizer):
                item.start_request()
            elif callable(getattr(item, "propose", None)) and hasattr(item, "__dict__"):
                start_request(item, seen)
