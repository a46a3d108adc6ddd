"""This process's place in a training run: accelerate's ``PartialState``, set up once.

Three things accelerate leaves to the caller, and why they are here:

* On a machine without CUDA, processes started by ``torchrun`` or ``accelerate launch
  --multi_gpu`` join one CPU (gloo) group only if accelerate is told the run is on CPU;
  otherwise each would train alone, silently. Without CUDA, this says so.
* ``accelerate launch --cpu --num_processes N`` starts one process, not N (its simple
  launcher; several CPU processes need ``--mpirun_hostfile``). That run is refused with
  the commands that do start N.
* A run's processes leave the group together (:func:`leave_process_group`): a process
  that exits while another still holds the group's connections can make the other's
  transport fail at exit, and the launcher report the whole run as failed.
"""

from __future__ import annotations

import os

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env


def process_state() -> PartialState:
    """The run's process group (joined on first call; one process outside a launcher)."""
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    if cpu and _one_of_many_requested():
        raise ValueError(
            "accelerate launch --cpu --num_processes N starts a single process; for N CPU processes run "
            "`accelerate launch --multi_gpu --num_processes N -m specdec.train ...` (gloo on a machine without GPUs) "
            "or `torchrun --nproc_per_node N -m specdec.train ...`"
        )
    return PartialState(cpu=cpu)


def leave_process_group() -> None:
    """The end of a run in several processes: all of them reach this point, then the
    group is torn down in each, before any of them exits."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _one_of_many_requested() -> bool:
    """accelerate's simple launcher sets MASTER_ADDR only when more than one process was
    asked for, and starts one without a rank (no torchrun, no MPI)."""
    launched_on_cpu = parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ
    ranked = any(
        key in os.environ for key in ("RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    )
    return launched_on_cpu and not ranked
