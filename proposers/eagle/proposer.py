"""The ``eagle`` proposer: chains and EAGLE-2 dynamic trees from a trained drafter.

Each round first syncs the drafter's KV cache with the positions the target
committed (fed with the target's features), then drafts from the root it gives.
A round not drafted (:meth:`EagleProposer.skip`) keeps its positions' features for the
next draft's sync, which feeds them with its own in one pass.
A drafter with a pointer (``drafter.copy_width``) also stores those positions in
the request's :class:`ContextMemory` and drafts over its rows (the draft vocabulary,
then the context's other tokens) from the mixture with the pointer.

Drafting runs as steps (:mod:`specdec.decoders.engine.drafting`): every pass of the draft
layer (the sync, each token of a chain, each level of a tree) is a
:class:`~specdec.decoders.engine.drafting.ModelPass` over the request's session of the
drafter (a :class:`Target` of its own), and the pointer's stores are
:class:`MemoryStore` steps, so a batch runs each step for all its requests as one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.decoders.engine.context import artifact_source
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.drafting import DraftSteps, ModelPass, run_alone
from specdec.decoders.engine.files import readable_artifact
from specdec.decoders.engine.proposer import Proposer, constrained_rows, draft_token
from specdec.decoders.engine.registry import register_proposer
from specdec.decoders.engine.sampling import check_finite
from specdec.decoders.models.target import Target
from specdec.decoders.sizing.policy import TreeOptions, tree_shape
from specdec.proposers.copy_attention import ContextMemory, MemoryStore, drafting_log_probs
from specdec.proposers.eagle.artifact import CONFIG_FILE, load_artifact
from specdec.proposers.eagle.drafter import check_llama_style, target_features


@register_proposer("eagle")
class EagleProposer(Proposer):
    # the drafter, its vocabulary, the tap on the target
    shared = frozenset({"drafter", "draft", "tap", "token_ids", "meta"})
    per_request = frozenset({"memory"})  # the pointer's store of the request's context
    artifact = "eagle"
    trainer = "specdec.train.eagle"

    @dataclass
    class Config(TreeOptions):  # tree: null (a chain) by default
        # Artifact directory; null = <artifacts_dir>/<target>/eagle.
        path: str | None = None
        k: int = 4  # chain: most tokens per draft; tree: its depth
        # chains: cut each draft to the length that pays, from acceptance measured per
        # first-token confidence and the target's T(n) (decoders/sizing/draft_length.py)
        adaptive: bool = True

    @property
    def drafts_trees(self) -> bool:
        return self.config.tree is not None

    @property
    def sampled(self) -> bool:
        return not self.config.tree  # chains carry q; trees are deterministic (point masses)

    @property
    def reads_target_layers(self) -> bool:
        return True  # its features are the target's layer outputs, tapped as its passes run

    @property
    def batch_refusal(self) -> str | None:
        return None  # the tap gives each request its own rows of a packed pass's layers

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        config.tree = tree_shape(config.tree, "eagle")
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        check_llama_style(context.target.model)  # before asking for an artifact it could never have
        directory = Path(config.path) if config.path else context.artifact_path(self.artifact)
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(
                f"no EAGLE drafter for target {context.target_key!r} at {directory}. Train it with "
                f"`{context.train_command(self.artifact, config.path)}`."
            )
        with readable_artifact(directory, context.train_command(self.artifact, config.path)):
            artifact = load_artifact(directory, context.target.model)
        self.drafter = artifact.drafter
        self.draft = Target(self.drafter)  # its passes: alone, or packed over a batch's requests
        if context.target.narrow:  # drafting passes are narrow passes too
            context.target.route(self.drafter, exact=False)
        self.meta = artifact.meta
        self.artifact_source = artifact_source(directory)
        self.num_target_layers = context.target.num_layers
        self.layers = self.drafter.feature_layers
        self.tap = context.target.tap([i - 1 for i in self.layers if i < self.num_target_layers])
        self.session = self.draft.session()
        self.token_ids = self.drafter.vocabulary.token_ids.to(self.drafter.device)  # (n,) row -> token id
        self.dynamic = (
            context.sizing.dynamic_tree(config.tree_width, config.k, config.tree_budget)
            if config.tree
            else None
        )
        self.policy = context.sizing.chain(config.k) if config.adaptive and not config.tree else None
        self._fed = 0  # committed positions in the draft's cache (fed with the target's features)
        self._unfed: list[torch.Tensor] = []  # features of the rounds not drafted since, (c, F) each
        self.memory: ContextMemory | None = None  # a drafter with a pointer: the request's context

    def begin(self, state) -> None:
        self.session.reset()
        self._fed = 0
        self._unfed = []
        self.memory = None if self.drafter.copy is None else self.drafter.context_memory()

    def propose(self, state) -> Draft:
        return run_alone(self.drafting(state))

    @torch.inference_mode()
    def drafting(self, state) -> DraftSteps:
        """The draft, as steps: the sync, then the chain's or the tree's passes of the draft
        layer, each a :class:`ModelPass` a batch's requests share."""
        root_logits, root_state = yield from self._sync(state)
        if self.dynamic is not None:
            return (yield from self._draft_tree(root_logits, root_state, state))
        return (yield from self._draft_chain(root_logits, root_state, state))

    @torch.inference_mode()
    def skip(self, state) -> None:
        """A round not drafted: its committed positions' features (read now, from the pass
        that committed them) wait for the next draft's sync, which feeds them with its own
        in one pass (a batch the gate keeps plain runs no pass of the drafter)."""
        self._unfed.append(self._committed_features(state))

    def _committed_features(self, state) -> torch.Tensor:
        """(c, F) the target's features at the positions its last pass committed."""
        return target_features(
            self.layers, self.num_target_layers, state.hidden, self.tap, state.committed_rows
        )

    def _sync(self, state) -> DraftSteps:
        """Drop last round's drafted entries, feed the positions the target committed
        since (their features and the tokens after them); -> the root logits (n,) (or,
        with a pointer, log-probabilities over the memory's rows) and the draft's state
        (hidden,) at the last committed position."""
        pieces, self._unfed = self._unfed + [self._committed_features(state)], []
        features = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (c, F)
        committed = len(state.tokens) - 1  # positions before the pending token
        start = committed - len(features)
        if start != self._fed:
            raise RuntimeError(
                f"the EAGLE draft cache holds {self._fed} positions and the passes since committed "
                f"{len(features)}, but the request has {committed}: call begin() at each request and "
                "propose() or skip() every round"
            )
        self.session.truncate(self._fed)
        following = state.tokens[start + 1 : committed + 1]
        fused = self.drafter.fuse(features.to(self.drafter.dtype))  # (c, hidden)
        next_tokens = torch.tensor(following, device=self.drafter.device)
        inputs = self.drafter.inputs(fused, next_tokens)  # (c, hidden)
        fed = ModelPass(self.session, following, last_only=True, inputs_embeds=inputs)
        logits = (yield fed)[-1:]  # (1, n)
        self._fed = committed
        if self.memory is not None:
            if len(self.memory) != start:
                raise RuntimeError(
                    f"the EAGLE pointer's memory holds {len(self.memory)} positions, the draft cache {start}"
                )
            hidden = fused.shape[-1]
            yield MemoryStore(self.memory, features[:, -hidden:], state.tokens[start:committed], following)
            logits = self._mixed(0, fused[-1:], next_tokens[-1:], logits)
        return logits[0], self.session.hidden[-1]

    def _step(
        self, states: torch.Tensor, tokens: list[int], depth: int, parents=None, tree_start=None
    ) -> DraftSteps:
        """Feed drafted ``tokens`` (at ``depth``, the root's children being depth 0) after
        their parents' states (f, hidden) -> (f, n) logits (with a pointer: (f, rows)
        log-probabilities)."""
        ids = torch.tensor(tokens, device=self.drafter.device)
        inputs = self.drafter.inputs(states, ids)
        logits = yield ModelPass(self.session, tokens, parents, tree_start, inputs_embeds=inputs)
        return logits if self.memory is None else self._mixed(depth, states, ids, logits)

    def _mixed(
        self, depth: int, states: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """The mixture with the pointer at ``depth``: states (f, hidden) the features the
        layer read, tokens (f,) the tokens after them, logits (f, n) -> (f, rows)."""
        slot = self.drafter.copy_slot(depth)
        return drafting_log_probs(
            self.drafter.copy, slot, states, self.drafter.embed(tokens), logits, self.memory
        )

    def _draft_chain(self, logits: torch.Tensor, previous: torch.Tensor, state) -> DraftSteps:
        length = self.config.k
        if self.policy is not None:  # the cut depends on q only: sampling stays lossless
            key = self.context.sizing.confidence(float(torch.softmax(logits.float(), -1).max()))
            length = self.policy.choose(key, self.config.k)
            if length == 0:
                return Draft.empty()
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(length):
            check_finite(logits, "EAGLE drafter")
            allowed = constrained_rows(
                state, tokens, self._row_token_ids(logits.shape[-1])
            )  # None without a constraint
            if allowed is not None and not bool(allowed.any()):
                break
            index, probs, _ = draft_token(logits, state, False, allowed)
            tokens.append(self._ids([index])[0])
            if probs is not None:
                rows.append(self._full_row(probs))
            if i + 1 < length:
                logits = (yield from self._step(previous[None], tokens[-1:], i + 1))[-1]
                previous = self.session.hidden[-1]
        return Draft.chain(tokens, torch.stack(rows) if rows else None)

    def _draft_tree(self, root_logits: torch.Tensor, root_state: torch.Tensor, state) -> DraftSteps:
        """A dynamic tree: each level's frontier is fed as one more level of a tree in
        the draft's cache, after its parents' states (a drafting step)."""
        tree_start = len(self.session)
        offset_of: dict[int, int] = {-1: -1}  # candidate node -> offset of its fed entry
        state_of: dict[int, torch.Tensor] = {-1: root_state}  # node -> the draft's state there
        fed_parents: list[int] = []

        def expand(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> DraftSteps:
            for node in frontier:
                offset_of[node] = len(fed_parents)
                fed_parents.append(offset_of[parents[node]])
            states = torch.stack([state_of[parents[node]] for node in frontier])  # (f, hidden)
            tokens = self._ids([rows[node] for node in frontier])
            logits = yield from self._step(states, tokens, depth + 1, list(fed_parents), tree_start)  # (f, n)
            for i, node in enumerate(frontier):
                state_of[node] = self.session.hidden[i]
            return logits

        allowed = None
        if state.grammar is not None:  # under a constraint: children among the allowed tokens only
            row_ids = self._row_token_ids(root_logits.shape[-1])

            def allowed(path: list[int]) -> torch.Tensor:
                return constrained_rows(state, self._ids(path) if path else [], row_ids)

        draft = yield from self.dynamic.build_steps(
            root_logits, expand, "EAGLE drafter", allowed, state.clock
        )
        return Draft(self._ids(draft.tokens), draft.parents, values=draft.values)

    def _ids(self, rows: list[int]) -> list[int]:
        """Drafting rows (the draft vocabulary's, or the pointer memory's) -> token ids."""
        index = torch.tensor(rows, dtype=torch.long, device=self.token_ids.device)
        return (self.token_ids[index] if self.memory is None else self.memory.token_ids(index)).tolist()

    def _row_token_ids(self, rows: int) -> torch.Tensor:
        """(rows,) the token id of every drafting row."""
        index = torch.arange(rows, device=self.token_ids.device)
        return self.token_ids[index] if self.memory is None else self.memory.token_ids(index)

    def _full_row(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the drafting rows -> (vocab,)."""
        if self.memory is None:
            return self.drafter.vocabulary.full_row(probs)
        return self.memory.full_rows(probs[None])[0]

    def observe(self, state, round: Round) -> None:
        sizer = self.dynamic if self.dynamic is not None else self.policy
        if sizer is not None:
            sizer.observe(round)

    def describe(self) -> dict:
        facts = {
            "artifact": self.artifact_source,
            "feature_layers": self.layers,
            "draft_vocab_size": len(self.token_ids),
            "k": self.config.k,
            "heldout_top1": self.meta.get("metrics", {}).get("top1"),
        }
        if self.dynamic is not None:
            facts.update(self.dynamic.describe())
        elif self.policy is not None:
            facts["draft_length_rates"] = self.policy.as_dict()
        return facts
