"""Train drafters on data the target model generates itself (self-distillation).

    python -m train drafter=medusa                       # default recipe (~30 min on 2 CPU cores)
    python -m train drafter=medusa train_data=large      # more data: better heads, a few hours
    python -m train drafter=medusa train.data.path=my_prompts.jsonl

Modules: :mod:`train.prompts` (the built-in prompt set), :mod:`train.generation`
(batched, cached, resumable generation, split across processes), :mod:`train.data`
(self-distilled sequences), :mod:`train.loop` (the shared training loop on
``accelerate``: W&B, progress), :mod:`train.batches` (the rows of each step),
:mod:`train.checkpoints` (save_state/load_state, kill-safe), :mod:`train.processes`
(the run's process group), :mod:`train.job` (one run, and the drafter registry), and
one module per drafter (:mod:`train.medusa`). The same command runs data-parallel
under ``accelerate launch`` or ``torchrun`` (docs/scale.md). Artifacts go to
``<artifacts_dir>/<target>/<drafter>``, where the matching proposer finds them.
"""

from train.job import TrainJob, drafters, run, store_drafter_configs

store_drafter_configs()  # drafter=<name> choices, before any config is composed

__all__ = ["TrainJob", "drafters", "run"]
