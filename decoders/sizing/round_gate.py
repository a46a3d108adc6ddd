"""Whether a round drafts at all: decided before the proposer runs, from earlier rounds.

A proposer's own sizing (chain lengths, tree budgets, :mod:`specdec.decoders.sizing.search`)
can size a draft down to nothing, but only after drafting: a model drafter has by
then paid its forward passes. Where its drafts are seldom accepted (a distilled
draft on long documents, heads at temperature 1 on translation) every round pays
drafting seconds D for little, and the pipeline runs slower than standard decoding.

The gate compares, per situation, what a drafted round has given against a plain
decoding step. A plain step emits one token for T(1), the target's cost curve at
the request's context (followed live: the passes of standard decoding and of
plain rounds time it). A drafted round emits e tokens for D + V, its drafting and
its verification seconds as the decode loop measured them. Drafting pays where

    mean e  >=  mean (D + V) / T(1)

over the situation's recent drafted rounds: a running mean over the first 32, then
an exponential average as long, so that one noisy round does not move it (closing
wrongly costs the drafts of every round until the next probe; staying open
wrongly costs D). The next request starts from where the last left off. A
situation closes only below ``margin`` (2%) under its cost and after ``min_rounds``
(8) counted rounds, for the same reason: in one bench run a gate that closed on the
first two or three rounds' average kept the copy heads' tree from drafting 24 of a
translation prompt's rounds.
The situation is whether the last round accepted a draft token: acceptance comes
in runs (copying, formulaic text), so a drafter may pay just after an accepted
round and not after a miss.

The drafted round's V is measured, not read from the curve: the curve prices
widths well (docs/performance.md, "Why a verification pass is cheap here"), but a gate that
weighs T(w) / T(1) decides on a ratio close to 1 where a few percent of error in
either point flips it.

A request's first drafted round is not counted: its drafting seconds hold the
drafter's catching up on the whole prompt (a draft model's own prefill, the copy
heads' memory of the prompt), paid once per request, not per round.

Closed, a situation is still probed (:class:`specdec.decoders.sizing.search.Probe`: one
drafted round after ``explore_every`` skipped ones, the wait doubling while the
probes keep it closed, up to 4 times as long), and every request starts with the
wait reset. The benchmark clears what the gate measured during its warm-up
(:meth:`RoundGate.forget`): the first passes of a process run cold.

A skipped round is a plain decoding step: the target's pass over the pending token
alone, whose verdict is the target's own token (greedy) or a sample from its
distribution. So the gate keeps every verifier lossless, whatever decided it. The
proposer is told (:meth:`~specdec.decoders.engine.proposer.Proposer.skip`) so that state it
keeps in step with the target's passes (copy heads' context memory, EAGLE's
features) takes in the round it did not draft.

Pipelines are built without a gate unless asked (``round_gate=true``): in its A/B
runs (docs/round_gate.md) it helped the distilled draft at temperature 1, left
the heads unchanged at 0 and cost the copy heads' tree at 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.search import PassSeconds, Probe

AFTER_ACCEPT, AFTER_MISS = "after_accept", "after_miss"


@dataclass
class RoundAverages:
    """Running averages of a kind of round: tokens emitted, and what the rounds cost (here:
    drafting and verifying seconds in units of T(1); the batch gate's: seconds). Running
    means over the first ``1 / weight`` rounds, then exponential averages as long."""

    tokens: float = 0.0
    cost: float = 0.0
    rounds: int = 0

    def add(self, tokens: float, cost: float, weight: float) -> None:
        weight = max(weight, 1.0 / (self.rounds + 1))  # the first rounds weigh in full
        self.tokens += weight * (tokens - self.tokens)
        self.cost += weight * (cost - self.cost)
        self.rounds += 1

    def pays(self, margin: float, min_rounds: int) -> bool:
        return self.rounds < min_rounds or self.tokens >= self.cost * (1 - margin)


class _GateProbe(Probe):
    MAX_BACKOFF = 4  # a closed situation learns only from its probes: keep them coming


class RoundGate:
    """Decides, round by round, whether the proposer drafts (:meth:`drafts`), and learns
    from each drafted round (:meth:`record`). One gate per pipeline: it keeps what earlier
    requests measured."""

    def __init__(
        self,
        target_cost: Callable[[], CostCurve],
        explore_every: int = 8,
        weight: float = 1 / 32,
        margin: float = 0.02,
        min_rounds: int = 8,
    ) -> None:
        self.weight, self.margin, self.min_rounds = weight, margin, min_rounds
        self.explore_every = explore_every
        self._pass_seconds = PassSeconds(target_cost, 1)
        self.forget()

    def begin(self) -> None:
        """A request starts: after a miss (nothing accepted yet), the probes' waits reset."""
        self._situation = AFTER_MISS
        self._first = True  # the request's first drafted round is yet to come
        self._probe = _GateProbe(self.explore_every)

    def forget(self) -> None:
        """Drop what was measured (the benchmark's warm-up), back to a new gate's state."""
        self.averages = {AFTER_ACCEPT: RoundAverages(), AFTER_MISS: RoundAverages()}
        self.drafted = 0  # rounds drafted, over all requests
        self.skipped = 0  # rounds the gate kept plain
        self.begin()

    def drafts(self) -> bool:
        """Whether this round drafts: its situation's drafted rounds paid, or it is a probe."""
        situation = self._situation
        drafting = bool(
            self._probe(situation, int(self.averages[situation].pays(self.margin, self.min_rounds)))
        )
        if drafting:
            self.drafted += 1
        else:
            self.skipped += 1
            self._situation = AFTER_MISS
        return drafting

    def cost(self, draft_seconds: float, verify_seconds: float) -> float:
        """A drafted round's seconds in units of a plain step's: (D + V) / T(1)."""
        return (draft_seconds + verify_seconds) / self._pass_seconds()[0]

    def record(self, draft_seconds: float, verify_seconds: float, emitted: int, accepted: int) -> None:
        """A drafted round: its drafting and verification seconds, the tokens it emitted
        and the draft tokens accepted (the request's first drafted round is not counted,
        see the module's docstring)."""
        if not self._first:
            cost = self.cost(draft_seconds, verify_seconds)
            self.averages[self._situation].add(emitted, cost, self.weight)
        self._first = False
        self._situation = AFTER_ACCEPT if accepted else AFTER_MISS

    def describe(self) -> dict:
        return {
            "rounds_drafted": self.drafted,
            "rounds_skipped": self.skipped,
            "situations": {
                name: {"rounds": a.rounds, "tokens": round(a.tokens, 3), "cost": round(a.cost, 3)}
                for name, a in self.averages.items()
            },
        }
