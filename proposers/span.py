"""Copy a span of the prompt's text, matched and re-tokenised as text, not as token ids.

Prompt lookup (``ngram``, ``suffix``) matches token ids, so it misses a span the output
spells with other tokens than the prompt did: a name copied into a JSON string starts
after a quote (``"Tartu``) where the prompt had it after a space (`` Tartu``), and the
two tokenise differently from the first letter on. This proposer matches text: the
longest tail of the output's text (``min_chars`` to ``max_chars`` characters) found in
the prompt's text, at its latest occurrence, and drafts what followed it there,
tokenised as the tokenizer would (up to ``k`` tokens). A value's first characters, too
few to match alone (``"T``, ``: 1``), are looked up as the start of a word (`` T``, `` 1``).

Under a constraint, a copied value usually ends at a word boundary the span runs past
(``"Tartu``, then the prompt's ``, Estonia``). So at the first ``endings`` boundaries
of the span (before a space or a punctuation mark) the draft also branches into the
tokens that close a JSON string (``",`` ``"}`` ``"]``): the engine keeps those the grammar
allows and appends the forced continuation (the next key) to them, so a round can end a
value and write the next key. Without a constraint there are no endings.

With ``adaptive`` (the default) the span is cut to the length that pays, from the
acceptance measured per match length and depth against the target's T(n)
(:class:`specdec.decoders.sizing.draft_length.DraftLengthPolicy`, as ``ngram`` does), and its nodes
carry those estimates, so ``merge`` sizes it with the other members' drafts.

Drafts are chosen deterministically from the committed tokens (``draft_probs`` None), so
every verifier treats them as point masses: lossless at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.proposer import NeedsTokenizer, Proposer
from specdec.decoders.engine.registry import register_proposer

CLOSINGS = ('",', '"}', '"]')  # the tokens that end a JSON string value (the grammar keeps the valid ones)
TAIL_TOKENS = 16  # the output's last tokens decoded to find the tail's text


@register_proposer("span")
class SpanProposer(Proposer):
    shared = frozenset({"tokenizer"})

    @dataclass
    class Config:
        k: int = 8  # tokens of the copied span drafted
        min_chars: int = 3  # the shortest tail of the output's text looked up
        max_chars: int = 48  # the longest
        endings: int = 2  # under a constraint: string-closing branches at the span's first word ends
        adaptive: bool = True  # cut spans to the length that pays (acceptance per match length vs T(n))

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if context.tokenizer is None:
            raise NeedsTokenizer(
                "proposer=span matches text: it needs the model's tokenizer, and this model has none"
            )
        if config.k < 1 or not 1 <= config.min_chars <= config.max_chars or config.endings < 0:
            raise ValueError(
                "proposer=span needs k >= 1, 1 <= min_chars <= max_chars and endings >= 0, got "
                f"k={config.k}, min_chars={config.min_chars}, max_chars={config.max_chars}, endings={config.endings}"
            )
        self.tokenizer = context.tokenizer
        self.closings = [self._encode(text) for text in CLOSINGS]  # each a token or a few
        self.source = ""
        self.policy = context.sizing.chain(config.k) if config.adaptive else None
        self._endings: list[tuple[int, int]] = []  # this round's ending branches: (first node, boundary rank)
        self._ended = [[0, 0] for _ in range(config.endings)]  # per boundary rank: [tried, ended there]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def begin(self, state) -> None:
        self.source = self.tokenizer.decode(state.tokens[: state.prompt_len], skip_special_tokens=True)

    def propose(self, state) -> Draft:
        self._endings = []
        generated = state.tokens[state.prompt_len :]
        tail = self.tokenizer.decode(generated[-TAIL_TOKENS:], skip_special_tokens=True)
        match = self._match(tail)
        if match is None:
            return Draft.empty()
        start, matched = match
        span = self._encode(self.source[start : start + 8 * self.config.k])[: self.config.k]
        survival = None
        if self.policy is not None:  # situations: how many characters matched (a word's start: 0)
            key = min(matched, 16) // 4
            span = span[: self.policy.choose(key, len(span))]
            survival = self.policy.values(key, len(span))
        if not span:
            return Draft.empty()
        tokens, parents = list(span), list(range(-1, len(span) - 1))
        if state.grammar is not None and self.config.endings:
            for rank, boundary in enumerate(self._boundaries(span)[: self.config.endings]):
                for closing in self.closings:  # a branch after span[:boundary]
                    self._endings.append((len(tokens), rank))
                    parent = boundary - 1
                    for token in closing:
                        tokens.append(token)
                        parents.append(parent)
                        parent = len(tokens) - 1
        draft = Draft(tokens, parents)
        if survival is not None:
            # a span node: the survival measured to its depth; an ending's nodes: the survival
            # to its boundary times how often a value ended at that boundary (measured)
            values = list(survival[: len(span)])
            rates = {first: self._end_rate(rank) for first, rank in self._endings}
            for node in range(len(span), len(tokens)):
                parent = parents[node]
                value = values[parent] if parent >= 0 else 1.0
                values.append(value * rates[node] if node in rates else value)
            draft.values = values
        return draft

    def _end_rate(self, rank: int) -> float:
        """How often a value ended at the ``rank``-th boundary when its span got there (one
        ending of one in two as a prior)."""
        tried, ended = self._ended[rank]
        return (ended + 1.0) / (tried + 2.0)

    def observe(self, state, round: Round) -> None:
        if self.policy is not None:
            self.policy.observe(round)  # counted under the match length it chose for
        if self._endings:  # an ending the target tried, its boundary reached: the value ended there?
            accepted, verified = set(round.path), set(round.verified)
            parents = round.draft.parents
            for first, rank in self._endings:
                parent = parents[first]
                if first in verified and (parent < 0 or parent in accepted):
                    self._ended[rank][0] += 1
                    self._ended[rank][1] += first in accepted

    def describe(self) -> dict:
        return {"draft_length_rates": self.policy.as_dict()} if self.policy is not None else {}

    def _match(self, tail: str) -> tuple[int, int] | None:
        """Where the prompt's text goes on after the longest tail of ``tail`` it holds, and
        how many characters matched (0: a value's first characters, as a word's start)."""
        for length in range(min(self.config.max_chars, len(tail)), self.config.min_chars - 1, -1):
            found = self.source.rfind(tail[-length:])
            if found >= 0 and found + length < len(self.source):
                return found + length, length
        # A value's first characters, too few to match alone: the latest word they start.
        opened = max(tail.rfind('"'), tail.rfind(" "))  # a string's or a number's start
        prefix = tail[opened + 1 :] if opened >= 0 else ""
        if 0 < len(prefix) < self.config.min_chars and not prefix[0].isspace():
            found = self.source.rfind(" " + prefix)
            if found >= 0 and found + 1 + len(prefix) < len(self.source):
                return found + 1 + len(prefix), 0
        return None

    def _boundaries(self, span: list[int]) -> list[int]:
        """The positions in ``span`` where a word ends: before a token that starts with a space
        or a punctuation mark (0: the tail itself may be the whole value)."""
        boundaries = []
        for position, token in enumerate(span):
            text = self.tokenizer.decode([token])
            if text[:1].isspace() or text[:1] in ",.;:!?)]}":
                boundaries.append(position)
        return boundaries
