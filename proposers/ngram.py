"""Prompt lookup: propose what followed the last time the current suffix appeared.

Looks for the longest suffix of the text so far (prompt and generated tokens)
that occurred before, trying n-gram sizes from ``max_n`` down to ``min_n``, and
proposes up to ``k`` tokens that followed its most recent earlier occurrence.
With ``branches > 1`` it returns a tree: the continuations of up to that many
distinct earlier occurrences, merged where they share a prefix.

With ``adaptive=true`` (default) the draft is cut to the length that pays:
acceptance is measured per matched-suffix length and depth, and
:class:`specdec.decoders.sizing.draft_length.DraftLengthPolicy` weighs it against the target's
measured pass cost, so a one-token match that is rarely right sends a short
draft or none, and a long match sends up to ``k``.

An index from each n-gram to the positions it ended at is updated as tokens
arrive, so a lookup costs O(max_n) whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import register_proposer


@register_proposer("ngram")
class NgramProposer(Proposer):
    @property
    def drafts_trees(self) -> bool:
        return self.config.branches > 1

    @dataclass
    class Config:
        # longest draft from one match: the sizing sends what the request's acceptance says holds
        k: int = 24
        min_n: int = 1
        max_n: int = 3
        branches: int = 1  # continuations from distinct earlier occurrences (1 = chain)
        adaptive: bool = True  # cut drafts to the length that pays (measured acceptance vs pass cost)

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        if not 1 <= config.min_n <= config.max_n:
            raise ValueError(
                f"ngram needs 1 <= proposer.min_n <= proposer.max_n, got {config.min_n}, {config.max_n}"
            )
        if config.branches < 1:
            raise ValueError(f"proposer.branches must be >= 1, got {config.branches}")
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # tokens[:_indexed] are in the index
        self.policy = context.sizing.chain(config.k) if config.adaptive else None

    def begin(self, state) -> None:
        self._index = {}
        self._indexed = 0

    def _update_index(self, tokens: list[int]) -> None:
        # Position p is "the continuation after tokens[p-n:p]"; index every n-gram
        # that ends before the last token (the last one has no continuation yet).
        for end in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.config.min_n, min(self.config.max_n, end) + 1):
                self._index.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, state) -> Draft:
        tokens = state.tokens
        self._update_index(tokens)
        k = self.config.k
        for n in range(min(self.config.max_n, len(tokens)), self.config.min_n - 1, -1):
            positions = self._index.get(tuple(tokens[-n:]))
            if not positions:
                continue
            continuations: list[list[int]] = []
            for start in reversed(positions):  # most recent first
                continuation = tokens[start : start + k]
                if continuation and continuation not in continuations:
                    continuations.append(continuation)
                    if len(continuations) == self.config.branches:
                        break
            if continuations:
                if self.policy is not None:
                    length = self.policy.choose(n, max(len(c) for c in continuations))
                    continuations = [c[:length] for c in continuations if length]
                    if not continuations:
                        return Draft.empty()
                    draft = tree_from_sequences(continuations)
                    survival = self.policy.values(n, length)  # the estimates it was sized by
                    draft.values = [survival[depth] for depth in draft.depths]
                    return draft
                return tree_from_sequences(continuations)
        return Draft.empty()

    def observe(self, state, round: Round) -> None:
        if self.policy is not None:
            self.policy.observe(round)  # counted under the matched length it chose for

    def describe(self) -> dict:
        return {"draft_length_rates": self.policy.as_dict()} if self.policy is not None else {}


def tree_from_sequences(sequences: list[list[int]]) -> Draft:
    """A token tree (trie) holding each sequence as a root-to-node path; the first
    sequence is the principal path."""
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            node = child_of.get((parent, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                child_of[(parent, token)] = node
            parent = node
    return Draft(tokens, parents)
