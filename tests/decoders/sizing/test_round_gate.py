"""The round gate (decoders/sizing/round_gate.py): its decisions from injected costs,
a pipeline whose rounds it keeps plain staying lossless for every proposer (greedy
identity, and the first tokens' distribution when sampling), and the real gate
closing on a drafter that cannot pay and staying open on one that does, under a
clock the test controls."""

from __future__ import annotations

import random
import time

import pytest

from specdec.decoders.engine import decoding as decoding_module
from specdec.decoders.engine.draft import Draft
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.sizing.round_gate import AFTER_ACCEPT, AFTER_MISS, RoundGate
from tests.conftest import random_prompts, spy_drafts
from tests.distribution_helpers import assert_first_two_tokens_follow_the_target
from tests.train.test_train import train_tiny_medusa

T1 = 0.01
CURVE = CostCurve({1: T1, 2: T1, 4: 1.2 * T1, 8: 1.5 * T1, 16: 2 * T1, 32: 4 * T1, 64: 8 * T1})


def gate(**options) -> RoundGate:
    """A gate in mid-request (its request's first drafted round, which is not counted, passed)
    that may close after one counted round unless told otherwise."""
    options.setdefault("min_rounds", 1)
    g = RoundGate(lambda: CURVE, **options)
    g._first = False
    return g


def test_a_new_gate_drafts_and_closes_where_drafting_has_not_paid():
    g = gate(explore_every=4)
    assert g.drafts()  # nothing measured: draft
    # drafted rounds that emit 1.1 tokens for D = T(1) and a pass of 2: cost 2 T(1) each
    for _ in range(6):
        g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)
    assert g.averages[AFTER_MISS].cost == pytest.approx(2.0)
    assert g.averages[AFTER_MISS].tokens == pytest.approx(1.0)
    decisions = [g.drafts() for _ in range(4)]
    assert decisions == [False, False, False, True]  # closed, with a probe after 4 rounds
    g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)  # the probe did not pay
    decisions = [g.drafts() for _ in range(8)]
    assert decisions == [False] * 7 + [True]  # the wait doubled
    assert g.skipped == 3 + 7 and g.drafted == 1 + 1 + 1


def test_drafting_pays_where_its_tokens_outnumber_its_seconds_in_units_of_t1():
    assert gate().cost(draft_seconds=0.5 * T1, verify_seconds=1.2 * T1) == pytest.approx(0.5 + 1.2)
    g = gate(explore_every=100)  # within the margin: 1.0 token for 1.015 T(1) stays open
    for _ in range(10):
        g.record(verify_seconds=T1, draft_seconds=0.015 * T1, emitted=1, accepted=0)
    assert g.drafts()
    for verify, drafts in ((1.2 * T1, True), (2 * T1, False)):  # 2 tokens for 1.7 T(1), or 2.5 T(1)
        g = gate(explore_every=100)
        for _ in range(10):
            g.record(verify_seconds=verify, draft_seconds=0.5 * T1, emitted=2, accepted=1)
        assert g.drafts() is drafts, verify


def test_situations_are_kept_apart_after_an_accepted_round_and_after_a_miss():
    """Acceptance in runs: drafting pays right after an accepted round, not after a miss."""
    g = gate(explore_every=100)
    for _ in range(20):
        g._situation = AFTER_ACCEPT
        g.record(verify_seconds=1.2 * T1, draft_seconds=0.3 * T1, emitted=4, accepted=3)
        g._situation = AFTER_MISS
        g.record(verify_seconds=1.2 * T1, draft_seconds=0.3 * T1, emitted=1, accepted=0)
    g.begin()  # a request starts after a miss
    assert not g.drafts()
    g._situation = AFTER_ACCEPT
    assert g.drafts()
    g.record(
        verify_seconds=1.2 * T1, draft_seconds=0.3 * T1, emitted=1, accepted=0
    )  # a miss: next round is after a miss
    assert not g.drafts()
    assert g.describe()["situations"][AFTER_ACCEPT]["rounds"] == 20  # a request's first: not counted


def test_a_request_restarts_the_probes_wait_and_keeps_what_was_measured():
    g = gate(explore_every=2)
    for _ in range(4):
        g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)
    for _ in range(20):  # probes that never reopen it: the wait grows to 8
        g.drafts()
    g.begin()
    assert g.averages[AFTER_MISS].rounds == 4 and not g.averages[AFTER_MISS].pays(
        g.margin, g.min_rounds
    )  # kept
    assert [g.drafts() for _ in range(2)] == [False, True]  # wait back to 2


def test_the_gate_recovers_once_drafting_pays_again():
    g = gate(explore_every=2)
    for _ in range(8):
        g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)
    assert not g.drafts()
    rounds = 0
    while not g.averages[AFTER_MISS].pays(g.margin, g.min_rounds):  # probes that now accept 3 tokens
        if g.drafts():
            g.record(verify_seconds=1.2 * T1, draft_seconds=T1, emitted=4, accepted=3)
            g._situation = AFTER_MISS
        rounds += 1
    assert rounds < 64  # probes after 2, 4, 8, 8 ... plain rounds while it stays closed


def test_a_situation_closes_only_after_min_rounds_counted_rounds():
    """A few rounds' average is noise: the gate keeps drafting until it has ``min_rounds``."""
    g = gate(min_rounds=8)
    for _ in range(7):
        g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)
        assert g.drafts()
    g.record(verify_seconds=T1, draft_seconds=T1, emitted=1, accepted=0)
    assert not g.drafts()


def test_forget_drops_what_was_measured():
    """The benchmark's warm-up runs cold: its rounds must not keep the gate closed."""
    g = gate()
    for _ in range(4):
        g.record(verify_seconds=T1, draft_seconds=5 * T1, emitted=1, accepted=0)
    assert not g.drafts()
    g.forget()
    assert g.averages[AFTER_MISS].rounds == 0 and g.drafts() and g.skipped == 0


def test_a_requests_first_drafted_round_is_not_counted():
    """It holds the drafter's catching up on the prompt, paid once per request."""
    g = RoundGate(lambda: CURVE)
    g.begin()
    assert g.drafts()
    g.record(verify_seconds=T1, draft_seconds=40 * T1, emitted=1, accepted=0)
    assert g.averages[AFTER_MISS].rounds == 0 and g.drafts()
    g.record(verify_seconds=T1, draft_seconds=0.1 * T1, emitted=2, accepted=1)
    assert g.averages[AFTER_MISS].rounds == 1
    g.begin()
    g.record(verify_seconds=T1, draft_seconds=40 * T1, emitted=1, accepted=0)
    assert g.averages[AFTER_MISS].rounds == 1


def test_pipelines_are_gated_only_when_asked(tiny_pipeline):
    assert tiny_pipeline.with_components("ngram", None).gate is None  # off by default
    gated = tiny_pipeline.with_components("ngram", None, round_gate=True)
    assert gated.gate is not None and gated.with_components("suffix", "tree").gate is not None  # kept
    # an early exit sizes its drafts itself, drafting cost included: never gated
    assert (
        tiny_pipeline.with_components({"name": "early_exit", "exit_layer": 1}, None, round_gate=True).gate
        is None
    )
    # a bench entry's own round_gate wins over the run's
    from specdec.decoders.evaluation.contenders import listed_pipeline, pipeline_contender

    entry = listed_pipeline(tiny_pipeline, {"proposer": "ngram", "round_gate": True}, None)
    assert entry.gate is not None and listed_pipeline(gated, {"proposer": "ngram"}, None).gate is not None
    contender = pipeline_contender(entry)
    record = contender.run(random_prompts(1)[0], 8)
    assert record.gated_rounds is not None
    assert contender.describe()["round_gate"]["rounds_drafted"] >= 1


class ScriptedGate:
    """Keeps the rounds plain that a seeded coin picks (whatever they would pay)."""

    def __init__(self, seed: int, skip: float = 0.4) -> None:
        self.random, self.skip = random.Random(seed), skip
        self.skipped = self.drafted = 0

    def begin(self) -> None:
        pass

    def drafts(self) -> bool:
        drafting = self.random.random() >= self.skip
        self.drafted += drafting
        self.skipped += not drafting
        return drafting

    def record(self, draft_seconds, verify_seconds, emitted, accepted) -> None:
        pass

    def describe(self) -> dict:
        return {}


GATED = [  # every proposer that can be gated (early exit sizes itself), chains and trees
    ("ngram", "greedy"),
    ({"name": "ngram", "branches": 3}, "tree"),
    ({"name": "suffix"}, "tree"),
    ({"name": "medusa"}, "greedy"),
    ({"name": "medusa", "tree": "dynamic"}, "tree"),
    ({"name": "draft_model", "tree": False, "k": 4}, "greedy"),
    ({"name": "draft_model", "tree": True, "k": 2}, "tree"),
    ({"name": "eagle"}, "greedy"),
    ({"name": "merge", "members": [{"name": "suffix"}, {"name": "medusa", "tree": "dynamic"}]}, "tree"),
    ({"name": "merge", "members": [{"name": "ngram"}, {"name": "draft_model", "tree": True}]}, "tree"),
]


@pytest.mark.parametrize("proposer,verifier", GATED, ids=lambda spec: str(spec))
def test_rounds_kept_plain_leave_greedy_output_unchanged(drafting_pays, trained_pipeline, proposer, verifier):
    """Rounds skipped at random between drafted ones: the output is standard decoding's,
    drafts were still accepted, and the proposer's state stayed in step (a copy-head
    memory or an EAGLE cache out of step raises)."""
    pipeline = trained_pipeline.with_components(proposer, verifier)
    pipeline.gate = ScriptedGate(seed=5)
    accepted = 0
    for prompt in random_prompts(4, seed=21):
        expected = trained_pipeline.generate(prompt, 24).tokens
        result = pipeline.generate(prompt, 24)
        assert result.tokens == expected
        accepted += result.stats.accepted
        assert result.stats.gated_rounds > 0
        assert result.stats.draft_sizes.count(0) >= result.stats.gated_rounds
    assert accepted > 0, "no draft token was accepted: gating was never tested between drafts"


@pytest.fixture(scope="module")
def pointer_artifacts(tmp_path_factory):
    """Copy heads with a pointer into the context, trained for the tiny model (seconds)."""
    directory = tmp_path_factory.mktemp("pointer")
    train_tiny_medusa(directory, ("drafter.copy_width=16",))
    return directory


def test_copy_heads_take_in_the_rounds_kept_plain(drafting_pays, tiny_model, tiny_config, pointer_artifacts):
    """Copy heads keep a memory of every committed position: rounds kept plain go into it
    too (``skip``), so it stays the committed text and the output standard decoding's."""
    from specdec.decoders import Pipeline

    model, tokenizer = tiny_model
    base = Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=pointer_artifacts)
    pipeline = base.with_components({"name": "medusa", "tree": "dynamic"}, "tree")
    assert pipeline.proposer.heads.copy is not None
    pipeline.gate = ScriptedGate(seed=3)
    accepted = 0
    for prompt in random_prompts(3, seed=8):
        result = pipeline.generate(prompt, 30)
        assert result.tokens == base.generate(prompt, 30).tokens
        assert result.stats.gated_rounds > 0
        accepted += result.stats.accepted
        text = list(prompt) + result.tokens
        memory = pipeline.proposer.memory
        assert memory.following.tolist() == text[1 : len(memory) + 1]
    assert accepted > 0


def test_eagle_feeds_the_rounds_kept_plain_at_its_next_draft(drafting_pays, trained_pipeline):
    """A round kept plain runs no pass of EAGLE's drafter: its positions' features wait and
    the next draft feeds them with its own in one pass. The drafter's cache then holds what
    it holds when every round is drafted: at every position both runs drafted from, the
    chains are the same tokens (float64)."""
    spec = {"name": "eagle", "adaptive": False, "k": 3}
    every = trained_pipeline.with_components(spec, "greedy")
    gated = trained_pipeline.with_components(spec, "greedy")
    gated.gate = ScriptedGate(seed=7)
    drafts: list[dict[int, list[int]]] = [{}, {}]
    for seen, pipeline in zip(drafts, (every, gated)):
        spy_drafts(
            pipeline.proposer, lambda state, draft, seen=seen: seen.update({len(state.tokens): draft.tokens})
        )
    session = gated.proposer.session
    passes = [0]
    forward = session.forward

    def counted(*args, **kwargs):
        passes[0] += 1
        return forward(*args, **kwargs)

    session.forward = counted
    for prompt in random_prompts(3, seed=12):
        for seen in drafts:
            seen.clear()
        passes[0] = 0
        assert gated.generate(prompt, 30).tokens == every.generate(prompt, 30).tokens
        common = set(drafts[0]) & set(drafts[1])
        assert len(common) >= 3 and len(drafts[1]) < len(drafts[0])
        assert all(drafts[0][at] == drafts[1][at] for at in common)
        assert passes[0] == 3 * len(drafts[1])  # per drafted round: the sync and 2 chain steps; none skipped
    assert gated.gate.skipped > 0


@pytest.mark.parametrize(
    "proposer,verifier",
    [
        ({"name": "draft_model"}, "rejection"),
        pytest.param({"name": "medusa", "tree": "dynamic"}, "tree", marks=pytest.mark.slow),  # 10-20 s
    ],
    ids=["draft_model chain, rejection", "medusa sampled tree"],
)
def test_rounds_kept_plain_leave_the_sampled_distribution_unchanged(
    drafting_pays, trained_pipeline, proposer, verifier
):
    """At T=1, the first round is kept plain or drafted by a coin: the first two tokens
    still follow the target's own distribution."""
    sampling = SamplingConfig(temperature=1.0, top_k=6)
    base = trained_pipeline.with_components(None, None, sampling)
    pipeline = trained_pipeline.with_components(proposer, verifier, sampling)
    pipeline.gate = ScriptedGate(seed=9, skip=0.3)
    prompt = random_prompts(1, seed=4)[0]
    assert_first_two_tokens_follow_the_target(base, pipeline, prompt, sampling, 1500, "gated drafts")
    assert pipeline.gate.skipped > 300


class Oracle(Proposer):
    """Drafts ``k`` tokens: the true continuation (``good``) or tokens never produced."""

    name = "oracle"

    def __init__(self, expected: list[int], prompt_len: int, good: bool, clock: list[float]) -> None:
        super().__init__(Proposer.Config(), None)
        self.expected, self.prompt_len, self.good, self.clock = expected, prompt_len, good, clock

    def propose(self, state) -> Draft:
        self.clock[0] += 2 * T1  # drafting takes two plain passes' time on the gate's clock
        done = len(state.tokens) - self.prompt_len
        if self.good:
            return Draft.chain(self.expected[done : done + 4])
        return Draft.chain([(self.expected[min(done, len(self.expected) - 1)] + 1) % 256] * 2)


@pytest.mark.parametrize("good", [False, True])
def test_the_real_gate_closes_where_drafting_cannot_pay(monkeypatch, tiny_pipeline, good):
    """Drafting that costs 2 T(1) a round on the gate's clock: a drafter whose tokens are
    never accepted has most rounds kept plain; one whose 4 tokens are always accepted
    (5 tokens for about 2 T(1) and a tiny model's pass) keeps every round. Outputs equal
    standard decoding's."""
    clock = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(decoding_module.time, "perf_counter", lambda: real() + clock[0])
    prompt = random_prompts(1, seed=2)[0]
    expected = tiny_pipeline.generate(prompt, 60).tokens
    pipeline = tiny_pipeline.with_components(
        Oracle(expected, len(prompt), good, clock), "greedy", round_gate=True
    )
    pipeline.gate = RoundGate(lambda: CURVE)
    result = pipeline.generate(prompt, 60)
    assert result.tokens == expected
    if good:
        assert result.stats.gated_rounds == 0 and result.stats.accepted > 40
    else:
        assert result.stats.accepted == 0
        assert result.stats.gated_rounds > 0.6 * result.stats.target_passes
