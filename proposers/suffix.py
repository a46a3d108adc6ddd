"""Suffix decoding: draft a tree of what followed the longest match, here and in earlier requests.

Two suffix indexes (proposers/suffix_index.py) are searched every round:

* the **request**: the prompt and the output so far, updated as tokens arrive;
* the **memory**: earlier requests' outputs (and their prompts with
  ``memory_prompts``), bounded by
  ``memory_requests`` and ``memory_tokens`` (oldest evicted first), optionally
  loaded from and saved to ``memory_path`` so it outlives the process.

In each, the longest suffix of the context (at most ``max_match`` tokens) that
occurred with a continuation is found, and a tree of its likely continuations
is grown best-first (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975);
up to ``match_lengths - 1`` shorter suffixes that occurred more often add the
paths the longest match did not see (a long match is the most specific
evidence, a shorter one the better-voted).
A node's chance of acceptance, given its parent's, is read from how often
nodes like it were accepted, counted per (depth, share of the occurrences that
continued with its token (smoothed: count / (occurrences + 1)), source,
match-length bucket, whether it continues the match's latest occurrence as
prompt lookup would) in an :class:`specdec.decoders.sizing.acceptance.AcceptanceStats`
(the confident convention: the frequency is taken at its word until measured,
and a depth not yet tried starts from the rate measured one level up):
the two sources are weighed separately, and a long match counts for more than a
short one. The two trees are joined (a node present in both takes the better
estimate) and the round keeps the n best nodes, n chosen from the target's cost
T(n) and the drafting time by :func:`specdec.decoders.sizing.search.best_size`, down to no
draft (with a one-node probe after ``explore_every`` rounds switched off, the wait
doubling after each probe that leaves it off: :class:`specdec.decoders.sizing.search.Probe`).

Nodes are chosen deterministically (``draft_probs`` None): every verifier treats
them as point masses, so the proposer is lossless at any temperature. With
``adaptive=false`` the tree is the ``max_nodes`` most frequent continuations.
"""

from __future__ import annotations

import contextlib
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.files import check_writable, write_json
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import register_proposer
from specdec.decoders.sizing.policy import SizingPolicy
from specdec.proposers.suffix_index import State, SuffixIndex

REQUEST, MEMORY = "request", "memory"
MEMORY_FORMAT = 1


def source_key(depth: int, frequency: float, source: str, match_length: int, latest: bool = False) -> tuple:
    """A suffix node's key: (depth, frequency bucket, source, match-length bucket, whether
    it continues the match's latest occurrence)."""
    return (*SizingPolicy.node_key(depth, frequency), source, min(match_length.bit_length(), 5), latest)


def source_label(key: tuple) -> str:
    depth, bucket, source, match, latest = key
    return f"{source}_match{2 ** (match - 1)}+_depth{depth}_f{bucket / 10:.1f}" + ("_latest" * latest)


@dataclass
class Candidate:
    value: float  # estimated probability that the target accepts the whole path
    key: tuple  # calibration key of the path's last node


@register_proposer("suffix")
class SuffixProposer(Proposer):
    shared = frozenset({"memory", "calibration"})  # earlier requests' outputs, the acceptance measured
    per_request = frozenset({"request"})  # the index of the request's own tokens

    @property
    def drafts_trees(self) -> bool:
        return True  # what followed every match, as one tree

    @dataclass
    class Config:
        k: int = 24  # deepest path of a draft tree (tokens after the pending one)
        max_nodes: int = 32  # largest draft tree
        max_match: int = 16  # longest suffix of the context looked up
        # matches of different lengths whose trees are joined: the longest, then shorter
        # ones that occurred more often (1 = the longest match only)
        match_lengths: int = 3
        adaptive: bool = True  # trees sized from T(n) and measured acceptance; false: max_nodes most frequent
        memory_requests: int = 256  # earlier requests kept (0: no memory across requests)
        memory_tokens: int = 200_000  # tokens kept in memory over all requests
        memory_path: str | None = None  # JSON file the memory is loaded from and saved to after each request
        # earlier requests' prompts go into memory too; false: their outputs only (outputs
        # predict outputs; the current prompt is in the request's own index anyway)
        memory_prompts: bool = False
        explore_every: int = 16  # rounds switched off (no draft) before a one-node probe (doubling, up to 8x)
        # nodes that continue the match's latest occurrence (prompt lookup's choice) are
        # calibrated apart from the others: recency as evidence beside frequency
        latest: bool = True

        def __post_init__(self) -> None:
            if self.memory_path:  # written after each request: refused before the first, not after it
                check_writable(Path(self.memory_path), "proposer.memory_path")

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        for name in ("k", "max_nodes", "max_match", "match_lengths", "explore_every"):
            if getattr(config, name) < 1:
                raise ValueError(f"proposer.{name} must be >= 1, got {getattr(config, name)}")
        if config.memory_requests < 0 or config.memory_tokens < 0:
            raise ValueError(
                "proposer.memory_requests and proposer.memory_tokens must be >= 0 (0 turns the memory off), "
                f"got {config.memory_requests} and {config.memory_tokens}"
            )
        self.depth = config.max_match + config.k  # a match and its continuation fit in the index
        # how many ranked candidates to send, and their calibration (keys: source_key(...));
        # a situation where candidates existed but no draft paid is probed every explore_every rounds
        self.sizer = context.sizing.ranked(config.max_nodes, config.explore_every)
        self.calibration = self.sizer.stats
        self._loaded = self._load_memory()  # the memory file's requests, what forget() returns to
        self.memory = self._memory_of(self._loaded)
        self.request = SuffixIndex(self.depth)
        self._indexed = 0  # tokens of the request in self.request
        self._keys: list[tuple] | None = None  # the last draft's node keys
        self.sizes: dict[int, int] = {}  # nodes per round -> rounds
        self.matched = {REQUEST: 0, MEMORY: 0}  # rounds where each source had a match
        self.accepted_from = {REQUEST: 0, MEMORY: 0}  # accepted nodes, by the source that ranked them

    # ------------------------------------------------------------------ requests

    def begin(self, state) -> None:
        self.request = SuffixIndex(self.depth)
        self.request.open_document()
        self._indexed = 0

    def propose(self, state) -> Draft:
        tokens = state.tokens
        self.request.extend(tokens[self._indexed :])
        self._indexed = len(tokens)
        candidates = self._candidates(self.request, tokens, REQUEST)
        for path, candidate in self._candidates(self.memory, tokens, MEMORY).items():
            if path not in candidates or candidate.value > candidates[path].value:
                candidates[path] = candidate
        # best first; a prefix's value is at least its extension's, so every cut is a tree
        ranked = sorted(candidates.items(), key=lambda item: (-item[1].value, len(item[0])))
        ranked = ranked[: self.config.max_nodes]
        size = self._size([c.value for _, c in ranked]) if ranked else 0
        draft, self._keys = tree_of(ranked[:size])
        self.sizes[size] = self.sizes.get(size, 0) + 1
        return draft

    def observe(self, state, round: Round) -> None:
        if self._keys is None:
            return
        keys, self._keys = self._keys, None
        self.calibration.record_round(round, keys)
        for node in round.path:
            self.accepted_from[keys[node][2]] += 1
        self.sizer.observe(round)

    def finish(self, state) -> None:
        self._keys = None
        if self.config.memory_requests == 0 or self.config.memory_tokens == 0:
            return
        kept = state.tokens if self.config.memory_prompts else state.tokens[state.prompt_len :]
        self.memory.add_document(kept[-self.config.memory_tokens :])
        self._evict(self.memory)
        if self.config.memory_path:
            self._save_request(Path(self.config.memory_path), kept[-self.config.memory_tokens :])

    def _save_request(self, path: Path, request: list[int]) -> None:
        """Add the finished request to ``memory_path``, merged with what other processes wrote
        there meanwhile: under an exclusive lock the file is read, the request appended, the
        oldest dropped to the bounds, and the file replaced. (Each process writing its own
        memory whole, the last writer erased the others' requests.)"""
        config = self.config
        with locked(path):
            requests = load_memory(path, self.context.target_key) if path.exists() else []
            requests.append(list(request))
            while requests and (
                len(requests) > config.memory_requests or sum(map(len, requests)) > config.memory_tokens
            ):
                requests.pop(0)
            write_memory(requests, path, self.context.target_key)

    def forget(self) -> None:
        self.memory = self._memory_of(self._loaded)

    # ------------------------------------------------------------------ the tree

    def _candidates(self, index: SuffixIndex, context: list[int], source: str) -> dict[tuple, Candidate]:
        """The best continuation paths of the matches in ``index`` (at most ``max_nodes`` per
        match), best-first by estimated acceptance (adaptive) or by frequency. A path
        found after several matches keeps the longest match's estimate (the most specific
        evidence); shorter matches add only the paths it did not find."""
        matches = index.matches(context, self.config.max_match, self.config.match_lengths)
        if not matches:
            return {}
        self.matched[source] += 1
        found: dict[tuple, Candidate] = {}
        for match in matches:
            for path, candidate in self._grow(index, match, source).items():
                found.setdefault(path, candidate)
        # a path is accepted only after its prefix: never value it above the prefix
        for path in sorted(found, key=len):
            if len(path) > 1 and found[path].value > found[path[:-1]].value:
                found[path] = Candidate(found[path[:-1]].value, found[path].key)
        return found

    def _grow(self, index: SuffixIndex, match: State, source: str) -> dict[tuple, Candidate]:
        """The ``max_nodes`` best paths after one match, grown best-first."""
        match_length = match[1]
        limit, max_depth = self.config.max_nodes, self.config.k
        latest = tuple(index.latest_continuation(match, max_depth)) if self.config.latest else ()
        found: dict[tuple, Candidate] = {}
        order = 0  # heap tie-break: insertion order
        frontier: list[tuple[float, int, tuple, State, tuple]] = [(-1.0, order, (), match, ())]
        while frontier and len(found) < limit:
            negative, _, path, state, key = heapq.heappop(frontier)
            if path:
                found[path] = Candidate(-negative, key)
            if len(path) == max_depth:
                continue
            children = list(index.continuations(state))
            total = sum(c.count for c in children)
            for child in sorted(children, key=lambda c: -c.count)[:limit]:
                # share of the occurrences that continued with this token, one unseen
                # occurrence added: 1 of 1 is 0.5, 5 of 5 is 0.83 (few occurrences prove little)
                frequency = child.count / (total + 1)
                depth = len(path)
                extended = path + (child.token,)
                key = source_key(depth, frequency, source, match_length, extended == latest[: depth + 1])
                rate = self.calibration.rate(key) if self.config.adaptive else frequency
                order += 1
                heapq.heappush(frontier, (negative * rate, order, extended, child.state, key))
        return found

    def _size(self, values: list[float]) -> int:
        """How many of the ranked candidates to send: all up to max_nodes, or (adaptive)
        the number that maximises expected tokens per second, possibly none."""
        if not self.config.adaptive:
            return min(len(values), self.config.max_nodes)
        return self.sizer.choose(values)

    # ------------------------------------------------------------------ memory

    def _load_memory(self) -> list[list[int]]:
        """The requests saved in ``memory_path`` (none if unset or not written yet)."""
        path = self.config.memory_path
        if not path or not Path(path).exists():
            return []
        return load_memory(Path(path), self.context.target_key)

    def _memory_of(self, requests: list[list[int]]) -> SuffixIndex:
        """A memory index over ``requests`` (oldest first), within the bounds."""
        memory = SuffixIndex(self.depth)
        for request in requests:
            memory.add_document(request)
        self._evict(memory)
        return memory

    def _evict(self, memory: SuffixIndex) -> None:
        """Drop the oldest requests until ``memory`` is within both bounds."""
        config = self.config
        while memory.documents > config.memory_requests or memory.tokens > config.memory_tokens:
            memory.remove_oldest()

    def describe(self) -> dict:
        rounds = sum(self.sizes.values())
        return {
            "mean_tree_nodes": round(sum(n * c for n, c in self.sizes.items()) / rounds, 3)
            if rounds
            else None,
            "rounds_without_draft": self.sizes.get(0, 0),
            "rounds_matched": dict(self.matched),
            "accepted_nodes_from": dict(self.accepted_from),
            "memory_requests": self.memory.documents,
            "memory_tokens": self.memory.tokens,
            "acceptance_by_source_match_depth_frequency": self.calibration.as_dict(source_label),
        }


def tree_of(ranked: list[tuple[tuple, Candidate]]) -> tuple[Draft, list[tuple]]:
    """The draft holding the given paths (closed under prefixes), and each node's key.
    Nodes go by depth, siblings by descending value, so the best path is the principal one."""
    ordered = sorted(ranked, key=lambda item: (len(item[0]), -item[1].value))
    node_of: dict[tuple, int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    keys: list[tuple] = []
    for path, candidate in ordered:
        node_of[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(node_of[path[:-1]] if len(path) > 1 else -1)
        keys.append(candidate.key)
    return Draft(tokens, parents, values=[c.value for _, c in ordered]), keys


def save_memory(memory: SuffixIndex, path: Path, target: str) -> None:
    """Write the memory's requests (oldest first) as JSON, atomically; ``target`` names
    the model (and so the tokenizer) whose token ids they are."""
    write_memory([memory.document(i) for i in range(memory.documents)], path, target)


def write_memory(requests: list[list[int]], path: Path, target: str) -> None:
    """``requests`` (oldest first) as a memory file for ``target``, written atomically."""
    write_json(path, {"format": MEMORY_FORMAT, "target": target, "requests": requests}, indent=None)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock on ``path`` (through ``path.lock``) for the block: the
    processes that share a memory file take turns reading and replacing it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform: merge without one
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_memory(path: Path, target: str) -> list[list[int]]:
    """The requests (token lists, oldest first) saved in ``path`` by :func:`save_memory` for ``target``."""
    try:
        payload = json.loads(path.read_text())
        requests = payload["requests"]
        if payload.get("format") != MEMORY_FORMAT or not all(
            isinstance(r, list) and all(isinstance(t, int) for t in r) for r in requests
        ):
            raise ValueError("not a list of token lists")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"proposer.memory_path={path} is not a suffix memory file ({error}); delete it or point "
            "proposer.memory_path at another file"
        ) from error
    if payload.get("target") != target:
        raise ValueError(
            f"proposer.memory_path={path} holds token ids of {payload.get('target')!r}, not of the target "
            f"{target!r}; point proposer.memory_path at a file of this target's (or a new one)"
        )
    return requests
