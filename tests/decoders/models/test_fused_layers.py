"""Fused layers compute what transformers' layers compute, bit for bit, on every pass the
decoding makes (prefill, chains, trees), and step aside wherever they do not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.decoders.models.fused_layers import (
    FusedLayer,
    fuse_layers,
    fusion_differs,
    wants_fused,
)
from specdec.decoders.models.invariance import check_pass_invariance
from specdec.decoders.models.target import Target
from tests.architectures import ARCHITECTURES

FUSABLE = ["llama", "qwen2", "mistral"]
BY_ID = {a.id: a for a in ARCHITECTURES}
PROMPT = list(range(30, 100))
TREE = ([5, 6, 7, 8, 9], [-1, 0, 0, 1, -1])


def passes(target: Target) -> list[torch.Tensor]:
    """A prefill, a chain of four, a tree, then a single token: every pass's logits."""
    session = target.session()
    out = [session.forward(PROMPT)]
    out.append(session.forward([11, 12, 13, 14]))
    out.append(session.forward(TREE[0], parents=TREE[1]))
    session.keep(len(PROMPT) + 4, [0, 1, 3])
    out.append(session.forward([15]))
    return out


@pytest.mark.parametrize("arch", FUSABLE)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("narrow,exact", [(False, False), (True, False), (False, True)])
def test_fused_passes_with_projections_apart_are_bit_identical_to_the_layers_own(arch, dtype, narrow, exact):
    model = BY_ID[arch].build().to(dtype)
    plain = Target(copy.deepcopy(model), narrow=narrow, exact=exact, fused=False)
    fused = Target(model, narrow=narrow, exact=exact, fused=True)
    fused.fusion.stacked = False
    assert all(isinstance(layer, FusedLayer) for layer in fused.layers())
    expected, got = passes(plain), passes(fused)
    assert len(fused.fusion.stacks) == len(fused.layers())  # the fused forward ran in every layer
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # (mistral's 16-key window: no exact mode past it)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_stacked_projections_keep_exact_mode_exact(arch, dtype):
    """Stacked, a pass may round otherwise than the unfused layers (where the product's bits
    depend on its outputs); its rows still equal single-token passes' bit for bit."""
    model = BY_ID[arch].build().to(dtype)
    plain = passes(Target(copy.deepcopy(model), exact=True, fused=False))
    fused = Target(model, exact=True, fused=True)
    assert fused.fusion.stacked
    got = passes(fused)
    assert all(len(stacks) == 2 for stacks in fused.fusion.stacks.values())
    for want, have in zip(plain, got):
        torch.testing.assert_close(have, want, rtol=0.05 if dtype == torch.bfloat16 else 1e-9, atol=0.05)
    report = check_pass_invariance(fused.model, prefix_len=126, chain_len=5)
    assert report.passed, report.summary()


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "phi", "gpt2"])
def test_layers_of_another_shape_are_left_as_they_are(arch):
    model = BY_ID[arch].build()
    target = Target(model, narrow=True, exact=False, fused=True)
    assert not any(isinstance(m, FusedLayer) for m in model.modules())
    assert target.session().forward(PROMPT).shape == (len(PROMPT), model.config.vocab_size)


def test_a_changed_weight_is_restacked():
    model = BY_ID["llama"].build()
    plain = copy.deepcopy(model)
    fused = Target(model, narrow=True, fused=True)
    before = passes(fused)
    for each in (model, plain):
        with torch.no_grad():
            each.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            each.model.layers[1].mlp.up_proj.weight.add_(0.01)
    after = passes(fused)
    assert not torch.equal(before[0], after[0])
    for want, have in zip(passes(Target(plain, narrow=True)), after):
        assert torch.equal(want, have)


class Adapter(torch.nn.Module):
    """Stands for a PEFT wrapper: a projection that is no longer a plain linear."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x) * 1.25


def test_a_wrapped_projection_or_a_pass_autograd_sees_takes_the_layers_own_forward():
    model = BY_ID["llama"].build(seed=2)
    plain = copy.deepcopy(model)
    for each in (model, plain):
        each.model.layers[1].self_attn.v_proj = Adapter(each.model.layers[1].self_attn.v_proj)
    fused = Target(model, fused=True)
    for want, have in zip(passes(Target(plain)), passes(fused)):
        assert torch.equal(want, have)
    assert len(fused.fusion.stacks) == 1  # layer 0 fused, layer 1 on its own forward

    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    loss = model(torch.tensor([PROMPT])).logits.sum()
    loss.backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_fusion_that_would_change_bits_is_found(monkeypatch):
    import specdec.decoders.models.fused_layers as fused_layers

    model = BY_ID["llama"].build()
    Target(model, narrow=True, fused=True)
    real = fused_layers._product
    monkeypatch.setattr(
        fused_layers,
        "_product",
        lambda stacked, like, x: [p + 1e-9 * p.abs() for p in real(stacked, like, x)],
    )
    assert "q_proj|k_proj|v_proj" in fusion_differs(model)


def test_the_setting_is_checked_in_one_line():
    assert wants_fused("auto", True) and not wants_fused("auto", False)
    assert wants_fused("true", False) and not wants_fused(False, True)
    with pytest.raises(ValueError, match=r"model.fused_layers='yes': use auto, true or false"):
        wants_fused("yes", True)


def test_fusing_twice_keeps_one_class_per_layer_type():
    model = BY_ID["llama"].build()
    target = Target(model, narrow=True, fused=True)
    classes = {type(layer) for layer in target.layers()}
    assert fuse_layers(model, target.fusion) == 2
    assert {type(layer) for layer in target.layers()} == classes and len(classes) == 1
