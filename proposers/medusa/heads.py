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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specdec.decoders.engine.drafting import Work
from specdec.decoders.models.kernels import PackedProduct
from specdec.proposers.copy_attention import ContextMemory, CopyAttention, drafting_log_probs
from specdec.proposers.vocabulary import ReducedVocabulary

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
        base = (
            lm_head if draft_vocab is None else ReducedVocabulary(draft_vocab, self.vocab_size).head(lm_head)
        )
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
        return self.steps([HeadStep(self, k, previous, tokens, memory)])[0]

    def steps(self, calls: Sequence[HeadStep]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`step` for several calls at once (a batch's requests drafting together):
        each head's state over the rows of every call to it, then the vocabulary product,
        which dominates, once over every call's rows; the pointer per call (each over its
        request's memory)."""
        if self.copy is not None and any(call.memory is None for call in calls):
            raise ValueError("copy heads draft from the request's context: pass its ContextMemory")
        embedded = [self.embed(call.tokens, call.previous.dtype) for call in calls]  # (B_i, hidden)
        states: list[torch.Tensor] = [None] * len(calls)  # type: ignore[list-item]
        for k in dict.fromkeys(call.k for call in calls):
            members = [i for i, call in enumerate(calls) if call.k == k]
            joined = self.state(
                k,
                torch.cat([calls[i].previous for i in members]),
                None,
                torch.cat([embedded[i] for i in members]),
            )  # (sum B_i, hidden)
            for i, state in zip(members, joined.split([len(calls[i].previous) for i in members])):
                states[i] = state
        logits = self.projection.heads_logits([call.k for call in calls], states)  # (B_i, n) each
        if self.copy is None:
            return list(zip(states, logits))
        return [
            (state, drafting_log_probs(self.copy, call.k, call.previous, embedded[i], logits[i], call.memory))
            for i, (call, state) in enumerate(zip(calls, states))
        ]

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
    # layout CPU kernels handle well depends on how many states there are: one state
    # is fastest times weight_t (hidden, n), a dynamic tree's level of 4 as
    # weight @ states.T (timings in docs/benchmarks.md, "Dynamic Medusa trees"). Both are kept (_base),
    # for where oneDNN's packed linear (faster than either on x86 CPUs) is not available.
    weight: torch.Tensor  # (n, hidden)
    weight_t: torch.Tensor  # (hidden, n), contiguous
    bias: torch.Tensor | None  # (n,)
    lora_a: torch.Tensor  # (K, rank, hidden)
    lora_b_t: torch.Tensor  # (K, rank, n), LoRA scale folded in
    vocab_size: int
    packed: PackedProduct | None = None  # the base product on oneDNN's packed linear (CPU)

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
            PackedProduct.of(base.weight),
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

    def heads_logits(self, heads: Sequence[int], residuals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`head_logits` of several (head, residuals (B_i, hidden)) pairs, the base
        product once over all their rows -> (B_i, n) each."""
        if len(residuals) == 1:
            return [self.head_logits(heads[0], residuals[0])]
        base = self._base(torch.cat(list(residuals))).split([len(r) for r in residuals])
        return [b + (r @ self.lora_a[k].T) @ self.lora_b_t[k] for b, k, r in zip(base, heads, residuals)]

    def _base(self, residual: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            logits = self.packed(residual)  # (B, n)
        elif len(residual) == 1:
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


@dataclass(eq=False)
class HeadStep(Work):
    """Head k's step over some rows of one request's draft (:meth:`MedusaHeads.step`):
    a model call of drafting. A batch runs the steps of its requests over the same heads
    as one call (:meth:`MedusaHeads.steps`)."""

    heads: MedusaHeads
    k: int
    previous: torch.Tensor  # (B, hidden) the states the step continues from
    tokens: torch.Tensor  # (B,) the tokens it reads
    memory: ContextMemory | None = None  # copy heads: the request's context

    @property
    def rows(self) -> int:  # type: ignore[override]
        return len(self.previous)

    def key(self) -> int:
        return id(self.heads)

    @classmethod
    def run_together(cls, works: Sequence[HeadStep]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.inference_mode():
            return works[0].heads.steps(works)


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
