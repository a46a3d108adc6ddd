"""The bench's options (``bench.*``): one typed schema, the one source of every default.

Stored as the Hydra choice ``bench=default``; ``conf/bench.yaml`` sets only what needs
Hydra (the output path in the run's folder), experiments override the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from specdec.decoders.cli.config import store_schema, to_dataclass
from specdec.decoders.evaluation.peers import PROMPT_LOOKUP_TOKENS

# Measured when neither proposer= nor bench.pipelines= is given: the best pipeline of each
# proposer family on the default target (README "Measured results"; docs/benchmarks.md).
# A name runs the proposer's defaults (its best measured configuration, with the verifier its
# drafts want); another label is a preset its class declares (copy_heads_chain). The trained
# early exit cannot pay on this target (docs/benchmarks.md, "Early exit, per exit layer"):
# it is in the full set, experiment=full_set, with the peers that cannot pay either.
DEFAULT_PIPELINES = ["ngram", "suffix", "copy_heads", "copy_heads_chain", "merge", "draft_model"]
# The peers of bench.peers=true: those that can pay on the default target. hf_assisted
# (0.30-0.38x) and hf_early_exit (0.25-0.32x) cannot, and took a third of the quickstart.
DEFAULT_PEERS = ["hf_generate", "hf_prompt_lookup"]


@dataclass
class BenchConfig:
    max_new_tokens: int = 64  # per prompt; the default run (60 prompts) stays within minutes on 2 CPU cores
    warmup: int = 1  # prompts run (and discarded) by every pipeline before measuring
    repeats: int = 1  # measured runs of each prompt; with 2 or more, mean and spread are reported
    # several pipelines in one run: names, preset labels, "proposer+verifier", or mappings,
    # e.g. [ngram+greedy,copy_heads_chain,{proposer:{name:medusa,tree:auto},verifier:tree}]
    pipelines: list[Any] = field(default_factory=list)
    # a pipeline here whose trained artifact is missing is skipped with the command that trains it
    default_pipelines: list[Any] = field(default_factory=lambda: list(DEFAULT_PIPELINES))
    # run after default_pipelines, when those run (experiment=full_set: the trained early exit)
    extra_pipelines: list[Any] = field(default_factory=list)
    # rounds: our pipelines run in step, a round at a time, on each prompt; prompts: one after another
    interleave: str = "rounds"
    aa: bool = True  # standard decoding twice, in step: "standard (A/A)" is the speedup noise alone gives
    peers: Any = False  # also measure transformers' peers: true = default_peers, all, or a list of names
    default_peers: list[str] = field(default_factory=lambda: list(DEFAULT_PEERS))
    # the tokens hf_prompt_lookup drafts from each match (its reference setting; it cannot size
    # its drafts, so it does not take our ngram's k, the longest draft ngram's sizing may send);
    # a list, e.g. [5,10]: one peer per setting, hf_prompt_lookup_5, hf_prompt_lookup_10
    prompt_lookup_tokens: Any = PROMPT_LOOKUP_TOKENS
    # results.json (conf/bench.yaml: Hydra's output directory, outputs/bench/DATE_TIME/ for a
    # run, multirun/DATE_TIME/JOB/ for each job of a sweep); the plots go next to it
    output: str = "results.json"
    plots: bool = True  # PNG plots next to results.json
    cost_cache: bool = True  # reuse the cached T(n) of this model/device/dtype; false = measure afresh
    # with model.exact on: also time every pipeline with it off, interleaved (speedup over
    # standard decoding with it off)
    exact_off: bool = False
    # batch mode (decoders/evaluation/batching.py): a size or a list of sizes, e.g. [1,2,4,8,16]:
    # throughput and latency of batched decoding instead of the per-prompt speedups; null = off
    batch_size: Any = None
    # batch mode: runs of each size while its A/A twin is outside ±3%, at most (bench.repeats at
    # least; each run runs every contender once, in turn): one run per size left the twin at
    # 0.89x to 1.05x on a quiet machine
    batch_repeats: int = 4
    # batch mode: when the requests arrive (continuous batching): null = all at the start, a
    # rate in requests per second (seeded exponential gaps), or a list of seconds, one per prompt
    arrivals: Any = None

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes of batch mode ([] when it is off)."""
        if self.batch_size is None:
            return []
        return (
            [int(s) for s in self.batch_size]
            if isinstance(self.batch_size, list | tuple)
            else [int(self.batch_size)]
        )

    def __post_init__(self) -> None:
        for option in ("repeats", "max_new_tokens", "batch_repeats"):
            if int(getattr(self, option)) < 1:
                raise ValueError(f"bench.{option}={getattr(self, option)}: must be at least 1")
        lookup = self.prompt_lookup_tokens
        settings = list(lookup) if isinstance(lookup, list | tuple) else [lookup]
        if not settings or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in settings):
            raise ValueError(
                f"bench.prompt_lookup_tokens={lookup}: give a number of tokens >= 1, or a list of them"
            )
        self.prompt_lookup_tokens = [int(n) for n in settings] if isinstance(lookup, list | tuple) else lookup
        if self.batch_size is not None and (
            not self.batch_sizes or any(size < 1 for size in self.batch_sizes)
        ):
            raise ValueError(f"bench.batch_size={self.batch_size}: give a size >= 1 or a list of them")
        if self.arrivals is not None and not self.batch_sizes:
            raise ValueError("bench.arrivals needs batch mode: give bench.batch_size too")
        if self.interleave not in ("rounds", "prompts"):
            raise ValueError(f"bench.interleave={self.interleave!r}: use rounds (the default) or prompts")


store_schema("bench", "default", BenchConfig)


def bench_config(cfg: DictConfig) -> BenchConfig:
    return to_dataclass(BenchConfig, cfg.bench, "bench")
