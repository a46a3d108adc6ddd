"""The Target owns its model's passes: what it installs it can remove, and it leaves
nothing on the module or in module globals."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.kernels import RoutedLinear, linear_route
from specdec.decoders.models.loading import tiny_random_model
from specdec.decoders.models.target import Target, as_target


def module_snapshot(model: torch.nn.Module) -> dict:
    """Each submodule's class and instance attributes (what a patch would change)."""
    return {name: (type(m), sorted(vars(m))) for name, m in model.named_modules()}


def hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(
    "narrow,exact,fused", [(True, False, False), (False, True, True), (True, True, True)]
)
def test_closing_a_target_gives_the_model_back_as_built(narrow, exact, fused):
    model = tiny_random_model(320, 64, 2, seed=3).double()
    before, attention = module_snapshot(model), model.config._attn_implementation
    registered = set(AttentionInterface._global_mapping)
    tokens = list(range(10, 40))
    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits

    target = Target(model, narrow=narrow, exact=exact, fused=fused)
    tap = target.tap([0])
    session = target.session()
    session.forward(tokens)
    assert tap.outputs(session.hidden)[0].shape[0] == len(tokens)  # the hook ran
    assert all(isinstance(m, RoutedLinear) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.config._attn_implementation != attention and hooks(model) > 0

    target.close()
    assert module_snapshot(model) == before  # classes back, no attribute left behind
    assert model.config._attn_implementation == attention and hooks(model) == 0
    assert set(AttentionInterface._global_mapping) == registered
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([tokens])).logits, reference)


def test_targets_over_two_models_keep_their_own_routes_and_pass_times():
    """Two targets in one process: switching one's mode leaves the other's alone, and the
    live pass times of each are its own (no state shared through a module global)."""
    a = Target(tiny_random_model(320, 64, 2, seed=3), narrow=True, exact=False)
    b = Target(tiny_random_model(320, 64, 2, seed=4), narrow=True, exact=True)
    a_route = linear_route(a.model)
    b.configure(narrow=True, exact=False)
    assert linear_route(a.model) is a_route and not a.exact and not b.exact
    assert a.attention != b.attention  # each registered its own attention
    curve = CostCurve({1: 0.01, 8: 0.012})
    times = a.pass_times(curve)
    assert a.pass_times() is times and b.pass_times() is None
    b.configure(narrow=True, exact=True)
    assert b.pass_times(curve) is not times and b.widest_exact_pass == 48 and a.widest_exact_pass is None


def test_a_target_refuses_to_wrap_a_target():
    target = Target(tiny_random_model(320, 64, 1, seed=3))
    with pytest.raises(TypeError, match="not a Target"):
        Target(target)


def test_switching_modes_back_and_forth_reuses_the_routes():
    """The bench's exact-off twins switch exact mode around every call: the target keeps one
    route per mode, so the packed weight copies and measured widths are made once."""
    target = Target(tiny_random_model(320, 64, 2, seed=3), narrow=True, exact=False)
    plain = linear_route(target.model)
    target.configure(narrow=True, exact=True)
    exact = linear_route(target.model)
    target.configure(narrow=True, exact=False)
    assert linear_route(target.model) is plain and plain is not exact
    assert plain.packed is exact.packed and plain.widths is exact.widths


def test_a_module_another_target_routes_is_refused_not_rerouted():
    owner = Target(tiny_random_model(320, 64, 1, seed=3), narrow=True, exact=True)
    with pytest.raises(ValueError, match="already belong to a Target"):
        as_target(owner.model)
    assert as_target(owner) is owner and owner.exact_attention


def test_a_copy_of_a_routed_layer_computes_on_the_same_route():
    """A trained exit adapts copies of the target's layers: in exact mode their products are
    measured on first use, and each row still equals the row alone."""
    import copy

    # exact mode on F.linear (not narrow): the route that reads each layer's measured widest product
    target = Target(tiny_random_model(320, 64, 1, seed=3).to(torch.float32), narrow=False, exact=True)
    layer = copy.deepcopy(target.model.lm_head)
    x = torch.randn(6, 64)
    with torch.no_grad():
        rows = layer(x)
        assert all(torch.equal(layer(x[i : i + 1])[0], rows[i]) for i in range(6))


def test_the_tap_gives_each_request_its_rows_of_a_packed_pass():
    """A packed pass over several requests files one set of layer outputs; each request's
    session holds its rows of the final states, and the tap gives it its rows of every
    layer: what its own pass gives (float64, to 1e-12)."""
    model = tiny_random_model(320, 64, 2, seed=3).double()
    target = Target(model)
    tap = target.tap([0])
    blocks = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    sessions = [target.session() for _ in blocks]
    for session, prefix in zip(sessions, ([1, 2], [3], [4, 4, 4])):
        session.forward(prefix)
    target.packed_forward(sessions, blocks, [None] * len(blocks))
    packed = [tap.outputs(session.hidden)[0] for session in sessions]
    for session, block, rows in zip(sessions, blocks, packed):
        alone = target.session()
        alone.forward(session.cached[: len(session) - len(block)])
        alone.forward(block)
        assert rows.shape[0] == len(block)
        torch.testing.assert_close(rows, tap.outputs(alone.hidden)[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="no layer features"):
        tap.outputs(torch.zeros(2, 64, dtype=torch.float64))


def test_the_tap_keeps_a_pass_while_a_session_holds_its_states():
    """A batch of 20 requests prefills one at a time before any drafts: the first request's
    prefill features are still there after the other 19 passes; a pass whose final states
    nothing holds (a session moved on, a session dropped) is dropped with its outputs."""
    model = tiny_random_model(320, 64, 2, seed=3).double()
    target = Target(model)
    tap = target.tap([0])
    sessions = [target.session() for _ in range(20)]
    for i in range(20):
        sessions[i].forward([1 + i, 2, 3])
    first = tap.outputs(sessions[0].hidden)[0]
    alone = target.session()
    alone.forward([1, 2, 3])
    torch.testing.assert_close(first, tap.outputs(alone.hidden)[0], rtol=1e-12, atol=1e-12)
    assert len(tap) == 21
    del alone
    for i in range(10):
        sessions[i].forward([4])  # each session moves on: its prefill's features go
    assert len(tap) == 20
    sessions = sessions[:5]  # sessions dropped
    assert len(tap) == 5
