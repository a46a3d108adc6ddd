"""The bench's results: results.json's payload, the table printed, the A/A verdict, and
the plots and W&B run published after a finished run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.evaluation.bench_config import BenchConfig, bench_config
from specdec.decoders.evaluation.contenders import EXACT_OFF, Contender
from specdec.decoders.evaluation.metrics import (
    Record,
    control_entry,
    first_divergence,
    physical_limit,
    pipeline_entry,
)
from specdec.decoders.evaluation.plots import bench_plots
from specdec.decoders.evaluation.tracking import log_benchmark
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.machine import (
    machine_info,
    machine_line,
    memory_limit,
    memory_limit_line,
    read_bandwidth,
    weight_bytes,
)


def results_payload(
    cfg: DictConfig,
    bench: BenchConfig,
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
        "exact": base.target.exact,
        "machine": machine_info(base.session.device),
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "max_new_tokens": bench.max_new_tokens,
        "prompts": prompts_done,
        "workload": cfg.workload.name,
        "workload_path": cfg.workload.path,
        "repeats": bench.repeats,
        "turns": cfg.workload.turns,
        "cost_curve": curves["standard"],
        "cost_curve_exact_off": curves.get(f"standard{EXACT_OFF}"),
        "pass_times": timed.describe() if (timed := base.target.pass_times()) else None,
        "memory_limit": bench_memory_limit(base.target, timed),
        "compile": base.target.compile_stats.record() if base.target.compile_stats.loaded else None,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "aa": aa,  # the A/A twin overall: within ±AA_TOLERANCE, the run supports its figures
        "pipelines": pipelines,
    }


def bench_memory_limit(target, timed) -> dict | None:
    """On a CPU: the target's weights, the read bandwidth measured now, and standard decoding's
    single-token pass (the live median, every pipeline's width-1 passes pooled) against the floor
    they set; None on other devices."""
    if target.device.type != "cpu":
        return None
    single = timed.measured().get(1) if timed is not None else None
    return memory_limit(weight_bytes(target.model), read_bandwidth(), single)


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
    if payload.get("memory_limit"):
        lines.append(memory_limit_line(payload["memory_limit"]))
    if compiled := payload.get("compile"):
        lines.append(
            f"compiled: {compiled['graphs']} graphs in {compiled['seconds']} s at load (outside the requests' "
            f"stats), {compiled['during_run']} more while decoding"
        )
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
    lines += category_drafts(payload)
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


def category_drafts(payload: dict) -> list[str]:
    """Per workload category, each contender's tok/s and, for those that draft (our pipelines,
    and transformers' assisted peers, whose rounds are counted), its mean draft length (draft
    tokens per target pass) and the share of drafted tokens accepted: "tok/s length/acceptance".
    No lines for a run of one category."""
    entries = [e for e in payload["pipelines"] if e.get("categories") and e["kind"] != "control"]
    categories = list(dict.fromkeys(c for e in entries for c in e["categories"]))
    if len(categories) < 2:
        return []

    def cell(figures: dict | None) -> str:
        if not figures:
            return "-"
        text = f"{figures['tokens_per_s']:.1f}"
        if figures.get("mean_draft_size") is not None and figures.get("acceptance_rate") is not None:
            text += f" {figures['mean_draft_size']:.1f}/{figures['acceptance_rate']:.2f}"
        return text

    width = max(14, *(len(e["name"]) for e in entries))
    lines = ["per category: tok/s, and draft tokens per pass / their acceptance where counted:"]
    lines.append(f"  {'category':<16}" + "".join(f" {e['name'][:width]:>{width}}" for e in entries))
    for category in categories:
        row = "".join(f" {cell(e['categories'].get(category)):>{width}}" for e in entries)
        lines.append(f"  {category:<16}{row}")
    return lines


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
    bench = bench_config(cfg)
    output = Path(bench.output)
    images = bench_plots(payload, output.parent) if bench.plots else []
    for image in images:
        print(f"[bench] wrote {image}", file=sys.stderr)
    log_benchmark(cfg, payload, images)
