"""Distil a small draft model for :mod:`specdec.proposers.draft_model` from the target.

The draft is the target cut down to ``num_layers`` of its decoder layers (the
first N with ``layers: first``, or N spread evenly from the first to the last
with ``layers: spread``, or an explicit list) plus its embeddings, final norm
and LM head: an ordinary model of the target's family that shares its
tokenizer. It is then trained by knowledge distillation on the self-distilled
data (:mod:`specdec.train.data`): at every response position the draft's next-token
distribution q is fitted to the target's distribution p there. p comes from the
target's final hidden states cached with the data, p = softmax(lm_head(h)), so
no target pass is rerun and no logits are stored. ``loss`` chooses

    kl   KL(p || q) = sum_x p(x) (log p(x) - log q(x))    (forward KL, classic distillation)
    tv   TV(p, q) = 1/2 sum_x |p(x) - q(x)|              (speculative sampling accepts a draft token
                                                           with probability 1 - TV(p, q))

With ``draft_vocab_size=N`` (default 8192) both distributions are taken over
the N tokens the target outputs most often (p and q renormalised over them),
the vocabulary ``proposer.vocab_size=N`` drafts over: the three LM-head products
of a step (draft logits, target logits, the draft's gradient) dominate its cost
and shrink by vocab / N. For drafting over N tokens this is the exact objective:
its optimum q = p restricted to the N tokens attains the best acceptance any q
over them can (the target's mass inside them), and the same argmax among them.

A full fine-tune of the copied layers and final norm, not PEFT: the draft is a
model of its own, so there is no shared backbone to keep intact, and a stack of
a few layers has to learn much of what the 30 layers after it did, which a
low-rank update would restrict; with 4 layers it is ~14 M trainable weights.
The embeddings and LM head (28 M of the target's weights in SmolLM2) stay frozen:
they are the target's own, and the same frozen head turns the cached target
states into p, so the two distributions are scored over the same rows.

After training, the draft is measured on held-out sequences (and on
``train.eval.path`` prompts if given) against the draft it started from:
``top1`` (its argmax is the target's, i.e. greedy acceptance of one token),
``acceptance`` (mean 1 - TV(p, q) at temperature 1), ``chain_tau`` (tokens per
target pass of a greedy chain of ``chain_k`` under teacher forcing) and ``kl``,
both over the full vocabulary and over the reduced ones of ``vocab_sizes``.

Artifact, an ordinary Hugging Face model directory (``from_pretrained`` loads it)::

    config.json, model.safetensors, generation_config.json   the draft (float32)
    tokenizer files                                          the target's tokenizer
    draft_vocab.json   tokens ranked by how often the target output them in the training
                       responses (proposer.vocab_size=N drafts over the first N, FR-Spec)
    distill.json       layers taken, training settings, metrics before and after
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specdec.decoders.models.architecture import decoder_of
from specdec.proposers.draft_model import DraftVocabulary, save_draft_vocab
from specdec.train import checkpoints
from specdec.train.data import Sequence, split_heldout
from specdec.train.job import TrainJob
from specdec.train.loop import FitConfig, fit
from specdec.train.processes import process_state

META_FILE = "distill.json"
LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")  # decoder layer index in a state-dict key


@dataclass
class Config(FitConfig):
    """``drafter=draft_model`` options: architecture, loss, evaluation, and the FitConfig fields
    (``batch_size`` counts sequences here).

    A few of the target's own layers, its embeddings, final norm and head, distilled
    on the target's distributions (full fine-tune of the layers and norm; embeddings
    and head frozen). Stored as the ``drafter=draft_model`` structured config: these
    are the only defaults."""

    epochs: float = 3.0  # 3 epochs: Spec-Bench top-1 0.238 against 0.168 after 1 (docs/benchmarks.md)
    batch_size: int = 8
    lr: float = 0.003

    num_layers: int = 4
    layers: Any = "first"  # "first", "spread" (evenly from first to last), or a list of target layer indices
    loss: str = "kl"  # kl = KL(target || draft); tv = total variation (1 - acceptance at temperature 1)
    # distil over the N most frequent response tokens (pair with proposer.vocab_size=N); 0 = the whole vocabulary
    draft_vocab_size: int = 8192
    chain_k: int = 4  # draft length assumed by the chain_tau estimate
    vocab_sizes: list[int] = field(
        default_factory=lambda: [1024, 4096, 8192]
    )  # reduced vocabularies measured
    eval_batch_size: int = 8  # sequences per evaluation batch


LOSSES = ("kl", "tv")


def train(job: TrainJob) -> Path:
    cfg: Config = job.drafter_config(Config)
    if cfg.loss not in LOSSES:
        raise ValueError(f"drafter.loss={cfg.loss!r} is not one of {', '.join(LOSSES)}")
    if cfg.draft_vocab_size < 0:
        raise ValueError(
            f"drafter.draft_vocab_size must be >= 0 (0 = all tokens), got {cfg.draft_vocab_size}"
        )
    target = job.pipeline.model
    layers = chosen_layers(cfg.layers, cfg.num_layers, target.config.num_hidden_layers)
    sequences = job.sequences()
    training, heldout = split_heldout(sequences, job.data_config.heldout)
    rows = training_rows(training)
    if job.is_main_process:
        print(f"[train] draft_model: target layers {layers}, {int(rows['response_len'].sum())} training positions "
              f"from {len(rows['input_ids'])} sequences, {len(heldout)} held out", file=sys.stderr)  # fmt: skip

    token_counts = torch.bincount(
        torch.cat([torch.tensor(s.response) for s in training]), minlength=target.config.vocab_size
    )  # (vocab,)
    output = job.output_dir
    output.mkdir(parents=True, exist_ok=True)
    if job.is_main_process:
        save_draft_vocab(output, token_counts)
    process_state().wait_for_everyone()  # every process reads the ranking below
    ranked = int((token_counts > 0).sum())
    vocabularies = {
        size: DraftVocabulary.load(output, size)
        for size in sorted({*cfg.vocab_sizes, cfg.draft_vocab_size} - {0})
        if size <= ranked
    }

    draft = build_draft(target, layers)
    head = draft.get_output_embeddings()  # the target's frozen head
    if cfg.draft_vocab_size:
        head = DraftVocabulary.load(output, min(cfg.draft_vocab_size, ranked)).head(head)
    initial = {"heldout": evaluate(draft, heldout, cfg, vocabularies)}

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        draft_logits, target_logits = response_logits(draft, head, batch)  # (P, draft vocab) each
        metrics = {
            "top1": float((draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()),
            "acceptance": float(1 - total_variation(draft_logits.detach(), target_logits).mean()),
        }
        return distillation_loss(draft_logits, target_logits, cfg.loss), metrics

    checkpoint = output / "checkpoint"
    start = time.perf_counter()
    fingerprint = _fingerprint(job, cfg, layers, rows)
    last = fit(draft, rows, loss_fn, cfg, checkpoint, fingerprint, job.logger,
               job.resume, job.scale)  # fmt: skip
    seconds = time.perf_counter() - start
    if not job.is_main_process:
        return output

    metrics = {"heldout": evaluate(draft, heldout, cfg, vocabularies)}
    evaluation = job.eval_sequences()
    if evaluation:
        metrics["eval"] = evaluate(draft, evaluation, cfg, vocabularies)
        initial["eval"] = evaluate(build_draft(target, layers), evaluation, cfg, vocabularies)
    for split in metrics:
        print(f"[train] {split}: initial {format_metrics(initial[split])}", file=sys.stderr)
        print(f"[train] {split}: distilled {format_metrics(metrics[split])}", file=sys.stderr)
    job.logger.summary(
        {f"{split}/{key}": value for split, values in metrics.items() for key, value in values.items()}
    )

    draft.save_pretrained(output)
    if job.pipeline.tokenizer is not None:
        job.pipeline.tokenizer.save_pretrained(output)
    meta = {
        "drafter": "draft_model",
        "target": job.pipeline.context.target_key,
        "target_layers": layers,
        "draft_vocab_size": cfg.draft_vocab_size and min(cfg.draft_vocab_size, ranked),
        "parameters": sum(p.numel() for p in draft.parameters()),
        "trainable_parameters": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "training_seconds": round(seconds, 1),
        "metrics": metrics,
        "initial_metrics": initial,
        "train_metrics": last,
        "training": job.training_record(cfg, len(training), int(rows["response_len"].sum())),
    }
    (output / META_FILE).write_text(json.dumps(meta, indent=2))
    checkpoints.remove(checkpoint, fingerprint)
    return output


def chosen_layers(choice: Any, num_layers: int, target_layers: int) -> list[int]:
    """The target's layer indices the draft starts from, in order."""
    if choice == "first":
        layers = list(range(num_layers))
    elif choice == "spread":
        layers = [round(i * (target_layers - 1) / max(num_layers - 1, 1)) for i in range(num_layers)]
    elif isinstance(choice, (list, tuple)):
        layers = [int(i) for i in choice]
    else:
        raise ValueError(f"drafter.layers={choice!r}: use first, spread, or a list of target layer indices")
    if not layers or sorted(set(layers)) != layers or not 0 <= layers[0] <= layers[-1] < target_layers:
        raise ValueError(
            f"drafter.layers gives {layers}: the draft needs distinct ascending target layer indices in "
            f"[0, {target_layers}); set drafter.num_layers between 1 and {target_layers}"
        )
    return layers


def build_draft(target: nn.Module, layers: list[int]) -> nn.Module:
    """A float32 model of the target's class with the target's decoder layers ``layers``
    (renumbered 0..N-1), embeddings, final norm and head; only the layers and the norm train."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    renumbered = {source: index for index, source in enumerate(layers)}
    state = {}
    for key, value in target.state_dict().items():
        match = LAYER_KEY.search(key)
        if match is None:
            state[key] = value.float()
        elif int(match[1]) in renumbered:
            state[f"{key[: match.start()]}.layers.{renumbered[int(match[1])]}.{key[match.end() :]}"] = (
                value.float()
            )
    draft.load_state_dict(state)  # strict: every draft weight comes from the target
    if getattr(target, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(target.generation_config)
    draft.to(next(target.parameters()).device)
    draft.requires_grad_(True)
    draft.get_input_embeddings().requires_grad_(False)
    draft.get_output_embeddings().requires_grad_(False)
    return draft.eval()


def training_rows(sequences: list[Sequence]) -> dict[str, torch.Tensor]:
    """Right-padded sequences for the draft and the target's states at their responses.

    input_ids (N, L): prompt + response[:-1] (the draft sees what the target saw);
    length (N,); response_start (N,): the position predicting response[0];
    response_len (N,); target_hidden (N, R, hidden) float16: row j is the target's
    final state where it predicted response[j] (zeros past response_len).
    """
    usable = [s for s in sequences if s.response and s.hidden is not None]
    if not usable:
        raise ValueError("no sequence has a response with the target's hidden states; regenerate the data")
    inputs = [s.prompt + s.response[:-1] for s in usable]
    width = max(len(ids) for ids in inputs)
    responses = max(len(s.response) for s in usable)
    input_ids = torch.zeros(
        len(usable), width, dtype=torch.long
    )  # (N, L); pads come last: causal attention ignores them
    target_hidden = torch.zeros(
        len(usable), responses, usable[0].hidden.shape[-1], dtype=torch.float16
    )  # (N, R, hidden)
    for row, (sequence, ids) in enumerate(zip(usable, inputs)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        target_hidden[row, : len(sequence.response)] = sequence.hidden
    return {
        "input_ids": input_ids,
        "length": torch.tensor([len(ids) for ids in inputs]),
        "response_start": torch.tensor([len(s.prompt) - 1 for s in usable]),
        "response_len": torch.tensor([len(s.response) for s in usable]),
        "target_hidden": target_hidden,
    }


def response_logits(
    draft: nn.Module, head: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits, target logits) through ``head`` (the target's, or its rows for a
    draft vocabulary), each (P, head outputs) float32, at the batch's P response
    positions in order; the head runs on those positions only."""
    width = int(batch["length"].max())
    responses = int(batch["response_len"].max())
    device = next(draft.parameters()).device
    input_ids = batch["input_ids"][:, :width].to(device)  # (B, L)
    hidden = decoder_of(draft)(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, L, hidden)
    offsets = torch.arange(responses)  # (R,)
    valid = offsets[None, :] < batch["response_len"][:, None]  # (B, R)
    positions = (batch["response_start"][:, None] + offsets[None, :]).clamp(max=width - 1)  # (B, R)
    rows = torch.arange(len(input_ids))[:, None].expand_as(positions)  # (B, R)
    draft_hidden = hidden[rows[valid], positions[valid]]  # (P, hidden)
    target_hidden = batch["target_hidden"][:, :responses][valid].to(device, torch.float32)  # (P, hidden)
    return head(draft_hidden).float(), head(target_hidden).float()


def distillation_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over positions of KL(p || q) or TV(p, q); logits (P, vocab)."""
    if kind == "tv":
        return total_variation(draft_logits, target_logits).mean()
    return nn.functional.kl_div(
        draft_logits.log_softmax(-1), target_logits.log_softmax(-1), reduction="batchmean", log_target=True
    )


def total_variation(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """(P,) 1/2 sum |p - q|: one minus the probability that speculative sampling accepts
    a token drawn from q (Leviathan et al. 2023)."""
    return 0.5 * (target_logits.softmax(-1) - draft_logits.softmax(-1)).abs().sum(-1)


@torch.no_grad()
def evaluate(
    draft: nn.Module, sequences: list[Sequence], cfg: Config, vocabularies: dict[int, DraftVocabulary]
) -> dict:
    """Agreement of the draft with the target on ``sequences`` (teacher-forced), over the
    full vocabulary and over each reduced one (metrics suffixed ``_v<N>``)."""
    if not sequences:
        return {}
    rows = training_rows(sequences)
    draft.eval()
    variants: dict[str, torch.Tensor | None] = {"": None}
    variants.update({f"_v{size}": vocabulary.token_ids for size, vocabulary in vocabularies.items()})
    sums: dict[str, float] = {}
    for start in range(0, len(rows["input_ids"]), cfg.eval_batch_size):
        batch = {key: value[start : start + cfg.eval_batch_size] for key, value in rows.items()}
        draft_logits, target_logits = response_logits(
            draft, draft.get_output_embeddings(), batch
        )  # (P, vocab)
        target_top = target_logits.argmax(-1)  # (P,)
        for suffix, token_ids in variants.items():
            logits = draft_logits if token_ids is None else _restricted(draft_logits, token_ids)
            matches = logits.argmax(-1) == target_top  # (P,)
            values = {
                "top1": float(matches.sum()),
                "acceptance": float((1 - total_variation(logits, target_logits)).sum()),
                "chain_accepted": _chain_accepted(matches, batch["response_len"].tolist(), cfg.chain_k),
            }
            if token_ids is None:
                values["kl"] = float(distillation_loss(logits, target_logits, "kl")) * len(matches)
            for key, value in values.items():
                sums[key + suffix] = sums.get(key + suffix, 0.0) + value
    positions = int(rows["response_len"].sum())
    metrics: dict[str, Any] = {"positions": positions}
    for key, total in sums.items():
        name = key.replace("chain_accepted", "chain_tau")
        metrics[name] = round((1 if name.startswith("chain_tau") else 0) + total / positions, 4)
    return metrics


def _restricted(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(P, vocab) logits with every token outside ``token_ids`` at -inf (q = 0 there)."""
    restricted = torch.full_like(logits, float("-inf"))
    restricted[:, token_ids] = logits[:, token_ids]
    return restricted


def _chain_accepted(matches: torch.Tensor, lengths: list[int], k: int) -> float:
    """Sum over response positions of the draft tokens a greedy chain of ``k`` starting
    there would get accepted: the run of consecutive matches, at most ``k``."""
    total = 0
    for sequence_matches in matches.split(lengths):
        run = 0
        for match in reversed(sequence_matches.tolist()):
            run = run + 1 if match else 0
            total += min(run, k)
    return float(total)


def format_metrics(metrics: dict) -> str:
    reduced = [key.removeprefix("top1_") for key in metrics if key.startswith("top1_v")]
    text = (
        f"{metrics['positions']} positions, top-1 {metrics['top1']:.3f}, acceptance (1 - TV) "
        f"{metrics['acceptance']:.3f}, chain tau {metrics['chain_tau']:.3f}, KL {metrics['kl']:.3f}"
    )
    return text + "".join(
        f"; {v}: top-1 {metrics['top1_' + v]:.3f}, 1 - TV {metrics['acceptance_' + v]:.3f}" for v in reduced
    )


def _fingerprint(job: TrainJob, cfg: Config, layers: list[int], rows: dict[str, torch.Tensor]) -> str:
    settings = {
        "drafter": asdict(cfg),
        "layers": layers,
        "data": asdict(job.data_config),
        "target": job.pipeline.context.target_key,
        "positions": int(rows["response_len"].sum()),
    }
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()
