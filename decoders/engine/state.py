"""What a proposer sees of a request in progress: :class:`DecodeState`.

It lives apart from the decode loop (:mod:`decoders.engine.decoding`) so the
Proposer contract can name it without importing the loop that drives proposers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders.engine.sampling import SamplingConfig
from decoders.models.session import ModelSession


@dataclass
class DecodeState:
    """What a proposer sees of a request in progress."""

    tokens: list[int]  # prompt + generated tokens; the last one is the pending token
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator
    target: ModelSession
    hidden_row: int = -1  # row of target.hidden that produced the pending token
    # rows of target.hidden at the positions the last pass committed (None: all, as after
    # the prefill); they are the positions just before the pending token, in order
    committed_rows: list[int] | None = None

    @property
    def last_hidden(self) -> torch.Tensor:
        """(hidden,) the target's final hidden state that predicted the pending token."""
        assert self.target.hidden is not None
        return self.target.hidden[self.hidden_row]

    @property
    def committed_hidden(self) -> torch.Tensor:
        """(c, hidden) the target's final hidden states at the positions the last pass
        committed: the prompt after the prefill, then the pending token of the round
        and the accepted draft tokens (positions len(tokens) - 1 - c .. len(tokens) - 2)."""
        assert self.target.hidden is not None
        rows = self.committed_rows
        return self.target.hidden if rows is None else self.target.hidden[rows]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]
