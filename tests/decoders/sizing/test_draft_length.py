"""The draft-length policy: drafts what pays under the cost curve, nothing when nothing is accepted."""

from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.draft_length import DraftLengthPolicy


def curve(per_extra_token: float) -> CostCurve:
    return CostCurve({n: 1.0 + per_extra_token * (n - 1) for n in (1, 2, 4, 8, 16)})


def test_new_situation_drafts_in_full_then_follows_acceptance():
    policy = DraftLengthPolicy(5, lambda: curve(0.05))
    assert policy.choose("a", 5) == 5  # optimistic until measured: try everything
    for _ in range(50):
        policy.record("a", 5, 0)  # the first token is always rejected
    assert policy.rate("a", 1) < 0.05
    choices = [policy.choose("a", 5) for _ in range(16)]
    assert choices == [0] * 15 + [1]  # retried after 16 rounds
    for _ in range(50):
        policy.record("b", 5, 5)  # always fully accepted
    assert policy.choose("b", 5) == 5
    assert policy.choose("b", 3) == 3  # never more than the candidates


def test_probes_back_off_while_a_situation_stays_off_and_reset_when_it_pays():
    """A probe that leaves its situation off doubles the wait before the next one (16, 32,
    64, then 128 at most); a situation that pays again is probed at the base rate once it
    is off again. Situations keep their own waits."""
    policy = DraftLengthPolicy(4, lambda: curve(0.05))
    for _ in range(50):
        policy.record("a", 4, 0)
    probes = [i for i in range(16 + 32 + 64 + 128 + 128 + 128) if policy.choose("a", 4)]
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps == [16, 32, 64, 128, 128, 128]
    assert policy.choose("b", 4) == 4  # another situation, optimistic until measured
    for _ in range(200):
        policy.record("a", 4, 4)  # "a" pays again
    assert policy.choose("a", 4) == 4
    for _ in range(10000):
        policy.record("a", 4, 0)
    assert policy.rate("a", 1) < 0.05
    assert [policy.choose("a", 4) for _ in range(16)] == [0] * 15 + [1]  # base wait again


def test_length_stops_where_acceptance_stops_paying():
    policy = DraftLengthPolicy(6, lambda: curve(0.2))
    for _ in range(200):
        policy.record("k", 6, 2)  # the first two are accepted, the third never
    assert policy.choose("k", 6) == 2
    assert abs(policy.expected_tokens("k", 2) - 3.0) < 1e-9
    # pooled over requests: 0 of 200 with one optimistic pseudo-observation; the request's own
    # record (the same 200 rounds) makes it surer still
    assert abs(policy.stats.pooled(("k", 3)) - 1 / 201) < 1e-9
    assert 0 < policy.expected_tokens("k", 3) - 3.0 < 1 / 201


def test_noisy_curve_does_not_reward_wider_passes():
    noisy = CostCurve({1: 1.0, 2: 1.5, 3: 1.2, 4: 1.6})  # T(3) < T(2): measurement noise
    policy = DraftLengthPolicy(3, lambda: noisy)
    for _ in range(100):
        policy.record("x", 3, 1)  # depth 1 accepted, depth 2 never
    assert policy.choose("x", 3) == 1


def test_as_dict_reports_measured_rates():
    policy = DraftLengthPolicy(3, lambda: curve(0.1))
    policy.record(2, 3, 1)
    rates = policy.as_dict()["2"]
    assert rates["depth1"]["tried"] == 1 and rates["depth2"]["tried"] == 1
    assert "depth3" not in rates


def test_flat_curve_drafts_what_is_ever_accepted_and_steep_curve_drafts_nothing():
    """The same acceptance (half of depth-1 tokens, a quarter of depth-2 ones), two
    machines: where wide passes are free every depth that is sometimes accepted pays;
    where every token costs a full pass (T(n) = n) no draft can pay for itself."""
    rounds = [2, 1, 0, 0] * 25  # accepted tokens of 100 drafts of 3, in every situation alike
    flat = DraftLengthPolicy(3, lambda: curve(0.0))
    steep = DraftLengthPolicy(3, lambda: curve(1.0))
    for accepted in rounds:
        flat.record("s", 3, accepted)
        steep.record("s", 3, accepted)
    assert flat.choose("s", 3) == 2  # depth 3 was never accepted: (0 + 1) / (26) < 1% gain
    assert steep.choose("s", 3) == 0
