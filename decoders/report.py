"""Command line: one comparison table over a sweep's (or any folder's) results.json files.

    python -m specdec.decoders.bench -m proposer=ngram proposer.k=2,4,8    # writes multirun/DATE_TIME/N/results.json
    python -m specdec.decoders.report multirun/DATE_TIME                   # table + report.csv + plot
    python -m specdec.decoders.report outputs/bench --csv all_runs.csv

Every results.json under DIR (searched recursively) contributes one row per
pipeline it measured; standard decoding is left out (each run's own baseline,
speedup 1 by definition). Besides the metrics, the table shows the options that
differ between rows (``proposer.k``, ``sampling.temperature``, ...), read from
each pipeline's proposer options and each run's resolved config. The Markdown
table is printed, a CSV is written (DIR/report.csv by default) and, when draft
length or tree size varies, the plot DIR/speedup_vs_<option>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.decoders.evaluation.report import collect, markdown_table, report_rows, sweep_plot, write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="a sweep directory (multirun/DATE_TIME) or any folder")
    parser.add_argument("--csv", type=Path, default=None, help="CSV path (default DIR/report.csv)")
    args = parser.parse_args(argv)
    root: Path = args.directory
    if not root.is_dir():
        parser.error(f"{root} is not a directory; pass the sweep folder, e.g. multirun/2026-01-31_12-00-00")
    skipped: list[Path] = []
    runs = collect(root, skipped)
    if not runs and skipped:  # found, but none could be used: not "none under DIR"
        named = ", ".join(str(path) for path in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        parser.error(
            f"none of the {len(skipped)} results.json under {root} could be used ({named}: the [report] "
            "lines above say why); pass a folder of finished per-prompt bench runs"
        )
    if not runs:
        parser.error(f"no results.json under {root}; run `python -m specdec.decoders.bench -m ...` first")
    rows, varying = report_rows(runs, root)
    if not rows:
        print(f"[report] {len(runs)} results file(s), but none measured anything besides standard decoding")
        return 1
    print(markdown_table(rows, varying))
    csv_path = args.csv or root / "report.csv"
    write_csv(rows, varying, csv_path)
    print(f"\n[report] {len(runs)} run(s), {len(rows)} row(s); wrote {csv_path}", file=sys.stderr)
    plot = sweep_plot(rows, varying, root)
    if plot is not None:
        print(f"[report] wrote {plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
