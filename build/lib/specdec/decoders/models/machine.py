"""Where a measurement was taken: the CPU, its vector extensions and the software.

A speedup holds for the machine it was measured on (bfloat16 passes are nearly
flat in width on CPUs with native bf16 and rise from a few tokens on AVX2-only
ones), so every results file and the bench's header carry this record.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
import transformers

# The /proc/cpuinfo flags that decide how fast a pass is, and how they are reported.
VECTOR_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_vnni": "AVX-512 VNNI",
    "amx_bf16": "AMX BF16",
    "amx_tile": "AMX",
}


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ('', set()) where there is none."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return "", set()
    name, flags = "", set()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def machine_info(device: torch.device | str = "cpu") -> dict:
    """CPU model, vector extensions, threads, accelerator, torch/transformers versions."""
    name, flags = _cpuinfo()
    info = {
        "cpu": name or platform.processor() or platform.machine(),
        "vector_extensions": [label for flag, label in VECTOR_FLAGS.items() if flag in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.device(device).type == "cuda":
        info["accelerator"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_line(info: dict) -> str:
    """The record in one line, for headers and README tables."""
    extensions = ", ".join(info["vector_extensions"]) or "no AVX2"
    accelerator = f", {info['accelerator']}" if "accelerator" in info else ""
    return (
        f"{info['cpu']} ({extensions}), {info['threads']} threads{accelerator}; "
        f"torch {info['torch']}, transformers {info['transformers']}"
    )
