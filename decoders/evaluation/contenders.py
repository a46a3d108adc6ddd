"""The bench's contenders: everything it times on each prompt.

A contender is a pipeline (standard decoding, its A/A twin, a speculative pipeline, an
exact-off twin) or a transformers peer. ``bench.pipelines``, ``proposer=`` or
``bench.default_pipelines`` name the pipelines: a proposer's name or preset label
(:class:`specdec.decoders.engine.proposer.Preset`), a ``proposer+verifier`` string, or a mapping.
:func:`contenders_for` builds them all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from specdec.decoders.cli.config import component
from specdec.decoders.engine.constraint import Constraint
from specdec.decoders.engine.pipeline import GenerationResult, Pipeline
from specdec.decoders.engine.registry import find_preset
from specdec.decoders.evaluation.bench_config import BenchConfig, bench_config
from specdec.decoders.evaluation.metrics import (
    Record,
)
from specdec.decoders.evaluation.peers import chosen_peers, make_peers
from specdec.decoders.models.target import Target

EXACT_OFF = " (exact off)"


AA = "standard (A/A)"  # bench.aa: standard decoding measured against itself


@dataclass
class Contender:
    """Something the benchmark times on each prompt."""

    name: str
    kind: str  # standard | speculative | peer
    proposer: str | None
    verifier: str | None
    run: Callable[[list[int], int, Constraint | None], Record]  # (prompt ids, max_new_tokens, constraint)
    lossless: bool = True
    # what the pipeline reports about itself, asked when results are written (after the
    # prompts run), so it holds what the proposer measured: acceptance profiles, budgets
    describe: Callable[[], dict] | None = None
    baseline: str = "standard"  # the contender its speedup and identical_outputs are measured against
    # the request started, to be decoded a round at a time (None: run() only)
    start: Callable[[list[int], int, Constraint | None], Stepping] | None = None


class Stepping:
    """One pipeline's request decoded a round at a time, alongside others'."""

    def __init__(
        self, pipeline: Pipeline, prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None
    ) -> None:
        self.pipeline = pipeline
        self.decoding = pipeline.start(prompt_ids, max_new_tokens, constraint=constraint)

    @property
    def done(self) -> bool:
        return self.decoding.done

    @property
    def progress(self) -> float:
        return self.decoding.progress

    def step(self) -> None:
        self.decoding.step()

    def record(self) -> Record:
        return generation_record(self.pipeline.result(self.decoding))


def generation_record(result: GenerationResult) -> Record:
    """A pipeline's result as a benchmark record (prompt, category, turn, repeat filled later)."""
    s = result.stats
    return Record(
        "", "", 0, 0, s.new_tokens, s.wall_time, result.tokens,
        s.target_passes, s.proposed, s.accepted, s.draft_time, s.verify_time, s.emitted_per_round,
        observe_time=s.observe_time, draft_sizes=s.draft_sizes, prefill_time=s.prefill_time,
        gated_rounds=s.gated_rounds, constraint_complete=s.constraint_complete,
        grammar_time=s.grammar_time if s.constraint_complete is not None else None,
        grammar_masks=s.grammar_masks if s.constraint_complete is not None else None,
    )  # fmt: skip


def pipeline_contender(pipeline: Pipeline, name: str = "standard", kind: str = "standard") -> Contender:
    """A pipeline as a contender; without a proposer it is standard decoding under
    ``name`` and ``kind`` (``control`` for the A/A twin)."""

    def run(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Record:
        return generation_record(pipeline.generate(prompt_ids, max_new_tokens, constraint=constraint))

    def start(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Stepping:
        return Stepping(pipeline, prompt_ids, max_new_tokens, constraint)

    if pipeline.proposer is None:
        return Contender(name, kind, None, None, run, start=start)
    return Contender(
        pipeline.name,
        "speculative",
        pipeline.proposer.name,
        pipeline.verifier.name,  # type: ignore[union-attr]
        run,
        pipeline.verifier.lossless,  # type: ignore[union-attr]
        lambda: {
            "proposer": pipeline.proposer.describe(),
            "proposer_config": vars(pipeline.proposer.config),
            "round_gate": pipeline.gate.describe() if pipeline.gate is not None else None,
        },
        start=start,
    )


def peer_contender(peer, target: Target | None = None) -> Contender:
    """A peer as a contender; a ``plain`` peer runs with ``target``'s routes off for its calls."""

    def run(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Record:
        if peer.plain and target is not None:
            with target.as_built():
                tokens, elapsed, complete = peer.run(prompt_ids, max_new_tokens, constraint)
        else:
            tokens, elapsed, complete = peer.run(prompt_ids, max_new_tokens, constraint)
        counts = peer.rounds.record_fields() if peer.rounds is not None else {}
        return Record("", "", 0, 0, len(tokens), elapsed, tokens, constraint_complete=complete, **counts)

    # not stepped: a plain peer switches the whole model's routes around its calls
    return Contender(peer.name, "peer", None, None, run)


def exact_off_twin(contender: Contender, target: Target) -> Contender:
    """``contender`` (built for this: its proposer's state is its own) run with exact
    mode switched off for its calls (``bench.exact_off``), measured against standard
    decoding with exact mode off."""
    narrow = target.narrow

    def run(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Record:
        target.configure(narrow, exact=False)
        try:
            return contender.run(prompt_ids, max_new_tokens, constraint)
        finally:
            target.configure(narrow, exact=True)

    # not stepped: exact mode is switched for the whole model around its calls
    return replace(
        contender, name=f"{contender.name}{EXACT_OFF}", run=run, baseline=f"standard{EXACT_OFF}", start=None
    )


def build_pipelines(cfg: DictConfig, base: Pipeline) -> list[Pipeline]:
    """The speculative pipelines this run measures: ``bench.pipelines`` if given,
    else ``proposer=``/``verifier=``, else ``bench.default_pipelines`` (the best
    pipeline of each proposer family) and ``bench.extra_pipelines``; those whose trained
    artifact is missing are skipped with the command that trains it."""
    proposer_cfg = component(cfg, "proposer")
    verifier_cfg = component(cfg, "verifier")
    bench = bench_config(cfg)
    listed = bench.pipelines
    if listed:
        if proposer_cfg is not None:
            raise ValueError("give either proposer=/verifier= or bench.pipelines=[...], not both")
        pipelines = [listed_pipeline(base, entry, verifier_cfg) for entry in listed]  # type: ignore[union-attr]
        return with_unique_names(pipelines, listed)  # type: ignore[arg-type]
    if proposer_cfg is not None:
        return [base.with_components(proposer_cfg, verifier_cfg)]
    defaults = [*bench.default_pipelines, *bench.extra_pipelines]
    pipelines = []
    for entry in defaults:  # type: ignore[union-attr]
        try:
            pipelines.append(pipeline := listed_pipeline(base, entry, verifier_cfg))
            if isinstance(entry, str) and "+" not in entry:  # a proposer's name: its results' label
                pipeline.label = entry
        except FileNotFoundError as missing:  # a trained artifact is missing: say how to make it
            print(f"[bench] skipping {entry_label(entry)}: {missing}", file=sys.stderr)
    return pipelines


def entry_label(entry: Any) -> str:
    """A ``bench.pipelines`` entry's name for messages: its label, else its proposer."""
    if isinstance(entry, dict):
        proposer = entry.get("proposer")
        return entry.get("label") or (proposer.get("name") if isinstance(proposer, dict) else str(proposer))
    return str(entry)


def listed_pipeline(base: Pipeline, entry: Any, verifier_cfg: dict | None) -> Pipeline:
    """One ``bench.pipelines`` entry: a proposer's preset label (``copy_heads_chain``,
    :class:`specdec.decoders.engine.proposer.Preset`) or name, alone or as ``{preset: LABEL}`` with
    a ``label`` or ``round_gate`` of its own; ``"proposer+verifier"``; or a mapping with
    ``proposer`` (a name or ``{name: ..., option: value}``), ``verifier`` (same; default
    ``verifier=`` or the sampling's default), an optional ``label`` and an optional
    ``round_gate`` (true / false: this pipeline's, whatever ``round_gate=`` says)."""
    if isinstance(entry, str) and find_preset(entry) is not None:
        entry = {"preset": entry}
    if isinstance(entry, dict) and "preset" in entry:  # a proposer's named variant, maybe relabelled
        found = find_preset(entry["preset"]) or (entry["preset"], None)
        name, preset = found
        options = dict(preset.options) if preset is not None else {}
        verifier = preset.verifier if preset is not None else None
        entry = {"proposer": {"name": name, **options}, "verifier": verifier, "label": entry["preset"]} | {
            k: v for k, v in entry.items() if k != "preset"
        }
    if isinstance(entry, str):
        proposer, _, verifier = entry.partition("+")
        entry = {"proposer": proposer, "verifier": verifier or None}
    if not isinstance(entry, dict) or "proposer" not in entry:
        raise ValueError(
            f"bench.pipelines entry {entry!r}: use 'proposer+verifier' or "
            "{proposer: NAME_OR_{name: NAME, OPTION: VALUE}, verifier: NAME, label: TEXT}"
        )
    pipeline = base.with_components(
        entry["proposer"], entry.get("verifier") or verifier_cfg, round_gate=entry.get("round_gate")
    )
    pipeline.label = entry.get("label")
    return pipeline


def with_unique_names(pipelines: list[Pipeline], entries: list[Any]) -> list[Pipeline]:
    """Results are kept by pipeline name, so two pipelines may not share one. Unlabelled
    entries whose default names ("proposer+verifier") collide are named after their
    proposer options instead, e.g. ``suffix(k=16)+tree``; a collision left after that is an error."""
    names = [p.name for p in pipelines]
    for pipeline, entry in zip(pipelines, entries):
        proposer = entry.get("proposer") if isinstance(entry, dict) else None
        if names.count(pipeline.name) > 1 and not pipeline.label and isinstance(proposer, dict):
            options = ",".join(f"{k}={v}" for k, v in proposer.items() if k != "name")
            if options:
                pipeline.label = f"{proposer['name']}({options})+{pipeline.verifier.name}"
    names = [p.name for p in pipelines]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(
                f"bench.pipelines has {names.count(name)} entries named {name!r}; give each a label "
                "({proposer: ..., verifier: ..., label: NAME}) so their results stay apart"
            )
    return pipelines


def contenders_for(
    cfg: DictConfig, bench: BenchConfig, base: Pipeline
) -> tuple[list[Pipeline], list[Contender]]:
    """Every pipeline this run builds (standard decoding first) and every contender it times:
    the pipelines, the A/A twin (``bench.aa``), the peers (``bench.peers``) and the exact-off
    twins (``bench.exact_off``)."""
    pipelines = [base] + build_pipelines(cfg, base)
    contenders = [pipeline_contender(p) for p in pipelines]
    if bench.aa:  # standard decoding again, its own KV cache: the noise band
        twin = base.with_components(None, None)
        pipelines.append(twin)
        contenders.append(pipeline_contender(twin, AA, "control"))
    names = chosen_peers(bench.peers, bench.default_peers or ["hf_generate"])
    if names != []:
        proposers = {p.proposer.name: p.proposer for p in pipelines if p.proposer is not None}
        peers = make_peers(
            base.model,
            sorted(base.eos_token_ids()),
            base.sampling,
            proposers,
            names,
            bench.prompt_lookup_tokens,
        )
        contenders += [peer_contender(peer, base.target) for peer in peers]
    if bench.exact_off and base.target.exact:
        twins = [base.with_components(None, None)] + build_pipelines(cfg, base)
        contenders += [exact_off_twin(pipeline_contender(p), base.target) for p in twins]
    return pipelines, contenders
