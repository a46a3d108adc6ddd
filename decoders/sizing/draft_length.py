"""How many candidate tokens a chain proposer should send: chosen from cost and acceptance.

A proposer often has more candidates than are worth verifying. Each extra
token widens the target's pass a little and is worth something only if every
token before it is accepted too. With

    a(key, d)  the measured share of depth-d tokens accepted when tried (all
               tokens before them accepted), per situation ``key`` (for prompt
               lookup: the length of the matched suffix),
    T(m)       the target's pass seconds over m tokens (decoders/models/cost.py),
    c          the proposer's drafting seconds per token,

a draft of L tokens emits on average E(L) = 1 + sum_{d<=L} prod_{j<=d} a(key, j)
tokens per round, and :meth:`DraftLengthPolicy.choose` takes the L that
maximises E(L) / (T(L + 1) + c L); a longer draft must beat a shorter one by
``min_gain`` (1%), as T is measured with noise. L = 0 (no draft: a plain
decoding step) wins when the candidates are rarely accepted. Rates are
optimistic until measured ((accepted + 1) / (tried + 1): 1 for an untried
depth), so a new situation is drafted in full, and a situation that was switched
off is retried every ``explore_every`` rounds so that it can recover.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

from decoders.models.cost import CostCurve


class DraftLengthPolicy:
    def __init__(
        self,
        max_len: int,
        target_cost: Callable[[], CostCurve],
        explore_every: int = 16,
        min_gain: float = 0.01,
    ) -> None:
        self.max_len = max_len
        self.min_gain = min_gain
        self.explore_every = explore_every
        self._target_cost = target_cost
        self._seconds: list[float] | None = None  # T(1) .. T(max_len + 1), non-decreasing
        self.tried: defaultdict[Hashable, list[int]] = defaultdict(lambda: [0] * (max_len + 1))
        self.accepted: defaultdict[Hashable, list[int]] = defaultdict(lambda: [0] * (max_len + 1))
        self._skipped: defaultdict[Hashable, int] = defaultdict(int)

    def _pass_seconds(self) -> list[float]:
        if self._seconds is None:
            self._seconds = self._target_cost().non_decreasing(self.max_len + 1)
        return self._seconds

    def rate(self, key: Hashable, depth: int) -> float:
        """a(key, depth), optimistic until measured: (accepted + 1) / (tried + 1)."""
        return (self.accepted[key][depth] + 1) / (self.tried[key][depth] + 1)

    def expected_tokens(self, key: Hashable, length: int) -> float:
        """E(length): tokens a round emits on average with a draft of ``length``."""
        expected, survive = 1.0, 1.0
        for depth in range(1, length + 1):
            survive *= self.rate(key, depth)
            expected += survive
        return expected

    def choose(self, key: Hashable, available: int, draft_seconds_per_token: float = 0.0) -> int:
        """The draft length (0 .. min(available, max_len)) with the most expected tokens per second."""
        available = min(available, self.max_len)
        if available <= 0:
            return 0
        seconds = self._pass_seconds()
        best, best_rate = 0, 1.0 / seconds[0]
        for length in range(1, available + 1):
            rate = self.expected_tokens(key, length) / (seconds[length] + draft_seconds_per_token * length)
            if rate > best_rate * (1 + self.min_gain):
                best, best_rate = length, rate
        if best == 0:
            self._skipped[key] += 1
            if self._skipped[key] % self.explore_every == 0:
                return 1  # keep measuring a situation that is switched off
        return best

    def record(self, key: Hashable, proposed: int, accepted: int) -> None:
        """Count one verified chain: depths 1..accepted were accepted, depth accepted + 1 rejected."""
        for depth in range(1, min(accepted + 1, proposed) + 1):
            self.tried[key][depth] += 1
            self.accepted[key][depth] += depth <= accepted

    def as_dict(self) -> dict:
        """Measured rates per key and depth (for results files)."""
        return {
            str(key): {
                f"depth{d}": {"tried": tried[d], "rate": round(self.rate(key, d), 4)}
                for d in range(1, self.max_len + 1)
                if tried[d]
            }
            for key, tried in sorted(self.tried.items(), key=lambda item: str(item[0]))
        }


def confidence_bucket(probability: float, buckets: int = 5) -> int:
    """A policy key from a drafter's top probability: 0 .. buckets - 1, equal widths."""
    return min(int(probability * buckets), buckets - 1)
