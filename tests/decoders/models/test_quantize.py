"""Weight-only int8 targets (model.quantize=int8): the quantization's error bound, the C
kernel's batch invariance and its fallback, fused layers over int8 projections, and greedy
speculation bit-identical to the quantized target's own standard decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.decoders import Pipeline
from specdec.decoders.models import native
from specdec.decoders.models.fused_layers import FusedLayer
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.quantize import Int8Linear, quantize_linears
from tests.conftest import random_prompts, requires_cpu
from tests.decoders.models.test_exact import assert_bit_identical


def int8_tiny(dtype: str, exact: str = "true", fused: str = "auto"):
    config = ModelConfig(name="tiny-random", dtype=dtype, exact=exact, fused_layers=fused, quantize="int8")
    return load_model(config)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_weight_is_within_half_a_step_of_the_original(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(dtype)
    layer = Int8Linear.of(linear)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    step = layer.scales[:, None]
    error = (layer.qweight.float() * step - linear.weight.float()).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    assert layer.weight.dtype == dtype  # the dequantized weight, for code that reads it


@requires_cpu("native_int8_linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ins", [64, 96])  # 96: bfloat16 inputs off the 64-wide dot-product route
def test_the_c_kernel_gives_a_row_the_same_bits_in_any_pass(dtype, ins):
    torch.manual_seed(0)
    layer = Int8Linear.of(torch.nn.Linear(ins, 40).to(dtype))
    x = torch.randn(13, ins).to(dtype)
    whole = layer(x)
    for rows in (1, 3, 4, 8, 9):
        assert torch.equal(layer(x[:rows]), whole[:rows])
    assert torch.equal(layer(x[5:6]), whole[5:6])
    reference = F.linear(
        x.double(), layer.qweight.double() * layer.scales.double()[:, None], layer.bias.double()
    )
    torch.testing.assert_close(whole.double(), reference, rtol=0.02, atol=0.02)


def test_without_the_kernel_the_dequantized_weight_multiplies(cpu_without, monkeypatch):
    torch.manual_seed(0)
    layer = Int8Linear.of(torch.nn.Linear(64, 40))
    x = torch.randn(5, 64)
    cpu_without("native_int8_linear")
    monkeypatch.setattr(native, "linear_int8", lambda *a: pytest.fail("the C kernel ran"))
    expected = F.linear(x, layer.qweight.float() * layer.scales[:, None], layer.bias)
    assert torch.equal(layer(x), expected)


def test_every_linear_is_quantized_and_a_bad_choice_is_refused_in_one_line():
    target = int8_tiny("float32", exact="false", fused="false")
    linears = [m for m in target.model.modules() if type(m) is torch.nn.Linear]
    assert linears == [] and isinstance(target.model.lm_head, Int8Linear)
    with pytest.raises(
        ValueError, match=r"model.quantize='int4' is not a choice; use one of none, int8"
    ) as error:
        ModelConfig(name="tiny-random", quantize="int4")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4).double()), "int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_stack_int8_projections_without_changing_a_bit(dtype):
    fused = int8_tiny(dtype, exact="false", fused="true")
    plain = int8_tiny(dtype, exact="false", fused="false")
    assert all(isinstance(layer, FusedLayer) for layer in fused.layers())
    prompt = list(range(30, 90))
    a, b = fused.session(), plain.session()
    assert torch.equal(a.forward(prompt), b.forward(prompt))
    assert torch.equal(a.forward([5, 6, 7]), b.forward([5, 6, 7]))
    stacks = next(iter(fused.fusion.stacks.values()))
    assert isinstance(stacks[0].linear, Int8Linear)  # q|k|v ran as one int8 product


@requires_cpu("native_int8_linear")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "proposer,verifier", [("ngram", "greedy"), ("ngram", "tree"), ("suffix", "rejection")]
)
def test_speculation_is_bit_identical_to_the_quantized_targets_own_decoding(
    dtype, proposer, verifier, drafting_pays
):
    target = int8_tiny(dtype)
    base = Pipeline(target, None, model_config=ModelConfig(name="tiny-random"))
    pipeline = base.with_components(proposer, verifier)
    accepted = sum(assert_bit_identical(base, pipeline, prompt, 24) for prompt in random_prompts(3, seed=2))
    assert accepted > 0, "no draft token was ever accepted: the test exercised nothing"
