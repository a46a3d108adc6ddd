"""A KV cache layer that appends in place.

transformers' ``DynamicLayer`` appends a pass's keys and values with
``torch.cat``: every pass copies the whole cache of every layer into freshly
allocated memory. A decoding step over a 300-token context of SmolLM2-135M
copies 14 MB that way. On the 2-core AVX2 CPU measured, writing in place instead
made passes after a 300-token prefix 1.0 to 1.4 ms faster (of 46 to 68 ms), with
bit-identical logits; the longer the context, the more the copy costs.

:class:`GrowingLayer` keeps each layer's keys and values in a buffer with room
to spare (doubled when full) and writes a pass's entries into it; ``keys`` and
``values`` are views of the buffer's filled part, so everything that reads or
cuts them as a ``DynamicLayer``'s (``ModelSession.truncate`` and ``keep``, the
early exit's per-layer crop, transformers' masks) works unchanged. A cut is a
shorter view; the next pass writes after it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

MIN_CAPACITY = 256  # tokens a layer's first buffer holds at least


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose appends write into a preallocated buffer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._holds(length, key_states) or end > self._key_buffer.shape[-2]:
            self._grow(length, end, key_states, value_states)
        self._key_buffer[..., length:end, :] = key_states
        self._value_buffer[..., length:end, :] = value_states
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _holds(self, length: int, states: torch.Tensor) -> bool:
        """Whether the buffer is where ``keys`` lives (a cut keeps it so; anything that
        replaced ``keys`` with another tensor does not) and fits ``states``' batch and heads."""
        buffer = self._key_buffer
        if buffer is None or buffer.shape[:-2] != states.shape[:-2] or buffer.dtype != states.dtype:
            return False
        return length == 0 or (
            self.keys.data_ptr() == buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    def _grow(self, length: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        capacity = max(MIN_CAPACITY, 2 * end)
        key_buffer = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        value_buffer = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        if length:
            key_buffer[..., :length, :] = self.keys
            value_buffer[..., :length, :] = self.values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose attention layers are all :class:`GrowingLayer`.

    transformers keeps only the last window of a sliding-window (or chunked) layer, so its
    entries no longer sit at their positions and a rollback by position cuts the wrong ones
    (greedy speculation then left standard decoding's output on Mistral). Here every layer
    keeps every entry; the masks apply the window (:mod:`specdec.decoders.models.architecture`).
    Other layer types (none reach here: the session refuses them) stay as they are."""
    cache = DynamicCache(config=config)
    cache.layers = [
        GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    return cache
