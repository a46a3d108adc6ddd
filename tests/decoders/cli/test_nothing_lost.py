"""Nothing lost, nothing misreported: concurrent runs, interrupted audits, other settings'
checkpoints, stop strings, and one `error:` line (status 2) for every bad input a careless
user tried, Hydra's own errors included. Each test failed on the code before these fixes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def command(module: str, *overrides: str, cwd: Path, env: dict | None = None, timeout: int = 300):
    return subprocess.run(
        [sys.executable, "-m", module, *overrides],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess, *expected: str) -> str:
    """The command ended with status 2 and one `error:` line holding every ``expected``."""
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for text in expected:
        assert text in last, (text, last)
    return last


# ------------------------------------------------------------------ concurrency


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    """Two benches started together: two folders, two results.json (one was overwritten)."""
    bench = [sys.executable, "-m", "specdec.decoders.bench", "model=tiny-random", "logger=disabled",
             "workload.limit=1", "bench.max_new_tokens=4", "bench.plots=false", "bench.aa=false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen([*bench, f"proposer={p}"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        for p in ("ngram", "suffix")
    ]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()[-2000:]
    results = sorted((tmp_path / "outputs" / "bench").glob("*/results.json"))
    assert len(results) == 2
    proposers = {json.loads(r.read_text())["pipelines"][1]["proposer"] for r in results}
    assert proposers == {"ngram", "suffix"}


def test_the_run_folder_names_the_process(tmp_path):
    from omegaconf import OmegaConf

    import specdec.decoders.cli.config  # noqa: F401  (registers the resolver)

    assert OmegaConf.create({"a": "${run_id:}"}).a.startswith(f"{os.getpid()}-")


@pytest.mark.slow  # several processes at once
def test_concurrent_writers_of_a_suffix_memory_lose_no_request(tmp_path):
    """Three processes finishing requests into one memory file at once: all three requests
    are in it (each used to write its own memory whole, the last writer winning)."""
    memory = tmp_path / "memory.json"
    script = (
        "import sys\n"
        "from decoders import Pipeline\n"
        "from decoders.models.loading import ModelConfig, load_model\n"
        "model, tok = load_model(ModelConfig(name='tiny-random', dtype='float32'))\n"
        f"p = Pipeline(model, None).with_components({{'name': 'suffix', 'memory_path': {str(memory)!r}}}, 'tree')\n"
        "p.generate([int(sys.argv[1])] * 12 + [5, 6, 7], 8)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", script, str(10 + i)], env=env) for i in range(3)]
    assert all(run.wait(timeout=300) == 0 for run in runs)
    requests = json.loads(memory.read_text())["requests"]
    assert len(requests) == 3
    assert stat.S_IMODE(memory.stat().st_mode) & 0o044  # readable by others, as the user's files are


# ------------------------------------------------------------------ partial files


def test_results_say_whether_they_are_complete_and_consumers_check(tmp_path, monkeypatch):
    from specdec.decoders.evaluation import report
    from specdec.decoders.evaluation.replay import run_replay
    from tests.bench_helpers import run_bench, tiny_overrides, write_workload

    output = tmp_path / "run" / "results.json"
    overrides = ["proposer=ngram", f"bench.output={output}", "bench.plots=false", f"hydra.run.dir={tmp_path}"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))
    payload = json.loads(output.read_text())
    assert payload["complete"] is True and payload["prompts_planned"] == payload["prompts"]
    assert stat.S_IMODE(output.stat().st_mode) & 0o044

    payload.update(complete=False, prompts_planned=payload["prompts"] + 5)
    output.write_text(json.dumps(payload))
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match="is partial .* the bench was interrupted"):
        run_replay(OmegaConf.create({"run": str(output), "pipelines": [], "plugins": [], "cost_curve": None}))
    rows, _ = report.report_rows(report.collect(tmp_path), tmp_path)
    assert rows and all(row["run"].endswith("(partial)") for row in rows)


def test_an_unwritable_output_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = command("specdec.decoders.bench", "model=tiny-random", "proposer=ngram", f"bench.output={blocker}/r.json",
                   "logger=disabled", cwd=tmp_path)  # fmt: skip
    one_error_line(done, "bench.output=", "cannot write in", "writable folder")
    assert "[bench]" not in done.stderr  # nothing was measured first


def test_zero_repeats_is_refused(tmp_path):
    done = command(
        "specdec.decoders.bench", "model=tiny-random", "bench.repeats=0", "logger=disabled", cwd=tmp_path
    )
    one_error_line(done, "bench.repeats=0: must be at least 1")


# ------------------------------------------------------------------ the audit


def test_an_interrupted_audit_keeps_finished_prompts_and_never_passes(tmp_path, monkeypatch):
    """Interrupted during the greedy test: the prompts done are kept; during the sampling
    test: not passed, not 'skipped (temperature=0)', and says which test was cut short."""
    from specdec.decoders.evaluation import audit as audit_module
    from tests.decoders.evaluation.test_audit import audit_config

    kept: list[dict] = []
    real = audit_module.sample_outcomes

    def interrupt_in_sampling(*args, **kwargs):
        if len([k for k in kept if k["sampling"] is not None]) >= 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(audit_module, "sample_outcomes", interrupt_in_sampling)
    cfg = audit_config(tmp_path, "proposer=ngram", "sampling.temperature=1.0", "audit.prompts=3",
                       "audit.sampling_prompts=3", "audit.samples=50")  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        audit_module.run_audit(cfg, checkpoint=kept.append)
    last = kept[-1]
    assert last["complete"] is False and last["passed"] is False
    assert "skipped" not in last["verdict"] and last["verdict"].startswith("INCOMPLETE")
    assert "sampling test interrupted after 1 of 3 prompts" in last["unfinished"]
    greedy = [k for k in kept if k["sampling"] is None and k["unfinished"].startswith("greedy")]
    assert [k["greedy_prompts"] for k in greedy] == [1, 2]  # each finished prompt was kept


# ------------------------------------------------------------------ checkpoints


def linear_regression(rows_count: int):
    """(rows, a logger that logs nothing, a linear module, its squared loss) for fit()."""
    import torch

    from specdec.train.loop import RunLogger
    from tests.train.test_train import compose_train

    rows = {
        "x": torch.randn(rows_count, 3, dtype=torch.float64),
        "y": torch.randn(rows_count, dtype=torch.float64),
    }
    logger = RunLogger(compose_train(["logger=disabled"]).logger, {}, "test")
    module = torch.nn.Linear(3, 1).double()

    def loss_fn(batch):
        return ((module(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean(), {}

    return rows, logger, module, loss_fn


def test_a_run_with_other_settings_keeps_the_earlier_checkpoint(tmp_path):
    from specdec.train import checkpoints
    from specdec.train.loop import FitConfig, fit

    rows, logger, module, loss_fn = linear_regression(40)
    checkpoint = tmp_path / "checkpoint"
    fit(
        module,
        rows,
        loss_fn,
        FitConfig(epochs=1, batch_size=8, checkpoint_every=2),
        checkpoint,
        "first",
        logger,
    )
    first = checkpoints.latest(checkpoints.own_folder(checkpoint, "first"))
    assert first is not None
    fit(
        module,
        rows,
        loss_fn,
        FitConfig(epochs=2, batch_size=8, checkpoint_every=2),
        checkpoint,
        "other",
        logger,
    )
    checkpoints.remove(checkpoint, "other")  # what a trainer does once its artifact is written
    assert first.exists(), "a run with other settings deleted the earlier checkpoint"


def test_a_corrupted_checkpoint_is_one_line_naming_it(tmp_path):
    from specdec.train import checkpoints
    from specdec.train.loop import FitConfig, fit

    rows, logger, module, loss_fn = linear_regression(16)
    config = FitConfig(epochs=2, batch_size=8, checkpoint_every=1)
    checkpoint = tmp_path / "checkpoint"
    with pytest.raises(KeyboardInterrupt):
        calls = [0]

        def interrupted(batch):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return loss_fn(batch)

        fit(module, rows, interrupted, config, checkpoint, "f", logger)
    saved = checkpoints.latest(checkpoints.own_folder(checkpoint, "f"))
    (saved / checkpoints.TRAINABLE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(
        ValueError, match=r"cannot be read .*delete it \(rm -r .*\) or set train.resume=false"
    ):
        fit(module, rows, loss_fn, config, checkpoint, "f", logger)


def test_corrupted_trained_heads_are_one_line(tmp_path, trained_artifacts):
    import shutil

    from specdec.decoders import Pipeline
    from specdec.decoders.models.loading import ModelConfig, load_model

    copy = tmp_path / "artifacts"
    shutil.copytree(trained_artifacts, copy)
    heads = next(copy.glob("*/medusa/heads.safetensors"))
    heads.write_bytes(heads.read_bytes()[:100])
    model, tokenizer = load_model(ModelConfig(name="tiny-random", dtype="float64"))
    base = Pipeline(model, tokenizer, model_config=ModelConfig(name="tiny-random"), artifacts_dir=copy)
    with pytest.raises(ValueError, match="the trained artifact cannot be read .*train it again with"):
        base.with_components("medusa", "greedy")


# ------------------------------------------------------------------ stop strings


def test_a_stop_string_is_a_string(tmp_path):
    from specdec.decoders.generate import stop_strings

    assert stop_strings("assist") == ["assist"]
    assert stop_strings(["a", "b"]) == ["a", "b"] and stop_strings(None) == []


# ------------------------------------------------------------------ one line each


@pytest.mark.parametrize(
    ("module", "overrides", "expected"),
    [
        ("specdec.decoders.generate", ["proposer=nosuch"], ["Could not find 'proposer/nosuch'", "ngram"]),
        ("specdec.decoders.generate", ["proposer=ngram", "proposer.kk=3"], ["proposer.kk: no such option"]),
        ("specdec.decoders.bench", ["bench.nokey=1"], ["bench.nokey: no such option"]),
        (
            "specdec.decoders.generate",
            ["+unknown=1"],
            ["+unknown=1: adds an option no part of this command reads"],
        ),
        ("specdec.decoders.generate", ["proposer=ngram", "proposer.k=abc"], ["proposer.k=abc", "Integer"]),
        ("specdec.decoders.replay", [], ["run has no value; give run=..."]),
        (
            "specdec.decoders.generate",
            ["plugins=[nosuch_plugin]"],
            ["could not import plugin module 'nosuch_plugin'"],
        ),
        (
            "specdec.decoders.generate",
            ["model.device=cuda"],
            ["model.device=cuda", "no CUDA device", "model.device=cpu"],
        ),
        (
            "specdec.decoders.generate",
            ["model=hf", "model.name_or_path=/no/such/model"],
            ["/no/such/model: no such folder"],
        ),
        ("specdec.decoders.generate", ["prompt=caf\udce9"], ["not UTF-8 text (byte 0xe9)"]),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, module, overrides, expected):
    args = ["model=tiny-random", *overrides] if module != "specdec.decoders.replay" else overrides
    one_error_line(command(module, *args, cwd=tmp_path), *expected)


def test_a_folder_without_a_model_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    done = command("specdec.decoders.generate", "model=hf", f"model.name_or_path={tmp_path}", cwd=tmp_path)
    one_error_line(done, "not a model folder (no config.json)")


def test_workload_and_cost_curve_files_are_named(tmp_path):
    from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload
    from specdec.decoders.models.cost import read_cost_curve

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"category": "qa", "turns": ["caf\xe9"]}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"{latin} is not UTF-8 text"):
        load_workload(WorkloadConfig(name="custom", path=str(latin)))
    with pytest.raises(ValueError, match=r"its categories are \['math_reasoning', 'mt_bench'"):
        load_workload(WorkloadConfig(categories=["nosuchcat"]))
    empty = tmp_path / "curve.json"
    empty.write_text('{"seconds": {}}')
    with pytest.raises(ValueError, match=f"cannot read a cost curve from {empty}.*1-token pass"):
        read_cost_curve(empty)


def test_report_skips_a_foreign_results_file(tmp_path, capsys):
    from specdec.decoders.evaluation.report import collect

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.json").write_text('{"something": "else"}')
    assert collect(tmp_path) == []
    assert "not a results.json written by python -m specdec.decoders.bench" in capsys.readouterr().err


def test_ship_refuses_a_folder_that_holds_no_drafter(tmp_path):
    from specdec.train.ship import main

    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path)])
    assert exit_.value.code == 2


def test_sigterm_is_said_and_kept_as_ctrl_c():
    """SIGTERM (a scheduler's stop, `kill`) reaches a command as Ctrl-C does: its own
    handler says what it kept, then it exits with status 130."""
    import signal

    from specdec.decoders.cli.errors import INTERRUPTED_STATUS, cli_errors

    said = []

    def task(cfg):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            said.append("interrupted: results so far kept")
            raise

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_:
            cli_errors(task)({})
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.code == INTERRUPTED_STATUS and said


def test_eval_only_without_an_artifact_fails_before_generating_data(tmp_path):
    done = command("train", "drafter=medusa", "model=tiny-random", "logger=disabled", "train.eval.only=true",
                   f"artifacts_dir={tmp_path}", f"train.data_dir={tmp_path / 'data'}", cwd=tmp_path)  # fmt: skip
    one_error_line(done, "train.eval.only=true, but there is no medusa artifact")
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("part_*"))
