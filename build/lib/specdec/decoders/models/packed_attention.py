"""Packed grouped-query attention for the narrow passes of speculative decoding.

A verification pass over a few tokens carries an attention mask (causal over the cache, or a
tree mask). With a mask, transformers' SDPA path for grouped-query attention copies every
key/value head ``groups`` times and the CPU kernel falls back to its unfused path, so a pass
over 4 tokens cost far more than one over one (docs/performance.md, "Why a verification pass
is cheap here"). Folding the query heads that share a key/value head into the query length
instead (the packing transformers already does for a single token) attends to each cached key
once, with the mask tiled to match. A :class:`specdec.decoders.models.target.Target` on the narrow
route registers it as its model's attention.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tiled_masks: TiledMasks | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (a :class:`specdec.decoders.models.target.Target`
    registers it with its own ``tiled_masks``, bound by ``functools.partial``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if (
        groups == 1
        or q_len == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kv_heads = heads // groups
    packed_query = query.reshape(batch, kv_heads, groups * q_len, dim)  # rows: (group, position)
    tile = tiled_masks or TiledMasks()
    packed_mask = tile(attention_mask, groups)  # (batch, 1, groups * q, kv)
    out = F.scaled_dot_product_attention(packed_query, key, value, attn_mask=packed_mask, scale=scaling)
    out = out.reshape(batch, heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


class TiledMasks:
    """The last mask tiled by :func:`packed_gqa_attention`: every layer of a pass gets the
    same mask object, so the layers after the first reuse its tiling. One per
    :class:`specdec.decoders.models.target.Target` (the attention it registers carries it)."""

    def __init__(self) -> None:
        self.last: tuple[weakref.ref, int, torch.Tensor] | None = None

    def __call__(self, mask: torch.Tensor, groups: int) -> torch.Tensor:
        """``mask`` repeated ``groups`` times along the query rows."""
        if self.last is not None and self.last[0]() is mask and self.last[1] == groups:
            return self.last[2]
        tiled = mask.repeat(1, 1, groups, 1)
        self.last = (weakref.ref(mask), groups, tiled)
        return tiled
