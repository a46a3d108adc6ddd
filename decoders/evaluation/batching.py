"""The bench's batch mode (``bench.batch_size=[1,2,4,8,16]``): throughput and latency of
batched decoding, per batch size, against batched standard decoding and ``hf_generate``
batched with padding.

Every pipeline decodes the workload's prompts with :meth:`Pipeline.generate_batch`, at most
``size`` requests at once, each joining as another finishes (``bench.arrivals``: all at the
start by default; a rate in requests per second, seeded exponential gaps; or a list of
seconds). transformers' ``generate`` has no continuous batching: it decodes the prompts in
groups of ``size``, left-padded, a group after the previous one (all arrived at the start).
At each size the contenders take turns (the order rotating from run to run) after one
warm-up batch each, ``bench.repeats`` runs each, and more, up to ``bench.batch_repeats``, while
the A/A twin is outside its ±3% band: every contender runs once per run, so each added run
averages the machine's drift into every comparison alike (:func:`measure_size`). A size larger
than the workload's prompts is measured, and labelled, as the batch they fill; a row reports total new tokens per second, the speedup over batched
standard decoding at that size, per-request latency (median, p90: arrival to last token),
the draft tokens per request per pass, ``plain``: the share of passes the batch gate kept
plain (:mod:`specdec.decoders.sizing.batch_gate`), and ``same``: the share of requests whose output is
decoding it alone with standard decoding (greedy). With ``bench.aa`` (the default), batched
standard decoding runs twice, in turn with the rest: the twin's speedup at each size is the
noise band of that size's figures.
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.decoders.engine.files import write_json
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.evaluation.batch_estimates import estimate_lines, lead_quantiles, stop_estimates
from specdec.decoders.evaluation.bench_config import BenchConfig
from specdec.decoders.evaluation.bench_results import AA_TOLERANCE, aa_within
from specdec.decoders.evaluation.contenders import AA
from specdec.decoders.models.machine import machine_info, machine_line

STANDARD = "standard"
HF = "hf_generate"


@dataclass
class BatchRun:
    """One contender's run of the workload at one batch size."""

    tokens: list[list[int]]  # per request, in prompt order
    seconds: float  # wall time, first arrival to last token
    latencies: list[float]  # per request: arrival to last token
    drafted_per_request: float  # draft tokens per request per pass (0 without drafts)
    accepted_per_request: float = 0.0  # draft tokens accepted per request per pass
    plain_share: float = 0.0  # passes the batch gate kept plain, over all passes
    # of the requests' drafted rounds, the share whose first draft token was accepted
    first_accepted: float = 0.0
    # per drafted round with valued proposals, over all requests: its likeliest first token's value
    lead_values: list[float] = field(default_factory=list)


def arrival_times(setting: Any, count: int, seed: int = 0) -> list[float] | None:
    """``bench.arrivals``: None (all at the start), a rate (requests per second: seeded
    exponential gaps) or a list of ``count`` seconds."""
    if setting is None:
        return None
    if _is_number(setting):
        if setting <= 0:
            raise ValueError(f"bench.arrivals={setting}: a rate must be > 0 requests per second")
        rng, now, times = random.Random(seed), 0.0, []
        for _ in range(count):
            times.append(now)
            now += rng.expovariate(float(setting))
        return times
    if not isinstance(setting, list | tuple) or not all(_is_number(t) and t >= 0 for t in setting):
        raise ValueError(  # a string reached float() a character at a time
            f"bench.arrivals={setting}: neither a rate nor a list of seconds; give a rate in requests per "
            "second (bench.arrivals=2.0), each prompt's arrival in seconds (bench.arrivals=[0,0.5,1.2]), "
            "or null (all at the start)"
        )
    times = [float(t) for t in setting]
    if len(times) != count:
        raise ValueError(f"bench.arrivals lists {len(times)} times for {count} prompts; give one per prompt")
    return times


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


Runner = Callable[[list, int, Any], BatchRun]  # (prompts, batch size, arrival times or None)


def pipeline_runner(pipeline: Pipeline, max_new_tokens: int) -> Runner:
    def run(prompts: list[list[int]], size: int, arrivals=None) -> BatchRun:
        if pipeline.proposer is not None:  # every run starts alike: no memory of the runs before
            pipeline.proposer.forget()
        if pipeline.batch_gate is not None:
            pipeline.batch_gate.forget()
        batch = pipeline.generate_batch(prompts, max_new_tokens, batch_size=size, arrivals=arrivals)
        stats = batch.stats
        request_passes = max(sum(stats.active), 1)
        drafted = sum(stats.drafted) / request_passes
        accepted = sum(r.stats.accepted for r in batch.results) / request_passes
        plain = stats.plain_rounds / max(stats.rounds, 1)
        rounds = [
            emitted > 1
            for r in batch.results
            for size, emitted in zip(r.stats.draft_sizes, r.stats.emitted_per_round)
            if size
        ]
        first = sum(rounds) / len(rounds) if rounds else 0.0
        leads = [value for r in batch.results for value in r.stats.lead_values]
        return BatchRun(
            [r.tokens for r in batch.results],
            stats.wall_time,
            stats.latencies,
            drafted,
            accepted,
            plain,
            first,
            leads,
        )

    return run


def hf_runner(model: torch.nn.Module, eos: list[int], max_new_tokens: int) -> Runner:
    """``model.generate``, greedy, the prompts in left-padded groups of ``size``."""
    pad = eos[0] if eos else 0
    device = next(model.parameters()).device

    @torch.inference_mode()
    def run(prompts: list[list[int]], size: int, arrivals=None) -> BatchRun:
        tokens: list[list[int]] = []
        latencies: list[float] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), size):
            group = prompts[first : first + size]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                temperature=None, top_k=None, top_p=None, eos_token_id=eos or None, pad_token_id=pad,
            )  # fmt: skip
            for row in out[:, width:].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                tokens.append(row[:end])
            done = time.perf_counter() - start
            latencies += [done] * len(group)
        return BatchRun(tokens, time.perf_counter() - start, latencies, 0.0)

    return run


def run_batch_benchmark(bench: BenchConfig, base: Pipeline, pipelines: list[Pipeline], prompts: list) -> dict:
    """Every batchable pipeline, batched standard decoding and (``bench.peers``) batched
    ``hf_generate`` at each of ``bench.batch_size``'s sizes; results.json written after each size."""
    sizes = reached_sizes(bench.batch_sizes, len(prompts))
    ids = [base.encode(prompt.turns[0]) for prompt in prompts]
    arrivals = arrival_times(bench.arrivals, len(ids))
    runners: dict[str, Runner] = {STANDARD: pipeline_runner(base, bench.max_new_tokens)}
    for pipeline in pipelines[1:]:
        if pipeline.proposer is None:  # the A/A twin (bench.aa): standard decoding again, apart
            runners[AA] = pipeline_runner(pipeline, bench.max_new_tokens)
            continue
        name = pipeline.name
        if (reason := pipeline.proposer.batch_refusal if pipeline.proposer else None) is not None:
            print(f"[bench] skipping {name} in batches: {reason}", file=sys.stderr)
            continue
        runners[name] = pipeline_runner(pipeline, bench.max_new_tokens)
    if bench.peers and arrivals is None:  # generate has no continuous batching: static groups only
        runners[HF] = hf_runner(base.model, sorted(base.eos_token_ids()), bench.max_new_tokens)
    # the cost model: one request's passes (the cached T(n), not the live times: those learn the
    # packed passes of this run, which cost more than one request's pass of as many rows)
    cost_model = base.context.fixed_cost_curve or base.target.cost_curve(
        base.context.target_key, base.context.cost_cache_dir
    )
    reference = runners[STANDARD](ids, 1).tokens  # each alone
    for runner in runners.values():  # warm-up: one small batch each
        runner(ids[:2], 2)
    rows: list[dict] = []
    payload = {
        "mode": "batch",
        "model": base.context.model_config.name,
        "dtype": str(base.session.dtype).removeprefix("torch."),
        "machine": machine_info(base.session.device),
        "prompts": len(ids),
        "max_new_tokens": bench.max_new_tokens,
        "batch_sizes": sizes,  # those the prompts fill: bench.batch_size's, each cut to the prompts
        "batch_sizes_asked": bench.batch_sizes,
        "arrivals": bench.arrivals,
        "repeats": bench.repeats,
        "batch_repeats": bench.batch_repeats,
        "rows": rows,
    }
    names = list(runners)
    progress = tqdm(total=len(sizes) * bench.repeats * len(names), desc="batches", file=sys.stderr)

    def run_once(name: str, size: int) -> BatchRun:
        if progress.n >= progress.total:  # a run past bench.repeats: the twin was outside its band
            progress.total += 1
        progress.update()
        return runners[name](ids, size, arrivals)

    for size in sizes:
        runs = measure_size(functools.partial(run_once, size=size), names, bench.repeats, bench.batch_repeats)
        rows += size_rows(size, runs, reference)
        payload["stop_estimates"] = stop_estimates(
            rows, cost_model, max(sizes), base.target.widest_exact_pass
        )
        write_json(Path(bench.output), payload)
    progress.close()
    return payload


def reached_sizes(sizes: list[int], prompts: int) -> list[int]:
    """The batch sizes ``prompts`` requests fill: each of ``sizes`` cut to ``prompts`` (a batch
    of 64 over 6 prompts never holds more than 6, and was labelled 64), once each; a cut is said."""
    reached = list(dict.fromkeys(min(size, prompts) for size in sizes))
    cut = [size for size in sizes if size > prompts]
    if cut:
        print(
            f"[bench] bench.batch_size: {prompts} prompts never fill a batch of {', '.join(map(str, cut))}; "
            f"measured and labelled as batch {prompts}"
            + (" (once)" if len(reached) < len(sizes) else "")
            + "; give more prompts (workload.limit) for larger batches",
            file=sys.stderr,
        )
    return reached


def run_rate(run: BatchRun) -> float:
    return sum(map(len, run.tokens)) / run.seconds


def twin_speedup(runs: dict[str, list[BatchRun]]) -> float | None:
    """The A/A twin's speedup over standard decoding in ``runs`` (None without a twin)."""
    if AA not in runs or not runs[AA]:
        return None
    return statistics.mean(map(run_rate, runs[AA])) / statistics.mean(map(run_rate, runs[STANDARD]))


def measure_size(
    run_once: Callable[[str], BatchRun], names: list[str], least: int, most: int
) -> dict[str, list[BatchRun]]:
    """Each contender's runs at one batch size. A run runs every contender once, the order
    rotating from run to run; ``least`` runs, then more, up to ``most`` in all, while the A/A
    twin's speedup (over the runs so far) is outside its band. Stopping once the twin is inside
    favours runs whose noise happened to cancel: the rows report the runs taken and the
    per-run spread of each speedup, the honest measure of the noise."""
    runs: dict[str, list[BatchRun]] = {name: [] for name in names}
    while True:
        done = len(runs[names[0]])
        shift = done % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_once(name))
        twin = twin_speedup(runs)
        if done + 1 >= max(least, most) or (done + 1 >= least and (twin is None or aa_within(twin))):
            return runs


def size_rows(size: int, runs: dict[str, list[BatchRun]], reference: list[list[int]]) -> list[dict]:
    """One row per contender at one batch size (means over its runs; ``speedup_spread``: the
    standard deviation of its speedups run by run, each over that run's standard decoding)."""
    rates = {name: [run_rate(r) for r in each] for name, each in runs.items()}
    standard = statistics.mean(rates[STANDARD])
    rows = []
    for name, each in runs.items():
        latencies = sorted(latency for run in each for latency in run.latencies)
        same = [tokens == expected for run in each for tokens, expected in zip(run.tokens, reference)]
        rows.append(
            {
                "pipeline": name,
                "batch_size": size,
                "tokens_per_s": statistics.mean(rates[name]),
                "speedup": statistics.mean(rates[name]) / standard,
                "runs": len(each),
                "speedup_spread": _spread([r / s for r, s in zip(rates[name], rates[STANDARD])]),
                "latency_median": statistics.median(latencies),
                "latency_p90": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
                "drafted_per_request": statistics.mean(run.drafted_per_request for run in each),
                "identical_outputs": sum(same) / len(same),
                "accepted_per_request": statistics.mean(run.accepted_per_request for run in each),
                "plain_share": statistics.mean(run.plain_share for run in each),
                "first_accepted": statistics.mean(run.first_accepted for run in each),
                "lead_value_quantiles": lead_quantiles([v for run in each for v in run.lead_values]),
            }
        )
    return rows


def format_batch_table(payload: dict) -> str:
    lines = [
        f"{payload['model']} ({payload['dtype']}): {payload['prompts']} prompts, max_new_tokens "
        f"{payload['max_new_tokens']}, arrivals {payload['arrivals'] or 'all at the start'}",
        f"machine: {machine_line(payload['machine'])}",
        f"{'batch':>5} {'pipeline':<22} {'tok/s':>8} {'speedup':>8} {'lat p50':>8} {'lat p90':>8} "
        f"{'drafted':>8} {'plain':>6} {'same':>5}",
    ]
    for row in payload["rows"]:
        lines.append(
            f"{row['batch_size']:>5} {row['pipeline']:<22} {row['tokens_per_s']:>8.1f} {row['speedup']:>7.2f}x "
            f"{row['latency_median']:>7.2f}s {row['latency_p90']:>7.2f}s {row['drafted_per_request']:>8.2f} "
            f"{row.get('plain_share', 0.0):>6.2f} {row['identical_outputs']:>5.2f}"
        )
    for size in payload["batch_sizes"]:
        twin = next((r for r in payload["rows"] if r["pipeline"] == AA and r["batch_size"] == size), None)
        if twin is not None:
            lines.append(twin_line(twin, payload))
    lines += estimate_lines(payload)
    return "\n".join(lines)


def twin_line(twin: dict, payload: dict) -> str:
    """The A/A twin's verdict at one size, with the runs it took and their spread."""
    within = aa_within(twin["speedup"])
    runs = twin.get("runs", payload.get("repeats", 1))
    line = (
        f"A/A twin at batch {twin['batch_size']}: {twin['speedup']:.3f}x, "
        f"{'within' if within else 'warning: outside'} ±{AA_TOLERANCE:.0%} (the noise band)"
    )
    line += f" after {runs} run{'s' if runs != 1 else ''}"
    if runs > 1:
        line += f", spread ±{twin.get('speedup_spread', 0.0):.1%} run to run"
    if not within and runs >= payload.get("batch_repeats", runs) > payload.get("repeats", 1):
        line += f" (bench.batch_repeats={payload['batch_repeats']} reached: give it more runs, or a quieter machine)"
    return line


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def batch_plots(payload: dict, folder: Path) -> list[Path]:
    """Throughput against batch size, and draft tokens per request against batch size: one
    line per pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []
    for key, label, name in (
        ("tokens_per_s", "total new tokens / s", "batch_throughput.png"),
        ("drafted_per_request", "draft tokens per request per pass", "batch_drafted.png"),
    ):
        figure, axis = plt.subplots(figsize=(6, 4))
        for pipeline in dict.fromkeys(row["pipeline"] for row in payload["rows"]):
            points = [(r["batch_size"], r[key]) for r in payload["rows"] if r["pipeline"] == pipeline]
            axis.plot(*zip(*points), marker="o", label=pipeline)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size")
        axis.set_ylabel(label)
        axis.set_title(f"{payload['model']} ({payload['dtype']})")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / name, dpi=120)
        plt.close(figure)
        images.append(folder / name)
    return images
