"""`python -m specdec.decoders.generate` end to end on the tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def run_generate(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec.decoders.generate", "model=tiny-random", *overrides],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_generate_streams_and_prints_stats(tmp_path):
    done = run_generate(
        "prompt=hello hello hello", "proposer=ngram", "verifier=greedy", "max_new_tokens=24", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "[ngram+greedy]" in done.stderr
    assert "mean accepted (tau)" in done.stderr
    assert "new tokens          24" in done.stderr or "new tokens" in done.stderr
    standard = run_generate("prompt=hello hello hello", "max_new_tokens=24", cwd=tmp_path)
    assert standard.returncode == 0, standard.stderr
    assert "[standard]" in standard.stderr
    assert done.stdout == standard.stdout  # greedy: same text with or without speculation


def test_generate_rejects_unknown_proposer_and_bad_sampling(tmp_path):
    unknown = run_generate("proposer=nope", cwd=tmp_path)
    assert unknown.returncode != 0
    assert "proposer/nope" in unknown.stderr and "ngram" in unknown.stderr
    bad = run_generate("sampling.temperature=-1", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: sampling.temperature must be >= 0")
    assert "Traceback" not in bad.stderr


def test_project_errors_are_one_line_unless_debugging(tmp_path):
    """A missing trained artifact: one `error:` line naming the train command, exit 2;
    debug=true keeps the traceback."""
    missing = run_generate("prompt=hi", "proposer=medusa", f"artifacts_dir={tmp_path}", cwd=tmp_path)
    assert missing.returncode == 2, missing.stderr
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no Medusa heads") and "python -m specdec.train drafter=medusa" in last
    assert "Traceback" not in missing.stderr
    debugging = run_generate(
        "prompt=hi", "proposer=medusa", f"artifacts_dir={tmp_path}", "debug=true", cwd=tmp_path
    )
    assert debugging.returncode not in (0, 2) and "FileNotFoundError" in debugging.stderr


def test_ctrl_c_keeps_the_text_and_says_what_was_decoded(tmp_path, monkeypatch, capsys):
    """Interrupted in its 6th round: the streamed text stays, the stats of the tokens decoded
    follow, the last line says it was interrupted, and the status is 130 (it printed the
    partial text and nothing else)."""
    from specdec.decoders import generate
    from specdec.decoders.engine.decoding import Decoding

    real_step, rounds = Decoding.step, []

    def step(self):
        rounds.append(1)
        if len(rounds) == 6:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Decoding, "step", step)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["generate", "model=tiny-random", "prompt=hello hello", "max_new_tokens=40"]
    )
    with pytest.raises(SystemExit) as exit_:
        generate.main()
    assert exit_.value.code == 130
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out  # the text streamed before the interrupt
    assert lines[-1] == (
        "[generate] interrupted after 6 of 40 tokens: the text and stats above are what was decoded"
    )  # the prefill's token and one per round of standard decoding
    assert (
        "[standard]" in lines
        and "new tokens          6" in lines
        and "target passes       5 (+ prefill)" in lines
    )
