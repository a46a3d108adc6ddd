"""Decoding a batch of requests: each round, one target pass over every request's block.

Each request is a :class:`~specdec.decoders.engine.decoding.Decoding` of its own: its
session (KV cache, length), its proposer (``proposer.for_request()``: per-request state
apart, weights and measured acceptance shared), its draft (chain or tree, any size,
possibly empty), its verifier's verdict and its stop conditions. A round of the batch:

    for each request:  planned = request.plan(room)      draft, cut, its block
    logits = target.packed_forward(sessions, blocks)     ONE pass over every block
    for each request:  request.settle(planned, logits)   verify, keep, emit, observe

So each request's output is what decoding it alone gives (greedy: the same tokens; in
exact mode the same bits, the pass kept within ``widest_exact_pass`` rows in all;
sampling: its own generator, the target's distribution).

Requests join as others finish (continuous batching): at most ``size`` decode at once,
each once it has arrived (``arrivals``: seconds after the start; default all at once).
A joining request's prefill is a pass of its own. Before each request plans, the sizing
policy is told what the rest of the pass holds (:meth:`SizingPolicy.beside`): the rows
the other requests put in it and the tokens they are expected to yield, so a draft is
sized by what it adds to the whole pass's tokens per second; then the pass keeps the nodes
that pay over every request's (:meth:`SizingPolicy.joint`). Drafts shrink, then stop, as
the batch makes the pass dearer; and where drafting itself (a model's forward passes for
every request) costs more than the nodes left give, or, once no request waits to join, where
drafting does not bring the batch's end closer, the pipeline's batch gate
(:mod:`specdec.decoders.sizing.batch_gate`) keeps the round plain before anyone drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.decoders.engine.decoding import Decoding, PlannedRound
from specdec.decoders.engine.drafting import DraftClock, draft_together
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.request import Outlook
from specdec.decoders.models.session import ModelSession


@dataclass
class BatchStats:
    """What a batch run measured as a whole."""

    wall_time: float = 0.0  # seconds from the start to the last request's end
    rounds: int = 0  # packed passes (prefills excluded)
    rows: list[int] = field(default_factory=list)  # per pass: the rows of every request's block
    drafted: list[int] = field(default_factory=list)  # per pass: draft tokens over all requests
    active: list[int] = field(default_factory=list)  # per pass: requests in it
    plain_rounds: int = 0  # passes the gate kept plain (no request drafted)
    latencies: list[float] = field(default_factory=list)  # per request: arrival to last token (s)

    def as_dict(self) -> dict:
        return {
            "wall_time": self.wall_time,
            "rounds": self.rounds,
            "mean_rows_per_pass": sum(self.rows) / max(len(self.rows), 1),
            "mean_drafted_per_request": sum(self.drafted) / max(sum(self.active), 1),
            "plain_rounds": self.plain_rounds,
            "latencies": self.latencies,
        }


@dataclass
class _Slot:
    session: ModelSession
    proposer: Proposer | None
    decoding: Decoding | None = None
    index: int = -1  # the request it decodes
    arrival: float = 0.0


def check_batchable(proposer: Proposer | None, gate: object | None) -> None:
    """Refuse, in one line, what cannot decode in a batch."""
    if proposer is not None and (reason := proposer.batch_refusal):
        raise ValueError(reason)
    if gate is not None:
        raise ValueError(
            "round_gate=true decides from one request's rounds; a batch has its own gate (whether "
            "a round over its requests drafts): build the pipeline with round_gate=false"
        )


def decode_batch(
    start: Callable[[int, ModelSession, Proposer | None], Decoding],
    count: int,
    size: int,
    sessions: Callable[[], ModelSession],
    proposer: Proposer | None,
    sizing: object | None = None,
    arrivals: Sequence[float] | None = None,
    on_done: Callable[[int, Decoding], None] | None = None,
    gate: object | None = None,
) -> BatchStats:
    """Decode requests 0 .. count - 1, at most ``size`` at once: ``start(i, session,
    proposer)`` prefills request i on a slot's session and proposer; ``on_done(i, decoding)``
    takes it when it ends. ``sizing``: the policy the proposers' sizers come from (told
    what the rest of each pass holds). ``gate``: whether each round drafts at all
    (:class:`~specdec.decoders.sizing.batch_gate.BatchGate`; None: every round drafts)."""
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {size}")
    if arrivals is not None and len(arrivals) != count:
        raise ValueError(f"arrivals has {len(arrivals)} times for {count} requests")
    arrivals = list(arrivals) if arrivals is not None else [0.0] * count
    order = sorted(range(count), key=lambda i: (arrivals[i], i))
    slots = [_Slot(sessions(), proposer.for_request() if proposer is not None else None) for _ in range(size)]
    target = slots[0].session.target
    together = proposer is not None and proposer.batches_drafting  # one model call per step for all
    stats = BatchStats(latencies=[0.0] * count)
    begin = time.perf_counter()
    try:
        waiting = 0  # next in order to join
        rotation = 0
        while True:
            now = time.perf_counter() - begin
            for slot in slots:  # the arrived join free slots
                if slot.decoding is None and waiting < count and arrivals[order[waiting]] <= now:
                    slot.index, slot.arrival = order[waiting], arrivals[order[waiting]]
                    waiting += 1
                    slot.decoding = start(slot.index, slot.session, slot.proposer)
                    _finish_if_done(slot, stats, begin, on_done)
            active = [slot for slot in slots if slot.decoding is not None]
            if not active:
                if waiting == count:
                    break
                time.sleep(max(arrivals[order[waiting]] - (time.perf_counter() - begin), 0.0))
                continue
            rotation = (rotation + 1) % len(active)  # who plans first (and gets the widest room) rotates
            active = active[rotation:] + active[:rotation]
            round_start = time.perf_counter()
            drafting = gate is None or gate.drafts(len(active), _outlook(active, waiting == count))  # type: ignore[attr-defined]
            planned = _plan(active, target, sizing, drafting, together)
            tock = time.perf_counter()
            logits = target.packed_forward(
                [slot.session for slot in active], [p.block for p in planned], [p.parents for p in planned]
            )
            seconds = time.perf_counter() - tock
            rows = sum(len(p.block) for p in planned)
            _record_pass(target, active, rows, seconds)
            stats.rounds += 1
            stats.rows.append(rows)
            stats.drafted.append(rows - len(active))
            stats.active.append(len(active))
            stats.plain_rounds += not drafting
            emitted = 0
            for slot, plan, block_logits in zip(active, planned, logits):
                before = len(slot.decoding.tokens)  # type: ignore[union-attr]
                slot.decoding.settle(plan, block_logits, seconds, timed=False)  # type: ignore[union-attr]
                emitted += len(slot.decoding.tokens) - before  # type: ignore[union-attr]
                _finish_if_done(slot, stats, begin, on_done)
            if gate is not None:
                gate.record(len(active), drafting, emitted, time.perf_counter() - round_start)  # type: ignore[attr-defined]
        stats.wall_time = time.perf_counter() - begin
    finally:
        if sizing is not None:  # single requests after the batch are sized alone again
            sizing.beside(0, 0.0)
    return stats


def _plan(
    active: list[_Slot], target, sizing, drafting: bool = True, together: bool = False
) -> list[PlannedRound]:
    """Every active request's round, planned in turn: each told the rest of the pass (the
    rows and expected tokens of those planned, one row and token for each still to plan)
    and, in exact mode, given the rows left within the widest exact pass. Then the drafts
    are weighed together (:meth:`SizingPolicy.joint`): over every request's nodes, ranked
    by their estimated value, the pass keeps those that raise its tokens per second, so a
    request planned early (which knew only the others' pending rows) gives way to a more
    valuable node of one planned after it.

    ``together``: the proposers draft at once (:func:`draft_together`: their model calls
    shared), each told the others' pending rows only; the joint choice then weighs them."""
    widest = target.widest_exact_pass if target is not None else None
    proposals: list = [None] * len(active)
    if together and drafting:
        if sizing is not None:
            sizing.beside(len(active) - 1, len(active) - 1.0, len(active))
        proposals = _draft_together(active)
    planned: list[PlannedRound] = []
    rows, tokens = 0, 0.0
    for k, slot in enumerate(active):
        later = len(active) - k - 1
        if sizing is not None and not together:
            sizing.beside(rows + later, tokens + later, len(active))
        room = None if widest is None else max(widest - rows - later, 1)
        plan = slot.decoding.plan(room, drafting, proposals[k], alone=False)  # type: ignore[union-attr]
        planned.append(plan)
        rows += len(plan.block)
        values = plan.draft.values
        tokens += 1.0 + (sum(values) if values else 0.0)
    if sizing is None or len(planned) < 2 or not any(len(p.draft) for p in planned):
        return planned
    kept = sizing.joint([(p.draft.parents, p.draft.values) for p in planned])
    return [plan.keeping(nodes) for plan, nodes in zip(planned, kept)]


def _draft_together(active: list[_Slot]) -> list[tuple[bool, object, float]]:
    """Every request's proposal, drafted at once: (drafted, draft, its drafting seconds)."""
    decodings = [slot.decoding for slot in active]
    clocks = [DraftClock() for _ in active]
    for decoding, clock in zip(decodings, clocks):
        decoding.state.clock = clock  # type: ignore[union-attr]
    try:
        results = draft_together([d.proposal() for d in decodings], clocks)  # type: ignore[union-attr]
    finally:
        for decoding in decodings:
            decoding.state.clock = time.perf_counter  # type: ignore[union-attr]
    return [(drafted, draft, clock.seconds) for (drafted, draft), clock in zip(results, clocks)]


def _outlook(active: list[_Slot], draining: bool) -> list[Outlook] | None:
    """Each request's outlook where the batch is draining (none waits to join), else None."""
    if not draining:
        return None
    decodings = [slot.decoding for slot in active]
    return [Outlook(d.remaining, d.stats.drafted_rounds, d.stats.drafted_round_tokens) for d in decodings]  # type: ignore[union-attr]


def _record_pass(target, active: list[_Slot], rows: int, seconds: float) -> None:
    """A packed pass teaches the live T(n) of packed passes over as many requests its
    width's cost (at the requests' mean context); a request's own passes keep theirs."""
    timing = target.pass_times(requests=len(active)) if target is not None else None
    if timing is not None:
        timing.at_context(sum(len(slot.session) for slot in active) // len(active))
        timing.record(rows, seconds)


def _finish_if_done(slot: _Slot, stats: BatchStats, begin: float, on_done) -> None:
    decoding = slot.decoding
    if decoding is None or not decoding.done:
        return
    stats.latencies[slot.index] = time.perf_counter() - begin - slot.arrival
    if on_done is not None:
        on_done(slot.index, decoding)
    else:
        decoding.output()
    slot.decoding = None
