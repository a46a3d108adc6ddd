"""`python -m decoders.generate` end to end on the tiny model."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT


def run_generate(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "decoders.generate", "model=tiny-random", *overrides],
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
    assert bad.returncode != 0 and "sampling.temperature must be >= 0" in bad.stderr
