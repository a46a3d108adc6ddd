"""Copy heads: Medusa heads that can point into the text already committed.

A Medusa head reads one hidden state, so it cannot repeat what the context
says: a name from the prompt, the rest of a sentence being quoted, the terms a
summary, translation or answer takes from its source. On the Spec-Bench dev
prompts, the token that followed the latest earlier occurrence of the current
token is the right next-but-one token 38-62% of the time in summarization,
QA, math, RAG and translation, where the trained heads alone are right 13-44%
of the time. This module adds to every head a pointer over the context
(pointer-generator networks, See et al. 2017; prefix attention for draft heads,
Hydra++, Ankner et al. 2024).

Every committed position j (input token x_j, target final hidden state h_j,
which predicted x_(j+1)) stores

    key_j   = W_k [h_(j-1) ; embed(x_j)]        what led to x_j, and x_j
    value_j = W_v [h_j ; embed(x_(j+1))]        what came after it

and head k, extending the token y_k after the state state_(k-1) (the target's
h and the pending token for head 0, head k-1's state and token after that),
asks with

    query_k  = W_q,k [state_(k-1) ; embed(y_k)]
    weight_j = softmax_j(scale_k * cos(query_k, key_j))       over committed j
    read_k   = sum_j weight_j value_j
    gate_k   = sigmoid(w_g,k . [state_(k-1) ; embed(y_k) ; read_k] + b_g,k)

    p_k(x) = gate_k * p_head,k(x) + (1 - gate_k) * sum_j weight_j [x_(j+1) = x]

The token parts of W_k and every W_q,k start as one shared random projection,
so a fresh pointer already looks for the same token; the gate starts at 0.82
for the head. The pointer can propose tokens outside the heads' draft
vocabulary, so copy heads draft over the draft vocabulary plus the tokens of the
committed context: the support of p_k, a few hundred rows more than the draft
vocabulary, not the whole one (scoring and ranking 49,152 rows per head call
cost more than the heads themselves). p_k is a proper distribution: sampled
drafts carry it (zero off its support) as their q rows and stay lossless.

:class:`ContextMemory` holds one request's keys, values and x_(j+1), extended
with the positions each verification pass commits, and the rows drafts use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specdec.decoders.engine.drafting import Work
from specdec.proposers.vocabulary import on_vocabulary

GATE_BIAS = 1.5  # a fresh gate gives the head sigmoid(1.5) = 0.82 of the mass
SCALE = 15.0  # a fresh pointer's inverse temperature on cosine scores


class CopyAttention(nn.Module):
    """Keys and values over committed positions; one query, scale and gate per head."""

    def __init__(self, hidden_size: int, num_heads: int, width: int = 128) -> None:
        super().__init__()
        self.key = nn.Linear(2 * hidden_size, width, bias=False)
        self.value = nn.Linear(2 * hidden_size, width, bias=False)
        self.queries = nn.ModuleList(nn.Linear(2 * hidden_size, width, bias=False) for _ in range(num_heads))
        self.gates = nn.ModuleList(nn.Linear(2 * hidden_size + width, 1) for _ in range(num_heads))
        self.scales = nn.Parameter(torch.full((num_heads,), SCALE))
        projection = torch.randn(width, hidden_size) / hidden_size**0.5  # token part: same token, same key
        with torch.no_grad():
            for linear in [self.key, *self.queries]:
                linear.weight.zero_()
                linear.weight[:, hidden_size:] = projection
            for gate in self.gates:
                gate.weight.zero_()
                gate.bias.fill_(GATE_BIAS)

    def entries(
        self, before: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, following: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions j: before (..., L, hidden) the h_(j-1), tokens
        (..., L, hidden) embed(x_j), hidden (..., L, hidden) the h_j, following
        (..., L, hidden) embed(x_(j+1)) -> keys (..., L, width) unit length, values
        (..., L, width)."""
        keys = nn.functional.normalize(self.key(torch.cat([before, tokens], dim=-1)), dim=-1)
        return keys, self.value(torch.cat([hidden, following], dim=-1))

    def point(
        self,
        k: int,
        state: torch.Tensor,
        embedded: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k's pointer: state, embedded (..., R, hidden) the queries' (state_(k-1),
        embed(y_k)); keys, values (..., L, width); mask (..., R, L), True where a query
        may point (None: everywhere) -> (weights (..., R, L), gate (..., R, 1))."""
        asked = torch.cat([state, embedded], dim=-1)  # (..., R, 2 hidden)
        if keys.shape[-2] == 0:  # nothing committed yet: all mass on the head
            return asked.new_zeros((*asked.shape[:-1], 0)), asked.new_ones((*asked.shape[:-1], 1))
        query = nn.functional.normalize(self.queries[k](asked), dim=-1)  # (..., R, width)
        # in the keys' dtype: a drafting memory keeps float32 ones (ContextMemory)
        scores = self.scales[k] * (query.to(keys.dtype) @ keys.transpose(-1, -2))  # (..., R, L)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with nothing to read: all 0
        read = (weights @ values).to(asked.dtype)  # (..., R, width)
        gate = torch.sigmoid(self.gates[k](torch.cat([asked, read], dim=-1)))  # (..., R, 1)
        return weights, gate


def mixture(
    head_probs: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    following_rows: torch.Tensor,
    size: int,
    head_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """p = gate * head + (1 - gate) * pointer, over ``size`` rows.

    head_probs (R, n) the head's distribution, over rows 0 .. n-1 or over ``head_rows``
    (n,); weights (R, L) the pointer's, onto rows ``following_rows`` (L,) (the rows of
    the x_(j+1)); gate (R, 1) -> (R, size). With rows = token ids and ``head_rows`` the
    draft vocabulary this is the mixture over the whole vocabulary; drafting uses the
    rows of :class:`ContextMemory`, where the head's rows come first."""
    probs = head_probs.new_zeros((len(head_probs), size))  # (R, size)
    if head_rows is None:
        probs[:, : head_probs.shape[-1]] = gate * head_probs
    else:
        probs[:, head_rows] = gate * head_probs
    probs.scatter_add_(1, following_rows[None].expand(len(probs), -1), (1 - gate) * weights)
    return probs


def drafting_log_probs(
    attention: CopyAttention,
    k: int,
    state: torch.Tensor,
    embedded: torch.Tensor,
    head_logits: torch.Tensor,
    memory: ContextMemory,
) -> torch.Tensor:
    """Drafting with a pointer: state, embedded (B, hidden) the queries (see
    :meth:`CopyAttention.point`), head_logits (B, n) the drafter's own over the draft
    vocabulary -> (B, rows) log-probabilities of the mixture over ``memory``'s rows
    (the draft vocabulary, then the context's other tokens)."""
    weights, gate = attention.point(k, state, embedded, memory.keys, memory.values)
    probs = mixture(
        torch.softmax(head_logits.float(), -1),
        weights.float(),
        gate.float(),
        memory.following_rows,
        memory.rows,
    )
    return probs.log().clamp(min=torch.finfo(torch.float32).min)


def label_probability(
    head_logits: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    following: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """Training: the mixture's probability of each label. head_logits (..., n) over the
    draft vocabulary, rows (...) each label's row there (< 0: outside it, or no label),
    weights (..., L) the pointer's, gate (...), following (..., L) (or broadcastable) the
    x_(j+1) token ids, labels (...) token ids -> (...)."""
    head = torch.log_softmax(head_logits, -1).gather(-1, rows.clamp(min=0)[..., None])[..., 0].exp()
    head = head * (rows >= 0)
    copied = (weights * (following == labels[..., None])).sum(-1)
    return gate * head + (1 - gate) * copied


class ContextMemory:
    """One request's keys, values and x_(j+1), grown as positions are committed, and
    the rows copy heads draft over.

    The mixture's support is the heads' draft vocabulary plus the tokens the pointer
    can reach (the committed x_(j+1)), a few hundred more, not the whole vocabulary:
    row r < n is the draft vocabulary's row r, the rows after it are the context's
    other tokens in order of first appearance (``vocab`` maps rows to token ids).
    Rows only ever get appended, so a round's rows stay valid while it drafts.
    """

    def __init__(
        self, attention: CopyAttention, embeddings: nn.Embedding, draft_vocab: torch.Tensor | None = None
    ) -> None:
        self.attention = attention
        self.embeddings = embeddings
        weight = attention.key.weight
        # On CPU, half-precision heads keep their keys and values in float32: their
        # products change shape every round as the context grows, and a bfloat16 product
        # of a shape not seen before cost 0.7 ms (oneDNN builds a kernel per shape) where
        # a float32 one cost 13 us (AVX-512 BF16 EPYC, a context of 300 positions).
        half = weight.dtype in (torch.bfloat16, torch.float16)
        self.dtype = torch.float32 if half and weight.device.type == "cpu" else weight.dtype
        self.keys = weight.new_zeros((0, weight.shape[0]), dtype=self.dtype)  # (L, width)
        self.values = weight.new_zeros((0, weight.shape[0]), dtype=self.dtype)  # (L, width)
        self.following = torch.zeros(0, dtype=torch.long, device=weight.device)  # (L,)
        self.following_rows = self.following  # (L,) rows of the x_(j+1)
        self.last_hidden: torch.Tensor | None = None  # (hidden,) h of the last stored position
        vocab_size = embeddings.num_embeddings
        # token id -> row (-1: no row yet); None: the heads score every token, rows = token ids
        self._row_of: torch.Tensor | None = None
        self.vocab: torch.Tensor | None = None  # (rows,) token id of each row; None = identity
        self.rows = vocab_size
        if draft_vocab is not None:
            draft_vocab = draft_vocab.to(weight.device)
            self._row_of = torch.full((vocab_size,), -1, dtype=torch.long, device=weight.device)
            self._row_of[draft_vocab] = torch.arange(len(draft_vocab), device=weight.device)
            self.vocab = draft_vocab
            self.rows = len(draft_vocab)

    def __len__(self) -> int:
        return len(self.following)

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Drafting rows -> token ids."""
        return rows if self.vocab is None else self.vocab[rows]

    def full_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, rows) distributions over the drafting rows -> (B, vocab), 0 elsewhere."""
        return on_vocabulary(probs, self.vocab, self.embeddings.num_embeddings)

    def _rows_for(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of token ``ids`` (c,), giving new rows to tokens that have none."""
        if self._row_of is None:
            return ids
        rows = self._row_of[ids]
        missing = ids[rows < 0]
        if len(missing):
            fresh, first = torch.unique(missing, return_inverse=True)
            order = torch.full_like(fresh, len(missing)).scatter_reduce(
                0, first, torch.arange(len(missing), device=ids.device), "amin"
            )  # each new token's first appearance
            fresh = fresh[order.argsort()]
            self._row_of[fresh] = torch.arange(self.rows, self.rows + len(fresh), device=ids.device)
            self.vocab = torch.cat([self.vocab, fresh])
            self.rows += len(fresh)
            rows = self._row_of[ids]
        return rows

    def extend(self, hidden: torch.Tensor, tokens: list[int], following: list[int]) -> None:
        """Store positions with final hidden states ``hidden`` (c, hidden), input tokens
        ``tokens`` (their x_j) and the tokens committed after them (their x_(j+1))."""
        ContextMemory.extend_together([self], [(hidden, tokens, following)])

    @staticmethod
    def extend_together(
        memories: Sequence[ContextMemory], positions: Sequence[tuple[torch.Tensor, list[int], list[int]]]
    ) -> None:
        """:meth:`extend` each of ``memories`` (over one attention and embedding table, a
        batch's requests) with its ``positions`` (hidden, tokens, following): the keys and
        values of all of them computed in one product per projection."""
        pieces = []  # per memory with positions: (its index, h_(j-1), h_j, x_j and x_(j+1))
        for index, (memory, (hidden, tokens, following)) in enumerate(zip(memories, positions)):
            if len(tokens) != len(hidden) or len(following) != len(tokens):
                raise ValueError(
                    f"{len(hidden)} hidden states for {len(tokens)} positions and {len(following)} next tokens"
                )
            if not tokens:
                continue
            weight = memory.attention.key.weight
            hidden = hidden.to(weight.dtype)
            last = memory.last_hidden
            first = hidden.new_zeros(1, hidden.shape[-1]) if last is None else last[None]
            ids = torch.tensor([tokens, following], dtype=torch.long, device=weight.device)  # (2, c)
            pieces.append((index, torch.cat([first, hidden[:-1]]), hidden, ids))
        if not pieces:
            return
        first_memory = memories[pieces[0][0]]
        weight = first_memory.attention.key.weight
        ids = _joined([ids for *_, ids in pieces], dim=1)  # (2, all c)
        embedded = first_memory.embeddings(ids).to(weight.dtype)  # (2, all c, hidden)
        keys, values = first_memory.attention.entries(
            _joined([before for _, before, _, _ in pieces]),
            embedded[0],
            _joined([hidden for _, _, hidden, _ in pieces]),
            embedded[1],
        )
        at = 0
        for index, _, hidden, own_ids in pieces:
            count = own_ids.shape[1]
            memories[index]._append(keys[at : at + count], values[at : at + count], own_ids[1], hidden[-1])
            at += count

    def _append(
        self, keys: torch.Tensor, values: torch.Tensor, following: torch.Tensor, last_hidden: torch.Tensor
    ) -> None:
        self.keys = torch.cat([self.keys, keys.to(self.dtype)])
        self.values = torch.cat([self.values, values.to(self.dtype)])
        self.following = torch.cat([self.following, following])
        self.following_rows = torch.cat([self.following_rows, self._rows_for(following)])
        self.last_hidden = last_hidden


def _joined(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``tensors`` concatenated; a lone one as it is (one request alone copies nothing)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


@dataclass(eq=False)
class MemoryStore(Work):
    """Storing one request's committed positions in its :class:`ContextMemory`: a step of
    drafting that a batch runs for all its requests over the same attention as one product
    (:meth:`ContextMemory.extend_together`)."""

    memory: ContextMemory
    hidden: torch.Tensor  # (c, hidden)
    tokens: list[int]
    following: list[int]

    @property
    def rows(self) -> int:  # type: ignore[override]
        return max(len(self.tokens), 1)

    def key(self) -> tuple[str, int]:
        return ("copy memory", id(self.memory.attention))

    @classmethod
    def run_together(cls, works: Sequence[MemoryStore]) -> list[None]:
        with torch.inference_mode():
            ContextMemory.extend_together(
                [work.memory for work in works],
                [(work.hidden, work.tokens, work.following) for work in works],
            )
        return [None] * len(works)
