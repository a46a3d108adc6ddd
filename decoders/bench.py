"""Command line: benchmark pipelines against standard decoding (and HF peers).

    python -m specdec.decoders.bench                                  # every available pipeline
    python -m specdec.decoders.bench proposer=ngram verifier=greedy bench.peers=true
    python -m specdec.decoders.bench workload=spec_bench workload.path=question.jsonl workload.limit=2
    python -m specdec.decoders.bench -m proposer=ngram proposer.k=2,4,8    # a sweep: one job per value
    python -m specdec.decoders.report multirun/DATE_TIME                  # the sweep's comparison table

How the contenders are measured: :mod:`specdec.decoders.evaluation.benchmark`.

Outputs land in Hydra's output directory (``outputs/bench/DATE_TIME/`` for a
single run, ``multirun/DATE_TIME/JOB/`` per sweep job): results.json (rewritten
after every prompt, so an interrupted run keeps what it finished), the PNG
plots next to it, and the offline W&B run (``logger=disabled`` turns it off).
``bench.output=PATH`` puts results.json (and the plots) elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdec.decoders.engine.registry import import_plugins_from_argv

import_plugins_from_argv()  # before Hydra composes, so plugin proposers are valid choices

from specdec.decoders.cli.config import CONF_DIR  # noqa: E402
from specdec.decoders.cli.errors import check_command_line, cli_errors  # noqa: E402
from specdec.decoders.evaluation.batching import batch_plots, format_batch_table  # noqa: E402
from specdec.decoders.evaluation.bench_results import format_table, publish  # noqa: E402
from specdec.decoders.evaluation.benchmark import run_benchmark  # noqa: E402
from specdec.decoders.models.loading import resolve_device  # noqa: E402


@hydra.main(config_path=CONF_DIR, config_name="bench", version_base="1.3")
@cli_errors
def main(cfg: DictConfig) -> None:
    resolve_device(cfg.model.device)  # fail early on a bad device name
    payload = run_benchmark(cfg)
    if payload.get("mode") == "batch":
        print(format_batch_table(payload))
        print(f"[bench] wrote {cfg.bench.output}", file=sys.stderr)
        for image in batch_plots(payload, Path(cfg.bench.output).parent) if cfg.bench.plots else []:
            print(f"[bench] wrote {image}", file=sys.stderr)
        return
    print(format_table(payload))
    print(f"[bench] wrote {cfg.bench.output}", file=sys.stderr)
    publish(cfg, payload)


if __name__ == "__main__":
    check_command_line("bench")  # Hydra's errors in one line too
    main()
