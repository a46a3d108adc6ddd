"""Command line: replay a greedy bench run's recorded outputs through pipelines.

    python -m specdec.decoders.replay run=outputs/bench/DATE_TIME
    python -m specdec.decoders.replay run=outputs/bench/DATE_TIME "pipelines=[{proposer:{name:suffix,k:16},verifier:tree}]"
    python -m specdec.decoders.replay run=outputs/bench/DATE_TIME cost_curve=bf16_curve.json

Seconds per pipeline instead of a bench's minutes, with projected (not measured)
times: how it works and what it cannot replay, :mod:`specdec.decoders.evaluation.replay`.
Writes replay.json and the bench's plots to ``outputs/replay/DATE_TIME/`` (``output=PATH`` elsewhere).
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
from specdec.decoders.evaluation.bench_results import format_table  # noqa: E402
from specdec.decoders.evaluation.plots import bench_plots  # noqa: E402
from specdec.decoders.evaluation.replay import run_replay  # noqa: E402


@hydra.main(config_path=CONF_DIR, config_name="replay", version_base="1.3")
@cli_errors
def main(cfg: DictConfig) -> None:
    payload = run_replay(cfg)
    curve = cfg.cost_curve or "the run's own T(n)"
    print(f"projected from the outputs recorded in {payload['run']}, timed by {curve}:")
    print(format_table(payload))
    print(f"[replay] wrote {cfg.output}", file=sys.stderr)
    if cfg.plots:
        for image in bench_plots(payload, Path(cfg.output).parent):
            print(f"[replay] wrote {image}", file=sys.stderr)


if __name__ == "__main__":
    check_command_line("replay")  # Hydra's errors in one line too
    main()
