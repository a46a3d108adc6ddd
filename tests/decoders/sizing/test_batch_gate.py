"""The batch gate: whether a batch's round drafts at all, from the throughput of the drafted
and the plain rounds over as many requests (decoders/sizing/batch_gate.py)."""

from __future__ import annotations

from specdec.decoders.sizing.batch_gate import DRAFTED, PLAIN, BatchGate, Outlook


def run_rounds(gate: BatchGate, requests: int, rounds: int, rates: dict[bool, float]) -> list[bool]:
    """``rounds`` rounds over ``requests`` requests, each giving its kind's rate (tokens/s)."""
    decisions = []
    for _ in range(rounds):
        drafting = gate.drafts(requests)
        decisions.append(drafting)
        gate.record(requests, drafting, tokens=int(rates[drafting] * 10), seconds=10.0)
    return decisions


def test_each_kind_is_measured_then_the_faster_runs_and_the_other_is_probed():
    gate = BatchGate(explore_every=5, min_rounds=3)
    decisions = run_rounds(gate, 8, 33, {True: 30.0, False: 50.0})  # plain rounds are faster
    assert decisions[:6] == [True] * 3 + [False] * 3  # drafted rounds first, then plain ones
    assert gate.winner(8) == PLAIN
    settled = decisions[6:]
    assert settled.count(True) == len(settled) // 5  # one drafted probe every 5 rounds
    assert gate.skipped == decisions.count(False) and gate.drafted == decisions.count(True)


def test_where_drafting_pays_it_keeps_drafting_and_each_batch_size_learns_apart():
    gate = BatchGate(explore_every=5, min_rounds=3)
    run_rounds(gate, 2, 30, {True: 60.0, False: 40.0})
    run_rounds(gate, 16, 30, {True: 60.0, False: 70.0})
    assert gate.winner(2) == DRAFTED and gate.winner(16) == PLAIN and gate.winner(4) is None
    # within the margin, drafting is kept (measured alike, it does not cost)
    close = BatchGate(min_rounds=3, margin=0.02)
    run_rounds(close, 4, 12, {True: 49.5, False: 50.0})
    assert close.winner(4) == DRAFTED
    close.forget()
    assert close.winner(4) is None and close.drafts(4)
    described = gate.describe()["by_requests"]
    assert described[2]["drafts"] == DRAFTED and described[16]["plain"]["tokens_per_s"] == 70.0


def test_sizes_of_one_class_learn_together_and_a_larger_class_measures_plain_first():
    """Requests 8 to 15 are one class: what rounds over 9 measured decides at 13. Once plain
    rounds won at 8, the 16 class starts with plain rounds (a larger batch's pass is dearer)."""
    gate = BatchGate(explore_every=50, min_rounds=3)
    run_rounds(gate, 9, 10, {True: 30.0, False: 50.0})
    assert gate.winner(13) == PLAIN and gate.winner(15) == PLAIN and gate.winner(16) is None
    assert not gate.drafts(12)
    assert run_rounds(gate, 16, 6, {True: 30.0, False: 50.0}) == [False] * 3 + [True] * 3
    assert BatchGate.size_class(1) == 1 and BatchGate.size_class(7) == 4 and BatchGate.size_class(31) == 16


def test_a_draining_batch_drafts_only_where_drafting_brings_its_end_closer():
    """Drafted rounds gave more tokens per second (the rates would draft). Once no request
    waits to join, a request whose drafts were never accepted keeps the batch's end where plain
    rounds put it, at dearer rounds: plain rounds run (a probe drafts now and then). Where every
    request's drafts pay, the end comes closer by more than the rounds cost: drafts run."""

    def measured(drafted_seconds: float) -> BatchGate:
        gate = BatchGate(explore_every=50, min_rounds=3)
        for drafting, tokens, seconds in ((True, 36, drafted_seconds), (False, 16, 1.0)):
            for _ in range(3):
                gate.record(16, drafting, tokens, seconds)
        return gate

    gate = measured(1.2)  # drafted rounds: 30 tokens/s over 16 requests, plain ones 16
    assert gate.winner(16) == DRAFTED
    laggard = [Outlook(40, 20, 20)] + [Outlook(40, 20, 40)] * 15  # 1 token per drafted round, 2
    assert not gate.drafts(16, laggard) and gate.kept_for_end == 1
    assert gate.drafts(16)  # while requests wait to join, the rates decide
    paying = [Outlook(40, 20, 40)] * 16  # every request 2 tokens per drafted round
    assert gate.drafts(16, paying)
    # drafted rounds twice as dear: 2 tokens per drafted round is level (kept: within the margin)
    dear = measured(2.0)
    assert dear.drafts(16, paying)
    assert not dear.drafts(16, [Outlook(40, 20, 36)] * 16)  # 1.8 tokens per drafted round
    # a request that has not drafted yet counts as the batch's mean: it keeps nothing back
    fresh = [Outlook(40, 0, 0)] + [Outlook(30, 20, 40)] * 15
    assert gate.drafts(16, fresh)
    assert gate.describe()["rounds_kept_for_end"] == 1


def test_a_pipeline_gates_its_batches_where_it_follows_its_passes(tiny_model, tiny_config, monkeypatch):
    """The gate times rounds: a pipeline has one where its T(n) is followed live, none where
    the T(n) is fixed (given, or ``SPECDEC_COST_CURVE``: the tests' own), nor without drafts."""
    from specdec.decoders.engine.pipeline import Pipeline
    from specdec.decoders.models.cost import COST_CURVE_ENV, CostCurve

    model, tokenizer = tiny_model
    monkeypatch.delenv(COST_CURVE_ENV, raising=False)
    live = Pipeline(model, tokenizer, "ngram", model_config=tiny_config)
    assert isinstance(live.batch_gate, BatchGate)
    assert live.with_components("suffix", None).batch_gate is not live.batch_gate  # one per pipeline
    assert Pipeline(model, tokenizer, None, model_config=tiny_config).batch_gate is None
    fixed = Pipeline(
        model, tokenizer, "ngram", model_config=tiny_config, cost_curve=CostCurve({1: 1.0, 8: 1.0})
    )
    assert fixed.batch_gate is None
    monkeypatch.setenv(COST_CURVE_ENV, "/nonexistent-is-not-read-here.json")
    assert Pipeline(model, tokenizer, "ngram", model_config=tiny_config).batch_gate is None
