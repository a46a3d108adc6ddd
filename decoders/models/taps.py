"""Layer taps: the outputs of chosen decoder layers in the target's own passes.

A drafter that reads the target's intermediate layers (EAGLE) gets them from the
passes the target makes anyway, through forward hooks, at no extra pass. A
:class:`specdec.decoders.models.target.Target` owns its tap (``target.tap(layers)``) and
removes its hooks when it is closed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn


class LayerTap:
    """The outputs of watched decoder layers, filed under each pass's final hidden states
    (the decoder's output) for as long as those live: a session keeps its latest pass's
    (its ``hidden`` is a view of them), so each request of a batch gets the features of the
    pass that made its ``hidden``, however many passes (other requests' prefills) ran since,
    and a session that serves a pass from its cache (the audit's repeated prefills) too.
    A pass whose final states nothing holds any more is dropped with its outputs."""

    def __init__(self, decoder: nn.Module) -> None:
        self.layers = decoder.layers
        self._hooks: dict[int, Any] = {}
        self._current: dict[int, torch.Tensor] = {}  # this pass so far: layer -> (batch, q, hidden)
        self._passes: list[_Filed] = []  # the passes whose final states live, newest last
        self._decoder_hook = decoder.register_forward_hook(self._file_pass)

    def watch(self, layers: list[int]) -> None:
        for layer in layers:
            if layer not in self._hooks:
                self._hooks[layer] = self.layers[layer].register_forward_hook(self._keeper(layer))

    def remove(self) -> None:
        """Take every hook off the model."""
        for hook in [self._decoder_hook, *self._hooks.values()]:
            hook.remove()
        self._hooks, self._passes, self._current = {}, [], {}

    def _keeper(self, layer: int):
        def keep(module, inputs, output) -> None:
            self._current[layer] = output[0] if isinstance(output, tuple) else output

        return keep

    def _file_pass(self, module, inputs, output) -> None:
        final = output[0] if isinstance(output, tuple) else output.last_hidden_state
        self._passes = [filed for filed in self._passes if filed.storage() is not None]
        self._passes.append(_Filed(final[0], self._current))
        self._current = {}

    def __len__(self) -> int:
        """The passes whose features it keeps (their final states live)."""
        return sum(filed.storage() is not None for filed in self._passes)

    def outputs(self, final_hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """layer -> (q, hidden) outputs of the pass whose final hidden states (its first
        sequence's, as a session keeps them) are ``final_hidden``, or hold them: a packed
        pass over several requests (decoders/models/batch.py) gives each request's session
        its rows of the pass's final states, and each gets its rows of every layer."""
        for filed in reversed(self._passes):
            rows = filed.rows_of(final_hidden)
            if rows is not None:
                return {layer: values[0][rows] for layer, values in filed.outputs.items()}
        raise RuntimeError("the target's latest pass did not run through its decoder: no layer features")


class _Filed:
    """One pass's layer outputs, and where its final states (rows, hidden) lie: their
    storage held weakly (a session's ``hidden`` is a view of it, an inference tensor that
    keeps the storage, not the tensor, alive), their address, strides and shape."""

    def __init__(self, final: torch.Tensor, outputs: dict[int, torch.Tensor]) -> None:
        self.storage = weakref.ref(final.untyped_storage())
        self.address, self.strides, self.shape = final.data_ptr(), final.stride(), final.shape
        self.row_bytes = final.element_size() * final.stride(0)
        self.outputs = outputs

    def rows_of(self, hidden: torch.Tensor) -> slice | None:
        """The rows of the final states that ``hidden`` (q, hidden) is a view of (None:
        it is not one, or they are gone)."""
        storage = self.storage()
        if storage is None or storage.data_ptr() != hidden.untyped_storage().data_ptr():
            return None
        if self.strides != hidden.stride() or self.shape[1:] != hidden.shape[1:]:
            return None
        offset, rest = divmod(hidden.data_ptr() - self.address, self.row_bytes)
        if rest or offset < 0 or offset + len(hidden) > self.shape[0]:
            return None
        return slice(offset, offset + len(hidden))
