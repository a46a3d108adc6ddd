"""Command line: benchmark pipelines against standard decoding (and HF peers).

    python -m decoders.bench                                  # every available pipeline
    python -m decoders.bench proposer=ngram verifier=greedy bench.peers=true
    python -m decoders.bench workload=spec_bench workload.path=question.jsonl workload.limit=2

All contenders share one process and one loaded target. After a warm-up they
run prompt by prompt, interleaved (the order rotates from prompt to prompt), so
slow drift of the machine hits them alike; speedups are ratios measured side by
side. results.json is rewritten after every prompt, so an interrupted run keeps
what it finished.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decoders.registry import import_plugins_from_argv

import_plugins_from_argv()

from decoders import Pipeline  # noqa: E402
from decoders.config import (  # noqa: E402
    CONF_DIR,
    component,
    load_plugins,
    model_config,
    sampling_config,
    workload_config,
)
from decoders.metrics import Record, pipeline_entry  # noqa: E402
from decoders.models import load_model, resolve_device  # noqa: E402
from decoders.peers import make_peers  # noqa: E402
from decoders.registry import proposer_registry  # noqa: E402
from decoders.workloads import Prompt, load_workload  # noqa: E402


@dataclass
class Contender:
    """Something the benchmark times on each prompt."""

    name: str
    kind: str  # standard | speculative | peer
    proposer: str | None
    verifier: str | None
    run: Callable[[list[int], int], Record]
    lossless: bool = True
    info: dict | None = None


def pipeline_contender(pipeline: Pipeline) -> Contender:
    def run(prompt_ids: list[int], max_new_tokens: int) -> Record:
        result = pipeline.generate(prompt_ids, max_new_tokens)
        s = result.stats
        return Record(
            "", "", 0, 0, s.new_tokens, s.wall_time, result.tokens,
            s.target_passes, s.proposed, s.accepted, s.draft_time, s.verify_time, s.emitted_per_round,
        )  # fmt: skip

    if pipeline.proposer is None:
        return Contender("standard", "standard", None, None, run)
    return Contender(
        pipeline.name,
        "speculative",
        pipeline.proposer.name,
        pipeline.verifier.name,  # type: ignore[union-attr]
        run,
        pipeline.verifier.lossless,  # type: ignore[union-attr]
        {"proposer": pipeline.proposer.describe(), "proposer_config": vars(pipeline.proposer.config)},
    )


def peer_contender(peer) -> Contender:
    def run(prompt_ids: list[int], max_new_tokens: int) -> Record:
        tokens, elapsed = peer.run(prompt_ids, max_new_tokens)
        return Record("", "", 0, 0, len(tokens), elapsed, tokens)

    return Contender(peer.name, "peer", None, None, run)


def build_pipelines(cfg: DictConfig, base: Pipeline) -> list[Pipeline]:
    """The speculative pipelines this run measures."""
    proposer_cfg = component(cfg, "proposer")
    verifier_cfg = component(cfg, "verifier")
    if proposer_cfg is not None:
        return [base.with_components(proposer_cfg, verifier_cfg)]
    pipelines = []
    for name in proposer_registry.names():
        try:
            pipelines.append(base.with_components(name, verifier_cfg))
        except FileNotFoundError as missing:  # a trained artifact is missing: say how to make it
            print(f"[bench] skipping {name}: {missing}", file=sys.stderr)
    return pipelines


def prompt_turns(pipeline: Pipeline, prompt: Prompt, first_answers: dict[str, str]) -> list[list[int]]:
    """Token ids of each turn; turn 2 carries the standard pipeline's first answer."""
    turns = []
    for turn, text in enumerate(prompt.turns):
        if turn == 0:
            turns.append(pipeline.encode(text))
        else:
            messages = [
                {"role": "user", "content": prompt.turns[0]},
                {"role": "assistant", "content": first_answers.get(prompt.id, "")},
                {"role": "user", "content": text},
            ]
            turns.append(pipeline.encode(messages))
    return turns


def write_json(path: Path, payload: dict) -> None:
    """Atomic write: an interrupted run never leaves a truncated results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(tmp, path)


def results_payload(cfg: DictConfig, base: Pipeline, contenders, records, prompts_done: int) -> dict:
    sampling = base.sampling
    baseline = records["standard"]
    pipelines = []
    for contender in contenders:
        entry = pipeline_entry(
            contender.name,
            contender.kind,
            contender.proposer,
            contender.verifier,
            records[contender.name],
            baseline,
            sampling.greedy,
        )
        entry["lossless"] = contender.lossless
        if contender.info:
            entry["info"] = contender.info
        entry["records"] = [r.as_dict() for r in records[contender.name]]
        pipelines.append(entry)
    return {
        "model": base.context.target_key,
        "dtype": str(base.session.dtype).removeprefix("torch."),
        "device": str(base.session.device),
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "max_new_tokens": cfg.bench.max_new_tokens,
        "prompts": prompts_done,
        "workload": cfg.workload.name,
        "repeats": cfg.bench.repeats,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "pipelines": pipelines,
    }


def run_benchmark(cfg: DictConfig) -> dict:
    load_plugins(cfg)
    model_cfg = model_config(cfg)
    sampling = sampling_config(cfg)
    target, tokenizer = load_model(model_cfg)
    base = Pipeline(
        target,
        tokenizer,
        sampling=sampling,
        model_config=model_cfg,
        artifacts_dir=cfg.artifacts_dir,
        max_new_tokens=cfg.bench.max_new_tokens,
    )
    pipelines = [base] + build_pipelines(cfg, base)
    contenders = [pipeline_contender(p) for p in pipelines]
    if cfg.bench.peers:
        proposers = {p.proposer.name: p.proposer for p in pipelines if p.proposer is not None}
        peers = make_peers(target, sorted(base.eos_token_ids()), sampling, proposers)
        contenders += [peer_contender(peer) for peer in peers]
    prompts = load_workload(workload_config(cfg))
    output = Path(cfg.bench.output)
    max_new = cfg.bench.max_new_tokens
    print(
        f"[bench] {len(prompts)} prompts x {cfg.bench.repeats} repeat(s), max_new_tokens={max_new}, "
        f"contenders: {', '.join(c.name for c in contenders)}; device {base.session.device}, "
        f"dtype {base.session.dtype}",
        file=sys.stderr,
    )

    warm_ids = base.encode(prompts[0].turns[0])
    for contender in tqdm(contenders, desc="warm-up", leave=False):
        for _ in range(max(cfg.bench.warmup, 0)):
            contender.run(warm_ids, min(max_new, 32))

    records: dict[str, list[Record]] = {c.name: [] for c in contenders}
    first_answers: dict[str, str] = {}
    payload: dict[str, Any] = {}
    progress = tqdm(prompts, desc="prompts")
    try:
        for number, prompt in enumerate(progress):
            for turn, prompt_ids in enumerate(prompt_turns(base, prompt, first_answers)):
                for repeat in range(cfg.bench.repeats):
                    shift = (number + repeat) % len(contenders)
                    for contender in contenders[shift:] + contenders[:shift]:
                        record = contender.run(prompt_ids, max_new)
                        record = replace(record, prompt_id=prompt.id, category=prompt.category, turn=turn, repeat=repeat)
                        records[contender.name].append(record)
                        if contender.kind == "standard" and turn == 0 and repeat == 0 and tokenizer is not None:
                            first_answers[prompt.id] = tokenizer.decode(record.tokens, skip_special_tokens=True)
            payload = results_payload(cfg, base, contenders, records, number + 1)
            write_json(output, payload)
            progress.set_postfix(
                {e["name"][:14]: f"{e['speedup']:.2f}x" for e in payload["pipelines"] if e["kind"] != "standard"}
            )
    except KeyboardInterrupt:
        print(f"\n[bench] interrupted: results of the finished prompts are in {output}", file=sys.stderr)
        raise
    return payload


def format_table(payload: dict) -> str:
    header = f"{'pipeline':<28} {'kind':<11} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'accept':>7} {'same':>6}"
    lines = [header, "-" * len(header)]

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    for e in payload["pipelines"]:
        lines.append(
            f"{e['name']:<28} {e['kind']:<11} {e['tokens_per_s']:>8.2f} {e['speedup']:>7.2f}x "
            f"{fmt(e['mean_accepted_tokens'], '6.2f'):>6} {fmt(e['acceptance_rate'], '7.3f'):>7} "
            f"{fmt(e['identical_outputs'], '6.2f'):>6}"
        )
    return "\n".join(lines)


@hydra.main(config_path=CONF_DIR, config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    resolve_device(cfg.model.device)  # fail early on a bad device name
    payload = run_benchmark(cfg)
    print(format_table(payload))
    print(f"[bench] wrote {cfg.bench.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
