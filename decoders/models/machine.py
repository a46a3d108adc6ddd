"""Where a measurement was taken: the CPU, its vector extensions and the software.

A speedup holds for the machine it was measured on (bfloat16 passes are nearly
flat in width on CPUs with native bf16 and rise from a few tokens on AVX2-only
ones), so every results file and the bench's header carry this record.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
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


def read_bandwidth(megabytes: int = 512, repeats: int = 3) -> float:
    """This machine's memory read bandwidth now, GB/s: the fastest of ``repeats`` sums over a
    float32 buffer of ``megabytes`` (far larger than any cache), on the threads PyTorch uses.
    A decode pass that reads every weight once cannot run faster than their bytes over this."""
    import time

    buffer = torch.ones(megabytes * (1 << 20) // 4)
    buffer.sum()  # pages touched, threads up
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        fastest = min(fastest, time.perf_counter() - start)
    return buffer.numel() * 4 / fastest / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, a storage shared by several (tied
    embeddings) counted once: what a pass over it reads at least once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def memory_limit(weights: int, bandwidth_gb_s: float, single_pass_s: float | None) -> dict:
    """The floor a single-token pass cannot beat (its weights' bytes read once at
    ``bandwidth_gb_s``) and how far the measured pass (``single_pass_s``) sits above it."""
    limit = weights / (bandwidth_gb_s * 1e9)
    return {
        "weight_bytes": weights,
        "read_gb_s": bandwidth_gb_s,
        "limit_ms": 1000 * limit,
        "single_pass_ms": None if single_pass_s is None else 1000 * single_pass_s,
        "ratio": None if single_pass_s is None else single_pass_s / limit,
    }


def memory_limit_line(limit: dict) -> str:
    """``memory_limit``'s record in one line, for the bench's header."""
    line = (
        f"weights {limit['weight_bytes'] / 1e6:.0f} MB, read at {limit['read_gb_s']:.1f} GB/s: "
        f"a single-token pass takes at least {limit['limit_ms']:.1f} ms"
    )
    if limit.get("ratio") is not None:
        line += (
            f"; standard decoding's took {limit['single_pass_ms']:.1f} ms, {limit['ratio']:.1f}x that limit"
        )
    return line


def machine_tag() -> str:
    """A short name for what a timing depends on here: the CPU, its vector extensions, the
    threads and the torch and transformers versions (cached measurements are keyed by it)."""
    info = machine_info()
    parts = [
        info["cpu"],
        *info["vector_extensions"],
        str(info["threads"]),
        info["torch"],
        info["transformers"],
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def _busy_seconds() -> float | None:
    """CPU seconds every CPU of the machine has spent busy (user, nice, system, irq, softirq,
    steal) since boot, from /proc/stat; None where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """How much of this machine's CPUs other work took from now until :meth:`share`: the whole
    machine's busy CPU time (steal included: a neighbour on the host) less this process's own,
    over the wall time times the CPUs. A measure of the machine, not of what was timed."""

    def __init__(self) -> None:
        self.busy, self.own, self.wall = _busy_seconds(), time.process_time(), time.perf_counter()

    def share(self) -> float | None:
        """Other work's share of the CPUs since this meter started (0 to 1); None without /proc/stat."""
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        wall = max(time.perf_counter() - self.wall, 1e-9)
        other = (busy - self.busy) - (time.process_time() - self.own)
        return min(max(other / (wall * (os.cpu_count() or 1)), 0.0), 1.0)
