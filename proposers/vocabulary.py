"""Reduced draft vocabularies (FR-Spec, Zhao et al. 2025), for every drafter that has one.

A drafter's cost per token is dominated by its LM head over the whole vocabulary
(49,152 rows for SmolLM2). A reduced vocabulary keeps the N tokens the target
itself outputs most often: the drafter scores only those rows, sliced once
(:meth:`ReducedVocabulary.head`), and its q rows are mapped back to the full
vocabulary with zeros elsewhere (:func:`on_vocabulary`), which is what verifiers
read. Verification stays lossless: a greedy draft is the argmax among the N
tokens (any deterministic draft is), and rejection sampling is exact for any q,
zeros included (the residual max(0, p - q) keeps the target's mass outside).

Used by the distilled draft model (:mod:`specdec.proposers.draft_model`, which stores its
ranking as ``draft_vocab.json``), the Medusa heads (:mod:`specdec.proposers.medusa.heads`,
token ids in ``heads.safetensors``) and the copy heads' memory
(:mod:`specdec.proposers.copy_attention`).
"""

from __future__ import annotations

import torch


def on_vocabulary(probs: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(..., N) probabilities of the tokens ``token_ids`` (N,) -> (..., vocab_size) rows,
    0 elsewhere: a reduced-vocabulary drafter's q rows as verifiers read them. ``None``:
    the rows already cover the vocabulary."""
    if token_ids is None:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return full.index_copy_(-1, token_ids.to(probs.device), probs)


class ReducedVocabulary:
    """Full-vocabulary ids of the tokens a drafter scores, and the maps to and from them."""

    def __init__(self, token_ids: torch.Tensor, full_size: int) -> None:
        self.token_ids = token_ids  # (N,) long, full-vocabulary ids
        self.full_size = full_size  # size of the full vocabulary

    def head(self, lm_head: torch.nn.Linear) -> torch.nn.Linear:
        """A frozen head scoring only these tokens: ``lm_head``'s rows for them, sliced once.

        Built on the meta device and given the sliced parameters, so no throwaway
        random initialisation runs (nor draws from the global generator)."""
        rows = self.token_ids.to(lm_head.weight.device)
        bias = lm_head.bias is not None
        reduced = torch.nn.Linear(lm_head.in_features, len(rows), bias=bias, device="meta")
        reduced.weight = torch.nn.Parameter(lm_head.weight.detach()[rows].clone(), requires_grad=False)
        if bias:
            reduced.bias = torch.nn.Parameter(lm_head.bias.detach()[rows].clone(), requires_grad=False)
        return reduced

    def full_row(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., N) probabilities over these tokens as (..., full vocab) rows, 0 elsewhere."""
        return on_vocabulary(probs, self.token_ids, self.full_size)
