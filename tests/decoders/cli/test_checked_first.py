"""Inputs and outputs are checked before any work: a bad one is one `error:` line naming its
option (status 2), and the model is never loaded first. Each case failed after decoding (or
after loading the model, or after generating training data) before these checks."""

from __future__ import annotations

import os
import sys

import pytest

from tests.bench_helpers import write_workload


@pytest.fixture()
def no_model(monkeypatch, tmp_path):
    """Loading the model fails the test: whatever is refused must be refused before it."""
    from specdec.decoders.engine import pipeline
    from specdec.decoders.evaluation import audit, benchmark
    from specdec.train import job

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    for module in (pipeline, benchmark, audit, job):
        monkeypatch.setattr(module, "load_model", loaded)
    monkeypatch.chdir(tmp_path)  # Hydra's run folders


def one_line(monkeypatch, capsys, module: str, *overrides: str) -> str:
    """Run ``python -m MODULE OVERRIDES`` in this process; it ends with one `error:` line, status 2."""
    import importlib

    main = importlib.import_module(module).main
    logger = [] if module.endswith("generate") else ["logger=disabled"]
    monkeypatch.setattr(sys, "argv", [module, "model=tiny-random", *logger, *overrides])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_a_suffix_memory_path_that_cannot_be_written_is_refused_first(
    no_model, monkeypatch, capsys, tmp_path
):
    """A file where the memory's folder should be: FileExistsError after decoding, before."""
    blocker = tmp_path / "FILE"
    blocker.write_text("")
    memory = blocker / "mem.json"
    line = one_line(monkeypatch, capsys, "specdec.decoders.generate", "proposer=suffix",
                    f"proposer.memory_path={memory}")  # fmt: skip
    assert f"proposer.memory_path={memory}" in line and f"{blocker} is a file, not a folder" in line
    assert "give proposer.memory_path a file path in a writable folder" in line
    merged = f"bench.pipelines=[{{proposer:{{name:merge,members:[ngram,{{name:suffix,memory_path:'{memory}'}}]}}}}]"
    line = one_line(monkeypatch, capsys, "specdec.decoders.bench", merged, f"bench.output={tmp_path}/r.json")
    assert f"proposer.memory_path={memory}" in line
    line = one_line(monkeypatch, capsys, "specdec.decoders.audit", "proposer=suffix",
                    f"proposer.memory_path={tmp_path}", f"audit.output={tmp_path}/a.json")  # fmt: skip
    assert f"proposer.memory_path={tmp_path}" in line and "is a folder" in line


def test_the_memory_path_is_checked_by_the_proposer_too(tmp_path):
    """Through the Python API (no command line), still before the first request."""
    from specdec.proposers.suffix import SuffixProposer

    (tmp_path / "FILE").write_text("")
    with pytest.raises(ValueError, match="proposer.memory_path=.*is a file, not a folder"):
        SuffixProposer.Config(memory_path=str(tmp_path / "FILE" / "mem.json"))
    assert SuffixProposer.Config(memory_path=str(tmp_path / "new" / "mem.json")).memory_path


@pytest.mark.parametrize(
    ("module", "overrides", "expected"),
    [
        ("specdec.decoders.bench", ["proposer=ngram", "workload.path=MISSING"], "Pass workload.path=FILE"),
        ("specdec.decoders.audit", ["workload.path=MISSING", "audit.output=OUT/a.json"], "Pass workload.path=FILE"),
        ("specdec.train.__main__", ["drafter=medusa", "train.data.path=MISSING", "artifacts_dir=OUT"], "train.data.path="),
        ("specdec.train.__main__", ["drafter=medusa", "train.eval.path=MISSING", "artifacts_dir=OUT"],
         "Pass train.eval.path=FILE"),
    ],
)  # fmt: skip
def test_a_missing_workload_file_is_refused_before_the_model_loads(
    no_model, monkeypatch, capsys, tmp_path, module, overrides, expected
):
    missing = str(tmp_path / "nosuch.jsonl")
    overrides = [o.replace("MISSING", missing).replace("OUT", str(tmp_path)) for o in overrides]
    line = one_line(monkeypatch, capsys, module, *overrides)
    assert missing in line and expected in line


def test_a_present_workload_file_still_runs(tmp_path, monkeypatch):
    """The workload read before the model is the one the bench measures."""
    from tests.bench_helpers import run_bench, tiny_overrides

    output = tmp_path / "r.json"
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), "proposer=ngram", "bench.aa=false",
              "bench.max_new_tokens=2", "bench.plots=false", f"bench.output={output}",
              f"hydra.run.dir={tmp_path / 'run'}"))  # fmt: skip
    assert output.exists()


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        (
            "fast",
            "bench.arrivals=fast: neither a rate nor a list of seconds; give a rate in requests per second",
        ),
        ("[0,1]", "bench.arrivals lists 2 times for 6 prompts; give one per prompt"),
        ("-1", "bench.arrivals=-1: a rate must be > 0"),
    ],
)
def test_bench_arrivals_that_cannot_be_read_are_named_before_the_model_loads(
    no_model, monkeypatch, capsys, tmp_path, arrivals, expected
):
    """``fast`` reached float() a character at a time: 'could not convert string to float: 'f''."""
    line = one_line(monkeypatch, capsys, "specdec.decoders.bench", "proposer=ngram", "bench.batch_size=2",
                    f"bench.arrivals={arrivals}", "workload.limit=1", f"bench.output={tmp_path}/r.json")  # fmt: skip
    assert expected in line


def test_an_output_another_run_is_writing_is_refused_before_any_work(no_model, monkeypatch, capsys, tmp_path):
    """Two audits given one audit.output at once both said "wrote", and one record was lost:
    now the second is refused, naming the process that holds the file; once the first ends
    the file is free again (and a later run overwrites it, as any output)."""
    from specdec.decoders.evaluation.files import held_output

    output = tmp_path / "audit.json"
    with held_output(output, "audit.output"):
        assert (tmp_path / "audit.json.lock").read_text() == str(os.getpid())
        line = one_line(monkeypatch, capsys, "specdec.decoders.audit", f"audit.output={output}")
        assert line == (
            f"error: audit.output={output}: another run (process {os.getpid()}) is writing it now; "
            "give each run at once an audit.output of its own"
        )
        bench = one_line(monkeypatch, capsys, "specdec.decoders.bench", f"bench.output={output}")
        assert f"bench.output={output}: another run (process {os.getpid()})" in bench
    assert not (tmp_path / "audit.json.lock").exists()
    with held_output(output, "audit.output"):  # free again
        pass
