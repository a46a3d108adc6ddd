"""A model session: one request's KV cache, chain and tree forward passes, rollback.

Used for the target model and for draft models alike. The session knows which
token ids its cache holds (``cached``) so callers can roll it back or compact
it after verification:

* :meth:`forward` appends tokens after the cached prefix. Without ``parents``
  the new tokens form a chain (plain causal attention). With ``parents`` they
  form a tree: each token attends to the cached prefix and to its own ancestors
  only, through a 4-D additive attention mask, at position
  ``len(cached) + depth``. A tree may also grow over several passes
  (``tree_start``), as a draft model expanding its tree level by level does.
* :meth:`keep` drops the rejected tokens' KV entries after a tree pass and
  moves the accepted ones into place; :meth:`truncate` is the chain rollback.

Works with models whose decoder returns ``last_hidden_state`` and whose layers attend
through a KV cache: full attention, sliding windows and chunks, hybrids of them, any
positional scheme (rotary, partial rotary, learned absolute positions, ALiBi where its
biases can be given per key). Every layer keeps every entry, appended in place
(:mod:`specdec.decoders.models.kv_cache`), so ``truncate`` and ``keep`` cut all layers alike, and
the masks apply each layer's own pattern (:mod:`specdec.decoders.models.architecture`). A model
the session cannot serve is refused when the session is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specdec.decoders.models.architecture import (
    AttentionPattern,
    PassPositions,
    UnsupportedArchitectureError,
    attention_patterns,
    check_tree_support,
    decoder_of,
)
from specdec.decoders.models.kv_cache import growing_cache


class ModelSession:
    """One request's passes over ``model`` (an ``nn.Module``, or a
    :class:`specdec.decoders.models.target.Target`, whose session knows its target: its exact
    mode's widest pass and the live pass times the decode loop feeds)."""

    def __init__(self, model, target=None) -> None:
        if not isinstance(model, torch.nn.Module):  # a Target: its module, and itself as the owner
            model, target = model.model, model
        self.target = target
        self.model = model
        self.decoder = decoder_of(model)
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.patterns = attention_patterns(model)  # each layer's attention: full, sliding, chunked
        # why tree passes cannot run on this model (None: they can); raised at the first one
        self.tree_refusal = check_tree_support(model, self.decoder, self.patterns)
        # what tree and packed passes tell the model of their positions (the target's own)
        self.positions = target.positions if target is not None else PassPositions(model)
        self._kept_rows: list[torch.Tensor] | None = None  # while recording_kept_rows
        self._last_logits: torch.Tensor | None = None
        self.reset()

    def for_request(self) -> ModelSession:
        """A fresh session over the same model (and the same LM head: a draft's may be cut to
        a reduced vocabulary), for another request decoded at the same time."""
        other = ModelSession(self.model, target=self.target)
        other.lm_head = self.lm_head
        return other

    @property
    def alibi(self) -> bool:
        return self.positions.alibi

    def reset(self) -> None:
        self.cache = growing_cache(self.model.config)
        self.cached: list[int] = []  # token ids whose KV entries are in the cache
        self.hidden: torch.Tensor | None = None  # (q, hidden) final hidden states of the last pass

    def __len__(self) -> int:
        return len(self.cached)

    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int],
        parents: list[int] | None = None,
        tree_start: int | None = None,
        last_only: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` and return their logits, (len(tokens), vocab).

        last_only: return the last token's logits only, (1, vocab): a prefill
        over a long prompt then skips the language-model head over every other
        position (its hidden states are still kept in ``self.hidden``).

        parents: optional tree structure over the new tokens (index of each one's
        parent among them, -1 for tokens that follow the cached prefix directly).
        tree_start: for a tree grown over several passes (a draft tree expanded level
            by level), the cache position where the tree begins; ``parents`` then
            covers the tree's entries cached since ``tree_start`` followed by the new
            tokens, indexed from ``tree_start``. Default: the tree is the new tokens.
        inputs_embeds: (len(tokens), hidden) the decoder's inputs instead of the tokens'
            embeddings (a feature-level drafter's fused inputs); ``tokens`` still name them.
        """
        start = len(self.cached)
        tree_start = start if tree_start is None else tree_start
        if parents is not None:
            check_tree_entries(parents, start - tree_start, len(tokens))
        kwargs: dict = {}
        if inputs_embeds is None:
            kwargs["input_ids"] = torch.tensor([tokens], dtype=torch.long, device=self.device)  # (1, q)
        else:
            kwargs["inputs_embeds"] = inputs_embeds[None]  # (1, q, hidden)
        if parents is not None and any(p != i - 1 for i, p in enumerate(parents)):
            if self.tree_refusal:
                raise UnsupportedArchitectureError(f"tree drafts: {self.tree_refusal}")
            new_depths = tree_depths(parents)[start - tree_start :]
            kwargs["position_ids"] = (
                torch.tensor(new_depths, dtype=torch.long, device=self.device) + tree_start
            ).unsqueeze(0)  # (1, q)
            masks = tree_attention_masks(parents, tree_start, self.patterns, self.dtype, self.device)
            kwargs["attention_mask"] = {
                kind: mask[:, :, start - tree_start :] for kind, mask in masks.items()
            }
            if len(masks) == 1:  # one pattern in every layer: a plain 4-D mask (1, 1, q, start + q)
                kwargs["attention_mask"] = next(iter(kwargs["attention_mask"].values()))
            if self.positions.alibi:
                kwargs.pop("position_ids")  # ALiBi has no position embeddings: its keys' biases
                keys = tree_positions(parents, tree_start).to(self.device)
                queries = keys[-len(tokens) :]
            else:
                keys, queries = None, kwargs["position_ids"][0]
            with self.positions.at(queries, keys):
                outputs = self.decoder(cache=self.cache, use_cache=True, **kwargs)
        else:
            outputs = self.decoder(cache=self.cache, use_cache=True, **kwargs)
        self.hidden = outputs.last_hidden_state[0]  # (q, hidden)
        self.cached.extend(tokens)
        return self.logits(self.hidden[-1:] if last_only else self.hidden)  # (q or 1, vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden`` (q, hidden): every pass's logits come from here (a
        layered pass's too), so :meth:`recording_kept_rows` sees them."""
        logits = self.lm_head(hidden)
        if self._kept_rows is not None:
            self._last_logits = logits.reshape(-1, logits.shape[-1])
        return logits

    @contextmanager
    def recording_kept_rows(self) -> Iterator[list[torch.Tensor]]:
        """Inside: the logit row behind each position this session commits, in order: the
        rows of its latest pass that :meth:`keep` retains (the audit's bit-identity check)."""
        rows: list[torch.Tensor] = []
        self._kept_rows, self._last_logits = rows, None
        try:
            yield rows
        finally:
            self._kept_rows = self._last_logits = None

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens."""
        if length >= len(self.cached):
            return
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]
        del self.cached[length:]

    @torch.inference_mode()
    def keep(self, start: int, kept: list[int]) -> None:
        """Keep, of the tokens appended at ``start``, only those at offsets ``kept``
        (ascending), moved to ``start, start + 1, ...``; drop the rest.

        The prefix before ``start`` is not copied: accepted entries are moved
        in place, then the cache is cut.
        """
        end = start + len(kept)
        if self._kept_rows is not None and self._last_logits is not None:
            self._kept_rows.extend(self._last_logits[kept])
        if kept != list(range(len(kept))):
            source = torch.tensor(kept, device=self.device) + start
            for layer in self.cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys[:, :, start:end] = layer.keys[:, :, source]
                    layer.values[:, :, start:end] = layer.values[:, :, source]
            block = self.cached[start:]
            self.cached[start:end] = [block[i] for i in kept]  # same length: truncate cuts both
        self.truncate(end)


def check_tree_entries(parents: list[int], cached: int, new: int) -> None:
    """Refuse, in one line, ``parents`` that do not give one parent per entry of a tree
    holding ``cached`` entries and ``new`` tokens."""
    if len(parents) != cached + new:
        raise ValueError(
            f"parents has {len(parents)} entries but the tree holds {cached} cached and {new} new "
            "tokens; give one parent per tree entry since tree_start."
        )


def tree_depths(parents: list[int]) -> list[int]:
    """Each tree entry's depth (0 for entries whose parent is -1); parents before children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_attention_masks(
    parents: list[int],
    prefix_len: int,
    patterns: list[AttentionPattern],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One additive mask (1, 1, q, prefix_len + q) per attention pattern among ``patterns``,
    keyed by transformers' layer type: :func:`tree_attention_mask`, narrowed for sliding and
    chunked layers to the keys their window lets each node see, positions counted by depth."""
    masks: dict[str, torch.Tensor] = {}
    key_positions = None  # computed only for a pattern with a window
    for pattern in dict.fromkeys(patterns):
        if pattern.layer_type in masks:
            continue
        window = None
        if pattern.kind != "full":
            if key_positions is None:
                key_positions = tree_positions(parents, prefix_len)
            window = pattern.allows(key_positions[prefix_len:], key_positions)
        masks[pattern.layer_type] = tree_attention_mask(parents, prefix_len, dtype, device, window)
    return masks


def tree_positions(parents: list[int], prefix_len: int) -> torch.Tensor:
    """(prefix_len + q,) the position of every key: the prefix's by index, a tree entry's
    the position of its depth after the prefix."""
    depths = torch.tensor(tree_depths(parents), dtype=torch.long)
    return torch.cat([torch.arange(prefix_len), depths + prefix_len])


def tree_attention_mask(
    parents: list[int],
    prefix_len: int,
    dtype: torch.dtype,
    device: torch.device,
    window: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask (1, 1, q, prefix_len + q): 0 where attention is allowed.

    Every new token sees the whole cached prefix, itself and its ancestors; with
    ``window`` (q, prefix_len + q) bool, only those of them it marks.
    """
    q = len(parents)
    ancestors = torch.zeros(q, q, dtype=torch.bool)  # ancestors[i, j]: j is i or an ancestor of i
    for i, parent in enumerate(parents):
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True
    allowed = torch.cat([torch.ones(q, prefix_len, dtype=torch.bool), ancestors], dim=1)
    if window is not None:
        allowed &= window
    mask = torch.zeros(q, prefix_len + q, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]
