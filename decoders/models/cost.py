"""The target's pass cost T(n): seconds for one forward pass over n new tokens.

Speculative decoding trades sequential passes for wider ones, so T(n)/T(1)
decides what a draft of n tokens may cost. The curve is measured once per
(model, device, dtype) on a fixed context and cached as JSON under
``~/.cache/specdec/costs``. ``SPECDEC_COST_CURVE=FILE`` (a JSON file in the
cache's format, ``{"seconds": {"1": ..., "2": ...}}``) replaces the measurement
everywhere: tests use it so that no decision depends on the machine running
them, and a user can replay another machine's curve. With tau and the draft cost D per round it gives a
pipeline's physical limit: ideal speedup = tau * T(1) / (T(n) + D).

Every row of a pass attends over the whole context, so a wide pass costs more after a
long prompt than after a short one: on SmolLM2-135M in bfloat16 (exact mode), T(8)/T(1)
is 1.06 after 256 tokens, 1.22 after 1,024 and 1.60 after 2,048. The measurement also
times a few widths after ``CONTEXTS`` tokens, and a curve read at a context
(:meth:`CostCurve.at_context`, set by the decode loop each round) adds what those
passes cost beyond the reference context's, interpolated in the context length.

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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.decoders.models.machine import LoadMeter, machine_tag
from specdec.decoders.models.session import ModelSession

REFERENCE_CONTEXT = 256  # tokens before the passes the curve times
CONTEXTS = (1024, 2048)  # longer contexts timed too (CostCurve.context)
CONTEXT_SIZES = (1, 4, 8, 16, 32)  # the widths timed after them
CONTEXT_STEP = 64  # a curve read at a context follows it in steps of this many tokens
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
    interpolated, after ``REFERENCE_CONTEXT`` tokens; with ``context`` (passes timed after
    longer contexts), read at the context set by :meth:`at_context`."""

    seconds: dict[int, float]
    disturbance: float = 1.0  # worst median / fastest repeat of the sweep that measured it
    version: int = 0  # bumped when the seconds change in place (PassTimes), so readers refresh
    # context length -> {n: seconds}: what a pass over n tokens after that many tokens (longer
    # than the reference) cost beyond one after the reference context, timed in the same sweep
    context: dict[int, dict[int, float]] = field(default_factory=dict)
    context_length: int = REFERENCE_CONTEXT  # the context the curve is read at
    measured_s: float = 0.0  # the measurement's seconds (0: read from a file)

    def __call__(self, n: float) -> float:
        return _interpolate(self.seconds, n) + self.extra(n)

    def at(self, n: float, context_length: int) -> float:
        """T(n) after ``context_length`` tokens, whatever context the curve is read at."""
        return _interpolate(self.seconds, n) + self.extra(n, context_length)

    def as_json(self) -> dict:
        """The curve as results files hold it: ``sizes`` and ``seconds`` after the reference
        context, and ``context`` (:attr:`context`, keys as strings) where longer ones were timed."""
        payload: dict = {
            "sizes": sorted(self.seconds),
            "seconds": [self.seconds[n] for n in sorted(self.seconds)],
        }
        if self.context:
            payload["context"] = {
                str(length): {str(n): s for n, s in sorted(by_n.items())}
                for length, by_n in sorted(self.context.items())
            }
        return payload

    @classmethod
    def from_json(cls, payload: dict) -> CostCurve:
        """The curve :meth:`as_json` wrote (a file without ``context`` gives none)."""
        seconds = {int(n): float(s) for n, s in zip(payload["sizes"], payload["seconds"])}
        return cls(seconds, context=_context_of(payload))

    def extra(self, n: float, context_length: int | None = None) -> float:
        """What a pass over n tokens costs after ``context_length`` tokens (default: the
        context it is read at) beyond its cost after the reference context: the measured
        differences, linear in the context length between the measured ones and along the
        last two past them, never negative."""
        length = self.context_length if context_length is None else context_length
        if not self.context or length <= REFERENCE_CONTEXT:
            return 0.0
        points = [(REFERENCE_CONTEXT, 0.0)] + [
            (c, _interpolate(by_n, n)) for c, by_n in sorted(self.context.items())
        ]
        right = next((i for i, (c, _) in enumerate(points) if c >= length), len(points) - 1)
        (c0, e0), (c1, e1) = points[right - 1], points[right]
        return max(e0 + (e1 - e0) * (length - c0) / (c1 - c0), 0.0)

    def at_context(self, length: int) -> None:
        """Read the curve after ``length`` tokens from now on (in steps of
        ``CONTEXT_STEP`` tokens; readers see a new ``version`` when the step changes)."""
        stepped = max(length // CONTEXT_STEP * CONTEXT_STEP, REFERENCE_CONTEXT)
        if self.context and stepped != self.context_length:
            self.context_length = stepped
            self.version += 1

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


def _interpolate(seconds: dict[int, float], n: float) -> float:
    """``seconds`` (by width) at width n, linearly, along the last segment past the widest."""
    sizes = sorted(seconds)
    n = max(n, sizes[0])
    if len(sizes) == 1:
        return seconds[sizes[0]]
    if n >= sizes[-1]:  # extrapolate along the last segment
        a, b = sizes[-2], sizes[-1]
    else:
        b = next(s for s in sizes if s >= n)
        a = sizes[max(sizes.index(b) - 1, 0)]
        if a == b:
            return seconds[a]
    slope = (seconds[b] - seconds[a]) / (b - a)
    return seconds[a] + slope * (n - a)


clock = time.perf_counter  # the sweep's timer (tests replace it to fake a machine's load)
elapsed_clock = time.perf_counter  # the budget's timer (tests replace it to fake a slow model)


BUDGET_S = 20.0  # seconds a measurement aims to take (a 1.5B target's passes fit 2 repeats)
MIN_REPEATS = 2  # timed sweeps at least, whatever the budget


@torch.inference_mode()
def measure_cost_curve(
    model: torch.nn.Module,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    context_len: int = REFERENCE_CONTEXT,
    repeats: int = 5,
    contexts: tuple[int, ...] = CONTEXTS,
    budget_s: float = BUDGET_S,
) -> CostCurve:
    """Time chain passes of each size after a ``context_len``-token prefix, and of
    ``CONTEXT_SIZES`` after each of ``contexts`` (those the model's positions allow), within
    about ``budget_s`` seconds: the first (warm-up) sweep's time sets how many repeats fit
    (``MIN_REPEATS`` to ``repeats``), and a longer context is timed only where its prefill and
    sweeps, estimated from the reference's, still fit. A progress bar counts the passes."""
    started = elapsed_clock()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    longest = max(sizes)
    limit = getattr(model.config, "max_position_embeddings", None) or context_len + longest
    contexts = tuple(c for c in contexts if c > context_len and c + max(CONTEXT_SIZES) <= limit)
    widest = sorted(set(sizes) | (set(CONTEXT_SIZES) if contexts else set()))
    prompt = torch.randint(0, vocab, (max((context_len, *contexts)),), generator=generator).tolist()
    inputs = {n: torch.randint(0, vocab, (n,), generator=generator).tolist() for n in widest}
    with tqdm(desc="[cost] timing T(n)", unit="pass", leave=False, disable=None) as bar:

        def prefilled(length: int) -> ModelSession:
            session = ModelSession(model)
            session.forward(prompt[:length], last_only=True)
            bar.update(1)
            return session

        def sweep(session: ModelSession, length: int, widths, times: dict | None) -> None:
            for n in widths:
                start = clock()
                session.forward(inputs[n])
                elapsed = clock() - start
                if times is not None:
                    times[n].append(elapsed)
                session.truncate(length)
                bar.update(1)

        tick = elapsed_clock()
        reference = prefilled(context_len)
        prefill_s = elapsed_clock() - tick
        tick = elapsed_clock()
        sweep(reference, context_len, sizes, None)  # warms up, and says what a sweep costs
        sweep_s = elapsed_clock() - tick
        fit = int((budget_s - (elapsed_clock() - started)) * 0.6 / max(sweep_s, 1e-9))
        repeats = max(MIN_REPEATS, min(repeats, fit))
        sweeps = [(context_len, sizes, reference)]
        share = len(CONTEXT_SIZES) / len(sizes)
        for length in contexts:  # each only where its prefill and sweeps (estimated) still fit
            estimate = prefill_s * (length / context_len) ** 1.5 + (repeats + 1) * sweep_s * share * 1.5
            if elapsed_clock() - started + estimate + repeats * sweep_s > budget_s:
                break
            session = prefilled(length)
            sweep(session, length, CONTEXT_SIZES, None)
            sweeps.append((length, CONTEXT_SIZES, session))
        bar.total = bar.n + repeats * sum(len(widths) for _, widths, _ in sweeps)
        samples = [{n: [] for n in widths} for _, widths, _ in sweeps]
        for _ in range(repeats):  # sizes interleaved, so drift in machine load hits all alike
            for (length, widths, session), times in zip(sweeps, samples):
                sweep(session, length, widths, times)
    contexts = tuple(length for length, _, _ in sweeps[1:])
    # Other work on the machine only ever adds time, so the fastest of the repeats is
    # the pass's own cost; the median's ratio to it says how disturbed the sweep was.
    fastest = [{n: min(times) for n, times in by_n.items()} for by_n in samples]
    # what the longer context adds, never less for a wider pass (the extra rows attend over it too)
    extra = []
    for by_n in fastest[1:]:
        widths = sorted(by_n)
        added = non_decreasing([by_n[n] - _interpolate(fastest[0], n) for n in widths], [1.0] * len(widths))
        extra.append({n: max(e, 0.0) for n, e in zip(widths, added)})
    curve = CostCurve(fastest[0], context=dict(zip(contexts, extra)))
    curve.disturbance = max(sorted(times)[len(times) // 2] / min(times) for times in samples[0].values())
    curve.measured_s = elapsed_clock() - started
    return curve


# 6: passes also timed after longer contexts (CostCurve.context).
# Bumped when the pass routing (decoders/models/kernels.py) changes what a pass costs,
# so that curves cached under older kernels are measured again. 2: single rows on the
# narrow route, its products over row-major inputs. 3: exact mode's default route computes
# passes wider than its measured widest invariant product in blocks. 4: float32 passes of
# 5 rows and more on oneDNN's packed linear. 5: bfloat16 passes on oneDNN's packed linear.
KERNELS_VERSION = 6

OTHER_LOAD = 0.25  # other work's share of the CPUs during a measurement above which it is not cached


COST_CURVE_ENV = "SPECDEC_COST_CURVE"


def _context_of(payload: dict) -> dict[int, dict[int, float]]:
    """:attr:`CostCurve.context` from a file's ``"context"`` (string keys; none if absent)."""
    return {
        int(length): {int(n): float(s) for n, s in by_n.items()}
        for length, by_n in (payload.get("context") or {}).items()
    }


def read_cost_curve(path: str | Path) -> CostCurve:
    """A curve saved in the cache's format (``{"seconds": {"n": seconds}}``, and optionally
    ``"context": {"length": {"n": extra seconds}}``, :attr:`CostCurve.context`)."""
    try:
        data = json.loads(Path(path).read_text())
        seconds = {int(n): float(s) for n, s in data["seconds"].items()}
        if 1 not in seconds or any(s <= 0 for s in seconds.values()):
            raise ValueError("it needs a positive time for a 1-token pass, and positive times only")
        return CostCurve(seconds, context=_context_of(data))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"cannot read a cost curve from {path} ({error}); it must be JSON like "
            '{"seconds": {"1": 0.040, "8": 0.043}}, e.g. a file from ~/.cache/specdec/costs'
        ) from error


def cached_cost_curve(model: torch.nn.Module, key: str, cache_dir: Path, exact: bool = False) -> CostCurve:
    """The cost curve of ``model`` (named ``key``): ``SPECDEC_COST_CURVE``'s file if set, else
    the cached measurement, measured on first use (exact mode, ``model.exact``, has its own),
    per model, device, dtype, kernels version and machine (:func:`machine_tag`: the CPU, the
    threads and the library versions). It is cached unless other work took more than
    ``OTHER_LOAD`` of the machine's CPUs while it ran (:class:`LoadMeter`, a measure of the
    machine, not of the curve: a pass's own noise does not stop it); then it is measured once
    more, and if the machine is still busy, the quieter one is used for this run (the target
    keeps it for its life, :meth:`specdec.decoders.models.target.Target.cost_curve`) and not
    written, so one busy moment does not steer every later run."""
    if os.environ.get(COST_CURVE_ENV):
        return read_cost_curve(os.environ[COST_CURVE_ENV])
    parameter = next(model.parameters())
    device = parameter.device.type
    dtype = str(parameter.dtype).removeprefix("torch.")
    mode = "-exact" if exact else ""
    path = cache_dir / f"{key}-{device}-{dtype}{mode}-k{KERNELS_VERSION}-{machine_tag()}.json"
    if path.exists():
        return read_cost_curve(path)
    meter = LoadMeter()
    curve, busy = measure_cost_curve(model), meter.share()
    if busy is not None and busy > OTHER_LOAD:
        meter = LoadMeter()
        again, busy_again = measure_cost_curve(model), meter.share()
        if busy_again is not None and busy_again < busy:
            curve, busy = again, busy_again
    if busy is not None and busy > OTHER_LOAD:
        print(
            f"[cost] T(n) measured in {curve.measured_s:.1f} s while other work kept {busy:.0%} of the CPUs "
            "busy: used for this run, not cached; it is measured again when the machine is quiet",
            file=sys.stderr,
        )
        return curve
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "key": key,
        "device": device,
        "dtype": dtype,
        "seconds": curve.seconds,
        "context": curve.context,
    }
    path.write_text(json.dumps(payload, indent=1))
    load = "" if busy is None else f", other work {busy:.0%} of the CPUs"
    print(f"[cost] T(n) measured in {curve.measured_s:.1f} s{load}; cached in {path}", file=sys.stderr)
    return curve


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


def fixed_by_environment() -> bool:
    """Whether ``SPECDEC_COST_CURVE`` replaces the measured curve (then nothing is timed live)."""
    return bool(os.environ.get(COST_CURVE_ENV))
