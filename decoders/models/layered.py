"""Running a slice of the target's decoder layers against its own KV cache.

Self-speculation (early exit) drafts with the target's first E layers and then
verifies with all of them. Both passes live in one
:class:`~specdec.decoders.models.session.ModelSession` and its one ``DynamicCache``: layer i
of the cache belongs to decoder layer i whichever pass writes it. While
drafting, layers ``[0, E)`` run ahead of layers ``[E, L)``, so the cache
temporarily holds more tokens in the shallow layers than in the deep ones.
:class:`LayeredDecoder` is what makes that legal: every call names its layer
range, takes positions and the attention mask from *that* range's cache
length, and :meth:`LayeredDecoder.crop` cuts one range back on its own. The
session's own ``forward``/``keep``/``truncate`` assume all layers agree, so a
caller must restore that before handing the session back (crop, or
:meth:`LayeredDecoder.finish` the deep range up to the same length).

Works with decoders laid out like Llama (``embed_tokens``, ``layers``, ``norm``,
``rotary_emb``; full attention in every layer). :func:`check_layered_equivalence`
proves, on the actual model, that running the layers one range at a time
reproduces the decoder's own forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from specdec.decoders.models.architecture import UnsupportedArchitectureError
from specdec.decoders.models.session import ModelSession


class LayeredDecoder:
    """Layer-range access to a session's decoder and cache.

    modules: optional replacement for the decoder's layer list (same length),
        e.g. with adapted copies of some layers; those copies must keep their
        ``layer_idx`` so they write the same cache slots.

    Like ``ModelSession.forward`` it is meant for inference: call it under
    ``torch.inference_mode()`` (the early-exit proposer does).
    """

    def __init__(self, session: ModelSession, modules: Sequence[torch.nn.Module] | None = None) -> None:
        decoder = session.decoder
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(decoder, a)]
        if missing:
            raise UnsupportedArchitectureError(
                f"{type(decoder).__name__} has no {missing}: running a range of its layers needs a "
                "Llama-style decoder (embed_tokens, layers, norm, rotary_emb). Use a Llama, Mistral, "
                "Qwen or SmolLM model, or a proposer that does not split the target."
            )
        config = decoder.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "sliding_window", None):
            raise UnsupportedArchitectureError(
                f"{type(decoder).__name__} uses attention layer types {sorted(layer_types)} "
                f"(sliding_window={getattr(config, 'sliding_window', None)}); LayeredDecoder builds one "
                "full causal mask per layer range. Use a model with full attention in every layer."
            )
        self.session = session
        self.decoder = decoder
        self.layers = list(modules) if modules is not None else list(decoder.layers)
        if len(self.layers) != len(decoder.layers):
            raise ValueError(
                f"got {len(self.layers)} layer modules for a {len(decoder.layers)}-layer decoder"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cached_length(self, layer: int) -> int:
        """Tokens whose KV entries layer ``layer`` of the cache holds."""
        return self.session.cache.get_seq_length(layer)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        """(q, hidden) input embeddings of ``tokens``."""
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.session.device)  # (q,)
        return self.decoder.embed_tokens(input_ids)

    def run(self, hidden: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Run layers ``[first, last)`` over q new positions as a causal chain.

        hidden: (q, hidden), the residual stream entering layer ``first`` for the
        q tokens that follow what layer ``first`` has cached (all layers of the
        range must hold the same length). Appends their KV entries to those
        layers and returns the (q, hidden) residual stream leaving layer ``last - 1``.
        """
        start = self.cached_length(first)
        position_ids = torch.arange(start, start + hidden.shape[0], device=hidden.device).unsqueeze(
            0
        )  # (1, q)
        states = run_layers(
            self.decoder,
            self.layers[first:last],
            hidden.unsqueeze(0),
            position_ids,
            self.session.cache,
            first,
        )
        return states[0]

    def crop(self, first: int, last: int, length: int) -> None:
        """Cut layers ``[first, last)`` of the cache back to their first ``length`` tokens."""
        for layer in self.session.cache.layers[first:last]:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    def finish(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Record a full-depth pass over ``tokens`` in the session and return its logits.

        hidden: (q, hidden), the residual stream leaving the last layer for
        ``tokens``, whose KV entries every layer now holds. Applies the final
        norm and LM head, as :meth:`ModelSession.forward` does, and leaves the
        session as that call would: ``cached`` extended, ``hidden`` set.
        Returns (q, vocab) logits.
        """
        session = self.session
        session.hidden = self.decoder.norm(hidden)  # (q, hidden)
        session.cached.extend(tokens)
        return session.logits(session.hidden)


def run_layers(
    decoder: torch.nn.Module,
    layers: Sequence[torch.nn.Module],
    states: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache | None = None,
    first: int = 0,
) -> torch.Tensor:
    """Run ``layers`` (consecutive, starting at layer ``first``) causally over ``states``.

    states: (batch, q, hidden), the residual stream entering layer ``first``;
    position_ids: (1 or batch, q). With a ``cache`` the q positions follow what
    layer ``first`` holds and their KV entries are appended; without one they
    are a whole (right-padded) sequence, as in training. Returns (batch, q, hidden).
    """
    mask = create_causal_mask(
        config=decoder.config,
        inputs_embeds=states,
        attention_mask=None,
        cache=cache,
        position_ids=position_ids,
        layer_idx=first,
    )
    position_embeddings = decoder.rotary_emb(states, position_ids=position_ids)
    for layer in layers:
        states = layer(
            states,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )
    return states


@torch.inference_mode()
def check_layered_equivalence(model: torch.nn.Module, split: int) -> None:
    """Raise unless running layers ``[0, split)`` then ``[split, L)`` reproduces the
    decoder's own forward pass on a short probe (prefill, then one more token).

    Catches architectures whose forward does more than embed -> layers -> norm
    (scaled embeddings, per-layer masks...), which LayeredDecoder would get wrong.
    """
    probe = [1, 2, 3, 4, 5]
    reference = ModelSession(model)
    expected = torch.cat([reference.forward(probe[:-1]), reference.forward(probe[-1:])])  # (5, vocab)
    layered = LayeredDecoder(ModelSession(model))
    rows = []
    for chunk in (probe[:-1], probe[-1:]):
        hidden = layered.run(layered.embed(chunk), 0, split)
        rows.append(layered.finish(chunk, layered.run(hidden, split, layered.num_layers)))
    try:
        torch.testing.assert_close(torch.cat(rows), expected)
    except AssertionError as error:
        raise UnsupportedArchitectureError(
            f"running {type(model).__name__}'s layers one range at a time does not reproduce its "
            f"forward pass ({str(error).splitlines()[-1].strip()}); its decoder does something "
            "LayeredDecoder does not model. Use a Llama-style model or another proposer."
        ) from None
