"""The measured pass-cost curve T(n): other work on the machine only adds time, so a
sweep keeps each size's fastest repeat; it fits a time budget; a curve measured while other
work took the machine's CPUs is used for its run but never cached. Timing is faked here: no assertion reads this machine's speed."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from specdec.decoders import Pipeline
from specdec.decoders.models import cost
from specdec.decoders.models.cost import COST_CURVE_ENV, cached_cost_curve
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.pass_times import PassTimes
from specdec.decoders.models.target import Target
from specdec.decoders.sizing.draft_length import DraftLengthPolicy
from tests.conftest import random_prompts


class FakeClock:
    """perf_counter whose timed passes last 1.0 s, except every ``spike_every``-th,
    which lasts ``spike`` s (a burst of other work)."""

    def __init__(self, spike_every: int = 0, spike: float = 3.0) -> None:
        self.now, self.calls, self.spike_every, self.spike = 0.0, itertools.count(), spike_every, spike

    def __call__(self) -> float:
        call = next(self.calls)
        if call % 2:  # the end of a timed pass
            disturbed = self.spike_every and (call // 2) % self.spike_every == 0
            self.now += self.spike if disturbed else 1.0
        return self.now


class FakeMeter:
    """LoadMeter whose every measurement finds other work taking ``share`` of the CPUs."""

    shares: list[float] = [0.0]

    def share(self) -> float:
        return FakeMeter.shares.pop(0) if len(FakeMeter.shares) > 1 else FakeMeter.shares[0]


@pytest.fixture
def measuring(monkeypatch):
    """``measuring(clock, busy=...)``: passes timed by ``clock``, the machine's other work
    measured as ``busy`` (a share, or a list of shares, one per measurement)."""
    monkeypatch.delenv(COST_CURVE_ENV, raising=False)  # measure, as a user's run does
    monkeypatch.setattr(cost, "LoadMeter", FakeMeter)

    def use(clock: FakeClock, busy: float | list[float] = 0.0) -> None:
        monkeypatch.setattr(cost, "clock", clock)
        FakeMeter.shares = list(busy) if isinstance(busy, list) else [busy]

    return use


def test_a_quiet_sweep_is_cached_at_each_sizes_fastest_repeat(tiny_model, tmp_path, measuring, capsys):
    model, _ = tiny_model
    measuring(FakeClock(spike_every=7))  # an occasional spike: the median is still 1.0
    curve = cached_cost_curve(model, "tiny", tmp_path)
    assert set(curve.seconds.values()) == {1.0} and curve.disturbance == 1.0
    (written,) = tmp_path.glob("tiny-*.json")
    assert written.name.endswith(f"-k{cost.KERNELS_VERSION}-{cost.machine_tag()}.json")  # this machine's
    assert (
        f"[cost] T(n) measured in {curve.measured_s:.1f} s, other work 0% of the CPUs; cached"
        in capsys.readouterr().err
    )


def test_a_curve_noisy_in_itself_on_a_quiet_machine_is_cached(tiny_model, tmp_path, measuring):
    """Whether a curve is cached is decided by the machine's other work, not by the curve's own
    spread: every other pass slow, nothing else running, and it is kept."""
    model, _ = tiny_model
    measuring(FakeClock(spike_every=2), busy=0.05)
    curve = cached_cost_curve(model, "tiny", tmp_path)
    assert curve.disturbance > 1.25 and set(curve.seconds.values()) == {1.0}
    assert list(tmp_path.glob("tiny-*.json"))


def test_a_curve_measured_on_a_busy_machine_is_used_but_not_cached(tiny_model, tmp_path, measuring, capsys):
    model, _ = tiny_model
    measuring(FakeClock(), busy=[0.6, 0.5])  # other work took half the CPUs, both times
    curve = cached_cost_curve(model, "tiny", tmp_path)
    assert set(curve.seconds.values()) == {1.0}
    assert not list(tmp_path.glob("tiny-*.json"))
    assert (
        "while other work kept 50% of the CPUs busy: used for this run, not cached" in capsys.readouterr().err
    )
    measuring(FakeClock(), busy=0.0)  # a quiet machine now: measured again, and this time cached
    cached_cost_curve(model, "tiny", tmp_path)
    assert list(tmp_path.glob("tiny-*.json"))
    measuring(FakeClock(), busy=[0.6, 0.1])  # busy, then quiet on the second try: cached
    cached_cost_curve(model, "other", tmp_path)
    assert list(tmp_path.glob("other-*.json"))


def test_a_target_keeps_its_uncached_curve_for_its_life(tiny_model, tmp_path, measuring):
    """A curve measured under load is not cached, but its target keeps it: the pipelines
    over that target do not measure again (nothing held in a module global)."""
    target = Target(tiny_model[0])
    measuring(FakeClock(), busy=0.9)
    curve = target.cost_curve("tiny", tmp_path)
    assert not list(tmp_path.glob("tiny-*.json"))
    measuring(FakeClock())
    assert target.cost_curve("tiny", tmp_path) is curve
    assert Target(tiny_model[0]).cost_curve("tiny", tmp_path) is not curve  # another target measures


def test_a_measurement_fits_its_budget_by_repeating_less_and_skipping_long_contexts(
    tiny_model, measuring, monkeypatch
):
    """The warm-up sweep's time sets the repeats (at least MIN_REPEATS), and a longer context is
    timed only where its prefill and sweeps fit (here a sweep takes 10 s of a 20 s budget)."""
    model, _ = tiny_model
    measuring(FakeClock())
    calls = Counter()
    real = cost.ModelSession
    ticks = iter(range(0, 10_000, 5))  # each call of the budget's clock: 5 s later

    class Session(real):
        def forward(self, tokens, *args, **kwargs):
            calls[len(tokens)] += 1
            return super().forward(tokens, *args, **kwargs)

    monkeypatch.setattr(cost, "ModelSession", Session)
    monkeypatch.setattr(cost, "elapsed_clock", lambda: float(next(ticks)))
    curve = cost.measure_cost_curve(model, sizes=(1, 2, 4), contexts=(1024,), budget_s=20.0)
    assert calls[1] == 1 + cost.MIN_REPEATS  # warm-up, then the fewest repeats
    assert curve.context == {}  # the long context did not fit
    measuring(FakeClock())
    calls.clear()
    ticks = iter(range(0, 10_000, 5))
    roomy = cost.measure_cost_curve(model, sizes=(1, 2, 4), contexts=(1024,), budget_s=1000.0)
    assert calls[1] == 2 * (1 + 5) and set(roomy.context) == {1024}  # every repeat, at both contexts


# ---------------------------------------------------------------- the live curve


def test_the_live_curve_takes_each_timed_widths_median_and_the_base_shape_between():
    base = cost.CostCurve({1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0})
    times = PassTimes(base, window=8, min_samples=3, refresh=1)
    for seconds in (2.0, 9.0, 2.0):  # a spike among width 1's passes: the median ignores it
        times.record(1, seconds)
    assert times.curve.seconds == {1: 2.0, 2: 2.0, 4: 2.0, 8: 4.0}  # one width timed: all scale with it
    for _ in range(3):
        times.record(4, 4.0)  # width 4 runs at 4x its base, width 1 at 2x
    assert times.curve.seconds[4] == 4.0 and times.curve.seconds[1] == 2.0
    assert times.curve.seconds[2] == pytest.approx(1.0 * (2.0 + (4.0 - 2.0) / 3))  # ratio interpolated
    assert times.curve.seconds[8] == 8.0  # past the widest timed width: its ratio
    assert times.base.seconds == {1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0}  # the cached curve is not touched
    assert times.describe() == {"sizes": [1, 4], "seconds": [2.0, 4.0], "passes": [3, 3], "total_passes": 6}


def test_a_wider_pass_is_never_taken_as_cheaper():
    """Medians that fall with width (passes timed at other moments) are pooled into their
    weighted mean, and widths between follow the running maximum: the sizing cannot be
    drawn to a width by its noise."""
    assert cost.non_decreasing([3.0, 1.0, 2.0, 5.0], [1, 1, 2, 1]) == [2.0, 2.0, 2.0, 5.0]
    assert cost.non_decreasing([1.0, 2.0], [5, 1]) == [1.0, 2.0]
    times = PassTimes(cost.CostCurve({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 8: 1.0}), min_samples=1, refresh=1)
    for width, seconds in [(1, 0.110), (1, 0.110), (1, 0.110), (3, 0.090), (4, 0.125)]:
        times.record(width, seconds)
    curve = times.curve.seconds
    assert curve[1] == curve[2] == curve[3] == pytest.approx((3 * 0.110 + 0.090) / 4)
    assert curve[4] == curve[8] == 0.125
    assert times.describe()["seconds"] == [0.110, 0.090, 0.125]  # what was timed, as timed


def test_the_live_curve_changes_only_every_refresh_passes_and_with_enough_samples():
    times = PassTimes(cost.CostCurve({1: 1.0, 4: 1.0}), min_samples=4, refresh=4)
    for _ in range(3):
        times.record(1, 5.0)
    assert times.curve.version == 0 and times.curve.seconds == {1: 1.0, 4: 1.0}
    times.record(4, 5.0)  # a refresh, but no width has 4 samples yet
    assert times.curve.version == 0
    for _ in range(4):
        times.record(1, 5.0)
    assert times.curve.version == 1 and times.curve.seconds == {1: 5.0, 4: 5.0}


def test_the_sizing_follows_the_live_curve():
    """A chain drafted in full on the cached flat curve stops being drafted once the passes
    timed show that a pass over two tokens costs ten times one over one, more than the five
    tokens a round of four accepted ones gives (PassSeconds re-reads the curve when it
    changes)."""
    times = PassTimes(cost.CostCurve({1: 1.0, 2: 1.0, 8: 1.0}), min_samples=1, refresh=1)
    policy = DraftLengthPolicy(4, lambda: times.curve)
    for _ in range(20):
        policy.record("k", 4, 4)  # every drafted token accepted
    assert policy.choose("k", 4) == 4
    times.record(1, 1.0)
    times.record(2, 10.0)
    assert policy.choose("k", 4) == 0


def test_generation_times_its_passes_for_the_live_curve(measuring, tmp_path):
    """With live cost on (the default) and no fixed curve, the proposer's sizing reads
    the target's PassTimes, and every verification pass of every pipeline over the
    target (the baseline's too) is recorded under its width; with it off, none is."""
    measuring(FakeClock())  # the cached curve: every width 1.0 s
    model, tokenizer = load_model(ModelConfig(name="tiny-random", dtype="float64", device="cpu"))
    prompt = random_prompts(1, seed=3)[0]
    off = Pipeline(
        model, tokenizer, {"name": "ngram"}, model_config=ModelConfig(name="tiny-random", live_cost=False)
    )
    off.context.cost_curve()
    off.generate(prompt)
    assert model.pass_times() is None
    speculative = Pipeline(model, tokenizer, {"name": "ngram"}, model_config=ModelConfig(name="tiny-random"))
    assert speculative.context.cost_curve() is model.pass_times().curve
    result = speculative.generate(prompt, max_new_tokens=24)
    baseline = speculative.with_components(None, None).generate(prompt, max_new_tokens=8)
    widths = Counter(size + 1 for size in result.stats.draft_sizes)  # the pending token + the draft
    widths[1] += baseline.stats.target_passes
    recorded = {n: len(samples) for n, samples in model.pass_times().samples.items()}
    assert recorded == dict(widths) and baseline.stats.target_passes and max(widths) > 1


# ---------------------------------------------------------------- passes after long contexts


def _context_curve() -> cost.CostCurve:
    """1.0 s for any width after 256 tokens; after 1,024 each token past the first adds
    0.1 s, after 2,048 0.3 s (``context`` holds what is added)."""
    return cost.CostCurve(
        {1: 1.0, 8: 1.0, 16: 1.0},
        context={1024: {1: 0.0, 8: 0.7, 16: 1.5}, 2048: {1: 0.0, 8: 2.1, 16: 4.5}},
    )


def test_a_curve_read_after_a_long_context_adds_what_those_passes_cost():
    curve = _context_curve()
    assert curve(8) == 1.0  # read at the reference context
    curve.at_context(1024)
    assert curve(8) == pytest.approx(1.7) and curve(16) == pytest.approx(2.5) and curve(1) == 1.0
    assert curve(4) == pytest.approx(1.3)  # between measured widths: linear in n
    curve.at_context(1536)  # between measured contexts: linear in the context length
    assert curve(8) == pytest.approx(1.0 + (0.7 + 2.1) / 2)
    curve.at_context(3072)  # past the longest: along the last two
    assert curve(8) == pytest.approx(1.0 + 2.1 + 1.4)
    curve.at_context(100)  # shorter than the reference: the reference curve
    assert curve(8) == 1.0
    assert cost.CostCurve({1: 1.0, 8: 1.0}).extra(8, 4096) == 0.0  # nothing measured: nothing added


def test_a_context_read_changes_the_version_only_when_its_step_changes():
    curve = _context_curve()
    curve.at_context(1024)
    version = curve.version
    curve.at_context(1024 + cost.CONTEXT_STEP - 1)
    assert curve.version == version
    curve.at_context(1024 + cost.CONTEXT_STEP)
    assert curve.version == version + 1
    flat = cost.CostCurve({1: 1.0})  # no context passes: reading at a context changes nothing
    flat.at_context(4096)
    assert flat.version == 0 and flat(1) == 1.0


def test_the_sizing_sends_smaller_drafts_after_long_contexts():
    """The same acceptance estimates: 12 nodes after a short prompt, fewer after 1,024
    tokens, fewer still after 2,048 (PassSeconds re-reads the curve at each context)."""
    from specdec.decoders.sizing.search import PassSeconds, best_size

    curve = _context_curve()
    seconds = PassSeconds(lambda: curve, 16)
    values = [0.9 ** (i + 1) for i in range(15)]
    sizes = []
    for length in (256, 1024, 2048):
        curve.at_context(length)
        sizes.append(best_size(values, seconds())[0])
    assert sizes[0] == 15 and sizes[0] > sizes[1] > sizes[2] >= 1, sizes


def test_live_passes_are_kept_as_after_the_reference_context():
    """A pass timed after 2,048 tokens is kept net of what the context adds, so the live
    curve's level stays the reference context's, and read at 2,048 it gives the pass back."""
    times = PassTimes(_context_curve(), min_samples=1, refresh=1)
    times.at_context(2048)
    times.record(8, 3.1 * 1.5)  # the machine runs 1.5x slower than the cached curve
    assert times.measured()[8] == pytest.approx(3.1 * 1.5 - 2.1)
    assert times.curve(8) == pytest.approx(3.1 * 1.5)
    times.at_context(256)
    assert times.curve(8) == pytest.approx(3.1 * 1.5 - 2.1)


def test_the_cache_keeps_the_passes_after_long_contexts(tiny_model, tmp_path, measuring):
    model, _ = tiny_model
    measuring(FakeClock())
    measured = cached_cost_curve(model, "tiny", tmp_path)
    assert set(measured.context) == set(cost.CONTEXTS)  # the tiny model's 4,096 positions allow both
    assert all(set(by_n) == set(cost.CONTEXT_SIZES) for by_n in measured.context.values())
    assert all(extra == 0.0 for by_n in measured.context.values() for extra in by_n.values())  # 1 s each
    (path,) = tmp_path.glob("tiny-*.json")
    assert cost.read_cost_curve(path).context == measured.context


def test_generation_reads_the_curve_at_its_context(measuring):
    """The decode loop sets the live curve's context before each round: after a
    1,100-token prompt the sizing reads T(n) as after 1,088 tokens (steps of 64)."""
    measuring(FakeClock())
    model, tokenizer = load_model(ModelConfig(name="tiny-random", dtype="float64", device="cpu"))
    pipeline = Pipeline(model, tokenizer, {"name": "ngram"}, model_config=ModelConfig(name="tiny-random"))
    curve = pipeline.context.cost_curve()
    assert curve.context  # the measured curve has passes after longer contexts
    prompt = (random_prompts(1, seed=5)[0] * 100)[:1100]
    pipeline.generate(prompt, max_new_tokens=2)
    assert curve.context_length == 1088
    pipeline.generate(prompt[:300], max_new_tokens=2)
    assert curve.context_length == 256


def test_what_a_long_context_adds_is_never_less_for_a_wider_pass(tiny_model, monkeypatch, measuring):
    """Timing noise can make a wider pass after a long context look as if the context
    added less to it than to a narrower one; the measured extras are fitted non-decreasing."""
    model, _ = tiny_model
    measuring(FakeClock())
    real = cost.ModelSession

    class Session(real):  # after 1,024 tokens: 1 token +0.5 s, 4 tokens +0.0 s, 8 and wider +0.6 s and more
        def forward(self, tokens, *args, **kwargs):
            if len(self) == 1024:
                cost.clock.now += {1: 0.5, 8: 0.6, 16: 0.7, 32: 0.8}.get(len(tokens), 0.0)
            return super().forward(tokens, *args, **kwargs)

    monkeypatch.setattr(cost, "ModelSession", Session)
    curve = cost.measure_cost_curve(model, sizes=(1, 4, 8), contexts=(1024,))
    added = curve.context[1024]
    assert added[1] == pytest.approx(0.25) and added[4] == pytest.approx(0.25)  # pooled
    assert added[8] == pytest.approx(0.6) and added[8] <= added[16] <= added[32]


def test_measuring_the_curve_is_never_counted_in_a_requests_stats(measuring, monkeypatch, tmp_path):
    """The first request of a pipeline that sizes its drafts measures T(n) before its clock
    starts: none of its times (draft, verify, wall) holds the measurement's seconds."""
    import time

    measuring(FakeClock())
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # no curve cached yet: this run measures
    real = cost.measure_cost_curve

    def slow(model, *args, **kwargs):
        time.sleep(1.0)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(cost, "measure_cost_curve", slow)
    model, tokenizer = load_model(ModelConfig(name="tiny-random", dtype="float64", device="cpu"))
    pipeline = Pipeline(model, tokenizer, {"name": "ngram"}, model_config=ModelConfig(name="tiny-random"))
    started = time.perf_counter()
    stats = pipeline.generate(random_prompts(1, seed=5)[0], max_new_tokens=8).stats
    assert time.perf_counter() - started > 1.0  # it was measured, during this call
    assert stats.wall_time < 0.5 and stats.draft_time < 0.5 and stats.verify_time < 0.5
