"""Shared fixtures: tiny seeded models in float64 so exact equality can be asserted.

No test reads the machine it runs on: the project's caches and W&B's folders
point at a temporary directory, and the target's pass cost T(n), which the
adaptive drafting policies read, is a synthetic curve written there and handed
to every process through ``SPECDEC_COST_CURVE`` (subprocesses included).
``SPECDEC_TEST_COST=flat|steep|moderate`` picks its shape (default moderate), so
the suite can be checked against a machine where wide passes are free and one
where every token costs a full pass; a test whose assertions need drafting to
pay passes its own curve (``Pipeline(..., cost_curve=...)``) or turns
adaptivity off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)  # tiny models gain nothing from threads; CI has 2 shared cores

from specdec.decoders import Pipeline  # noqa: E402
from specdec.decoders.engine.proposer import NeedsTokenizer  # noqa: E402
from specdec.decoders.engine.registry import verifier_registry  # noqa: E402
from specdec.decoders.models import cpu  # noqa: E402
from specdec.decoders.models.cost import COST_CURVE_ENV, CostCurve  # noqa: E402
from specdec.decoders.models.loading import ModelConfig, load_model  # noqa: E402
from specdec.train.job import store_drafter_configs  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = (1, 2, 4, 8, 16, 32, 64)
TEST_COST_CURVES = {
    "flat": CostCurve({n: 0.01 for n in SIZES}),  # wide passes free: every useful node pays
    "moderate": CostCurve({n: 0.01 * (1 + 0.05 * (n - 1)) for n in SIZES}),  # +5% per extra token
    "steep": CostCurve({n: 0.01 * n for n in SIZES}),  # every token a full pass: no draft pays
}
#: the curve of tests that need drafting to happen, whatever SPECDEC_TEST_COST says
DRAFTING_PAYS = TEST_COST_CURVES["flat"]


def _isolate_from_the_machine() -> Path:
    """Point caches, W&B and T(n) at a temporary directory (before any test runs)."""
    root = Path(tempfile.mkdtemp(prefix="specdec-tests-"))
    shape = os.environ.get("SPECDEC_TEST_COST", "moderate")
    if shape not in TEST_COST_CURVES:
        raise pytest.UsageError(f"SPECDEC_TEST_COST={shape!r}: use one of {sorted(TEST_COST_CURVES)}")
    curve_file = root / f"cost-{shape}.json"
    curve_file.write_text(json.dumps({"seconds": TEST_COST_CURVES[shape].seconds}))
    os.environ[COST_CURVE_ENV] = str(curve_file)
    os.environ["SPECDEC_CACHE"] = str(root / "cache")
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ[variable] = str(root / "wandb")
    return root


TEST_ROOT = _isolate_from_the_machine()
store_drafter_configs()  # drafter=<name> choices, as `python -m specdec.train` stores them before composing


@pytest.fixture()
def drafting_pays(monkeypatch, tmp_path):
    """A flat T(n), whatever SPECDEC_TEST_COST says: for tests whose assertions need
    adaptive proposers to keep drafting (acceptance counts, chi-square tests that
    must see drafted tokens) even where the tiny models' drafts are seldom accepted."""
    curve_file = tmp_path / "cost-drafting-pays.json"
    curve_file.write_text(json.dumps({"seconds": DRAFTING_PAYS.seconds}))
    monkeypatch.setenv(COST_CURVE_ENV, str(curve_file))


#: where the tiny models of the losslessness matrices run: cpu, or cuda for `make gpu-check`
#: (scripts/gpu_check.sh), which runs those matrices with the models on the GPU
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig(name="tiny-random", dtype="float64", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """(module, tokenizer): the tiny float64 target as transformers builds it (its Target
    leaves float64 passes as they are; each pipeline over it wraps it in one)."""
    target, tokenizer = load_model(tiny_config)
    return target.model, tokenizer


@pytest.fixture()
def tiny_pipeline(tiny_model, tiny_config, tmp_path) -> Pipeline:
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=tmp_path / "artifacts")


def once_per_run(tmp_path_factory, name: str, make) -> Path:
    """A folder ``make(folder)`` fills once per test run: under pytest-xdist the workers share
    it (the first makes it, under a lock, in the run's own temporary folder)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # every worker's folder
    directory = run / name
    with FileLock(str(run / f"{name}.lock")):
        if not (run / f"{name}.done").exists():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that died half-way
            directory.mkdir()
            make(directory)
            (run / f"{name}.done").touch()
    return directory


@pytest.fixture(scope="session")
def trained_artifacts(tmp_path_factory) -> Path:
    """An artifacts dir with the default Medusa recipe (copy heads) and an EAGLE drafter
    trained for the tiny model (seconds), so pipelines over every registered proposer can run;
    trained once per run (:func:`once_per_run`)."""
    from tests.proposers.test_eagle import train_tiny_eagle
    from tests.train.test_train import train_tiny_medusa

    def train(directory: Path) -> None:
        train_tiny_medusa(directory)
        train_tiny_eagle(directory)

    return once_per_run(tmp_path_factory, "trained-artifacts", train)


@pytest.fixture()
def trained_pipeline(tiny_model, tiny_config, trained_artifacts) -> Pipeline:
    """The tiny pipeline whose artifacts dir holds trained heads (see ``trained_artifacts``)."""
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=trained_artifacts)


def random_prompts(count: int, vocab: int = 256, seed: int = 0, repetitive: bool = True) -> list[list[int]]:
    """Token-id prompts; repetitive ones give prompt lookup something to find."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        length = int(torch.randint(4, 40, (1,), generator=generator))
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        if repetitive and i % 2 == 0:
            ids = ids + ids[: length // 2] + ids
        prompts.append(ids)
    return prompts


# ------------------------------------------------------------------ CPU capabilities
#
# No test assumes the CPU it runs on. A test that needs a capability is marked
# ``requires_cpu(NAME)`` and skips, naming it, where the probe says it is absent. The
# fallback routes run everywhere: a dtype written ``bfloat16-avx2`` is bfloat16 on a CPU
# simulated without any probed capability (``SPECDEC_CPU_ABSENT=all``), so an AVX-512
# machine takes the routes an AVX2-only one takes.

AS_ON_AVX2 = "-avx2"


def spy_drafts(proposer, seen) -> None:
    """Call ``seen(state, draft)`` with every draft ``proposer`` returns to the engine, which
    asks for drafts through :meth:`Proposer.drafting` (a proposer drafting in steps never
    calls its ``propose`` there)."""
    drafting = proposer.drafting

    def spied(state):
        draft = yield from drafting(state)
        seen(state, draft)
        return draft

    proposer.drafting = spied


def requires_cpu(name: str) -> pytest.MarkDecorator:
    """Skip where this CPU (or a simulated one) lacks capability ``name``."""
    return pytest.mark.skipif(
        not cpu.has(name), reason=f"needs CPU capability {name} ({cpu.NEEDS[name]}), absent here"
    )


def split_dtype(spelled: str) -> tuple[str, bool]:
    """``bfloat16-avx2`` -> (``bfloat16``, True): the dtype, and whether the CPU is simulated
    without its capabilities."""
    return spelled.removesuffix(AS_ON_AVX2), spelled.endswith(AS_ON_AVX2)


@contextlib.contextmanager
def cpu_for(spelled_dtype: str):
    """Inside: the CPU this spelled dtype asks for (every capability absent for ``-avx2``)."""
    with pytest.MonkeyPatch.context() as patch:
        if split_dtype(spelled_dtype)[1]:
            patch.setenv(cpu.ABSENT_ENV, "all")
        yield


@pytest.fixture()
def cpu_without(monkeypatch):
    """``cpu_without("onednn_bf16_linear", ...)`` (no names: every capability) for the rest
    of the test, subprocesses included."""

    def absent(*names: str) -> None:
        monkeypatch.setenv(cpu.ABSENT_ENV, ",".join(names) or "all")

    return absent


# ------------------------------------------------------------------ constraint-only proposers
#
# The ``grammar`` proposer drafts a constraint's forced tokens and nothing without one, so the
# tests that run every registered proposer unconstrained and need drafts accepted skip it;
# tests/decoders/engine/test_constraint.py runs it, alone and merged with every other proposer, under
# constraints (greedy identity, exact mode, sampled distributions).
CONSTRAINT_ONLY_PROPOSERS = frozenset({"grammar"})
# ``span`` copies the prompt's *text*: the tiny random models never copy text, so there its drafts
# are verified and rejected, not accepted. The matrices ask of it drafts the target verified
# (identity with rejections exercised); acceptance is measured on the default model (the
# structured bench: identical outputs 1.00) and its drafts' shapes in tests/proposers/test_span.py.
TEXT_PROPOSERS = frozenset({"span"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            isinstance(params.get("proposer"), str)
            and params["proposer"] in CONSTRAINT_ONLY_PROPOSERS
            and "test_constraint" not in item.nodeid
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason="drafts only under a constraint: tests/decoders/engine/test_constraint.py runs it"
                )
            )


def lossless_verifiers() -> list[str]:
    """Every registered verifier that declares itself lossless: the losslessness matrices' columns."""
    return [v for v in verifier_registry.names() if verifier_registry.get(v).lossless]


def pipeline_or_skip(base: Pipeline, proposer, verifier="rejection", sampling=None) -> Pipeline:
    """``base`` with ``proposer`` and ``verifier``; skipped where the proposer needs a trained
    artifact that is not there (its own tests cover it) or a tokenizer the model lacks."""
    try:
        return base.with_components(proposer, verifier, sampling)
    except (FileNotFoundError, NeedsTokenizer) as missing:
        pytest.skip(str(missing))
