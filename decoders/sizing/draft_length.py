"""How many candidate tokens a chain proposer should send: chosen from cost and acceptance.

A proposer often has more candidates than are worth verifying. Each extra
token widens the target's pass a little and is worth something only if every
token before it is accepted too. With a(key, d) the measured share of depth-d
tokens accepted when tried, per situation ``key`` (for prompt lookup: the length
of the matched suffix; for Medusa chains: the first head's confidence), a draft
of L tokens is the chain whose node values are the survival products
prod_{j<=d} a(key, j), and :func:`specdec.decoders.sizing.search.best_size` takes the L
with the most expected tokens per second, drafting cost per token included;
L = 0 (a plain decoding step) wins when the candidates are rarely accepted.

Rates are optimistic until measured (:meth:`AcceptanceStats.optimistic`: 1 for an
untried depth), so a new situation is drafted in full, and a situation that was
switched off is retried after ``explore_every`` rounds so that it can recover (the
wait doubling after each retry that left it off, :class:`specdec.decoders.sizing.search.Probe`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import AcceptanceStats
from specdec.decoders.sizing.search import MIN_GAIN, Beside, PassSeconds, Probe, Sizer, best_size, survival


class DraftLengthPolicy(Sizer):
    """Chain lengths per situation; keys of :attr:`stats` are (situation, depth 1..max_len)."""

    def __init__(
        self,
        max_len: int,
        target_cost: Callable[[], CostCurve],
        explore_every: int = 16,
        min_gain: float = MIN_GAIN,
        beside: Beside | None = None,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.min_gain = min_gain
        self.stats = AcceptanceStats.optimistic()
        self._pass_seconds = PassSeconds(target_cost, max_len + 1, beside)
        self._probe = Probe(explore_every)
        self._key: Hashable = None  # the situation of the last choice

    def rate(self, key: Hashable, depth: int) -> float:
        return self.stats.rate((key, depth))

    def values(self, key: Hashable, length: int) -> list[float]:
        """The chain's node values: survival to each depth 1..length."""
        return survival([self.rate(key, depth) for depth in range(1, length + 1)])

    def expected_tokens(self, key: Hashable, length: int) -> float:
        """E(length): tokens a round emits on average with a draft of ``length``."""
        return 1.0 + sum(self.values(key, length))

    def choose(self, key: Hashable, available: int, draft_seconds_per_token: float = 0.0) -> int:
        """The draft length (0 .. min(available, max_len)) with the most expected tokens per
        second; the round's nodes are then counted under ``key`` (:meth:`observe`)."""
        self._key = key
        available = min(available, self.max_len)
        if available <= 0:
            return 0
        length, _ = best_size(
            self.values(key, available),
            self._pass_seconds(),
            seconds_per_node=draft_seconds_per_token,
            min_gain=self.min_gain,
            allow_empty=True,
            base_tokens=self._pass_seconds.base_tokens,
        )
        return self._probe(key, length)

    def record(self, key: Hashable, proposed: int, accepted: int) -> None:
        """Count one verified chain of ``proposed`` tokens of which the first ``accepted`` were
        accepted: depths 1 .. min(accepted + 1, proposed) were tried."""
        keys = [(key, depth) for depth in range(1, proposed + 1)]
        self.stats.record(Draft.chain([0] * proposed), keys, list(range(accepted)))

    def observe(self, round: Round, tried: int | None = None) -> None:
        """Count the round's draft under the last choice's situation, as a chain to the
        deepest node the target saw (the depths of a tree of continuations, e.g. ngram's
        branches, count once each). ``tried``: the chain's length as tried instead, for a
        proposer that stopped short of the length it was given (its drafter unsure: the
        depth it stopped at was tried and gave nothing)."""
        super().observe(round)
        if tried is None:
            if not round.verified:
                return
            tried = 1 + max(round.draft.depths[node] for node in round.verified)
        self.record(self._key, tried, round.num_accepted)

    def as_dict(self) -> dict:
        """Measured rates per situation and depth (for results files)."""
        rates: dict = {}
        for (key, depth), tried in sorted(
            self.stats.tried.items(), key=lambda item: (str(item[0][0]), item[0][1])
        ):
            rate = round(self.rate(key, depth), 4)
            rates.setdefault(str(key), {})[f"depth{depth}"] = {"tried": tried, "rate": rate}
        return rates

    def describe(self) -> dict:
        return {"draft_length_rates": self.as_dict()}
