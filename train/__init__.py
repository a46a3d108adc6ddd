"""Train drafters on data the target model generates itself (self-distillation).

    python -m specdec.train drafter=medusa                       # default recipe (~30 min on 2 CPU cores)
    python -m specdec.train drafter=medusa train_data=large      # more data: better heads, a few hours
    python -m specdec.train drafter=medusa train.data.path=my_prompts.jsonl

Modules: :mod:`specdec.train.prompts` (the built-in prompt set), :mod:`specdec.train.generation`
(batched, cached, resumable generation, split across processes), :mod:`specdec.train.data`
(self-distilled sequences), :mod:`specdec.train.loop` (the shared training loop on
``accelerate``: W&B, progress), :mod:`specdec.train.batches` (the rows of each step),
:mod:`specdec.train.checkpoints` (save_state/load_state, kill-safe), :mod:`specdec.train.processes`
(the run's process group), :mod:`specdec.train.job` (one run, and the drafter registry), and
one module per drafter (:mod:`specdec.train.medusa`). The same command runs data-parallel
under ``accelerate launch`` or ``torchrun`` (docs/scale.md). Artifacts go to
``<artifacts_dir>/<target>/<drafter>``, where the matching proposer finds them.

Importing the package, or any one module of it, runs nothing else: ``TrainJob``, ``drafters``
and ``run`` are imported from :mod:`specdec.train.job` on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainJob", "drafters", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from specdec.train import job

        return getattr(job, name)
    raise AttributeError(f"module 'specdec.train' has no attribute {name!r}")
