"""The EAGLE drafter module and the target features it reads.

:class:`EagleDrafter` fuses the target's features with the next token's embedding
and runs one decoder layer over them; the target's layer tap
(:class:`specdec.decoders.models.taps.LayerTap`, ``target.tap(layers)``) collects its
intermediate layers' outputs from its own passes (forward hooks, no extra pass);
:func:`target_features` assembles them per committed position. See
:mod:`specdec.proposers.eagle` for the scheme.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdec.decoders.models.architecture import UnsupportedArchitectureError, decoder_of
from specdec.decoders.models.taps import LayerTap
from specdec.proposers.copy_attention import ContextMemory, CopyAttention
from specdec.proposers.draft_model import DraftVocabulary


def resolve_layers(feature_layers: list[int] | None, num_layers: int) -> list[int]:
    """Feature layers as hidden-state indices 1..L (see the module docstring), sorted,
    without repeats; None = EAGLE-3's low, middle and high features."""
    if feature_layers is None:
        feature_layers = [2, num_layers // 2, num_layers]
    resolved = sorted({min(max(i if i > 0 else num_layers + 1 + i, 1), num_layers) for i in feature_layers})
    if not feature_layers or any(i == 0 or abs(i) > num_layers for i in feature_layers):
        raise ValueError(
            f"feature layers {feature_layers} must be hidden-state indices 1..{num_layers} (or -1 for the last)"
        )
    return resolved


LLAMA_STYLE = {
    "decoder": ("layers", "norm"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def check_llama_style(target: nn.Module) -> None:
    """EAGLE's draft layer is a copy of one of the target's decoder layers, adapted with LoRA
    on its attention and MLP projections, and reads the target's layers' outputs: it needs a
    Llama-style decoder. Others are refused in one line naming what is missing."""
    decoder = decoder_of(target)
    missing = [name for name in LLAMA_STYLE["decoder"] if not hasattr(decoder, name)]
    if not missing:
        layer = decoder.layers[0]
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing += [f"self_attn.{n}" for n in LLAMA_STYLE["attention"] if not hasattr(attention, n)]
        missing += [f"mlp.{n}" for n in LLAMA_STYLE["mlp"] if not hasattr(mlp, n)]
    if missing:
        raise UnsupportedArchitectureError(
            f"eagle needs a Llama-style decoder (decoder.layers and .norm, q/k/v/o and gate/up/down "
            f"projections); {type(target).__name__}'s lacks {', '.join(missing[:4])}. Use draft_model, "
            "ngram, suffix or medusa with it"
        )


class EagleDrafter(nn.Module):
    """The feature fusion, one decoder layer and the draft vocabulary's LM head.

    Built over a target: the layer starts as a copy of target layer ``init_layer`` and
    the final norm as the target's; ``fuse`` starts by passing the highest feature
    through and ``combine`` by passing the feature through, so an untrained drafter
    is the copied layer applied on the target's last feature. The target's input
    embeddings are read, not copied; the LM head is the target's rows for the draft
    vocabulary (frozen).

    With ``copy_width`` > 0 the drafter also points into the committed context
    (:mod:`specdec.proposers.copy_attention`, the copy heads' pointer): the query at depth k
    is what the layer reads there, [feature ; embed(next token)], with its own query,
    scale and gate for each of the first ``copy_depths`` depths (deeper ones share the
    last); the keys and values come from the target's highest feature and the tokens
    of the committed positions. Drafts then come from the mixture of the layer's
    distribution and the pointer's, over the draft vocabulary plus the context's tokens."""

    def __init__(
        self,
        target: nn.Module,
        feature_layers: list[int],
        init_layer: int,
        vocabulary: DraftVocabulary,
        copy_width: int = 0,
        copy_depths: int = 1,
    ) -> None:
        super().__init__()
        from transformers import AutoModel

        target_decoder = decoder_of(target)
        check_llama_style(target)
        num_layers = len(target_decoder.layers)
        self.feature_layers = resolve_layers(feature_layers, num_layers)
        self.init_layer = init_layer if init_layer >= 0 else num_layers + init_layer
        if not 0 <= self.init_layer < num_layers:
            raise ValueError(f"drafter.init_layer={init_layer}: the target has {num_layers} layers")
        config = copy.deepcopy(target.config.get_text_config())
        config.num_hidden_layers = 1
        config.vocab_size, config.pad_token_id = 1, None  # inputs come as embeddings: no table of its own
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        config._attn_implementation = "sdpa"  # 4-D masks (trees, training-time test)
        weight = target.get_output_embeddings().weight
        self.decoder = AutoModel.from_config(config).to(weight.device, weight.dtype)
        layer = self.decoder.layers[0]
        layer.load_state_dict(target_decoder.layers[self.init_layer].state_dict())
        layer.self_attn.layer_idx = 0
        self.decoder.norm.load_state_dict(target_decoder.norm.state_dict())
        self.config = self.decoder.config
        hidden = weight.shape[1]
        width = len(self.feature_layers)
        self.fuse = nn.Linear(width * hidden, hidden, bias=False).to(weight)
        self.combine = nn.Linear(2 * hidden, hidden, bias=False).to(weight)
        with torch.no_grad():
            eye = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
            self.fuse.weight.zero_()
            self.fuse.weight[:, (width - 1) * hidden :] = eye  # the highest feature through
            self.combine.weight.zero_()
            self.combine.weight[:, :hidden] = eye  # the feature through, the token's embedding off
        self.vocabulary = vocabulary
        self.lm_head = vocabulary.head(target.get_output_embeddings())  # (n, hidden) frozen rows
        self._embeddings = (target.get_input_embeddings(),)  # the target's, not a submodule
        self.decoder.requires_grad_(False)
        if copy_width and copy_depths < 1:
            raise ValueError(f"an EAGLE pointer needs copy_depths >= 1, got {copy_depths}")
        self.copy = CopyAttention(hidden, copy_depths, copy_width).to(weight) if copy_width else None

    # ModelSession reads the drafter as a model
    def get_decoder(self) -> nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., hidden) the target's input embeddings, in the drafter's dtype."""
        return self._embeddings[0](tokens.to(self._embeddings[0].weight.device)).to(self.device, self.dtype)

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features (..., hidden) (fused or the draft's own y), tokens (...) the next tokens
        -> (..., hidden) the decoder layer's inputs x."""
        return self.combine(torch.cat([features.to(self.dtype), self.embed(tokens)], dim=-1))

    def copy_slot(self, depth: int) -> int:
        """The pointer's query, scale and gate that depth ``depth`` uses."""
        return min(depth, len(self.copy.scales) - 1)

    def context_memory(self) -> ContextMemory:
        """An empty memory of committed positions for one request (a drafter with a pointer)."""
        if self.copy is None:
            raise ValueError("this EAGLE drafter has no pointer (drafter.copy_width=0)")
        return ContextMemory(self.copy, self._embeddings[0], self.vocabulary.token_ids.to(self.device))


def target_features(
    layers: list[int], num_layers: int, final_hidden: torch.Tensor, tap: LayerTap | None, rows=None
) -> torch.Tensor:
    """(c, len(layers) * hidden) the target's features of the latest pass at ``rows``
    (None = all): intermediate layers from ``tap``, index L from ``final_hidden`` (q, hidden)."""
    parts = []
    outputs = tap.outputs(final_hidden) if tap is not None and any(i < num_layers for i in layers) else {}
    for index in layers:
        values = final_hidden if index == num_layers else outputs[index - 1]
        if len(values) != len(final_hidden):
            raise RuntimeError("the layer tap's outputs are not from the target's latest pass")
        parts.append((values if rows is None else values[rows]).to(final_hidden.device))
    return torch.cat(parts, dim=-1)
