"""The target's pass cost T(n): seconds for one forward pass over n new tokens.

Speculative decoding trades sequential passes for wider ones, so T(n)/T(1)
decides what a draft of n tokens may cost. The curve is measured once per
(model, device, dtype) on a fixed context and cached as JSON under
``~/.cache/specdec/costs``. ``SPECDEC_COST_CURVE=FILE`` (a JSON file in the
cache's format, ``{"seconds": {"1": ..., "2": ...}}``) replaces the measurement
everywhere: tests use it so that no decision depends on the machine running
them, and a user can replay another machine's curve. With tau and the draft cost D per round it gives a
pipeline's physical limit: ideal speedup = tau * T(1) / (T(n) + D).

The measured curve is the fastest of a few repeats on a quiet moment; the passes
a decode makes run where the machine is, at other contexts, with the verdict and
the KV commit around them. :class:`PassTimes` (``model.live_cost``, on unless a
fixed curve is given) closes that gap: the decode loop times every verification
pass, and the sizing reads a curve that follows the median of the recent passes
of each width, the cached curve's shape filling the widths not yet seen.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from decoders.models.kernels import exact_passes
from decoders.models.session import ModelSession

DEFAULT_SIZES = (
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    9,
    12,
    16,
    17,
    24,
    32,
    48,
    64,
)  # 9 and 17 catch the steps of padded_rows


@dataclass
class CostCurve:
    """Pass seconds by number of new tokens (the fastest of interleaved repeats), linearly
    interpolated."""

    seconds: dict[int, float]
    disturbance: float = 1.0  # worst median / fastest repeat of the sweep that measured it
    version: int = 0  # bumped when the seconds change in place (PassTimes), so readers refresh

    def __call__(self, n: float) -> float:
        sizes = sorted(self.seconds)
        n = max(n, sizes[0])
        if n >= sizes[-1]:  # extrapolate along the last segment
            a, b = sizes[-2], sizes[-1]
        else:
            b = next(s for s in sizes if s >= n)
            a = sizes[max(sizes.index(b) - 1, 0)]
            if a == b:
                return self.seconds[a]
        slope = (self.seconds[b] - self.seconds[a]) / (b - a)
        return self.seconds[a] + slope * (n - a)

    def relative(self, n: float) -> float:
        """T(n) / T(1)."""
        return self(n) / self(1)

    def non_decreasing(self, max_tokens: int) -> list[float]:
        """[T(1), ..., T(max_tokens)], each at least the one before: measurement noise
        must not make a wider pass look cheaper to a policy choosing a width."""
        seconds: list[float] = []
        for m in range(1, max_tokens + 1):
            seconds.append(max(self(m), seconds[-1] if seconds else 0.0))
        return seconds


clock = time.perf_counter  # the sweep's timer (tests replace it to fake a machine's load)


@torch.inference_mode()
def measure_cost_curve(
    model: torch.nn.Module,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    context_len: int = 256,
    repeats: int = 5,
) -> CostCurve:
    """Time chain passes of each size after a ``context_len``-token prefix."""
    session = ModelSession(model)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (context_len,), generator=generator).tolist()
    session.forward(prefix)
    inputs = {n: torch.randint(0, vocab, (n,), generator=generator).tolist() for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):  # sizes interleaved, so drift in machine load hits all alike
        for n in sizes:
            start = clock()
            session.forward(inputs[n])
            elapsed = clock() - start
            if repeat:  # the first sweep warms up
                samples[n].append(elapsed)
            session.truncate(context_len)
    # Other work on the machine only ever adds time, so the fastest of the repeats is
    # the pass's own cost; the median's ratio to it says how disturbed the sweep was.
    seconds = {n: min(times) for n, times in samples.items()}
    curve = CostCurve(seconds)
    curve.disturbance = max(sorted(times)[len(times) // 2] / min(times) for times in samples.values())
    return curve


# Bumped when the pass routing (decoders/models/kernels.py) changes what a pass costs,
# so that curves cached under older kernels are measured again. 2: single rows on the
# narrow route, its products over row-major inputs. 3: exact mode's default route computes
# passes wider than its measured widest invariant product in blocks. 4: float32 passes of
# 5 rows and more on oneDNN's packed linear. 5: bfloat16 passes on oneDNN's packed linear.
KERNELS_VERSION = 5

DISTURBED = 1.25  # a sweep whose median pass took this much longer than its fastest is not cached


COST_CURVE_ENV = "SPECDEC_COST_CURVE"


def read_cost_curve(path: str | Path) -> CostCurve:
    """A curve saved in the cache's format (``{"seconds": {"n": seconds}}``)."""
    try:
        data = json.loads(Path(path).read_text())
        return CostCurve({int(n): float(s) for n, s in data["seconds"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"cannot read a cost curve from {path} ({error}); it must be JSON like "
            '{"seconds": {"1": 0.040, "8": 0.043}}, e.g. a file from ~/.cache/specdec/costs'
        ) from error


_UNCACHED: dict[Path, CostCurve] = {}  # this process's disturbed measurements, by cache path


def cached_cost_curve(model: torch.nn.Module, key: str, cache_dir: Path) -> CostCurve:
    """The cost curve of ``model`` (named ``key``): ``SPECDEC_COST_CURVE``'s file if
    set, else the cached measurement, measured on first use (exact mode,
    ``model.exact``, has its own). A measurement disturbed by other work on the
    machine is retried once and, if still disturbed, used for the rest of the process
    but never written, so one busy moment does not steer every later run."""
    if os.environ.get(COST_CURVE_ENV):
        return read_cost_curve(os.environ[COST_CURVE_ENV])
    parameter = next(model.parameters())
    device = parameter.device.type
    dtype = str(parameter.dtype).removeprefix("torch.")
    mode = "-exact" if exact_passes(model) else ""
    path = cache_dir / f"{key}-{device}-{dtype}{mode}-k{KERNELS_VERSION}.json"
    if path.exists():
        return read_cost_curve(path)
    if path in _UNCACHED:  # measured under load earlier in this process: not measured again
        return _UNCACHED[path]
    curve = measure_cost_curve(model)
    if curve.disturbance > DISTURBED:
        curve = min(curve, measure_cost_curve(model), key=lambda c: c.disturbance)
    if curve.disturbance > DISTURBED:
        print(
            f"[cost] T(n) measured under load (a median pass {curve.disturbance:.2f}x the fastest): "
            "used for this run, not cached; measure again when the machine is quiet",
            file=sys.stderr,
        )
        _UNCACHED[path] = curve
        return curve
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"key": key, "device": device, "dtype": dtype, "seconds": curve.seconds}, indent=1)
    )
    return curve


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
        self.curve = CostCurve(dict(base.seconds), base.disturbance)
        self.window, self.min_samples, self.refresh = window, min_samples, refresh
        self.samples: dict[int, deque[float]] = {}
        self.passes = 0

    def record(self, tokens: int, seconds: float) -> None:
        """One pass over ``tokens`` new tokens took ``seconds``."""
        self.samples.setdefault(tokens, deque(maxlen=self.window)).append(seconds)
        self.passes += 1
        if self.passes % self.refresh == 0:
            self._update()

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
        ratios = [measured[n] / self.base(n) for n in widths]

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
            highest = max(highest, measured.get(n, self.base(n) * ratio(n)))
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


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares
    (pool-adjacent-violators): each run that decreases is replaced by its weighted mean."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, count = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight
            last[0] = (last[0] * last[1] + mean * weight) / total
            last[1], last[2] = total, last[2] + count
    return [mean for mean, _, count in blocks for _ in range(count)]


_PASS_TIMES = "_specdec_pass_times"  # the attribute of a target that carries its PassTimes


def live_pass_times(model: torch.nn.Module, base: CostCurve) -> PassTimes:
    """The target's PassTimes in its current pass mode (one per loaded model and
    mode, so every pipeline over it, the baseline included, adds its passes),
    started from ``base`` on first use."""
    by_mode = model.__dict__.setdefault(_PASS_TIMES, {})
    mode = exact_passes(model)
    if mode not in by_mode:
        by_mode[mode] = PassTimes(base)
    return by_mode[mode]


def pass_times(model: torch.nn.Module) -> PassTimes | None:
    """The target's PassTimes in its current pass mode if a pipeline over it follows
    its live cost, else None."""
    by_mode = model.__dict__.get(_PASS_TIMES)
    return by_mode.get(exact_passes(model)) if by_mode else None


def fixed_by_environment() -> bool:
    """Whether ``SPECDEC_COST_CURVE`` replaces the measured curve (then nothing is timed live)."""
    return bool(os.environ.get(COST_CURVE_ENV))
