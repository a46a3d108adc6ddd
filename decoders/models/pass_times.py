"""The passes the decode loop times, and the T(n) they imply (``model.live_cost``).

The cached curve (:mod:`specdec.decoders.models.cost`) is the fastest of a few repeats on a quiet
moment; the passes a decode makes run where the machine is, at other contexts. :class:`PassTimes`
follows them.
"""

from __future__ import annotations

import statistics
from collections import deque

from specdec.decoders.models.cost import CostCurve, _interpolate, non_decreasing


class PassTimes:
    """The verification passes the decode loop timed, and the curve they imply.

    ``curve`` is one :class:`CostCurve` object, updated in place (its ``version``
    bumped) every ``refresh`` passes: a width with ``min_samples`` passes among its
    last ``window`` takes their median seconds; any other width of ``base`` takes
    its base seconds times the ratio measured/base of the nearest measured widths
    (interpolated between them), so a width the sizing has not tried yet keeps the
    base curve's shape at the level the machine runs at now.

    A pass over more tokens is never taken as cheaper than one over fewer: the medians
    are fitted by the closest non-decreasing curve (pool-adjacent-violators, weighted
    by the passes behind each median), and the whole curve by its running maximum.
    Without that, widths timed at different moments (another pipeline, another
    prompt's context length) can make a wider pass look cheaper, and the sizing then
    keeps drafting to that width, which only feeds that width more samples.
    """

    def __init__(self, base: CostCurve, window: int = 32, min_samples: int = 4, refresh: int = 8) -> None:
        self.base = base
        self.curve = CostCurve(dict(base.seconds), base.disturbance, context=base.context)
        self.window, self.min_samples, self.refresh = window, min_samples, refresh
        self.samples: dict[int, deque[float]] = {}
        self.passes = 0

    def record(self, tokens: int, seconds: float) -> None:
        """One pass over ``tokens`` new tokens took ``seconds``, at the context the curve
        is read at; kept as what it would have taken after the reference context."""
        seconds = max(seconds - self.curve.extra(tokens), 0.0)
        self.samples.setdefault(tokens, deque(maxlen=self.window)).append(seconds)
        self.passes += 1
        if self.passes % self.refresh == 0:
            self._update()

    def at_context(self, length: int) -> None:
        """The decode loop's next pass comes after ``length`` tokens."""
        self.curve.at_context(length)

    def measured(self) -> dict[int, float]:
        """Median seconds of each width timed often enough to be trusted."""
        return {
            n: statistics.median(times)
            for n, times in sorted(self.samples.items())
            if len(times) >= self.min_samples
        }

    def _update(self) -> None:
        measured = self.measured()
        if not measured:
            return
        widths = sorted(measured)
        fitted = non_decreasing([measured[n] for n in widths], [len(self.samples[n]) for n in widths])
        measured = dict(zip(widths, fitted))
        ratios = [measured[n] / _interpolate(self.base.seconds, n) for n in widths]

        def ratio(n: int) -> float:
            if n <= widths[0]:
                return ratios[0]
            if n >= widths[-1]:
                return ratios[-1]
            right = next(i for i, w in enumerate(widths) if w >= n)
            a, b = widths[right - 1], widths[right]
            return ratios[right - 1] + (ratios[right] - ratios[right - 1]) * (n - a) / (b - a)

        sizes = sorted(set(self.base.seconds) | set(measured))
        seconds, highest = {}, 0.0
        for n in sizes:
            highest = max(highest, measured.get(n, _interpolate(self.base.seconds, n) * ratio(n)))
            seconds[n] = highest
        self.curve.seconds = seconds
        self.curve.version += 1

    def describe(self) -> dict:
        """For results files: the widths timed, their median seconds and pass counts."""
        measured = self.measured()
        return {
            "sizes": list(measured),
            "seconds": list(measured.values()),
            "passes": [len(self.samples[n]) for n in measured],
            "total_passes": self.passes,
        }
