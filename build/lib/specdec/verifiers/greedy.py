"""Greedy verification: keep draft tokens while they equal the target's argmax.

The emitted tokens are exactly what standard greedy decoding would produce
(up to floating-point ties), whatever the proposer guessed.
"""

from __future__ import annotations

import torch

from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.registry import register_verifier
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.verifier import Verifier


def greedy_walk(draft: Draft, target_logits: torch.Tensor) -> Acceptance:
    """Follow, from the root, the child whose token is the target's argmax.

    target_logits: (n + 1, vocab). Works for chains and trees: at each accepted
    node the target's choice is looked up among that node's children.
    """
    target_choice = target_logits.argmax(-1).tolist()  # (n + 1,) target token after each row
    path: list[int] = []
    row = 0  # row of target_logits that predicts the next token
    children = draft.children
    while True:
        wanted = target_choice[row]
        match = next((c for c in children[row] if draft.tokens[c] == wanted), None)
        if match is None:
            return Acceptance(path, [draft.tokens[i] for i in path] + [wanted])
        path.append(match)
        row = match + 1


@register_verifier("greedy")
class GreedyVerifier(Verifier):
    """Exact match against the target's argmax (temperature 0 only)."""

    def check(self, sampling: SamplingConfig) -> None:
        if not sampling.greedy:
            raise ValueError(
                f"verifier=greedy decodes at temperature 0 only (got sampling.temperature="
                f"{sampling.temperature}); use verifier=rejection for sampling."
            )

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        return greedy_walk(draft, target_logits)
