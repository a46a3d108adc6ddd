"""The fidelity audit (python -m specdec.decoders.audit) end to end on tiny models, and its statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import fields

import pytest
import torch
from hydra import compose, initialize_config_dir
from scipy import stats

from specdec.decoders import Pipeline, SamplingConfig
from specdec.decoders.cli.config import CONF_DIR
from specdec.decoders.engine.draft import Acceptance
from specdec.decoders.engine.registry import proposer_registry, register_verifier, verifier_registry
from specdec.decoders.engine.verifier import Verifier
from specdec.decoders.evaluation.audit import LossyVerifierError, reusing_prompts, run_audit
from specdec.decoders.evaluation.audit_statistics import (
    ChiSquare,
    combined_p_value,
    goodness_of_fit,
    sequence_tests,
    sequential_goodness_of_fit,
    sequential_two_sample,
    two_sample,
)
from specdec.decoders.models.session import ModelSession
from tests.bench_helpers import write_workload
from tests.conftest import REPO_ROOT

ACCEPT_ALL = "audit_test_accept_all"


@pytest.fixture(scope="module")
def accept_all_verifier() -> str:
    """A lossy verifier, declared so: keeps every draft token, then the target's argmax."""
    if ACCEPT_ALL not in verifier_registry:

        @register_verifier(ACCEPT_ALL)
        class AcceptAll(Verifier):
            lossless = False

            def verify(self, draft, target_logits, sampling, generator) -> Acceptance:
                bonus = int(target_logits[len(draft)].argmax())
                return Acceptance(list(range(len(draft))), draft.tokens + [bonus])

    return ACCEPT_ALL


def audit_config(tmp_path, *overrides: str):
    """The composed audit config for the tiny model, W&B off, output in tmp_path."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "audit",
            [
                "model=tiny-random",
                "model.dtype=float64",
                "logger=disabled",
                f"audit.output={tmp_path / 'audit.json'}",
                f"artifacts_dir={tmp_path / 'artifacts'}",
                *overrides,
            ],
        )


def test_audit_cli_on_an_enumerable_vocabulary(tmp_path):
    """`python -m specdec.decoders.audit` writes audit.json with a passing verdict: greedy
    identity and the exact chi-square test of the first sampled tokens."""
    command = [
        sys.executable, "-m", "specdec.decoders.audit",
        "model=tiny-random", "model.vocab_size=8", "model.dtype=float64",
        "proposer=ngram", "verifier=rejection", "sampling.temperature=1.0",
        "audit.prompts=3", "audit.max_new_tokens=12", "audit.sampling_prompts=1", "audit.samples=80",
        "logger=disabled", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "PASSED" in completed.stdout
    audit = json.loads((tmp_path / "run" / "audit.json").read_text())  # audit.output defaults to the run dir
    assert audit["passed"] is True and audit["complete"] is True
    assert audit["greedy_identical"] == 1.0 and audit["divergences"] == []
    assert audit["greedy_prompts"] == 3 and audit["dtype"] == "float64"
    assert audit["pipeline"] == "ngram+rejection" and audit["declared_lossless"] is True
    assert audit["sampling"]["method"] == "exact"
    assert audit["pipeline_samples"] == 80 and audit["standard_samples"] == 0
    tests = audit["sampling"]["tests"]
    assert [(t["position"], t["kind"]) for t in tests] == [  # audit.sampled_tokens=3
        (0, "conditional"), (1, "conditional"), (1, "marginal"), (2, "conditional"), (2, "marginal")
    ]  # fmt: skip
    assert all(t["impossible"] == 0 for t in tests) and sum(t["dof"] for t in tests) > 0
    assert 0.001 < audit["sampling_p_value"] <= 1.0


def test_audit_two_sample_test_on_a_tokenizer_model(tmp_path):
    """A vocabulary too large to enumerate: pipeline and standard samples are compared,
    on workload prompts encoded with the chat template."""
    cfg = audit_config(
        tmp_path,
        "proposer=draft_model",
        "verifier=rejection",
        "sampling.temperature=1.0",
        f"workload.path={write_workload(tmp_path)}",
        "audit.prompts=2",
        "audit.max_new_tokens=10",
        "audit.sampling_prompts=2",
        "audit.samples=50",
    )
    partial_records: list[dict] = []
    audit = run_audit(cfg, checkpoint=partial_records.append)
    assert audit["passed"] is True, audit["verdict"]
    assert audit["greedy_identical"] == 1.0
    assert audit["sampling"]["method"] == "two_sample"
    assert audit["pipeline_samples"] == audit["standard_samples"] == 100
    assert audit["sampling_p_value"] > 0.001 and audit["complete"] is True
    # checkpoints: after each greedy prompt but the last, after the greedy test, then after
    # each sampling prompt; none of them passed
    assert [r["complete"] for r in partial_records] == [False, False, False, False]
    assert [r["passed"] for r in partial_records] == [False, False, False, False]
    assert [r["greedy_prompts"] for r in partial_records] == [1, 2, 2, 2]
    assert [r["pipeline_samples"] for r in partial_records] == [0, 0, 50, 100]
    json.dumps(audit)  # the record is JSON-serialisable as written


def test_audit_refuses_a_lossy_verifier_when_losslessness_is_required(tmp_path, accept_all_verifier):
    cfg = audit_config(tmp_path, "proposer=ngram", f"verifier={accept_all_verifier}", "model.vocab_size=8")
    with pytest.raises(LossyVerifierError, match="audit.require_lossless=false"):
        run_audit(cfg)


def test_audit_measures_a_lossy_verifier_with_logit_gaps(drafting_pays, tmp_path, accept_all_verifier):
    cfg = audit_config(
        tmp_path,
        "proposer=ngram",
        f"verifier={accept_all_verifier}",
        "model.vocab_size=8",
        "audit.require_lossless=false",
        "audit.prompts=6",
        "audit.max_new_tokens=16",
    )
    audit = run_audit(cfg)
    assert audit["passed"] is False and audit["verdict"].startswith("FAILED (verifier declared lossy)")
    assert audit["declared_lossless"] is False
    assert audit["divergences"] and audit["greedy_identical"] < 1.0
    assert audit["greedy_identical"] == 1 - len(audit["divergences"]) / 6
    for divergence in audit["divergences"]:
        assert divergence["standard_token"] != divergence["pipeline_token"]
        assert 0 <= divergence["position"] < 16
        assert divergence["logit_gap"] > audit["tie_tolerance"]  # standard chose the target's argmax
    assert audit["sampling_p_value"] is None and audit["pipeline_samples"] == 0


def test_audit_needs_a_proposer(tmp_path):
    cfg = audit_config(tmp_path, "~proposer", "model.vocab_size=8")
    with pytest.raises(ValueError, match="proposer=NAME"):
        run_audit(cfg)


# --------------------------------------------------------------------- statistics


def test_chi_square_p_values_match_scipy():
    for statistic, dof in [(0.5, 1), (3.2, 2), (30.0, 17), (250.0, 200)]:
        assert ChiSquare(statistic, dof).p_value == pytest.approx(stats.chi2.sf(statistic, dof), rel=1e-6)
    assert ChiSquare(5.0, 0).p_value == 1.0
    assert ChiSquare(0.0, 3, impossible=1).p_value == 0.0


def test_goodness_of_fit_matches_scipy_and_bins_rare_outcomes():
    expected = {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.04, "e": 0.01}
    observed = Counter({"a": 52, "b": 27, "c": 14, "d": 6, "e": 1})
    test = goodness_of_fit(observed, expected)  # d and e (expected 4 and 1) are binned together
    reference = stats.chisquare([52, 27, 14, 7], [50, 30, 15, 5])
    assert test.dof == 3
    assert test.statistic == pytest.approx(reference.statistic)
    assert test.p_value == pytest.approx(reference.pvalue)
    assert goodness_of_fit(Counter({"z": 1, "a": 99}), expected).impossible == 1


def test_two_sample_matches_scipy_contingency():
    first = Counter({"x": 40, "y": 30, "z": 25, "w": 3})
    second = Counter({"x": 50, "y": 20, "z": 28, "w": 2})
    test = two_sample(first, second)  # w (5 in all) joins y (50), the least frequent kept outcome
    table = [[40, 25, 33], [50, 28, 22]]
    statistic, p_value, dof, _ = stats.chi2_contingency(table, correction=False)
    assert (test.dof, test.statistic, test.p_value) == (dof, pytest.approx(statistic), pytest.approx(p_value))


def test_sequential_tests_hold_their_level_and_detect_a_difference():
    """On samples of the tested distribution p-values are not small; on a perturbed
    one they are (fixed seeds: deterministic)."""
    generator = torch.Generator().manual_seed(0)
    weights = [0.4, 0.3, 0.15, 0.1, 0.05]
    vocab = len(weights)
    expected = {  # a 3-token distribution whose conditionals depend on the prefix
        (a, b, c): weights[a] * weights[(a + b) % vocab] * weights[(b + c) % vocab]
        for a in range(vocab)
        for b in range(vocab)
        for c in range(vocab)
    }
    outcomes = list(expected)
    probs = torch.tensor([expected[o] for o in outcomes], dtype=torch.float64)
    skewed = probs * torch.tensor([1.6 if o[1] == 0 else 1.0 for o in outcomes], dtype=torch.float64)

    def draw(distribution: torch.Tensor, count: int = 3000) -> Counter:
        picks = torch.multinomial(distribution, count, replacement=True, generator=generator)
        return Counter(outcomes[i] for i in picks.tolist())

    assert combined_p_value(sequential_goodness_of_fit(draw(probs), expected)) > 0.01
    assert combined_p_value(sequential_two_sample(draw(probs), draw(probs))) > 0.01
    assert combined_p_value(sequential_goodness_of_fit(draw(skewed), expected)) < 1e-4
    positions = sequential_two_sample(draw(skewed), draw(probs))  # two samples: less power
    assert combined_p_value(positions) < 1e-3
    assert positions[1].p_value < 1e-3 < positions[0].p_value  # found at the second token


def test_marginal_tests_see_differences_behind_spread_prefixes():
    """When first tokens are too spread for per-prefix tests, the second token's
    marginal still compares the samples."""
    generator = torch.Generator().manual_seed(1)

    def draw(prob_zero: float) -> Counter:
        first = torch.randint(400, (2000,), generator=generator).tolist()
        second = (torch.rand(2000, generator=generator) >= prob_zero).long().tolist()
        return Counter(zip(first, second))

    tests = sequence_tests(draw(0.5), draw(0.6), exact=False)
    assert tests[(1, "conditional")].dof <= 3  # about 5 samples per prefix and side: nearly all binned
    assert tests[(1, "marginal")].p_value < 1e-4
    assert combined_p_value(sequence_tests(draw(0.5), draw(0.5), exact=False).values()) > 0.01


@pytest.mark.parametrize("proposer", [None, *proposer_registry.names()])
def test_prompt_reuse_session_changes_nothing_but_the_cost(
    tiny_model, tiny_config, tmp_path, monkeypatch, proposer
):
    """The sampling test's prefill reuse gives, seed by seed, the tokens of fresh prefills."""
    model, tokenizer = tiny_model
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    knobs = {f.name for f in fields(proposer_registry.get(proposer).Config)} if proposer else set()
    if knobs & {"adaptive", "tree_budget"}:
        # Adaptive sizing and automatic tree budgets weigh the drafting time measured on this
        # machine: the two pipelines could size differently under load (a CI run on both cores
        # did, for the draft model's tree). Here only the prefill reuse is tested.
        pinned = {"adaptive": False, "tree_budget": 4}
        proposer = {"name": proposer, **{knob: value for knob, value in pinned.items() if knob in knobs}}
    try:
        fresh = Pipeline(model, tokenizer, proposer, "rejection" if proposer else None, sampling,
                         model_config=tiny_config, artifacts_dir=tmp_path)  # fmt: skip
    except FileNotFoundError as missing:  # needs a trained artifact that is not there
        pytest.skip(str(missing))
    reused = reusing_prompts(fresh.with_components(proposer, "rejection" if proposer else None))
    pass_lengths: list[int] = []
    forward = ModelSession.forward

    def counting(session, tokens, *args, **kwargs):
        if session is reused.session:
            pass_lengths.append(len(tokens))
        return forward(session, tokens, *args, **kwargs)

    monkeypatch.setattr(ModelSession, "forward", counting)
    prompts = ([5, 6, 7, 5, 6, 7, 5, 6], [9] * 11)  # longer than any verification pass
    for prompt in prompts:
        for seed in range(6):
            expected = fresh.generate(prompt, 8, seed=seed)
            result = reused.generate(prompt, 8, seed=seed)
            assert result.tokens == expected.tokens
            assert result.stats.accepted == expected.stats.accepted
    assert pass_lengths.count(8) == pass_lengths.count(11) == 1  # one real prefill per prompt
