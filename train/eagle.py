"""Fit an EAGLE drafter (:mod:`specdec.proposers.eagle`) on the target's self-distilled data.

The target stays frozen. The draft layer starts as a copy of target layer
``init_layer`` and is adapted with PEFT LoRA; the fusion (``fuse``, ``combine``)
and the norms are trained in full (PEFT ``modules_to_save``). Features: one target
pass over each cached sequence (prompt + response) gives the chosen layers'
outputs at every position (the target's layer tap, ``Target.tap``), cached next to the
self-distillation data, so no epoch reruns the target.

Training-time test (EAGLE-3): step 0 reads the target's features at every
position t (with uniform noise of ``feature_noise`` times each feature's RMS,
EAGLE's input-feature noise) and predicts token t + 2; step k >= 1 reads, at
position t, the draft's own step-(k-1) output at t - 1 and predicts token t + 2
again, as the depth-k node of a draft whose committed prefix ends at t - k. Its
attention sees the step-0 keys of positions <= t - k and, of each step j in
1..k, the key at position t - k + j (the same draft path), which is what the
draft cache holds at inference. Steps run one after another through one KV cache
holding every step's keys; the loss is sum_k ``step_decay``^k * cross-entropy_k
over the draft vocabulary, on labels that are response tokens (the target's own).

With a pointer (``copy_width`` > 0, :mod:`specdec.proposers.copy_attention`), step k at
position t also points at the committed positions j <= t - k (keys and values from
the target's highest feature and the tokens there), and its loss is that of the
mixture of the layer's distribution and the pointer's, labels outside the draft
vocabulary included (the pointer can give them).

Measured after training on held-out sequences (and ``train.eval.path`` prompts):
per depth k, the top-1 accuracy of step k teacher-forced on the tokens (the
draft's own features, as a chain that is still right has them), the accuracy
conditional on every earlier depth being right, and ``chain_tau``, the tokens per
target pass a greedy chain of ``eval_depth`` would get.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache

from specdec.decoders.models.architecture import decoder_of
from specdec.decoders.models.target import Target
from specdec.proposers.copy_attention import label_probability, mixture
from specdec.proposers.draft_model import DraftVocabulary, save_draft_vocab
from specdec.proposers.eagle.artifact import (
    CONFIG_FILE,
    LORA_TARGETS,
    full_modules,
    load_artifact,
    save_artifact,
)
from specdec.proposers.eagle.drafter import EagleDrafter, resolve_layers, target_features
from specdec.train import checkpoints
from specdec.train.data import Sequence, split_heldout
from specdec.train.job import TrainJob
from specdec.train.loop import FitConfig, fit
from specdec.train.medusa import IGNORE, vocab_index


@dataclass
class Config(FitConfig):
    """``drafter=eagle`` options: features, the draft layer, adapter, training-time test,
    and the FitConfig fields. Stored as the ``drafter=eagle`` structured config: these are
    the only defaults."""

    epochs: float = 2.0
    # hidden-state indices of the target's features (1..L, L = the final normed state,
    # -1 = L); null = EAGLE-3's low, middle, high [2, L // 2, L]; [-1] = EAGLE-1's last layer
    feature_layers: list[int] | None = None
    init_layer: int = -1  # the target layer the draft layer starts from
    draft_vocab_size: int = 8192  # most frequent training tokens the drafter scores
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_dropout: float = 0.0
    ttt_steps: int = 3  # training-time test: unrolled steps (1 = features from the target only)
    step_decay: float = 0.8  # loss weight of step k: step_decay ** k
    feature_noise: float = 0.1  # uniform input-feature noise, times each feature's RMS
    # the pointer into the context (proposers/copy_attention.py): its width, 0 = none;
    # one query, scale and gate per training-time-test step
    copy_width: int = 128
    max_length: int = 2048  # tokens per sequence (longer ones are cut)
    eval_depth: int = 4  # steps measured after training (the chain length)
    eval_batch_size: int = 8  # sequences per evaluation batch
    batch_size: int = 8  # sequences per optimizer step


def train(job: TrainJob) -> Path:
    cfg: Config = job.drafter_config(Config)
    if cfg.ttt_steps < 1:
        raise ValueError(f"drafter.ttt_steps must be >= 1, got {cfg.ttt_steps}")
    if job.eval_only:
        job.measured_artifact(CONFIG_FILE)  # a missing artifact is said before any data is generated
    sequences = job.sequences()
    training, heldout = split_heldout(sequences, job.data_config.heldout)
    target = job.pipeline.model
    num_layers = len(decoder_of(target).layers)
    layers = resolve_layers(cfg.feature_layers, num_layers)
    if job.eval_only:  # measure the existing artifact again (e.g. on new eval prompts)
        if not job.is_main_process:
            return job.output_dir
        directory = job.measured_artifact(CONFIG_FILE)
        artifact = load_artifact(directory, target)
        job.record_measurement(
            directory, CONFIG_FILE, artifact.meta, measure(job, artifact.drafter.float(), heldout, cfg)
        )
        return directory

    vocab_size = target.get_output_embeddings().weight.shape[0]
    counts = torch.bincount(
        torch.tensor([t for s in training for t in s.response], dtype=torch.long), minlength=vocab_size
    )  # (vocab,)
    job.output_dir.mkdir(parents=True, exist_ok=True)
    save_draft_vocab(job.output_dir, counts)  # ranked; the artifact is complete once eagle.json exists
    size = min(cfg.draft_vocab_size or vocab_size, int((counts > 0).sum()))
    vocabulary = DraftVocabulary.load(job.output_dir, size)
    data = feature_data(job, training, layers, cfg.max_length)
    drafter, peft_drafter = build_drafter(target, layers, cfg, vocabulary)
    positions = int(sum(len(t) - max(p, 2) for t, p in zip(data["tokens"], data["prompt_len"])))
    if job.is_main_process:
        print(f"[train] eagle: feature layers {layers}, draft layer from target layer {drafter.init_layer}, "
              f"{positions} training positions from {len(data['tokens'])} sequences ({len(heldout)} held out), "
              f"{cfg.ttt_steps} training-time-test steps, draft vocabulary {size} tokens, "
              f"{sum(p.numel() for p in drafter.parameters() if p.requires_grad)} trainable parameters",
              file=sys.stderr)  # fmt: skip
    rows = {"index": torch.arange(len(data["tokens"]))}
    loss_fn = ttt_loss(drafter, data, cfg)
    fingerprint = hashlib.sha1(
        json.dumps(
            {"drafter": asdict(cfg), "data": asdict(job.data_config), "positions": positions}, sort_keys=True
        ).encode()  # fmt: skip
    ).hexdigest()
    checkpoint = job.output_dir / "checkpoint"
    last = fit(drafter, rows, loss_fn, cfg, checkpoint, fingerprint, job.logger, job.resume, job.scale)
    if not job.is_main_process:
        return job.output_dir
    metrics = measure(job, drafter, heldout, cfg)
    meta = {
        "drafter": "eagle",
        "target": job.pipeline.context.target_key,
        "feature_layers": layers,
        "init_layer": drafter.init_layer,
        "copy_width": cfg.copy_width,
        "copy_depths": cfg.ttt_steps,
        "num_target_layers": num_layers,
        "hidden_size": drafter.lm_head.in_features,
        "vocab_size": vocab_size,
        "draft_vocab_size": size,
        "trainable_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "metrics": metrics.pop("heldout"),
        "eval_metrics": metrics,
        "train_metrics": last,
        "training": job.training_record(cfg, len(training), positions),
    }
    save_artifact(peft_drafter, job.output_dir, meta, counts)
    checkpoints.remove(checkpoint, fingerprint)
    return job.output_dir


def build_drafter(
    target: nn.Module, layers: list[int], cfg: Config, vocabulary: DraftVocabulary
) -> tuple[EagleDrafter, nn.Module]:
    """A fresh float32 drafter over ``target`` with LoRA on its layer and the fusion and
    norms trained in full; returns (drafter, the PeftModel wrapping it)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)  # LoRA's A matrices are random
    drafter = EagleDrafter(target, layers, cfg.init_layer, vocabulary, cfg.copy_width, cfg.ttt_steps).float()
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=LORA_TARGETS,
        modules_to_save=full_modules(cfg.copy_width),
        bias="none",
    )
    return drafter, get_peft_model(drafter, lora)


# ---------------------------------------------------------------- features


def feature_data(job: TrainJob, sequences: list[Sequence], layers: list[int], max_length: int) -> dict:
    """tokens, prompt_len and features of each sequence (with two or more response tokens):
    features (n - 1, len(layers) * hidden) the target's, in its dtype, at positions 0..n-2
    of its n tokens; computed by one target pass per sequence and cached under the data
    directory (keyed by the sequences, layers and dtype)."""
    kept = [s for s in sequences if len(s.response) >= 2]
    if not kept:
        raise ValueError("no training sequence has two or more response tokens; generate longer responses")
    tokens = [(list(s.prompt) + list(s.response))[:max_length] for s in kept]
    dtype = job.pipeline.session.dtype
    key = json.dumps({"ids": [s.id for s in kept], "tokens": [len(t) for t in tokens], "layers": layers,
                      "dtype": str(dtype)})  # fmt: skip
    path = job.data_root / f"eagle-features-{hashlib.sha1(key.encode()).hexdigest()[:12]}.safetensors"
    if path.exists():
        flat = load_file(str(path))["features"]
    else:
        flat = compute_features(job.pipeline.target, tokens, layers, job.is_main_process)
        if job.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"features": flat}, str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").rename(path)
    features = list(flat.split([len(t) - 1 for t in tokens]))
    return {"tokens": tokens, "prompt_len": [len(s.prompt) for s in kept], "features": features}


@torch.inference_mode()
def compute_features(target: Target, tokens: list[list[int]], layers: list[int], show: bool) -> torch.Tensor:
    """(sum of n - 1, F) the features of every sequence's positions 0..n-2, concatenated."""
    num_layers = target.num_layers
    tap = target.tap([i - 1 for i in layers if i < num_layers])
    session = target.session()
    parts = []
    for sequence in tqdm(tokens, desc="eagle features", unit="seq", disable=not show):
        session.reset()
        session.forward(sequence[:-1], last_only=True)
        parts.append(target_features(layers, num_layers, session.hidden, tap).cpu())
    return torch.cat(parts)


# ---------------------------------------------------------------- training-time test


def padded(data: dict, index: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch of sequences: features (B, T, F) float32, tokens (B, T + 1), and valid
    (B, T) positions t with a key (t < n - 1), labels (B, T) token t + 2 where it is a
    response token (else IGNORE)."""
    lengths = [len(data["tokens"][i]) for i in index]
    width = max(lengths) - 1  # T positions
    feature_size = data["features"][index[0]].shape[-1]
    features = torch.zeros(len(index), width, feature_size)
    tokens = torch.zeros(len(index), width + 2, dtype=torch.long)
    labels = torch.full((len(index), width), IGNORE, dtype=torch.long)
    for b, i in enumerate(index):
        n, prompt = lengths[b], data["prompt_len"][i]
        features[b, : n - 1] = data["features"][i].float()
        tokens[b, :n] = torch.tensor(data["tokens"][i])
        t = torch.arange(n - 2)  # positions whose label t + 2 exists
        labels[b, : n - 2] = torch.where(t + 2 >= prompt, tokens[b, 2:n], IGNORE)
    valid = torch.arange(width)[None] < torch.tensor(lengths)[:, None] - 1
    return {"features": features.to(device), "tokens": tokens[:, : width + 1].to(device),
            "valid": valid.to(device), "labels": labels}  # fmt: skip


def unrolled(drafter: EagleDrafter, batch: dict[str, torch.Tensor], steps: int, noise: float = 0.0):
    """The training-time test: yields (step k, its outputs y_k (B, T, hidden), logits (B, T, n),
    pointer): with a pointer, its (weights (B, T, T) over positions j, gate (B, T)), else None."""
    features, tokens, valid = batch["features"], batch["tokens"], batch["valid"]
    batch_size, width, _ = features.shape
    dtype, device = drafter.dtype, drafter.device
    clean = features
    if noise:
        blocks = features.view(batch_size, width, len(drafter.feature_layers), -1)
        rms = blocks.pow(2).mean(-1, keepdim=True).sqrt()
        features = (blocks + noise * rms * (2 * torch.rand_like(blocks) - 1)).flatten(2)
    following = tokens[:, 1 : width + 1]  # (B, T) token t + 1
    positions = torch.arange(width, device=device)
    cache = DynamicCache(config=drafter.config)
    previous = drafter.fuse(features.to(dtype))  # (B, T, hidden) step 0 reads the target's features
    lowest = torch.finfo(dtype).min
    query, key = positions[:, None], positions[None, :]  # (T, 1), (1, T)
    entries = None
    if drafter.copy is not None:  # position j: key from (h_(j-1), x_j), value from (h_j, x_(j+1))
        hidden = clean[..., -previous.shape[-1] :].to(dtype)  # (B, T, hidden) the highest feature
        before = torch.cat([hidden.new_zeros(batch_size, 1, hidden.shape[-1]), hidden[:, :-1]], 1)
        following_embedded = drafter.embed(following)
        entries = drafter.copy.entries(before, drafter.embed(tokens[:, :width]), hidden, following_embedded)
    for k in range(steps):
        if k:
            previous = torch.cat([previous.new_zeros(batch_size, 1, previous.shape[-1]), previous[:, :-1]], 1)
        blocks = [(key <= query - k)[None] & valid[:, None, :]]  # step 0's keys: the committed prefix
        blocks += [(key == query - k + j).expand(batch_size, -1, -1) for j in range(1, k + 1)]
        allowed = torch.cat(blocks, dim=-1)  # (B, T, (k + 1) T)
        allowed[..., k * width :] |= torch.eye(
            width, dtype=torch.bool, device=device
        )  # every row sees itself
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, lowest)
        pointer = None
        if entries is not None:  # the committed positions j <= t - k, as the draft's memory holds
            weights, gate = drafter.copy.point(
                drafter.copy_slot(k), previous, following_embedded, *entries, blocks[0]
            )
            pointer = (weights, gate[..., 0])
        outputs = drafter.decoder(
            inputs_embeds=drafter.inputs(previous, following),
            attention_mask=mask[:, None],
            position_ids=positions[None].expand(batch_size, -1),
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # (B, T, hidden)
        yield k, outputs, drafter.lm_head(outputs), pointer
        previous = outputs


def ttt_loss(drafter: EagleDrafter, data: dict, cfg: Config):
    """sum_k step_decay^k * cross-entropy of step k (:func:`unrolled`) over the draft
    vocabulary, averaged over the batch's labels. Each sequence runs on its own, at its
    own length: padding a batch to its longest sequence would double the work here."""
    token_ids = drafter.vocabulary.token_ids
    vocab_size = drafter.vocabulary.full_size
    steps = cfg.ttt_steps

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        sums: list[torch.Tensor | float] = [0.0] * steps  # summed cross-entropy per step
        counts, hits = torch.zeros(steps), torch.zeros(steps)  # hits: top-1, or the mixture's p(label)
        for index in batch["index"].tolist():
            rows = padded(data, [index], drafter.device)
            labels = rows["labels"].to(drafter.device)  # (1, T) token ids
            targets = vocab_index(rows["labels"], token_ids, vocab_size).to(drafter.device)  # (1, T) rows
            for k, _, logits, pointer in unrolled(drafter, rows, steps, cfg.feature_noise):
                step_targets = targets.clone()
                step_targets[:, :k] = IGNORE  # rows before position k have no step-k path
                if pointer is None:
                    sums[k] = sums[k] + nn.functional.cross_entropy(
                        logits.transpose(1, 2), step_targets, ignore_index=IGNORE, reduction="sum"
                    )
                    present = step_targets != IGNORE
                    hits[k] += float(((logits.argmax(-1) == step_targets) & present).sum())
                else:  # the mixture's probability of the label, which may lie outside the draft vocabulary
                    present = labels != IGNORE
                    present[:, :k] = False
                    following = rows["tokens"][:, 1:][:, None, :]  # (1, 1, T) the x_(j+1)
                    probs = label_probability(logits, step_targets, *pointer, following, labels)  # (1, T)
                    sums[k] = sums[k] - (probs.clamp(min=1e-9).log() * present).sum()
                    hits[k] += float((probs.detach() * present).sum())
                counts[k] += float(present.sum())
        total = sum(cfg.step_decay**k * sums[k] / max(float(counts[k]), 1.0) for k in range(steps))
        name = "top1" if drafter.copy is None else "p_label"
        metrics = {f"{name}/step{k}": float(hits[k] / counts[k].clamp(min=1)) for k in range(steps)}
        return total, metrics

    return loss_fn


# ---------------------------------------------------------------- evaluation


def measure(job: TrainJob, drafter: EagleDrafter, heldout: list[Sequence], cfg: Config) -> dict[str, dict]:
    """Accuracies on the held-out sequences and on ``train.eval.path`` prompts (overall and
    per category); printed and logged to W&B."""
    layers = drafter.feature_layers
    metrics = {"heldout": evaluate(drafter, feature_data(job, heldout, layers, cfg.max_length), cfg)}
    evaluation = job.eval_sequences()
    if evaluation:
        data = feature_data(job, evaluation, layers, cfg.max_length)
        metrics["eval"] = evaluate(drafter, data, cfg)
        kept = [s for s in evaluation if len(s.response) >= 2]
        for category in sorted({s.category for s in kept}):
            index = [i for i, s in enumerate(kept) if s.category == category]
            subset = {key: [values[i] for i in index] for key, values in data.items()}
            metrics[f"eval/{category}"] = evaluate(drafter, subset, cfg)
    for split, values in metrics.items():
        print(f"[train] {split}: " + format_metrics(values), file=sys.stderr)
    job.logger.summary(
        {f"{split}/{key}": value for split, values in metrics.items() for key, value in values.items()}
    )
    return metrics


@torch.no_grad()
def evaluate(drafter: EagleDrafter, data: dict, cfg: Config) -> dict:
    """Per depth k: top1 (step k teacher-forced on the tokens), conditional top1 (given
    depths 0..k-1 right), top5; chain_tau of a greedy chain of ``eval_depth`` tokens."""
    depth = cfg.eval_depth
    hits = torch.zeros(depth)
    hits5 = torch.zeros(depth)
    counts = torch.zeros(depth)
    chain_hits = torch.zeros(depth)  # paths whose depths 0..k are all right
    accepted, paths = 0.0, 0
    was_training = drafter.training
    drafter.eval()
    for start in range(0, len(data["tokens"]), cfg.eval_batch_size):
        index = list(range(start, min(start + cfg.eval_batch_size, len(data["tokens"]))))
        rows = padded(data, index, drafter.device)
        labels = rows["labels"].to(drafter.device)  # (B, T) token ids
        width = labels.shape[1]
        correct = torch.zeros(depth, *labels.shape, dtype=torch.bool, device=drafter.device)
        for k, _, logits, pointer in unrolled(drafter, rows, depth):
            top = ranked(drafter, logits, pointer, rows["tokens"][:, 1:], 5)  # (B, T, 5) token ids
            present = labels != IGNORE
            present[:, :k] = False
            correct[k] = (top[..., 0] == labels) & present
            hits[k] += correct[k].sum().cpu()
            hits5[k] += ((top == labels[..., None]).any(-1) & present).sum().cpu()
            counts[k] += present.sum().cpu()
        # a chain from prefix p: depth k is step k's row p + k
        start_rows = labels != IGNORE  # (B, T) prefixes with a depth-0 label
        alive = start_rows.clone()
        for k in range(depth):
            shifted = torch.zeros_like(alive)
            shifted[:, : width - k] = correct[k][:, k:]
            alive &= shifted
            chain_hits[k] += alive.sum().cpu()
            accepted += float(alive.sum())
        paths += int(start_rows.sum())
    drafter.train(was_training)
    top1 = hits / counts.clamp(min=1)
    conditional = [chain_hits[0] / max(paths, 1)] + [
        chain_hits[k] / chain_hits[k - 1].clamp(min=1) for k in range(1, depth)
    ]
    return {
        "positions": paths,
        "top1": [round(float(a), 4) for a in top1],
        "top5": [round(float(a), 4) for a in hits5 / counts.clamp(min=1)],
        "conditional_top1": [round(float(a), 4) for a in conditional],
        "chain_tau": round(1 + accepted / max(paths, 1), 4),
    }


def ranked(drafter: EagleDrafter, logits: torch.Tensor, pointer, following: torch.Tensor, count: int):
    """The ``count`` tokens (B, T, count) a step ranks first: by its logits (B, T, n) over
    the draft vocabulary, or by the mixture with its ``pointer`` onto ``following`` (B, T)."""
    token_ids = drafter.vocabulary.token_ids.to(logits.device)
    if pointer is None:
        return token_ids[logits.topk(count, dim=-1).indices]
    weights, gate = pointer
    size = drafter.vocabulary.full_size
    out = torch.empty(*logits.shape[:2], count, dtype=torch.long, device=logits.device)
    chunk = 256  # rows of full-vocabulary mixtures at a time
    for b in range(len(logits)):
        for start in range(0, logits.shape[1], chunk):
            part = slice(start, start + chunk)
            probs = mixture(
                torch.softmax(logits[b, part].float(), -1),
                weights[b, part].float(),
                gate[b, part, None].float(),
                following[b],
                size,
                token_ids,
            )  # (rows, vocab)
            out[b, part] = probs.topk(count, dim=-1).indices
    return out


def format_metrics(metrics: dict) -> str:
    return (
        f"{metrics['positions']} positions, top-1 per depth {metrics['top1']}, conditional "
        f"{metrics['conditional_top1']}, top-5 {metrics['top5']}, chain tau {metrics['chain_tau']}"
    )
