"""Benchmark metrics, aggregated from per-prompt records (names fixed by DESIGN.md).

    tokens_per_s          sum of new tokens / sum of wall seconds (prefill included)
    speedup               tokens_per_s / standard decoding's, same run, interleaved
    mean_accepted_tokens  tau: tokens emitted per decode-phase target pass, bonus included
    acceptance_rate       accepted draft tokens / proposed draft tokens
    identical_outputs     share of prompts whose greedy output equals standard's

and the physical limit of a speculative pipeline, from the target's pass cost
curve T(n) (decoders/models/cost.py):

    ideal_speedup         tau * T(1) / (T(draft size + 1) + draft seconds), per round:
                          (P + E * T(1)) / (P + sum over rounds of T(n_r + 1) + D)
    efficiency            speedup / ideal_speedup
    speedup_same_lengths  the speedup had every request of a pipeline been as long as
                          standard decoding's: sum of standard's wall seconds / sum of
                          (P + decode seconds x standard's tokens / own tokens), prompt by
                          prompt. Equal to ``speedup`` when the outputs are as long (greedy);
                          at temperature > 0 each pipeline samples its own answers, and a
                          shorter one pays its prefill over fewer tokens, a noise that
                          swamps a category of two prompts. None for peers (no P measured).

(E: tokens emitted by the rounds, n_r: round r's draft size, D: drafting seconds,
P: prefill seconds, which both sides pay, as tokens_per_s counts them.)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class Record:
    """One contender on one prompt (one turn, one repeat)."""

    prompt_id: str
    category: str
    turn: int
    repeat: int
    new_tokens: int
    wall_time: float
    tokens: list[int]
    target_passes: int | None = None  # None for peers (not instrumented)
    proposed: int | None = None
    accepted: int | None = None
    draft_time: float | None = None  # the proposer's work, observe included
    verify_time: float | None = None
    emitted_per_round: list[int] = field(default_factory=list)
    text: str | None = None  # decoded output, when the model has a tokenizer
    observe_time: float | None = None  # of draft_time, the proposer's observe calls
    draft_sizes: list[int] = field(default_factory=list)  # per round: draft tokens verified
    prefill_time: float | None = None
    gated_rounds: int | None = None  # rounds the round gate kept plain (no drafting)
    # under a constraint: the output is a complete sentence of the grammar (False: it ran out of
    # max_new_tokens first; kept, marked incomplete), and whether it validates (decoders/evaluation/validity.py)
    constraint_complete: bool | None = None
    valid: bool | None = None
    grammar_time: float | None = None  # seconds llguidance spent on masks
    grammar_masks: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(records: list[Record]) -> dict:
    """tokens_per_s, tau and acceptance over a set of records (ratios of sums)."""
    new_tokens = sum(r.new_tokens for r in records)
    wall = sum(r.wall_time for r in records)
    instrumented = [r for r in records if r.target_passes is not None]
    tau = acceptance = draft_size = None
    if instrumented:
        emitted = sum(sum(r.emitted_per_round) for r in instrumented)
        passes = sum(r.target_passes or 0 for r in instrumented)
        proposed = sum(r.proposed or 0 for r in instrumented)
        tau = _ratio(emitted, passes)
        acceptance = _ratio(sum(r.accepted or 0 for r in instrumented), proposed)
        draft_size = _ratio(proposed, passes)  # draft tokens verified per target pass
    return {
        "tokens_per_s": _ratio(new_tokens, wall) or 0.0,
        "mean_accepted_tokens": tau,
        "acceptance_rate": acceptance,
        "mean_draft_size": draft_size,
        "new_tokens": new_tokens,
        "wall_time": wall,
    }


def pipeline_entry(
    name: str,
    kind: str,
    proposer: str | None,
    verifier: str | None,
    records: list[Record],
    baseline: list[Record],
    greedy: bool,
) -> dict:
    """One element of results.json's ``pipelines`` list."""
    overall = summarize(records)
    base = summarize(baseline)
    entry = {
        "name": name,
        "proposer": proposer,
        "verifier": verifier,
        "kind": kind,
        "tokens_per_s": overall["tokens_per_s"],
        "speedup": _ratio(overall["tokens_per_s"], base["tokens_per_s"]) or 0.0,
        "mean_accepted_tokens": overall["mean_accepted_tokens"],
        "acceptance_rate": overall["acceptance_rate"],
        "identical_outputs": identical_share(records, baseline) if greedy else None,
        "new_tokens": overall["new_tokens"],
        "wall_time": overall["wall_time"],
    }
    entry["speedup_same_lengths"] = same_length_speedup(records, baseline)
    entry.update(constraint_summary(records))
    entry.update(repeat_spread(records, baseline))
    categories = {
        category: compared(records, baseline, lambda c, category=category: c == category)
        for category in dict.fromkeys(r.category for r in records)
    }
    entry["categories"] = categories
    stages = sorted({category.partition("/")[2] for category in categories} - {""})
    if stages:  # categories "<family>/<stage>" (workload=agentic): each stage over every family
        entry["stages"] = {
            stage: compared(records, baseline, lambda c, stage=stage: c.endswith("/" + stage))
            for stage in stages
        }
    return entry


def constraint_summary(records: list[Record]) -> dict:
    """Under a constraint: the share of outputs that validate against it, the share that are
    complete (the rest ran out of max_new_tokens first), and llguidance's cost per mask.
    Empty for unconstrained records."""
    judged = [r for r in records if r.valid is not None]
    if not judged:
        return {}
    summary = {
        "valid_outputs": sum(bool(r.valid) for r in judged) / len(judged),
        "complete_outputs": sum(bool(r.constraint_complete) for r in judged) / len(judged),
    }
    timed = [r for r in judged if r.grammar_masks]
    if timed:
        masks = sum(r.grammar_masks or 0 for r in timed)
        summary["grammar_ms_per_mask"] = 1e3 * sum(r.grammar_time or 0.0 for r in timed) / masks
        summary["grammar_masks_per_token"] = masks / max(sum(r.new_tokens for r in timed), 1)
    return summary


def compared(records: list[Record], baseline: list[Record], keep: Callable[[str], bool]) -> dict:
    """tokens_per_s, speedup and tau over the records whose category ``keep`` accepts."""
    mine = summarize([r for r in records if keep(r.category)])
    theirs = summarize([r for r in baseline if keep(r.category)])
    return {
        "tokens_per_s": mine["tokens_per_s"],
        "speedup": _ratio(mine["tokens_per_s"], theirs["tokens_per_s"]) or 0.0,
        "speedup_same_lengths": same_length_speedup(
            [r for r in records if keep(r.category)], [r for r in baseline if keep(r.category)]
        ),
        "mean_accepted_tokens": mine["mean_accepted_tokens"],
        "acceptance_rate": mine["acceptance_rate"],
        "mean_draft_size": mine["mean_draft_size"],
    }


def same_length_speedup(records: list[Record], baseline: list[Record]) -> float | None:
    """Standard decoding's seconds over this pipeline's had its outputs been standard's
    length: each record's prefill plus its decode seconds scaled by standard's tokens over
    its own, matched by (prompt, turn, repeat). None without prefill times or a match."""
    base = {(r.prompt_id, r.turn, r.repeat): r for r in baseline}
    theirs = mine = 0.0
    for r in records:
        b = base.get((r.prompt_id, r.turn, r.repeat))
        if b is None or r.prefill_time is None or not r.new_tokens:
            return None
        theirs += b.wall_time
        mine += r.prefill_time + (r.wall_time - r.prefill_time) * b.new_tokens / r.new_tokens
    return _ratio(theirs, mine) if records else None


def repeat_spread(records: list[Record], baseline: list[Record]) -> dict:
    """Mean and sample standard deviation over repeats of tokens_per_s and speedup.

    Each repeat is one interleaved pass over the whole workload, so its speedup
    is a ratio of sums like the headline figure. Empty with a single repeat.
    """
    repeats = sorted({r.repeat for r in records})
    if len(repeats) < 2:
        return {}
    rates = [summarize([r for r in records if r.repeat == k])["tokens_per_s"] for k in repeats]
    base_rates = [summarize([r for r in baseline if r.repeat == k])["tokens_per_s"] for k in repeats]
    speedups = [rate / base if base else 0.0 for rate, base in zip(rates, base_rates)]
    return {
        "tokens_per_s_mean": statistics.mean(rates),
        "tokens_per_s_std": statistics.stdev(rates),
        "speedup_mean": statistics.mean(speedups),
        "speedup_std": statistics.stdev(speedups),
    }


def physical_limit(records: list[Record], pass_seconds: Callable[[float], float]) -> dict | None:
    """The speedup this pipeline's tau allows if only target passes and drafting cost time.

    pass_seconds: T(n), seconds of one target pass over n new tokens. Round r verifies
    the pending token plus its n_r draft tokens, so it costs T(n_r + 1) plus its share of
    the drafting time; standard decoding costs T(1) per token. Rounds are costed one by
    one where the records keep their draft sizes: T(mean size + 1) understates the cost
    of drafts whose size varies where T(n) bends upward. The prefill, which standard
    decoding and the pipeline both pay and ``speedup`` counts, is added to both sides.
    None for contenders without per-round counters (peers).
    """
    instrumented = [r for r in records if r.target_passes]
    passes = sum(r.target_passes or 0 for r in instrumented)
    if not passes:
        return None
    emitted = sum(sum(r.emitted_per_round) for r in instrumented)
    mean_draft_size = sum(r.proposed or 0 for r in instrumented) / passes
    draft_seconds = sum(r.draft_time or 0.0 for r in instrumented)
    prefill = sum(r.prefill_time or 0.0 for r in instrumented)
    rounds = sum(
        sum(pass_seconds(n + 1) for n in r.draft_sizes)
        if len(r.draft_sizes) == r.target_passes
        else r.target_passes * pass_seconds(mean_draft_size + 1)
        for r in instrumented
    )
    ideal = (prefill + emitted * pass_seconds(1)) / (prefill + rounds + draft_seconds)
    return {
        "ideal_speedup": ideal,
        "mean_draft_size": mean_draft_size,
        "draft_seconds_per_round": draft_seconds / passes,  # observe included
        "observe_seconds_per_round": sum(r.observe_time or 0.0 for r in instrumented) / passes,
    }


@dataclass
class Divergence:
    """Where a greedy pipeline first left standard decoding on one prompt."""

    prompt: str
    position: int  # index among the generated tokens
    standard_token: int | None  # None: that output had already ended
    pipeline_token: int | None
    logit_gap: float | None  # target logit of standard's token minus the pipeline's


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first token where ``tokens`` differs from ``reference`` (None if equal)."""
    for index, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def identical_share(records: list[Record], baseline: list[Record]) -> float | None:
    reference = {(r.prompt_id, r.turn, r.repeat): r.tokens for r in baseline}
    pairs = [(r.tokens, reference.get((r.prompt_id, r.turn, r.repeat))) for r in records]
    pairs = [(a, b) for a, b in pairs if b is not None]
    if not pairs:
        return None
    return sum(a == b for a, b in pairs) / len(pairs)


def control_entry(entries: list[dict]) -> dict | None:
    """The run's A/A twin (kind ``control``) among its pipeline entries, if it has one."""
    return next((e for e in entries if e["kind"] == "control"), None)
