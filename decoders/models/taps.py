"""Layer taps: the outputs of chosen decoder layers in the target's own passes.

A drafter that reads the target's intermediate layers (EAGLE) gets them from the
passes the target makes anyway, through forward hooks, at no extra pass. A
:class:`specdec.decoders.models.target.Target` owns its tap (``target.tap(layers)``) and
removes its hooks when it is closed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LayerTap:
    """The outputs of watched decoder layers, filed under each pass's final hidden states
    (the decoder's output) for the last ``KEPT`` passes used: a session that serves a pass
    from its cache (the audit's repeated prefills) still gets the features of the pass that
    made its ``hidden``. (The entries hold their final hidden states, so no later tensor
    shares their memory.)"""

    KEPT = 8

    def __init__(self, decoder: nn.Module) -> None:
        self.layers = decoder.layers
        self._hooks: dict[int, Any] = {}
        self._current: dict[int, torch.Tensor] = {}  # this pass so far: layer -> (batch, q, hidden)
        self._passes: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []  # (final, outputs), newest last
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
        self._passes = [*self._passes[-(self.KEPT - 1) :], (final, self._current)]
        self._current = {}

    def outputs(self, final_hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """layer -> (q, hidden) outputs of the pass whose final hidden states (its first
        sequence's, as a session keeps them) are ``final_hidden``, or hold them: a packed
        pass over several requests (decoders/models/batch.py) gives each request's session
        its rows of the pass's final states, and each gets its rows of every layer."""
        for i in range(len(self._passes) - 1, -1, -1):
            final, outputs = self._passes[i]
            rows = _rows_of(final[0], final_hidden)
            if rows is not None:
                self._passes.append(self._passes.pop(i))  # most recently used last
                return {layer: values[0][rows] for layer, values in outputs.items()}
        raise RuntimeError("the target's latest pass did not run through its decoder: no layer features")


def _rows_of(final: torch.Tensor, hidden: torch.Tensor) -> slice | None:
    """The rows of ``final`` (rows, hidden) that ``hidden`` (q, hidden) is a view of (None:
    it is not one)."""
    if final.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr():
        return None
    if final.stride() != hidden.stride() or final.shape[1:] != hidden.shape[1:]:
        return None
    offset, rest = divmod(hidden.data_ptr() - final.data_ptr(), final.element_size() * final.stride(0))
    if rest or offset < 0 or offset + len(hidden) > len(final):
        return None
    return slice(offset, offset + len(hidden))
