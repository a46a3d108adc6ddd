"""Replay over recorded greedy outputs: the same rounds as real decoding, times from T(n)."""

from __future__ import annotations

import json
import sys

import pytest

from specdec.decoders.evaluation.replay import (
    Reference,
    ReplaySession,
    projected_record,
    replay_pipeline,
    standard_records,
)
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.session import ModelSession
from tests.bench_helpers import run_bench, tiny_overrides, write_workload
from tests.conftest import random_prompts

CURVE = CostCurve({1: 0.010, 2: 0.011, 4: 0.013, 8: 0.017, 16: 0.025, 32: 0.041, 64: 0.073})

#: proposers whose drafts do not depend on measured seconds, so a replay must make the
#: same rounds as the real decode loop: prompt lookup, the suffix tree, the copy heads
#: (they read the target's final hidden states) as a chain and a static tree, and a merge
DETERMINISTIC = [
    ({"name": "ngram", "adaptive": False}, "greedy"),
    ({"name": "ngram", "adaptive": False, "branches": 2}, "tree"),
    ({"name": "suffix", "adaptive": False}, "tree"),
    ({"name": "medusa", "adaptive": False}, "greedy"),
    ({"name": "medusa", "tree": "auto"}, "tree"),
    (
        {
            "name": "merge",
            "joint_budget": False,
            "members": [{"name": "suffix", "adaptive": False}, {"name": "medusa", "tree": "auto"}],
        },
        "tree",
    ),
]


def references(pipeline, prompts, max_new: int) -> list[Reference]:
    """Standard greedy decoding's outputs of ``prompts``, with the teacher-forced hidden states."""
    session = ModelSession(pipeline.model)
    made = []
    for number, prompt in enumerate(prompts):
        tokens = pipeline.generate(prompt, max_new).tokens
        session.reset()
        session.forward(prompt + tokens, last_only=True)
        made.append(Reference(f"p{number}", "qa", 0, prompt, tokens, 0.5, session.hidden))
    return made


@pytest.mark.parametrize("spec,verifier", DETERMINISTIC, ids=lambda value: str(value))
def test_replay_makes_the_rounds_real_decoding_makes(trained_pipeline, spec, verifier):
    """Float64 tiny target: every round of the replay (draft size, tokens emitted) and its
    output equal those of the real decode loop over the real target, request after request
    (the suffix tree's memory carries across both alike)."""
    prompts = random_prompts(4, seed=5)
    recorded = references(trained_pipeline.with_components(None, None), prompts, 24)
    real = trained_pipeline.with_components(spec, verifier)
    replayed = trained_pipeline.with_components(spec, verifier)
    replayed.max_new_tokens = 24
    records = replay_pipeline(replayed, recorded, CURVE)
    drafted = 0
    for prompt, reference, record in zip(prompts, recorded, records):
        result = real.generate(prompt, 24)
        assert record.tokens == reference.tokens == result.tokens
        assert record.draft_sizes == result.stats.draft_sizes
        assert record.emitted_per_round == result.stats.emitted_per_round
        drafted += result.stats.proposed
    assert drafted > 0, "nothing was drafted: the replay was not exercised"


@pytest.mark.parametrize(
    "spec,verifier",
    [({"name": "ngram", "adaptive": False}, "greedy"), ({"name": "suffix", "adaptive": False}, "tree")],
    ids=["ngram", "suffix"],
)
def test_the_oracle_sends_only_what_the_target_accepts(tiny_pipeline, spec, verifier):
    """Drafts cut to the accepted path: the same rounds as the uncut replay (proposers whose
    drafts do not follow their measurements), each draft wholly accepted, so cheaper."""
    recorded = references(tiny_pipeline, random_prompts(4, seed=7), 24)
    runs = {}
    for oracle in (False, True):
        pipeline = tiny_pipeline.with_components(spec, verifier)
        pipeline.max_new_tokens = 24
        runs[oracle] = replay_pipeline(pipeline, recorded, CURVE, oracle=oracle)
    accepted = 0
    for real, cut, reference in zip(runs[False], runs[True], recorded):
        assert cut.tokens == real.tokens == reference.tokens
        assert cut.emitted_per_round == real.emitted_per_round
        assert cut.accepted == cut.proposed == real.accepted
        assert cut.draft_sizes == [emitted - 1 for emitted in cut.emitted_per_round]
        assert cut.verify_time <= real.verify_time
        accepted += cut.accepted
    assert accepted > 0
    assert sum(r.verify_time for r in runs[True]) < sum(r.verify_time for r in runs[False])


def test_replay_projects_times_from_the_curve(tiny_pipeline):
    """A request's projected time is its recorded prefill, T(n + 1) per round of n draft
    tokens and the drafting measured; standard decoding's, T(1) per token after the first."""
    prompts = random_prompts(3, seed=9)
    recorded = references(tiny_pipeline, prompts, 16)
    pipeline = tiny_pipeline.with_components({"name": "ngram", "adaptive": False}, "greedy")
    pipeline.max_new_tokens = 16
    for record in replay_pipeline(pipeline, recorded, CURVE, prefill_scale=2.0):
        assert record.prefill_time == pytest.approx(1.0)  # 0.5 s recorded, scaled
        passes = sum(CURVE(size + 1) for size in record.draft_sizes)
        assert record.verify_time == pytest.approx(passes)
        assert record.wall_time == pytest.approx(1.0 + passes + record.draft_time)
        assert record.target_passes == len(record.draft_sizes)
    for reference, record in zip(recorded, standard_records(recorded, CURVE)):
        assert record.wall_time == pytest.approx(0.5 + (len(reference.tokens) - 1) * CURVE(1))
        assert record.tokens == reference.tokens


def test_replay_reads_each_round_at_its_context():
    """Where the curve timed longer contexts, a round's pass costs T(n + 1) after the
    tokens before it (prompt, prefill token, earlier rounds): a long conversation's
    passes are dearer than the reference context's, and the results file keeps that."""
    curve = CostCurve({1: 0.010, 8: 0.017}, context={1024: {1: 0.004, 8: 0.012}})
    reference = Reference("p", "qa", 1, list(range(768 - 1)), list(range(9)), 0.5)
    record = projected_record(reference, curve, 1.0, reference.tokens, [0, 7, 0], [1, 7, 1])
    # contexts 768, 769 and 776: two thirds of the way from the reference 256 to 1024, and a little past
    seconds = [
        0.010 + 0.004 * (768 - 256) / 768,
        0.017 + 0.012 * (769 - 256) / 768,
        0.010 + 0.004 * (776 - 256) / 768,
    ]
    assert record.verify_time == pytest.approx(sum(seconds))
    (standard,) = standard_records([reference], curve)
    assert standard.verify_time == pytest.approx(
        sum(0.010 + 0.004 * (768 + i - 256) / 768 for i in range(len(reference.tokens) - 1))
    )
    assert CostCurve.from_json(json.loads(json.dumps(curve.as_json()))) == curve
    assert "context" not in CURVE.as_json() and CostCurve.from_json(CURVE.as_json()) == CURVE


def test_replayed_passes_answer_only_rows_on_the_recorded_output(tiny_pipeline):
    """A tree pass: the rows whose path is the recorded output predict its next token and
    carry its hidden state; a row off it predicts nothing and carries zeros."""
    prompt, tokens = [5, 6, 7], [8, 9, 10, 11]
    hidden = ModelSession(tiny_pipeline.model)
    hidden.forward(prompt + tokens, last_only=True)
    session = ReplaySession(tiny_pipeline.target, Reference("p", "qa", 0, prompt, tokens, 0.0, hidden.hidden))
    first = session.forward(prompt, last_only=True)
    assert first.shape[0] == 1 and int(first[0].argmax()) == 8 and session.hidden.shape[0] == 3
    session.forward([8])
    # pending 9, then children 10 (right) and 12 (wrong), and 11 under 10
    logits = session.forward([9, 10, 12, 11], parents=[-1, 0, 0, 1])
    assert [int(row.argmax()) for row in logits[:3:2]] == [10, 0] and float(logits[2].abs().sum()) == 0
    assert int(logits[1].argmax()) == 11 and float(logits[3].abs().sum()) == 0  # past the recorded end
    assert session.hidden[1].equal(hidden.hidden[5]) and float(session.hidden[2].abs().sum()) == 0
    session.keep(4, [0, 1, 3])
    assert session.cached == prompt + tokens


def test_replay_refuses_proposers_that_read_the_target_layers(tiny_pipeline):
    recorded = references(tiny_pipeline, random_prompts(1, seed=2), 4)
    pipeline = tiny_pipeline.with_components({"name": "early_exit", "exit_layer": 1}, "greedy")
    with pytest.raises(ValueError, match="inner layers.*decoders.bench"):
        replay_pipeline(pipeline, recorded, CURVE)


def test_replay_cli_replays_a_bench_run(tmp_path, monkeypatch, capsys):
    """bench (two turns), then replay of its run: the same pipelines and outputs, tau as
    measured (a deterministic proposer), times projected from a given T(n), the oracle."""
    from specdec.decoders import replay

    workload = write_workload(tmp_path)
    run_dir = tmp_path / "run"
    pipelines = "bench.pipelines=[{proposer:{name:ngram,adaptive:false},verifier:greedy,label:lookup}]"
    run_bench(
        monkeypatch, tiny_overrides(workload, f"hydra.run.dir={run_dir}", pipelines, "workload.turns=2")
    )
    bench = {p["name"]: p for p in json.loads((run_dir / "results.json").read_text())["pipelines"]}

    curve_file = tmp_path / "curve.json"
    curve_file.write_text(json.dumps({"seconds": {"1": 0.02, "16": 0.021}}))
    out = tmp_path / "replay.json"
    argv = [
        "specdec.decoders.replay",
        "oracle=true",
        f"run={run_dir}",
        f"cost_curve={curve_file}",
        f"output={out}",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    replay.main()
    assert "projected" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["projected"] is True and payload["cost_curve"]["seconds"] == [0.02, 0.021]
    replayed = {p["name"]: p for p in payload["pipelines"]}
    assert set(replayed) == {"standard", "lookup", "lookup (oracle)"}
    assert replayed["lookup (oracle)"]["acceptance_rate"] == 1.0
    lookup = replayed["lookup"]
    assert lookup["identical_outputs"] == 1.0
    assert lookup["mean_accepted_tokens"] == pytest.approx(bench["lookup"]["mean_accepted_tokens"])
    assert lookup["speedup"] > 1.0  # drafts nearly free under this curve, and some accepted
    # second turns carry standard decoding's first answer, rebuilt as the bench built them
    recorded = {(r["prompt_id"], r["turn"]): r["tokens"] for r in bench["standard"]["records"]}
    assert {(r["prompt_id"], r["turn"]): r["tokens"] for r in lookup["records"]} == recorded
    assert {r["turn"] for r in lookup["records"]} == {0, 1}
    for plot in ("speedup_by_category.png", "tau_distribution.png", "cost_curve.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


def test_replay_cli_refuses_a_sampled_run(tmp_path, monkeypatch, capsys):
    from specdec.decoders import replay

    workload = write_workload(tmp_path)
    run_dir = tmp_path / "run"
    run_bench(
        monkeypatch,
        tiny_overrides(workload, f"hydra.run.dir={run_dir}", "proposer=ngram", "sampling.temperature=1.0"),
    )
    monkeypatch.setattr(
        sys, "argv", ["specdec.decoders.replay", f"run={run_dir}", f"hydra.run.dir={tmp_path / 'r'}"]
    )
    with pytest.raises(SystemExit) as exit:
        replay.main()
    assert exit.value.code == 2
    assert "only greedy runs can be replayed" in capsys.readouterr().err


def test_replay_cli_says_it_does_not_replay_a_batch_mode_run(tmp_path, monkeypatch, capsys):
    """The bench wrote it; replay said "not a results.json written by bench"."""
    from specdec.decoders import replay

    run_dir = tmp_path / "run"
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), f"hydra.run.dir={run_dir}", "proposer=ngram",
              "bench.batch_size=[1,2]", "bench.max_new_tokens=2", "bench.aa=false", "bench.plots=false"))  # fmt: skip
    capsys.readouterr()
    monkeypatch.setattr(
        sys, "argv", ["specdec.decoders.replay", f"run={run_dir}", f"hydra.run.dir={tmp_path / 'r'}"]
    )
    with pytest.raises(SystemExit) as exit:
        replay.main()
    assert exit.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"error: {run_dir / 'results.json'} is a batch-mode run (bench.batch_size=[1, 2]): replay replays "
        "per-prompt runs only (their recorded rounds, one request at a time); give run= a bench run made "
        "without bench.batch_size"
    )


def test_replay_of_a_run_that_named_one_proposer_takes_the_pipelines_given(tmp_path, monkeypatch):
    """A run made with proposer=... replayed with pipelines=[...]: those pipelines, not an error
    that the run's proposer and the list cannot both be given."""
    from specdec.decoders import replay

    workload = write_workload(tmp_path)
    run_dir = tmp_path / "run"
    run_bench(
        monkeypatch, tiny_overrides(workload, f"hydra.run.dir={run_dir}", "proposer=ngram", "verifier=greedy")
    )
    out = tmp_path / "replay.json"
    argv = [
        "specdec.decoders.replay",
        f"run={run_dir}",
        "pipelines=[{proposer:{name:suffix,k:4},verifier:tree,label:suffix4}]",
        f"output={out}",
        "plots=false",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    replay.main()
    names = {p["name"] for p in json.loads(out.read_text())["pipelines"]}
    assert names == {"standard", "suffix4"}
