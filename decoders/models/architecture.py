"""What a session needs to know about a model's attention, and what it refuses.

transformers 5 declares each decoder layer's attention pattern (``config.layer_types``, or
``sliding_window`` / ``attention_chunk_size`` for every layer): full attention, a sliding
window of the last ``w`` positions, or chunks of ``c`` positions. Its own caches keep only
the window of a sliding layer, which cannot be rolled back to an accepted path or compacted
by position; a session keeps every layer's entries instead (:mod:`specdec.decoders.models.kv_cache`)
and lets the masks apply each layer's pattern: transformers' own masks on chain passes, and
:func:`specdec.decoders.models.session.tree_attention_masks` on tree passes, one per pattern.

Refused when the session is built, with one line naming the architecture and what is
missing, rather than run wrong:

* layers whose cache is a recurrent state (linear attention, Mamba-style hybrids) or an
  indexer's keys: neither can be cut back to the accepted path;
* a model mixing attention patterns whose decoder takes one mask for every layer: a tree
  pass could not give each layer its own;
* ALiBi models whose key biases cannot be given per key (trees need each node's bias from
  its depth): Bloom's can (:func:`alibi_from_positions`), MPT's cannot.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch


class UnsupportedArchitectureError(TypeError):
    """The model's architecture lacks what a session or proposer needs (one line, named)."""


@dataclass(frozen=True)
class AttentionPattern:
    """One decoder layer's attention: ``full``, ``sliding`` (a query at position p sees keys
    at positions above p - window) or ``chunked`` (keys in p's chunk of ``window`` positions)."""

    kind: str
    window: int | None = None
    layer_type: str = "full_attention"  # transformers' name, the key of a per-type mask mapping

    def allows(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """(q, kv) bool: which keys this pattern lets each query see, causality aside;
        None where it restricts nothing (full attention)."""
        q, k = query_positions[:, None], key_positions[None, :]
        if self.kind == "sliding":
            return q - k < self.window  # transformers: kv_idx > q_idx - sliding_window
        if self.kind == "chunked":
            return torch.div(q, self.window, rounding_mode="floor") == torch.div(
                k, self.window, rounding_mode="floor"
            )
        return None


SUPPORTED_LAYER_TYPES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model's decoder (the module that returns ``last_hidden_state``). transformers'
    ``get_decoder`` returns the whole causal LM where ``base_model_prefix`` names no attribute
    (Llama 4's text model: ``language_model``, but the decoder is ``model``)."""
    decoder = model.get_decoder()
    if decoder is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        return model.model
    return decoder


def attention_patterns(model: torch.nn.Module) -> list[AttentionPattern]:
    """Each decoder layer's pattern, as transformers builds the model's cache from its config;
    refuses layer types whose cache cannot be rolled back."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config.get_text_config(decoder=True)
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    patterns = []
    for index, (layer_type, options) in enumerate(zip(layer_types, kwargs)):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: layer {index} is {layer_type!r}, whose cache (a recurrent state "
                "or an indexer's keys) cannot be cut back to the tokens the target accepted; speculative "
                "decoding here needs attention layers with a KV cache (full, sliding or chunked)"
            )
        kind = SUPPORTED_LAYER_TYPES[layer_type]
        window = options.get("sliding_window") if kind != "full" else None
        patterns.append(AttentionPattern(kind, window, layer_type))
    return patterns


def takes_mask_per_layer_type(decoder: torch.nn.Module) -> bool:
    """Whether the decoder's forward accepts ``attention_mask`` as a mapping from layer type
    to mask (transformers' hybrid models: Gemma 2 and 3, Cohere2, GPT-OSS, Qwen2, ...)."""
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


def check_tree_support(
    model: torch.nn.Module, decoder: torch.nn.Module, patterns: list[AttentionPattern]
) -> str | None:
    """None where tree passes work on this model, else why not (one line)."""
    name = type(model).__name__
    if len({p.layer_type for p in patterns}) > 1 and not takes_mask_per_layer_type(decoder):
        return (
            f"{name} mixes attention patterns {sorted({p.layer_type for p in patterns})} but its decoder "
            "takes one mask for every layer, so a tree pass cannot give each layer its own"
        )
    if uses_alibi(model) and not hasattr(decoder, "build_alibi_tensor"):
        return (
            f"{name} adds ALiBi biases built from key indexes inside its forward; a tree node's bias "
            "must come from its depth, which this model offers no way to give"
        )
    return None


def uses_alibi(model: torch.nn.Module) -> bool:
    config = model.config
    return bool(getattr(config, "alibi", False)) or getattr(config, "model_type", "") in ("bloom", "mpt")


def alibi_from_positions(original, positions: torch.Tensor):
    """A stand-in for a Bloom-style ``build_alibi_tensor(mask, heads, dtype)`` that gives key
    ``j`` the bias ``slope * positions[j]`` (a tree node's position is its depth), instead of
    the index the 2-D mask would give it. The slopes are the model's own: read off its
    function at position 1."""

    def build(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        probe = torch.ones(1, 2, dtype=torch.long, device=positions.device)
        slopes = original(probe, num_heads, torch.float32)[:, 0, 1]  # (heads,) slope * 1
        alibi = slopes[:, None, None] * positions.to(torch.float32)[None, None, :]  # (heads, 1, kv)
        return alibi.to(dtype)

    return build


class QueryTemperature:
    """Llama 4's attention temperature: on its layers without rotary positions, each query is
    scaled by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, ``p`` its position.
    transformers takes ``p`` from the cache's length as if the pass were a chain; a tree
    node's position is its depth (and a packed pass holds several requests), so for those
    passes :meth:`at` switches the layers' own scaling off and scales the query projection's
    rows from the positions given: the same product, on the right positions."""

    def __init__(self, attentions: list[torch.nn.Module]) -> None:
        self.attentions = attentions
        self.floor_scale = attentions[0].floor_scale
        self.attn_scale = attentions[0].attn_scale

    def scales(self, positions: torch.Tensor) -> torch.Tensor:
        """(q,) each query's scale, as transformers computes it from its position."""
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    @contextmanager
    def at(self, positions: torch.Tensor):
        """The layers scale their queries by ``positions`` (q,) during the block."""
        scales = self.scales(positions).view(1, -1, 1)  # (1, q, 1) over (1, q, heads * head_dim)
        hooks = []
        try:
            for attention in self.attentions:
                attention.attn_temperature_tuning = False
                hooks.append(
                    attention.q_proj.register_forward_hook(lambda _m, _i, q: (q * scales).to(q.dtype))
                )
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for attention in self.attentions:
                attention.attn_temperature_tuning = True


class PassPositions:
    """What a tree or packed pass must tell a model of its rows' positions beyond
    ``position_ids``: ALiBi's key biases (a node's position is its depth, not its index in
    the cache) and Llama 4's query temperature. A :class:`~specdec.decoders.models.target.Target`
    owns one (``target.positions``); the module is changed only inside :meth:`at`'s block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.decoder = decoder_of(model)
        self.alibi = uses_alibi(model)
        self.temperature = query_temperature(self.decoder)  # Llama 4's, from each query's position

    @contextmanager
    def at(self, query_positions: torch.Tensor, key_positions: torch.Tensor | None = None):
        """During the block, the model's passes take each query's position from
        ``query_positions`` (q,) and, under ALiBi, each key's from ``key_positions`` (kv,)."""
        with ExitStack() as undo:
            if self.alibi and key_positions is not None:
                decoder = self.decoder
                decoder.build_alibi_tensor = alibi_from_positions(
                    type(decoder).build_alibi_tensor.__get__(decoder), key_positions
                )
                undo.callback(delattr, decoder, "build_alibi_tensor")  # the class's own builder again
            if self.temperature is not None:
                undo.enter_context(self.temperature.at(query_positions))
            yield


def query_temperature(decoder: torch.nn.Module) -> QueryTemperature | None:
    """The decoder's temperature-scaled attention layers (Llama 4's without rotary positions),
    or None where it has none."""
    attentions = [
        layer.self_attn
        for layer in getattr(decoder, "layers", [])
        if getattr(getattr(layer, "self_attn", None), "attn_temperature_tuning", False)
        and not getattr(layer.self_attn, "use_rope", True)
    ]
    for (
        attention
    ) in attentions:  # scaling the projection's rows is scaling the query only if nothing comes between
        if hasattr(attention, "qk_norm"):
            raise UnsupportedArchitectureError(
                f"{type(decoder).__name__}: a temperature-scaled attention layer normalises its queries "
                "after projecting them, which a tree or packed pass cannot give each node's position"
            )
    return QueryTemperature(attentions) if attentions else None
