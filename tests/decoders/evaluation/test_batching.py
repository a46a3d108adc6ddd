"""The bench's batch mode: rows per batch size and contender, the outputs checked against
decoding each request alone, the plots, and its options refused in one line when wrong."""

from __future__ import annotations

import json
import statistics

import pytest

from specdec.decoders.evaluation.batching import arrival_times
from specdec.decoders.evaluation.bench_config import BenchConfig
from tests.bench_helpers import run_bench, tiny_overrides, write_workload


def test_batch_mode_reports_every_contender_at_every_size(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    overrides = ["bench.pipelines=[ngram,suffix]", "bench.batch_size=[1,3]", "bench.peers=true"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), f"hydra.run.dir={run_dir}", *overrides))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["mode"] == "batch" and results["batch_sizes"] == [1, 3] and results["prompts"] == 3
    rows = {(row["pipeline"], row["batch_size"]): row for row in results["rows"]}
    names = {"standard", "standard (A/A)", "ngram+greedy", "suffix+tree", "hf_generate"}
    assert set(rows) == {(name, size) for name in names for size in (1, 3)}
    for (name, size), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["latency_p90"] >= row["latency_median"] > 0
        if name != "hf_generate":  # greedy, float64: each request's output is the one it gets alone
            assert row["identical_outputs"] == 1.0, (name, size)
    assert rows[("standard", 1)]["speedup"] == pytest.approx(1.0)
    assert rows[("standard", 3)]["drafted_per_request"] == 0.0
    assert rows[("suffix+tree", 1)]["drafted_per_request"] > 0
    leads = rows[("suffix+tree", 1)]["lead_value_quantiles"]  # suffix values its nodes
    assert len(leads) == 21 and leads == sorted(leads) and 0.0 <= leads[0] and leads[-1] <= 1.0
    assert results["stop_estimates"]["suffix+tree"]["lead_value_quantiles"] == leads
    assert rows[("standard", 1)]["lead_value_quantiles"] == []
    assert (run_dir / "batch_throughput.png").exists() and (run_dir / "batch_drafted.png").exists()
    table = capsys.readouterr().out
    assert "batch pipeline" in table and "suffix+tree" in table
    assert rows[("standard (A/A)", 3)]["drafted_per_request"] == 0.0  # the twin: standard decoding again
    assert "A/A twin at batch 1:" in table and "A/A twin at batch 3:" in table


def test_continuous_arrivals_run_without_the_static_peer(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    overrides = ["proposer=ngram", "bench.batch_size=2", "bench.arrivals=[0,0.05,0.1]", "bench.peers=true"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), f"hydra.run.dir={run_dir}", *overrides))
    results = json.loads((run_dir / "results.json").read_text())
    assert {row["pipeline"] for row in results["rows"]} == {"standard", "standard (A/A)", "ngram+greedy"}
    assert results["arrivals"] == [0, 0.05, 0.1]


def test_arrival_times():
    assert arrival_times(None, 3) is None
    rate = arrival_times(4.0, 5)
    assert rate[0] == 0.0 and rate == sorted(rate) and rate == arrival_times(4.0, 5)  # seeded
    assert arrival_times([0, 1, 2], 3) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="lists 2 times for 3 prompts"):
        arrival_times([0, 1], 3)
    with pytest.raises(ValueError, match="rate must be > 0"):
        arrival_times(0, 3)


def test_batch_options_are_checked():
    assert BenchConfig(batch_size=4).batch_sizes == [4]
    assert BenchConfig(batch_size=[1, 2, 4]).batch_sizes == [1, 2, 4]
    assert BenchConfig().batch_sizes == []
    with pytest.raises(ValueError, match="bench.batch_size=0"):
        BenchConfig(batch_size=0)
    with pytest.raises(ValueError, match="bench.arrivals needs batch mode"):
        BenchConfig(arrivals=2.0)


def test_the_cost_models_stop_estimate():
    from specdec.decoders.evaluation.batch_estimates import stop_estimate
    from specdec.decoders.models.cost import CostCurve

    steep_after_8 = CostCurve({1: 1.0, 8: 1.0, 9: 2.0, 64: 57.0})
    # each request drafting 1 token and gaining 0.5 per pass: 4 requests fill the flat 8 rows, 5 do not
    assert stop_estimate(0.5, 1.0, steep_after_8, 64) == 5
    assert stop_estimate(0.5, 1.0, CostCurve({1: 1.0, 512: 1.0}), 64) is None  # a flat T pays at any size
    linear = CostCurve({1: 1.0, 101: 2.0})  # each row 1% of T(1): (1.3) / T(2B) <= 1 / T(B) from B = 43
    assert stop_estimate(0.3, 1.0, linear, 64) == 43
    # in exact mode a pass holds at most 48 rows: 24 requests drafting 1 token fill it
    assert stop_estimate(0.5, 1.0, CostCurve({1: 1.0, 512: 1.0}), 64, widest=48) == 25


def test_the_cost_models_estimate_of_where_any_drafting_stops():
    from specdec.decoders.evaluation.batch_estimates import any_stop_estimate
    from specdec.decoders.models.cost import CostCurve

    steep_after_8 = CostCurve({1: 1.0, 8: 1.0, 9: 2.0, 64: 57.0})
    # a 9th row doubles the pass: even a draft token accepted 9 times in 10 stops paying at 8 rows
    assert any_stop_estimate(0.9, steep_after_8, 64) == 8
    assert any_stop_estimate(0.9, CostCurve({1: 1.0, 512: 1.0}), 64) is None
    # exact mode's widest pass: 48 requests leave no row for a draft, however cheap rows are
    assert any_stop_estimate(0.9, CostCurve({1: 1.0, 512: 1.0}), 64, widest=48) == 48
    assert any_stop_estimate(0.9, steep_after_8, 64, widest=48) == 8  # the cost stops it first
    linear = CostCurve({1: 1.0, 1001: 11.0})  # each row 1% of T(1): 0.3 k (99 + B) <= B k from B = 42.4
    assert any_stop_estimate(0.3, linear, 200) == 43
    assert any_stop_estimate(0.3, linear, 40) is None
    stepped = CostCurve({1: 1.0, 8: 1.0, 9: 1.5, 16: 1.5, 17: 3.0, 64: 50.0})
    # at 8 rows a 9th alone does not pay, but 8 more do (the step's rows are free): stop at 16
    assert any_stop_estimate(0.9, stepped, 64) == 16
    # a step right after 2 rows stops drafting at 2 but not beyond it: the estimate is where it
    # stops for good (past the step each row costs 0.01: 0.5 T(B) <= 0.01 B from B = 157)
    early_step = CostCurve({1: 1.0, 2: 1.0, 3: 1.6, 200: 1.6 + 197 * 0.01})
    assert any_stop_estimate(0.5, early_step, 400) == 158
    assert any_stop_estimate(0.5, early_step, 100) is None


def test_where_any_drafting_stops_follows_the_best_requests_first_tokens():
    """The joint choice takes the likeliest first tokens of the batch first, so the estimate
    ranks B draws of their values: where half the rounds' first token is worth 0.6 and half
    nothing, drafting pays up to where a 0.6 token stops paying (B = 99 * 0.6 / 0.4, 149),
    not where the mean 0.3 does (43)."""
    from specdec.decoders.evaluation.batch_estimates import any_stop_estimate, lead_quantiles, ranked_leads
    from specdec.decoders.models.cost import CostCurve

    linear = CostCurve({1: 1.0, 1001: 11.0})  # each row 1% of T(1)
    halves = lead_quantiles([0.0] * 50 + [0.6] * 50)
    assert len(halves) == 21 and halves[:10] == [0.0] * 10 and halves[11:] == [0.6] * 10
    assert any_stop_estimate(halves, linear, 400) == 149
    assert any_stop_estimate(0.3, linear, 400) == 43
    assert any_stop_estimate(lead_quantiles([0.3] * 10), linear, 400) == 43  # alike: the mean's
    spread = lead_quantiles([i / 100 for i in range(101)])
    assert ranked_leads(spread, 1) == pytest.approx([0.5])  # one request: the median
    best_of_ten = ranked_leads(spread, 10)
    assert best_of_ten == sorted(best_of_ten, reverse=True) and best_of_ten[0] == pytest.approx(0.95)
    assert lead_quantiles([]) == []


def test_estimates_from_a_small_batch_search_up_to_exact_modes_widest_pass():
    """Sizes run up to 8 search to 32 by default; in exact mode at least to its widest pass
    (48), where no draft row is left, so the estimate is a size there, not "beyond 32". The
    table says where drafting stops paying, or up to which size it pays."""
    from specdec.decoders.evaluation.batch_estimates import stop_estimates
    from specdec.decoders.evaluation.batching import format_batch_table
    from specdec.decoders.models.cost import CostCurve
    from specdec.decoders.models.machine import machine_info

    flat = CostCurve({1: 1.0, 512: 1.0})
    row = {
        "pipeline": "suffix+tree",
        "batch_size": 1,
        "accepted_per_request": 0.9,
        "drafted_per_request": 1.0,
    }
    row["first_accepted"] = 0.9
    plain = stop_estimates([row], flat, 8)["suffix+tree"]
    assert plain["stops_at"] is None and plain["any_stops_at"] is None and plain["searched_to"] == 32
    exact = stop_estimates([row], flat, 8, widest=48)["suffix+tree"]
    assert exact["stops_at"] == 25 and exact["any_stops_at"] == 48 and exact["searched_to"] == 48
    payload = {"model": "tiny", "dtype": "float32", "prompts": 8, "max_new_tokens": 16, "arrivals": None}
    payload |= {
        "batch_sizes": [1, 8],
        "rows": [],
        "machine": machine_info(),
        "stop_estimates": {"suffix+tree": plain},
    }
    table = format_batch_table(payload)
    assert "stops paying" not in table and table.count("pays at every batch size up to 32") == 2
    payload["stop_estimates"] = {"suffix+tree": exact}
    table = format_batch_table(payload)
    assert "suffix+tree" in table and "stops paying at batch size 25; any draft token" in table
    assert "stops paying at batch size 48 (exact mode: a pass holds at most 48 rows" in table


def scripted_runs(seconds: dict[str, list[float]]):
    """A run_once for measure_size whose runs take the scripted seconds (10 tokens each), in
    the order asked, and the order it was asked in: no test here reads the machine's clock."""
    from specdec.decoders.evaluation.batching import BatchRun

    asked: list[str] = []

    def run_once(name: str) -> BatchRun:
        asked.append(name)
        taken = seconds[name][sum(1 for n in asked if n == name) - 1]
        return BatchRun([[0] * 10], taken, [taken], 0.0)

    return run_once, asked


NAMES = ["standard", "ngram+greedy", "standard (A/A)"]


def test_a_size_runs_again_while_its_twin_is_outside_its_band():
    """Run 1: the twin at 0.89x (outside ±3%); run 2 brings the mean of its rates to within
    1% of standard's: two runs, the contenders in turn, the order rotating."""
    from specdec.decoders.evaluation.batching import measure_size, size_rows, twin_speedup

    run_once, asked = scripted_runs(
        {"standard": [1.0, 1.0, 1.0], "ngram+greedy": [0.5, 0.5, 0.5], "standard (A/A)": [1.125, 0.89, 1.0]}
    )
    runs = measure_size(run_once, NAMES, least=1, most=4)
    assert asked == NAMES + NAMES[1:] + NAMES[:1]  # run 2 starts with the next contender
    assert twin_speedup(runs) == pytest.approx(1.0, abs=0.01)
    rows = {row["pipeline"]: row for row in size_rows(4, runs, [[0] * 10])}
    assert rows["standard (A/A)"]["runs"] == 2 and rows["ngram+greedy"]["speedup"] == pytest.approx(2.0)
    assert rows["standard (A/A)"]["speedup_spread"] == pytest.approx(statistics.stdev([1 / 1.125, 1 / 0.89]))


def test_a_size_stops_at_batch_repeats_and_runs_bench_repeats_at_least():
    from specdec.decoders.evaluation.batching import measure_size

    noisy, asked = scripted_runs(
        {"standard": [1.0] * 9, "ngram+greedy": [1.0] * 9, "standard (A/A)": [1.2] * 9}
    )
    assert len(measure_size(noisy, NAMES, least=1, most=3)["standard"]) == 3  # outside every time: the cap
    quiet, asked = scripted_runs({name: [1.0] * 9 for name in NAMES})
    assert len(measure_size(quiet, NAMES, least=2, most=3)["standard"]) == 2  # within at once: bench.repeats
    without_twin, asked = scripted_runs({name: [1.0, 2.0, 3.0] for name in NAMES[:2]})
    assert len(measure_size(without_twin, NAMES[:2], least=1, most=3)["standard"]) == 1  # bench.aa=false


def test_the_twin_line_says_the_runs_it_took_and_whether_the_cap_was_reached():
    from specdec.decoders.evaluation.batching import twin_line

    payload = {"repeats": 1, "batch_repeats": 4}
    inside = {"batch_size": 4, "speedup": 1.01, "runs": 2, "speedup_spread": 0.031}
    assert twin_line(inside, payload) == (
        "A/A twin at batch 4: 1.010x, within ±3% (the noise band) after 2 runs, spread ±3.1% run to run"
    )
    outside = {"batch_size": 1, "speedup": 0.89, "runs": 4, "speedup_spread": 0.08}
    assert twin_line(outside, payload).endswith(
        "warning: outside ±3% (the noise band) after 4 runs, spread ±8.0% run to run "
        "(bench.batch_repeats=4 reached: give it more runs, or a quieter machine)"
    )


def test_sizes_the_prompts_cannot_fill_are_cut_to_them_and_said(capsys):
    """bench.batch_size=64 over 6 prompts was labelled batch 64; [1,4,16] over 12 reported a
    batch 16 that never held more than 12."""
    from specdec.decoders.evaluation.batching import reached_sizes

    assert reached_sizes([1, 4, 16], 12) == [1, 4, 12]
    assert capsys.readouterr().err == (
        "[bench] bench.batch_size: 12 prompts never fill a batch of 16; measured and labelled as batch 12; "
        "give more prompts (workload.limit) for larger batches\n"
    )
    assert reached_sizes([6, 8, 64], 6) == [6]
    assert "never fill a batch of 8, 64; measured and labelled as batch 6 (once)" in capsys.readouterr().err
    assert reached_sizes([1, 2], 6) == [1, 2] and capsys.readouterr().err == ""


def test_a_batch_larger_than_the_workload_is_labelled_as_the_batch_it_is(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    overrides = ["proposer=ngram", "bench.batch_size=[2,8]", "bench.aa=false", "bench.max_new_tokens=2"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), f"hydra.run.dir={run_dir}", *overrides))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["batch_sizes"] == [2, 3] and results["batch_sizes_asked"] == [2, 8]
    assert {row["batch_size"] for row in results["rows"]} == {2, 3}
    assert "3 prompts never fill a batch of 8" in capsys.readouterr().err
