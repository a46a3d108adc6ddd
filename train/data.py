"""Self-distillation data: the target answers a set of prompts, and its own
tokens (and final hidden states) become the drafters' training data.

The prompts are either the built-in mix (:mod:`specdec.train.prompts`: Magpie requests
the target writes itself, templated requests over varied task types, and the
passages the target writes for the summarization, extraction and retrieval
templates) or a user's JSONL file (``train.data.path``), which replaces the mix.
Responses are greedy by default: greedy verification accepts exactly the
target's greedy tokens, so those are the ones to learn.

Generations are cached under ``<artifacts_dir>/<target>/data/`` in folders
named by the generation settings, and reused by every drafter of that target.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.decoders.cli.config import store_schema
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.train import prompts as builtin
from specdec.train.generation import Generation, GenerationSettings, GenerationStore, Request, generate_all
from specdec.train.processes import process_state


@dataclass
class DataConfig:
    """``train.data``: which prompts, how many, and how the target answers them."""

    path: str | None = None  # JSONL of prompts; replaces the built-in mix
    magpie_prompts: int = 1024  # requests the target writes itself
    templated_prompts: int = 1024  # requests from task templates
    passages: int = 48  # texts the target writes for summarization / extraction / RAG prompts
    max_query_tokens: int = 64  # length limit of a Magpie request
    max_new_tokens: int = 128  # length limit of a response (and of a passage)
    query_temperature: float = 1.0  # Magpie requests are sampled, for variety
    response_temperature: float = 0.0  # 0 = greedy responses
    batch_size: int = 32
    heldout: float = 0.05  # share of sequences kept out of training, for evaluation
    seed: int = 0


store_schema("train_data", "base", DataConfig, package="train.data")


@dataclass
class Sequence:
    """One training sequence: a prompt and the target's response to it.

    hidden: (len(response), hidden) float16; row j is the target's final hidden
    state at the position that predicted response[j] (see :class:`Generation`).
    """

    id: str
    category: str
    prompt: list[int]
    response: list[int]
    hidden: torch.Tensor | None

    @property
    def heldout_key(self) -> float:
        """A stable number in [0, 1) from the id: sequences below ``heldout`` are held out."""
        return zlib.crc32(self.id.encode()) / 2**32


def self_distilled(pipeline: Pipeline, cfg: DataConfig, data_root: Path) -> list[Sequence]:
    """The target's responses to the configured prompts, generated or loaded from the cache."""
    responses = _store(pipeline, data_root, "responses", cfg.max_new_tokens, cfg.response_temperature, cfg)
    prompts: list[tuple[str, str, str]] = []  # (id, category, text)
    sequences: list[Sequence] = []
    if cfg.path:
        prompts = [(f"user/{i}", "user", text) for i, text in enumerate(read_prompt_file(Path(cfg.path)))]
    else:
        passages = _passages(pipeline, cfg, responses)
        sequences += [_sequence(id_, "passage", g) for id_, g in passages.items()]
        passage_texts = [_text(pipeline, g) for g in passages.values()]
        prompts += [(f"magpie/{i}", "magpie", text) for i, text in _magpie_requests(pipeline, cfg, data_root)]
        for i in range(cfg.templated_prompts):
            spec = builtin.templated_prompt(cfg.seed, i, cfg.passages)
            prompts.append((f"templated/{i}", spec.category, builtin.fill_passages(spec, passage_texts)))
    categories = {id_: category for id_, category, _ in prompts}
    requests = [Request(id_, tuple(pipeline.encode(text))) for id_, _, text in prompts]
    generations = _generate(pipeline, requests, responses, cfg, "responses")
    sequences += [_sequence(id_, categories[id_], g) for id_, g in generations.items()]
    return sequences


def split_heldout(sequences: list[Sequence], share: float) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out) sequences, split by a hash of the ids (stable as the set grows)."""
    heldout = [s for s in sequences if s.heldout_key < share]
    training = [s for s in sequences if s.heldout_key >= share]
    if not training:
        raise ValueError(f"train.data.heldout={share} leaves no training sequences")
    return training, heldout


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from JSONL: ``{"prompt": "..."}`` lines, or Spec-Bench questions
    (``{"turns": ["..."]}``, first turn used)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise FileNotFoundError(f"cannot read train.data.path={path}: {error.strerror}") from error
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"] if "prompt" in row else row["turns"][0]
            if not isinstance(text, str) or not text.strip():
                raise ValueError("the prompt is not a non-empty string")
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as error:
            raise ValueError(
                f'{path}:{number}: expected a JSON object with "prompt": "..." or "turns": ["..."] ({error})'
            ) from error
        texts.append(text)
    if not texts:
        raise ValueError(f"train.data.path={path} holds no prompts")
    return texts


def check_prompt_files(data: DataConfig, eval_path: str | None, eval_limit: int | None) -> None:
    """Read ``train.data.path`` and ``train.eval.path`` before the model loads: a missing eval
    file was found only after the training data had been generated."""
    from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload

    if data.path:
        read_prompt_file(Path(data.path))
    if eval_path:
        load_workload(WorkloadConfig(name="eval", path=eval_path, limit=eval_limit), "train.eval.path")


def eval_sequences(
    pipeline: Pipeline, cfg: DataConfig, data_root: Path, path: str, limit: int | None
) -> list[Sequence]:
    """The target's responses to a benchmark-style prompt file (Spec-Bench format),
    to measure drafters on prompts unlike the training ones; never trained on."""
    from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload

    responses = _store(pipeline, data_root, "responses", cfg.max_new_tokens, cfg.response_temperature, cfg)
    workload = load_workload(WorkloadConfig(name="eval", path=path, limit=limit), "train.eval.path")
    categories = {f"eval/{p.id}": p.category for p in workload}
    requests = [Request(f"eval/{p.id}", tuple(pipeline.encode(p.turns[0]))) for p in workload]
    generations = _generate(pipeline, requests, responses, cfg, "eval responses")
    return [_sequence(id_, categories[id_], g) for id_, g in generations.items()]


def _passages(pipeline: Pipeline, cfg: DataConfig, store: GenerationStore) -> dict[str, Generation]:
    requests = [
        Request(f"passage/{i}", tuple(pipeline.encode(builtin.passage_request(cfg.seed, i))))
        for i in range(cfg.passages)
    ]
    return _generate(pipeline, requests, store, cfg, "passages")


def _magpie_requests(pipeline: Pipeline, cfg: DataConfig, data_root: Path) -> list[tuple[int, str]]:
    """(index, text) of the Magpie requests that ended properly (an unfinished
    request is not a well-formed user turn)."""
    if cfg.magpie_prompts < 1:
        return []
    tokenizer = pipeline.tokenizer
    if tokenizer is None:
        raise ValueError("Magpie prompts need a tokenizer; set train.data.magpie_prompts=0")
    prefix = tuple(tokenizer.encode(builtin.pre_query_prefix(tokenizer), add_special_tokens=False))
    store = _store(pipeline, data_root, "queries", cfg.max_query_tokens, cfg.query_temperature, cfg)
    requests = [Request(f"magpie/{i}", prefix) for i in range(cfg.magpie_prompts)]
    settings = GenerationSettings(
        cfg.max_query_tokens,
        SamplingConfig(temperature=cfg.query_temperature, seed=cfg.seed),
        cfg.batch_size,
        False,
    )
    generations = generate_all(
        pipeline.model,
        requests,
        store,
        settings,
        pipeline.eos_token_ids(),
        _pad_id(pipeline),
        "magpie requests",
    )
    eos = pipeline.eos_token_ids()
    kept = []
    for i, request in enumerate(requests):
        generation = generations[request.id]
        text = _text(pipeline, generation)
        if generation.output and generation.output[-1] in eos and text:
            kept.append((i, text))
    if len(kept) < len(requests) and process_state().is_main_process:
        print(f"[train] {len(requests) - len(kept)} of {len(requests)} Magpie requests were unfinished or empty "
              "and are skipped", file=sys.stderr)  # fmt: skip
    return kept


def _generate(
    pipeline: Pipeline, requests: list[Request], store: GenerationStore, cfg: DataConfig, desc: str
) -> dict[str, Generation]:
    settings = GenerationSettings(
        cfg.max_new_tokens,
        SamplingConfig(temperature=cfg.response_temperature, seed=cfg.seed),
        cfg.batch_size,
        True,
    )
    return generate_all(
        pipeline.model, requests, store, settings, pipeline.eos_token_ids(), _pad_id(pipeline), desc
    )


def _store(
    pipeline: Pipeline, data_root: Path, stage: str, max_new_tokens: int, temperature: float, cfg: DataConfig
) -> GenerationStore:
    """The cache folder of one generation stage, named by what decides its outputs."""
    settings = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": cfg.seed,
        "dtype": str(pipeline.session.dtype),
    }
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return GenerationStore(data_root / f"{stage}-{digest}")


def _pad_id(pipeline: Pipeline) -> int:
    tokenizer = pipeline.tokenizer
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(pipeline.eos_token_ids(), default=0)


def _text(pipeline: Pipeline, generation: Generation) -> str:
    if pipeline.tokenizer is None:
        raise ValueError("the built-in prompts need a tokenizer; give token-id data another way")
    return pipeline.tokenizer.decode(generation.output, skip_special_tokens=True).strip()


def _sequence(id_: str, category: str, generation: Generation) -> Sequence:
    return Sequence(id_, category, generation.prompt, generation.output, generation.hidden)
