"""Train drafters on data the target model generates itself (self-distillation).

    python -m train drafter=medusa                       # default recipe (~30 min on 2 CPU cores)
    python -m train drafter=medusa train_data=large      # more data: better heads, a few hours
    python -m train drafter=medusa train.data.path=my_prompts.jsonl

Modules: :mod:`train.prompts` (the built-in prompt set), :mod:`train.generation`
(batched, cached, resumable generation), :mod:`train.data` (self-distilled
sequences), :mod:`train.loop` (the shared training loop: checkpoints, W&B,
progress), :mod:`train.job` (one run, and the drafter registry), and one module
per drafter (:mod:`train.medusa`). Artifacts go to
``<artifacts_dir>/<target>/<drafter>``, where the matching proposer finds them.
"""

from train.job import DRAFTERS, TrainJob, run

__all__ = ["DRAFTERS", "TrainJob", "run"]
