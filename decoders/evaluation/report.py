"""The sweep report: one comparison table over many results.json files.

Every results.json under a folder (searched recursively) contributes one row
per pipeline it measured; standard decoding is left out (each run's own
baseline, speedup 1 by definition), and so is its A/A twin, whose speedup is
shown on each of its run's rows instead (``a/a``: what the run's noise alone gives). Besides the metrics, the table shows the
options that differ between rows (``proposer.k``, ``sampling.temperature``,
...), read from each pipeline's proposer options and each run's resolved
config. The command line is :mod:`specdec.decoders.report`.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from specdec.decoders.evaluation.files import batch_run, read_results
from specdec.decoders.evaluation.metrics import control_entry
from specdec.decoders.evaluation.plots import speedup_vs_parameter

METRICS = (
    ("tokens_per_s", "tok/s"),
    ("speedup", "speedup"),
    ("speedup_std", "±"),
    ("mean_accepted_tokens", "tau"),
    ("acceptance_rate", "accept"),
    ("identical_outputs", "same"),
    ("ideal_speedup", "ideal"),
    ("efficiency", "eff"),
    ("aa_speedup", "a/a"),
    ("prompts", "prompts"),
)
# Options that say how big a draft is, in the order the plot prefers them.
DRAFT_SIZE_OPTIONS = (
    "proposer.k",
    "proposer.tree_size",
    "proposer.num_nodes",
    "proposer.branches",
    "proposer.depth",
)
# Config keys that never describe what was measured.
IGNORED_PREFIXES = ("logger.", "bench.output", "bench.plots", "bench.cost_cache", "artifacts_dir", "plugins")


def collect(directory: Path, skipped: list[Path] | None = None) -> list[tuple[Path, dict]]:
    """(path, payload) of every results.json under ``directory``, in path order; the files it
    cannot use are said and added to ``skipped``."""
    runs, skipped = [], [] if skipped is None else skipped
    for path in sorted(directory.rglob("results.json"), key=lambda p: [_natural(part) for part in p.parts]):
        try:
            payload = read_results(path, "skipped")
        except ValueError as error:
            print(f"[report] skipping {error}", file=sys.stderr)
            skipped.append(path)
            continue
        if (batch := batch_run(payload)) is not None:
            print(
                f"[report] skipping {path}: a batch-mode run ({batch}); the bench printed its table",
                file=sys.stderr,
            )
            skipped.append(path)
            continue
        if payload.get("complete") is False:
            print(
                f"[report] {path} is partial ({payload.get('prompts')} of {payload.get('prompts_planned')} "
                "prompts: the bench was interrupted); its rows are marked (partial)",
                file=sys.stderr,
            )
        runs.append((path, payload))
    return runs


def report_rows(runs: list[tuple[Path, dict]], root: Path) -> tuple[list[dict], list[str]]:
    """One row per non-standard pipeline, and the option keys whose values differ between rows."""
    rows = []
    for path, payload in runs:
        run_options = {
            key: value
            for key, value in flatten(payload.get("config") or {}).items()
            if not key.startswith(IGNORED_PREFIXES) and not key.startswith("proposer")
        }
        control = control_entry(payload["pipelines"])
        for entry in payload["pipelines"]:
            if entry["kind"] in ("standard", "control"):
                continue
            proposer_options = (entry.get("info") or {}).get("proposer_config") or {}
            options = {**run_options, **{f"proposer.{k}": v for k, v in flatten(proposer_options).items()}}
            row = {
                "run": (str(path.parent.relative_to(root)) or ".")
                + (" (partial)" if payload.get("complete") is False else ""),
                "pipeline": entry["name"],
                "kind": entry["kind"],
            }
            row["options"] = options
            row.update({key: entry.get(key) for key, _ in METRICS if key not in ("prompts", "aa_speedup")})
            row["aa_speedup"] = control["speedup"] if control else None
            row["prompts"] = payload["prompts"]
            rows.append(row)
    keys = dict.fromkeys(key for row in rows for key in row["options"])
    varying = [key for key in keys if len({repr(row["options"].get(key)) for row in rows}) > 1]
    return rows, varying


def flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists become tuples so values compare and hash."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = tuple(value) if isinstance(value, list) else value
    return flat


def table_columns(varying: list[str]) -> list[tuple[str, str]]:
    """(key, header) of the table: run, pipeline, the varying options, the metrics."""
    return (
        [("run", "run"), ("pipeline", "pipeline"), ("kind", "kind")]
        + [(k, k) for k in varying]
        + list(METRICS)
    )


def cell(row: dict, key: str) -> Any:
    return row["options"].get(key) if key in row["options"] else row.get(key)


def markdown_table(rows: list[dict], varying: list[str]) -> str:
    columns = table_columns(varying)

    def text(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header for _, header in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    lines += ["| " + " | ".join(text(cell(row, key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(rows: list[dict], varying: list[str], path: Path) -> None:
    columns = table_columns(varying)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([key for key, _ in columns])
        writer.writerows([[cell(row, key) for key, _ in columns] for row in rows])


def draft_size_option(rows: list[dict], varying: list[str]) -> str | None:
    """The varying numeric option that sets draft length or tree size, if any."""
    numeric = [
        key
        for key in varying
        if key.startswith("proposer.")
        and all(isinstance(row["options"].get(key), (int, float)) for row in rows if key in row["options"])
    ]
    preferred = [key for key in DRAFT_SIZE_OPTIONS if key in numeric]
    return (preferred or numeric or [None])[0]


def sweep_plot(rows: list[dict], varying: list[str], directory: Path) -> Path | None:
    """Speedup against draft length / tree size, one line per pipeline and other varying options."""
    speculative = [row for row in rows if row["kind"] == "speculative"]
    option = draft_size_option(speculative, varying)
    if option is None:
        return None
    others = [key for key in varying if key != option and not key.endswith(".name")]
    points = []
    for row in speculative:
        if row["options"].get(option) is None:
            continue
        label = ", ".join([row["pipeline"]] + [f"{key}={row['options'].get(key)}" for key in others])
        points.append(
            {
                "series": label,
                "x": row["options"][option],
                **{k: row[k] for k in ("speedup", "speedup_std", "mean_accepted_tokens")},
            }
        )
    return speedup_vs_parameter(points, option, directory / f"speedup_vs_{option.split('.')[-1]}.png")


def _natural(text: str) -> tuple:
    """Sort key putting job 10 after job 9."""
    return (0, int(text), "") if text.isdigit() else (1, 0, text)
