"""The benchmark CLI end to end on the tiny model: results file, metrics, turns, plots, interrupts."""

from __future__ import annotations

import json

import pytest

from specdec.decoders.evaluation import bench_results, contenders, scheduling
from specdec.decoders.evaluation.metrics import Record, first_divergence, physical_limit, repeat_spread
from tests.bench_helpers import run_bench, tiny_overrides, write_workload

TOP_LEVEL = {
    "model": str,
    "dtype": str,
    "device": str,
    "temperature": float,
    "max_new_tokens": int,
    "prompts": int,
    "workload": str,
    "pipelines": list,
}
PIPELINE_FIELDS = {
    "name",
    "proposer",
    "verifier",
    "kind",
    "tokens_per_s",
    "speedup",
    "mean_accepted_tokens",
    "acceptance_rate",
    "identical_outputs",
    "categories",
}


def test_bench_cli_greedy_two_turns_with_repeats_and_peers(drafting_pays, tmp_path, monkeypatch):
    """Every DESIGN.md field, lossless greedy outputs, turn 2 fed the model's first answer."""
    workload = write_workload(tmp_path)
    fed_answers: dict[str, str | None] = {}
    turn_ids = scheduling.turn_ids

    def spy(pipeline, prompt, turn, first_answer):
        if turn == 1:
            fed_answers[prompt.id] = first_answer
        return turn_ids(pipeline, prompt, turn, first_answer)

    monkeypatch.setattr(scheduling, "turn_ids", spy)
    monkeypatch.setattr(bench_results, "read_bandwidth", lambda: 10.0)  # GB/s, injected
    run_dir = tmp_path / "run"
    overrides = ["proposer=ngram", "workload.turns=2", "bench.repeats=2", "bench.peers=true"]
    run_bench(monkeypatch, tiny_overrides(workload, f"hydra.run.dir={run_dir}", *overrides))

    results = json.loads((run_dir / "results.json").read_text())  # bench.output defaults to the run dir
    for key, kind in TOP_LEVEL.items():
        assert isinstance(results[key], kind), key
    assert results["model"].startswith("tiny-random") and results["dtype"] == "float64"
    machine = results["machine"]  # where the figures hold
    assert machine["cpu"] and machine["threads"] >= 1 and isinstance(machine["vector_extensions"], list)
    assert machine["torch"] and machine["transformers"]
    limit = results["memory_limit"]  # the floor the weights' bytes set, and the pass against it
    assert limit["read_gb_s"] == 10.0 and limit["weight_bytes"] > 0
    assert limit["limit_ms"] == pytest.approx(limit["weight_bytes"] / 10e9 * 1000)
    assert limit["single_pass_ms"] is limit["ratio"] is None  # a fixed cost curve here: no live pass times
    assert "read at 10.0 GB/s" in bench_results.format_table(results).splitlines()[2]
    assert (results["temperature"], results["max_new_tokens"], results["prompts"]) == (0.0, 8, 3)
    pipelines = {p["name"]: p for p in results["pipelines"]}
    assert set(pipelines) == {"standard", "ngram+greedy", "hf_generate", "hf_prompt_lookup", "standard (A/A)"}
    for entry in results["pipelines"]:
        assert PIPELINE_FIELDS <= set(entry), entry["name"]
        assert set(entry["categories"]) == {"qa", "rag"}
        for category in entry["categories"].values():
            assert {"tokens_per_s", "speedup", "mean_accepted_tokens"} <= set(category)
        assert len(entry["records"]) == 3 * 2 * 2  # prompts x turns x repeats

    standard, ngram = pipelines["standard"], pipelines["ngram+greedy"]
    assert standard["kind"] == "standard" and standard["speedup"] == 1.0
    assert standard["mean_accepted_tokens"] == 1.0 and standard["identical_outputs"] == 1.0
    assert (ngram["kind"], ngram["proposer"], ngram["verifier"]) == ("speculative", "ngram", "greedy")
    assert ngram["identical_outputs"] == 1.0
    assert all(r["diverges_at"] is None for r in ngram["records"])
    assert ngram["mean_accepted_tokens"] > 1.0 and 0.0 < ngram["acceptance_rate"] <= 1.0
    assert {pipelines[name]["kind"] for name in ("hf_generate", "hf_prompt_lookup")} == {"peer"}
    aa = pipelines["standard (A/A)"]  # standard decoding again, in step with the rest: the noise band
    assert aa["kind"] == "control" and aa["identical_outputs"] == 1.0 and aa["speedup"] > 0
    assert aa["mean_accepted_tokens"] == 1.0 and aa["ideal_speedup"] is None

    # Spread over the two repeats, and the physical limit from the measured T(n).
    assert ngram["speedup_std"] >= 0.0 and ngram["speedup_mean"] > 0.0
    assert ngram["ideal_speedup"] > 0.0
    assert ngram["efficiency"] == pytest.approx(ngram["speedup"] / ngram["ideal_speedup"])
    assert standard["ideal_speedup"] is None and pipelines["hf_generate"]["efficiency"] is None
    curve = results["cost_curve"]
    assert curve["sizes"][0] == 1 and len(curve["sizes"]) == len(curve["seconds"])
    assert all(seconds > 0 for seconds in curve["seconds"])

    # Decoded text per record; turn 2 carried standard decoding's turn-1 answer.
    first_turn = {
        r["prompt_id"]: r["text"] for r in standard["records"] if r["turn"] == 0 and r["repeat"] == 0
    }
    assert all(isinstance(r["text"], str) for r in standard["records"])
    assert fed_answers == first_turn
    assert {r["turn"] for r in ngram["records"]} == {0, 1}

    for plot in ("speedup_by_category.png", "tau_distribution.png", "cost_curve.png"):
        image = run_dir / plot
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


def test_bench_cli_sampling(tmp_path, monkeypatch):
    """Temperature > 0: the rejection verifier, no greedy identity claim, sane tau."""
    output = tmp_path / "out" / "sampled.json"
    overrides = ["proposer=ngram", "sampling.temperature=0.8", "sampling.top_k=20", f"bench.output={output}"]
    overrides += [f"hydra.run.dir={tmp_path / 'run'}", "bench.plots=false"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))

    results = json.loads(output.read_text())
    assert results["temperature"] == 0.8
    ngram = next(p for p in results["pipelines"] if p["kind"] == "speculative")
    assert ngram["verifier"] == "rejection"
    assert ngram["identical_outputs"] is None and "diverges_at" not in ngram["records"][0]
    assert 1.0 <= ngram["mean_accepted_tokens"] <= 1 + 5  # at most k drafted tokens + 1 per pass
    assert all(r["new_tokens"] == len(r["tokens"]) for r in ngram["records"])
    assert not list(output.parent.glob("*.png"))


def test_interrupted_benchmark_keeps_finished_prompts(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the third prompt: results.json holds the two finished prompts, and
    the command says so and exits with status 130, without a traceback."""
    make_contender = contenders.pipeline_contender

    def interrupting_contender(pipeline, *names):
        contender = make_contender(pipeline, *names)
        if contender.kind != "speculative":
            return contender
        calls = []
        run, start = contender.run, contender.start

        def until_third_prompt(call):
            def counted(prompt_ids, max_new_tokens, constraint=None):
                calls.append(prompt_ids)
                if len(calls) == 1 + 3:  # warm-up, prompt 1, prompt 2, then the third prompt
                    raise KeyboardInterrupt
                return call(prompt_ids, max_new_tokens, constraint)

            return counted

        contender.run, contender.start = until_third_prompt(run), until_third_prompt(start)
        return contender

    monkeypatch.setattr(contenders, "pipeline_contender", interrupting_contender)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_bench(
            monkeypatch,
            tiny_overrides(write_workload(tmp_path), "proposer=ngram", f"hydra.run.dir={run_dir}"),
        )
    assert exit_info.value.code == 130
    assert "results of the 2 finished prompt(s) are in" in capsys.readouterr().err

    results = json.loads((run_dir / "results.json").read_text())
    assert results["prompts"] == 2
    assert all(len(p["records"]) == 2 for p in results["pipelines"])
    assert [r["prompt_id"] for r in results["pipelines"][0]["records"]] == ["a", "c"]  # grouped by category


def _record(repeat: int, wall_time: float, **counters) -> Record:
    return Record("p", "qa", 0, repeat, 8, wall_time, list(range(8)), **counters)


def test_repeat_spread_is_mean_and_sample_std_of_per_repeat_ratios():
    baseline = [_record(0, 1.0), _record(1, 1.0)]
    records = [_record(0, 0.5), _record(1, 0.25)]  # speedups 2 and 4
    spread = repeat_spread(records, baseline)
    assert spread["speedup_mean"] == pytest.approx(3.0)
    assert spread["speedup_std"] == pytest.approx(2**0.5)
    assert repeat_spread(records[:1], baseline[:1]) == {}


def test_physical_limit_follows_its_formula():
    """tau * T(1) / (T(mean draft + 1) + draft seconds per round), with T(n) = 1 + n / 10."""
    records = [
        _record(0, 1.0, target_passes=2, proposed=6, accepted=4, draft_time=0.2, emitted_per_round=[3, 3]),
        _record(1, 1.0, target_passes=2, proposed=2, accepted=0, draft_time=0.2, emitted_per_round=[1, 1]),
    ]
    limit = physical_limit(records, lambda n: 1 + n / 10)
    tau, mean_draft, draft_seconds = 8 / 4, 8 / 4, 0.4 / 4
    assert limit["mean_draft_size"] == mean_draft and limit["draft_seconds_per_round"] == pytest.approx(
        draft_seconds
    )
    assert limit["ideal_speedup"] == pytest.approx(tau * 1.1 / (1 + (mean_draft + 1) / 10 + draft_seconds))
    assert physical_limit([_record(0, 1.0)], lambda n: 1.0) is None  # peers have no counters


def test_physical_limit_costs_each_round_and_adds_the_prefill_to_both_sides():
    """With per-round draft sizes each round costs T(its size + 1): on a curve that bends
    upward, rounds of 0 and 4 nodes cost more than two rounds of the mean, 2. The prefill
    is paid by standard decoding and by the pipeline alike."""

    def convex(n: float) -> float:
        return 1.0 if n <= 3 else 1.0 + (n - 3)

    counters = dict(target_passes=2, proposed=4, accepted=3, draft_time=0.5, emitted_per_round=[1, 4])
    varying = _record(0, 1.0, draft_sizes=[0, 4], prefill_time=2.0, **counters)
    limit = physical_limit([varying], convex)
    assert limit["mean_draft_size"] == 2.0
    # standard: prefill + 5 tokens x T(1); pipeline: prefill + T(1) + T(5) + drafting
    assert limit["ideal_speedup"] == pytest.approx((2.0 + 5 * 1.0) / (2.0 + 1.0 + 3.0 + 0.5))
    steady = _record(0, 1.0, draft_sizes=[2, 2], prefill_time=2.0, **counters)
    assert physical_limit([steady], convex)["ideal_speedup"] == pytest.approx((2.0 + 5.0) / (2.0 + 2.0 + 0.5))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_bench_pipelines_list_runs_several_pipelines_in_one_run(tmp_path, monkeypatch):
    output = tmp_path / "results.json"
    listed = "bench.pipelines=[ngram+greedy,{proposer:{name:ngram,k:2,adaptive:false},verifier:greedy,label:ngram_k2}]"
    overrides = [listed, f"bench.output={output}", f"hydra.run.dir={tmp_path / 'run'}", "bench.plots=false"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))
    entries = {e["name"]: e for e in json.loads(output.read_text())["pipelines"]}
    assert set(entries) == {"standard", "ngram+greedy", "ngram_k2", "standard (A/A)"}
    assert entries["ngram_k2"]["identical_outputs"] == 1.0
    assert 0 < entries["ngram_k2"]["mean_draft_size"] <= 2  # its own options, not the first entry's
    assert entries["ngram_k2"]["info"]["proposer_config"]["k"] == 2
    assert entries["ngram+greedy"]["info"]["proposer_config"]["k"] == 24


def test_default_pipelines_skip_the_ones_without_a_trained_artifact(tmp_path, monkeypatch, capsys):
    """No proposer= and no bench.pipelines: bench.default_pipelines, minus those whose
    artifact is missing (named with the command that trains it)."""
    run_dir = tmp_path / "run"
    defaults = "bench.default_pipelines=[{proposer:ngram,label:lookup},{proposer:medusa,label:heads}]"
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), f"hydra.run.dir={run_dir}", defaults,
                                          f"artifacts_dir={tmp_path / 'none'}"))  # fmt: skip
    results = json.loads((run_dir / "results.json").read_text())
    assert [p["name"] for p in results["pipelines"]] == ["standard", "lookup", "standard (A/A)"]
    assert "skipping heads: no Medusa heads" in capsys.readouterr().err


def test_bench_pipelines_list_rejects_a_malformed_entry():
    from specdec.decoders.evaluation.contenders import listed_pipeline

    for entry in ({"verifier": "greedy"}, 3):
        with pytest.raises(ValueError, match="bench.pipelines entry"):
            listed_pipeline(None, entry, None)


def test_bench_pipelines_that_differ_by_options_get_names_of_their_own():
    """Results are kept by name: two unlabelled entries of one proposer with different
    options must not pool their records under "proposer+verifier"."""
    from specdec.decoders.engine.pipeline import Pipeline
    from specdec.decoders.evaluation.contenders import listed_pipeline, with_unique_names
    from specdec.decoders.models.loading import ModelConfig, load_model

    model_cfg = ModelConfig(name="tiny-random", dtype="float64")
    target, tokenizer = load_model(model_cfg)
    base = Pipeline(target, tokenizer, model_config=model_cfg)
    entries = [
        {"proposer": "ngram", "verifier": "greedy"},
        {"proposer": {"name": "ngram", "k": 2}, "verifier": "greedy"},
        {"proposer": {"name": "ngram", "k": 3}, "verifier": "greedy", "label": "mine"},
    ]
    pipelines = with_unique_names([listed_pipeline(base, e, None) for e in entries], entries)
    assert [p.name for p in pipelines] == ["ngram+greedy", "ngram(k=2)+greedy", "mine"]
    twins = [{"proposer": {"name": "ngram", "k": 2}, "verifier": "greedy"}] * 2
    with pytest.raises(ValueError, match="give each a label"):
        with_unique_names([listed_pipeline(base, e, None) for e in twins], twins)


def test_same_length_speedup_charges_each_pipeline_at_standard_decodings_lengths():
    """A pipeline that decodes at standard decoding's rate but sampled a shorter answer
    loses on tokens per second (its prefill spread over fewer tokens), not at equal
    lengths; one that decodes twice as fast gains on both."""
    from specdec.decoders.evaluation.metrics import pipeline_entry

    def record(prompt, tokens, wall, prefill=1.0, category="c"):
        return Record(prompt, category, 0, 0, tokens, wall, [], target_passes=1, prefill_time=prefill)

    standard = [record("a", 40, 5.0), record("b", 40, 5.0, category="d")]  # 0.1 s a token
    shorter = [record("a", 10, 2.0), record("b", 40, 5.0, category="d")]  # same rate, answer "a" short
    faster = [record("a", 40, 3.0), record("b", 20, 2.0, category="d")]  # 0.05 s a token
    short = pipeline_entry("short", "speculative", "x", "y", shorter, standard, greedy=False)
    assert short["speedup"] < 0.9 and short["categories"]["c"]["speedup"] == 0.625
    assert short["speedup_same_lengths"] == 1.0 and short["categories"]["c"]["speedup_same_lengths"] == 1.0
    fast = pipeline_entry("fast", "speculative", "x", "y", faster, standard, greedy=False)
    assert fast["speedup_same_lengths"] == 10.0 / 6.0  # (5 + 5) / (1 + 2 + 1 + 2)
    assert fast["categories"]["d"]["speedup_same_lengths"] == 5.0 / 3.0
    peer = [Record("a", "c", 0, 0, 40, 4.0, []), Record("b", "d", 0, 0, 40, 4.0, [])]  # no prefill timed
    assert (
        pipeline_entry("peer", "peer", None, None, peer, standard, greedy=False)["speedup_same_lengths"]
        is None
    )


def test_progress_labels_are_short_and_never_shared():
    """The progress bar's labels fit its width, and two contenders whose names begin alike
    (a pipeline and its ungated twin, two suffix settings) never share one, which in the
    bar's dict would drop one contender's figure."""
    names = [
        "draft_model_tree",
        "draft_model_tree (ungated)",
        "suffix(k=16,max_nodes=24)+tree",
        "suffix(k=16,max_nodes=32)+tree",
        "suffix(k=16,max_nodes=24)+tree, again",
        "ngram+greedy",
    ]
    labels = scheduling.progress_labels(names)
    assert list(labels) == names and len(set(labels.values())) == len(names)
    assert labels["ngram+greedy"] == "ngram+greedy" and labels["draft_model_tree"] == "draft_model_tree"
    assert labels["draft_model_tree (ungated)"] == "draft_mo…ngated)"
    assert all(len(labels[n]) == 16 for n in names[1:4])
    # a long name whose short label is taken (same start, same end) keeps its whole self
    alike = scheduling.progress_labels(["suffix(k=16,max_nodes=24)+tree", "suffix(k=16,max_nodes=64)+tree"])
    assert alike == {
        "suffix(k=16,max_nodes=24)+tree": "suffix(k…4)+tree",
        "suffix(k=16,max_nodes=64)+tree": "suffix(k=16,max_nodes=64)+tree",
    }


def test_slower_categories_name_each_one_and_mark_those_below_the_noise_band():
    """The bench's table ends by naming, per contender, the categories it ran slower than
    standard decoding in; the A/A twin's farthest category from 1.0x sets the band, and
    only a category below it is starred."""

    def entry(name, kind, speedups):
        return {"name": name, "kind": kind, "categories": {c: {"speedup": s} for c, s in speedups.items()}}

    payload = {
        "pipelines": [
            entry("standard", "standard", {"a": 1.0, "b": 1.0, "c": 1.0}),
            entry("fast", "speculative", {"a": 1.5, "b": 1.2, "c": 1.004}),  # 1.004 prints as 1.00x
            entry("slow", "speculative", {"a": 0.99, "b": 0.93, "c": 1.1}),
            entry("standard (A/A)", "control", {"a": 0.98, "b": 1.03, "c": 0.997}),
            entry("peer", "peer", {"a": 0.96, "b": 0.97, "c": 0.9649}),
        ]
    }
    lines = bench_results.slower_categories(payload)
    assert lines[0] == "categories slower than standard decoding (* below the A/A band, 0.97x to 1.03x):"
    assert [line.split()[0] for line in lines[1:]] == ["slow", "peer"]  # fast and the twin: none below
    assert lines[1].endswith("b 0.93x*, a 0.99x")
    assert lines[2].endswith("a 0.96x*, c 0.96x*, b 0.97x")  # 0.97x is the band's edge: not below it
    # without the twin there is no band to star against; with no slower category, no lines
    no_twin = {"pipelines": [e for e in payload["pipelines"] if e["kind"] != "control"]}
    assert bench_results.slower_categories(no_twin)[0] == "categories slower than standard decoding:"
    assert "*" not in "".join(bench_results.slower_categories(no_twin))
    assert bench_results.slower_categories({"pipelines": payload["pipelines"][:2]}) == []


def test_peer_selection():
    """bench.peers: true = the default peers (those that pay on the default target), all =
    every peer whose counterpart runs, a list = those named; unknown names are refused."""
    from specdec.decoders.evaluation.peers import chosen_peers

    defaults = ["hf_generate", "hf_prompt_lookup"]
    assert chosen_peers(True, defaults) == defaults and chosen_peers("true", defaults) == defaults
    assert chosen_peers(False, defaults) == [] and chosen_peers(None, defaults) == []
    assert chosen_peers("all", defaults) is None
    assert chosen_peers(["hf_assisted"], defaults) == ["hf_assisted"]
    with pytest.raises(ValueError, match="unknown peer 'hf_nope'.*hf_assisted"):
        chosen_peers(["hf_nope"], defaults)


def test_the_default_quickstart_leaves_out_what_cannot_pay():
    """The quickstart's set: no trained early exit, no assisted generation peers; the full set
    keeps both one override away (experiment=full_set)."""
    from hydra import compose, initialize_config_dir

    import specdec.decoders.evaluation.bench_config  # noqa: F401  (stores bench=default, as the command line does)
    from tests.conftest import REPO_ROOT

    with initialize_config_dir(config_dir=f"{REPO_ROOT}/conf", version_base=None):
        quick = compose(config_name="bench")
        full = compose(config_name="bench", overrides=["experiment=full_set"])
    labels = list(quick.bench.default_pipelines)
    assert "early_exit_trained" not in labels and "copy_heads" in labels
    assert list(quick.bench.default_peers) == ["hf_generate", "hf_prompt_lookup"]
    assert list(full.bench.default_pipelines) == labels  # stated once, in bench_config.py
    assert list(full.bench.extra_pipelines) == ["early_exit_trained"]
    assert full.bench.peers == "all"


@pytest.mark.parametrize(("speedup", "warns"), [(1.0, False), (0.975, False), (1.03, False), (0.94, True)])
def test_the_table_warns_when_the_aa_twin_is_outside_three_percent(speedup, warns):
    payload = {
        "model": "m", "dtype": "float32", "device": "cpu", "workload": "w", "prompts": 1, "turns": 1,
        "repeats": 1, "temperature": 0.0, "max_new_tokens": 8,
        "pipelines": [
            {"name": "standard", "kind": "standard", "tokens_per_s": 10.0, "speedup": 1.0},
            {"name": "standard (A/A)", "kind": "control", "tokens_per_s": 10.0 * speedup, "speedup": speedup},
        ],
    }  # fmt: skip
    for entry in payload["pipelines"]:
        entry.update(mean_accepted_tokens=1.0, acceptance_rate=None, identical_outputs=1.0)
        entry.update(ideal_speedup=None, efficiency=None, categories={})
    last = bench_results.format_table(payload).splitlines()[-1]
    assert last.startswith("warning: the A/A twin ran at 0.940x") if warns else "within ±3%" in last


def test_bench_entries_name_presets_by_label(trained_pipeline):
    """A proposer's name runs its defaults, a preset label the variant its class declares;
    ``{preset: ...}`` keeps the preset and takes a label or round gate of its own."""
    from specdec.decoders.evaluation.contenders import listed_pipeline

    chain = listed_pipeline(trained_pipeline, "copy_heads_chain", None)
    assert chain.name == "copy_heads_chain" and chain.proposer.name == "copy_heads"
    assert chain.proposer.config.tree is None and chain.verifier.name == "greedy"
    tree = listed_pipeline(
        trained_pipeline, {"preset": "copy_heads", "label": "ungated", "round_gate": False}, None
    )
    assert tree.name == "ungated" and tree.proposer.config.tree == "dynamic" and tree.verifier.name == "tree"
    assert not tree.round_gate
    assert listed_pipeline(trained_pipeline, "ngram", None).name == "ngram+greedy"  # a bare name: as before
