"""Replay: pipelines over a bench run's recorded greedy outputs, timed by a given T(n).

Greedy speculative decoding emits exactly what standard greedy decoding emits, so once
a bench run has recorded standard decoding's output for every prompt, any proposer's
rounds on those prompts follow from its drafts alone: the target's verdict on a draft is
known before the target runs. :class:`ReplaySession` stands in for the target's session
in the real decode loop (:func:`specdec.decoders.engine.decoding.decode`, the real verifiers):

* a pass's logits are one-hot at the recorded next token on rows whose path follows
  the recorded output, zero elsewhere (rows no verifier reads: their parent was rejected);
* its final hidden states, which proposers such as the copy heads read, come from one
  teacher-forced pass of the target over prompt + output (up to floating-point order,
  what the incremental passes computed).

A request's time is then projected: the prefill standard decoding took in the run,
plus T(n + 1) for each round's draft of n tokens, read at the context the round ran
after where the curve timed longer contexts (a pass after 1,000 tokens costs more
than one after the curve's 256), plus the drafting time measured here; standard
decoding's, the prefill plus T(1) per further token, each at its context. With the run's own
curve the projection reproduces the bench's figures up to the machine's noise and the
verification's own overhead; with another machine's curve (``cost_curve=FILE``) it
projects them there, the prefill scaled by T(1)'s ratio. A replay takes seconds per
pipeline where a bench takes minutes, so sizing and drafting ideas can be compared
before they are measured; its figures are projections, and the tables say so.

:class:`AcceptedPathOnly` (``oracle=true``) wraps a proposer so that every draft is cut
to the path the recorded output accepts: the bound a sizing of its drafts can reach.

Proposers that draft with the target's inner layers (early exit's shallow layers,
EAGLE's features) need its real passes: :attr:`Proposer.reads_target_layers`, and a
replay skips them. Sampling is not replayed (its outputs are not fixed by the run).

The command line is :mod:`specdec.decoders.replay`; :func:`run_replay` is what it runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.decoders.cli.config import load_plugins, model_config
from specdec.decoders.engine.decoding import decode
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.request import StopConditions
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.contenders import build_pipelines
from specdec.decoders.evaluation.files import batch_run, read_results, write_json
from specdec.decoders.evaluation.metrics import Record, pipeline_entry
from specdec.decoders.evaluation.scheduling import turn_ids
from specdec.decoders.evaluation.workloads import load_workload, workload_config
from specdec.decoders.models.cost import CostCurve, read_cost_curve
from specdec.decoders.models.loading import load_model
from specdec.decoders.models.machine import machine_info
from specdec.decoders.models.session import tree_depths
from specdec.decoders.models.target import Target


@dataclass
class Reference:
    """What standard greedy decoding did on one prompt (one turn) of a run."""

    prompt_id: str
    category: str
    turn: int
    prompt_ids: list[int]
    tokens: list[int]  # its output
    prefill_time: float  # seconds its prefill took in the run
    hidden: torch.Tensor | None = None  # (len(prompt) + len(output), hidden) teacher-forced final states


class ReplaySession:
    """A target session that answers passes from a recorded output (see the module).

    It keeps what :class:`ModelSession` keeps for the decode loop (``cached``,
    ``hidden``, ``keep``, ``truncate``); ``target`` is the real target, for what the
    loop asks of it (exact mode's widest pass)."""

    def __init__(self, target: Target, reference: Reference) -> None:
        self.target = target
        model = self.model = target.model
        self.device = next(model.parameters()).device
        self.max_positions = None
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.sequence = reference.prompt_ids + reference.tokens
        self.reference_hidden = reference.hidden
        self.reset()

    def reset(self) -> None:
        self.cached: list[int] = []
        self.hidden: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.cached)

    def forward(
        self, tokens: list[int], parents: list[int] | None = None, last_only: bool = False, **_: object
    ) -> torch.Tensor:
        start = len(self.cached)
        if self.cached != self.sequence[:start]:
            raise RuntimeError(
                "the replayed cache left the recorded output: a verifier accepted a wrong token"
            )
        parents = list(range(-1, len(tokens) - 1)) if parents is None else parents  # a chain by default
        depths = tree_depths(parents)
        follows: list[bool] = []  # whether the row's path is the recorded output
        for token, parent, depth in zip(tokens, parents, depths):
            position = start + depth
            on_path = parent < 0 or follows[parent]
            follows.append(on_path and position < len(self.sequence) and self.sequence[position] == token)
        rows = [len(tokens) - 1] if last_only else range(len(tokens))
        logits = torch.zeros(len(rows), self.vocab_size, device=self.device)
        for row, i in enumerate(rows):
            position = start + depths[i] + 1
            if follows[i] and position < len(self.sequence):
                logits[row, self.sequence[position]] = 1.0
        if self.reference_hidden is not None:
            last = len(self.sequence) - 1
            positions = torch.tensor([min(start + depth, last) for depth in depths])
            kept = torch.tensor(follows, dtype=self.reference_hidden.dtype)[:, None]
            self.hidden = self.reference_hidden[positions] * kept  # rows off the output: zeros
        self.cached.extend(tokens)
        return logits

    def truncate(self, length: int) -> None:
        del self.cached[length:]

    def keep(self, start: int, kept: list[int]) -> None:
        block = self.cached[start:]
        self.cached[start:] = [block[i] for i in kept]


class AcceptedPathOnly(Proposer):
    """Sizing's oracle: the wrapped proposer's drafts cut to the path the recorded output
    accepts, so every round pays T(n + 1) only for the n tokens it gains. With the
    proposer's sizing on, its speedup bounds what sending less of its drafts could gain;
    with it off (every candidate sent), what a perfect choice among its candidates would
    reach. The wrapped proposer observes its rounds in its own numbering, the nodes cut
    away neither tried nor rejected."""

    name = "oracle"

    def __init__(self, inner: Proposer) -> None:
        super().__init__(inner.config, inner.context)
        self.inner = inner
        self.sequence: list[int] = []  # the recorded prompt + output of the request
        self._draft: Draft | None = None  # the inner proposer's last draft, whole

    def begin(self, state) -> None:
        self.inner.begin(state)

    def propose(self, state) -> Draft:
        self._draft = draft = self.inner.propose(state)
        path: list[int] = []
        row = 0  # the pending token's row of children, then each accepted node's
        while (position := len(state.tokens) + len(path)) < len(self.sequence):
            child = next((c for c in draft.children[row] if draft.tokens[c] == self.sequence[position]), None)
            if child is None:
                break
            path.append(child)
            row = child + 1
        return draft.select(path)

    def observe(self, state, round: Round) -> None:
        nodes = round.draft.nodes_in(self._draft)
        self.inner.observe(
            state,
            Round(
                self._draft,
                [nodes[i] for i in round.path],
                [nodes[i] for i in round.verified],
                round.tokens,
                round.draft_seconds,
                round.verify_seconds,
            ),
        )

    def finish(self, state) -> None:
        self.inner.finish(state)

    def describe(self) -> dict:
        return self.inner.describe()


def references_of(run: dict, base: Pipeline, cfg: DictConfig, hidden: bool) -> list[Reference]:
    """Standard decoding's first repeat of every prompt and turn of ``run`` (results.json),
    in the run's order, with the prompt ids rebuilt as the bench built them and (``hidden``)
    the target's teacher-forced final hidden states."""
    standard = next((p for p in run["pipelines"] if p["name"] == "standard"), None)
    if standard is None or not standard["records"]:
        raise ValueError(
            "the run has no standard decoding records to replay; run the bench to the end of a prompt"
        )
    prompts = {p.id: p for p in load_workload(workload_config(cfg))}
    answers: dict[str, str] = {}
    references = []
    session = base.target.session()
    for record in standard["records"]:
        if record["repeat"]:
            continue
        prompt = prompts.get(record["prompt_id"])
        if prompt is None:
            raise ValueError(
                f"prompt {record['prompt_id']!r} of the run is not in its workload any more; replay a run "
                "of the workload as it is now"
            )
        prompt_ids = turn_ids(base, prompt, record["turn"], answers.get(prompt.id))
        if record["turn"] == 0:
            answers[prompt.id] = record["text"]
        reference = Reference(
            prompt.id,
            record["category"],
            record["turn"],
            prompt_ids,
            record["tokens"],
            record["prefill_time"],
        )
        if hidden:
            session.reset()
            session.forward(prompt_ids + record["tokens"], last_only=True)
            reference.hidden = session.hidden
        references.append(reference)
    return references


def replay_pipeline(
    pipeline: Pipeline,
    references: list[Reference],
    curve: CostCurve,
    prefill_scale: float = 1.0,
    oracle: bool = False,
) -> list[Record]:
    """Every reference replayed through ``pipeline`` (its proposer and verifier), in order,
    as bench records whose times are projected (see the module); ``oracle``: with its
    drafts cut to what the target accepts (:class:`AcceptedPathOnly`)."""
    proposer = pipeline.proposer
    if proposer is not None and proposer.reads_target_layers:
        raise ValueError(
            f"proposer {proposer.name} drafts with the target's inner layers, which a replay does not "
            "run; measure it with python -m specdec.decoders.bench"
        )
    if pipeline.target.pass_times() is not None:
        raise RuntimeError(
            "the target follows a live cost curve, which the replay's instant passes would corrupt"
        )
    if oracle and proposer is not None:
        proposer = AcceptedPathOnly(proposer)
    greedy = SamplingConfig()
    stop = StopConditions(
        pipeline.max_new_tokens, pipeline.eos_token_ids(), pipeline.stop_strings, pipeline.tokenizer
    )
    records = []
    for reference in references:
        if isinstance(proposer, AcceptedPathOnly):
            proposer.sequence = reference.prompt_ids + reference.tokens
        session = ReplaySession(pipeline.target, reference)
        output = decode(session, reference.prompt_ids, stop, greedy, proposer, pipeline.verifier)  # type: ignore[arg-type]
        stats = output.stats
        records.append(
            projected_record(
                reference,
                curve,
                prefill_scale,
                output.tokens,
                stats.draft_sizes,
                stats.emitted_per_round,
                stats.proposed,
                stats.accepted,
                stats.draft_time,
                stats.observe_time,
            )
        )
    return records


def standard_records(
    references: list[Reference], curve: CostCurve, prefill_scale: float = 1.0
) -> list[Record]:
    """Standard decoding's records projected the same way: one T(1) pass per token after the first."""
    records = []
    for reference in references:
        passes = max(len(reference.tokens) - 1, 0)
        records.append(
            projected_record(reference, curve, prefill_scale, reference.tokens, [0] * passes, [1] * passes)
        )
    return records


def projected_record(
    reference: Reference,
    curve: CostCurve,
    prefill_scale: float,
    tokens: list[int],
    draft_sizes: list[int],
    emitted_per_round: list[int],
    proposed: int = 0,
    accepted: int = 0,
    draft_time: float = 0.0,
    observe_time: float = 0.0,
) -> Record:
    """A bench record of one replayed request: the recorded prefill (scaled), T(n + 1) for
    each round's draft of n tokens, and the drafting measured."""
    prefill = reference.prefill_time * prefill_scale
    verify = sum(
        curve.at(size + 1, context)
        for size, context in zip(draft_sizes, round_contexts(reference, emitted_per_round))
    )
    return Record(
        prompt_id=reference.prompt_id,
        category=reference.category,
        turn=reference.turn,
        repeat=0,
        new_tokens=len(tokens),
        wall_time=prefill + verify + draft_time,
        tokens=tokens,
        target_passes=len(draft_sizes),
        proposed=proposed,
        accepted=accepted,
        draft_time=draft_time,
        verify_time=verify,
        emitted_per_round=list(emitted_per_round),
        observe_time=observe_time,
        draft_sizes=list(draft_sizes),
        prefill_time=prefill,
    )


def round_contexts(reference: Reference, emitted_per_round: list[int]) -> list[int]:
    """The context each round's pass runs after: the prompt, the token its prefill gave,
    and what earlier rounds emitted."""
    contexts, length = [], len(reference.prompt_ids) + 1
    for emitted in emitted_per_round:
        contexts.append(length)
        length += emitted
    return contexts


def replayable(pipelines: list[Pipeline], report: bool = False) -> list[Pipeline]:
    """The pipelines a replay can run: not those whose proposer reads the target's inner layers."""
    kept = []
    for pipeline in pipelines:
        if pipeline.proposer is not None and pipeline.proposer.reads_target_layers:
            if report:
                print(
                    f"[replay] skipping {pipeline.name}: it drafts with the target's inner layers",
                    file=sys.stderr,
                )
        else:
            kept.append(pipeline)
    return kept


def run_replay(cfg: DictConfig) -> dict:
    """Replay ``cfg.run``'s recorded outputs through its pipelines (or ``cfg.pipelines``)."""
    run_dir = Path(cfg.run)
    results_file = run_dir / "results.json" if run_dir.is_dir() else run_dir
    if not results_file.exists():
        raise FileNotFoundError(f"no bench results at {results_file}; give run=outputs/bench/DATE_TIME")
    run = read_results(results_file, "give run=outputs/bench/DATE_TIME")
    if (batch := batch_run(run)) is not None:
        raise ValueError(
            f"{results_file} is a batch-mode run ({batch}): replay replays per-prompt runs only (their "
            "recorded rounds, one request at a time); give run= a bench run made without bench.batch_size"
        )
    if run.get("complete") is False:
        raise ValueError(
            f"{results_file} is partial ({run['prompts']} of {run.get('prompts_planned', '?')} prompts: the "
            "bench was interrupted); replay a finished run"
        )
    if run["temperature"] != 0.0:
        raise ValueError(
            f"the run sampled at temperature {run['temperature']}; only greedy runs can be replayed "
            "(their outputs are what every lossless pipeline emits)"
        )
    run_cfg = OmegaConf.create(run["config"])
    if cfg.pipelines:  # these instead of the run's, whether it listed pipelines or named one
        run_cfg.bench.pipelines = cfg.pipelines
        run_cfg.proposer = run_cfg.verifier = None
    run_cfg.plugins = list(run_cfg.get("plugins") or []) + list(cfg.plugins)
    load_plugins(run_cfg)
    run_curve = CostCurve.from_json(run["cost_curve"])
    curve = read_cost_curve(cfg.cost_curve) if cfg.cost_curve else run_curve
    prefill_scale = curve(1) / run_curve(1)

    target, tokenizer = load_model(model_config(run_cfg))
    base = Pipeline(
        target,
        tokenizer,
        model_config=model_config(run_cfg),
        artifacts_dir=run_cfg.artifacts_dir,
        max_new_tokens=run["max_new_tokens"],
        cost_curve=curve,
    )
    pipelines = replayable(build_pipelines(run_cfg, base), report=True)
    if not pipelines:
        raise ValueError("no pipeline of the run can be replayed; name some with pipelines=[...]")
    references = references_of(run, base, run_cfg, hidden=True)
    baseline = standard_records(references, curve, prefill_scale)
    entries = [pipeline_entry("standard", "standard", None, None, baseline, baseline, True)]
    entries[0]["records"] = [r.as_dict() for r in baseline]
    runs = [(pipeline, False) for pipeline in pipelines]
    if cfg.oracle:  # fresh proposers: what one replay leaves in a proposer's memory must not reach the other
        runs += [(pipeline, True) for pipeline in replayable(build_pipelines(run_cfg, base))]
    for pipeline, oracle in tqdm(runs, desc="pipelines"):
        records = replay_pipeline(pipeline, references, curve, prefill_scale, oracle)
        texts = [tokenizer.decode(r.tokens, skip_special_tokens=True) if tokenizer else None for r in records]
        records = [replace(r, text=text) for r, text in zip(records, texts)]
        name = f"{pipeline.name} (oracle)" if oracle else pipeline.name
        entry = pipeline_entry(
            name, "speculative", pipeline.proposer.name, pipeline.verifier.name, records, baseline, True
        )
        entry["info"] = pipeline.proposer.describe()
        entry["records"] = [r.as_dict() for r in records]
        entries.append(entry)
    for entry in entries:
        entry["ideal_speedup"] = entry["efficiency"] = None
    payload = {
        "projected": True,
        "run": str(results_file),
        "cost_curve_file": cfg.cost_curve,
        "oracle": bool(cfg.oracle),
        "model": run["model"],
        "dtype": run["dtype"],
        "device": run["device"],
        "machine": machine_info(base.session.device),
        "run_machine": run.get("machine"),
        "temperature": 0.0,
        "max_new_tokens": run["max_new_tokens"],
        "prompts": len({r.prompt_id for r in references}),
        "workload": run["workload"],
        "repeats": 1,
        "turns": run["turns"],
        "cost_curve": curve.as_json(),
        "pipelines": entries,
    }
    write_json(Path(cfg.output), payload)
    return payload
