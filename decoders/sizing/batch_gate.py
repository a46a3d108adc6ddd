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

**A draining batch** (no request waits to join: every one has arrived and joined) ends
with its last request, so the tokens a drafted round adds to requests that end earlier do not
bring that end closer; they only free places nobody will take. The rates then overstate
drafting (measured: suffix decoding at 16 requests in float32 drafted 81% of its rounds,
whose rounds gave 17% more tokens per second, yet the batch took 62 rounds against 66 and ran
0.96x). While draining, a round the rates would draft drafts only where it shortens the batch
(:meth:`BatchGate.shortens`): the rounds to the batch's end, plain, are the most tokens any
request may still emit; drafting, the most of each request's remaining tokens over its tokens
per drafted round (its own drafted rounds, shrunk towards the batch's mean by ``min_rounds``
rounds of it); each priced by the seconds of that kind of round. A request whose drafts are
never accepted keeps the end where it is, and plain rounds then run.

A round the gate keeps plain is a standard decoding step for every request of the batch
(the proposer is told, :meth:`~specdec.decoders.engine.proposer.Proposer.skip`), so it is
lossless whatever decided it. One gate per pipeline (:meth:`SizingPolicy.batch_gate`); the
bench clears it before each run, like the proposer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.decoders.engine.request import Outlook
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
        self.kept_for_end = 0  # of those, rounds the rates would draft that a draining batch kept plain

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

    def drafts(self, requests: int, draining: Sequence[Outlook] | None = None) -> bool:
        """Whether this round of a pass over ``requests`` requests drafts. ``draining``: each
        request's outlook where no request waits to join (None: some do)."""
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
            if drafting and draining and not self.shortens(size, draining):
                drafting = False
                self.kept_for_end += 1
            size.since_probe += 1
            if size.since_probe >= self.explore_every:  # the other kind, measured again
                size.since_probe = 0
                drafting = not drafting
        if drafting:
            self.drafted += 1
        else:
            self.skipped += 1
        return drafting

    def shortens(self, size: _Size, draining: Sequence[Outlook]) -> bool:
        """Whether drafted rounds bring a draining batch's end closer than plain ones, their
        seconds counted (see the module)."""
        drafted, plain = size.rates[DRAFTED], size.rates[PLAIN]
        rounds = sum(o.drafted_rounds for o in draining)
        # a live request's round emits at least a token
        mean = max(sum(o.drafted_tokens for o in draining) / rounds, 1.0) if rounds else 1.0
        prior = self.min_rounds
        plain_end = max(o.remaining for o in draining)
        drafted_end = max(
            o.remaining * (o.drafted_rounds + prior) / (o.drafted_tokens + prior * mean) for o in draining
        )
        return drafted_end * drafted.cost * (1 - self.margin) <= plain_end * plain.cost

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round over ``requests`` requests: whether it drafted, the new tokens it gave
        over all of them and its seconds (drafting, pass and verifying)."""
        size = self.sizes.setdefault(self.size_class(requests), _Size())
        size.rates[DRAFTED if drafted else PLAIN].add(tokens, seconds, self.weight)

    def describe(self) -> dict:
        return {
            "rounds_drafted": self.drafted,
            "rounds_skipped": self.skipped,
            "rounds_kept_for_end": self.kept_for_end,
            "by_requests": {
                n: {
                    kind: {"rounds": r.rounds, "tokens_per_s": round(r.rate, 2)}
                    for kind, r in s.rates.items()
                }
                | {"drafts": self.winner(n)}
                for n, s in sorted(self.sizes.items())
            },
        }
