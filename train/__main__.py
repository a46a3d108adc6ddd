"""Command line: ``python -m specdec.train drafter=medusa [model=...] [train_data=large]``."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from specdec.decoders.cli.config import CONF_DIR
from specdec.decoders.cli.errors import check_command_line, cli_errors
from specdec.train.job import run, store_drafter_configs
from specdec.train.processes import leave_process_group


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
@cli_errors
def main(cfg: DictConfig) -> None:
    run(cfg)
    leave_process_group()  # after success only: a failed process must not wait for the others


store_drafter_configs()  # drafter=<name> choices, before any config is composed

if __name__ == "__main__":
    check_command_line("train")  # Hydra's errors in one line too
    main()
