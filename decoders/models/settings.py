"""What ``model.narrow_passes`` and ``model.exact`` choose on this machine (``auto``
resolved, other spellings checked in one line). The routes themselves are in
:mod:`specdec.decoders.models.kernels`, exact attention in
:mod:`specdec.decoders.models.exact_attention`."""

from __future__ import annotations

import torch

from specdec.decoders.models.kernels import PACKED_DTYPES, packed_route_available


def wants_narrow_routing(setting: str | bool, device: torch.device, dtype: torch.dtype) -> bool:
    """``auto``: on CPU for float32, and for bfloat16 where oneDNN's packed bfloat16 linear
    runs (not on AVX2-only CPUs), where they were measured to pay."""
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        if device.type != "cpu":
            return False
        return dtype == torch.float32 or (dtype in PACKED_DTYPES and packed_route_available(dtype))
    if setting in ("true", "on"):
        return True
    if setting in ("false", "off"):
        return False
    raise ValueError(f"model.narrow_passes={setting!r}: use auto, true or false.")


# ---------------------------------------------------------------- exact mode
#
# Exact mode makes every pass batch-invariant: a row's logits do not depend on how
# many tokens share its pass, so greedy speculative decoding gives standard
# decoding's output bit for bit, not only up to floating-point ties. The linears
# take the exact route above, attention takes decoders.models.exact_attention.


def wants_exact(setting: str | bool, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether exact mode is on, and why (the line announced at load time).

    ``auto`` (chosen from the measurements in docs/exact.md): on for
    bfloat16 on CPU, where without it greedy speculative output left standard
    decoding's on 58-67% of Spec-Bench prompts (floating-point ties) and with it the
    measured pipelines ran 7-17% slower than with it off; off for float32 and float64,
    whose ties are rare (logit gaps of 1e-6) and where its wide passes cost up to
    1.5x (16 tokens); off on other devices, whose kernels were not measured.
    """
    if isinstance(setting, str) and setting in ("true", "on", "false", "off"):
        setting = setting in ("true", "on")
    if isinstance(setting, bool):
        return setting, f"model.exact={str(setting).lower()}"
    if setting != "auto":
        raise ValueError(f"model.exact={setting!r}: use auto, true or false.")
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return False, f"model.exact=auto: off on {device.type}, whose kernels this mode was not measured on"
    if dtype != torch.bfloat16:
        return (
            False,
            f"model.exact=auto: off for {name} on cpu, where ties are rare and wide passes cost most",
        )
    return True, f"model.exact=auto: on for {name} on cpu"
