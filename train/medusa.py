"""Fit Medusa heads (:mod:`proposers.medusa`) on the target's self-distilled data.

The backbone stays frozen and untouched. Each head's residual block is trained
in full; each head's language-model projection starts from the target's own
``lm_head`` weight (shared, never copied or changed) and is adapted with a PEFT
LoRA adapter. The target's final hidden states come cached with the data, so
no epoch reruns the target.

Training rows: for a response r (n tokens) with hidden states H (row j predicted
r[j]), row j trains head k to predict r[j + 1 + k], the token k + 2 positions
after H[j]'s position; labels past the response's end are ignored. The loss is
sum_k decay^k * cross-entropy_k (Medusa's weighting: later heads are harder and
matter less, since they only count when every earlier head was right).

After training, the heads are measured on held-out sequences (and on
``train.eval.path`` prompts if given): per-head top-1/top-5 accuracy, the
accuracy of each rank (which builds the default tree), and ``chain_tau``, the
tokens per target pass a greedy chain would get on that data (1 + the mean
number of leading heads that are right).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from proposers.medusa import LORA_TARGETS, MedusaHeads, best_tree, save_artifact
from train.data import Sequence, split_heldout
from train.job import TrainJob
from train.loop import FitConfig, fit

IGNORE = -100  # label of rows whose target token lies past the response


@dataclass
class Config(FitConfig):
    """``drafter=medusa`` options: architecture, adapter, loss, tree, and the FitConfig fields."""

    num_heads: int = 4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    head_decay: float = 0.8  # loss weight of head k is head_decay ** k
    tree_nodes: int = 16  # size of the default tree stored with the artifact
    top_ranks: int = 10  # ranks whose accuracy is measured (tree candidates)
    eval_batch_size: int = 512


def train(job: TrainJob) -> Path:
    cfg: Config = job.drafter_config(Config)
    sequences = job.sequences()
    training, heldout = split_heldout(sequences, job.data_config.heldout)
    rows = training_rows(training, cfg.num_heads)
    print(f"[train] medusa: {len(rows['hidden'])} training positions from {len(training)} sequences, "
          f"{len(heldout)} held out", file=sys.stderr)  # fmt: skip

    lm_head = job.pipeline.model.get_output_embeddings()
    vocab_size, hidden_size = lm_head.weight.shape
    heads, peft_heads = build_heads(lm_head, cfg)
    weights = torch.tensor([cfg.head_decay**k for k in range(cfg.num_heads)])  # (K,)

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = peft_heads(batch["hidden"].to(heads.dtype))  # (B, K, vocab)
        labels = batch["labels"]  # (B, K)
        losses = nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none"
        )  # (B, K)
        valid = labels != IGNORE  # (B, K)
        per_head = (losses * valid).sum(0) / valid.sum(0).clamp(min=1)  # (K,)
        correct = (logits.argmax(-1) == labels) & valid  # (B, K)
        accuracy = correct.sum(0) / valid.sum(0).clamp(min=1)  # (K,)
        metrics = {f"top1/head{k}": float(accuracy[k]) for k in range(cfg.num_heads)}
        return (per_head * weights).sum(), metrics

    fingerprint = _fingerprint(job, cfg, len(rows["hidden"]))
    checkpoint = job.output_dir / "checkpoint.pt"
    last = fit(heads, rows, loss_fn, cfg, checkpoint, fingerprint, job.logger, resume=job.resume)

    metrics = {"heldout": evaluate(heads, heldout, cfg)}
    evaluation = job.eval_sequences()
    if evaluation:
        metrics["eval"] = evaluate(heads, evaluation, cfg)
        for category in sorted({s.category for s in evaluation}):
            metrics[f"eval/{category}"] = evaluate(
                heads, [s for s in evaluation if s.category == category], cfg
            )
    for split, values in metrics.items():
        print(f"[train] {split}: " + format_metrics(values), file=sys.stderr)
    job.logger.summary(
        {f"{split}/{key}": value for split, values in metrics.items() for key, value in values.items()}
    )

    token_ranking = rank_tokens(training, vocab_size)
    meta = {
        "drafter": "medusa",
        "target": job.pipeline.context.target_key,
        "num_heads": cfg.num_heads,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "trainable_parameters": sum(p.numel() for p in heads.parameters() if p.requires_grad),
        "tree": best_tree(metrics["heldout"]["rank_accuracy"], cfg.tree_nodes),
        "metrics": metrics["heldout"],
        "eval_metrics": {split: values for split, values in metrics.items() if split != "heldout"},
        "draft_vocab_coverage": vocab_coverage(token_ranking, heldout),
        "train_metrics": last,
        "training": {
            "config": asdict(cfg),
            "data": asdict(job.data_config),
            "sequences": len(training),
            "positions": len(rows["hidden"]),
        },
    }
    print(f"[train] share of held-out response tokens within the N most frequent training tokens: "
          f"{meta['draft_vocab_coverage']}", file=sys.stderr)  # fmt: skip
    save_artifact(peft_heads, job.output_dir, meta, token_ranking)
    checkpoint.unlink(missing_ok=True)
    return job.output_dir


def build_heads(lm_head: nn.Linear, cfg: Config) -> tuple[MedusaHeads, nn.Module]:
    """Fresh heads in float32 over ``lm_head`` (shared when it is float32) with LoRA
    on their projections; returns (heads, the PeftModel wrapping them)."""
    from peft import LoraConfig, get_peft_model

    if lm_head.weight.dtype != torch.float32:  # train in float32; the target keeps its weights
        lm_head = _frozen_float32_copy(lm_head)
    torch.manual_seed(cfg.seed)  # LoRA's A matrices are random
    heads = MedusaHeads(lm_head, cfg.num_heads)
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=LORA_TARGETS,
        bias="none",
    )
    peft_heads = get_peft_model(heads, lora)
    heads.blocks.requires_grad_(True)  # the residual blocks are trained in full
    return heads, peft_heads


def _frozen_float32_copy(lm_head: nn.Linear) -> nn.Linear:
    copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None)
    copy.load_state_dict({k: v.float() for k, v in lm_head.state_dict().items()})
    return copy.to(lm_head.weight.device).requires_grad_(False)


def training_rows(sequences: list[Sequence], num_heads: int) -> dict[str, torch.Tensor]:
    """hidden (N, hidden) float16 and labels (N, K): one row per response position
    that has at least head 0's label."""
    hidden_parts, label_parts = [], []
    for sequence in sequences:
        n = len(sequence.response)
        if n < 2 or sequence.hidden is None:
            continue
        response = torch.tensor(sequence.response + [IGNORE] * num_heads)  # padded with IGNORE
        rows = torch.arange(n - 1)  # (n - 1,)
        offsets = 1 + torch.arange(num_heads)  # (K,) head k's label is k + 1 tokens after row j's own
        label_parts.append(response[rows[:, None] + offsets[None, :]])  # (n - 1, K)
        hidden_parts.append(sequence.hidden[: n - 1])
    if not hidden_parts:
        raise ValueError("no training sequence has two or more response tokens; generate longer responses")
    return {"hidden": torch.cat(hidden_parts), "labels": torch.cat(label_parts)}


@torch.no_grad()
def evaluate(heads: MedusaHeads, sequences: list[Sequence], cfg: Config) -> dict:
    """Per-head accuracies on ``sequences``: top1, top5, rank_accuracy[k][r] (head k's
    rank-r token is right), and chain_tau (tokens per pass of a greedy chain)."""
    rows = training_rows(sequences, cfg.num_heads)
    rank_hits = torch.zeros(cfg.num_heads, cfg.top_ranks)  # (K, ranks)
    valid_counts = torch.zeros(cfg.num_heads)  # (K,)
    accepted = 0.0
    for start in range(0, len(rows["hidden"]), cfg.eval_batch_size):
        hidden = rows["hidden"][start : start + cfg.eval_batch_size].to(heads.dtype)  # (B, hidden)
        labels = rows["labels"][start : start + cfg.eval_batch_size]  # (B, K)
        ranked = heads(hidden).topk(cfg.top_ranks, dim=-1).indices  # (B, K, ranks)
        hits = ranked == labels[..., None]  # (B, K, ranks); IGNORE never matches
        rank_hits += hits.sum(0)
        valid_counts += (labels != IGNORE).sum(0)
        top1 = hits[..., 0].long()  # (B, K)
        accepted += float(top1.cumprod(dim=1).sum())  # leading heads that are right, summed over rows
    rank_accuracy = rank_hits / valid_counts.clamp(min=1)[:, None]  # (K, ranks)
    return {
        "positions": len(rows["hidden"]),
        "top1": [round(float(a), 4) for a in rank_accuracy[:, 0]],
        "top5": [round(float(a), 4) for a in rank_accuracy[:, :5].sum(1)],
        "rank_accuracy": [[round(float(a), 4) for a in head] for head in rank_accuracy],
        "chain_tau": round(1 + accepted / max(len(rows["hidden"]), 1), 4),
    }


def rank_tokens(sequences: list[Sequence], vocab_size: int) -> torch.Tensor:
    """Token ids seen in the responses, most frequent first: (seen,) int64."""
    tokens = torch.tensor([t for s in sequences for t in s.response], dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)  # (vocab,)
    order = torch.sort(counts, descending=True, stable=True).indices  # (vocab,)
    return order[: int((counts > 0).sum())]


def vocab_coverage(token_ranking: torch.Tensor, sequences: list[Sequence]) -> dict[str, float]:
    """Share of the response tokens of ``sequences`` within the top-N of the ranking,
    for a few drafting vocabulary sizes N (what restricting the heads to N tokens costs)."""
    tokens = torch.tensor([t for s in sequences for t in s.response], dtype=torch.long)
    if not len(tokens):
        return {}
    position = torch.full((int(max(tokens.max(), token_ranking.max())) + 1,), len(token_ranking))
    position[token_ranking] = torch.arange(len(token_ranking))
    ranks = position[tokens]  # (tokens,) rank of each token in the training ranking
    return {str(n): round(float((ranks < n).float().mean()), 4) for n in (1024, 2048, 4096, 8192, 16384)}


def format_metrics(metrics: dict) -> str:
    return (
        f"{metrics['positions']} positions, top-1 per head {metrics['top1']}, "
        f"top-5 {metrics['top5']}, chain tau {metrics['chain_tau']}"
    )


def _fingerprint(job: TrainJob, cfg: Config, positions: int) -> str:
    settings = {"drafter": asdict(cfg), "data": asdict(job.data_config), "positions": positions}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()
