"""The measured pass-cost curve T(n): other work on the machine only adds time, so a
sweep keeps each size's fastest repeat, and a sweep disturbed by load is used for
its run but never cached. Timing is faked here: no assertion reads this machine's speed."""

from __future__ import annotations

import itertools

import pytest

from decoders.models import cost
from decoders.models.cost import COST_CURVE_ENV, cached_cost_curve


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


@pytest.fixture
def measuring(monkeypatch):
    monkeypatch.delenv(COST_CURVE_ENV, raising=False)  # measure, as a user's run does
    monkeypatch.setattr(cost, "_UNCACHED", {})

    def use(clock: FakeClock) -> None:
        monkeypatch.setattr(cost, "clock", clock)

    return use


def test_a_quiet_sweep_is_cached_at_each_sizes_fastest_repeat(tiny_model, tmp_path, measuring):
    model, _ = tiny_model
    measuring(FakeClock(spike_every=7))  # an occasional spike: the median is still 1.0
    curve = cached_cost_curve(model, "tiny", tmp_path)
    assert set(curve.seconds.values()) == {1.0} and curve.disturbance == 1.0
    assert list(tmp_path.glob("tiny-*.json"))


def test_a_sweep_under_load_is_used_but_not_cached(tiny_model, tmp_path, measuring, capsys):
    model, _ = tiny_model
    measuring(FakeClock(spike_every=2))  # every other pass disturbed, both sweeps
    curve = cached_cost_curve(model, "tiny", tmp_path)
    assert curve.disturbance > cost.DISTURBED and set(curve.seconds.values()) == {1.0}
    assert not list(tmp_path.glob("tiny-*.json"))
    assert "not cached" in capsys.readouterr().err
    measuring(FakeClock())  # a quiet machine now, but this process keeps what it measured
    assert cached_cost_curve(model, "tiny", tmp_path) is curve
