"""Medusa heads: K small heads on the target's last hidden state guess the next K tokens.

Head k (k = 0 .. K-1) reads the target's final hidden state ``h`` at the position
that produced the pending token, and predicts the token k + 2 positions ahead
of that position, i.e. the (k + 1)-th token after the pending one (Medusa-1,
Cai et al. 2024). Each head is a residual block feeding a language-model
projection that starts from the target's own ``lm_head`` and is adapted with LoRA:

    residual_k = h + SiLU(W_k h + b_k)                           trained in full
    logits_k   = W_lm residual_k + scale * B_k A_k residual_k    W_lm frozen and shared

W_lm is the target's lm_head restricted to a **draft vocabulary**: the tokens
most frequent in the training responses (8192 by default, chosen at training;
all tokens if the artifact has no such list). Drafting then reads a slice of
the lm_head instead of all of it, on CPU the dominant cost, and training is
as many times cheaper; tokens outside it get probability 0 in the draft
distribution, which keeps sampling lossless. The K projections share the one
weight, so drafting computes all heads' base logits with one matmul and adds
each head's low-rank LoRA term (:class:`DraftProjection`);
:meth:`MedusaHeads.forward`, used in training, runs the PEFT layers
themselves. Both give the same logits.

Drafts:

* chain (``tree: null``): each head's top-1 token; when sampling, each head's
  token is drawn from ``processed_probs`` of its logits and those rows are the
  draft_probs. Head k's distribution does not depend on the tokens drawn for
  earlier heads; rejection sampling only needs each token to come from the
  stated row, so this stays lossless.
* tree: Medusa "choices", a list of paths of top-k ranks per head, e.g.
  ``[[0], [1], [0, 0], [0, 1], [1, 0]]``; node ``[0, 1]`` is head 1's
  second-ranked token under head 0's top token. Paths are ordered so the
  all-0 path is the principal path (what chain verifiers keep). ``"auto"``
  takes the tree stored with the artifact, built from the heads' measured
  per-rank accuracies. When sampling, each node's token is drawn independently
  from its head's distribution (siblings are i.i.d. draws).

Artifact layout (written by ``python -m train drafter=medusa``)::

    medusa.json         architecture, target key, training summary, default tree
    heads.safetensors   the residual blocks and the draft vocabulary (token ids)
    adapter/            PEFT LoRA adapter of the heads' lm projections
"""

from __future__ import annotations

import heapq
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from decoders.draft import Draft, follow_tokens
from decoders.draft_length import DraftLengthPolicy, confidence_bucket
from decoders.registry import register_proposer
from decoders.sampling import check_finite, processed_probs, sample
from decoders.tree_budget import AcceptanceProfile, BudgetTuner
from proposers.base import Proposer

CONFIG_FILE = "medusa.json"
BLOCKS_FILE = "heads.safetensors"
VOCAB_KEY = "draft_vocab"
ADAPTER_DIR = "adapter"
LORA_TARGETS = r"lm_heads\.\d+"  # PEFT target_modules: every head's lm projection


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x)); zero-initialised, so a fresh head starts as the target's lm_head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """K residual blocks, each feeding an lm projection over the draft vocabulary.

    The K projections are plain ``nn.Linear`` modules sharing one frozen weight:
    the target's lm_head itself (whole vocabulary, not copied) or its rows for
    ``draft_vocab``. PEFT injects a LoRA adapter into each.
    """

    def __init__(self, lm_head: nn.Linear, num_heads: int, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs at least one head, got num_heads={num_heads}")
        self.num_heads = num_heads
        self.vocab_size, hidden_size = lm_head.weight.shape
        # (n,) token id of each output row; None = all tokens
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(lm_head.weight.device)
        base = _vocab_projection(lm_head, draft_vocab)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(_shared(base) for _ in range(num_heads))
        self.blocks.to(lm_head.weight)
        self._drafting: DraftProjection | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].linear.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks[0].linear.weight.device

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., hidden) -> logits (..., K, n) over the draft vocabulary, through the PEFT layers."""
        return torch.stack([lm(block(hidden)) for block, lm in zip(self.blocks, self.lm_heads)], dim=-2)

    def fused_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (hidden,) -> logits (K, vocab): :meth:`forward`'s values from one matmul
        for all heads, scattered to token ids; tokens outside the draft vocabulary get
        the dtype's lowest value. Gathers the projections on first use: call it after training."""
        if self._drafting is None:
            self._drafting = DraftProjection.gather(self)
        residual = torch.stack([block(hidden) for block in self.blocks])  # (K, hidden)
        return self._drafting.logits(residual)


@dataclass
class DraftProjection:
    """All heads' lm projections for drafting: the base weight once, LoRA per head."""

    draft_vocab: torch.Tensor | None  # (n,) token ids of the rows; None = all tokens
    weight: torch.Tensor  # (n, hidden)
    bias: torch.Tensor | None  # (n,)
    lora_a: torch.Tensor  # (K, rank, hidden)
    lora_b: torch.Tensor  # (K, n, rank), LoRA scale folded in
    vocab_size: int

    @classmethod
    def gather(cls, heads: MedusaHeads) -> DraftProjection:
        base = _base_layer(heads.lm_heads[0])
        lora_a, lora_b = [], []
        for projection in heads.lm_heads:
            adapters = list(getattr(projection, "active_adapters", []))
            if len(adapters) > 1:
                raise ValueError(f"Medusa heads support one LoRA adapter per head, found {adapters}")
            if adapters:
                lora_a.append(projection.lora_A[adapters[0]].weight)  # (rank, hidden)
                lora_b.append(
                    projection.lora_B[adapters[0]].weight * projection.scaling[adapters[0]]
                )  # (n, rank)
            else:  # no adapter: a zero low-rank term
                lora_a.append(base.weight.new_zeros(1, base.in_features))
                lora_b.append(base.weight.new_zeros(base.out_features, 1))
        return cls(
            heads.draft_vocab,
            base.weight.detach(),
            None if base.bias is None else base.bias.detach(),
            torch.stack(lora_a).detach(),
            torch.stack(lora_b).detach(),
            heads.vocab_size,
        )

    def logits(self, residual: torch.Tensor) -> torch.Tensor:
        """residual (K, hidden) -> (K, vocab)."""
        logits = residual @ self.weight.T  # (K, n)
        if self.bias is not None:
            logits = logits + self.bias
        low_rank = torch.einsum("krh,kh->kr", self.lora_a, residual)  # (K, rank)
        logits = logits + torch.einsum("knr,kr->kn", self.lora_b, low_rank)  # (K, n)
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((len(residual), self.vocab_size), torch.finfo(logits.dtype).min)  # (K, vocab)
        full[:, self.draft_vocab] = logits
        return full


def _vocab_projection(lm_head: nn.Linear, draft_vocab: torch.Tensor | None) -> nn.Linear:
    """A frozen Linear: ``lm_head`` itself, or a new one holding its rows for ``draft_vocab``."""
    if draft_vocab is None:
        return lm_head
    rows = draft_vocab.to(lm_head.weight.device)
    projection = nn.Linear(lm_head.in_features, len(rows), bias=lm_head.bias is not None, device="meta")
    projection.weight = nn.Parameter(lm_head.weight.detach()[rows].clone(), requires_grad=False)
    if lm_head.bias is not None:
        projection.bias = nn.Parameter(lm_head.bias.detach()[rows].clone(), requires_grad=False)
    return projection


def _shared(base: nn.Linear) -> nn.Linear:
    """A Linear module of its own (PEFT wraps modules) over ``base``'s parameters."""
    projection = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
    projection.weight = base.weight
    if base.bias is not None:
        projection.bias = base.bias
    projection.requires_grad_(False)
    return projection


def _base_layer(projection: nn.Module) -> nn.Linear:
    """The plain Linear under a PEFT LoRA layer (or the Linear itself)."""
    return getattr(projection, "base_layer", projection)


# ---------------------------------------------------------------- artifact I/O


@dataclass
class MedusaArtifact:
    """A loaded artifact: heads (adapter applied) and the metadata in medusa.json."""

    heads: MedusaHeads
    meta: dict


def save_artifact(peft_heads: nn.Module, directory: Path, meta: dict) -> None:
    """Write adapter/, heads.safetensors and medusa.json (``peft_heads`` is the PeftModel)."""
    directory.mkdir(parents=True, exist_ok=True)
    heads: MedusaHeads = peft_heads.get_base_model()
    peft_heads.save_pretrained(str(directory / ADAPTER_DIR))
    tensors = {f"blocks.{name}": t.detach().contiguous() for name, t in heads.blocks.state_dict().items()}
    if heads.draft_vocab is not None:
        tensors[VOCAB_KEY] = heads.draft_vocab.cpu().contiguous()
    save_file(tensors, str(directory / BLOCKS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def load_artifact(directory: Path, lm_head: nn.Linear) -> MedusaArtifact:
    """Build heads over ``lm_head`` and load the blocks, draft vocabulary and adapter."""
    from peft import PeftModel

    meta = json.loads((directory / CONFIG_FILE).read_text())
    vocab_size, hidden_size = lm_head.weight.shape
    if (meta["vocab_size"], meta["hidden_size"]) != (vocab_size, hidden_size):
        raise ValueError(
            f"the Medusa heads in {directory} were trained for a target with vocab {meta['vocab_size']} and "
            f"hidden size {meta['hidden_size']}, but this target has {vocab_size} and {hidden_size}; "
            "retrain them for this target with `python -m train drafter=medusa`."
        )
    tensors = load_file(str(directory / BLOCKS_FILE))
    draft_vocab = tensors.pop(VOCAB_KEY, None)
    heads = MedusaHeads(lm_head, meta["num_heads"], draft_vocab)
    heads.blocks.load_state_dict({name.removeprefix("blocks."): t for name, t in tensors.items()})
    PeftModel.from_pretrained(heads, str(directory / ADAPTER_DIR))  # injects LoRA into `heads`
    heads.to(lm_head.weight.dtype).eval().requires_grad_(False)
    return MedusaArtifact(heads, meta)


# ---------------------------------------------------------------- trees


def build_tree(choices: list[list[int]], num_heads: int) -> tuple[list[int], list[int], list[int]]:
    """Medusa choice paths -> (depths, ranks, parents) of the draft nodes.

    Paths are sorted by (length, ranks), so parents precede children and each
    node's first child is its rank-0 child: the all-0 path is the principal path.
    """
    paths = sorted((tuple(int(r) for r in path) for path in choices), key=lambda p: (len(p), p))
    index: dict[tuple[int, ...], int] = {}
    depths, ranks, parents = [], [], []
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"proposer.tree path {list(path)} must be a non-empty list of ranks >= 0")
        if len(path) > num_heads:
            raise ValueError(f"proposer.tree path {list(path)} is deeper than the {num_heads} heads in use")
        if path in index:
            raise ValueError(f"proposer.tree lists path {list(path)} twice")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"proposer.tree path {list(path)} needs its prefix {list(path[:-1])} too")
        index[path] = len(depths)
        depths.append(len(path) - 1)
        ranks.append(path[-1])
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    return depths, ranks, parents


def best_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[list[int]]:
    """The ``num_nodes`` paths with the highest expected acceptance.

    rank_accuracy[k][r]: how often head k's rank-r token is the right one.
    Treating heads as independent, a path is accepted with the product of its
    ranks' accuracies, and tau = 1 + the sum of that over the tree's nodes; a
    path never beats its prefix, so taking the best paths one by one keeps the
    tree closed under prefixes.
    """
    chosen: list[list[int]] = []
    frontier = [(-acc, (rank,)) for rank, acc in enumerate(rank_accuracy[0])]
    heapq.heapify(frontier)
    while frontier and len(chosen) < num_nodes:
        negative_value, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < len(rank_accuracy):
            for rank, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (negative_value * acc, path + (rank,)))
    return chosen


# ---------------------------------------------------------------- proposer


@register_proposer("medusa")
class MedusaProposer(Proposer):
    @dataclass
    class Config:
        # Artifact directory; null = <artifacts_dir>/<target>/medusa.
        path: str | None = None
        # Heads used (the chain length); null = all the artifact has.
        num_heads: int | None = None
        # null = chain of top-1 tokens; a list of Medusa choice paths, e.g.
        # [[0], [1], [0, 0]]; or "auto" = the tree stored with the artifact.
        tree: Any = None
        # trees: nodes kept, the first N of the tree's paths (ordered by expected
        # acceptance); null = all; "auto" = chosen from the target's T(n) and the
        # acceptance measured so far (decoders/tree_budget.py)
        tree_budget: Any = None
        # chains: cut each draft to the length that pays, from acceptance measured per
        # first-head confidence and the target's T(n) (decoders/draft_length.py)
        adaptive: bool = True

    sampled = True
    needs_hidden = True

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        directory = Path(config.path) if config.path else context.artifact_path("medusa")
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(
                f"no Medusa heads for target {context.target_key!r} at {directory}. Train them with "
                f"`{train_command(context, config.path)}`."
            )
        artifact = load_artifact(directory, context.target.get_output_embeddings())
        self.heads = artifact.heads
        self.meta = artifact.meta
        self.num_heads = config.num_heads or self.heads.num_heads
        if not 1 <= self.num_heads <= self.heads.num_heads:
            raise ValueError(
                f"proposer.num_heads must be between 1 and the artifact's {self.heads.num_heads} heads, "
                f"got {config.num_heads}"
            )
        choices = self.meta.get("tree") if config.tree == "auto" else config.tree
        if config.tree == "auto" and not choices:
            raise ValueError(f"proposer.tree=auto, but {directory / CONFIG_FILE} stores no tree")
        self.tree = None if choices is None else build_tree(choices, self.num_heads)
        self._choices = [list(c) for c in choices or []]  # in order of expected acceptance
        self._trees = {len(self._choices): self.tree}  # node budget -> (depths, ranks, parents)
        self.profile = AcceptanceProfile()
        budget = config.tree_budget
        if not (budget is None or budget == "auto" or (isinstance(budget, int) and budget >= 1)):
            raise ValueError(f"proposer.tree_budget must be null, a positive integer or auto, got {budget!r}")
        auto = budget == "auto" and self.tree is not None
        self.tuner = BudgetTuner(self.profile, context.cost_curve, len(self._choices)) if auto else None
        self._last_tree: Draft | None = None
        self._draft_seconds = 0.0
        self.policy = DraftLengthPolicy(self.num_heads, context.cost_curve) if config.adaptive else None
        self._last: tuple[int, int] | None = None  # (policy key, draft length) of the round

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        tick = time.perf_counter()
        draft = self._propose(state)
        self._draft_seconds = time.perf_counter() - tick
        return draft

    def _propose(self, state) -> Draft:
        logits = self.heads.fused_logits(state.last_hidden)[: self.num_heads]  # (K, vocab)
        check_finite(logits, "Medusa heads")
        sampling = state.sampling
        if self.tree is None:
            draft_probs = None if sampling.greedy else processed_probs(logits, sampling)  # (K, vocab) float32
            length = self.num_heads
            if self.policy is not None:  # the cut depends on q only: sampling stays lossless
                first = torch.softmax(logits[0].float(), -1) if draft_probs is None else draft_probs[0]
                key = confidence_bucket(float(first.max()))
                length = self.policy.choose(key, self.num_heads)
                self._last = (key, length)
                if length == 0:
                    return Draft.empty()
            if draft_probs is None:
                return Draft.chain(logits[:length].argmax(-1).tolist())
            draft_probs = draft_probs[:length]
            return Draft.chain(sample(draft_probs, state.generator).tolist(), draft_probs)
        depths, ranks, parents = self._budget_tree()
        if sampling.greedy:
            top_tokens = logits.topk(max(ranks) + 1, dim=-1).indices  # (K, max rank + 1)
            draft = Draft(top_tokens[depths, ranks].tolist(), parents)
        else:
            draft_probs = processed_probs(logits, sampling)[depths]  # (n, vocab): each node's head
            draft = Draft(sample(draft_probs, state.generator).tolist(), parents, draft_probs)
        self._last_tree = draft
        return draft

    def _budget_tree(self) -> tuple[list[int], list[int], list[int]]:
        """The tree of the first ``budget`` paths (closed under prefixes: a path never
        ranks above its prefix), built once per budget."""
        budget = self.tuner.budget if self.tuner is not None else self.config.tree_budget
        budget = min(budget or len(self._choices), len(self._choices))
        if budget not in self._trees:
            self._trees[budget] = build_tree(self._choices[:budget], self.num_heads)
        return self._trees[budget]

    def observe(self, state, acceptance) -> None:
        if self._last_tree is not None and self.tuner is not None:
            self.profile.record(self._last_tree, follow_tokens(self._last_tree, acceptance.tokens))
            self.tuner.observe_draft_seconds(self._draft_seconds)  # re-chooses the budget every few rounds
            self._last_tree = None
        if self._last is not None and self.policy is not None:
            key, length = self._last
            self.policy.record(key, length, acceptance.num_accepted)
            self._last = None

    def describe(self) -> dict:
        return {
            "draft_length_rates": self.policy.as_dict() if self.policy is not None else None,
            "num_heads": self.num_heads,
            "tree_nodes": None if self.tree is None else len(self._budget_tree()[0]),
            "tree_budget_auto": self.tuner is not None,
            "acceptance_by_depth_rank": self.profile.as_dict() if self.tuner is not None else None,
            "draft_vocab_size": None if self.heads.draft_vocab is None else len(self.heads.draft_vocab),
            "trainable_parameters": self.meta.get("trainable_parameters"),
            "heads_top1_heldout": self.meta.get("metrics", {}).get("top1"),
        }


def train_command(context, output: str | None = None) -> str:
    """The command line that trains this target's Medusa heads (into ``output`` if given)."""
    model = context.model_config
    parts = ["python -m train drafter=medusa", f"model={model.name}"]
    if model.name_or_path:
        parts.append(f"model.name_or_path={model.name_or_path}")
    if model.name == "tiny-random":
        parts += [
            f"model.vocab_size={model.vocab_size}",
            f"model.hidden_size={model.hidden_size}",
            f"model.num_layers={model.num_layers}",
            f"model.seed={model.seed}",
        ]
    if str(context.artifacts_dir) != "artifacts":
        parts.append(f"artifacts_dir={context.artifacts_dir}")
    if output:
        parts.append(f"train.output={output}")
    return " ".join(parts)
