"""Whether a batch's round drafts at all: decided before any request drafts, from the
rounds of batches of the same size.

Each request's sizer weighs its nodes against the pass, and the batch then keeps the
nodes that pay together (:meth:`~specdec.decoders.sizing.policy.SizingPolicy.joint`); but
both decide after drafting, when a drafter that runs a model (copy heads, a draft model)
has already paid for every request of the batch. In a large batch the pass is dear, few
nodes pay, and that drafting cost alone can make the batch slower than batched standard
decoding (measured: copy heads at batch 16 in float32, 0.94x with 0.54 draft tokens per
request per pass).

The gate compares, for each size class of the pass (its number of requests rounded down to a
power of two: 1, 2-3, 4-7, 8-15, 16-31 ...), the throughput of whole rounds (drafting, the
pass, verifying: new tokens over all requests per second) of the rounds that drafted and of
the rounds that did not. Classes, not every size: a batch whose requests end one by one
passes through every size below its own, each for a few rounds. Rates are running means over
the first ``1 / weight`` rounds, then exponential averages as long (of tokens and of seconds
apart, so a round's rate weighs by its length).

- **Measured**: once a class has ``min_rounds`` of each kind, a round drafts while the
  drafted rounds' rate is at least the plain rounds' (within ``margin``); already after
  ``quick_rounds`` of each where one kind is slower by ``decisive`` or more (a drafter whose
  rounds cost half again as much for a few more tokens is not measured further).
- **Inferred**: drafting pays less as the batch grows (the pass each draft token widens is
  dearer, and each token's share of it larger). So a class not measured yet takes plain
  rounds where a smaller class found plain rounds faster, and drafted ones where a larger
  class found drafting faster; it measures itself through its probes meanwhile. A
  batch that drains through the classes below its own does not spend rounds measuring
  what its larger classes already tell.
- **Otherwise** it measures both kinds, ``quick_rounds`` each, then ``min_rounds`` each
  unless that decided, first the kind the nearest measured class found faster (drafted
  where none is).
- **Probes**: the losing kind is measured again one round in an interval, ``explore_every``
  at least, longer the more that kind loses (so probing costs at most ``explore_cost`` of
  the throughput: a probe of a kind 30% slower comes every 60 rounds), at most
  ``max_interval``.

A round the gate keeps plain is a standard decoding step for every request of the batch
(the proposer is told, :meth:`~specdec.decoders.engine.proposer.Proposer.skip`), so it is
lossless whatever decided it. One gate per pipeline (:meth:`SizingPolicy.batch_gate`); the
bench clears it before each run, like the proposer's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.decoders.sizing.round_gate import RoundAverages

DRAFTED, PLAIN = "drafted", "plain"


class _Rate(RoundAverages):
    """A kind of batch round: new tokens over all requests, and seconds (its ``cost``)."""

    @property
    def rate(self) -> float:
        return self.tokens / self.cost if self.cost > 0 else 0.0


@dataclass
class _Size:
    """What the gate knows of passes over one number of requests."""

    rates: dict[str, _Rate] = field(default_factory=lambda: {DRAFTED: _Rate(), PLAIN: _Rate()})
    since_probe: int = 0


def _loss(a: float, b: float) -> float:
    """How much slower the slower of two rates is, as a share of the faster."""
    best = max(a, b)
    return 1.0 - min(a, b) / best if best > 0 else 0.0


class BatchGate:
    """Decides, round by round of a batch, whether its requests draft (:meth:`drafts`), and
    learns from each round (:meth:`record`). See the module."""

    def __init__(
        self,
        explore_every: int = 12,
        weight: float = 1 / 16,
        margin: float = 0.0,
        min_rounds: int = 4,
        explore_cost: float = 0.005,
        max_interval: int = 256,
        quick_rounds: int = 2,
        decisive: float = 0.2,
    ) -> None:
        self.explore_every, self.weight, self.margin, self.min_rounds = (
            explore_every,
            weight,
            margin,
            min_rounds,
        )
        self.explore_cost, self.max_interval = explore_cost, max_interval
        self.quick_rounds, self.decisive = min(quick_rounds, min_rounds), decisive
        self.forget()

    def forget(self) -> None:
        """Drop what was measured, back to a new gate's state."""
        self.sizes: dict[int, _Size] = {}
        self.drafted = 0  # rounds drafted
        self.skipped = 0  # rounds kept plain

    @staticmethod
    def size_class(requests: int) -> int:
        """The class of a pass over ``requests`` requests: the power of two at or below it."""
        return 1 << (max(requests, 1).bit_length() - 1)

    def _measured(self, size_class: int) -> str | None:
        size = self.sizes.get(size_class)
        if size is None:
            return None
        drafted, plain = size.rates[DRAFTED], size.rates[PLAIN]
        rounds = min(drafted.rounds, plain.rounds)
        if rounds < self.quick_rounds:
            return None
        if rounds < self.min_rounds and _loss(drafted.rate, plain.rate) < self.decisive:
            return None
        return DRAFTED if drafted.rate >= plain.rate * (1 - self.margin) else PLAIN

    def _inferred(self, size_class: int) -> tuple[str, int] | None:
        """(the kind, the measured class it is inferred from) for a class not measured yet:
        plain where a smaller class found plain rounds faster, drafted where a larger class
        found drafted ones faster (the nearest such class)."""
        found = []
        for other in self.sizes:
            kind = self._measured(other)
            if (kind == PLAIN and other < size_class) or (kind == DRAFTED and other > size_class):
                found.append((abs(other.bit_length() - size_class.bit_length()), other, kind))
        if not found:
            return None
        _, other, kind = min(found)
        return kind, other

    def winner(self, requests: int) -> str | None:
        """Which kind of round pays at this many requests: measured in its class, else
        inferred from the others (None: neither)."""
        size_class = self.size_class(requests)
        measured = self._measured(size_class)
        if measured is not None:
            return measured
        inferred = self._inferred(size_class)
        return inferred[0] if inferred is not None else None

    def probe_interval(self, size_class: int) -> int:
        """Rounds between probes of the losing kind in a measured class: the explored share
        of rounds times what each loses at most ``explore_cost``."""
        rates = self.sizes[size_class].rates
        loss = _loss(rates[DRAFTED].rate, rates[PLAIN].rate)
        return min(max(self.explore_every, round(loss / self.explore_cost)), self.max_interval)

    def drafts(self, requests: int) -> bool:
        """Whether this round of a pass over ``requests`` requests drafts."""
        size_class = self.size_class(requests)
        size = self.sizes.setdefault(size_class, _Size())
        kind, source = self._measured(size_class), size_class
        if kind is None and (inferred := self._inferred(size_class)) is not None:
            kind, source = inferred
        if kind is None:  # measure both: first the kind the nearest measured class found faster
            drafted, plain = size.rates[DRAFTED], size.rates[PLAIN]
            measured = [
                (abs(n.bit_length() - size_class.bit_length()), n) for n in self.sizes if self._measured(n)
            ]
            nearest = self._measured(min(measured)[1]) if measured else DRAFTED
            first = drafted if nearest == DRAFTED else plain
            quick = min(drafted.rounds, plain.rounds) < self.quick_rounds
            drafting = (first is drafted) == (
                first.rounds < (self.quick_rounds if quick else self.min_rounds)
            )
        else:
            drafting = kind == DRAFTED
            size.since_probe += 1
            if size.since_probe >= self.probe_interval(source):  # the other kind, measured again
                size.since_probe = 0
                drafting = not drafting
        if drafting:
            self.drafted += 1
        else:
            self.skipped += 1
        return drafting

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round over ``requests`` requests: whether it drafted, the new tokens it gave
        over all of them and its seconds (drafting, pass and verifying)."""
        size = self.sizes.setdefault(self.size_class(requests), _Size())
        size.rates[DRAFTED if drafted else PLAIN].add(tokens, seconds, self.weight)

    def describe(self) -> dict:
        return {
            "rounds_drafted": self.drafted,
            "rounds_skipped": self.skipped,
            "by_requests": {
                n: {
                    kind: {"rounds": r.rounds, "tokens_per_s": round(r.rate, 2)}
                    for kind, r in s.rates.items()
                }
                | {"drafts": self.winner(n)}
                for n, s in sorted(self.sizes.items())
            },
        }
