"""The benchmark: pipelines against standard decoding (and HF peers), one process.

All contenders share one process and one loaded target. The target's pass cost
curve T(n) is taken first (cached per model/device/dtype), then every contender
warms up, then they run prompt by prompt (the order rotates from prompt to prompt
and repeat to repeat). On each prompt our pipelines, standard decoding included,
are interleaved round by round (``bench.interleave=rounds``, the default): each
has a KV cache of its own, and the one furthest behind (share of max_new_tokens
generated) runs the next round, so they cross the same seconds of the machine's
load together and slow drift (on a shared machine, a 64-token answer's pass times
vary by about 10% from one answer to the next) hits them alike. Each is timed on
its own calls only. transformers' peers, which cannot be stepped, run one prompt
at a time between them (``bench.interleave=prompts``: everything does).
``bench.aa=true`` adds standard decoding a second time, in step with the rest: its
speedup over the first, ``standard (A/A)``, is what the run's noise alone gives. Multi-turn prompts
(``workload.turns=2``) feed standard decoding's first answer back as the
assistant turn, so every contender sees the same second-turn context.

The command line is :mod:`decoders.bench`; :func:`run_benchmark` is what it runs.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decoders.cli.config import (
    component,
    constraint_config,
    load_plugins,
    model_config,
    sampling_config,
)
from decoders.engine.constraint import Constraint, ConstraintConfig
from decoders.engine.pipeline import GenerationResult, Pipeline
from decoders.evaluation.files import check_writable, write_json
from decoders.evaluation.metrics import (
    Record,
    control_entry,
    first_divergence,
    physical_limit,
    pipeline_entry,
)
from decoders.evaluation.peers import chosen_peers, make_peers
from decoders.evaluation.plots import bench_plots
from decoders.evaluation.tracking import log_benchmark
from decoders.evaluation.validity import output_valid
from decoders.evaluation.workloads import Prompt, load_workload, workload_config
from decoders.models.cost import CostCurve, cached_cost_curve, pass_times
from decoders.models.kernels import configure_passes, exact_passes, routes_narrow_linears
from decoders.models.loading import load_model
from decoders.models.machine import machine_info, machine_line

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


def in_step(steppings: list[Callable[[], Stepping]], seed: int = 0) -> list[Record]:
    """Start every request (their prefills in an order drawn from ``seed``), then run
    rounds: each time of the request furthest behind (share of its max_new_tokens
    generated), until all are done. Their records, in the order given.

    Requests tied at the same progress go in an order drawn at random (``seed``). A fixed
    tie order gave two equally paced requests fixed places: in the quickstart, standard
    decoding's rounds always followed its A/A twin's and the twin's followed the speculative
    pipelines' rounds (567 of 579 rounds), so whatever following another pipeline's pass
    costs (its weights and buffers in the caches instead of one's own) fell on one of them
    only. A tie order that alternates is no cure: a pipeline drafting 3 tokens a round meets
    the twins every 4th level, always in the same direction."""
    draw = random.Random(seed)
    order = list(range(len(steppings)))
    draw.shuffle(order)
    running: list[Stepping] = [None] * len(steppings)  # type: ignore[list-item]
    for index in order:
        running[index] = steppings[index]()
    while waiting := [s for s in running if not s.done]:
        low = min(s.progress for s in waiting)
        draw.choice([s for s in waiting if s.progress == low]).step()
    return [stepping.record() for stepping in running]


def run_prompt(
    contenders: list[Contender],
    prompt_ids: list[int],
    max_new_tokens: int,
    rounds: bool,
    seed: int = 0,
    constraint: Constraint | None = None,
) -> dict:
    """Every contender on one prompt (under ``constraint`` if given), in this order:
    {name: Record}. With ``rounds`` those that can be stepped run in step (:func:`in_step`,
    ``seed`` passed on), at the place of the first of them."""
    together = [c for c in contenders if c.start is not None] if rounds else []
    records: dict[str, Record] = {}
    for contender in contenders:
        if contender not in together:
            records[contender.name] = contender.run(prompt_ids, max_new_tokens, constraint)
        elif contender is together[0]:
            starts = [lambda c=c: c.start(prompt_ids, max_new_tokens, constraint) for c in together]
            records.update(zip((c.name for c in together), in_step(starts, seed)))
    return records


def exact_off_twin(contender: Contender, target) -> Contender:
    """``contender`` (built for this: its proposer's state is its own) run with exact
    mode switched off for its calls (``bench.exact_off``), measured against standard
    decoding with exact mode off."""
    narrow = routes_narrow_linears(target)

    def run(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Record:
        configure_passes(target, narrow, exact=False)
        try:
            return contender.run(prompt_ids, max_new_tokens, constraint)
        finally:
            configure_passes(target, narrow, exact=True)

    # not stepped: exact mode is switched for the whole model around its calls
    return replace(
        contender, name=f"{contender.name}{EXACT_OFF}", run=run, baseline=f"standard{EXACT_OFF}", start=None
    )


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


def peer_contender(peer) -> Contender:
    def run(prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None) -> Record:
        tokens, elapsed, complete = peer.run(prompt_ids, max_new_tokens, constraint)
        return Record("", "", 0, 0, len(tokens), elapsed, tokens, constraint_complete=complete)

    return Contender(peer.name, "peer", None, None, run)


def build_pipelines(cfg: DictConfig, base: Pipeline) -> list[Pipeline]:
    """The speculative pipelines this run measures: ``bench.pipelines`` if given,
    else ``proposer=``/``verifier=``, else ``bench.default_pipelines`` (the best
    pipeline of each proposer family; those whose trained artifact is missing are
    skipped with the command that trains it)."""
    proposer_cfg = component(cfg, "proposer")
    verifier_cfg = component(cfg, "verifier")
    node = cfg.bench.get("pipelines")
    listed = OmegaConf.to_container(node, resolve=True) if node else []
    if listed:
        if proposer_cfg is not None:
            raise ValueError("give either proposer=/verifier= or bench.pipelines=[...], not both")
        pipelines = [listed_pipeline(base, entry, verifier_cfg) for entry in listed]  # type: ignore[union-attr]
        return with_unique_names(pipelines, listed)  # type: ignore[arg-type]
    if proposer_cfg is not None:
        return [base.with_components(proposer_cfg, verifier_cfg)]
    defaults = OmegaConf.to_container(cfg.bench.default_pipelines, resolve=True) or []
    pipelines = []
    for entry in defaults:  # type: ignore[union-attr]
        try:
            pipelines.append(listed_pipeline(base, entry, verifier_cfg))
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
    """One ``bench.pipelines`` entry: ``"proposer+verifier"``, or a mapping with
    ``proposer`` (a name or ``{name: ..., option: value}``), ``verifier`` (same; default
    ``verifier=`` or the sampling's default), an optional ``label`` and an optional
    ``round_gate`` (true / false: this pipeline's, whatever ``round_gate=`` says)."""
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


def turn_ids(pipeline: Pipeline, prompt: Prompt, turn: int, first_answer: str | None) -> list[int]:
    """Token ids of one turn; the second turn carries the model's first answer.

    Built only once turn 0 has run, since ``first_answer`` is what standard
    decoding answered to it.
    """
    if turn == 0:
        return pipeline.encode(prompt.turns[0])
    if first_answer is None:
        raise RuntimeError(f"turn {turn} of prompt {prompt.id} needs standard decoding's first answer")
    messages = [
        {"role": "user", "content": prompt.turns[0]},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": prompt.turns[turn]},
    ]
    return pipeline.encode(messages)


def progress_labels(names: list[str], width: int = 16) -> dict[str, str]:
    """Short progress-bar labels, one per name: a long name keeps its start and its end
    (``draft_model_tree (ungated)`` -> ``draft_mo…ngated)``), and a name whose short label
    another already took keeps its whole self, so no two contenders share a label."""
    labels: dict[str, str] = {}
    for name in names:
        head = width // 2
        label = name if len(name) <= width else f"{name[:head]}…{name[len(name) - (width - head - 1) :]}"
        labels[name] = name if label in labels.values() else label
    return labels


def target_cost_curve(cfg: DictConfig, base: Pipeline, output: Path) -> CostCurve:
    """T(n) of the target, from the shared cache or (bench.cost_cache=false) measured
    afresh into the output directory. Called before any contender is timed."""
    cache = base.context.cost_cache_dir if cfg.bench.cost_cache else output.parent
    return cached_cost_curve(base.model, base.context.target_key, cache)


def exact_off_cost_curve(cfg: DictConfig, base: Pipeline, output: Path) -> CostCurve:
    """T(n) of the target with exact mode switched off (``bench.exact_off``)."""
    narrow = routes_narrow_linears(base.model)
    configure_passes(base.model, narrow, exact=False)
    try:
        return target_cost_curve(cfg, base, output)
    finally:
        configure_passes(base.model, narrow, exact=True)


def results_payload(
    cfg: DictConfig,
    base: Pipeline,
    contenders: list[Contender],
    records: dict[str, list[Record]],
    prompts_done: int,
    cost_curves: dict[str, CostCurve],
) -> dict:
    """results.json; ``cost_curves`` holds T(n) per baseline name (``standard``, and
    ``standard (exact off)`` with ``bench.exact_off``)."""
    sampling = base.sampling
    pipelines = []
    for contender in contenders:
        baseline = records[contender.baseline]
        reference = {(r.prompt_id, r.turn, r.repeat): r.tokens for r in baseline}
        cost_curve = cost_curves.get(contender.baseline, cost_curves["standard"])
        entry = pipeline_entry(
            contender.name,
            contender.kind,
            contender.proposer,
            contender.verifier,
            records[contender.name],
            baseline,
            sampling.greedy,
        )
        entry["ideal_speedup"] = entry["efficiency"] = None  # the physical limit, speculative pipelines only
        speculative = contender.kind == "speculative"
        limit = physical_limit(records[contender.name], cost_curve) if speculative else None
        if limit:
            entry.update(limit)  # ideal_speedup, mean_draft_size, draft/observe_seconds_per_round
            entry["efficiency"] = entry["speedup"] / limit["ideal_speedup"]
        entry["lossless"] = contender.lossless
        entry["baseline"] = contender.baseline
        if contender.describe is not None:
            entry["info"] = contender.describe()
        entry["records"] = []
        for record in records[contender.name]:
            row = record.as_dict()
            if sampling.greedy:  # where this output leaves standard greedy decoding's, if it does
                row["diverges_at"] = first_divergence(
                    record.tokens, reference[(record.prompt_id, record.turn, record.repeat)]
                )
            entry["records"].append(row)
        pipelines.append(entry)
    curves = {name: curve.as_json() for name, curve in cost_curves.items()}
    twin = control_entry(pipelines)
    aa = None
    if twin is not None:
        within = aa_within(twin["speedup"])
        aa = {"speedup": twin["speedup"], "tolerance": AA_TOLERANCE, "within_tolerance": within}
    return {
        "model": base.context.target_key,
        "dtype": str(base.session.dtype).removeprefix("torch."),
        "device": str(base.session.device),
        "exact": exact_passes(base.model),
        "machine": machine_info(base.session.device),
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "max_new_tokens": cfg.bench.max_new_tokens,
        "prompts": prompts_done,
        "workload": cfg.workload.name,
        "workload_path": cfg.workload.path,
        "repeats": cfg.bench.repeats,
        "turns": cfg.workload.turns,
        "cost_curve": curves["standard"],
        "cost_curve_exact_off": curves.get(f"standard{EXACT_OFF}"),
        "pass_times": timed.describe() if (timed := pass_times(base.model)) else None,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "aa": aa,  # the A/A twin overall: within ±AA_TOLERANCE, the run supports its figures
        "pipelines": pipelines,
    }


def run_benchmark(cfg: DictConfig) -> dict:
    check_writable(Path(cfg.bench.output), "bench.output")  # before anything slow
    for option in ("repeats", "max_new_tokens"):
        if int(cfg.bench[option]) < 1:
            raise ValueError(f"bench.{option}={cfg.bench[option]}: must be at least 1")
    load_plugins(cfg)
    model_cfg = model_config(cfg)
    sampling = sampling_config(cfg)
    target, tokenizer = load_model(model_cfg)
    base = Pipeline(
        target,
        tokenizer,
        sampling=sampling,
        model_config=model_cfg,
        artifacts_dir=cfg.artifacts_dir,
        max_new_tokens=cfg.bench.max_new_tokens,
        round_gate=bool(cfg.get("round_gate", False)),
    )
    interleave = cfg.bench.get("interleave", "rounds")
    if interleave not in ("rounds", "prompts"):
        raise ValueError(f"bench.interleave={interleave!r}: use rounds (the default) or prompts")
    pipelines = [base] + build_pipelines(cfg, base)
    contenders = [pipeline_contender(p) for p in pipelines]
    if cfg.bench.get("aa", False):  # standard decoding again, its own KV cache: the noise band
        twin = base.with_components(None, None)
        pipelines.append(twin)
        contenders.append(pipeline_contender(twin, AA, "control"))
    peer_setting = cfg.bench.peers
    if OmegaConf.is_list(peer_setting):
        peer_setting = OmegaConf.to_container(peer_setting)
    names = chosen_peers(peer_setting, list(cfg.bench.get("default_peers") or ["hf_generate"]))
    if names != []:
        proposers = {p.proposer.name: p.proposer for p in pipelines if p.proposer is not None}
        peers = make_peers(target, sorted(base.eos_token_ids()), sampling, proposers, names)
        contenders += [peer_contender(peer) for peer in peers]
    if cfg.bench.exact_off and exact_passes(target):
        twins = [base.with_components(None, None)] + build_pipelines(cfg, base)
        contenders += [exact_off_twin(pipeline_contender(p), target) for p in twins]
    prompts = load_workload(workload_config(cfg))
    output = Path(cfg.bench.output)
    max_new = cfg.bench.max_new_tokens
    print(
        f"[bench] {len(prompts)} prompts x {cfg.bench.repeats} repeat(s), max_new_tokens={max_new}, "
        f"contenders: {', '.join(c.name for c in contenders)}; device {base.session.device}, "
        f"dtype {base.session.dtype}\n[bench] machine: {machine_line(machine_info(base.session.device))}",
        file=sys.stderr,
    )
    cost_curves = {"standard": target_cost_curve(cfg, base, output)}
    if any(c.baseline != "standard" for c in contenders):
        cost_curves[f"standard{EXACT_OFF}"] = exact_off_cost_curve(cfg, base, output)

    constraints = prompt_constraints(cfg, base, prompts)  # compiled before anything runs
    warm_ids = base.encode(prompts[0].turns[0])
    for contender in tqdm(contenders, desc="warm-up", leave=False):
        for _ in range(max(cfg.bench.warmup, 0)):
            contender.run(warm_ids, min(max_new, 32), constraints[0][1] if constraints[0] else None)
    for pipeline in pipelines:  # the warm-up prompt must not sit in a proposer's memory
        if pipeline.proposer is not None:
            pipeline.proposer.forget()
        if pipeline.gate is not None:  # nor its cold first passes in a round gate's averages
            pipeline.gate.forget()

    records: dict[str, list[Record]] = {c.name: [] for c in contenders}
    first_answers: dict[str, str] = {}
    payload: dict[str, Any] = {}
    progress = tqdm(prompts, desc="prompts")
    try:
        for number, prompt in enumerate(progress):
            for turn in range(len(prompt.turns)):
                prompt_ids = turn_ids(base, prompt, turn, first_answers.get(prompt.id))
                for repeat in range(cfg.bench.repeats):
                    shift = (number + repeat) % len(contenders)
                    order = contenders[shift:] + contenders[:shift]
                    seed = (number * len(prompt.turns) + turn) * cfg.bench.repeats + repeat  # tie order
                    spec, constraint = constraints[number] or (None, None)
                    measured = run_prompt(
                        order, prompt_ids, max_new, interleave == "rounds", seed, constraint
                    )
                    for contender in order:
                        record = measured[contender.name]
                        text = (
                            tokenizer.decode(record.tokens, skip_special_tokens=True) if tokenizer else None
                        )
                        record = replace(
                            record,
                            prompt_id=prompt.id,
                            category=prompt.category,
                            turn=turn,
                            repeat=repeat,
                            text=text,
                            valid=None
                            if spec is None
                            else output_valid(text or "", record.tokens, spec, constraint),
                        )
                        records[contender.name].append(record)
                        if contender.name == "standard" and turn == 0 and repeat == 0 and text is not None:
                            first_answers[prompt.id] = text
            payload = results_payload(cfg, base, contenders, records, number + 1, cost_curves)
            payload["complete"] = number + 1 == len(prompts)  # false: an interrupted run's prompts so far
            payload["prompts_planned"] = len(prompts)
            write_json(output, payload)
            shown = [e for e in payload["pipelines"] if e["kind"] != "standard"]
            labels = progress_labels([e["name"] for e in shown])
            progress.set_postfix({labels[e["name"]]: f"{e['speedup']:.2f}x" for e in shown})
    except KeyboardInterrupt:
        done = payload.get("prompts", 0)
        kept = (
            f"results of the {done} finished prompt(s) are in {output}" if done else "no prompt had finished"
        )
        print(f"\n[bench] interrupted: {kept}", file=sys.stderr)
        raise
    return payload


def prompt_constraints(
    cfg: DictConfig, base: Pipeline, prompts: list[Prompt]
) -> list[tuple[ConstraintConfig, Constraint] | None]:
    """Each prompt's constraint, compiled: its own (the workload's ``constraint`` field), else
    the run's ``constraint.*``, else None. A schema that does not compile stops the run before
    anything is measured, naming the prompt."""
    shared = constraint_config(cfg)
    compiled: list[tuple[ConstraintConfig, Constraint] | None] = []
    for prompt in prompts:
        spec = shared
        if prompt.constraint is not None:
            options = {"forced_per_leaf": shared.forced_per_leaf} if shared is not None else {}
            try:
                spec = ConstraintConfig(**{**options, **prompt.constraint})
            except TypeError:
                raise ValueError(
                    f"prompt {prompt.id}: constraint {sorted(prompt.constraint)} is not one of "
                    "json_schema, regex, grammar"
                ) from None
        if spec is None:
            compiled.append(None)
            continue
        try:
            compiled.append((spec, base.constraint(spec)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"prompt {prompt.id}: {error}") from None
    return compiled


def format_table(payload: dict) -> str:
    """The results as a text table; ``±`` is the standard deviation of the speedup over
    repeats, ``ideal`` the physical limit and ``eff`` measured / ideal speedup."""
    header = (
        f"{'pipeline':<28} {'kind':<11} {'tok/s':>8} {'speedup':>8} {'±':>5} {'tau':>6} {'accept':>7} "
        f"{'same':>6} {'ideal':>6} {'eff':>5}"
    )
    title = (
        f"{payload['model']} ({payload['dtype']}, {payload['device']}), {payload['workload']}: "
        f"{payload['prompts']} prompts x {payload['turns']} turn(s) x {payload['repeats']} repeat(s), "
        f"temperature {payload['temperature']}, max_new_tokens {payload['max_new_tokens']}"
    )
    lines = [title]
    if "machine" in payload:
        lines.append(machine_line(payload["machine"]))
    lines += [header, "-" * len(header)]

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    for e in payload["pipelines"]:
        lines.append(
            f"{e['name']:<28} {e['kind']:<11} {e['tokens_per_s']:>8.2f} {e['speedup']:>7.2f}x "
            f"{fmt(e.get('speedup_std'), '5.2f'):>5} {fmt(e['mean_accepted_tokens'], '6.2f'):>6} "
            f"{fmt(e['acceptance_rate'], '7.3f'):>7} {fmt(e['identical_outputs'], '6.2f'):>6} "
            f"{fmt(e['ideal_speedup'], '5.2f') + ('x' if e['ideal_speedup'] else ''):>6} "
            f"{fmt(e['efficiency'], '5.2f'):>5}"
        )
    if payload["temperature"] > 0:  # sampled answers differ in length: metrics.same_length_speedup
        lines.append(
            "speedup had every answer been as long as standard decoding's (overall; lowest category):"
        )
        for e in payload["pipelines"]:
            same = e.get("speedup_same_lengths")
            if same is None or e["kind"] == "standard":
                continue
            by_category = {c: v.get("speedup_same_lengths") for c, v in e["categories"].items()}
            low = min(
                (c for c in by_category if by_category[c] is not None), key=by_category.get, default=None
            )
            lowest = f"; {low} {by_category[low]:.2f}x" if low else ""
            lines.append(f"  {e['name']:<26} {same:.2f}x{lowest}")
    constrained = [e for e in payload["pipelines"] if "valid_outputs" in e]
    if constrained:  # under a constraint: what validates, what ran out of tokens, llguidance's cost
        lines.append("constrained outputs (valid against the schema / complete within max_new_tokens):")
        for e in constrained:
            cost = e.get("grammar_ms_per_mask")
            grammar = (
                f"; grammar {cost:.3f} ms/mask, {e['grammar_masks_per_token']:.2f} masks/token"
                if cost
                else ""
            )
            lines.append(
                f"  {e['name']:<26} valid {e['valid_outputs']:.2f}  complete {e['complete_outputs']:.2f}{grammar}"
            )
    lines += slower_categories(payload)
    if verdict := aa_verdict(payload):
        lines.append(verdict)
    return "\n".join(lines)


AA_TOLERANCE = 0.03  # an A/A twin further than this from 1.0x overall: the run cannot support its figures


def aa_within(speedup: float) -> bool:
    """Whether an A/A twin's overall speedup is within ±AA_TOLERANCE of 1.0x."""
    return round(abs(speedup - 1.0), 6) <= AA_TOLERANCE


def aa_verdict(payload: dict) -> str | None:
    """One line on the A/A twin's overall speedup: within ±3% of 1.0x the run's figures
    stand on it; outside, a ``warning:`` that they cannot (standard decoding against itself,
    in step, moved that far by noise or bias alone). None without a twin."""
    twin = control_entry(payload["pipelines"])
    if twin is None or not twin.get("tokens_per_s"):
        return None
    speedup = twin["speedup"]
    if aa_within(speedup):
        return f"A/A twin {speedup:.3f}x overall: within ±{AA_TOLERANCE:.0%}, the run's noise band"
    return (
        f"warning: the A/A twin ran at {speedup:.3f}x overall, outside ±{AA_TOLERANCE:.0%}: standard "
        "decoding against itself moved that far, so this run cannot support differences of that size; "
        "run it again on a quieter machine or with bench.repeats=2"
    )


def slower_categories(payload: dict) -> list[str]:
    """Lines naming, per contender, the workload categories it ran slower than standard
    decoding in. With the A/A twin in the run, its farthest category from 1.0x sets the
    run's noise band, and a ``*`` marks a category below the band (slower by more than
    noise alone makes standard decoding against itself). No lines when there are no
    categories or none is below 1.0x."""
    entries = [e for e in payload["pipelines"] if e["kind"] != "standard" and e.get("categories")]
    twin = control_entry(entries)
    band = None  # as shown: figures are compared at the two decimals they are printed with
    if twin is not None:
        band = round(max(abs(1.0 - c["speedup"]) for c in twin["categories"].values()), 2)
    rows = []
    for e in entries:
        if e is twin:
            continue
        shown = {name: round(c["speedup"], 2) for name, c in e["categories"].items()}
        slower = sorted((speedup, name) for name, speedup in shown.items() if speedup < 1.0)
        if slower:
            marked = [
                f"{name} {speedup:.2f}x{'*' if band is not None and speedup < round(1.0 - band, 2) else ''}"
                for speedup, name in slower
            ]
            rows.append(f"  {e['name']:<26} {', '.join(marked)}")
    if not rows:
        return []
    title = "categories slower than standard decoding"
    if band is not None:
        title += f" (* below the A/A band, {1.0 - band:.2f}x to {1.0 + band:.2f}x):"
    return [title + ("" if band is not None else ":")] + rows


def publish(cfg: DictConfig, payload: dict) -> None:
    """After a finished run: the plots next to results.json, then the W&B run.

    results.json is already on disk, so a failing plot or W&B never loses results.
    """
    output = Path(cfg.bench.output)
    images = bench_plots(payload, output.parent) if cfg.bench.plots else []
    for image in images:
        print(f"[bench] wrote {image}", file=sys.stderr)
    log_benchmark(cfg, payload, images)
