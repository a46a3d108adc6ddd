"""One target pass over several requests: their blocks packed into one sequence of rows.

A batch of requests each keeps its own :class:`~specdec.decoders.models.session.ModelSession`
(its KV cache, its length, its tree). A round of the batch runs one pass of the decoder
over every request's block (pending token and draft, a chain or a tree, any size) packed
one after the other: ``(1, total rows)``. What works per row (embeddings, norms, the
linears, rotary positions given per row) runs once over all of them; attention is the
only part that mixes rows, so it runs per request: each request's queries against its own
cache and its own new keys, under its own mask (:func:`packed_attention`), with the
attention function the target runs for a request alone. So a request's rows see what
they would see in a pass of their own, and in exact mode (linears batch-invariant per row
up to ``widest_exact_pass`` rows in all) get the very same bits.

Packing, not padding: no row is computed for nothing, and no request's cache is copied
(:class:`PackedCache` appends each request's new keys and values to its own cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.decoders.models.architecture import UnsupportedArchitectureError
from specdec.decoders.models.session import (
    ModelSession,
    check_tree_entries,
    tree_attention_masks,
    tree_depths,
)


class BatchLayout:
    """What the packed attention needs during one pass: each request's rows, masks (by
    layer type) and, per layer, its keys and values once its cache holds the new ones."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.masks: list[dict[str, torch.Tensor]] = []
        self.layer_types: list[str] = []
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.inner: Callable | None = None  # the attention a request alone would run

    def clear(self) -> None:
        self.spans, self.masks, self.kv, self.inner = [], [], {}, None


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    layout: BatchLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over a packed pass: query (1, heads, rows, d) of
    every request; each request's slice attends to its own keys and values (from
    ``layout``, written there by :class:`PackedCache`) under its own mask. Returns
    (1, rows, heads, d), the requests' outputs in their rows' order."""
    assert layout is not None and layout.inner is not None
    layer = module.layer_idx
    kind = layout.layer_types[layer]
    if (many := getattr(layout.inner, "many", None)) is not None:  # every request in one call
        masks = [each[kind] for each in layout.masks]
        out = many(module, query, layout.spans, layout.kv[layer], masks, dropout, scaling, **kwargs)
        if out is not None:
            return out, None
    outputs = []
    for (start, end), masks, (keys, values) in zip(layout.spans, layout.masks, layout.kv[layer]):
        out, _ = layout.inner(
            module,
            query[:, :, start:end],
            keys,
            values,
            masks[kind],
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


class PackedCache:
    """The cache a packed pass hands the decoder: each layer's new keys and values are
    split by request and appended to that request's own cache; the packed attention reads
    them back from the layout. (Only ``update`` is called: the pass brings its own 4-D
    mask and positions, so transformers builds no mask from the cache.)"""

    def __init__(self, caches: Sequence, spans: list[tuple[int, int]], layout: BatchLayout) -> None:
        self.caches, self.spans, self.layout = caches, spans, layout

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.layout.kv[layer_idx] = [
            cache.layers[layer_idx].update(keys[:, :, start:end], values[:, :, start:end])
            for cache, (start, end) in zip(self.caches, self.spans)
        ]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:  # read by nothing a packed pass runs
        raise NotImplementedError("a packed pass has no single sequence length")


def check_batchable(session: ModelSession) -> None:
    """Refuse, in one line, a model whose passes cannot be packed here."""
    if session.alibi:
        raise UnsupportedArchitectureError(
            f"{type(session.model).__name__} uses ALiBi, whose biases a packed pass does not give per "
            "request; decode its requests one at a time"
        )
    if session.tree_refusal:
        raise UnsupportedArchitectureError(f"batched decoding: {session.tree_refusal}")


@torch.inference_mode()
def packed_forward(
    decoder: torch.nn.Module,
    sessions: Sequence[ModelSession],
    blocks: Sequence[list[int]],
    parents: Sequence[list[int] | None],
    layout: BatchLayout,
    inner: Callable,
    last_only: bool = False,
    inputs_embeds: Sequence[torch.Tensor] | None = None,
    tree_starts: Sequence[int | None] | None = None,
) -> list[torch.Tensor]:
    """Append each request's block to its session in one pass of ``decoder`` (run with the
    packed attention, which calls ``inner`` per request) and return each block's logits,
    (len(block), vocab), as :meth:`ModelSession.forward` would (``last_only``: its last
    token's, (1, vocab)). ``inputs_embeds``: each block's decoder inputs, (len(block),
    hidden), instead of its tokens' embeddings (a feature-level drafter's). ``tree_starts``:
    for a tree grown over several passes, where it begins in its session's cache, its
    ``parents`` then covering the entries cached since, as in :meth:`ModelSession.forward`."""
    first = sessions[0]
    spans, positions, masks = [], [], []
    row = 0
    for i, (session, block, tree) in enumerate(zip(sessions, blocks, parents)):
        start = len(session)
        tree_start = (
            start if tree is None or tree_starts is None or tree_starts[i] is None else tree_starts[i]
        )
        tree = tree if tree is not None else [j - 1 for j in range(len(block))]
        cached = start - tree_start  # the tree's entries cached before this pass
        check_tree_entries(tree, cached, len(block))
        positions.append(torch.tensor(tree_depths(tree)[cached:], dtype=torch.long) + tree_start)
        tree_masks = tree_attention_masks(tree, tree_start, session.patterns, first.dtype, first.device)
        masks.append({kind: mask[:, :, cached:] for kind, mask in tree_masks.items()})
        spans.append((row, row + len(block)))
        row += len(block)
    layout.clear()
    layout.spans, layout.masks, layout.inner = spans, masks, inner
    layout.layer_types = [pattern.layer_type for pattern in first.patterns]
    if inputs_embeds is None:
        inputs = {
            "input_ids": torch.tensor(
                [[token for block in blocks for token in block]], dtype=torch.long, device=first.device
            )
        }
    else:
        inputs = {"inputs_embeds": torch.cat(list(inputs_embeds))[None]}  # (1, rows, hidden)
    placeholder = torch.zeros(1, 1, row, 1, dtype=first.dtype, device=first.device)  # 4-D: no mask is built
    position_ids = torch.cat(positions).to(first.device)
    try:
        with first.positions.at(position_ids):
            outputs = decoder(
                **inputs,
                position_ids=position_ids[None],
                attention_mask=placeholder,
                cache=PackedCache([s.cache for s in sessions], spans, layout),
                use_cache=True,
            )
    finally:
        layout.clear()
    hidden = outputs.last_hidden_state[0]  # (rows, hidden)
    # the LM head over all rows (or each block's last) at once: a linear, per row like the others
    every = first.lm_head(hidden[[end - 1 for _, end in spans]] if last_only else hidden)
    logits = []
    for i, (session, block, (start, end)) in enumerate(zip(sessions, blocks, spans)):
        session.hidden = hidden[start:end]
        session.cached.extend(block)
        logits.append(every[i : i + 1] if last_only else every[start:end])
    return logits
