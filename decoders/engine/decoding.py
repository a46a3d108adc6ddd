"""The decode loop: standard decoding and speculative decoding are one loop.

    prefill(prompt)                       -> the target chooses the first token
    loop until EOS / stop string / max_new_tokens:
        draft  = proposer.propose(state)  (empty without a proposer)
        logits = session.forward([pending] + draft)   ONE pass, tree mask if needed
        result = verifier.verify(draft, logits)       accepted path + 1 target token
        session.keep(accepted)            rejected nodes' KV entries dropped
        proposer.observe(state, round)    the proposer's own draft, its accepted path in
                                          the draft's numbering, draft and verify seconds

Under a constraint (:mod:`specdec.decoders.engine.constraint`) the draft is cut where the
grammar rejects it and extended by the tokens it forces, and every row of the pass is
masked with the grammar's state there before the verifier reads it.

With no proposer every round verifies an empty draft, i.e. emits one target
token per pass: that is standard decoding, the baseline. With a round gate
(:mod:`specdec.decoders.sizing.round_gate`) a round may skip drafting where earlier rounds
say drafting does not pay: it is then a standard decoding step, and the proposer
is told (``proposer.skip(state)``) instead of asked.

:class:`Decoding` is that loop a round at a time (the benchmark steps several
requests in turn); :func:`decode` runs one to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from specdec.decoders.engine.constraint import GrammarState
from specdec.decoders.engine.draft import Acceptance, Draft
from specdec.decoders.engine.drafting import DraftSteps, run_alone
from specdec.decoders.engine.plugins import plugin_code
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import build, verifier_registry
from specdec.decoders.engine.request import GenerationStats, StopConditions
from specdec.decoders.engine.round_draft import check_draft_tokens, cut_to_paying, lead_value, proposer_round
from specdec.decoders.engine.sampling import SamplingConfig, check_finite, next_token
from specdec.decoders.engine.state import DecodeState
from specdec.decoders.engine.verifier import Verifier
from specdec.decoders.models.session import ModelSession


class RoundGate(Protocol):
    """What the loop asks of a round gate (the one built in is
    :class:`specdec.decoders.sizing.round_gate.RoundGate`, a layer above the engine)."""

    def begin(self) -> None: ...  # a request starts

    def drafts(self) -> bool: ...  # whether this round drafts

    def record(self, draft_seconds: float, verify_seconds: float, emitted: int, accepted: int) -> None: ...

    def forget(self) -> None: ...  # drop what was measured (the benchmark's warm-up)

    def describe(self) -> dict: ...  # for results files


@dataclass
class PlannedRound:
    """A round between its two halves (:meth:`Decoding.plan`, :meth:`Decoding.settle`)."""

    drafting: bool  # the proposer was asked (not a round the gate kept plain)
    proposed: Draft  # the proposer's draft, as it drafted it
    draft: Draft  # what the target verifies: cut to the grammar, the budget and the pass
    block: list[int]  # the pass's tokens: the pending token, then the draft's
    parents: list[int] | None  # the block's tree (None: a chain)
    block_start: int  # the session's length before the pass
    tick: float  # when drafting started
    tock: float  # when drafting ended
    timing: object | None  # the target's live pass times, if followed

    def keeping(self, nodes: list[int]) -> PlannedRound:
        """This round with its draft cut to ``nodes`` (closed under taking parents, in
        order): a batch's joint choice drops the nodes that do not pay in the whole pass."""
        if len(nodes) == len(self.draft):
            return self
        draft = self.draft.select(nodes)
        parents = None if draft.is_chain else [-1] + [p + 1 for p in draft.parents]
        return replace(self, draft=draft, block=[self.block[0]] + draft.tokens, parents=parents)


@dataclass
class GenerationOutput:
    tokens: list[int]  # generated tokens (prompt excluded)
    stats: GenerationStats


def default_verifier(sampling: SamplingConfig, trees: bool = False) -> str:
    """The verifier used where none is configured, the one place it is chosen: ``tree``
    for a proposer whose drafts are trees (on a model that takes tree passes); else greedy
    at temperature 0, rejection sampling otherwise (all lossless)."""
    if trees:
        return "tree"
    return "greedy" if sampling.greedy else "rejection"


def standard_verifier(sampling: SamplingConfig) -> Verifier:
    """The verifier standard decoding uses on its empty drafts: it just picks the
    target's token (argmax, or a sample from the processed distribution)."""
    return build(verifier_registry, default_verifier(sampling))


def decode(
    session: ModelSession,
    prompt_ids: list[int],
    stop: StopConditions,
    sampling: SamplingConfig,
    proposer: Proposer | None = None,
    verifier: Verifier | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    gate: RoundGate | None = None,
    grammar: GrammarState | None = None,
) -> GenerationOutput:
    """Generate after ``prompt_ids``: standard decoding without a proposer, else speculative
    (every round drafted, or as ``gate`` decides); under ``grammar``'s constraint if given."""
    decoding = Decoding(session, prompt_ids, stop, sampling, proposer, verifier, on_tokens, gate, grammar)
    while not decoding.done:
        decoding.step()
    return decoding.output()


class Decoding:
    """One request being decoded, a round at a time: :func:`decode` runs it to the end;
    the benchmark steps several of them in turn (``bench.interleave=rounds``), each on a
    session of its own, so that they see the machine's load alike.

    Construction checks the request and runs the prefill (the target chooses the first
    token); :meth:`step` runs one round; :meth:`output` finishes the request. The
    stats' ``wall_time`` is the time spent in this request's own calls only, not in
    whatever ran between its rounds."""

    def __init__(
        self,
        session: ModelSession,
        prompt_ids: list[int],
        stop: StopConditions,
        sampling: SamplingConfig,
        proposer: Proposer | None = None,
        verifier: Verifier | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        gate: RoundGate | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        if proposer is not None and verifier is None:
            raise ValueError("a proposer needs a verifier")
        if verifier is None:
            verifier = standard_verifier(sampling)
        verifier.check(sampling)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if session.max_positions and len(prompt_ids) + stop.max_new_tokens > session.max_positions:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({stop.max_new_tokens}) exceeds "
                f"the model's context of {session.max_positions} tokens; shorten the prompt or lower "
                "max_new_tokens."
            )
        self.session, self.stop, self.sampling = session, stop, sampling  # the request's target session
        self.proposer, self.verifier, self.on_tokens = proposer, verifier, on_tokens
        self.grammar = grammar
        if gate is not None and proposer is not None and proposer.drafts_in_target:
            raise ValueError(
                f"proposer {proposer.name!r} drafts inside the target and sizes its drafts itself; "
                "it cannot be gated (build its pipeline with round_gate=False)"
            )
        self.gate = gate if proposer is not None else None
        self.stats = GenerationStats()
        self.finished = False  # output() has told the proposer
        self.generator = sampling.generator(session.device)
        start = time.perf_counter()

        session.reset()
        logits = session.forward(prompt_ids, last_only=True)[-1]  # (vocab,)
        check_finite(logits, "prefill")
        self.vocab_size = logits.shape[-1]  # a draft's ids are checked against it
        if grammar is not None:
            logits = grammar.constrain(Draft.empty(), logits[None])[0]
        first = next_token(logits, sampling, self.generator)
        self.stats.prefill_time = time.perf_counter() - start
        self.tokens, self.done = stop.cut([], [first])  # the generated tokens (prompt excluded)
        if grammar is not None:
            grammar.advance(self.tokens)
        if on_tokens:
            on_tokens(self.tokens)
        self.state = DecodeState(
            list(prompt_ids) + self.tokens, len(prompt_ids), sampling, self.generator, session.hidden
        )
        if proposer is not None:
            if proposer.drafts_in_target:
                self.state.session = session
        self.state.grammar = grammar
        if proposer is not None:
            with plugin_code(proposer, "begin"):
                proposer.begin(self.state)
            sizing = getattr(getattr(proposer, "context", None), "sizing", None)
            if sizing is not None:  # the request's own acceptance, over the pooled prior
                sizing.start_request(proposer)
            if self.gate is not None:
                self.gate.begin()
        # A live cost curve learns from the passes; not from those that reuse drafting work.
        self.timed = proposer is None or not proposer.drafts_in_target
        # Exact mode keeps a pass's rows exact up to a width; wider drafts are cut to fit.
        owner = getattr(session, "target", None)  # the Target whose passes these are (None: a bare session)
        self.widest = owner.widest_exact_pass if owner is not None else None
        self.stats.wall_time += time.perf_counter() - start

    def _pass_times(self):
        """The target's live pass times, once some pipeline over it follows its live cost."""
        owner = getattr(self.session, "target", None)
        return owner.pass_times() if owner is not None else None

    @property
    def progress(self) -> float:
        """The share of ``max_new_tokens`` generated so far (1.0 once done)."""
        return 1.0 if self.done else len(self.tokens) / self.stop.max_new_tokens

    @property
    def remaining(self) -> int:
        """Tokens it may still emit: what ``max_new_tokens`` leaves (0 once done)."""
        return 0 if self.done else self.stop.max_new_tokens - len(self.tokens)

    def step(self) -> None:
        """One round: draft, one target pass over the pending token and the draft,
        verify, keep the accepted path, tell the proposer."""
        planned = self.plan()
        tock = time.perf_counter()
        if not planned.drafting:
            target_logits = self.session.forward(planned.block, planned.parents)  # (n + 1, vocab)
        else:  # the proposer may reuse work done while drafting (default: session.forward)
            with plugin_code(self.proposer, "verify_forward"):
                target_logits = self.proposer.verify_forward(self.session, planned.block, planned.parents)  # type: ignore[union-attr]
        self.settle(planned, target_logits, time.perf_counter() - tock)

    def proposal(self, draft: bool = True) -> DraftSteps:
        """The round's proposal as steps (:meth:`Proposer.drafting`), returning (whether the
        proposer drafted, its draft): a batch drafts its requests' proposals together
        (:func:`~specdec.decoders.engine.drafting.draft_together`). ``draft=False``: a plain
        round (a batch's gate kept it so), the proposer told as when the round gate keeps one."""
        proposer, state = self.proposer, self.state
        timing = self._pass_times()
        if timing is not None:  # the sizing reads T(n) after this many tokens
            timing.at_context(len(self.session))
        drafting = proposer is not None and draft and (self.gate is None or self.gate.drafts())
        if drafting:
            with plugin_code(proposer, "propose"):
                proposed = yield from proposer.drafting(state)  # type: ignore[union-attr]
        else:
            if proposer is not None:  # a round the gate keeps plain
                with plugin_code(proposer, "skip"):
                    proposer.skip(state)
                self.stats.gated_rounds += 1
            proposed = Draft.empty()
        return drafting, proposed

    def plan(
        self,
        room: int | None = None,
        draft: bool = True,
        proposal: tuple[bool, Draft, float] | None = None,
        alone: bool = True,
    ) -> PlannedRound:
        """The round's first half: the draft (cut to the grammar, the token budget, exact
        mode's widest pass and ``room`` tokens in all, pending token included) and the block
        the target's pass takes. A batch plans every request's round, runs one pass over
        their blocks, then :meth:`settle` s each. ``draft``: as for :meth:`proposal`.
        ``proposal``: (drafted, draft, drafting seconds) of a :meth:`proposal` a batch drafted
        with its other requests' (None: drafted here). ``alone``: the pass is this request's
        (False: a batch's, whose nodes the batch weighs together)."""
        if self.done:
            raise RuntimeError("this request is finished")
        session, verifier, state, proposer = self.session, self.verifier, self.state, self.proposer
        tick = time.perf_counter()
        if proposal is None:
            drafting, proposed = run_alone(self.proposal(draft))
        else:
            drafting, proposed, seconds = proposal
            tick -= seconds
        check_draft_tokens(proposed, self.vocab_size, proposer)
        timing = self._pass_times()
        draft = proposed
        if self.grammar is not None and drafting:  # no node the grammar rejects; its forced tokens added
            draft = self.grammar.prune(draft)
            draft = self.grammar.extend_forced(draft, self.grammar.constraint.forced_per_leaf)
            if alone:  # the forced tokens were added unsized: the nodes that pay (a batch weighs all)
                draft = cut_to_paying(draft, proposer)
        # Tokens past max_new_tokens would be thrown away: don't draft them.
        budget = self.remaining
        draft = draft.truncated(budget - 1)
        if self.widest is not None:
            draft = draft.limited(self.widest - 1)
        if room is not None:
            draft = draft.limited(max(room - 1, 0))
        draft = verifier.prepare(draft)
        parents = None if draft.is_chain else [-1] + [p + 1 for p in draft.parents]
        block = [state.tokens[-1]] + draft.tokens
        return PlannedRound(
            drafting, proposed, draft, block, parents, len(session), tick, time.perf_counter(), timing
        )

    def settle(self, planned: PlannedRound, target_logits, pass_seconds: float, timed: bool = True) -> None:
        """The round's second half, given the target's logits over the planned block: verify,
        keep the accepted path, emit, tell the proposer. ``timed``: whether the pass is this
        request's alone (its seconds then teach the live T(n); a batch's pass is recorded
        once, by the batch)."""
        session, proposer, verifier, state, stats = (
            self.session, self.proposer, self.verifier, self.state, self.stats
        )  # fmt: skip
        output, draft, drafting, tick, tock = (
            self.tokens, planned.draft, planned.drafting, planned.tick, planned.tock
        )  # fmt: skip
        check_finite(target_logits, "target's verification pass")
        if self.grammar is not None:  # the constrained target: forbidden tokens at -inf, row by row
            target_logits = self.grammar.constrain(draft, target_logits)
        with plugin_code(verifier, "verify"):
            acceptance: Acceptance = verifier.verify(draft, target_logits, self.sampling, self.generator)
        state.committed_rows = [0] + [node + 1 for node in acceptance.path]
        session.keep(planned.block_start, state.committed_rows)
        state.hidden = session.hidden
        state.hidden_row = state.committed_rows[-1]
        verify_seconds = pass_seconds + (time.perf_counter() - tock - pass_seconds if timed else 0.0)
        settled = time.perf_counter()

        new, self.done = self.stop.cut(output, acceptance.tokens)
        output.extend(new)
        state.tokens.extend(new)
        if self.grammar is not None:
            self.grammar.advance(new)
        stats.target_passes += 1
        stats.proposed += len(draft)
        stats.accepted += acceptance.num_accepted
        stats.draft_sizes.append(len(draft))
        stats.emitted_per_round.append(len(new))
        if drafting:
            stats.drafted_rounds += 1
            stats.drafted_round_tokens += len(new)
        if drafting and (lead := lead_value(planned.proposed)) is not None:
            stats.lead_values.append(lead)
        stats.verify_time += verify_seconds
        stats.draft_time += tock - tick
        # timing starts when the first sizer reads T(n)
        timing = planned.timing
        if timed and self.timed and (timing := timing or self._pass_times()) is not None:
            timing.at_context(planned.block_start)  # (a sizer may have started the timing in this round)
            timing.record(len(planned.block), verify_seconds)
        if self.on_tokens:
            self.on_tokens(new)
        observe_seconds = 0.0
        if drafting and not self.done:
            observing = time.perf_counter()
            with plugin_code(proposer, "observe"):
                told = proposer_round(planned.proposed, draft, acceptance, tock - tick, verify_seconds)
                proposer.observe(state, told)  # type: ignore[union-attr]
            observe_seconds = time.perf_counter() - observing
            stats.observe_time += observe_seconds
            stats.draft_time += observe_seconds
        if drafting and self.gate is not None:
            self.gate.record(tock - tick + observe_seconds, verify_seconds, len(new), acceptance.num_accepted)
        stats.wall_time += (tock - tick) + verify_seconds + (time.perf_counter() - settled)

    def output(self) -> GenerationOutput:
        """The generated tokens and the stats, once done (the proposer is told it ended)."""
        if not self.done:
            raise RuntimeError("this request is not finished: step() it until done")
        if self.proposer is not None and not self.finished:
            start = time.perf_counter()
            with plugin_code(self.proposer, "finish"):
                self.proposer.finish(self.state)
            self.stats.wall_time += time.perf_counter() - start
        self.finished = True
        self.stats.new_tokens = len(self.tokens)
        if self.grammar is not None:
            self.stats.constraint_complete = self.grammar.complete
            self.stats.grammar_time = self.grammar.mask_seconds
            self.stats.grammar_masks = self.grammar.masks_computed
        return GenerationOutput(self.tokens, self.stats)
