"""Exact mode's attention kernel in C (``exact_kernel.c``), built on first use and loaded with ctypes.

The Python route of exact attention (:func:`specdec.decoders.models.exact_attention._invariant_attention`)
keeps a row's bits independent of its pass by laying every product out in fixed chunks, at the
price of about a hundred PyTorch operations a layer: a third of a single-token pass of
SmolLM2-135M. The C kernel computes each (row, head) on its own, in standard decoding's order,
in one call a layer (the file's comment gives the arithmetic).

It is compiled once per machine and source with the system's C compiler (``cc``, or ``$CC``;
``-O3 -march=native -ffp-contract=off -fopenmp``) into the cache (``~/.cache/specdec/native``,
keyed by the source and the CPU's flags), and found there by later processes. Where no compiler
builds it, or ``SPECDEC_CPU_ABSENT`` names ``native_attention``, exact attention keeps the
Python route (the capability, :mod:`specdec.decoders.models.cpu`, says which); both routes are exact, each on its own terms, and a
process uses one of them for every pass.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.decoders.models.cache import cache_dir

SOURCE = Path(__file__).with_name("exact_kernel.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
SYMBOLS = {
    torch.float32: "attend_float32",
    torch.float64: "attend_float64",
    torch.bfloat16: "attend_bfloat16",
}
_LINEAR_ARGS = [
    ctypes.c_void_p,
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_void_p,
]
_LINEAR_ARGS += [ctypes.c_long] + [ctypes.c_int] * 4
LINEAR_STEP = 64  # the bfloat16 linear's inputs: a multiple of this many
_INT8_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
_INT8_ARGS += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long] + [
    ctypes.c_int
] * 4
_MANY_ARGS = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_MANY_ARGS += [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_double, ctypes.c_int]
INT8_STEP = 32  # the int8 linear's inputs: a multiple of this many
_ARGS = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_ARGS += [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_double, ctypes.c_int]


def _machine() -> str:
    """What the compiled code depends on: the CPU's flags (``-march=native``) and the source."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return hashlib.sha256((flags + SOURCE.read_text() + " ".join(FLAGS)).encode()).hexdigest()[:16]


def build(directory: Path) -> Path:
    """Compile the kernel into ``directory`` (atomically) unless it is there; its path.
    Raises ``RuntimeError`` naming the compiler's complaint where it fails."""
    target = directory / f"exact_kernel_{_machine()}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip().splitlines()[-1:]}")
        os.replace(built, target)
    print(
        f"[native] built exact mode's kernels with {compiler} in {time.perf_counter() - started:.1f} s: {target}",
        file=sys.stderr,
    )
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(build(cache_dir() / "native")))
    except (RuntimeError, OSError):
        return None
    for symbol in SYMBOLS.values():
        getattr(library, symbol).argtypes = _ARGS
        getattr(library, symbol).restype = None
        getattr(library, symbol + "_many").argtypes = _MANY_ARGS
        getattr(library, symbol + "_many").restype = None
    library.linear_bfloat16.argtypes = _LINEAR_ARGS
    library.linear_bfloat16.restype = None
    library.linear_available.restype = ctypes.c_int
    library.linear_int8.argtypes = _INT8_ARGS
    library.linear_int8.restype = None
    return library


def available() -> bool:
    """Whether the kernel is built and loaded here (probed once, by building it)."""
    return _library() is not None


def linear_built() -> bool:
    """Whether the bfloat16 linear is built here: the kernel builds and the compiler targets
    AVX-512 BF16 (``-march=native`` on such a CPU)."""
    library = _library()
    return library is not None and bool(library.linear_available())


def linear_kernel(weight: torch.Tensor):
    """The bfloat16 linear for ``weight`` (out, in), or None where it does not run: another
    dtype or device, or inputs not a multiple of ``LINEAR_STEP``. (Whether this machine has it
    at all is the capability ``native_bf16_linear``: callers ask :mod:`specdec.decoders.models.cpu`.)"""
    usable = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
    library = _library() if usable and weight.shape[1] % LINEAR_STEP == 0 else None
    return library.linear_bfloat16 if library is not None else None


def linear(function, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) @ weight.T (+ bias) -> (rows, out) in bfloat16, every output on its own
    (the C file's ``linear_bfloat16``): its bits depend on its input row and weight row
    alone, whatever else the call holds."""
    x = x.contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    rows, outs = x.shape[0], weight.shape[0]
    y = torch.empty(rows, outs, dtype=torch.bfloat16)
    function(
        x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
        rows, outs, weight.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return y


def int8_kernel():
    """The weight-only int8 linear (the C file's ``linear_int8``), or None where the kernels do
    not build here."""
    library = _library()
    return library.linear_int8 if library is not None else None


def linear_int8(
    function, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (rows, in) float32 or bfloat16 @ (scales * qweight).T (+ bias) -> (rows, out) in x's
    dtype; qweight (out, in) int8, scales and bias (out,) float32. Each output on its own:
    batch-invariant as :func:`linear` is."""
    x = x.contiguous()
    rows, outs = x.shape[0], qweight.shape[0]
    y = torch.empty(rows, outs, dtype=x.dtype)
    low = x.dtype == torch.bfloat16
    function(
        x.data_ptr(), int(low), x.stride(0), qweight.data_ptr(), qweight.stride(0), scales.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), int(low), y.stride(0),
        rows, outs, qweight.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return y


def kernel(dtype: torch.dtype):
    """The attention kernel for ``dtype`` (float32, float64, bfloat16), or None for another
    dtype. (Whether this machine has it at all is the capability ``native_attention``: callers
    ask :mod:`specdec.decoders.models.cpu`.)"""
    library = _library() if dtype in SYMBOLS else None
    return getattr(library, SYMBOLS[dtype]) if library is not None else None


def attend(
    function,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix: int,
    visible: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query (heads, rows, d), key/value (kv_heads, keys, d), each with unit stride in d;
    visible (rows, width) int32 and counts (rows,) int32 (:func:`visible_rows`) -> (rows, heads, d)
    in the query's dtype."""
    heads, rows, dim = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    out = torch.empty(rows, heads, dim, dtype=query.dtype)
    function(
        query.data_ptr(), query.stride(0), query.stride(1),
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        out.data_ptr(), out.stride(1), out.stride(0),
        heads, key.shape[0], rows, dim, prefix,
        visible.data_ptr(), visible.stride(0), counts.data_ptr(), scale, torch.get_num_threads(),
    )  # fmt: skip
    return out


def many_kernel(dtype: torch.dtype):
    """The attention kernel over a packed pass of several requests for ``dtype``
    (:func:`attend_many`), or None for another dtype or where the kernels do not build."""
    library = _library() if dtype in SYMBOLS else None
    return getattr(library, SYMBOLS[dtype] + "_many") if library is not None else None


def attend_many(function, query: torch.Tensor, requests: list[tuple], scale: float) -> torch.Tensor:
    """A packed pass's attention in one call: query (heads, rows, d) holds every request's rows;
    ``requests``: per request (key, value, prefix, first row, rows, visible, counts), its keys and
    values (kv_heads, keys, d) and its rows' layout (:func:`visible_rows`). -> (rows, heads, d).
    Each (row, head) is computed as :func:`attend` computes it for the request alone."""
    heads, rows, dim = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    meta, kept = [], []
    for key, value, prefix, first, count, visible, counts in requests:
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        kept += [key, value]
        meta += [key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1)]
        meta += [prefix, first, count, visible.data_ptr(), visible.stride(0), counts.data_ptr()]
    table = torch.tensor(meta, dtype=torch.int64)
    out = torch.empty(rows, heads, dim, dtype=query.dtype)
    kv_heads = requests[0][0].shape[0]
    function(
        query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), out.stride(1), out.stride(0),
        heads, kv_heads, dim, len(requests), table.data_ptr(), scale, torch.get_num_threads(),
    )  # fmt: skip
    return out


def visible_rows(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block (rows, rows) bool, which block entries each row sees -> each row's visible
    offsets in order, (rows, rows) int32 (padded with zeros), and their counts (rows,) int32."""
    counts = block.sum(1, dtype=torch.int32)
    order = torch.sort((~block).to(torch.int8), dim=1, stable=True).indices  # the seen ones first, in order
    return order.to(torch.int32).contiguous(), counts.contiguous()
