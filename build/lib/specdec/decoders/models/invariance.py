"""Checking batch invariance on the actual model: is a verification pass's row
bit-equal to a single-token pass over the same position?

Exact mode (``model.exact``) rests on properties of the CPU kernels that were
measured, not promised, so the load announces what this check finds on the
machine at hand, and the tests run it on tiny models and the default one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decoders.models.session import ModelSession

PROBE_TREE = [-1, 0, 0, 1, 1, 2]  # two levels of siblings: nodes sit between their ancestors


@dataclass
class InvarianceReport:
    """How many rows of a chain pass and of a tree pass equal their single-token passes."""

    chain_equal: int
    chain_rows: int
    tree_equal: int
    tree_rows: int
    max_difference: float  # largest |logit difference| over all rows

    @property
    def passed(self) -> bool:
        return self.chain_equal == self.chain_rows and self.tree_equal == self.tree_rows

    def summary(self) -> str:
        verdict = (
            "bit-identical" if self.passed else f"NOT bit-identical (up to {self.max_difference:.3g} apart)"
        )
        return (
            f"verification rows {verdict} to single-token passes: chain {self.chain_equal}/{self.chain_rows}, "
            f"tree {self.tree_equal}/{self.tree_rows}"
        )


def ancestor_path(parents: list[int], node: int) -> list[int]:
    """The nodes from the tree's root level down to ``node``, in order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@torch.inference_mode()
def single_token_rows(session: ModelSession, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """(n, vocab): node i's logits from single-token passes along its ancestor path,
    after the session's cached prefix (which it keeps)."""
    prefix = len(session)
    rows = []
    for node in range(len(tokens)):
        session.truncate(prefix)
        for step in ancestor_path(parents, node):
            logits = session.forward([tokens[step]])
        rows.append(logits[0])
    session.truncate(prefix)
    return torch.stack(rows)


@torch.inference_mode()
def pass_rows(session: ModelSession, tokens: list[int], parents: list[int] | None) -> torch.Tensor:
    """(n, vocab): the logits of one pass over ``tokens`` (a chain without parents),
    after the session's cached prefix (which it keeps)."""
    prefix = len(session)
    logits = session.forward(tokens, parents)
    session.truncate(prefix)
    return logits


def check_pass_invariance(
    model: torch.nn.Module,
    prefix_len: int = 445,
    chain_len: int = 5,
    tree: list[int] = PROBE_TREE,
    seed: int = 0,
) -> InvarianceReport:
    """Compare a chain pass and a tree pass after a random ``prefix_len``-token
    prefix with single-token passes. The default prefix puts the pass across a
    64-key chunk boundary of :mod:`specdec.decoders.models.exact_attention`, where the
    passes' rows combine 7 or 8 chunks (CPU sums of 8 or more run in lanes)."""
    generator = torch.Generator().manual_seed(seed)
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (prefix_len,), generator=generator).tolist()
    tokens = torch.randint(0, vocab, (max(chain_len, len(tree)),), generator=generator).tolist()
    session = ModelSession(model)
    session.forward(prefix)
    chain = list(range(-1, chain_len - 1))
    counts = []
    largest = 0.0
    for block, parents, as_tree in ((tokens[:chain_len], chain, False), (tokens[: len(tree)], tree, True)):
        expected = single_token_rows(session, block, parents)
        got = pass_rows(session, block, parents if as_tree else None)
        counts.append(sum(bool(torch.equal(a, b)) for a, b in zip(got, expected)))
        largest = max(largest, float((got.double() - expected.double()).abs().max()))
    return InvarianceReport(counts[0], chain_len, counts[1], len(tree), largest)
