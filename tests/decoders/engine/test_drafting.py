"""Drafting as steps: alone each work is a call of its own; together, works with one key
run as one call, every request gets its own part back, and its clock its share."""

import time

import pytest

from specdec.decoders.engine.drafting import DraftClock, Work, draft_together, run_alone


class Scale(Work):
    """A fake model call: multiply ``values`` by the model's factor. Calls are logged, so a
    test sees which works ran together."""

    calls: list[list[int]] = []

    def __init__(self, model: int, values: list[int], seconds: float = 0.0) -> None:
        self.model, self.values, self.seconds = model, values, seconds

    @property
    def rows(self) -> int:
        return len(self.values)

    def key(self) -> int:
        return self.model

    @classmethod
    def run_together(cls, works):
        cls.calls.append([len(work.values) for work in works])
        time.sleep(works[0].seconds)
        return [[v * work.model for v in work.values] for work in works]


def steps(model: int, rounds: int, start: int, seconds: float = 0.0):
    """A drafting that asks ``rounds`` calls in turn, each on the last one's result."""
    values = [start, start + 1]
    for _ in range(rounds):
        values = yield Scale(model, values, seconds)
    return sum(values)


@pytest.fixture(autouse=True)
def _log():
    Scale.calls = []


def test_alone_every_work_is_a_call_of_its_own():
    assert run_alone(steps(2, 3, 1)) == (1 + 2) * 8
    assert Scale.calls == [[2], [2], [2]]


def test_together_works_with_one_key_are_one_call_and_each_gets_its_own_result():
    clocks = [DraftClock() for _ in range(3)]
    results = draft_together([steps(2, 2, 1), steps(2, 3, 10), steps(3, 1, 5)], clocks)
    assert results == [run_alone(steps(2, 2, 1)), run_alone(steps(2, 3, 10)), run_alone(steps(3, 1, 5))]
    Scale.calls = Scale.calls[: -(2 + 3 + 1)]  # (the run_alone references above)
    # step 1: both model-2 drafts in one call, the model-3 one apart; then the two
    # model-2 drafts together once more; then the longer one alone
    assert sorted(map(sorted, Scale.calls[:2])) == [[2], [2, 2]]
    assert Scale.calls[2:] == [[2, 2], [2]]


def test_a_request_is_timed_on_its_share_of_the_joint_calls():
    clocks = [DraftClock(), DraftClock()]
    draft_together([steps(2, 1, 1, seconds=0.2), steps(2, 1, 1, seconds=0.2)], clocks)
    # one joint call of 0.2 s, two rows each: 0.1 s apiece, not 0.2
    assert all(0.09 < clock.seconds < 0.15 for clock in clocks)


def test_a_clock_runs_while_its_request_drafts():
    clock = DraftClock()
    clock.resume()
    time.sleep(0.05)
    assert clock() >= 0.05  # live, before the pause
    clock.pause()
    frozen = clock()
    time.sleep(0.02)
    assert clock() == frozen


def test_a_drafting_with_no_step_returns_at_once():
    def nothing():
        return "draft"
        yield

    assert run_alone(nothing()) == "draft"
    assert draft_together([nothing(), steps(2, 1, 0)], [DraftClock(), DraftClock()]) == ["draft", 2]
