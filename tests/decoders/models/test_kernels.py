"""The narrow-pass matmul route: same products, same model outputs, right scope."""

import pytest
import torch

from specdec.decoders.models import native
from specdec.decoders.models.kernels import (
    NATIVE_ROWS,
    PACKED_FROM,
    linear_route,
    packed_route_available,
    route_narrow_linears,
)
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.session import ModelSession
from specdec.decoders.models.settings import wants_narrow_routing
from tests.conftest import requires_cpu


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 9, 16, 17, 41, 48, 49, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_routed_linear_computes_the_same_product(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert route_narrow_linears(layer) == 1
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@requires_cpu("onednn_f32_linear")
def test_packed_route_serves_wide_float32_passes_and_follows_weight_changes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    route_narrow_linears(layer)
    narrow, wide = torch.randn(PACKED_FROM - 1, 24), torch.randn(PACKED_FROM + 3, 24)
    with torch.no_grad():
        layer(narrow)
        assert layer not in linear_route(layer).packed  # below PACKED_FROM: the transposed product
        torch.testing.assert_close(layer(wide), torch.nn.functional.linear(wide, layer.weight, layer.bias))
        assert layer in linear_route(layer).packed
        layer.weight.mul_(2)  # changed in place: the packed copy must not go stale
        torch.testing.assert_close(layer(wide), torch.nn.functional.linear(wide, layer.weight, layer.bias))
    # with autograd on, the product stays one autograd can differentiate
    out = layer(wide)
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@requires_cpu("onednn_f32_linear")
def test_a_frozen_layer_passes_its_inputs_gradient_on_the_packed_route():
    """A frozen linear (an early exit's LM head) fed by a trained adapter: its wide passes
    keep the input's gradient, which oneDNN's packed linear, having no backward, would drop."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40).requires_grad_(False)
    route_narrow_linears(layer)
    x = torch.randn(PACKED_FROM + 3, 24, requires_grad=True)
    layer(x).square().sum().backward()
    expected = torch.autograd.grad(torch.nn.functional.linear(x, layer.weight, layer.bias).square().sum(), x)[
        0
    ]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected)
    assert layer not in linear_route(layer).packed  # not even packed: autograd needs the plain product


@requires_cpu("onednn_f32_linear")
def test_packed_route_takes_weights_made_in_inference_mode():
    with torch.inference_mode():  # an inference tensor keeps no version counter
        layer = torch.nn.Linear(24, 40)
        route_narrow_linears(layer)
        x = torch.randn(PACKED_FROM + 3, 24)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer in linear_route(layer).packed


@requires_cpu("onednn_bf16_linear")
def test_bfloat16_narrow_route_is_the_packed_linear_at_every_width(cpu_without):
    """Without the C linear, bfloat16's narrow route takes oneDNN's packed linear from one row
    on (on the AVX-512 BF16 EPYC measured, a whole SmolLM2-135M pass cost a quarter less than on
    F.linear), and under autograd falls back to a product autograd can differentiate."""
    cpu_without("native_bf16_linear")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40).to(torch.bfloat16)
    route_narrow_linears(layer)
    with torch.no_grad():
        for rows in (1, 3, 8):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
            torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)
            assert layer in linear_route(layer).packed
        layer.weight.mul_(2)  # changed in place: the packed copy must not go stale
        expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@requires_cpu("native_bf16_linear")
@pytest.mark.parametrize("exact", [False, True])
def test_bfloat16_passes_of_a_few_rows_take_the_c_linear(exact, monkeypatch):
    """Up to NATIVE_ROWS rows (every exact pass), bfloat16 takes the C linear: the linear's
    product, each row's bits its own whatever the pass holds, no packed copy made, a weight
    changed in place read as it is now; inputs not a multiple of 64 and products autograd sees
    keep the other routes."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 40).to(torch.bfloat16)
    route_narrow_linears(layer, exact=exact)
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *args: calls.append(args[1].shape[0]) or real(*args))
    with torch.no_grad():
        x = torch.randn(12, 128, dtype=torch.bfloat16)
        rows = 12 if exact else NATIVE_ROWS
        together = layer(x[:rows])
        expected = torch.nn.functional.linear(x[:rows].float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(together.float(), expected, rtol=2e-2, atol=2e-2)
        for row in range(rows):
            assert torch.equal(layer(x[row : row + 1])[0], together[row])
        assert calls == [rows] + [1] * rows and layer not in linear_route(layer).packed
        layer.weight.mul_(2)
        torch.testing.assert_close(
            layer(x[:1]).float(), 2 * expected[:1] - layer.bias.float(), rtol=3e-2, atol=3e-2
        )
        if not exact:
            layer(x)  # wider than NATIVE_ROWS: oneDNN
            assert calls[-1] == 1 and layer in linear_route(layer).packed
        odd = torch.nn.Linear(72, 8).to(torch.bfloat16)
        route_narrow_linears(odd, exact=exact)
        before = len(calls)
        odd(torch.randn(2, 72, dtype=torch.bfloat16))
        assert len(calls) == before
    before = len(calls)
    layer.weight.requires_grad_(True)
    layer(x[:2]).float().sum().backward()
    assert len(calls) == before and layer.weight.grad is not None


@requires_cpu("onednn_f32_linear")
def test_wide_float32_passes_take_the_packed_linear():
    """A pass wider than the narrow route's rows (a prefill) takes oneDNN's packed linear
    too where the route uses it, and F.linear where it does not (exact mode, left off)."""
    torch.manual_seed(0)
    wide = torch.randn(60, 24)
    for packed_from, packs in ((PACKED_FROM, True), (None, False)):
        layer = torch.nn.Linear(24, 40)
        route_narrow_linears(layer, max_rows=16, packed_from=packed_from)
        with torch.no_grad():
            torch.testing.assert_close(
                layer(wide), torch.nn.functional.linear(wide, layer.weight, layer.bias)
            )
        assert (layer in linear_route(layer).packed) is packs


def test_packed_route_can_be_left_off():
    layer = torch.nn.Linear(24, 40)
    route_narrow_linears(layer, packed_from=None)
    with torch.no_grad():
        layer(torch.randn(PACKED_FROM + 3, 24))
        layer(torch.randn(80, 24))  # wide passes too
    assert layer not in linear_route(layer).packed


def test_padding_widths():
    from specdec.decoders.models.kernels import padded_rows

    assert [padded_rows(n) for n in range(1, 11)] == [2, 2, 4, 4, 5, 8, 8, 8, 16, 16]
    assert padded_rows(17) == 24 and padded_rows(48) == 48


def test_routing_keeps_the_model_outputs():
    plain, _ = load_model(ModelConfig(name="tiny-random", dtype="float32", narrow_passes="false"))
    routed, _ = load_model(ModelConfig(name="tiny-random", dtype="float32", narrow_passes="auto"))
    assert linear_route(plain.model) is None and not plain.narrow
    assert linear_route(routed.model) is not None and routed.narrow
    tokens = list(range(40, 60))
    a, b = ModelSession(plain), ModelSession(routed)
    torch.testing.assert_close(a.forward(tokens[:12]), b.forward(tokens[:12]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.forward(tokens[12:]), b.forward(tokens[12:]), rtol=1e-4, atol=1e-4)


def test_routing_setting():
    cpu = torch.device("cpu")
    assert wants_narrow_routing("auto", cpu, torch.float32)
    assert not wants_narrow_routing("auto", cpu, torch.float64)
    assert wants_narrow_routing("auto", cpu, torch.bfloat16) == packed_route_available(torch.bfloat16)
    assert not wants_narrow_routing("auto", torch.device("cuda"), torch.float32)
    assert wants_narrow_routing("true", cpu, torch.float64)
    with pytest.raises(ValueError, match="narrow_passes"):
        wants_narrow_routing("sometimes", cpu, torch.float32)


def test_last_only_prefill_returns_the_last_row():
    model, _ = load_model(ModelConfig(name="tiny-random", dtype="float64"))
    full, last = ModelSession(model), ModelSession(model)
    tokens = list(range(30, 50))
    expected = full.forward(tokens)
    got = last.forward(tokens, last_only=True)
    assert got.shape == (1, expected.shape[-1])
    torch.testing.assert_close(got[0], expected[-1])
    torch.testing.assert_close(last.hidden, full.hidden)


def test_packed_attention_matches_sdpa_on_chains_and_trees():
    """GQA model (4 query heads over 2 key/value heads), chain and tree masks."""
    from specdec.decoders.models.loading import tiny_random_model
    from specdec.decoders.models.target import Target

    def gqa_model():
        model = tiny_random_model(320, 64, 2, seed=3)
        return model.to(torch.float64).eval()

    plain, packed = gqa_model(), gqa_model()
    assert plain.config.num_attention_heads // plain.config.num_key_value_heads == 2
    packed = Target(packed, narrow=True)  # the narrow route: linears and packed GQA attention
    assert packed.attention.startswith("specdec_sdpa")
    prefix = list(range(100, 130))
    parents = [-1, 0, 0, 1, 2, 2]
    for tokens, tree in ((list(range(5, 10)), None), (list(range(200, 206)), parents)):
        a, b = ModelSession(plain), ModelSession(packed)
        a.forward(prefix), b.forward(prefix)
        torch.testing.assert_close(b.forward(tokens, tree), a.forward(tokens, tree))
