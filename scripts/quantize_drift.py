"""How far an int8 target's greedy output strays from the model it was quantized from.

    python scripts/quantize_drift.py                          # SmolLM2-135M, bfloat16, the default workload
    python scripts/quantize_drift.py --model tiny-random --dtype float32 --limit 1 --tokens 8

Both targets decode every prompt of the workload greedily with standard decoding (speculation
does not change a target's greedy output). Prints, over the prompts: the share whose outputs
are identical, the mean length of the common prefix before the first differing token, the share
of positions that agree, and each target's single-token pass time (interleaved, medians).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from specdec.decoders import Pipeline
from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload
from specdec.decoders.models.loading import ModelConfig, load_model


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def drift(model: str, dtype: str, workload: str, limit: int | None, tokens: int) -> dict:
    pipelines = {}
    for quantize in ("none", "int8"):
        config = ModelConfig(name=model, dtype=dtype, quantize=quantize)
        target, tokenizer = load_model(config)
        pipelines[quantize] = Pipeline(target, tokenizer, model_config=config)
    prompts = load_workload(WorkloadConfig(name=workload, limit=limit))
    identical, prefixes, agree, positions = 0, [], 0, 0
    seconds: dict[str, list[float]] = {"none": [], "int8": []}
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        outputs = {}
        for name, pipeline in pipelines.items():
            ids = pipeline.encode(prompt.turns[0]) if pipeline.tokenizer is not None else list(range(3, 40))
            started = time.perf_counter()
            outputs[name] = pipeline.generate(ids, tokens).tokens
            seconds[name].append((time.perf_counter() - started) / max(1, len(outputs[name])))
        a, b = outputs["none"], outputs["int8"]
        identical += a == b
        prefixes.append(common_prefix(a, b))
        agree += sum(x == y for x, y in zip(a, b))
        positions += max(len(a), len(b))
    return {
        "prompts": len(prompts),
        "identical": identical / len(prompts),
        "common_prefix": statistics.mean(prefixes),
        "positions_agreeing": agree / max(1, positions),
        "ms_per_token": {name: 1000 * statistics.median(s) for name, s in seconds.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or tiny-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", default="default")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each category")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = drift(args.model, args.dtype, args.workload, args.limit, args.tokens)
    print(
        f"int8 against {args.dtype}, {result['prompts']} prompts x {args.tokens} tokens: identical outputs "
        f"{result['identical']:.2f}, common prefix {result['common_prefix']:.1f} tokens, positions agreeing "
        f"{result['positions_agreeing']:.2f}; ms per token (standard decoding, whole request) "
        f"{result['ms_per_token']['none']:.1f} against {result['ms_per_token']['int8']:.1f} for int8"
    )
    return result


if __name__ == "__main__":
    main()
