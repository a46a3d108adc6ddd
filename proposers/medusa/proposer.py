"""The Medusa proposer: drafts from the heads (:mod:`specdec.proposers.medusa.heads`).

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
  per-rank accuracies. When sampling, a node's rank is the order of its draw:
  siblings are drawn one after another without replacement, each from the
  parent's distribution without the tokens drawn before it, renormalised, and
  that row is its draft_probs (the tree verifier's condition for losslessness).
  Distinct siblings accept more than i.i.d. draws, which repeat the likeliest
  token (``sibling_sampling: iid`` keeps those, for comparison). With
  ``tree_budget: auto`` the tree is re-chosen from the acceptance measured per
  (depth, rank), shape and size (decoders/sizing/tree_budget.py).
* dynamic tree (``tree: dynamic``): grown each round from the heads' own
  confidence (decoders/sizing/dynamic_tree.py, the mechanism the draft model's trees
  use): ``tree_width`` frontier nodes per level expanded into their
  ``tree_width`` most probable children, then the best ``tree_budget`` nodes, or
  with ``tree_budget: auto`` each round's best size from the target's cost and
  the acceptance measured per depth and confidence. Its nodes are point masses,
  which at temperature > 0 are accepted with the target's p(x) only; so when
  sampling it drafts, by default (``when_sampling: sampled_tree``), the
  artifact's tree with sampled siblings instead, shaped and sized from measured
  acceptance as ``tree: auto, tree_budget: auto`` is (docs/sampling.md, "Sampled trees at
  temperature > 0": more tau at T=1 in every run there). ``when_sampling:
  point_masses`` keeps the dynamic tree at every temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.decoders.engine.context import artifact_source
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.drafting import DraftSteps, run_alone
from specdec.decoders.engine.files import readable_artifact
from specdec.decoders.engine.proposer import Proposer, constrained_rows
from specdec.decoders.engine.registry import register_proposer
from specdec.decoders.engine.sampling import check_finite, processed_probs
from specdec.decoders.sizing.policy import SizingPolicy, TreeOptions, tree_shape
from specdec.proposers.copy_attention import ContextMemory, MemoryStore
from specdec.proposers.medusa.artifact import CONFIG_FILE, load_artifact
from specdec.proposers.medusa.heads import HeadStep, MedusaHeads
from specdec.proposers.medusa.trees import build_tree, draw_siblings
from specdec.proposers.vocabulary import on_vocabulary

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

    def root(self) -> DraftSteps:
        """Head 0's logits (n,), as a drafting step for sequential heads."""
        if self.heads.sequential:
            token = torch.tensor([self.pending], device=self.hidden.device)
            states, logits = yield HeadStep(self.heads, 0, self.hidden[None], token, self.memory)
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

    def expand(self, nodes: list[int], tokens: list[int], parents: list[int], depth: int) -> DraftSteps:
        """Compute the children's distributions of ``nodes`` (all at ``depth``): a drafting
        step for sequential heads."""
        if not nodes:
            return
        if not self.heads.sequential:
            for node in nodes:
                self.logits[node] = self.fused[depth + 1]
            return
        previous = torch.stack([self.states[parents[node]] for node in nodes])  # (B, hidden)
        rows = torch.tensor([tokens[node] for node in nodes], device=previous.device)  # (B,) draft-vocab rows
        node_tokens = self.ids(rows)  # (B,) token ids, what the heads embed
        states, logits = yield HeadStep(self.heads, depth + 1, previous, node_tokens, self.memory)
        check_finite(logits, "Medusa heads")
        for i, node in enumerate(nodes):
            self.states[node], self.logits[node] = states[i], logits[i]


def _check_options(config) -> None:
    """The options whose values are a closed set, checked before anything loads."""
    if config.when_sampling not in ("sampled_tree", "point_masses"):
        raise ValueError(
            f"proposer.when_sampling must be sampled_tree or point_masses, got {config.when_sampling!r}"
        )
    if config.sibling_sampling not in ("without_replacement", "iid"):
        raise ValueError(
            f"proposer.sibling_sampling must be without_replacement or iid, got {config.sibling_sampling!r}"
        )
    SizingPolicy.check_budget(config.tree_budget)
    config.tree = tree_shape(config.tree, "medusa", static=True)


@register_proposer("medusa")
class MedusaProposer(Proposer):
    shared = frozenset({"heads"})  # the trained heads (and pointer)
    artifact = "medusa"
    trainer = "specdec.train.medusa"

    @dataclass
    class Config(TreeOptions):
        # Artifact directory; null = <artifacts_dir>/<target>/medusa.
        path: str | None = None
        # Heads used (the chain length); null = all the artifact has.
        num_heads: int | None = None
        # tree (TreeOptions): null = chain of top-1 tokens; a list of Medusa choice paths,
        # e.g. [[0], [1], [0, 0]]; auto = the tree stored with the artifact; dynamic = grown
        # each round from the heads' confidence. tree_budget: null here (every path)
        tree_budget: Any = None
        # sampled static trees: "without_replacement" (siblings distinct, each from the parent's
        # distribution without the earlier siblings' tokens) or "iid" (independent draws)
        sibling_sampling: str = "without_replacement"
        # dynamic trees at temperature > 0: "sampled_tree" (the artifact's tree, sampled, shape
        # and size from measured acceptance) or "point_masses" (the dynamic tree itself)
        when_sampling: str = "sampled_tree"
        # chains: cut each draft to the length that pays, from acceptance measured per
        # first-head confidence and the target's T(n) (decoders/sizing/draft_length.py)
        adaptive: bool = True

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        _check_options(config)
        directory = self._load_heads(config, context)
        self.dynamic = (
            context.sizing.dynamic_tree(config.tree_width, self.num_heads, config.tree_budget)
            if config.tree == "dynamic"
            else None
        )
        choices = self._tree_choices(config, directory)
        self.tree = None if choices is None else build_tree(choices, self.num_heads)
        self._choices = [list(c) for c in choices or []]  # in order of expected acceptance
        self._trees = {tuple(map(tuple, self._choices)): self.tree}  # rank paths -> (depths, ranks, parents)
        self._paths = tuple(map(tuple, self._choices))  # the rank paths of the last tree drafted
        # the sizers, from the pipeline's policy: a static tree's budget, a chain's length
        auto = config.tree_budget == "auto" and self.tree is not None
        self.tuner = context.sizing.static_tree(len(self._choices)) if auto else None
        chain = config.adaptive and self.tree is None and self.dynamic is None
        self.policy = context.sizing.chain(self.num_heads) if chain else None
        # the sizer of the shape drafted last (None: a fixed size), which learns from its round;
        # a dynamic tree's rounds drafted as a sampled tree go to the tuner
        self.sizer = self.dynamic or self.tuner or self.policy
        self.memory: ContextMemory | None = None  # copy heads: the request's committed context
        self._unstored: list[torch.Tensor] = []  # hidden states of rounds skipped since the last draft

    def _load_heads(self, config: Config, context) -> Path:
        """Load the artifact's heads (routed as the target's passes are); their directory."""
        directory = Path(config.path) if config.path else context.artifact_path(self.artifact)
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(
                f"no Medusa heads for target {context.target_key!r} at {directory}. Train them with "
                f"`{context.train_command(self.artifact, config.path)}`."
            )
        with readable_artifact(directory, context.train_command(self.artifact, config.path)):
            artifact = load_artifact(
                directory, context.target.output_embeddings(), context.target.input_embeddings()
            )
        self.heads = artifact.heads
        self.artifact_source = artifact_source(directory)
        if context.target.narrow:  # a dynamic tree's levels are narrow passes too
            context.target.route(self.heads, exact=False)
        self.meta = artifact.meta
        self.num_heads = config.num_heads or self.heads.num_heads
        if not 1 <= self.num_heads <= self.heads.num_heads:
            raise ValueError(
                f"proposer.num_heads must be between 1 and the artifact's {self.heads.num_heads} heads, "
                f"got {config.num_heads}"
            )
        return directory

    def _tree_choices(self, config: Config, directory: Path) -> list | None:
        """The rank paths of the static tree drafted (None: a chain or the dynamic tree alone):
        ``tree``'s, or the artifact's (``auto``, and a dynamic tree's shape when sampling)."""
        stored = self.meta.get("tree")
        if config.tree == "auto" and not stored:
            raise ValueError(f"proposer.tree=auto, but {directory / CONFIG_FILE} stores no tree")
        if self.dynamic is not None:
            sampled_shape = config.when_sampling == "sampled_tree" and stored
            return [path for path in stored if len(path) <= self.num_heads] if sampled_shape else None
        return stored if config.tree == "auto" else config.tree

    @property
    def drafts_trees(self) -> bool:
        return self.config.tree is not None

    @property
    def sampled(self) -> bool:
        return self.dynamic is None or self.tree is not None  # dynamic trees alone are deterministic

    def begin(self, state) -> None:
        self.memory = None if self.heads.copy is None else self.heads.context_memory()
        self._unstored = []

    def _remember(self, state) -> DraftSteps:
        """Copy heads: store the positions committed since the last draft (the prompt
        at the first), each with its hidden state, its token and the token after it: those
        of the rounds skipped since (:meth:`skip`) and of the last pass, in one product (a
        drafting step: a batch stores every request's in one)."""
        committed = len(state.tokens) - 1  # positions before the pending token
        start = len(self.memory)
        pieces, self._unstored = self._unstored + [state.committed_hidden], []
        hidden = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (c, hidden)
        if start + len(hidden) != committed:
            raise RuntimeError(
                f"the copy heads' memory holds {start} positions and the passes since committed {len(hidden)}, "
                f"but the request has {committed}: call begin() at each request and propose() every round"
            )
        tokens = state.tokens
        yield MemoryStore(self.memory, hidden, tokens[start:committed], tokens[start + 1 : committed + 1])

    def _take_in(self, state) -> DraftSteps:
        """Copy heads: the committed positions not in the memory yet go to it."""
        if self.heads.copy is not None:
            if self.memory is None:  # the first request, begin() not called
                self.memory = self.heads.context_memory()
            yield from self._remember(state)

    def skip(self, state) -> None:
        """A round not drafted: its committed positions' hidden states wait for the next
        draft, which stores them with its own in one product (a batch the gate keeps plain
        pays nothing per request for the copy heads)."""
        if self.heads.copy is not None:
            self._unstored.append(state.committed_hidden)  # a copy (rows taken by index)

    def propose(self, state) -> Draft:
        return run_alone(self.drafting(state))

    @torch.inference_mode()
    def drafting(self, state) -> DraftSteps:
        """The draft, as drafting steps: every head step (:class:`HeadStep`) a batch's
        requests share."""
        sampling = state.sampling
        yield from self._take_in(state)
        outputs = _HeadOutputs(self.heads, state, self.num_heads, self.memory)
        root = yield from outputs.root()  # (n,) head 0's logits over the draft vocabulary
        if self.dynamic is not None and not (self.tree is not None and not sampling.greedy):
            self.sizer = self.dynamic

            def expand(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> DraftSteps:
                yield from outputs.expand(frontier, rows, parents, depth)
                return torch.stack([outputs.logits[node] for node in frontier])  # (f, n)

            allowed = None
            if state.grammar is not None:  # under a constraint: children among the allowed tokens only
                row_ids = torch.tensor(outputs.token_ids(list(range(root.shape[-1]))))

                def allowed(path: list[int]) -> torch.Tensor:
                    return constrained_rows(state, outputs.token_ids(path) if path else [], row_ids)

            draft = yield from self.dynamic.build_steps(root, expand, "Medusa heads", allowed, state.clock)
            return Draft(outputs.token_ids(draft.tokens), draft.parents, values=draft.values)
        if self.tree is not None:
            self.sizer = self.tuner
            return (yield from self._draft_tree(outputs, *self._budget_tree(), sampling, state.generator))
        length = self.num_heads
        if self.policy is not None:  # the cut depends on q only: sampling stays lossless
            first = torch.softmax(root.float(), -1) if sampling.greedy else processed_probs(root, sampling)
            key = self.context.sizing.confidence(float(first.max()))
            length = self.policy.choose(key, self.num_heads)
            if length == 0:
                return Draft.empty()
        chain = list(range(length))
        shape = (chain, [0] * length, [d - 1 for d in chain])
        return (yield from self._draft_tree(outputs, *shape, sampling, state.generator))

    def _draft_tree(self, outputs, depths, ranks, parents, sampling, generator) -> DraftSteps:
        """Fill the tree shape (nodes ordered by depth) level by level: a node's token
        is its rank among, or (sampling) a draw from, the distribution its parent's
        path gives the node's head (siblings drawn without replacement unless
        ``sibling_sampling=iid``)."""
        iid = self.config.sibling_sampling == "iid"
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
            else:  # (P, rows) float32, one row per parent; siblings in draft (rank) order
                for i, (token, p) in zip(
                    level, draw_siblings(processed_probs(logits, sampling), row, iid, generator)
                ):
                    tokens[i], probs[i] = token, p
            yield from outputs.expand([i for i in level if i in has_children], tokens, parents, depth)
        draft_probs = None if sampling.greedy else outputs.full_rows(torch.stack(probs))  # (nodes, vocab)
        return Draft(outputs.token_ids(tokens), parents, draft_probs)

    def _budget_tree(self) -> tuple[list[int], list[int], list[int]]:
        """The tree to draft: with ``tree_budget: auto``, once measured, the best rank paths
        under the acceptance measured per (depth, rank); otherwise the first ``budget``
        paths of the given tree (closed under prefixes: a path never ranks above its
        prefix). Each shape is built once."""
        if self.tuner is not None and self.tuner.paths is not None:
            paths = tuple(self.tuner.paths)
        else:
            budget = self.tuner.budget if self.tuner is not None else self.config.tree_budget
            budget = min(budget or len(self._choices), len(self._choices))
            paths = tuple(tuple(path) for path in self._choices[:budget])
        if paths not in self._trees:
            self._trees[paths] = build_tree([list(path) for path in paths], self.num_heads)
        self._paths = paths
        return self._trees[paths]

    def observe(self, state, round: Round) -> None:
        if self.sizer is not None:
            self.sizer.observe(round)

    def describe(self) -> dict:
        if self.dynamic is not None:
            return {
                "artifact": self.artifact_source,
                "num_heads": self.num_heads,
                "sequential_heads": self.heads.sequential,
                **self.dynamic.describe(),
                "when_sampling": self.config.when_sampling if self.tree is not None else "point_masses",
                "sampled_tree_paths": [list(path) for path in self._paths] if self.tree is not None else None,
                "sampled_acceptance_by_depth_rank": self.tuner.as_dict() if self.tuner is not None else None,
            }
        return {
            "artifact": self.artifact_source,
            "draft_length_rates": self.policy.as_dict() if self.policy is not None else None,
            "num_heads": self.num_heads,
            "sequential_heads": self.heads.sequential,
            "copy_heads": self.heads.copy is not None,
            "tree_nodes": None if self.tree is None else len(self._budget_tree()[0]),
            "tree_paths": None if self.tree is None else [list(path) for path in self._paths],
            "tree_budget_auto": self.tuner is not None,
            "acceptance_by_depth_rank": self.tuner.as_dict() if self.tuner is not None else None,
            "draft_vocab_size": None if self.heads.draft_vocab is None else len(self.heads.draft_vocab),
            "trainable_parameters": self.meta.get("trainable_parameters"),
            "heads_top1_heldout": self.meta.get("metrics", {}).get("top1"),
        }
