"""What this CPU can do, probed once per process: the capabilities that decide a kernel route.

Machines differ: AVX2-only CPUs have no native bfloat16 and oneDNN refuses its packed
bfloat16 linear there (``mkldnn_reorder_linear_weight: bf16 path needs the cpu support
avx_ne_convert or avx512bw, avx512vl and avx512dq``); AVX-512 CPUs with BF16 and Intel
CPUs with AMX have both. Every route that depends on one of these asks :func:`has`, never
the CPU's name or flags directly, so one switch moves it to its fallback.

Capabilities (names as the probe reports them and as skipped tests name them):

``native_bf16``
    bfloat16 arithmetic in hardware (AVX-512 BF16 or AMX): ``model.dtype=auto`` is
    bfloat16 where this holds, float32 elsewhere.
``onednn_bf16_linear``
    oneDNN's packed bfloat16 linear (``torch.ops.mkldnn._reorder_linear_weight``) runs:
    probed by packing and multiplying a small weight, so a build or CPU that refuses it
    answers False instead of raising. bfloat16's narrow route and drafters' packed
    vocabulary products take it where it holds and ``F.linear`` where it does not.
``onednn_f32_linear``
    the same in float32 (x86 builds of PyTorch; float32's wider narrow passes take it).
``native_attention``
    exact mode's attention kernel in C builds here (:mod:`specdec.decoders.models.native`:
    a C compiler with OpenMP); without it exact attention takes its Python route.
``native_bf16_linear``
    the bfloat16 linear in C (AVX-512 BF16 dot products, each output on its own) builds here:
    bfloat16 passes of up to ``NATIVE_ROWS`` rows take it (every exact pass), oneDNN's packed
    linear otherwise.
``native_int8_linear``
    the weight-only int8 linear in C (``model.quantize=int8``) builds here (a C compiler with
    OpenMP); without it int8 layers multiply by their weights dequantized.

``SPECDEC_CPU_ABSENT`` (comma-separated names, or ``all``) makes this process treat
capabilities as absent, whatever the CPU has: an AVX-512 machine then takes the routes
an AVX2 one takes (``SPECDEC_CPU_ABSENT=all make test`` runs the whole suite that way).
It is read at each call, so tests switch it with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import functools
import os

import torch

ABSENT_ENV = "SPECDEC_CPU_ABSENT"


def _probe_native_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _probe_onednn_linear(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(ops, name) for name in ("_linear_pointwise", "_reorder_linear_weight")
    ):
        return False
    try:
        with torch.no_grad():
            weight = torch.ones(8, 8, dtype=dtype)
            packed = ops._reorder_linear_weight(weight, None)
            out = ops._linear_pointwise(torch.ones(4, 8, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.all(out == 8))
    except (RuntimeError, NotImplementedError):  # "bf16 path needs the cpu support ..."
        return False


def _probe_native_attention() -> bool:
    from specdec.decoders.models import native

    return native.available()


def _probe_native_linear() -> bool:
    from specdec.decoders.models import native

    return native.linear_built()


PROBES = {
    "native_bf16": _probe_native_bf16,
    "onednn_bf16_linear": lambda: _probe_onednn_linear(torch.bfloat16),
    "onednn_f32_linear": lambda: _probe_onednn_linear(torch.float32),
    "native_attention": lambda: _probe_native_attention(),
    "native_bf16_linear": lambda: _probe_native_linear(),
    "native_int8_linear": lambda: _probe_native_attention(),  # the same library: built or not
}

# what each capability needs, for messages and skipped tests
NEEDS = {
    "native_bf16": "AVX-512 BF16 or AMX",
    "onednn_bf16_linear": "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    "onednn_f32_linear": "an x86 build of PyTorch with oneDNN",
    "native_attention": "a C compiler with OpenMP (cc or $CC) to build exact mode's attention kernel",
    "native_bf16_linear": "AVX-512 BF16 and a C compiler with OpenMP (cc or $CC)",
    "native_int8_linear": "a C compiler with OpenMP (cc or $CC) to build the int8 linear",
}


@functools.cache
def _probed(name: str) -> bool:
    return PROBES[name]()


def forced_absent() -> frozenset[str]:
    """Capabilities ``SPECDEC_CPU_ABSENT`` switches off in this process. Read on every call
    (tests set it at run time), parsed once per value: every routed linear product asks."""
    return _absent(os.environ.get(ABSENT_ENV, ""))


@functools.cache
def _absent(value: str) -> frozenset[str]:
    value = value.strip()
    if value == "all":
        return frozenset(PROBES)
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = names - set(PROBES)
    if unknown:
        raise ValueError(
            f"{ABSENT_ENV}={value!r}: unknown capability {sorted(unknown)[0]!r}; "
            f"use 'all' or names from {sorted(PROBES)}"
        )
    return frozenset(names)


def has(name: str) -> bool:
    """Whether this CPU (and PyTorch build) has capability ``name``, unless forced absent."""
    if name not in PROBES:
        raise KeyError(f"unknown CPU capability {name!r}; known: {sorted(PROBES)}")
    return name not in forced_absent() and _probed(name)


def onednn_linear(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here in ``dtype`` (float32 or bfloat16)."""
    if dtype == torch.bfloat16:
        return has("onednn_bf16_linear")
    if dtype == torch.float32:
        return has("onednn_f32_linear")
    return False


def capabilities() -> dict[str, bool]:
    """Every capability as this process sees it (forced absences applied)."""
    return {name: has(name) for name in PROBES}
