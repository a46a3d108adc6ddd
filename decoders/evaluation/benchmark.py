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

The command line is :mod:`specdec.decoders.bench`; :func:`run_benchmark` is what it runs. Its
options: :mod:`specdec.decoders.evaluation.bench_config`; the contenders: :mod:`specdec.decoders.evaluation.contenders`;
how they run: :mod:`specdec.decoders.evaluation.scheduling`; results: :mod:`specdec.decoders.evaluation.bench_results`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from specdec.decoders.cli.config import (
    check_proposer_options,
    constraint_config,
    load_plugins,
    model_config,
    sampling_config,
)
from specdec.decoders.engine.constraint import Constraint
from specdec.decoders.engine.constraint_source import ConstraintConfig
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.evaluation.batching import arrival_times, run_batch_benchmark
from specdec.decoders.evaluation.bench_config import BenchConfig, bench_config
from specdec.decoders.evaluation.bench_results import results_payload
from specdec.decoders.evaluation.contenders import EXACT_OFF, Contender, contenders_for
from specdec.decoders.evaluation.files import check_writable, held_output
from specdec.decoders.evaluation.scheduling import measure, warm_up
from specdec.decoders.evaluation.workloads import Prompt, load_workload, workload_config
from specdec.decoders.models.cost import CostCurve, cached_cost_curve
from specdec.decoders.models.loading import load_model
from specdec.decoders.models.machine import machine_info, machine_line


def run_benchmark(cfg: DictConfig) -> dict:
    """The bench (``python -m specdec.decoders.bench``): the contenders, then the prompts in step,
    results.json written after every prompt. Returns the final payload."""
    bench = bench_config(cfg)
    check_writable(Path(bench.output), "bench.output")  # before anything slow
    # another bench given this file while this one runs is refused
    with held_output(Path(bench.output), "bench.output"):
        return _run_benchmark(cfg, bench)


def _run_benchmark(cfg: DictConfig, bench: BenchConfig) -> dict:
    load_plugins(cfg)
    check_proposer_options(cfg)
    prompts = load_workload(workload_config(cfg))  # a missing workload file: before the model loads
    arrival_times(bench.arrivals, len(prompts))  # and arrivals that do not fit them
    model_cfg = model_config(cfg)
    target, tokenizer = load_model(model_cfg)
    base = Pipeline(
        target, tokenizer, sampling=sampling_config(cfg), model_config=model_cfg,
        artifacts_dir=cfg.artifacts_dir, max_new_tokens=bench.max_new_tokens, round_gate=cfg.round_gate,
    )  # fmt: skip
    pipelines, contenders = contenders_for(cfg, bench, base)
    if bench.batch_sizes:  # batch mode: throughput and latency per batch size
        return run_batch_benchmark(bench, base, pipelines, prompts)
    announce(bench, base, prompts, contenders)
    cost_curves = baseline_cost_curves(bench, base, contenders)
    constraints = prompt_constraints(cfg, base, prompts)  # compiled before anything runs
    first = constraints[0][1] if constraints[0] else None
    warm_up(contenders, pipelines, base.encode(prompts[0].turns[0]), bench, first)

    def results(records: dict, done: int) -> dict:
        return results_payload(cfg, bench, base, contenders, records, done, cost_curves)

    return measure(prompts, contenders, base, bench, constraints, results)


def announce(bench: BenchConfig, base: Pipeline, prompts: list[Prompt], contenders: list[Contender]) -> None:
    print(
        f"[bench] {len(prompts)} prompts x {bench.repeats} repeat(s), max_new_tokens={bench.max_new_tokens}, "
        f"contenders: {', '.join(c.name for c in contenders)}; device {base.session.device}, "
        f"dtype {base.session.dtype}\n[bench] machine: {machine_line(machine_info(base.session.device))}",
        file=sys.stderr,
    )


def baseline_cost_curves(bench: BenchConfig, base: Pipeline, contenders: list[Contender]) -> dict:
    """T(n) per baseline (``standard``; ``standard (exact off)`` with exact-off twins), taken
    before any contender is timed."""
    output = Path(bench.output)
    curves = {"standard": target_cost_curve(bench, base, output)}
    if any(c.baseline != "standard" for c in contenders):
        curves[f"standard{EXACT_OFF}"] = exact_off_cost_curve(bench, base, output)
    return curves


def target_cost_curve(bench: BenchConfig, base: Pipeline, output: Path) -> CostCurve:
    """T(n) of the target, from the shared cache or (bench.cost_cache=false) measured
    afresh into the output directory. Called before any contender is timed."""
    if bench.cost_cache:  # the target's own: the sizers read the same curve (one measurement, kept)
        return base.target.cost_curve(base.context.target_key, base.context.cost_cache_dir)
    key = base.context.target_key + base.target.variant
    return cached_cost_curve(base.model, key, output.parent, exact=base.target.exact)


def exact_off_cost_curve(bench: BenchConfig, base: Pipeline, output: Path) -> CostCurve:
    """T(n) of the target with exact mode switched off (``bench.exact_off``)."""
    narrow = base.target.narrow
    base.target.configure(narrow, exact=False)
    try:
        return target_cost_curve(bench, base, output)
    finally:
        base.target.configure(narrow, exact=True)


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
