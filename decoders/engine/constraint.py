"""Structured generation: a grammar (JSON schema, regex, Lark/GBNF) that every pipeline obeys.

The constrained target is the target with every token the grammar forbids at a
position given probability 0: its logits there are set to -inf before they become
probabilities (:func:`specdec.decoders.engine.sampling.processed_probs`). Speculation stays
lossless against *that* distribution because the engine, not the verifiers, applies
the grammar, and applies it at every row of every pass:

* **rows**: a pass over the pending token and draft nodes 0..n-1 gives n + 1 rows;
  row 0 is judged with the grammar's state after the committed output, row i + 1
  with its state after the path to node i (:meth:`GrammarState.constrain`). Every
  verifier (greedy, rejection, tree, typical) then reads constrained rows, and
  standard decoding is the same loop with an empty draft, so it masks alike.
* **drafts**: before the pass, :meth:`GrammarState.prune` cuts every node whose token
  the grammar rejects after its path (with its subtree): no row is spent on a node
  that could not be accepted. A sampled node's recorded distribution q (drawn from
  the unconstrained drafter) becomes q restricted to the tokens allowed there and
  renormalised. That is exactly the law of the kept token: a token drawn from q and
  kept only when allowed is distributed as the renormalised q. Each sibling test of
  the verifiers then runs with the q its token was drawn from, and a position whose
  nodes were all cut is decoded from the constrained target directly; either way the
  position's token has the constrained target's distribution, so the cut is lossless
  (tests/decoders/engine/test_constraint.py checks it by enumeration and by sampling).
* **forced tokens**: where the grammar allows one continuation only (keys, quotes,
  braces, the rest of an enum value), the engine appends it, tokenised canonically,
  to every leaf of a speculative draft (:meth:`GrammarState.extend_forced`) and the
  ``grammar`` proposer drafts it from the pending token. These nodes are deterministic
  (q a point mass) and hang on their own path only, so trees stay lossless; the target
  still verifies them.
* **layout tokens**: a forced token must be the canonical spelling whatever follows, so
  forced *bytes* a longer token could still cover stay unforced (the ``": "`` between a
  key and a string value: ``":`` is forced, the `` "`` after it is not, since `` "T``
  is a token too). After the forced tokens the continuation adds the token the target
  wrote for those same left-over bytes before (:class:`LayoutHabits`, per vocabulary),
  valued at its measured share, and then what the grammar forces after it. A value's
  first token then comes as the bonus of the round that wrote its key, not in a round
  of its own.

The grammar engine is llguidance (the one vLLM, SGLang, llama.cpp and guidance use):
it computes a token mask in microseconds, rolls back, and knows forced tokens.
Unconstrained requests never import it. How a constraint is given (``constraint.*``) and
compiled to llguidance's grammar text is :mod:`specdec.decoders.engine.constraint_source`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy
import torch

from specdec.decoders.engine.constraint_source import (
    ConstraintConfig,
    ConstraintError,
    first_line,
    grammar_source,
)
from specdec.decoders.engine.draft import Draft


class LayoutHabits:
    """Which token the target writes for forced bytes that no forced token covers, learnt
    per byte string (`` "``, `` ``, `` [``) from what the target wrote after them. Before
    any is seen, the one token spelling the bytes exactly, valued at one in two."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # llguidance's
        self.seen: dict[bytes, Counter] = {}

    def candidates(self, left: bytes) -> list[tuple[int, float]]:
        """(token, estimated chance the target writes it next), likeliest first."""
        seen = self.seen.get(left)
        if seen:
            total = sum(seen.values())
            return [(token, (count + 1.0) / (total + 2.0)) for token, count in seen.most_common()]
        exact = self.tokenizer.tokenize_bytes(left)
        return [(exact[0], 0.5)] if len(exact) == 1 else []

    def record(self, left: bytes, token: int) -> None:
        self.seen.setdefault(left, Counter())[token] += 1


class GrammarVocabulary:
    """llguidance's view of a tokenizer (every token's bytes), built once per pipeline
    (about 0.3 s for a 49k vocabulary) and shared by all its constraints."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        if tokenizer is None:
            raise ConstraintError("a constraint needs the model's tokenizer, and this model has none")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
            )
        except ValueError as error:
            raise ConstraintError(
                f"constraint: this tokenizer cannot be used ({first_line(error)})"
            ) from None
        self.vocab_size = vocab_size
        self.habits = LayoutHabits(self.tokenizer)

    def compile(self, config: ConstraintConfig | dict | Constraint) -> Constraint:
        if isinstance(config, Constraint):
            return config
        if isinstance(config, dict):
            config = ConstraintConfig(**config)
        if config.kind is None:
            raise ConstraintError(
                "constraint: give constraint.json_schema, constraint.regex or constraint.grammar"
            )
        source, description = grammar_source(config)
        return Constraint(self, source, description, config.forced_per_leaf)

    def allowed(self, bitmask: bytes) -> torch.Tensor:
        """llguidance's bitmask (one bit per token, 32 to a word) as a (vocab,) bool tensor."""
        octets = numpy.frombuffer(bitmask, dtype=numpy.uint8)  # (4 * ceil(vocab / 32),) little-endian words
        bits = numpy.unpackbits(octets, bitorder="little")[: self.vocab_size]  # token 8b + j: bit j of byte b
        return torch.from_numpy(bits.view(numpy.bool_))


class Constraint:
    """A compiled grammar for one vocabulary; :meth:`start` gives a request its state."""

    def __init__(
        self, vocabulary: GrammarVocabulary, source: str, description: str, forced_per_leaf: int
    ) -> None:
        self.vocabulary, self.source, self.description = vocabulary, source, description
        self.forced_per_leaf = forced_per_leaf

    def start(self) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.vocabulary.tokenizer, self.source, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"constraint ({self.description}): {first_line(matcher.get_error())}")
        return GrammarState(self, matcher)

    def accepts(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` is a complete output of the grammar (an end token may follow)."""
        state = self.start()
        body = state.before_end(tokens)
        matcher = state.matcher
        return (
            matcher.validate_tokens(body) == len(body)
            and matcher.consume_tokens(body)
            and matcher.is_accepting()
        )


class GrammarState:
    """One request's place in its grammar: the output so far has been consumed.

    Within a round the state walks the draft (consume a path, roll it back); the masks it
    computes are kept by path for the round, so pruning, the rows and the extension ask
    llguidance once per node."""

    def __init__(self, constraint: Constraint, matcher: Any) -> None:
        self.constraint, self.matcher = constraint, matcher
        self.vocabulary = constraint.vocabulary
        self.masks: dict[tuple[int, ...], torch.Tensor] = {}  # this round's, by path from the output
        self.end_tokens = frozenset(constraint.vocabulary.tokenizer.eos_tokens)
        self.mask_seconds = 0.0  # llguidance's time, for the bench's cost per node
        self.masks_computed = 0
        # this round's layout tokens: (path from the output before it, its left-over bytes)
        self.layouts: set[tuple[tuple[int, ...], bytes]] = set()

    # ---------------------------------------------------------------- the committed output

    def advance(self, tokens: list[int]) -> None:
        """The output grew by ``tokens`` (all allowed: they came from constrained rows).
        What the target wrote after each of the round's layout tokens' paths teaches the
        habits."""
        self.masks.clear()
        for path, left in self.layouts:
            if len(tokens) > len(path) and tuple(tokens[: len(path)]) == path:
                self.vocabulary.habits.record(left, tokens[len(path)])
        self.layouts.clear()
        body = self.before_end(tokens)
        if body and not self.matcher.consume_tokens(body):
            raise RuntimeError(f"the grammar rejected emitted tokens {tokens}: {self.matcher.get_error()}")

    def before_end(self, tokens: list[int] | tuple[int, ...]) -> list[int]:
        """``tokens`` up to their first end token (llguidance's matcher stops by itself once
        a grammar's sentence cannot go on, and an end token fed to a stopped matcher is an
        error it never leaves: the end is kept out of the matcher)."""
        for i, token in enumerate(tokens):
            if token in self.end_tokens:
                return list(tokens[:i])
        return list(tokens)

    def rollback(self, count: int) -> None:
        """The output lost its last ``count`` tokens."""
        self.masks.clear()
        self.layouts.clear()
        if count and not self.matcher.rollback(count):
            raise RuntimeError(f"the grammar cannot roll back {count} tokens: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())

    def forced(self, limit: int | None = None) -> list[int]:
        """The tokens the grammar forces next (canonically tokenised), at most ``limit``."""
        forced = self.matcher.compute_ff_tokens() if not self.matcher.is_stopped() else []
        return list(forced[:limit] if limit is not None else forced)

    def continuation(self, limit: int, path: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
        """(tokens, values) a draft can write after the output plus ``path`` (the matcher
        stands there): the forced tokens (value 1), then, where forced bytes are left that
        they do not cover, the likeliest allowed token the habits know for those bytes
        (value: its chance, times the value before it), and so on, at most ``limit``
        tokens. The matcher is left where it stood."""
        matcher = self.matcher
        tokens: list[int] = []
        values: list[float] = []
        value = 1.0
        while len(tokens) < limit and not matcher.is_stopped():
            forced = self.forced(limit - len(tokens))
            if forced and not matcher.consume_tokens(forced):
                break
            tokens += forced
            values += [value] * len(forced)
            left = matcher.compute_ff_bytes() if len(tokens) < limit and not matcher.is_stopped() else b""
            layout = next(
                ((token, chance) for token, chance in self.vocabulary.habits.candidates(left)
                 if matcher.try_consume_tokens([token]) == 1),
                None,
            ) if left else None  # fmt: skip
            if layout is None:
                break
            self.layouts.add((path + tuple(tokens), left))
            value *= layout[1]
            tokens.append(layout[0])
            values.append(value)
        if tokens:
            matcher.rollback(len(tokens))
        return tokens, values

    # ---------------------------------------------------------------- one round's draft

    def allowed_after(self, path: tuple[int, ...]) -> torch.Tensor:
        """(vocab,) bool: the tokens allowed after the output plus ``path`` (a valid path)."""
        mask = self.masks.get(path)
        if mask is None:
            start = time.perf_counter()
            body = self.before_end(path)
            if len(body) < len(path):  # past an end token: nothing there is kept, the row stays as it is
                mask = torch.ones(self.vocabulary.vocab_size, dtype=torch.bool)
            else:
                if body and not self.matcher.consume_tokens(body):
                    raise RuntimeError(f"internal: draft path {body} is not allowed by the grammar")
                mask = self.vocabulary.allowed(self.matcher.compute_bitmask())
                if body:
                    self.matcher.rollback(len(body))
            self.mask_seconds += time.perf_counter() - start
            self.masks_computed += 1
            self.masks[path] = mask
        return mask

    def paths(self, draft: Draft) -> list[tuple[int, ...]]:
        """Each node's path of tokens from the output, the node's own token last."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(draft.tokens, draft.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        return paths

    def prune(self, draft: Draft) -> Draft:
        """``draft`` without the nodes the grammar rejects after their path (nor their
        subtrees); sampled nodes' q restricted to the allowed tokens and renormalised."""
        if not draft.tokens:
            return draft
        paths = self.paths(draft)
        kept: list[int] = []
        alive = [False] * len(draft)
        for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            if parent >= 0 and not alive[parent]:
                continue
            if bool(self.allowed_after(paths[node][:-1])[token]):
                alive[node] = True
                kept.append(node)
        if len(kept) == len(draft) and draft.draft_probs is None:
            return draft
        pruned = draft.select(kept)  # a new draft: the proposer's own stays as it returned it
        if draft.draft_probs is not None and kept:
            rows = torch.stack([self.allowed_after(paths[node][:-1]) for node in kept])  # (k, vocab)
            restricted = pruned.draft_probs * rows.to(pruned.draft_probs.device)  # (k, vocab)
            pruned.draft_probs = restricted / restricted.sum(-1, keepdim=True)
        return pruned

    def extend_forced(self, draft: Draft, limit: int) -> Draft:
        """``draft`` with the grammar's continuation (:meth:`continuation`: its forced tokens
        and the layout tokens between them, at most ``limit``) appended to each leaf. Added
        nodes are deterministic (point masses); a node's value is its leaf's times its own."""
        if not draft.tokens or limit <= 0:
            return draft
        paths = self.paths(draft)
        leaves = [node for node in range(len(draft)) if not draft.children[node + 1]]
        tokens, parents = list(draft.tokens), list(draft.parents)
        shares: list[tuple[int, float]] = []  # each added node's (leaf, chance given its leaf)
        for leaf in leaves:
            path = list(paths[leaf])
            if len(self.before_end(path)) < len(path):  # the draft ends there
                continue
            if not self.matcher.consume_tokens(path):
                raise RuntimeError(f"internal: draft path {path} is not allowed by the grammar")
            added, values = self.continuation(limit, paths[leaf])
            self.matcher.rollback(len(path))
            parent = leaf
            for token, value in zip(added, values):
                tokens.append(token)
                parents.append(parent)
                shares.append((leaf, value))
                parent = len(tokens) - 1
        if not shares:
            return draft
        extra = len(tokens) - len(draft)
        probs = draft.draft_probs
        if probs is not None:  # the added nodes are point masses on their tokens
            forced_rows = torch.zeros(extra, probs.shape[-1], dtype=probs.dtype, device=probs.device)
            forced_rows[torch.arange(extra), torch.tensor(tokens[len(draft) :])] = 1.0
            probs = torch.cat([probs, forced_rows])
        values = None
        if draft.values is not None:  # an added node is accepted when its leaf is, times its share
            values = list(draft.values)
            values += [values[leaf] * share for leaf, share in shares]
        own = list(range(len(draft))) + [None] * extra  # the added nodes are nobody's
        return Draft(tokens, parents, probs, dict(draft.extras), values=values, origin=(draft, own))

    def constrain(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        """The constrained target's logits: row 0 masked with the state after the output,
        row i + 1 with the state after node i's path. target_logits: (n + 1, vocab);
        returns a new tensor, forbidden tokens at -inf."""
        paths = [()] + self.paths(draft)
        allowed = torch.stack([self.allowed_after(path) for path in paths])  # (n + 1, vocab)
        return target_logits.masked_fill(~allowed.to(target_logits.device), float("-inf"))
