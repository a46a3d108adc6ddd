"""A Hydra multirun sweep of the bench in a temporary directory, then the sweep report."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from specdec.decoders import report
from specdec.decoders.evaluation import report as sweep_report
from tests.bench_helpers import run_bench, tiny_overrides, write_workload


def test_multirun_sweep_and_report(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    overrides = ["proposer=ngram", "proposer.k=1,3", f"hydra.sweep.dir={sweep}", "bench.plots=false"]
    run_bench(monkeypatch, ["--multirun", *tiny_overrides(write_workload(tmp_path), *overrides)])

    # Each job wrote results.json into its own job directory.
    job_results = {job: json.loads((sweep / job / "results.json").read_text()) for job in ("0", "1")}
    assert [r["config"]["proposer"]["k"] for r in job_results.values()] == [1, 3]

    capsys.readouterr()  # drop the sweep's own output
    assert report.main([str(sweep)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| run | pipeline | kind | proposer.k | tok/s | speedup |")

    with (sweep / "report.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["run"], row["pipeline"], row["proposer.k"]) for row in rows] == [
        ("0", "ngram+greedy", "1"),
        ("1", "ngram+greedy", "3"),
    ]
    for row, results in zip(rows, job_results.values()):
        ngram = next(p for p in results["pipelines"] if p["kind"] == "speculative")
        assert float(row["speedup"]) == ngram["speedup"]
        control = next(p for p in results["pipelines"] if p["kind"] == "control")  # the run's A/A
        assert float(row["aa_speedup"]) == control["speedup"]
        assert float(row["identical_outputs"]) == 1.0
    assert (sweep / "speedup_vs_k.png").read_bytes()[:4] == b"\x89PNG"


def _payload(temperature: float, k: int) -> dict:
    def entry(name: str, kind: str, speedup: float) -> dict:
        info = {"proposer_config": {"k": k, "max_n": 3}} if kind == "speculative" else None
        return {"name": name, "kind": kind, "speedup": speedup, "tokens_per_s": 10.0 * speedup, "info": info}

    return {
        "prompts": 2,
        "config": {"sampling": {"temperature": temperature}, "logger": {"dir": str(k)}, "proposer": {"k": k}},
        "pipelines": [entry("standard", "standard", 1.0), entry("ngram+rejection", "speculative", 1.5)],
    }


def test_report_shows_only_options_that_vary():
    root = Path("/sweep")
    runs = [(root / "0" / "results.json", _payload(0.5, 4)), (root / "1" / "results.json", _payload(1.0, 4))]
    rows, varying = sweep_report.report_rows(runs, root)
    assert varying == ["sampling.temperature"]  # k, max_n and the logger's dir are the same or ignored
    assert [row["run"] for row in rows] == ["0", "1"]  # standard decoding left out
    assert sweep_report.draft_size_option(rows, varying) is None  # nothing to plot against
    assert "| sampling.temperature |" in sweep_report.markdown_table(rows, varying)


def test_report_says_the_files_it_found_were_unusable(tmp_path, capsys):
    """A truncated results.json and a batch-mode one: the report said "no results.json under DIR"."""
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "results.json").write_text('{"model": "tiny-random", "pipel')
    (tmp_path / "batch").mkdir()
    (tmp_path / "batch" / "results.json").write_text(
        json.dumps({"mode": "batch", "batch_sizes": [1, 4], "rows": []})
    )
    with pytest.raises(SystemExit) as exit:
        report.main([str(tmp_path)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"[report] skipping {tmp_path / 'batch' / 'results.json'}: a batch-mode run (bench.batch_size=[1, 4])"
        in err
    )
    assert f"[report] skipping {tmp_path / 'cut' / 'results.json'}: not a readable results.json" in err
    last = err.strip().splitlines()[-1]
    assert f"error: none of the 2 results.json under {tmp_path} could be used" in last
    assert str(tmp_path / "cut" / "results.json") in last and "no results.json under" not in last
