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
power of two: 1, 2-3, 4-7, 8-15, 16-31 ...), the throughput of whole rounds
(drafting, the pass, verifying: new tokens over all requests per second) of the rounds that
drafted and of the rounds that did not. A round drafts while the drafted rounds' rate is at
least the plain rounds' within ``margin``; each side is measured first (``min_rounds``
drafted, then as many plain; plain first where a smaller class found plain rounds faster,
as a larger batch's pass is dearer), and the losing side keeps being measured, one round in
``explore_every``. Classes, not every size: a batch whose requests end one by one passes
through every size below its own, each for a few rounds, and would spend them all measuring. Rates are running means over the first ``1 / weight`` rounds, then
exponential averages as long (of tokens and of seconds apart, so a round's rate weighs by
its length).

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


class BatchGate:
    """Decides, round by round of a batch, whether its requests draft (:meth:`drafts`), and
    learns from each round (:meth:`record`). See the module."""

    def __init__(
        self, explore_every: int = 12, weight: float = 1 / 16, margin: float = 0.02, min_rounds: int = 4
    ) -> None:
        self.explore_every, self.weight, self.margin, self.min_rounds = (
            explore_every,
            weight,
            margin,
            min_rounds,
        )
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

    def winner(self, requests: int) -> str | None:
        """Which kind of round has paid at this many requests (None: not measured yet)."""
        size = self.sizes.get(self.size_class(requests))
        if size is None:
            return None
        drafted, plain = size.rates[DRAFTED], size.rates[PLAIN]
        if drafted.rounds < self.min_rounds or plain.rounds < self.min_rounds:
            return None
        return DRAFTED if drafted.rate >= plain.rate * (1 - self.margin) else PLAIN

    def drafts(self, requests: int) -> bool:
        """Whether this round of a pass over ``requests`` requests drafts."""
        size = self.sizes.setdefault(self.size_class(requests), _Size())
        drafted, plain = size.rates[DRAFTED], size.rates[PLAIN]
        if drafted.rounds < self.min_rounds or plain.rounds < self.min_rounds:
            # measure both: drafting first, unless a smaller class found plain rounds faster
            smaller = [n for n in self.sizes if n < self.size_class(requests)]
            plain_first = any(self.winner(n) == PLAIN for n in smaller)
            first = plain if plain_first else drafted
            drafting = (first is drafted) == (first.rounds < self.min_rounds)
        else:
            drafting = self.winner(requests) == DRAFTED
            size.since_probe += 1
            if size.since_probe >= self.explore_every:  # the other kind, measured again
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
