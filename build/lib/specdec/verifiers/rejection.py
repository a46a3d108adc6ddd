"""Lossless speculative sampling over a chain (Leviathan et al. 2023; Chen et al. 2023).

Names: ``target_probs`` is p, the target's distribution; ``draft_probs`` is q,
the distribution each draft token was drawn from; both after the same
temperature / top-k / top-p processing, in float32.

For draft token x at depth i:
    accept with probability min(1, p_i(x) / q_i(x));
    at the first rejection emit a correction token drawn from the residual
    norm(max(0, p_i - q_i)) and stop;
    if every token is accepted, emit a bonus token drawn from p_n.
A deterministic draft (draft_probs is None) is a point mass on x: acceptance is
p_i(x) and the residual is p_i with x removed. The emitted sequence then has
exactly the target's distribution. At temperature 0 p is one-hot and this is
greedy verification.
"""

from __future__ import annotations

import torch

from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.registry import register_verifier
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs, sample
from specdec.decoders.engine.verifier import Verifier


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for (vocab,) rows; new tensor, inputs untouched.

    If p - q has no positive mass (p == q up to rounding), rejection had
    probability 0 and p itself is returned.
    """
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    total = residual.sum()
    if total <= 0:
        return target_probs
    return residual / total


def point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    """(vocab,) one-hot distribution on ``token``."""
    mass = torch.zeros_like(like)
    mass[token] = 1.0
    return mass


def speculative_sample_chain(
    draft: Draft,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Acceptance:
    """Speculative sampling of a chain. target_probs: (n + 1, vocab) float32."""
    n = len(draft)
    if n == 0:
        return Acceptance([], [int(sample(target_probs[0], generator))])
    device = target_probs.device
    draft_tokens = torch.tensor(draft.tokens, device=device)  # (n,)
    rows = torch.arange(n, device=device)
    target_p_x = target_probs[rows, draft_tokens]  # (n,) p_i(x_i)
    if draft.draft_probs is None:
        draft_q_x = torch.ones_like(target_p_x)  # point mass: q_i(x_i) = 1
    else:
        draft_q_x = draft.draft_probs[rows, draft_tokens].to(device)  # (n,) q_i(x_i)
    uniform = torch.rand(n, generator=generator, device=device)  # (n,)
    # accept iff u < p/q, written without dividing (q may underflow to 0).
    accepted = (uniform * draft_q_x < target_p_x).tolist()
    num_accepted = accepted.index(False) if False in accepted else n
    if num_accepted == n:
        last = int(sample(target_probs[n], generator))  # bonus token
    else:
        rejected_q = (
            point_mass(draft.tokens[num_accepted], target_probs[num_accepted])
            if draft.draft_probs is None
            else draft.draft_probs[num_accepted].to(device)
        )
        residual = residual_distribution(target_probs[num_accepted], rejected_q)
        last = int(sample(residual, generator))  # correction token
    path = list(range(num_accepted))
    return Acceptance(path, draft.tokens[:num_accepted] + [last])


@register_verifier("rejection")
class RejectionVerifier(Verifier):
    """Speculative sampling: lossless at any temperature (greedy at temperature 0)."""

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        target_probs = processed_probs(target_logits, sampling)  # (n + 1, vocab) float32
        return speculative_sample_chain(draft, target_probs, generator)
