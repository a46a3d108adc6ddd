"""What one request asks for and what it measured: its stop conditions (``max_new_tokens``,
end-of-sequence tokens, stop strings) and its counters (:class:`GenerationStats`), shared by
the decode loop (:mod:`specdec.decoders.engine.decoding`), batches and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class GenerationStats:
    """Counters for one request. Times are wall seconds."""

    new_tokens: int = 0
    target_passes: int = 0  # decode-phase target passes (rounds), prefill excluded
    proposed: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, accepted
    prefill_time: float = 0.0
    draft_time: float = 0.0  # the proposer's work: propose and observe (pruning included)
    observe_time: float = 0.0  # of draft_time, the part spent in observe
    verify_time: float = 0.0
    wall_time: float = 0.0
    gated_rounds: int = 0  # rounds the round gate kept plain (no drafting)
    drafted_rounds: int = 0  # rounds the proposer was asked to draft (its draft may be empty)
    drafted_round_tokens: int = 0  # tokens those rounds emitted, bonus tokens included
    draft_sizes: list[int] = field(default_factory=list)  # per round
    emitted_per_round: list[int] = field(default_factory=list)
    # per drafted round whose proposal was valued (or empty): the estimated acceptance of its
    # likeliest first token, 0 for an empty proposal (what a batch's joint choice ranks by)
    lead_values: list[float] = field(default_factory=list)
    # under a constraint: whether the output is a complete sentence of the grammar (None: none)
    constraint_complete: bool | None = None
    grammar_time: float = 0.0  # of the above, seconds llguidance spent computing masks
    grammar_masks: int = 0  # masks it computed (one per row of a pass, one per pruned parent)

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per decode-phase target pass, bonus token included."""
        return sum(self.emitted_per_round) / max(self.target_passes, 1)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "gated_rounds": self.gated_rounds,
            "tokens_per_s": self.tokens_per_s,
            "prefill_time": self.prefill_time,
            "draft_time": self.draft_time,
            "observe_time": self.observe_time,
            "verify_time": self.verify_time,
            "wall_time": self.wall_time,
            "constraint_complete": self.constraint_complete,
        }


def check_stop_strings(stop_strings) -> None:
    """Refuse an empty stop string: every text holds it, so it would end every output after
    its first token, silently."""
    if any(not text for text in stop_strings):
        raise ValueError(
            f"stop={list(stop_strings)}: an empty stop string ends every output at once; remove it"
        )


@dataclass
class StopConditions:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_stop_strings(self.stop_strings)
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")

    def cut(self, output: list[int], new: list[int]) -> tuple[list[int], bool]:
        """The part of ``new`` to emit after ``output``, and whether generation ends."""
        budget = self.max_new_tokens - len(output)
        done = len(new) >= budget
        new = new[:budget]
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1], True
        if self.stop_strings:
            for i in range(len(new)):
                if self._ends_in_stop(output + new[: i + 1]):
                    return new[: i + 1], True
        return new, done

    def _ends_in_stop(self, tokens: list[int]) -> bool:
        window = max(len(s) for s in self.stop_strings) + 1  # a token is at least one character
        text = self.tokenizer.decode(tokens[-window:])  # type: ignore[union-attr]
        return any(stop in text for stop in self.stop_strings)


class Outlook(NamedTuple):
    """One request of a draining batch (none waits to join), as the batch gate weighs it:
    what it may still emit and what drafting gave it."""

    remaining: int  # tokens it may still emit (``max_new_tokens`` left)
    drafted_rounds: int  # rounds it was asked to draft
    drafted_tokens: int  # tokens those rounds emitted
