"""Fused decoder layers: a Llama-shaped layer's pass in a few products and no submodule calls.

On a CPU a small model's pass is bound less by its weights than by the operations around
them: SmolLM2-135M's single-token pass ran 5,400 PyTorch operations in exact mode, through
12 module calls per layer (docs/performance.md, "Where a pass goes"). A fused layer
computes what transformers' Llama layer computes, with

* the query, key and value projections as one product over their weights stacked, and the
  MLP's gate and up projections as another (so 4 products a layer instead of 7), each on the
  route the layer's own linears take (:func:`specdec.decoders.models.kernels.routed_product`:
  the narrow route, exact mode's padded products, oneDNN's packed copies);
* the norms, the rotary embedding, the cache update and the attention function (whatever the
  model's ``_attn_implementation`` names: SDPA, exact attention, a packed batch's) called
  inline, in the order and with the operations the layer's own modules use.

A row of a stacked product is the rows of its parts side by side wherever the kernel sums each
output over the input in one fixed order whatever the number of outputs. MKL's float64 product
does not always (SmolLM2-shaped tiny models: other bits over 4 rows), so the load-time check
(:func:`fusion_differs`) compares the two on the model's own weights over the decoding's widths,
and where they differ the projections run apart (``Fusion.stacked``), still inline: a fused
layer with its projections apart is transformers' layer, operation for operation and bit for bit.
Stacked or not, exact mode's products stay batch-invariant (each stacked weight's rows are
measured as any linear's, :func:`specdec.decoders.models.kernels.exact_product_rows`).

A layer is fused by switching its class to a subclass whose ``forward`` is
:meth:`FusedLayer.forward` (its parameters, state dict and hooks stay: the layer taps' hooks
still fire); the stacked weights live in its :class:`Fusion` (one per target), keyed weakly by
layer, and are rebuilt when a weight changes. Where the fused forward does not apply (a layer
whose projections are not plain linears, as under a PEFT adapter; a pass autograd must see;
attention weights asked for), the layer runs transformers' own forward.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec.decoders.models.kernels import RoutedLinear, routed_product
from specdec.decoders.models.quantize import Int8Linear

# Layers whose forward the fused one reproduces: pre-norm, attention with q/k/v/o projections,
# rotary embeddings, a gated MLP, RMSNorm as Llama's (weight * normed.to(dtype)); each with the
# extra arguments its attention hands the attention function.
FUSABLE_LAYERS = {
    "LlamaDecoderLayer": lambda attention: {},
    "MistralDecoderLayer": lambda attention: {
        "sliding_window": getattr(attention.config, "sliding_window", None)
    },
    "Qwen2DecoderLayer": lambda attention: {"sliding_window": attention.sliding_window},
}


@dataclass(eq=False)
class Stacked:
    """One stacked product: the parts' weights (and biases) one above the other, and the
    sizes to split its output back into the parts."""

    linear: torch.nn.Module  # nn.Linear or Int8Linear
    sizes: list[int]
    stamp: tuple


@dataclass(eq=False)
class Fusion:
    """A target's fused layers' stacked weights, by layer (weakly). ``stacked``: the projections
    run stacked; where that would change their bits (:func:`fusion_differs`) they run apart, still
    inline."""

    stacks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    stacked: bool = True

    def __post_init__(self) -> None:
        self.layer_classes: dict[type, type] = {}

    def fused_class(self, cls: type) -> type:
        if cls not in self.layer_classes:
            self.layer_classes[cls] = type(
                f"Fused{cls.__name__}", (FusedLayer, cls), {"fusion": self, "base": cls}
            )
        return self.layer_classes[cls]

    def stacks_of(self, layer: torch.nn.Module) -> tuple[Stacked, Stacked] | tuple[()] | None:
        """The layer's (q|k|v, gate|up) stacked products, built on first use and again when a
        part's weight changed (``()`` where the projections run apart); None where a part is
        not a plain (or routed) linear."""
        attention, mlp = layer.self_attn, layer.mlp
        parts = (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj)
        linear = all(type(p) is torch.nn.Linear or isinstance(p, RoutedLinear) for p in parts)
        if not linear and not all(isinstance(p, Int8Linear) for p in parts):
            return None
        if not self.stacked:
            self.stacks[layer] = ()
            return ()
        stamp = tuple(_stamp(p.weight if linear else p.qweight) for p in parts)
        held = self.stacks.get(layer)
        if held is None or held[0].stamp != stamp[:3] or held[1].stamp != stamp[3:]:
            held = self.stacks[layer] = (_stack(parts[:3], stamp[:3]), _stack(parts[3:], stamp[3:]))
        return held


def _stamp(weight: torch.Tensor) -> tuple:
    # inference tensors keep no version counter: their storage alone identifies them
    return (weight.data_ptr(), None if weight.is_inference() else weight._version)


def _stack(parts: tuple[torch.nn.Module, ...], stamp: tuple) -> Stacked:
    sizes = [p.out_features for p in parts]
    if isinstance(parts[0], Int8Linear):  # int8 rows and their scales, one above the other
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat(biases)
        qweight, scales = torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts])
        return Stacked(Int8Linear(qweight, scales, bias, parts[0].dtype), sizes, stamp)
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    with torch.device("meta"):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        linear.bias = torch.nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return Stacked(linear, sizes, stamp)


def _product(stacked: Stacked, like: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The stacked product on the route ``like`` (one of its parts) takes, split into parts."""
    return list(_stacked_product(stacked, like, x).split(stacked.sizes, dim=-1))


def _stacked_product(stacked: Stacked, like: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(stacked.linear, Int8Linear):
        return stacked.linear(x)
    if isinstance(like, RoutedLinear):
        return routed_product(stacked.linear, x, like.route)
    return F.linear(x, stacked.linear.weight, stacked.linear.bias)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm, operation for operation (so bit for bit)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


class FusedLayer(torch.nn.Module):
    """The forward a fused layer's class takes (see the module's docstring)."""

    fusion: Fusion
    base: type  # the layer's own class

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        attention, mlp = self.self_attn, self.mlp
        # transformers' eager attention (no registered function) keeps the layer's own forward
        function = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, None)
        stacks = None
        if function is not None and position_embeddings is not None:
            if not (torch.is_grad_enabled() or self.training or kwargs.get("output_attentions")):
                stacks = self.fusion.stacks_of(self)
        if stacks is None:
            return super().forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        shape = hidden_states.shape[:-1]
        heads = (*shape, -1, attention.head_dim)
        residual = hidden_states
        normed = _rms_norm(self.input_layernorm, hidden_states)
        cos, sin = position_embeddings
        code = sys.modules[type(attention).__module__]
        if stacks:  # the query and key heads side by side: one rotary embedding over both
            split = stacks[0].sizes[0] + stacks[0].sizes[1]
            both = _stacked_product(stacks[0], attention.q_proj, normed)
            value = both[..., split:].view(heads).transpose(1, 2)
            both = both[..., :split].view(heads).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            both = (both * cos) + (code.rotate_half(both) * sin)  # apply_rotary_pos_emb's arithmetic
            query_heads = stacks[0].sizes[0] // attention.head_dim
            query, key = both[:, :query_heads], both[:, query_heads:]
        else:
            query = attention.q_proj(normed).view(heads).transpose(1, 2)
            key = attention.k_proj(normed).view(heads).transpose(1, 2)
            value = attention.v_proj(normed).view(heads).transpose(1, 2)
            query, key = code.apply_rotary_pos_emb(query, key, cos, sin)
        # the arguments the layer's attention hands on to the cache and the attention function
        passed = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx, kwargs=passed)
        extra = FUSABLE_LAYERS[self.base.__name__](attention)
        out, _ = function(
            attention,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=attention.scaling,
            **extra,
            **passed,
        )
        hidden_states = residual + attention.o_proj(out.reshape(*shape, -1).contiguous())
        residual = hidden_states
        normed = _rms_norm(self.post_attention_layernorm, hidden_states)
        if stacks:
            gate, up = _product(stacks[1], mlp.gate_proj, normed)
        else:
            gate, up = mlp.gate_proj(normed), mlp.up_proj(normed)
        return residual + mlp.down_proj(mlp.act_fn(gate) * up)


def fusable(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is one whose forward :class:`FusedLayer` reproduces."""
    cls = layer.base if isinstance(layer, FusedLayer) else type(layer)
    if cls.__name__ not in FUSABLE_LAYERS:
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (
        attention is not None
        and mlp is not None
        and all(
            hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        )
        and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and all(n is not None and hasattr(n, "variance_epsilon") for n in norms)
        and not hasattr(attention, "q_norm")
        and getattr(getattr(layer, "config", attention.config), "pretraining_tp", 1) <= 1
    )


def fuse_layers(model: torch.nn.Module, fusion: Fusion) -> int:
    """Fuse every fusable decoder layer of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        if fusable(module):
            module.__class__ = fusion.fused_class(
                module.base if isinstance(module, FusedLayer) else type(module)
            )
            count += 1
    return count


def unfuse_layers(model: torch.nn.Module) -> None:
    """Put every fused layer of ``model`` back on its own class."""
    for module in model.modules():
        if isinstance(module, FusedLayer):
            module.__class__ = module.base


def fusion_differs(model: torch.nn.Module, widths: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16)) -> str | None:
    """Why fusing ``model``'s layers would change its outputs' bits (None: it would not):
    on its first fused layer, each stacked product over random rows of every width in
    ``widths`` against its parts' own products, on the route they take."""
    layer = next((m for m in model.modules() if isinstance(m, FusedLayer)), None)
    stacks = layer.fusion.stacks_of(layer) if layer is not None else None
    if not stacks:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    generator = torch.Generator().manual_seed(0)
    like = layer.input_layernorm.weight  # the model's dtype and device (an int8 layer's weight is not)
    with torch.inference_mode():
        for rows in widths:
            x = torch.randn(rows, attention.q_proj.in_features, generator=generator).to(
                like.device, like.dtype
            )
            for stacked, parts in (
                (stacks[0], ("q_proj", "k_proj", "v_proj")),
                (stacks[1], ("gate_proj", "up_proj")),
            ):
                owner = attention if parts[0] == "q_proj" else mlp
                linears = [getattr(owner, p) for p in parts]
                for name, fused, alone in zip(
                    parts, _product(stacked, linears[0], x), (m(x) for m in linears)
                ):
                    if not torch.equal(fused, alone):
                        return (
                            f"the stacked {'|'.join(parts)} product gives {name} other bits over {rows} rows"
                        )
    return None


def wants_fused(setting, routed: bool) -> bool:
    """``auto``: where the linears take a CPU route (narrow or exact), which is where a pass's
    operations cost more than its weights; ``true`` or ``false``."""
    if isinstance(setting, str) and setting in ("true", "on", "false", "off"):
        setting = setting in ("true", "on")
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"model.fused_layers={setting!r}: use auto, true or false.")
    return routed
