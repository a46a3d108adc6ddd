"""CPU capabilities: the probes, their simulated absence, and the fallback routes taken
without them (an AVX2-only CPU has no native bfloat16 and no oneDNN packed bfloat16 linear)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specdec.decoders.models import cpu
from specdec.decoders.models.kernels import (
    PackedProduct,
    linear_route,
    route_narrow_linears,
)
from specdec.decoders.models.loading import ModelConfig, load_model, resolve_dtype
from specdec.decoders.models.session import ModelSession
from specdec.decoders.models.settings import wants_narrow_routing
from tests.conftest import REPO_ROOT, requires_cpu


def test_probes_answer_and_absence_is_forced(cpu_without, monkeypatch):
    assert set(cpu.capabilities()) == set(cpu.PROBES) == set(cpu.NEEDS)
    cpu_without("onednn_bf16_linear")
    assert not cpu.has("onednn_bf16_linear")
    assert cpu.has("onednn_f32_linear") == cpu._probed("onednn_f32_linear")  # only the one named
    cpu_without()
    assert not any(cpu.capabilities().values())
    monkeypatch.setenv(cpu.ABSENT_ENV, "avx512,native_bf16")
    with pytest.raises(ValueError, match="unknown capability 'avx512'"):
        cpu.has("native_bf16")
    with pytest.raises(KeyError, match="unknown CPU capability"):
        cpu.has("sse9")


def test_the_bfloat16_probe_catches_onednns_refusal(monkeypatch):
    """On an AVX2-only CPU oneDNN raises instead of packing: the probe says absent."""

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert cpu._probe_onednn_linear(torch.bfloat16) is False


def test_auto_dtype_is_float32_without_native_bf16(cpu_without):
    native = cpu.has("native_bf16")
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    cpu_without("native_bf16")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@requires_cpu("native_bf16")
def test_auto_dtype_is_bfloat16_with_native_bf16():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_bfloat16_without_onednn_takes_f_linear(cpu_without):
    """The routes an AVX2-only CPU takes: no packed copy, F.linear's own product, no narrow
    routing by default, and drafters' vocabulary products unpacked (float32 keeps its own)."""
    cpu_without("onednn_bf16_linear")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40).to(torch.bfloat16)
    route_narrow_linears(layer)
    with torch.no_grad():
        for rows in (1, 3, 8, 60):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer not in linear_route(layer).packed
    assert not wants_narrow_routing("auto", torch.device("cpu"), torch.bfloat16)
    assert PackedProduct.of(layer.weight) is None
    assert (PackedProduct.of(layer.weight.float()) is None) == (not cpu.has("onednn_f32_linear"))


@pytest.mark.parametrize("exact", ["true", "false"])
def test_a_bfloat16_model_runs_without_onednn_bf16(cpu_without, exact):
    """A whole bfloat16 model, chain and tree passes, on the fallback route: its logits are
    those of the float32 model up to bfloat16's rounding."""
    cpu_without()
    model, _ = load_model(ModelConfig(name="tiny-random", dtype="bfloat16", exact=exact))
    reference, _ = load_model(ModelConfig(name="tiny-random", dtype="float32", exact="false"))
    a, b = ModelSession(model), ModelSession(reference)
    prefix = list(range(40, 70))
    torch.testing.assert_close(a.forward(prefix).float(), b.forward(prefix), rtol=0.05, atol=0.05)
    tree = [-1, 0, 0, 1]
    torch.testing.assert_close(
        a.forward([5, 6, 7, 8], tree).float(), b.forward([5, 6, 7, 8], tree), rtol=0.05, atol=0.05
    )


def test_generate_in_bfloat16_on_a_cpu_without_it(tmp_path):
    """The README's bfloat16 command on a simulated AVX2-only CPU runs to the end (it raised
    oneDNN's RuntimeError before), and says which route it took."""
    import os

    done = subprocess.run(
        [sys.executable, "-m", "specdec.decoders.generate", "model=tiny-random", "model.dtype=bfloat16",
         "prompt=hello hello hello", "proposer=ngram", "max_new_tokens=16"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, cpu.ABSENT_ENV: "all", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "oneDNN's packed bfloat16 linear needs" in done.stderr
