"""Tree verification: greedy walk at temperature 0, multi-draft speculative sampling above.

Names: ``target_probs[row]`` is p, the target's processed distribution at a node
(row 0: after the pending token; row i + 1: after draft node i); ``draft_probs[i]``
is q_i, the distribution node i's token was drawn from. See decoders/engine/draft.py for
accepted / correction / bonus tokens.

At temperature 0 the verifier follows the target's argmax through the tree
(:func:`~specdec.verifiers.greedy.greedy_walk`). Above, it walks the tree from the root,
one round per sibling (SpecInfer's multi-step speculative sampling, also called
recursive rejection sampling). At a node with current target distribution p:

    for each child c_i (token x_i), in draft order:
        sampled draft (draft_probs given):
            accept with min(1, p(x_i) / q_i(x_i));  on rejection p <- norm(max(0, p - q_i))
        deterministic draft (draft_probs None, q_i a point mass on x_i):
            accept with p(x_i);                     on rejection p <- p without x_i, renormalised
        on acceptance: descend into c_i, whose p is the target's row for c_i
    every child rejected: emit the correction token, drawn from the final p
    a node without children: emit the bonus token, drawn from p

When this is lossless (emits exactly the target's distribution). Each round is
one step of ordinary speculative sampling against the current p, whose output
is distributed as p provided x_i ~ q_i. So it is lossless when, at every node:

1. each sibling's token x_i is distributed as its recorded q_i given everything
   decided before its round (the path, the earlier siblings and their verdicts):
   siblings drawn independently (i.i.d. from one q, or each from its own q_i),
   or one after another with q_i recording the distribution actually used
   (e.g. sampling without replacement with q_i renormalised over the tokens
   not drawn yet);
2. how many siblings there are, and which subtree hangs below each, does not
   depend on the sampled tokens' values. Merging equal i.i.d. samples into one
   node (as a trie does) breaks this and is lossy; keep duplicates as separate
   siblings instead;
3. each child's subtree is drawn given its own path only.

Deterministic drafts (draft_probs None) satisfy all three whatever their shape,
as long as the tree depends on the committed tokens only (not on this round's
target randomness): n-gram tries, top-k expansions, reranked dynamic trees.
The tests (tests/test_tree.py) enumerate the algorithm's branches to check
exactness for i.i.d., without-replacement and deterministic siblings, and show
a merged-duplicates tree is not exact.
"""

from __future__ import annotations

import torch

from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.registry import register_verifier
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs, sample
from specdec.decoders.engine.verifier import Verifier
from specdec.verifiers.greedy import greedy_walk
from specdec.verifiers.rejection import point_mass, residual_distribution


def sibling_round(
    target_probs: torch.Tensor, token: int, draft_probs: torch.Tensor | None
) -> tuple[float, torch.Tensor]:
    """One sibling's round: (probability of accepting ``token``, the target distribution
    the next sibling — or the correction token — is judged against if it is rejected).

    target_probs: (vocab,) current p; draft_probs: (vocab,) q_i, or None for a point mass.
    """
    draft_probs = point_mass(token, target_probs) if draft_probs is None else draft_probs
    target_p_x, draft_q_x = float(target_probs[token]), float(draft_probs[token])
    accept_probability = 1.0 if target_p_x >= draft_q_x else target_p_x / draft_q_x
    return accept_probability, residual_distribution(target_probs, draft_probs)


class RowsOnDemand:
    """The target's processed distributions, row by row as the walk reaches them: a
    walk reads only the rows of the nodes it accepts (tau of them, not all n + 1), and
    processing a row over the whole vocabulary costs more than the walk itself."""

    def __init__(self, target_logits: torch.Tensor, sampling: SamplingConfig) -> None:
        self.logits = target_logits  # (n + 1, vocab)
        self.sampling = sampling
        self.device = target_logits.device

    def __getitem__(self, row: int) -> torch.Tensor:
        return processed_probs(self.logits[row], self.sampling)  # (vocab,) float32


def multi_draft_walk(
    draft: Draft, target_probs: torch.Tensor | RowsOnDemand, generator: torch.Generator
) -> Acceptance:
    """Multi-draft speculative sampling over a tree. target_probs: (n + 1, vocab) float32,
    or the same rows on demand."""
    # One uniform per node: each sibling's acceptance test uses its own.
    uniforms = torch.rand(len(draft), generator=generator, device=target_probs.device).tolist()
    children = draft.children
    path: list[int] = []
    row = 0  # target_probs row of the last accepted node (0: the pending token)
    while True:
        probs = target_probs[row]  # (vocab,) p, narrowed by each rejected sibling
        for child in children[row]:
            token = draft.tokens[child]
            draft_row = None if draft.draft_probs is None else draft.draft_probs[child].to(probs.device)
            accept_probability, residual = sibling_round(probs, token, draft_row)
            if uniforms[child] < accept_probability:
                path.append(child)
                row = child + 1
                break
            probs = residual
        else:  # every child rejected (correction token), or a leaf (bonus token)
            last = int(sample(probs, generator))
            return Acceptance(path, [draft.tokens[i] for i in path] + [last])


@register_verifier("tree")
class TreeVerifier(Verifier):
    """Lossless tree verification: greedy at temperature 0, multi-draft speculative
    sampling above (see the module docstring for the conditions on sampled trees)."""

    accepts_trees = True

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        if sampling.greedy:
            return greedy_walk(draft, target_logits)
        return multi_draft_walk(draft, RowsOnDemand(target_logits, sampling), generator)
