"""Time a target's passes on each route of this work, interleaved in one process.

    python scripts/pass_routes.py --dtype bfloat16             # SmolLM2-135M, after 300 tokens
    python scripts/pass_routes.py --model tiny-random --repeats 4 --prefix 40

Routes: the layers as built with exact mode's Python attention and oneDNN's linears (the
project before fused layers), fused layers, then the C exact attention, then the C bfloat16
linears. ``SPECDEC_CPU_ABSENT`` switches the C kernels off pass by pass; two targets (fused
and not) decode after the same random prefix. Prints a markdown table of median milliseconds
per pass width, then the weights' bytes, the read bandwidth and the floor they set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec.decoders.models import cpu
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.machine import memory_limit, memory_limit_line, read_bandwidth, weight_bytes

ROUTES = [  # name, fused layers, capabilities absent
    ("layers as built, Python exact attention, oneDNN", "false", "native_attention,native_bf16_linear"),
    ("fused layers", "true", "native_attention,native_bf16_linear"),
    ("and C exact attention", "true", "native_bf16_linear"),
    ("and C bfloat16 linears (as shipped)", "true", ""),
]


def time_routes(
    model: str, dtype: str, prefix: int, widths: list[int], repeats: int, warmup: int = 2
) -> dict:
    """{route: {width: median seconds}} over ``repeats`` interleaved rounds after ``warmup``."""
    torch.manual_seed(0)
    sessions = {}
    for fused in ("false", "true"):
        target, _ = load_model(ModelConfig(name=model, dtype=dtype, exact="auto", fused_layers=fused))
        session = target.session()
        session.forward(torch.randint(3, target.vocab_size, (prefix,)).tolist(), last_only=True)
        sessions[fused] = session
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in widths} for name, _, _ in ROUTES}
    before = os.environ.get(cpu.ABSENT_ENV)
    try:
        for round_ in range(warmup + repeats):
            for name, fused, absent in ROUTES:
                os.environ[cpu.ABSENT_ENV] = absent
                session = sessions[fused]
                for n in widths:
                    length = len(session)
                    start = time.perf_counter()
                    session.forward(list(range(3, 3 + n)))
                    elapsed = time.perf_counter() - start
                    session.truncate(length)
                    if round_ >= warmup:
                        times[name][n].append(elapsed)
    finally:
        if before is None:
            os.environ.pop(cpu.ABSENT_ENV, None)
        else:
            os.environ[cpu.ABSENT_ENV] = before
    medians = {name: {n: statistics.median(ts) for n, ts in by.items()} for name, by in times.items()}
    medians["_weights"] = weight_bytes(sessions["true"].model)
    return medians


def table(medians: dict, widths: list[int]) -> str:
    lines = [
        "| pass over n tokens, ms | " + " | ".join(map(str, widths)) + " |",
        "|---" * (len(widths) + 1) + "|",
    ]
    for name, _, _ in ROUTES:
        lines.append(f"| {name} | " + " | ".join(f"{1000 * medians[name][n]:.1f}" for n in widths) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or tiny-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix", type=int, default=300, help="tokens cached before the timed passes")
    parser.add_argument("--widths", default="1,4,8,16", help="pass widths, comma-separated")
    parser.add_argument("--repeats", type=int, default=16)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    medians = time_routes(args.model, args.dtype, args.prefix, widths, args.repeats)
    single = medians["and C bfloat16 linears (as shipped)"][1] if 1 in widths else None
    report = (
        table(medians, widths)
        + "\n"
        + memory_limit_line(memory_limit(medians["_weights"], read_bandwidth(), single))
    )
    print(report)
    return report


if __name__ == "__main__":
    main()
