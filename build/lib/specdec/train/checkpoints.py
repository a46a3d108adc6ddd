"""Training checkpoints on accelerate's ``save_state`` / ``load_state``, laid out so
that a kill at any moment leaves the newest complete checkpoint intact.

Layout of a checkpoint folder (``<artifact>/checkpoint``), one folder per run's settings
(the first 12 hex digits of its fingerprint's SHA-1), so a run with other settings neither
resumes from nor deletes another's checkpoints::

    3f2a9c0b1d4e/
     step-00000050/          what accelerate saves: optimizer, scheduler, each process's RNG state,
       trainable.safetensors the drafter's trainable parameters, by their unwrapped names
       progress.json         step and fingerprint (the drafter and data settings), written last

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

import hashlib
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


def own_folder(checkpoint: Path, fingerprint: str) -> Path:
    """Where the checkpoints of the run with ``fingerprint`` go, under ``checkpoint``."""
    return checkpoint / hashlib.sha1(fingerprint.encode()).hexdigest()[:12]


def save(accelerator: Accelerator, checkpoint: Path, step: int, fingerprint: str) -> Path:
    """Write the training state at ``step`` (once per step) into this run's own folder; every
    process calls this (each saves its RNG state). Only this run's older steps are deleted."""
    folder = own_folder(checkpoint, fingerprint)
    final = folder / f"step-{step:08d}"
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
        for older in folder.glob("step-*"):
            if older != final:
                shutil.rmtree(older, ignore_errors=True)
    return final


def restore(accelerator: Accelerator, checkpoint: Path, fingerprint: str) -> int:
    """Load this run's newest checkpoint (its own folder; a checkpoint of the layout before
    per-settings folders is taken if its fingerprint matches); returns the step to continue
    from (0 = fresh start). Checkpoints of other settings are kept, and said so. A checkpoint
    that cannot be read ends the run in one line naming it and how to start afresh. Every
    process calls this."""
    found = latest(own_folder(checkpoint, fingerprint))
    legacy = latest(checkpoint)
    if found is None and legacy is not None and _progress(legacy).get("fingerprint") == fingerprint:
        found = legacy
    others = [d for d in checkpoint.glob("*/") if d.is_dir() and d != own_folder(checkpoint, fingerprint)]
    others = [d for d in others if latest(d) is not None] + ([legacy] if legacy not in (None, found) else [])
    if others and accelerator.is_main_process:
        print(
            f"[train] keeping {len(others)} checkpoint(s) of other settings under {checkpoint} "
            "(not this run's; delete them when no longer needed)",
            file=sys.stderr,
        )
    if found is None:
        return 0
    try:
        accelerator.load_state(str(found))
    except Exception as error:  # noqa: BLE001 - a torn or corrupted file, whatever the reader raises
        raise ValueError(
            f"the checkpoint {found} cannot be read ({type(error).__name__}: {str(error).splitlines()[0]}); "
            f"delete it (rm -r {found}) or set train.resume=false to start afresh"
        ) from None
    progress = _progress(found)
    if accelerator.is_main_process:
        print(f"[train] resuming from {found} at step {progress['step']}", file=sys.stderr)
    return int(progress["step"])


def _progress(found: Path) -> dict:
    try:
        return json.loads((found / PROGRESS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def remove(checkpoint: Path, fingerprint: str) -> None:
    """Delete this run's checkpoints once its artifact is written (main process); those of
    other settings stay."""
    shutil.rmtree(own_folder(checkpoint, fingerprint), ignore_errors=True)
    legacy = latest(checkpoint)
    if legacy is not None and _progress(legacy).get("fingerprint") == fingerprint:
        shutil.rmtree(legacy, ignore_errors=True)
    if checkpoint.exists() and not any(checkpoint.iterdir()):
        checkpoint.rmdir()
