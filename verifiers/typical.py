"""Medusa's typical acceptance (Cai et al. 2024, "Medusa", section 2.3.1): LOSSY.

A draft node with token x is plausible when the target, at its parent, gives x

    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))

where p is the target's processed distribution there (same temperature / top-k /
top-p as sampling) and H(p) its entropy in nats. Of the root-to-node paths whose
every node is plausible, the deepest is accepted (the first in draft order on
ties), then one token is sampled from the target's p after its last node.

Parameters (Medusa's defaults):

* ``posterior_threshold`` (epsilon, 0.09): a hard bar; any token the target gives
  at least this probability is accepted.
* ``posterior_alpha`` (delta, 0.3 = sqrt(0.09)): scales the entropy-dependent bar.
  Where the target is unsure (high entropy) exp(-H) is small, so less likely
  tokens pass; where it is sure, only its top tokens do.

Lower values accept more tokens per pass and drift further from the target's
distribution. The output is NOT the target's distribution (``lossless = False``);
the benchmark reports its quality loss. At temperature 0 p is one-hot and only
the argmax passes, so this is greedy verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.registry import register_verifier
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs, sample
from specdec.decoders.engine.verifier import Verifier
from specdec.verifiers.greedy import greedy_walk


def plausible_nodes(
    draft: Draft, target_probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float
) -> list[bool]:
    """Whether each draft node's token passes the typical-acceptance bar at its parent.

    target_probs: (n + 1, vocab) float32; row 0 is p after the pending token.
    """
    entropy = torch.special.entr(target_probs).sum(-1)  # (n + 1,) H(p) in nats
    bar = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # (n + 1,)
    rows = torch.tensor(draft.parents, dtype=torch.long, device=target_probs.device) + 1  # (n,) parent's row
    tokens = torch.tensor(draft.tokens, dtype=torch.long, device=target_probs.device)  # (n,)
    return (target_probs[rows, tokens] > bar[rows]).tolist()


def deepest_plausible_path(draft: Draft, plausible: list[bool]) -> list[int]:
    """The longest root-to-node path of plausible nodes (first in draft order on ties)."""
    reachable: list[bool] = []  # node and all its ancestors plausible
    for node, parent in enumerate(draft.parents):
        reachable.append(plausible[node] and (parent < 0 or reachable[parent]))
    ends = [node for node in range(len(draft)) if reachable[node]]
    if not ends:
        return []
    node = max(ends, key=lambda i: (draft.depths[i], -i))
    path = []
    while node >= 0:
        path.append(node)
        node = draft.parents[node]
    return path[::-1]


@register_verifier("typical")
class TypicalVerifier(Verifier):
    """Medusa's typical acceptance over chains or trees; lossy by design."""

    @dataclass
    class Config:
        posterior_threshold: float = 0.09  # epsilon: tokens with at least this probability pass
        posterior_alpha: float = 0.3  # delta: scale of the entropy-dependent bar delta * exp(-H)

    lossless = False
    accepts_trees = True

    def __init__(self, config: Config, **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        if not 0 < config.posterior_threshold <= 1:
            raise ValueError(
                f"verifier.posterior_threshold must be in (0, 1], got {config.posterior_threshold}"
            )
        if config.posterior_alpha < 0:
            raise ValueError(f"verifier.posterior_alpha must be >= 0, got {config.posterior_alpha}")

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        if sampling.greedy:
            return greedy_walk(draft, target_logits)
        target_probs = processed_probs(target_logits, sampling)  # (n + 1, vocab) float32
        plausible = plausible_nodes(
            draft, target_probs, self.config.posterior_threshold, self.config.posterior_alpha
        )
        path = deepest_plausible_path(draft, plausible)
        row = path[-1] + 1 if path else 0
        last = int(sample(target_probs[row], generator))
        return Acceptance(path, [draft.tokens[i] for i in path] + [last])
