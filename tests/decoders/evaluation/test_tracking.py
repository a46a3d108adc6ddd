"""W&B tracking of a bench run: an offline run read back from disk, and W&B failures."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import wandb
from wandb.proto import wandb_internal_pb2

from tests.bench_helpers import run_bench, tiny_overrides, write_workload


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a .wandb file: a 7-byte header, then 32 KiB blocks of chunks, each
    with a (crc32, length, type) header; types 1-4 are full/first/middle/last."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        left_in_block = 32768 - position % 32768
        if left_in_block < 7:  # block trailer padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.fixture()
def wandb_home(tmp_path, monkeypatch) -> None:
    """Keep W&B's caches and settings inside the test's directory."""
    for variable in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / variable.lower()))


@pytest.mark.usefixtures("wandb_home")
def test_offline_run_holds_config_summary_table_and_plots(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    overrides = ["proposer=ngram", f"hydra.run.dir={run_dir}", "logger=wandb", "logger.mode=offline"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))

    wandb.teardown()  # the W&B service writes the run file out when it shuts down
    results = json.loads((run_dir / "results.json").read_text())
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")  # logger.dir defaults to the run dir
    (run_file,) = offline_run.glob("run-*.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "specdec" and run.display_name == "run"  # the run directory's name
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["name"] == "tiny-random" and config["proposer"]["name"] == "ngram"

    summary = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
        if item.key
    }
    ngram = next(p for p in results["pipelines"] if p["name"] == "ngram+greedy")
    assert summary["prompts"] == 3
    assert summary["standard/speedup"] == 1.0
    assert summary["ngram+greedy/speedup"] == pytest.approx(ngram["speedup"])
    assert summary["ngram+greedy/mean_accepted_tokens"] == pytest.approx(ngram["mean_accepted_tokens"])
    assert summary["ngram+greedy/categories/qa/speedup"] == pytest.approx(
        ngram["categories"]["qa"]["speedup"]
    )

    (table_file,) = (offline_run / "files" / "media" / "table").glob("records_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:3] == ["pipeline", "kind", "prompt_id"] and "text" in table["columns"]
    assert len(table["data"]) == 3 * 3  # three pipelines (standard, its A/A twin, ngram) x three prompts
    images = {
        p.name.split("_0_")[0] for p in (offline_run / "files" / "media" / "images" / "plots").glob("*.png")
    }
    assert images == {"speedup_by_category", "tau_distribution", "cost_curve"}


def test_wandb_failure_keeps_results(tmp_path, monkeypatch, capsys):
    def broken_init(**kwargs):
        raise RuntimeError("no W&B here")

    monkeypatch.setattr(wandb, "init", broken_init)
    run_dir = tmp_path / "run"
    overrides = ["proposer=ngram", f"hydra.run.dir={run_dir}", "logger=wandb", "bench.plots=false"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))

    assert json.loads((run_dir / "results.json").read_text())["prompts"] == 3
    assert "W&B logging failed (RuntimeError: no W&B here)" in capsys.readouterr().err
