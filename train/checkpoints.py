"""Training checkpoints on accelerate's ``save_state`` / ``load_state``, laid out so
that a kill at any moment leaves the newest complete checkpoint intact.

Layout of a checkpoint folder (``<artifact>/checkpoint``)::

    step-00000050/           what accelerate saves: optimizer, scheduler, each process's RNG state,
      trainable.safetensors  the drafter's trainable parameters, by their unwrapped names
      progress.json          step and fingerprint (the drafter and data settings), written last

Two things stay hand-written, and why:

* Atomicity. accelerate writes into the folder it is given, so a kill during a save
  would leave a torn newest checkpoint. Each one is written to ``step-N.tmp`` and
  renamed when every process has finished; older ones are deleted only after that.
* Trainable parameters only. accelerate saves the whole module, which for a drafter
  holds frozen copies of the target's weights (Medusa heads' float32 ``lm_head``, a
  draft model's embeddings and head: over 100 MB for SmolLM2, gigabytes for a 7B
  target) that training never changes and the drafter rebuilds from the target. The
  save and load hooks (accelerate's own extension point) store the trainable
  parameters under their unwrapped names instead, so a checkpoint written by N
  processes resumes on any other number.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

TRAINABLE_FILE = "trainable.safetensors"
PROGRESS_FILE = "progress.json"


def trainable_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def register_trainable_state(accelerator: Accelerator, module: torch.nn.Module) -> list:
    """Make ``save_state``/``load_state`` store ``module``'s trainable parameters instead of
    the prepared models' full state; returns the hook handles (``.remove()`` them after)."""
    trainable = trainable_parameters(module)

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        weights.clear()  # accelerate saves nothing for the models; the file below replaces it
        if accelerator.is_main_process:
            state = {name: p.detach().cpu().contiguous() for name, p in trainable.items()}
            save_file(state, str(Path(output_dir) / TRAINABLE_FILE))

    def load_hook(models: list, input_dir: str) -> None:
        models.clear()  # accelerate loads nothing for the models; the file below replaces it
        state = load_file(str(Path(input_dir) / TRAINABLE_FILE))
        if set(state) != set(trainable):
            raise ValueError(
                f"{input_dir} holds other trainable parameters than this drafter has; "
                "delete it (or set train.resume=false) to start afresh"
            )
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(state[name])

    return [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]


def latest(checkpoint: Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoint`` (None if there is none)."""
    complete = [d for d in checkpoint.glob("step-*") if d.suffix != ".tmp" and (d / PROGRESS_FILE).exists()]
    return max(complete, key=lambda d: d.name, default=None)


def save(accelerator: Accelerator, checkpoint: Path, step: int, fingerprint: str) -> Path:
    """Write the training state at ``step`` (once per step); every process calls this (each
    saves its RNG state)."""
    final = checkpoint / f"step-{step:08d}"
    tmp = final.with_suffix(".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed midway
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / PROGRESS_FILE).write_text(json.dumps({"step": step, "fingerprint": fingerprint}))
        os.replace(tmp, final)
        for older in checkpoint.glob("step-*"):
            if older != final:
                shutil.rmtree(older, ignore_errors=True)
    return final


def restore(accelerator: Accelerator, checkpoint: Path, fingerprint: str) -> int:
    """Load the newest checkpoint if its fingerprint matches; returns the step to continue
    from (0 = fresh start). Every process calls this."""
    found = latest(checkpoint)
    if found is None:
        return 0
    progress = json.loads((found / PROGRESS_FILE).read_text())
    if progress.get("fingerprint") != fingerprint:
        if accelerator.is_main_process:
            print(f"[train] ignoring {found}: it belongs to other settings; starting afresh", file=sys.stderr)
        return 0
    accelerator.load_state(str(found))
    if accelerator.is_main_process:
        print(f"[train] resuming from {found} at step {progress['step']}", file=sys.stderr)
    return int(progress["step"])


def remove(checkpoint: Path) -> None:
    """Delete the checkpoints once the artifact is written (main process)."""
    shutil.rmtree(checkpoint, ignore_errors=True)
