"""Fit Medusa heads (:mod:`specdec.proposers.medusa`) on the target's self-distilled data.

The backbone stays frozen and untouched. Each head's residual block is trained
in full; each head's language-model projection starts from the target's own
``lm_head`` weight (its rows for the draft vocabulary, frozen) and is adapted
with a PEFT LoRA adapter. The target's final hidden states come cached with the
data, so no epoch reruns the target.

Draft vocabulary: the ``draft_vocab_size`` tokens most frequent in the training
responses (0 = all tokens). Heads score only those, which makes both training
and drafting cheaper by vocab / draft_vocab_size on the projection; a label
outside it is skipped by the loss and counted as a miss by every accuracy.

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

One module for the whole recipe (about 470 lines): rows, loss, copy-head
sequences and measurement all read the same heads and rows, and a reader follows
the recipe from top to bottom.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specdec.decoders.models.session import ModelSession
from specdec.proposers.copy_attention import label_probability, mixture
from specdec.proposers.medusa.artifact import CONFIG_FILE, load_artifact, save_artifact
from specdec.proposers.medusa.heads import LORA_TARGETS, MedusaHeads
from specdec.proposers.medusa.trees import best_tree
from specdec.train import checkpoints
from specdec.train.data import Sequence, split_heldout
from specdec.train.job import TrainJob
from specdec.train.loop import FitConfig, fit

IGNORE = -100  # label of rows whose target token lies past the response


@dataclass
class Config(FitConfig):
    """``drafter=medusa`` options: architecture, adapter, loss, tree, and the FitConfig fields.

    Residual blocks trained in full, LoRA on the heads' lm projections (which start
    from the target's lm_head). Stored as the ``drafter=medusa`` structured config:
    these are the only defaults."""

    epochs: float = 3.0
    num_heads: int = 4
    sequential: bool = True  # heads also read the previous token and head (Hydra); false = Medusa-1 heads
    draft_vocab_size: int = 8192  # most frequent training tokens the heads score; 0 = all
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    head_decay: float = 0.8  # loss weight of head k is head_decay ** k
    # copy heads: share of each head's loss taken on the target's own distribution over the
    # token (its distill_top most likely tokens at temperature 1, renormalised) instead of
    # the response's token alone (0 = the response's token only)
    distill_weight: float = 0.0
    distill_top: int = 8
    copy_width: int = 128  # copy heads: a pointer of this width into the context (proposers/copy_attention.py); 0 = plain heads
    copy_batch_size: int = 4  # copy heads: sequences per step (they train on whole sequences)
    tree_nodes: int = 16  # size of the default tree stored with the artifact
    top_ranks: int = 10  # ranks whose accuracy is measured (tree candidates)
    eval_batch_size: int = 512


def train(job: TrainJob) -> Path:
    cfg: Config = job.drafter_config(Config)
    if job.eval_only:
        job.measured_artifact(CONFIG_FILE)  # a missing artifact is said before any data is generated
    training, heldout = split_heldout(job.sequences(), job.data_config.heldout)
    lm_head = job.pipeline.model.get_output_embeddings()
    embeddings = job.pipeline.model.get_input_embeddings()
    if job.eval_only:  # measure the existing artifact again (e.g. on new eval prompts)
        if not job.is_main_process:
            return job.output_dir
        directory = job.measured_artifact(CONFIG_FILE)
        artifact = load_artifact(directory, lm_head, embeddings)
        job.record_measurement(
            directory, CONFIG_FILE, artifact.meta, measure(job, artifact.heads, heldout, cfg)
        )
        return directory
    vocab_size, hidden_size = lm_head.weight.shape
    draft_vocab = draft_vocabulary(training, vocab_size, cfg.draft_vocab_size)
    heads, peft_heads = build_heads(lm_head, cfg, draft_vocab, embeddings)
    weights = torch.tensor([cfg.head_decay**k for k in range(cfg.num_heads)], device=heads.device)  # (K,)
    if not 0.0 <= cfg.distill_weight <= 1.0 or cfg.distill_top < 1:
        raise ValueError(
            f"drafter.distill_weight must lie in [0, 1] and drafter.distill_top be >= 1, got "
            f"{cfg.distill_weight} and {cfg.distill_top}"
        )
    if cfg.distill_weight and not cfg.copy_width:
        raise ValueError("drafter.distill_weight > 0 needs copy heads (drafter.copy_width > 0)")
    if cfg.copy_width:
        rows = context_rows(job.pipeline, training)
        positions = int((rows["length"] - rows["prompt_len"] - 1).sum())
        if cfg.distill_weight:
            rows.update(target_distributions(lm_head, rows, cfg.distill_top))
        loss_fn = copy_loss(heads, peft_heads, weights, cfg.distill_weight)
        fit_cfg = replace(cfg, batch_size=cfg.copy_batch_size)
    else:
        rows = training_rows(training, cfg.num_heads)
        rows["targets"] = vocab_index(rows["labels"], draft_vocab, vocab_size)
        positions = len(rows["hidden"])
        loss_fn = head_loss(heads, peft_heads, weights, cfg.num_heads)
        fit_cfg = cfg
    if job.is_main_process:
        print(f"[train] medusa: {positions} training positions from {len(training)} sequences "
              f"({len(heldout)} held out); draft vocabulary {len(draft_vocab) if draft_vocab is not None else 'all'} "
              f"tokens, covering {coverage(draft_vocab, heldout):.1%} of held-out response tokens",
              file=sys.stderr)  # fmt: skip

    fingerprint = _fingerprint(job, cfg, positions)
    checkpoint = job.output_dir / "checkpoint"
    last = fit(heads, rows, loss_fn, fit_cfg, checkpoint, fingerprint, job.logger, job.resume, job.scale)
    if not job.is_main_process:
        return job.output_dir

    metrics = measure(job, heads, heldout, cfg)
    heldout_metrics = metrics.pop("heldout")
    meta = {
        "drafter": "medusa",
        "target": job.pipeline.context.target_key,
        "num_heads": cfg.num_heads,
        "sequential": cfg.sequential,
        "copy_width": cfg.copy_width,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "draft_vocab_size": None if draft_vocab is None else len(draft_vocab),
        "trainable_parameters": sum(p.numel() for p in heads.parameters() if p.requires_grad),
        "tree": best_tree(heldout_metrics["rank_accuracy"], cfg.tree_nodes),
        "metrics": heldout_metrics,
        "eval_metrics": metrics,
        "train_metrics": last,
        "training": job.training_record(cfg, len(training), positions),
    }
    save_artifact(peft_heads, job.output_dir, meta)
    checkpoints.remove(checkpoint, fingerprint)
    return job.output_dir


def measure(job: TrainJob, heads: MedusaHeads, heldout: list[Sequence], cfg: Config) -> dict[str, dict]:
    """Accuracies on the held-out sequences and, if ``train.eval.path`` is set, on its
    prompts, overall and per category; printed and logged to W&B."""
    metrics = {"heldout": evaluate(heads, heldout, cfg, job.pipeline)}
    evaluation = job.eval_sequences()
    if evaluation:
        metrics["eval"] = evaluate(heads, evaluation, cfg, job.pipeline)
        for category in sorted({s.category for s in evaluation}):
            metrics[f"eval/{category}"] = evaluate(
                heads, [s for s in evaluation if s.category == category], cfg, job.pipeline
            )
    for split, values in metrics.items():
        print(f"[train] {split}: " + format_metrics(values), file=sys.stderr)
    job.logger.summary(
        {f"{split}/{key}": value for split, values in metrics.items() for key, value in values.items()}
    )
    return metrics


def build_heads(
    lm_head: nn.Linear,
    cfg: Config,
    draft_vocab: torch.Tensor | None = None,
    embeddings: nn.Embedding | None = None,
) -> tuple[MedusaHeads, nn.Module]:
    """Fresh float32 heads over ``lm_head`` (sequential ones also over the target's
    input ``embeddings``) with LoRA on their projections; returns (heads, the
    PeftModel wrapping them)."""
    from peft import LoraConfig, get_peft_model

    if cfg.sequential and embeddings is None:
        raise ValueError("drafter.sequential=true needs the target's input embeddings")
    if lm_head.weight.dtype != torch.float32:  # train in float32; the target keeps its weights
        lm_head = _frozen_float32_copy(lm_head)
    if cfg.sequential and embeddings.weight.dtype != torch.float32:
        embeddings = nn.Embedding.from_pretrained(embeddings.weight.detach().float(), freeze=True)
    torch.manual_seed(cfg.seed)  # LoRA's A matrices are random
    heads = MedusaHeads(
        lm_head, cfg.num_heads, draft_vocab, embeddings if cfg.sequential else None, cfg.copy_width
    )
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=LORA_TARGETS,
        bias="none",
    )
    peft_heads = get_peft_model(heads, lora)
    for module in heads.trained_modules().values():  # residual blocks (and input mixers) in full
        module.requires_grad_(True)
    return heads, peft_heads


def _frozen_float32_copy(lm_head: nn.Linear) -> nn.Linear:
    copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None)
    copy.load_state_dict({k: v.float() for k, v in lm_head.state_dict().items()})
    return copy.to(lm_head.weight.device).requires_grad_(False)


def draft_vocabulary(sequences: list[Sequence], vocab_size: int, size: int) -> torch.Tensor | None:
    """The ``size`` tokens most frequent in the responses (seen ones only), ascending
    ids; None when ``size`` is 0 (all tokens)."""
    if size < 0:
        raise ValueError(f"drafter.draft_vocab_size must be >= 0 (0 = all tokens), got {size}")
    if size == 0:
        return None
    tokens = torch.tensor([t for s in sequences for t in s.response], dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)  # (vocab,)
    ranking = torch.sort(counts, descending=True, stable=True).indices  # (vocab,)
    return ranking[: min(size, int((counts > 0).sum()))].sort().values


def vocab_index(labels: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Token ids -> rows of the draft vocabulary; IGNORE for tokens outside it (and IGNORE)."""
    if draft_vocab is None:
        return labels
    index = torch.full((vocab_size + 1,), IGNORE, dtype=torch.long)  # last slot: IGNORE itself
    index[draft_vocab.cpu()] = torch.arange(len(draft_vocab))
    return index[torch.where(labels == IGNORE, vocab_size, labels)]


def coverage(draft_vocab: torch.Tensor | None, sequences: list[Sequence]) -> float:
    """Share of the response tokens of ``sequences`` inside the draft vocabulary."""
    tokens = torch.tensor([t for s in sequences for t in s.response], dtype=torch.long)
    if draft_vocab is None or not len(tokens):
        return 1.0
    return float(torch.isin(tokens, draft_vocab.cpu()).float().mean())


def training_rows(sequences: list[Sequence], num_heads: int) -> dict[str, torch.Tensor]:
    """hidden (N, hidden) float16, pending (N,) the token that hidden predicted, and
    labels (N, K) token ids: one row per response position that has at least head 0's label."""
    hidden_parts, label_parts, pending_parts = [], [], []
    for sequence in sequences:
        n = len(sequence.response)
        if n < 2 or sequence.hidden is None:
            continue
        response = torch.tensor(sequence.response + [IGNORE] * num_heads)  # padded with IGNORE
        rows = torch.arange(n - 1)  # (n - 1,)
        offsets = 1 + torch.arange(num_heads)  # (K,) head k's label is k + 1 tokens after row j's own
        label_parts.append(response[rows[:, None] + offsets[None, :]])  # (n - 1, K)
        hidden_parts.append(sequence.hidden[: n - 1])
        pending_parts.append(response[rows])
    if not hidden_parts:
        raise ValueError("no training sequence has two or more response tokens; generate longer responses")
    return {
        "hidden": torch.cat(hidden_parts),
        "labels": torch.cat(label_parts),
        "pending": torch.cat(pending_parts),
    }


def head_loss(heads: MedusaHeads, peft_heads: nn.Module, weights: torch.Tensor, num_heads: int):
    """The loss of heads without copy attention on rows of :func:`training_rows`:
    sum_k weights[k] * cross-entropy of head k over the draft vocabulary."""

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = peft_heads(
            batch["hidden"].to(heads.device, heads.dtype), head_inputs(batch).to(heads.device)
        )  # (B, K, n)
        targets = batch["targets"].to(heads.device)  # (B, K) row in the draft vocabulary, or IGNORE
        losses = nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
        )  # (B, K)
        in_vocab = targets != IGNORE  # (B, K)
        per_head = (losses * in_vocab).sum(0) / in_vocab.sum(0).clamp(min=1)  # (K,)
        correct = (logits.argmax(-1) == targets) & in_vocab  # (B, K)
        accuracy = correct.sum(0).cpu() / (batch["labels"] != IGNORE).sum(0).clamp(min=1)  # (K,)
        metrics = {f"top1/head{k}": float(accuracy[k]) for k in range(num_heads)}
        return (per_head * weights).sum(), metrics

    return loss_fn


def context_rows(pipeline, sequences: list[Sequence]) -> dict[str, torch.Tensor]:
    """Whole sequences for copy heads, padded: tokens (S, L) prompt + response, hidden
    (S, L - 1, hidden) float16 the target's final hidden state at every position but the
    last (the prompt's from one target pass over it, the response's from the data),
    prompt_len (S,) and length (S,), for sequences with a head-0 label."""
    kept = [s for s in sequences if len(s.response) >= 2 and s.hidden is not None]
    if not kept:
        raise ValueError("no training sequence has two or more response tokens; generate longer responses")
    length = max(len(s.prompt) + len(s.response) for s in kept)
    hidden_size = kept[0].hidden.shape[-1]
    tokens = torch.zeros(len(kept), length, dtype=torch.long)
    hidden = torch.zeros(len(kept), length - 1, hidden_size, dtype=torch.float16)
    session = ModelSession(pipeline.model)
    for i, sequence in enumerate(tqdm(kept, desc="prompt hidden states", unit="seq")):
        prompt = list(sequence.prompt)
        if len(prompt) > 1:  # positions 0 .. P-2; the response's rows start at P-1
            session.reset()
            session.forward(prompt[:-1], last_only=True)
            hidden[i, : len(prompt) - 1] = session.hidden.to(torch.float16).cpu()
        n = len(prompt) + len(sequence.response)
        tokens[i, :n] = torch.tensor(prompt + sequence.response)
        hidden[i, len(prompt) - 1 : n - 1] = sequence.hidden[: len(sequence.response)].to(torch.float16)
    return {
        "tokens": tokens,
        "hidden": hidden,
        "prompt_len": torch.tensor([len(s.prompt) for s in kept]),
        "length": torch.tensor([len(s.prompt) + len(s.response) for s in kept]),
    }


@torch.no_grad()
def target_distributions(
    lm_head: nn.Module, rows: dict[str, torch.Tensor], top: int
) -> dict[str, torch.Tensor]:
    """The target's next-token distribution at every response position of :func:`context_rows`,
    from its cached final hidden states: soft_ids (S, L - 1, top) its ``top`` most likely
    tokens at temperature 1 and soft_probs (S, L - 1, top) their probabilities, renormalised
    over the ``top`` (zero at prompt and padding positions)."""
    hidden = rows["hidden"]
    ids = torch.zeros(*hidden.shape[:2], top, dtype=torch.int32)
    probs = torch.zeros(*hidden.shape[:2], top, dtype=torch.float16)
    weight = lm_head.weight.detach()
    for i in tqdm(range(len(hidden)), desc="target distributions", unit="seq"):
        start, end = int(rows["prompt_len"][i]) - 1, int(rows["length"][i]) - 1
        logits = hidden[i, start:end].to(weight.device, weight.dtype) @ weight.T  # (n, vocab)
        best = torch.softmax(logits.float(), -1).topk(top, dim=-1)
        ids[i, start:end] = best.indices.cpu().to(torch.int32)
        probs[i, start:end] = (best.values / best.values.sum(-1, keepdim=True)).cpu().to(torch.float16)
    return {"soft_ids": ids, "soft_probs": probs}


def sequence_views(batch: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """A batch of :func:`context_rows` as head rows and context: hidden (B, R, hidden)
    the h at each response position t that has a head-0 label, inputs and labels
    (B, R, K) as in :func:`training_rows` (IGNORE where there is none), before, hidden_all
    (B, L - 1, hidden) the h_(j-1) and h_j of positions j, current and following (B, L - 1)
    the x_j and x_(j+1), and mask (B, R, L - 1): position j is committed when t is
    drafted from (j <= t)."""
    tokens, lengths, prompt_len = batch["tokens"], batch["length"], batch["prompt_len"]
    length = int(lengths.max())
    tokens = tokens[:, :length]
    hidden = batch["hidden"][:, : length - 1].float()  # (B, L - 1, hidden)
    rows = int((lengths - prompt_len - 1).max())  # response positions with a head-0 label
    r = torch.arange(rows)
    t = (prompt_len[:, None] - 1 + r[None]).clamp(max=length - 2)  # (B, R) query positions
    valid = r[None] < (lengths - prompt_len - 1)[:, None]  # (B, R)
    padded = torch.cat([tokens, torch.full((len(tokens), num_heads + 2), IGNORE)], dim=1)
    ahead = t[..., None] + 1 + torch.arange(num_heads + 1)  # (B, R, K + 1) positions t+1 .. t+K+1
    ahead_tokens = padded.gather(1, ahead.flatten(1)).view(*ahead.shape)
    ahead_tokens = torch.where(ahead < lengths[:, None, None], ahead_tokens, IGNORE)
    labels = torch.where(valid[..., None], ahead_tokens[..., 1:], IGNORE)  # (B, R, K)
    positions = torch.arange(length - 1)
    view = {
        # (B, R, K) t+1 .. t+K: the position whose target state predicts each label
        "label_from": ahead[..., :-1].clamp(max=length - 2),
        "hidden": hidden.gather(1, t[..., None].expand(-1, -1, hidden.shape[-1])),  # (B, R, hidden)
        "inputs": torch.where(valid[..., None], ahead_tokens[..., :-1], IGNORE),  # (B, R, K) y_0 .. y_K-1
        "labels": labels,
        "before": torch.cat([hidden.new_zeros(len(hidden), 1, hidden.shape[-1]), hidden[:, :-1]], dim=1),
        "hidden_all": hidden,
        "current": tokens[:, :-1],
        "following": tokens[:, 1:],
        "mask": (positions[None, None] <= t[..., None])
        & (positions[None, None] < (lengths - 1)[:, None, None]),
    }
    if "soft_ids" in batch:  # the target's distribution over each label
        at = view["label_from"].flatten(1)  # (B, R * K)
        for key in ("soft_ids", "soft_probs"):
            table = batch[key][:, : length - 1]  # (B, L - 1, top)
            picked = table.gather(1, at[..., None].expand(-1, -1, table.shape[-1]))
            view[key] = picked.view(*labels.shape, table.shape[-1])  # (B, R, K, top)
    return view


def copy_forward(heads: MedusaHeads, forward: nn.Module, view: dict[str, torch.Tensor]):
    """Copy heads on a :func:`sequence_views` batch through ``forward`` (the heads or their
    PeftModel) -> (logits (B, R, K, n), pointer weights (B, R, K, L - 1), gates (B, R, K))."""
    device, dtype = heads.device, heads.dtype
    keys, values = heads.copy.entries(
        view["before"].to(device, dtype),
        heads.embed(view["current"].to(device), dtype),
        view["hidden_all"].to(device, dtype),
        heads.embed(view["following"].to(device), dtype),
    )
    return forward(
        view["hidden"].to(device, dtype), view["inputs"].to(device), (keys, values, view["mask"].to(device))
    )


def copy_loss(heads: MedusaHeads, peft_heads: nn.Module, weights: torch.Tensor, distill_weight: float = 0.0):
    """The loss of copy heads on whole sequences: sum_k weights[k] * the mean of
    -log p_k(label), p_k the mixture of head k and its pointer (labels outside the draft
    vocabulary count too: the pointer can give them). With ``distill_weight`` w, each
    position's term is (1 - w) x that + w x the cross-entropy of p_k against the target's
    own distribution there (:func:`target_distributions`, in the batch): what rejection
    sampling accepts at temperature 1 is sum_x min(p(x), p_k(x)), not p_k(label)."""

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        view = sequence_views(batch, heads.num_heads)
        logits, pointer, gates = copy_forward(heads, peft_heads, view)
        labels = view["labels"].to(heads.device)  # (B, R, K)
        rows = vocab_index(labels.cpu(), heads.draft_vocab, heads.vocab_size).to(heads.device)  # (B, R, K)
        following = view["following"].to(heads.device)[:, None, None, :]  # (B, 1, 1, L - 1)
        probs = label_probability(logits, rows, pointer, gates, following, labels)  # (B, R, K)
        present = labels != IGNORE
        losses = -torch.log(probs.clamp(min=1e-9))
        if distill_weight:
            soft_ids = view["soft_ids"].to(heads.device).long()  # (B, R, K, top)
            soft_probs = view["soft_probs"].to(heads.device).float()
            soft = torch.zeros_like(losses)
            for m in range(soft_ids.shape[-1]):
                ids = soft_ids[..., m]
                rows_m = vocab_index(ids.cpu(), heads.draft_vocab, heads.vocab_size).to(heads.device)
                q = label_probability(logits, rows_m, pointer, gates, following, ids)
                soft = soft - soft_probs[..., m] * torch.log(q.clamp(min=1e-9))
            losses = (1 - distill_weight) * losses + distill_weight * soft
        losses = losses * present
        counts = present.sum((0, 1)).clamp(min=1)  # (K,)
        per_head = losses.sum((0, 1)) / counts  # (K,)
        mean_probs = (probs.detach() * present).sum((0, 1)) / counts  # (K,)
        metrics = {f"p_label/head{k}": float(mean_probs[k]) for k in range(heads.num_heads)}
        metrics["gate"] = float((gates.detach() * present).sum() / present.sum().clamp(min=1))
        return (per_head * weights).sum(), metrics

    return loss_fn


def head_inputs(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, K) the tokens y_k sequential heads read, teacher-forced: the pending token,
    then each earlier head's label (IGNORE past the response, where the labels are too)."""
    return torch.cat([rows["pending"][:, None], rows["labels"][:, :-1]], dim=1)


@torch.no_grad()
def evaluate(heads: MedusaHeads, sequences: list[Sequence], cfg: Config, pipeline=None) -> dict:
    """Per-head accuracies on ``sequences``: top1, top5, rank_accuracy[k][r] (head k's
    rank-r token is right), chain_tau (tokens per pass of a greedy chain), and the
    draft vocabulary's coverage of the response tokens. Copy heads are ranked by their
    mixture with the pointer and need the ``pipeline`` (for the prompts' hidden states);
    for them, sampled_acceptance[k] is the mean of sum_x min(p(x), q_k(x)) over head k's
    labels, p the target's distribution there at temperature 1 and q_k the head's: the
    chance that rejection sampling accepts a node drafted from q_k, given the right
    earlier tokens (teacher-forced), what temperature 1 gets per depth."""
    rank_hits = torch.zeros(cfg.num_heads, cfg.top_ranks)  # (K, ranks)
    label_counts = torch.zeros(cfg.num_heads)  # (K,)
    accepted, positions = 0.0, 0
    sampled_sum, sampled_count = torch.zeros(cfg.num_heads), torch.zeros(cfg.num_heads)
    for ranked, labels, sampled in _ranked_tokens(heads, sequences, cfg, pipeline):
        if sampled is not None:
            present = labels != IGNORE
            sampled_sum += (sampled * present).sum(0)
            sampled_count += present.sum(0)
        hits = ranked == labels[..., None]  # (N, K, ranks); IGNORE never matches
        rank_hits += hits.sum(0)
        label_counts += (labels != IGNORE).sum(0)
        accepted += float(hits[..., 0].long().cumprod(dim=1).sum())  # leading heads that are right
        positions += len(labels)
    rank_accuracy = rank_hits / label_counts.clamp(min=1)[:, None]  # (K, ranks)
    metrics = {
        "positions": positions,
        "top1": [round(float(a), 4) for a in rank_accuracy[:, 0]],
        "top5": [round(float(a), 4) for a in rank_accuracy[:, :5].sum(1)],
        "rank_accuracy": [[round(float(a), 4) for a in head] for head in rank_accuracy],
        "chain_tau": round(1 + accepted / max(positions, 1), 4),
        "draft_vocab_coverage": round(coverage(heads.draft_vocab, sequences), 4),
    }
    if sampled_count.any():  # copy heads: sum_x min(p(x), q_k(x)), p the target's at temperature 1
        metrics["sampled_acceptance"] = [round(float(a), 4) for a in sampled_sum / sampled_count.clamp(min=1)]
    return metrics


def _ranked_tokens(heads: MedusaHeads, sequences: list[Sequence], cfg: Config, pipeline):
    """Batches of (ranked (N, K, ranks) token ids each head puts first, labels (N, K)),
    one row per response position with a head-0 label; sequential heads read the right
    earlier tokens (teacher-forced, as a greedy chain that is still right would)."""
    if heads.copy is None:
        rows = training_rows(sequences, cfg.num_heads)
        all_inputs = head_inputs(rows)  # (N, K)
        for start in range(0, len(rows["hidden"]), cfg.eval_batch_size):
            hidden = rows["hidden"][start : start + cfg.eval_batch_size].to(heads.device, heads.dtype)
            inputs = all_inputs[start : start + cfg.eval_batch_size].to(heads.device)  # (B, K)
            ranked = heads(hidden, inputs).topk(cfg.top_ranks, dim=-1).indices.cpu()  # (B, K, ranks) rows
            if heads.draft_vocab is not None:
                ranked = heads.draft_vocab.cpu()[ranked]  # token ids
            yield ranked, rows["labels"][start : start + cfg.eval_batch_size], None
        return
    if pipeline is None:
        raise ValueError("evaluating copy heads needs the pipeline (the prompts' hidden states)")
    rows = context_rows(pipeline, sequences)
    lm_head = pipeline.model.get_output_embeddings()
    per_batch = max(1, cfg.eval_batch_size // 128)  # sequences per batch, ~128 response positions each
    for start in range(0, len(rows["tokens"]), per_batch):
        view = sequence_views(
            {key: value[start : start + per_batch] for key, value in rows.items()}, cfg.num_heads
        )
        logits, pointer, gates = copy_forward(heads, heads, view)
        valid = view["labels"][..., 0] != IGNORE  # (B, R)
        following = view["following"].to(heads.device)  # (B, L - 1)
        ranked, sampled = [], []
        at = view["label_from"]  # (B, R, K)
        for k in range(cfg.num_heads):
            probs = torch.stack(
                [
                    mixture(
                        torch.softmax(logits[b, :, k], -1),
                        pointer[b, :, k],
                        gates[b, :, k, None],
                        following[b],
                        heads.vocab_size,
                        heads.draft_vocab,
                    )
                    for b in range(len(logits))
                ]
            )  # (B, R, vocab)
            ranked.append(probs.topk(cfg.top_ranks, dim=-1).indices.cpu())  # (B, R, ranks)
            # the target's distribution over head k's label: its state at the position before it
            before = view["hidden_all"].gather(
                1, at[..., k, None].expand(-1, -1, view["hidden_all"].shape[-1])
            )
            target = torch.softmax(
                lm_head(before.to(lm_head.weight.device, lm_head.weight.dtype)).float(), -1
            )
            sampled.append(torch.minimum(target, probs.float()).sum(-1).cpu())  # (B, R)
        # (N, K, ranks), (N, K), (N, K) the chance a node sampled from q_k is accepted at temperature 1
        yield torch.stack(ranked, dim=2)[valid], view["labels"][valid], torch.stack(sampled, dim=2)[valid]


def format_metrics(metrics: dict) -> str:
    return (
        f"{metrics['positions']} positions, top-1 per head {metrics['top1']}, top-5 {metrics['top5']}, "
        f"chain tau {metrics['chain_tau']}, draft vocabulary coverage {metrics['draft_vocab_coverage']}"
        + (
            f", sampled acceptance per head {metrics['sampled_acceptance']}"
            if "sampled_acceptance" in metrics
            else ""
        )
    )


def _fingerprint(job: TrainJob, cfg: Config, positions: int) -> str:
    settings = {"drafter": asdict(cfg), "data": asdict(job.data_config), "positions": positions}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()
