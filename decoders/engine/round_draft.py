"""A round's draft around the target's pass, beside the grammar's cut and the verifier: what
:class:`~specdec.decoders.engine.decoding.Decoding` checks and cuts before the pass and what it
tells the proposer after it. A draft's ids are refused outside the vocabulary
(:func:`check_draft_tokens`); a constrained draft, its forced tokens added unsized, is cut to the
nodes that pay (:func:`cut_to_paying`); the verdict goes back in the proposer's own numbering
(:func:`proposer_round`); a proposal's likeliest first token's value feeds the stats
(:func:`lead_value`).
"""

from __future__ import annotations

from specdec.decoders.engine.draft import Acceptance, Draft, Round
from specdec.decoders.engine.plugins import PluginError, describe
from specdec.decoders.engine.proposer import Proposer


def check_draft_tokens(draft: Draft, vocab_size: int, proposer: Proposer | None) -> None:
    """Refuse a draft holding an id outside the vocabulary before the target's pass reads it
    (the embedding's IndexError names neither the proposer nor the id)."""
    if draft.tokens and not 0 <= min(draft.tokens) <= max(draft.tokens) < vocab_size:
        bad = next(t for t in draft.tokens if not 0 <= t < vocab_size)
        raise PluginError(
            f"{describe(proposer)} drafted token id {bad}, outside the vocabulary of {vocab_size} ids "
            f"(0 to {vocab_size - 1}); a draft holds the target's token ids"
        )


def cut_to_paying(draft: Draft, proposer: Proposer | None) -> Draft:
    """``draft`` cut to the nodes that pay for their rows in this request's pass, by their
    values (:meth:`SizingPolicy.joint`); whole where it has none. Deterministic drafts only:
    the cut then never depends on a sampled token."""
    sizing = getattr(getattr(proposer, "context", None), "sizing", None)
    if draft.values is None or draft.draft_probs is not None or not len(draft) or sizing is None:
        return draft
    keep = sizing.joint([(draft.parents, draft.values)], requests=0)[0]
    return draft if len(keep) == len(draft) else draft.select(keep)


def proposer_round(
    proposed: Draft, verified: Draft, acceptance: Acceptance, draft_seconds: float, verify_seconds: float
) -> Round:
    """The round in the proposer's numbering: ``verified`` is ``proposed`` after the
    engine's and the verifier's pruning, and the verdict's path is in its numbering."""
    nodes = verified.nodes_in(proposed)
    path: list[int] = []
    for node in acceptance.path:
        if nodes[node] is None:  # a node the verifier added: the proposer's path ends before it
            break
        path.append(nodes[node])
    seen = [node for node in nodes if node is not None]
    return Round(proposed, path, seen, acceptance.tokens, draft_seconds, verify_seconds)


def lead_value(proposed: Draft) -> float | None:
    """A proposal's estimated acceptance of its likeliest first token: 0 for an empty one,
    None for one without values."""
    if not len(proposed):
        return 0.0
    if proposed.values is None:
        return None
    return max(value for value, parent in zip(proposed.values, proposed.parents) if parent < 0)
