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

Sequential heads (``drafter.sequential=true``, the default): head k also reads
the embedding of the token before the one it predicts (the pending token for
head 0, head k-1's token after that) and continues from head k-1's state, as in
Hydra (Ankner et al. 2024); see :class:`MedusaHeads`. Head 0 then knows the
token the target has just chosen, which Medusa-1's first head has to guess
around. Drafting runs the heads one after another, batched over a tree level.

Copy heads (``drafter.copy_width > 0``, sequential heads only): each head also
points into the committed context and mixes the token that followed the places
it points at with its own distribution, over the draft vocabulary plus the
context's tokens (proposers/copy_attention.py). The proposer keeps the request's keys and
values, extended each round with the positions the target committed.

Drafts are token trees filled level by level (a chain is the tree whose every
node has one child); a node's token comes from the distribution its parent's
path gives the node's head: for Medusa-1 heads that is the head's one
distribution, for sequential heads the head given the drafted path.

* chain (``tree: null``): each head's top-1 token; when sampling, each token is
  drawn from ``processed_probs`` of its head's logits and those rows are the
  draft_probs. Rejection sampling only needs each token to come from its
  stated row given the tokens before it, so this stays lossless.
* tree: Medusa "choices", a list of paths of top-k ranks per head, e.g.
  ``[[0], [1], [0, 0], [0, 1], [1, 0]]``; node ``[0, 1]`` is head 1's
  second-ranked token under head 0's top token. Paths are ordered so the
  all-0 path is the principal path (what chain verifiers keep). ``"auto"``
  takes the tree stored with the artifact, built from the heads' measured
  per-rank accuracies. When sampling, siblings are i.i.d. draws from their
  shared distribution.
* dynamic tree (``tree: dynamic``): grown each round from the heads' own
  confidence (decoders/dynamic_tree.py, the mechanism the draft model's trees
  use): ``tree_width`` frontier nodes per level expanded into their
  ``tree_width`` most probable children, then the best ``tree_budget`` nodes, or
  with ``tree_budget: auto`` each round's best size from the target's cost and
  the acceptance measured per depth and confidence. Deterministic at every
  temperature (the tree verifier's point-mass rule).

Artifact layout (written by ``python -m train drafter=medusa``)::

    medusa.json         architecture, target key, training summary, default tree
    heads.safetensors   the residual blocks, input mixers (sequential heads) and
                        the draft vocabulary (token ids)
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

from decoders.context import artifact_source
from decoders.draft import Draft, follow_tokens
from decoders.draft_length import DraftLengthPolicy, confidence_bucket
from decoders.dynamic_tree import DynamicTree
from decoders.kernels import route_narrow_linears, routes_narrow_linears
from decoders.registry import register_proposer
from decoders.sampling import check_finite, on_vocabulary, processed_probs, sample
from decoders.tree_budget import AcceptanceProfile, BudgetTuner
from proposers.base import Proposer
from proposers.copy_attention import ContextMemory, CopyAttention, mixture

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

    With ``embeddings`` (the target's input embedding, frozen and not copied) the
    heads are **sequential** (Hydra, Ankner et al. 2024): head k also reads the
    embedding of the token just before the one it predicts, and starts from head
    k-1's state instead of ``h``::

        state_-1 = h,   y_0 = the pending token,   y_k = head k-1's token (k >= 1)
        state_k  = block_k(W_in_k [state_k-1 ; embed(y_k)])       W_in_k trained in full
        logits_k = lm_k(state_k)

    so the first head knows the pending token and each later head knows the draft
    it extends. ``W_in_k`` starts as [I | 0], so a fresh sequential head equals a
    fresh Medusa head.
    """

    def __init__(
        self,
        lm_head: nn.Linear,
        num_heads: int,
        draft_vocab: torch.Tensor | None = None,
        embeddings: nn.Embedding | None = None,
        copy_width: int = 0,
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs at least one head, got num_heads={num_heads}")
        if copy_width and embeddings is None:
            raise ValueError(
                "copy heads must be sequential (they read the drafted tokens): set drafter.sequential=true, "
                "or drafter.copy_width=0 for Medusa-1 heads"
            )
        self.num_heads = num_heads
        self.vocab_size, hidden_size = lm_head.weight.shape
        # (n,) token id of each output row; None = all tokens
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(lm_head.weight.device)
        base = _vocab_projection(lm_head, draft_vocab)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(_shared(base) for _ in range(num_heads))
        self.sequential = embeddings is not None
        self._embeddings = (embeddings,)  # a tuple: the target's module, not a submodule of the heads
        if self.sequential:
            self.inputs = nn.ModuleList(_input_mixer(hidden_size) for _ in range(num_heads))
            self.inputs.to(lm_head.weight)
        # copy heads: a pointer over the committed context (proposers/copy_attention.py)
        self.copy = (
            CopyAttention(hidden_size, num_heads, copy_width).to(lm_head.weight) if copy_width else None
        )
        self.blocks.to(lm_head.weight)
        self._drafting: DraftProjection | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].linear.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks[0].linear.weight.device

    def trained_modules(self) -> dict[str, nn.Module]:
        """The parts trained in full and saved in heads.safetensors (LoRA aside)."""
        modules: dict[str, nn.Module] = {"blocks": self.blocks}
        if self.sequential:
            modules["inputs"] = self.inputs
        if self.copy is not None:
            modules["copy"] = self.copy
        return modules

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The target's input embeddings of ``tokens`` (...), (..., hidden)."""
        return self._embeddings[0](tokens.clamp(min=0)).to(dtype)

    def state(
        self,
        k: int,
        previous: torch.Tensor,
        tokens: torch.Tensor | None,
        embedded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head k's state: previous (..., hidden) is ``h`` for Medusa heads and for the
        first sequential head, head k-1's state otherwise; tokens (...) the y_k above
        (ignored by Medusa heads, whose states all read ``h``), or ``embedded`` their
        embeddings if already looked up."""
        if not self.sequential:
            return self.blocks[k](previous)
        if embedded is None:
            embedded = self.embed(tokens, previous.dtype)  # (..., hidden)
        return self.blocks[k](self.inputs[k](torch.cat([previous, embedded], dim=-1)))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, context=None):
        """hidden (..., hidden), tokens (..., K) the y_k (sequential heads; teacher-forced
        in training) -> logits (..., K, n) over the draft vocabulary, through the PEFT layers.

        Copy heads with ``context`` = (keys, values, mask) from :meth:`CopyAttention.entries`
        ((B, L, width) each, mask (B, R, L)) for hidden (B, R, hidden): also each head's
        pointer, (logits, weights (B, R, K, L), gates (B, R, K))."""
        if self.sequential and tokens is None:
            raise ValueError("sequential heads need the tokens y_0 .. y_K-1 they read")
        logits, weights, gates, state = [], [], [], hidden
        for k, lm in enumerate(self.lm_heads):
            token = None if tokens is None else tokens[..., k]
            embedded = None
            if context is not None:
                keys, values, mask = context
                embedded = self.embed(token, state.dtype)
                weight, gate = self.copy.point(k, state, embedded, keys, values, mask)
                weights.append(weight)
                gates.append(gate)
            state = self.state(k, state if self.sequential else hidden, token, embedded)
            logits.append(lm(state))
        if context is None:
            return torch.stack(logits, dim=-2)
        return torch.stack(logits, dim=-2), torch.stack(weights, dim=-2), torch.cat(gates, dim=-1)

    def fused_logits(self, hidden: torch.Tensor, full: bool = True) -> torch.Tensor:
        """Medusa heads: hidden (hidden,) -> logits (K, vocab): :meth:`forward`'s values
        from one matmul for all heads, scattered to token ids; tokens outside the draft
        vocabulary get the dtype's lowest value. ``full=False``: (K, n), the draft
        vocabulary's rows only."""
        if self.sequential:
            raise ValueError("sequential heads depend on the drafted tokens: draft them with step()")
        residual = torch.stack([block(hidden) for block in self.blocks])  # (K, hidden)
        return self.projection.logits(residual, full)

    def step(
        self, k: int, previous: torch.Tensor, tokens: torch.Tensor, memory: ContextMemory | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequential heads, drafting: previous (B, hidden), tokens (B,) -> (head k's
        states (B, hidden), its logits (B, n) over the draft vocabulary's rows).

        Copy heads read ``memory`` and give log-probabilities of the mixture with their
        pointer instead, over the memory's rows (:class:`ContextMemory`), (B, rows)."""
        if self.copy is None:
            state = self.state(k, previous, tokens)
            return state, self.projection.head_logits(k, state)  # (B, n)
        if memory is None:
            raise ValueError("copy heads draft from the request's context: pass its ContextMemory")
        embedded = self.embed(tokens, previous.dtype)  # (B, hidden)
        state = self.state(k, previous, tokens, embedded)
        logits = self.projection.head_logits(k, state)  # (B, n)
        weights, gate = self.copy.point(k, previous, embedded, memory.keys, memory.values)
        probs = mixture(
            torch.softmax(logits.float(), -1),
            weights.float(),
            gate.float(),
            memory.following_rows,
            memory.rows,
        )  # (B, rows): the draft vocabulary, then the context's other tokens
        return state, probs.log().clamp(min=torch.finfo(torch.float32).min)

    def context_memory(self) -> ContextMemory:
        """An empty memory of committed positions for one request (copy heads)."""
        if self.copy is None:
            raise ValueError("these heads have no copy attention")
        return ContextMemory(self.copy, self._embeddings[0], self.draft_vocab)

    @property
    def projection(self) -> DraftProjection:
        """The lm projections gathered for drafting, on first use: use it after training."""
        if self._drafting is None:
            self._drafting = DraftProjection.gather(self)
        return self._drafting


def _input_mixer(hidden_size: int) -> nn.Linear:
    """W_in of a sequential head: [state ; embedding] -> hidden, starting as [I | 0]."""
    mixer = nn.Linear(2 * hidden_size, hidden_size, bias=False)
    with torch.no_grad():
        mixer.weight.zero_()
        mixer.weight[:, :hidden_size] = torch.eye(hidden_size)
    return mixer


@dataclass
class DraftProjection:
    """All heads' lm projections for drafting: the base weight once, LoRA per head."""

    draft_vocab: torch.Tensor | None  # (n,) token ids of the rows; None = all tokens
    # Drafting is mostly the product of a few states with the weight, and which memory
    # layout CPU kernels handle well depends on how many states there are. For 6,289
    # rows here: one state times weight_t (hidden, n) takes 0.7 ms against 2.4 ms for
    # F.linear with weight (n, hidden); 4 states (a dynamic tree's level) take 1.4 ms
    # as weight @ states.T against 5.7 ms as states @ weight_t. Both are kept (_base).
    weight: torch.Tensor  # (n, hidden)
    weight_t: torch.Tensor  # (hidden, n), contiguous
    bias: torch.Tensor | None  # (n,)
    lora_a: torch.Tensor  # (K, rank, hidden)
    lora_b_t: torch.Tensor  # (K, rank, n), LoRA scale folded in
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
            base.weight.detach().T.contiguous(),
            None if base.bias is None else base.bias.detach(),
            torch.stack(lora_a).detach(),
            torch.stack(lora_b).detach().transpose(1, 2).contiguous(),
            heads.vocab_size,
        )

    def logits(self, residual: torch.Tensor, full: bool = True) -> torch.Tensor:
        """residual (K, hidden), row k for head k -> (K, vocab), or (K, n) over the
        draft vocabulary with ``full=False``."""
        low_rank = torch.einsum("krh,kh->kr", self.lora_a, residual)  # (K, rank)
        logits = self._base(residual) + torch.einsum("krn,kr->kn", self.lora_b_t, low_rank)
        return self._full(logits) if full else logits

    def head_logits(self, k: int, residual: torch.Tensor) -> torch.Tensor:
        """residual (B, hidden), all rows for head k -> (B, n) over the draft vocabulary."""
        return self._base(residual) + (residual @ self.lora_a[k].T) @ self.lora_b_t[k]

    def _base(self, residual: torch.Tensor) -> torch.Tensor:
        if len(residual) == 1:
            logits = residual @ self.weight_t  # (1, n)
        else:
            logits = (self.weight @ residual.T).T  # (B, n)
        return logits if self.bias is None else logits + self.bias

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, n) over the draft vocabulary -> (B, vocab); the rest get the dtype's lowest value."""
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((len(logits), self.vocab_size), torch.finfo(logits.dtype).min)  # (B, vocab)
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
    tensors = {
        f"{part}.{name}": t.detach().contiguous()
        for part, module in heads.trained_modules().items()
        for name, t in module.state_dict().items()
    }
    if heads.draft_vocab is not None:
        tensors[VOCAB_KEY] = heads.draft_vocab.cpu().contiguous()
    save_file(tensors, str(directory / BLOCKS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def load_artifact(
    directory: Path, lm_head: nn.Linear, embeddings: nn.Embedding | None = None
) -> MedusaArtifact:
    """Build heads over ``lm_head`` (and ``embeddings``, which sequential heads read)
    and load the trained parts, draft vocabulary and adapter."""
    from peft import PeftModel

    meta = json.loads((directory / CONFIG_FILE).read_text())
    vocab_size, hidden_size = lm_head.weight.shape
    if (meta["vocab_size"], meta["hidden_size"]) != (vocab_size, hidden_size):
        raise ValueError(
            f"the Medusa heads in {directory} were trained for a target with vocab {meta['vocab_size']} and "
            f"hidden size {meta['hidden_size']}, but this target has {vocab_size} and {hidden_size}; "
            "retrain them for this target with `python -m train drafter=medusa`."
        )
    sequential = bool(meta.get("sequential", False))
    if sequential and embeddings is None:
        raise ValueError(
            f"the heads in {directory} are sequential: load them with the target's input embeddings"
        )
    tensors = load_file(str(directory / BLOCKS_FILE))
    draft_vocab = tensors.pop(VOCAB_KEY, None)
    heads = MedusaHeads(
        lm_head, meta["num_heads"], draft_vocab, embeddings if sequential else None, meta.get("copy_width", 0)
    )
    for part, module in heads.trained_modules().items():
        module.load_state_dict(
            {name.removeprefix(f"{part}."): t for name, t in tensors.items() if name.startswith(f"{part}.")}
        )
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


class _HeadOutputs:
    """The heads' logits for one draft, over the draft vocabulary's rows (token ids
    only for the chosen tokens), computed as the tree grows.

    ``logits[p]`` holds the logits of the children of node p (-1 =
    the root, i.e. depth-0 nodes): for Medusa heads head depth(p)+1's logits from
    ``h``, the same for every parent; for sequential heads the logits of that head
    given p's path, computed by ``expand`` (batched over a level's parents).
    """

    def __init__(
        self, heads: MedusaHeads, state, num_heads: int, memory: ContextMemory | None = None
    ) -> None:
        self.heads = heads
        self.memory = memory  # copy heads: the request's committed context
        self.hidden = state.last_hidden  # (hidden,)
        self.pending = state.tokens[-1]
        self.num_heads = num_heads
        self.fused: torch.Tensor | None = None  # (K, n) Medusa heads
        self.states: dict[int, torch.Tensor] = {}  # node -> head state its children's head reads
        self.logits: dict[int, torch.Tensor] = {}  # node -> (n,) its children's logits

    def root(self) -> torch.Tensor:
        if self.heads.sequential:
            token = torch.tensor([self.pending], device=self.hidden.device)
            states, logits = self.heads.step(0, self.hidden[None], token, self.memory)
            self.states[-1], self.logits[-1] = states[0], logits[0]
        else:
            self.fused = self.heads.fused_logits(self.hidden, full=False)[: self.num_heads]  # (K, n)
            self.logits[-1] = self.fused[0]
        check_finite(self.fused if self.fused is not None else self.logits[-1], "Medusa heads")
        return self.logits[-1]

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Drafting rows -> token ids: the memory's rows for copy heads, else the draft
        vocabulary's (token ids themselves if the heads score every token)."""
        if self.memory is not None:
            return self.memory.token_ids(rows)
        return rows if self.heads.draft_vocab is None else self.heads.draft_vocab[rows]

    def token_ids(self, rows: list[int]) -> list[int]:
        return self.ids(torch.tensor(rows, dtype=torch.long, device=self.hidden.device)).tolist()

    def full_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, rows) drafting distributions -> (B, vocab), 0 outside the rows."""
        if self.memory is not None:
            return self.memory.full_rows(probs)
        return on_vocabulary(probs, self.heads.draft_vocab, self.heads.vocab_size)

    def expand(self, nodes: list[int], tokens: list[int], parents: list[int], depth: int) -> None:
        """Compute the children's distributions of ``nodes`` (all at ``depth``)."""
        if not nodes:
            return
        if not self.heads.sequential:
            for node in nodes:
                self.logits[node] = self.fused[depth + 1]
            return
        previous = torch.stack([self.states[parents[node]] for node in nodes])  # (B, hidden)
        rows = torch.tensor([tokens[node] for node in nodes], device=previous.device)  # (B,) draft-vocab rows
        node_tokens = self.ids(rows)  # (B,) token ids, what the heads embed
        states, logits = self.heads.step(depth + 1, previous, node_tokens, self.memory)
        check_finite(logits, "Medusa heads")
        for i, node in enumerate(nodes):
            self.states[node], self.logits[node] = states[i], logits[i]


@register_proposer("medusa")
class MedusaProposer(Proposer):
    @dataclass
    class Config:
        # Artifact directory; null = <artifacts_dir>/<target>/medusa.
        path: str | None = None
        # Heads used (the chain length); null = all the artifact has.
        num_heads: int | None = None
        # null = chain of top-1 tokens; a list of Medusa choice paths, e.g.
        # [[0], [1], [0, 0]]; "auto" = the tree stored with the artifact; "dynamic" =
        # grown each round from the heads' confidence (decoders/dynamic_tree.py).
        tree: Any = None
        # trees: nodes kept, the first N of the tree's paths (ordered by expected
        # acceptance) or the N most probable of a dynamic tree's candidates; null = all;
        # "auto" = chosen from the target's T(n) and the acceptance measured so far
        # (decoders/tree_budget.py; per round for dynamic trees)
        tree_budget: Any = None
        tree_width: int = 4  # dynamic trees: children per expanded node, nodes expanded per level
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
        artifact = load_artifact(
            directory, context.target.get_output_embeddings(), context.target.get_input_embeddings()
        )
        self.heads = artifact.heads
        self.artifact = artifact_source(directory)
        if routes_narrow_linears(context.target):  # a dynamic tree's levels are narrow passes too
            route_narrow_linears(self.heads)
        self.meta = artifact.meta
        self.num_heads = config.num_heads or self.heads.num_heads
        if not 1 <= self.num_heads <= self.heads.num_heads:
            raise ValueError(
                f"proposer.num_heads must be between 1 and the artifact's {self.heads.num_heads} heads, "
                f"got {config.num_heads}"
            )
        self.dynamic = (
            DynamicTree(config.tree_width, self.num_heads, config.tree_budget, context.cost_curve)
            if config.tree == "dynamic"
            else None
        )
        self.sampled = self.dynamic is None  # dynamic trees are deterministic
        choices = self.meta.get("tree") if config.tree == "auto" else None if self.dynamic else config.tree
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
        self.memory: ContextMemory | None = None  # copy heads: the request's committed context

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        tick = time.perf_counter()
        draft = self._propose(state)
        self._draft_seconds = time.perf_counter() - tick
        return draft

    def begin(self, state) -> None:
        self.memory = None if self.heads.copy is None else self.heads.context_memory()

    def _remember(self, state) -> None:
        """Copy heads: store the positions committed since the last round (the prompt
        at the first), each with its hidden state, its token and the token after it."""
        committed = len(state.tokens) - 1  # positions before the pending token
        start = len(self.memory)
        hidden = state.committed_hidden  # (c, hidden)
        if start + len(hidden) != committed:
            raise RuntimeError(
                f"the copy heads' memory holds {start} positions and the last pass committed {len(hidden)}, "
                f"but the request has {committed}: call begin() at each request and propose() every round"
            )
        self.memory.extend(hidden, state.tokens[start:committed], state.tokens[start + 1 : committed + 1])

    def _propose(self, state) -> Draft:
        sampling = state.sampling
        if self.heads.copy is not None:
            if self.memory is None:  # the first request, begin() not called
                self.memory = self.heads.context_memory()
            self._remember(state)
        outputs = _HeadOutputs(self.heads, state, self.num_heads, self.memory)
        root = outputs.root()  # (n,) head 0's logits over the draft vocabulary
        if self.dynamic is not None:

            def expand(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> torch.Tensor:
                outputs.expand(frontier, rows, parents, depth)
                return torch.stack([outputs.logits[node] for node in frontier])  # (f, n)

            draft = self.dynamic.build(root, expand, "Medusa heads")
            self._last_tree = Draft(outputs.token_ids(draft.tokens), draft.parents)
            return self._last_tree
        if self.tree is not None:
            draft = self._draft_tree(outputs, *self._budget_tree(), sampling, state.generator)
            self._last_tree = draft
            return draft
        length = self.num_heads
        if self.policy is not None:  # the cut depends on q only: sampling stays lossless
            first = torch.softmax(root.float(), -1) if sampling.greedy else processed_probs(root, sampling)
            key = confidence_bucket(float(first.max()))
            length = self.policy.choose(key, self.num_heads)
            self._last = (key, length)
            if length == 0:
                return Draft.empty()
        chain = list(range(length))
        return self._draft_tree(
            outputs, chain, [0] * length, [d - 1 for d in chain], sampling, state.generator
        )

    @staticmethod
    def _draft_tree(outputs, depths, ranks, parents, sampling, generator) -> Draft:
        """Fill the tree shape (nodes ordered by depth) level by level: a node's token
        is its rank among, or (sampling) a draw from, the distribution its parent's
        path gives the node's head; siblings share that distribution."""
        tokens = [0] * len(depths)
        probs: list[torch.Tensor] = [None] * len(depths)  # type: ignore[list-item]
        has_children = {p for p in parents if p >= 0}
        for depth in range(max(depths) + 1):
            level = [i for i, d in enumerate(depths) if d == depth]
            owners = list(dict.fromkeys(parents[i] for i in level))  # parents of this level, -1 = root
            logits = torch.stack([outputs.logits[p] for p in owners])  # (P, n) filled by root() and expand()
            row = [owners.index(parents[i]) for i in level]
            if sampling.greedy:  # tokens hold rows of the draft vocabulary until the end
                top = logits.topk(max(ranks[i] for i in level) + 1, dim=-1).indices  # (P, ranks)
                for i, r in zip(level, row):
                    tokens[i] = int(top[r, ranks[i]])
            else:
                level_probs = processed_probs(logits, sampling)[row]  # (len(level), vocab) float32
                for i, token, p in zip(level, sample(level_probs, generator).tolist(), level_probs):
                    tokens[i], probs[i] = token, p
            outputs.expand([i for i in level if i in has_children], tokens, parents, depth)
        draft_probs = None if sampling.greedy else outputs.full_rows(torch.stack(probs))  # (nodes, vocab)
        return Draft(outputs.token_ids(tokens), parents, draft_probs)

    def _budget_tree(self) -> tuple[list[int], list[int], list[int]]:
        """The tree of the first ``budget`` paths (closed under prefixes: a path never
        ranks above its prefix), built once per budget."""
        budget = self.tuner.budget if self.tuner is not None else self.config.tree_budget
        budget = min(budget or len(self._choices), len(self._choices))
        if budget not in self._trees:
            self._trees[budget] = build_tree(self._choices[:budget], self.num_heads)
        return self._trees[budget]

    def observe(self, state, acceptance) -> None:
        if self._last_tree is not None and self.dynamic is not None:
            self.dynamic.record(
                self._last_tree, follow_tokens(self._last_tree, acceptance.tokens), self._draft_seconds
            )
            self._last_tree = None
        if self._last_tree is not None and self.tuner is not None:
            self.profile.record(self._last_tree, follow_tokens(self._last_tree, acceptance.tokens))
            self.tuner.observe_draft_seconds(self._draft_seconds)  # re-chooses the budget every few rounds
            self._last_tree = None
        if self._last is not None and self.policy is not None:
            key, length = self._last
            self.policy.record(key, length, acceptance.num_accepted)
            self._last = None

    def describe(self) -> dict:
        if self.dynamic is not None:
            return {
                "artifact": self.artifact,
                "num_heads": self.num_heads,
                "sequential_heads": self.heads.sequential,
                **self.dynamic.describe(),
            }
        return {
            "artifact": self.artifact,
            "draft_length_rates": self.policy.as_dict() if self.policy is not None else None,
            "num_heads": self.num_heads,
            "sequential_heads": self.heads.sequential,
            "copy_heads": self.heads.copy is not None,
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
