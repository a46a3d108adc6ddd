"""What a proposer sees of a request in progress: :class:`DecodeState`.

It lives apart from the decode loop (:mod:`specdec.decoders.engine.decoding`) so the
Proposer contract can name it without importing the loop that drives proposers.

A proposer sees the request's tokens and the target's final hidden states of its
last pass, not the target's session: only a proposer that drafts with the
target's own layers (``Proposer.drafts_in_target``, early exit) is handed the
session, because its drafting writes KV entries there that its
``verify_forward`` then reuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.decoders.engine.constraint import GrammarState
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.models.session import ModelSession


@dataclass
class DecodeState:
    """What a proposer sees of a request in progress."""

    tokens: list[int]  # prompt + generated tokens; the last one is the pending token
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator
    hidden: torch.Tensor | None  # (q, hidden) the target's final hidden states of its last pass
    hidden_row: int = -1  # row of hidden that produced the pending token
    # rows of hidden at the positions the last pass committed (None: all, as after
    # the prefill); they are the positions just before the pending token, in order
    committed_rows: list[int] | None = None
    # the target's session, given only to a proposer that drafts in it (drafts_in_target)
    session: ModelSession | None = None
    # the request's constraint, where it has one: its state after the output so far
    # (``grammar.continuation(k)``: what it forces next, and the layout tokens between; the
    # ``grammar`` proposer drafts it)
    grammar: GrammarState | None = None
    # seconds, read by differences, that drafting measures its own cost with: wall time for a
    # request alone; in a batch drafting together, its share (decoders/engine/drafting.py)
    clock: Callable[[], float] = time.perf_counter

    @property
    def last_hidden(self) -> torch.Tensor:
        """(hidden,) the target's final hidden state that predicted the pending token."""
        assert self.hidden is not None
        return self.hidden[self.hidden_row]

    @property
    def committed_hidden(self) -> torch.Tensor:
        """(c, hidden) the target's final hidden states at the positions the last pass
        committed: the prompt after the prefill, then the pending token of the round
        and the accepted draft tokens (positions len(tokens) - 1 - c .. len(tokens) - 2)."""
        assert self.hidden is not None
        rows = self.committed_rows
        return self.hidden if rows is None else self.hidden[rows]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]
