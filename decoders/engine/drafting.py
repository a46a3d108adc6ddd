"""Drafting as steps, so that a batch drafts for all its requests at once.

A proposer whose drafting runs a model (the heads' vocabulary products, a draft model's
passes) spends most of its drafting time in calls whose cost hardly grows with their rows
on a CPU: the weights are read once whatever the rows. Such a proposer drafts as a
generator (:meth:`~specdec.decoders.engine.proposer.Proposer.drafting`): it yields each
model call it needs as a :class:`Work`, is sent the call's result, and returns its draft.

* Alone (:func:`run_alone`), each work runs as a call of its own: ``propose`` is that.
* In a batch (:func:`draft_together`), every request's generator advances a step at a time
  and the works they wait on with the same :meth:`Work.key` (the same heads, the same
  draft model) run as one call (:meth:`Work.run_together`); each request is sent its part.

A pass of a model over one request's session (a draft model's, EAGLE's draft layer) is a
:class:`ModelPass`: a batch's passes over one model run as one packed pass of it.

A request's draft is the one it drafts alone, up to the rounding of a wider product.

A request's drafting seconds (:class:`DraftClock`, which the proposer reads as
``state.clock``) are its own code's seconds plus its rows' share of every joint call it
was part of: what the request adds to a batched round, which is what its sizers weigh.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.decoders.models.session import ModelSession

# a proposal in steps: yields the model calls it needs, is sent their results, returns its draft
DraftSteps = Generator["Work", Any, Any]


class Work:
    """A model call that drafting needs. Works of several requests with the same
    :meth:`key` run as one call. ``rows``: the call's share of a joint call's seconds."""

    rows: int = 1

    def key(self) -> Hashable:
        """Works with equal keys run together (default: never joined)."""
        return id(self)

    @classmethod
    def run_together(cls, works: Sequence[Work]) -> list[Any]:
        """Every work's result, in order, from as few calls as can serve them."""
        raise NotImplementedError


@dataclass(eq=False)
class ModelPass(Work):
    """A pass of a model over one request's ``session``, :meth:`ModelSession.forward`'s
    arguments; its result is what that returns, the new rows' logits. The passes of a
    batch's requests over one model (their sessions' :class:`Target`) run as one packed pass
    (:meth:`Target.packed_forward`): its weights are read once for all of them."""

    session: ModelSession
    tokens: list[int]
    parents: list[int] | None = None
    tree_start: int | None = None
    last_only: bool = False
    inputs_embeds: torch.Tensor | None = None  # (len(tokens), hidden) instead of the tokens' embeddings

    @property
    def rows(self) -> int:  # type: ignore[override]
        return max(len(self.tokens), 1)

    def key(self) -> Hashable:
        return ("model pass", id(self.session.model), self.last_only, self.inputs_embeds is None)

    @classmethod
    def run_together(cls, works: Sequence[ModelPass]) -> list[torch.Tensor]:
        target = works[0].session.target
        with torch.inference_mode():
            if len(works) == 1 or target is None:  # a session built without its Target runs alone
                return [
                    work.session.forward(
                        work.tokens, work.parents, work.tree_start, work.last_only, work.inputs_embeds
                    )
                    for work in works
                ]
            embeds = None if works[0].inputs_embeds is None else [work.inputs_embeds for work in works]
            return target.packed_forward(
                [work.session for work in works],
                [work.tokens for work in works],
                [work.parents for work in works],
                works[0].last_only,
                inputs_embeds=embeds,
                tree_starts=[work.tree_start for work in works],
            )


def run_alone(steps: DraftSteps) -> Any:
    """Drive ``steps`` to its end, each work a call of its own; its return value."""
    reply = None
    while True:
        try:
            work = steps.send(reply)
        except StopIteration as end:
            return end.value
        reply = type(work).run_together([work])[0]


class DraftClock:
    """One request's drafting seconds in a batch, read as ``time.perf_counter`` is (by
    differences): its generator's own time, live while it runs, plus its shares of the
    joint calls it took part in."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None  # when its generator resumed, while it runs

    def __call__(self) -> float:
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        return self.seconds + running

    def resume(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
        self._since = None


def draft_together(steps: Sequence[DraftSteps], clocks: Sequence[DraftClock]) -> list[Any]:
    """Drive every request's ``steps`` together: each round of the loop advances every
    generator still drafting to the work it waits on, then runs the works with one key as
    one call. Returns each generator's return value; ``clocks`` get each request's seconds."""
    results: list[Any] = [None] * len(steps)
    replies: list[Any] = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        waiting: dict[Hashable, list[tuple[int, Work]]] = {}
        for i in live:
            clocks[i].resume()
            try:
                work = steps[i].send(replies[i])
            except StopIteration as end:
                results[i] = end.value
                continue
            finally:
                clocks[i].pause()
            waiting.setdefault(work.key(), []).append((i, work))
        live = []
        for group in waiting.values():
            works = [work for _, work in group]
            tick = time.perf_counter()
            outputs = type(works[0]).run_together(works)
            seconds = time.perf_counter() - tick
            rows = sum(work.rows for work in works)
            for (i, work), output in zip(group, outputs):
                clocks[i].seconds += seconds * work.rows / rows
                replies[i] = output
                live.append(i)
        live.sort()
    return results
