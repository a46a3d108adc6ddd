"""Sizing follows the request in hand: the statistics across requests are its prior, the
request's own record and its situation (how its last drafted round ended) the verdict."""

import random

import pytest

from specdec.decoders.engine.draft import Draft
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.acceptance import MISSED, OPENING, PARTIAL, WHOLE, AcceptanceStats
from specdec.decoders.sizing.draft_length import DraftLengthPolicy
from specdec.decoders.sizing.policy import RankedNodes
from specdec.decoders.sizing.search import Probe, start_request


def curve(per_extra_token: float) -> CostCurve:
    return CostCurve({n: 1.0 + per_extra_token * (n - 1) for n in (1, 2, 4, 8, 16, 32)})


def chain(length: int) -> Draft:
    return Draft.chain(list(range(length)))


def test_situation_is_how_the_last_drafted_round_ended():
    stats = AcceptanceStats.measured()
    assert stats.situation == OPENING
    keys = ["a", "b", "c"]
    stats.record(chain(3), keys, path=[])
    assert stats.situation == MISSED
    stats.record(chain(3), keys, path=[0])
    assert stats.situation == PARTIAL
    stats.record(chain(3), keys, path=[0, 1, 2])  # the drafter ran out, not the target
    assert stats.situation == WHOLE
    stats.record(Draft.empty(), [], path=[])  # nothing tried: the situation stays
    assert stats.situation == WHOLE
    # a tree whose accepted path reaches a leaf is whole, though a sibling was rejected
    tree = Draft([1, 2, 3], [-1, -1, 0])
    stats.record(tree, ["a", "a", "b"], path=[0, 2])
    assert stats.situation == WHOLE
    stats.start_request()
    assert stats.situation == OPENING and not stats.request_tried


def drafted_lengths(policy: DraftLengthPolicy, accept: float, rounds: int, rng: random.Random) -> list[int]:
    """One request of ``rounds`` rounds whose drafted tokens are each accepted with chance
    ``accept`` (given the ones before): the lengths the policy chose."""
    policy.stats.start_request()
    lengths = []
    for _ in range(rounds):
        length = policy.choose("n", 16)
        lengths.append(length)
        if length:
            accepted = 0
            while accepted < length and rng.random() < accept:
                accepted += 1
            policy.record("n", length, accepted)
    return lengths


def streak_after_poor_requests(pooled_rules: bool) -> list[int]:
    """The issue's streak: 20 requests whose drafts are mostly rejected, then one whose
    drafts the target accepts almost whole (0.97 a token). On a bfloat16-like curve."""
    rng = random.Random(0)
    policy = DraftLengthPolicy(16, lambda: curve(0.034))
    if pooled_rules:  # as before: the statistics across requests are the verdict
        policy.stats.request_weight = policy.stats.situation_weight = 1e9
        policy.stats.explore = 0.0
    for _ in range(20):
        drafted_lengths(policy, 0.3, 30, rng)
    return drafted_lengths(policy, 0.97, 12, rng)


def test_a_request_that_accepts_what_earlier_ones_rejected_is_sized_by_its_own_record():
    lengths = streak_after_poor_requests(pooled_rules=False)
    # longer drafts where they hold, within a few rounds (the pooled prior alone: 1 or 2)
    assert min(lengths[-6:]) >= 8, lengths


def test_a_workload_that_always_accepts_drafts_its_longest():
    rng = random.Random(0)
    policy = DraftLengthPolicy(16, lambda: curve(0.034))
    for _ in range(5):
        drafted_lengths(policy, 0.97, 30, rng)
    assert min(drafted_lengths(policy, 0.97, 12, rng)) == 16


def test_without_the_request_layer_the_pooled_prior_would_rule():
    """The check can fail: with the request's and the situations' weights so large that the
    pooled counts rule (the sizing before), the same streak gets one-token drafts."""
    lengths = streak_after_poor_requests(pooled_rules=True)
    assert max(lengths) <= 2, lengths


def test_situations_pool_across_requests():
    """After a draft accepted whole the next is too, in every request: what earlier requests
    measured in that situation is the request's prior in it."""
    stats = AcceptanceStats.measured()
    keys = ["d1", "d2"]
    for _ in range(50):
        stats.start_request()
        stats.record(chain(2), keys, path=[])  # opening: missed
        stats.record(chain(2), keys, path=[])  # after a miss: missed
        stats.record(chain(2), keys, path=[])
    for _ in range(50):
        stats.start_request()
        stats.situation = WHOLE
        stats.record(chain(2), keys, path=[0, 1])  # after a whole draft: whole again
    stats.start_request()
    stats.situation = WHOLE
    assert stats.rate("d1") > 0.9
    stats.situation = MISSED
    assert stats.rate("d1") < 0.1
    assert stats.pooled("d1") == pytest.approx(50 / 200)


def test_a_batch_request_keeps_its_own_counts_over_shared_pooled_ones():
    policy = DraftLengthPolicy(8, lambda: curve(0.02))
    one, other = policy.for_request(), policy.for_request()
    one.record("n", 4, 4)
    assert one.stats.tried is other.stats.tried is policy.stats.tried  # pooled: shared
    assert one.stats.request_tried and not other.stats.request_tried
    assert one.stats.situation == WHOLE and other.stats.situation == OPENING
    assert isinstance(one._probe, Probe) and one._probe is not other._probe


def test_start_request_reaches_every_sizer_of_a_proposer_and_its_members():
    class Member:
        def __init__(self) -> None:
            self.policy = DraftLengthPolicy(4, lambda: curve(0.02))
            self.sizer = RankedNodes(lambda: curve(0.02), 8, explore_every=4)

        def propose(self, state):
            return Draft.empty()

    class Joined:
        def __init__(self) -> None:
            self.members = [Member(), Member()]
            self.inner = Member()

        def propose(self, state):
            return Draft.empty()

    joined = Joined()
    sizers = [s for m in joined.members + [joined.inner] for s in (m.policy, m.sizer)]
    for sizer in sizers:
        sizer.stats.record(chain(2), [("k", 1), ("k", 2)], path=[0, 1])
        assert sizer.stats.situation == WHOLE
    probe = joined.members[0].sizer._probe
    for _ in range(4 + 7):  # a probe that leaves its situation off doubles the wait
        probe(None, 0)
    assert probe.wait[None] == 8
    start_request(joined)
    assert all(s.stats.situation == OPENING and not s.stats.request_tried for s in sizers)
    assert all(s.stats.tried for s in sizers)  # the pooled counts stay
    assert None not in probe.wait  # the base wait again
