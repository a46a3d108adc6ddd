"""A depth-limited suffix tree over token documents, updated online.

The index answers two questions about the token strings of at most ``depth``
tokens that occur inside its documents: how often does a string occur, and
what followed it each time. Documents are kept in arrival order; the last one
may still be growing (the current request), and the oldest one can be removed
(eviction from a bounded memory).

Structure. A string that occurs at least twice has an explicit node holding
its occurrence count and its children (the next token of each occurrence). A
string that occurs once needs no node: its one occurrence, start ``i``, is
stored as a *leaf* in its parent's children, and every longer string along it
is read from the tokens themselves (``tokens[i + depth]`` is the next one). So
a document of n tokens that repeats little costs about n leaves, not n x depth
nodes, and where text repeats, nodes appear where it does.

Updates. Appending token ``t`` at position ``n`` adds one occurrence to the
strings ``tokens[j : n + 1]`` for the last ``depth`` starts ``j``. Only starts
whose string ``tokens[j : n]`` still occurs more than once (an explicit node)
need work; a string that is unique stays unique when extended, so its start
drops out of the active list for good. Each active start takes one step: count
the explicit child, create a leaf, or split a leaf into a node with two
occurrences. The work per token is at most ``depth`` steps: linear in the text.

Lookups. :meth:`SuffixIndex.longest_match` walks the trie from the root with
the last m tokens of a context, m from ``max_length`` down, and stops at the
first string that occurred with a continuation: at most ``max_length**2``
steps, whatever the length of the documents.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ROOT = 0

# A position in the trie: (code, depth). code >= 0 is an explicit node id; code < 0 is
# the leaf of the single occurrence starting at ~code. depth is the string's length.
State = tuple[int, int]


@dataclass(frozen=True)
class Continuation:
    """One way a string continued: the next token, in how many occurrences, and
    where the longer string sits in the trie."""

    token: int
    count: int
    state: State


class SuffixIndex:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix index needs depth >= 2, got {depth}")
        self.depth = depth
        self._tokens: list[int] = []  # every document's tokens, concatenated
        self._base = 0  # absolute position of self._tokens[0] (documents removed before it)
        self._starts: list[int] = []  # absolute start of each document, oldest first
        self._ends: list[int] = []  # absolute end of each closed document (the last may be open)
        self._open = False  # whether the last document still grows
        self._count: list[int] = [0]  # occurrences per explicit node (the root's unused)
        self._children: list[dict[int, int]] = [{}]  # per explicit node: token -> node id or ~start
        self._latest: list[int] = [-1]  # per explicit node: start of its latest occurrence that continued
        self._free: list[int] = []  # ids of removed nodes, for reuse
        self._active: list[tuple[int, int]] = []  # (start j, node of tokens[j:end]) of the open document

    # ------------------------------------------------------------------ documents

    @property
    def documents(self) -> int:
        return len(self._starts)

    @property
    def tokens(self) -> int:
        """Tokens held, over every document."""
        return len(self._tokens)

    def document(self, number: int) -> list[int]:
        """The tokens of document ``number`` (0 = oldest)."""
        start, end = self._starts[number], self._end(number)
        return self._tokens[start - self._base : end - self._base]

    def open_document(self) -> None:
        """Start a new document; later :meth:`extend` calls grow it."""
        self._close()
        self._starts.append(self._base + len(self._tokens))
        self._open = True
        self._active = []

    def add_document(self, tokens: Sequence[int]) -> None:
        """Index a whole document."""
        self.open_document()
        self.extend(tokens)
        self._close()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the open document."""
        if not self._open:
            raise RuntimeError("SuffixIndex.extend needs an open document (open_document first)")
        for token in tokens:
            self._append(token)

    def remove_oldest(self) -> None:
        """Forget the oldest document: every string loses its occurrences there."""
        if not self._starts:
            raise IndexError("the suffix index holds no document")
        if self._open and len(self._starts) == 1:
            raise RuntimeError("cannot remove the document that is still growing")
        start, end = self._starts[0], self._end(0)
        for i in range(start, end):
            self._remove_occurrence(i, min(i + self.depth, end))
        del self._tokens[: end - start]
        self._base = end
        self._starts.pop(0)
        self._ends.pop(0)

    # ------------------------------------------------------------------ lookups

    def walk(self, pattern: Sequence[int]) -> State | None:
        """Where ``pattern`` sits in the trie; None if it never occurs (or is longer than depth)."""
        if len(pattern) > self.depth:
            return None
        code, depth = ROOT, 0
        for token in pattern:
            if code >= 0:
                child = self._children[code].get(token)
                if child is None:
                    return None
                code = child
            else:
                position = ~code + depth
                if position >= self._end_of(~code) or self._at(position) != token:
                    return None
            depth += 1
        return code, depth

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (non-empty, at most ``depth`` tokens) in the documents."""
        state = self.walk(pattern)
        if state is None:
            return 0
        return self._count[state[0]] if state[0] >= 0 else 1

    def continuations(self, state: State) -> Iterator[Continuation]:
        """What followed the string at ``state``, one entry per distinct next token."""
        code, depth = state
        if depth >= self.depth:
            return
        if code < 0:  # one occurrence: the next token is read from the document
            position = ~code + depth
            if position < self._end_of(~code):
                yield Continuation(self._at(position), 1, (code, depth + 1))
            return
        for token, child in self._children[code].items():
            yield Continuation(token, self._count[child] if child >= 0 else 1, (child, depth + 1))

    def latest_continuation(self, state: State, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest occurrence of the string at
        ``state`` that continued (within its document): prompt lookup's choice. Empty
        where :meth:`continuations` is."""
        code, depth = state
        if depth >= self.depth:
            return []
        start = ~code if code < 0 else self._latest[code]
        if start < self._base:  # none (or evicted, and with it every occurrence that continued)
            return []
        begin, end = start + depth, self._end_of(start)
        return self._tokens[begin - self._base : min(begin + limit, end) - self._base]

    def longest_match(self, context: Sequence[int], max_length: int) -> State | None:
        """The state of the longest suffix of ``context`` (at most ``max_length`` tokens,
        and short enough to continue within ``depth``) that occurred with a continuation."""
        longest = min(max_length, len(context), self.depth - 1)
        for length in range(longest, 0, -1):
            state = self.walk(context[len(context) - length :])
            if state is not None and next(self.continuations(state), None) is not None:
                return state
        return None

    def matches(self, context: Sequence[int], max_length: int, most: int) -> list[State]:
        """Up to ``most`` suffixes of ``context`` that occurred with a continuation, longest
        first, each shorter one kept only if it occurred more often than the last one kept:
        the longest match is the most specific evidence, a shorter one with more
        occurrences the better-voted. ``most=1`` is :meth:`longest_match`."""
        found: list[State] = []
        occurrences = 0
        longest = min(max_length, len(context), self.depth - 1)
        for length in range(longest, 0, -1):
            state = self.walk(context[len(context) - length :])
            if state is None:
                continue
            count = sum(c.count for c in self.continuations(state))
            if count > occurrences:
                found.append(state)
                occurrences = count
                if len(found) == most:
                    break
        return found

    # ------------------------------------------------------------------ internals

    def _at(self, position: int) -> int:
        return self._tokens[position - self._base]

    def _end(self, number: int) -> int:
        if number < len(self._ends):
            return self._ends[number]
        return self._base + len(self._tokens)  # the open document ends where the tokens do

    def _end_of(self, position: int) -> int:
        """End of the document holding absolute ``position``."""
        return self._end(bisect.bisect_right(self._starts, position) - 1)

    def _close(self) -> None:
        if self._open:
            self._ends.append(self._base + len(self._tokens))
            self._open = False
            self._active = []

    def _new_node(self, count: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node] = count
            self._children[node] = {}
            self._latest[node] = -1
            return node
        self._count.append(count)
        self._children.append({})
        self._latest.append(-1)
        return len(self._count) - 1

    def _append(self, token: int) -> None:
        n = self._base + len(self._tokens)
        self._tokens.append(token)
        active: list[tuple[int, int]] = []
        for start, node in self._active + [(n, ROOT)]:
            depth = n - start  # length of tokens[start:n], the string at ``node``
            if depth >= self.depth:
                continue
            self._latest[node] = start  # this occurrence of the string continued, with ``token``
            children = self._children[node]
            child = children.get(token)
            if child is None:  # first occurrence of the longer string: a leaf
                children[token] = ~start
                continue
            if child < 0:  # its one earlier occurrence becomes a node with two
                other = ~child
                child = self._new_node(1)
                children[token] = child
                following = other + depth + 1
                if depth + 1 < self.depth and following < self._end_of(other):
                    self._children[child][self._at(following)] = ~other
                    self._latest[child] = other
            self._count[child] += 1
            active.append((start, child))
        self._active = active

    def _remove_occurrence(self, start: int, end: int) -> None:
        """Remove the occurrence at ``start`` of every string tokens[start:m], m <= end."""
        node = ROOT
        for position in range(start, end):
            children = self._children[node]
            token = self._at(position)
            child = children[token]
            if child < 0:  # its leaf: nothing below is explicit
                del children[token]
                return
            self._count[child] -= 1
            if self._count[child] == 0:
                del children[token]
                self._free_subtree(child)
                return
            node = child

    def _free_subtree(self, node: int) -> None:
        pending = [node]
        while pending:
            node = pending.pop()
            pending.extend(child for child in self._children[node].values() if child >= 0)
            self._children[node] = {}
            self._free.append(node)
