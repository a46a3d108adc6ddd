"""Benchmark plots, saved as PNG next to results.json (and by the sweep report).

    speedup_by_category.png  speedup of each pipeline and peer per workload category
    tau_distribution.png     how many tokens each speculative round emitted
    cost_curve.png           the target's pass cost T(n) / T(1), the physical limit's input
    speedup_vs_<option>.png  a sweep's speedup and tau against draft length or tree size (report)

Figures are built with matplotlib's object API (``Figure``, rendered by Agg), so
no GUI backend or pyplot global state is involved.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from matplotlib.figure import Figure

STANDARD_LINE = {"color": "black", "linestyle": "--", "linewidth": 1}


def bench_plots(payload: dict, directory: Path) -> list[Path]:
    """Every plot one benchmark run supports, written into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [speedup_by_category(payload, directory / "speedup_by_category.png")]
    speculative = [e for e in payload["pipelines"] if e["kind"] == "speculative" and e.get("records")]
    if speculative:
        paths.append(tau_distribution(speculative, directory / "tau_distribution.png"))
    if payload.get("cost_curve"):
        paths.append(cost_curve(payload, directory / "cost_curve.png"))
    return paths


def speedup_by_category(payload: dict, path: Path) -> Path:
    """Grouped bars: one group per category plus ``overall``, one bar per pipeline."""
    contenders = [e for e in payload["pipelines"] if e["kind"] != "standard"]
    categories = list(next(e for e in payload["pipelines"] if e["kind"] == "standard")["categories"])
    groups = categories + ["overall"]
    figure = Figure(figsize=(max(6.0, 0.35 * len(groups) * max(len(contenders), 1) + 2.5), 4.5))
    axes = figure.subplots()
    width = 0.8 / max(len(contenders), 1)
    for index, entry in enumerate(contenders):
        speedups = [entry["categories"].get(c, {}).get("speedup", 0.0) for c in categories] + [
            entry["speedup"]
        ]
        positions = [g + (index - (len(contenders) - 1) / 2) * width for g in range(len(groups))]
        hatch = "//" if entry["kind"] == "peer" else None
        bars = axes.bar(positions, speedups, width, label=entry["name"], hatch=hatch)
        if len(groups) * len(contenders) <= 40:
            axes.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    axes.axhline(1.0, **STANDARD_LINE, label="standard (1.0)")
    axes.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    axes.set_xlabel("workload category")
    axes.set_ylabel("speedup over standard decoding (x)")
    axes.set_title(_run_title(payload, "Speedup per category"))
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar
    axes.margins(y=0.12)
    return _save(figure, path)


def tau_distribution(pipelines: list[dict], path: Path) -> Path:
    """Share of rounds that emitted 1, 2, ... tokens, per speculative pipeline."""
    counts = {e["name"]: Counter(n for r in e["records"] for n in r["emitted_per_round"]) for e in pipelines}
    largest = max((max(c) for c in counts.values() if c), default=1)
    sizes = list(range(1, largest + 1))
    figure = Figure(figsize=(max(6.0, 0.5 * len(sizes) + 3), 4.5))
    axes = figure.subplots()
    width = 0.8 / len(pipelines)
    for index, entry in enumerate(pipelines):
        rounds = sum(counts[entry["name"]].values()) or 1
        shares = [counts[entry["name"]][n] / rounds for n in sizes]
        positions = [n + (index - (len(pipelines) - 1) / 2) * width for n in sizes]
        tau = entry["mean_accepted_tokens"]
        label = f"{entry['name']} (tau {tau:.2f})" if tau is not None else entry["name"]
        axes.bar(positions, shares, width, label=label)
    axes.set_xticks(sizes)
    axes.set_xlabel("tokens emitted in a round (accepted draft tokens + 1)")
    axes.set_ylabel("share of rounds")
    axes.set_title("Tokens per target pass")
    axes.legend(fontsize=8)
    return _save(figure, path)


def cost_curve(payload: dict, path: Path) -> Path:
    """T(n) / T(1): what verifying n tokens in one pass costs relative to one token."""
    sizes = payload["cost_curve"]["sizes"]
    seconds = payload["cost_curve"]["seconds"]
    one = seconds[sizes.index(1)] if 1 in sizes else seconds[0]
    figure = Figure(figsize=(6.0, 4.0))
    axes = figure.subplots()
    axes.plot(sizes, [s / one for s in seconds], marker="o", label="measured (fastest of repeats)")
    timed = payload.get("pass_times")
    if timed and 1 in timed["sizes"]:  # the decode's own passes, median per width
        live_one = timed["seconds"][timed["sizes"].index(1)]
        axes.plot(
            timed["sizes"],
            [s / live_one for s in timed["seconds"]],
            marker="x",
            label="timed while decoding (median)",
        )
    axes.plot(sizes, [1.0] * len(sizes), **STANDARD_LINE, label="free width (T(n) = T(1))")
    axes.set_xlabel("tokens in one target pass (n)")
    axes.set_ylabel("T(n) / T(1)")
    axes.set_title(
        f"Target pass cost: {payload['model']}\n({payload['dtype']}, {payload['device']}, T(1) = {one * 1e3:.1f} ms)"
    )
    axes.legend(fontsize=8)
    return _save(figure, path)


def speedup_vs_parameter(rows: list[dict], parameter: str, path: Path) -> Path:
    """A sweep against one option (``x``): speedup (left) and tau (right), one line per ``series``.

    rows: dicts with ``series``, ``x``, ``speedup``, ``mean_accepted_tokens`` and
    optionally ``speedup_std``.
    """
    figure = Figure(figsize=(11.0, 4.5))
    speedup_axes, tau_axes = figure.subplots(1, 2)
    for series in dict.fromkeys(r["series"] for r in rows):
        points = sorted((r for r in rows if r["series"] == series), key=lambda r: r["x"])
        x = [r["x"] for r in points]
        errors = [r.get("speedup_std") or 0.0 for r in points]
        speedup_axes.errorbar(
            x,
            [r["speedup"] for r in points],
            yerr=errors if any(errors) else None,
            marker="o",
            capsize=3,
            label=series,
        )
        tau_axes.plot(x, [r["mean_accepted_tokens"] for r in points], marker="o", label=series)
    speedup_axes.axhline(1.0, **STANDARD_LINE, label="standard (1.0)")
    speedup_axes.set_ylabel("speedup over standard decoding (x)")
    speedup_axes.set_title(f"Speedup against {parameter}")
    tau_axes.set_ylabel("tokens per target pass (tau)")
    tau_axes.set_title(f"Tau against {parameter}")
    for axes in (speedup_axes, tau_axes):
        axes.set_xlabel(parameter)
        axes.legend(fontsize=8)
    return _save(figure, path)


def _run_title(payload: dict, what: str) -> str:
    what = f"{what} (projected by a replay)" if payload.get("projected") else what
    return (
        f"{what}: {payload['model']}, T={payload['temperature']}, "
        f"{payload['prompts']} prompts, {payload['max_new_tokens']} new tokens"
    )


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path
