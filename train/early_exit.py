"""Fit an early exit (:class:`specdec.proposers.early_exit.ExitHead`) for one exit layer
on the target's self-distilled data.

    python -m specdec.train drafter=early_exit drafter.exit_layer=8
    python -m specdec.train -m drafter=early_exit drafter.exit_layer=4,8,12,16

What is trained (the target itself never changes):

* a residual adapter in front of the exit (``adapter_rank``), in full;
* a LoRA on the exit's LM head (``head_lora_rank``); the head stays the target's, shared;
* optionally a PEFT LoRA on copies of the last ``shallow_lora_layers`` layers
  below the exit, merged into the copies when saved and used only while
  drafting. Those layers then write KV entries the target would not, so the
  proposer switches KV reuse off for such an exit.

Loss: KL(p_target || q_exit) at every response position, where p_target is the
full-depth distribution (the target's LM head on the final hidden states that
come cached with the data) and q_exit the exit's distribution. Adapter up
projection and LoRA B start at zero, so training starts from the untrained exit
(the target's own norm and head) and the evaluation before training is that
baseline.

The residual stream entering the first trained part (layer E, or the first
adapted shallow layer) is computed once per sequence with the target's frozen
layers; batches are whole sequences. Artifact:
``<artifacts>/<target>/early_exit/layer-<E>/`` (exit weights, exit config,
``training.json`` with the metrics), where ``proposer=early_exit
proposer.trained=true proposer.exit_layer=E`` finds it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specdec.decoders.models.architecture import decoder_of
from specdec.decoders.models.layered import LayeredDecoder, run_layers
from specdec.decoders.models.session import ModelSession
from specdec.proposers.early_exit import ExitHead
from specdec.train import checkpoints
from specdec.train.data import Sequence, split_heldout
from specdec.train.job import TrainJob
from specdec.train.loop import FitConfig, fit

#: Linear layers of a Llama-style decoder layer that the shallow LoRA adapts.
SHALLOW_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Config(FitConfig):
    """``drafter=early_exit`` options; ``batch_size`` counts sequences per step.

    A residual adapter before the exit and LoRA on the exit's LM head, distilled
    from the full-depth distribution; one artifact per exit layer
    (``python -m specdec.train -m drafter=early_exit drafter.exit_layer=4,8,12,16``). Stored
    as the ``drafter=early_exit`` structured config: these are the only defaults."""

    batch_size: int = 8

    exit_layer: int = 8
    adapter_rank: int = 128
    head_lora_rank: int = 16
    head_lora_alpha: float = 32.0
    shallow_lora_layers: int = 0  # adapt the last N layers below the exit (turns KV reuse off)
    shallow_lora_rank: int = 8
    shallow_lora_alpha: float = 16.0
    chain_k: int = 4  # draft length of the chain tau reported in the metrics


@dataclass
class ExitExample:
    """One sequence's training input.

    stream: (T, hidden) float16, the residual stream entering the first trained
        layer at every position (only the response-predicting ones without
        shallow LoRA, since nothing trained then looks across positions).
    first: row of ``stream`` that predicted response[0].
    final_hidden: (n, hidden) float16, the target's final hidden states that
        predicted the n response tokens (the full-depth teacher).
    """

    stream: torch.Tensor
    first: int
    final_hidden: torch.Tensor


def train(job: TrainJob) -> Path:
    cfg: Config = job.drafter_config(Config)
    target = job.pipeline.model
    check_config(cfg, target)
    training, heldout = split_heldout(job.sequences(), job.data_config.heldout)
    evaluation = job.eval_sequences()
    if next(target.parameters()).dtype not in (torch.float32, torch.float64):
        # The data came from the target as it runs (bfloat16 by default on CPUs with native
        # bf16, so the cached generations are reused); the exit trains on a float32 target,
        # and the trained exit loads into the target in any dtype. Exact mode (CPU bfloat16)
        # is for verification passes; float32 training uses the ordinary kernels.
        job.pipeline.target.configure(narrow=False, exact=False)
        target = target.float()
    start_layer = (
        cfg.exit_layer - cfg.shallow_lora_layers
    )  # first trained layer (= exit layer without shallow LoRA)
    examples = exit_examples(target, training, start_layer, keep_context=cfg.shallow_lora_layers > 0)
    heldout_examples = exit_examples(target, heldout, start_layer, keep_context=cfg.shallow_lora_layers > 0)
    eval_examples = exit_examples(target, evaluation, start_layer, keep_context=cfg.shallow_lora_layers > 0)
    if job.is_main_process:
        print(f"[train] early_exit layer {cfg.exit_layer}: {sum(len(e.final_hidden) for e in examples)} positions "
              f"from {len(examples)} sequences, {len(heldout_examples)} held out", file=sys.stderr)  # fmt: skip

    head, peft_layers = build_exit(target, cfg)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    exit_logits = ExitLogits(target, head, start_layer)
    before = {"heldout": evaluate(exit_logits, heldout_examples, cfg.chain_k)}
    if eval_examples:
        before["eval"] = evaluate(exit_logits, eval_examples, cfg.chain_k)

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen = [examples[i] for i in batch["index"].tolist()]
        draft_logits = exit_logits(chosen)  # (N, vocab)
        with torch.no_grad():
            target_logprobs = exit_logits.teacher(chosen).log_softmax(-1)  # (N, vocab)
        draft_logprobs = draft_logits.float().log_softmax(-1)  # (N, vocab)
        kl = (target_logprobs.exp() * (target_logprobs - draft_logprobs)).sum(-1).mean()
        agreement = (draft_logits.argmax(-1) == target_logprobs.argmax(-1)).float().mean()
        return kl, {"top1_agreement": float(agreement)}

    output = job.output_dir / f"layer-{cfg.exit_layer}"
    rows = {"index": torch.arange(len(examples))}
    fingerprint = _fingerprint(job, cfg, len(examples))
    checkpoint = output / "checkpoint"
    last = fit(head, rows, loss_fn, cfg, checkpoint, fingerprint, job.logger, job.resume, job.scale)
    if not job.is_main_process:
        return output

    if peft_layers is not None:  # fold the shallow LoRA into the layer copies
        merged = peft_layers.merge_and_unload()
        for index, layer in merged.items():
            head.shallow_layers[index] = layer
        exit_logits = ExitLogits(target, head, start_layer)
    after = {"heldout": evaluate(exit_logits, heldout_examples, cfg.chain_k)}
    if eval_examples:
        after["eval"] = evaluate(exit_logits, eval_examples, cfg.chain_k)
    for split in after:
        print(f"[train] {split}: untrained exit {format_metrics(before[split])}; "
              f"trained exit {format_metrics(after[split])}", file=sys.stderr)  # fmt: skip
    job.logger.summary({f"{split}/{when}/{key}": value for when, metrics in (("untrained", before), ("trained", after))
                        for split, values in metrics.items() for key, value in values.items()})  # fmt: skip

    head.eval().requires_grad_(False)
    head.save(output)
    meta = {
        "drafter": "early_exit",
        "target": job.pipeline.context.target_key,
        "exit_layer": cfg.exit_layer,
        "num_layers": target.config.num_hidden_layers,
        "trainable_parameters": trainable,
        "untrained": before,
        "trained": after,
        "train_metrics": last,
        "training": job.training_record(cfg, len(examples)),
    }
    (output / "training.json").write_text(json.dumps(meta, indent=2))
    checkpoints.remove(checkpoint, fingerprint)
    return output


def check_config(cfg: Config, target: nn.Module) -> None:
    num_layers = target.config.num_hidden_layers
    if not 1 <= cfg.exit_layer <= num_layers:
        raise ValueError(
            f"drafter.exit_layer must be in [1, {num_layers}] for this target, got {cfg.exit_layer}"
        )
    if not 0 <= cfg.shallow_lora_layers <= cfg.exit_layer:
        raise ValueError(
            f"drafter.shallow_lora_layers must be in [0, exit_layer={cfg.exit_layer}], got {cfg.shallow_lora_layers}"
        )


def build_exit(target: nn.Module, cfg: Config) -> tuple[ExitHead, nn.Module | None]:
    """A fresh trainable ExitHead; with shallow LoRA also the PeftModel over its layer copies."""
    torch.manual_seed(cfg.seed)  # adapter and LoRA A matrices are random
    head = ExitHead(target, cfg.exit_layer, cfg.adapter_rank, cfg.head_lora_rank, cfg.head_lora_alpha)
    head.requires_grad_(True)
    if not cfg.shallow_lora_layers:
        return head, None
    from peft import LoraConfig, get_peft_model

    for index in range(cfg.exit_layer - cfg.shallow_lora_layers, cfg.exit_layer):
        head.adapt_shallow_layer(target, index)
    lora = LoraConfig(
        r=cfg.shallow_lora_rank,
        lora_alpha=cfg.shallow_lora_alpha,
        target_modules=SHALLOW_LORA_TARGETS,
        bias="none",
    )
    peft_layers = get_peft_model(
        head.shallow_layers, lora
    )  # injects LoRA in place; freezes the copies' weights
    return head, peft_layers


@torch.no_grad()
def exit_examples(
    target: nn.Module, sequences: list[Sequence], start_layer: int, keep_context: bool
) -> list[ExitExample]:
    """The residual stream entering layer ``start_layer`` for each sequence, from the
    target's own frozen layers (run once, not per epoch)."""
    session = ModelSession(target)
    layered = LayeredDecoder(session)
    examples = []
    for sequence in tqdm(sequences, desc=f"layer-{start_layer} streams", unit="seq", disable=not sequences):
        n = len(sequence.response)
        if n < 1 or sequence.hidden is None:
            continue
        tokens = sequence.prompt + sequence.response[:-1]  # position first + j predicts response[j]
        session.reset()
        with torch.inference_mode():
            stream = layered.run(layered.embed(tokens), 0, start_layer)  # (T, hidden)
        first = len(sequence.prompt) - 1
        if not keep_context:
            stream, first = stream[first:], 0
        examples.append(ExitExample(stream.to(torch.float16), first, sequence.hidden))
    return examples


class ExitLogits:
    """Draft logits of an ExitHead on a batch of examples, and the teacher's."""

    def __init__(self, target: nn.Module, head: ExitHead, start_layer: int) -> None:
        self.decoder = decoder_of(target)
        self.lm_head = target.get_output_embeddings()
        self.head = head
        self.dtype = next(target.parameters()).dtype
        layers = head.layer_modules(target)
        self.adapted = layers[start_layer : head.exit_layer]  # empty without shallow LoRA
        self.start_layer = start_layer

    def __call__(self, examples: list[ExitExample]) -> torch.Tensor:
        """(sum of n, vocab) draft logits at every response position of ``examples``."""
        if not self.adapted:
            return self.head(torch.cat([e.stream for e in examples]).to(self.dtype))
        width = max(len(e.stream) for e in examples)
        states = torch.zeros(
            len(examples), width, examples[0].stream.shape[-1], dtype=self.dtype
        )  # (B, T, hidden)
        for row, example in enumerate(examples):  # right padding: causal attention never sees it
            states[row, : len(example.stream)] = example.stream
        position_ids = torch.arange(width).unsqueeze(0)  # (1, T)
        states = run_layers(self.decoder, self.adapted, states, position_ids, first=self.start_layer)
        rows = [states[i, e.first : e.first + len(e.final_hidden)] for i, e in enumerate(examples)]
        return self.head(torch.cat(rows))

    def teacher(self, examples: list[ExitExample]) -> torch.Tensor:
        """(sum of n, vocab) full-depth logits at the same positions."""
        return self.lm_head(torch.cat([e.final_hidden for e in examples]).to(self.dtype)).float()


@torch.no_grad()
def evaluate(exit_logits: ExitLogits, examples: list[ExitExample], chain_k: int, batch: int = 8) -> dict:
    """Agreement of the exit's argmax with the full-depth argmax, KL(p_target || q_exit),
    and the chain tau a greedy k-token early-exit draft would get on these sequences.

    chain_tau: 1 + mean over positions of the number of consecutive agreeing
    positions starting there (at most chain_k): under teacher forcing, draft token
    i is accepted exactly when the exit agrees at the i positions before it.
    """
    agree, positions, kl_sum, accepted = 0, 0, 0.0, 0
    for start in range(0, len(examples), batch):
        chosen = examples[start : start + batch]
        draft = exit_logits(chosen).float()  # (N, vocab)
        target_logprobs = exit_logits.teacher(chosen).log_softmax(-1)  # (N, vocab)
        kl_sum += float((target_logprobs.exp() * (target_logprobs - draft.log_softmax(-1))).sum())
        hits = (draft.argmax(-1) == target_logprobs.argmax(-1)).long()  # (N,)
        offset = 0
        for example in chosen:
            sequence_hits = hits[offset : offset + len(example.final_hidden)]
            offset += len(example.final_hidden)
            accepted += sum(_leading_ones(sequence_hits[j : j + chain_k]) for j in range(len(sequence_hits)))
        agree += int(hits.sum())
        positions += len(hits)
    return {
        "positions": positions,
        "top1_agreement": round(agree / max(positions, 1), 4),
        "kl": round(kl_sum / max(positions, 1), 4),
        f"chain_tau_k{chain_k}": round(1 + accepted / max(positions, 1), 4),
    }


def _leading_ones(hits: torch.Tensor) -> int:
    misses = (hits == 0).nonzero()
    return int(misses[0]) if len(misses) else len(hits)


def format_metrics(metrics: dict) -> str:
    tau = next(v for k, v in metrics.items() if k.startswith("chain_tau"))
    return f"top-1 agreement {metrics['top1_agreement']:.3f}, KL {metrics['kl']:.3f}, chain tau {tau:.3f}"


def _fingerprint(job: TrainJob, cfg: Config, sequences: int) -> str:
    settings = {"drafter": asdict(cfg), "data": asdict(job.data_config), "sequences": sequences}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()
