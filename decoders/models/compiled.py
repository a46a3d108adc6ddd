"""Compiled target passes (``model.compile=auto|true|false``): the decoder through ``torch.compile``.

``true`` compiles the target's decoder (the transformer under the LM head) with inductor and
dynamic shapes, so passes of every width and context length share a few graphs rather than one
per shape. The layers then run as transformers builds them: the project's CPU routes (routed
linears, fused layers, the C kernels) are switched off for a compiled target, since a C call
is opaque to the compiler and splits its graph. The compilation is paid once, at load, by
warm-up passes over the widths a decoding sends (a prefill, then 1 to 16 tokens); their count
of graphs and seconds are announced (``[compile] ...``), kept in :class:`CompileStats`, and
recorded by the bench. Graphs compiled later (a shape the warm-up did not cover) are counted
apart, as ``during_run``.

Exact mode keeps eager passes: inductor's generated kernels promise no batch invariance (a
row's sums may be ordered by the pass's width), so where exact mode is on, ``true`` is
refused at load with the reason printed, and the target stays eager.

``auto`` compiles nowhere yet: on the AMD EPYC with AVX-512 BF16 (2 threads), SmolLM2-135M's
decoder compiled into 25 graphs in 102 s and ran a single-token pass in 61.9 ms against 26.5 on
the project's eager routes (fused layers, C kernels; docs/performance.md, "Compiled passes").
Dynamo specialises each layer's attention on its index and reaches its recompile limit (8), so
the later layers run eager behind guards. No GPU was measured.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from specdec.decoders.models.kernels import unroute_linears

COMPILE_CHOICES = ("auto", "true", "false")
WARM_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # the pass widths the warm-up sends after its prefill


@dataclass
class CompileStats:
    """What compiling a target cost: graphs compiled at load and their wall seconds (the
    warm-up's, tracing included), and graphs compiled afterwards, while decoding."""

    graphs: int = 0
    seconds: float = 0.0
    during_run: int = 0
    loaded: bool = field(default=False, repr=False)

    def record(self) -> dict:
        return {"graphs": self.graphs, "seconds": round(self.seconds, 2), "during_run": self.during_run}


def wants_compile(setting, device: torch.device, exact: bool) -> tuple[bool, str]:
    """Whether the target is compiled, and why (the line announced at load)."""
    if isinstance(setting, bool):
        setting = str(setting).lower()
    setting = {"on": "true", "off": "false"}.get(str(setting), str(setting))
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"model.compile={setting!r}: use auto, true or false.")
    if setting == "false":
        return False, "model.compile=false"
    if setting == "auto":
        return (
            False,
            f"model.compile=auto: off on {device.type}, where compiled passes were not measured to pay",
        )
    if exact:
        return False, (
            "model.compile=true, but exact mode is on: compiled kernels do not promise batch invariance, "
            "so the passes stay eager (model.exact=false compiles them)"
        )
    return True, "model.compile=true"


def counting_backend(stats: CompileStats):
    """Inductor, counting the graphs it is handed (at load, or while decoding)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: torch.fx.GraphModule, example_inputs):
        if stats.loaded:
            stats.during_run += 1
        else:
            stats.graphs += 1
        return compile_fx(graph, example_inputs)

    return backend


def compile_target(
    target, stats: CompileStats, widths: tuple[int, ...] = WARM_WIDTHS, prefix: int = 32
) -> None:
    """Compile ``target``'s decoder and pay for it now: a prefill of ``prefix`` tokens, then a
    pass of every width in ``widths``, on a session dropped afterwards. The layers run as
    transformers builds them (the CPU routes' C calls would split the graphs)."""
    target.configure(False, False, fused=False)
    unroute_linears(target.model)
    decoder = target.decoder()
    decoder.compile(dynamic=True, backend=counting_backend(stats))
    started = time.perf_counter()
    session = target.session()
    vocab = target.vocab_size
    session.forward([(7 * i + 3) % vocab for i in range(prefix)], last_only=True)
    for width in widths:
        length = len(session)
        session.forward([(5 * i + 11) % vocab for i in range(width)])
        session.truncate(length)
    stats.seconds = time.perf_counter() - started
    stats.loaded = True
    print(
        f"[compile] {stats.graphs} graphs compiled in {stats.seconds:.1f} s at load "
        "(outside every request's stats)",
        file=sys.stderr,
    )


def uncompile(target) -> None:
    """Put ``target``'s decoder back on eager passes."""
    target.decoder()._compiled_call_impl = None
