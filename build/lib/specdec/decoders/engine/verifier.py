"""The Verifier contract: who decides which draft tokens the target keeps.

``verify(draft, target_logits, sampling, generator)`` gets the draft (after
:meth:`Verifier.prepare`) and the target's logits for one pass over the
pending token and every draft node:

    target_logits: (n + 1, vocab); row 0 is the target's distribution after the
    pending token (for the root-level nodes), row i + 1 the distribution after
    draft node i (for its children).

It returns an :class:`~specdec.decoders.engine.draft.Acceptance`: the accepted path and the
emitted tokens (accepted tokens + one correction or bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.sampling import SamplingConfig


class Verifier:
    name: ClassVar[str]

    @dataclass
    class Config:
        pass

    #: Lossless verifiers reproduce the target's output distribution exactly.
    lossless: ClassVar[bool] = True
    #: Tree verifiers judge whole trees; chain verifiers judge the principal path.
    accepts_trees: ClassVar[bool] = False

    def __init__(self, config: Verifier.Config, **_: object) -> None:
        self.config = config

    def check(self, sampling: SamplingConfig) -> None:
        """Raise if this verifier cannot honour ``sampling``."""

    def prepare(self, draft: Draft) -> Draft:
        """The part of the draft the target should see: chain verifiers prune a tree
        to its principal path before the target pass, so no compute is wasted."""
        return draft if self.accepts_trees else draft.as_chain()

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        raise NotImplementedError
