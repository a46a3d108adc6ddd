"""A separate, smaller causal LM drafts k tokens autoregressively.

The draft keeps its own KV cache (a :class:`~decoders.session.ModelSession`).
Before each round it is synced with what the target committed: the cache is
cut back to the longest prefix it shares with the committed tokens (accepted
draft tokens stay cached; rejected ones are dropped) and only the missing
tokens are fed, so accepted prefixes are never re-run.

When sampling, tokens are drawn from the draft's processed distribution
(same temperature / top-k / top-p as the target) and returned as draft_probs.

With ``tree=true`` it drafts an EAGLE-2-style dynamic tree instead (Li et al.
2024): level by level, the ``tree_width`` frontier nodes with the highest
cumulative draft log-probability are expanded into their ``tree_width`` most
probable children, one draft forward per level (the levels share one tree in
the draft's cache, see ``ModelSession.forward(tree_start=...)``); ``k`` levels
in all. The candidates are then reranked by cumulative log-probability and the
best ``tree_budget`` kept (a child never outranks its parent, so they form a
tree). The tree is deterministic (draft_probs None) at every temperature: the
tree verifier's point-mass rule is lossless for any deterministic tree, while
sampled siblings would only be if the tree's shape did not depend on the
sampled tokens (verifiers/tree.py), which reranking breaks. ``tree_budget=auto``
picks the budget that maximises expected tokens per second from the target's
cost curve and the acceptance measured so far (decoders/tree_budget.py).

Syncing after a round works the same for chains and trees: the draft's cache
holds the committed prefix followed by the drafted entries it fed (a chain or a
tree); the entries along the accepted path are kept (``ModelSession.keep``),
the rest dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from decoders.cost import cached_cost_curve
from decoders.draft import Draft
from decoders.models import ModelConfig, load_model, tiny_draft_model
from decoders.registry import register_proposer
from decoders.sampling import check_finite, processed_probs, sample
from decoders.session import ModelSession
from decoders.tree_budget import AcceptanceProfile, BudgetTuner
from proposers.base import Proposer


class IncompatibleTokenizerError(ValueError):
    pass


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    @dataclass
    class Config:
        k: int = 4  # tokens drafted per round (the tree's depth with tree=true)
        # HF directory or hub id of the draft; null = the default draft for the target
        # (a smaller seeded model for tiny-random, the distilled draft under artifacts/).
        name_or_path: str | None = None
        dtype: str = "auto"
        tree: bool = False  # EAGLE-2-style dynamic tree instead of a chain
        tree_width: int = 4  # children per expanded node, and nodes expanded per level
        # nodes kept after reranking: an int, or "auto" (chosen from the target's cost
        # curve and the measured acceptance, re-chosen as rounds accumulate)
        tree_budget: Any = 16

    sampled = True

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        if config.tree_width < 1:
            raise ValueError(f"proposer.tree_width must be >= 1, got {config.tree_width}")
        auto = config.tree_budget == "auto"
        if not auto and not (isinstance(config.tree_budget, int) and config.tree_budget >= 1):
            raise ValueError(
                f"proposer.tree_budget must be a positive integer or auto, got {config.tree_budget!r}"
            )
        self.sampled = not config.tree  # tree drafts are deterministic (see the module docstring)
        self.model = self._load_draft()
        self.session = ModelSession(self.model)
        self._draft_start = 0  # committed tokens when the last draft was made
        self._fed_parents: list[int] = []  # tree structure of the drafted entries cached after them
        self._last_tree: Draft | None = None
        self.profile = AcceptanceProfile()
        self.tuner = BudgetTuner(self.profile, self._cost_curve, self.max_tree_nodes) if auto else None

    def _load_draft(self) -> torch.nn.Module:
        context = self.context
        target = context.target
        path = self.config.name_or_path
        if path is None and context.model_config.name == "tiny-random":
            return tiny_draft_model(target)
        if path is None:
            artifact = context.artifact_path("draft_model")
            if not (artifact / "config.json").exists():
                raise FileNotFoundError(
                    f"no draft model for target {context.target_key!r} at {artifact}. Train one "
                    f"with `python -m train drafter=draft_model model={context.model_config.name}` "
                    "or point proposer.name_or_path at a Hugging Face causal LM with the same tokenizer."
                )
            path = str(artifact)
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
        device = str(next(target.parameters()).device)
        model, tokenizer = load_model(ModelConfig(name="hf", name_or_path=path, dtype=dtype, device=device))
        check_same_tokenizer(context.tokenizer, tokenizer, path)
        return model

    @property
    def max_tree_nodes(self) -> int:
        """Candidates a tree draft generates: ``tree_width`` per level and expanded node."""
        width = self.config.tree_width
        return width + (self.config.k - 1) * width * width

    def _cost_curve(self):
        context = self.context
        return cached_cost_curve(context.target, context.target_key, context.cost_cache_dir)

    @property
    def tree_budget(self) -> int:
        return self.tuner.budget if self.tuner is not None else self.config.tree_budget

    def begin(self, state) -> None:
        self.session.reset()
        self._draft_start = 0
        self._fed_parents = []
        self._last_tree = None

    def _sync(self, tokens: list[int]) -> None:
        """Keep in the draft cache the committed prefix and the fed draft entries the
        target accepted; drop the rest. The pending token is fed in :meth:`propose`."""
        start = self._draft_start
        accepted = tokens[start:-1]
        fed = Draft(self.session.cached[start:], self._fed_parents)
        self.session.keep(start, follow_tokens(fed, accepted))
        if self._last_tree is not None:
            self.profile.record(self._last_tree, follow_tokens(self._last_tree, accepted))

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        tokens = state.tokens
        self._sync(tokens)
        self._draft_start = len(tokens)
        self._fed_parents = []
        logits = self.session.forward(tokens[len(self.session) :])[-1]  # (vocab,)
        if not self.config.tree:
            return self._draft_chain(logits, state)
        tick = time.perf_counter()
        self._last_tree = self._draft_tree(logits)
        if self.tuner is not None:
            self.tuner.observe_draft_seconds(time.perf_counter() - tick)
        return self._last_tree

    def _draft_chain(self, logits: torch.Tensor, state) -> Draft:
        """k tokens, each fed back for the next; sampled from the processed draft
        distribution when sampling."""
        sampling = state.sampling
        draft_tokens: list[int] = []
        draft_rows: list[torch.Tensor] = []
        for i in range(self.config.k):
            check_finite(logits, "draft model's forward pass")
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, sampling)  # (vocab,) float32
                token = int(sample(probs, state.generator))
                draft_rows.append(probs)
            draft_tokens.append(token)
            if i + 1 < self.config.k:
                self._fed_parents.append(i - 1)
                logits = self.session.forward([token])[-1]
        draft_probs = torch.stack(draft_rows) if draft_rows else None  # (k, vocab)
        return Draft.chain(draft_tokens, draft_probs)

    def _draft_tree(self, root_logits: torch.Tensor) -> Draft:
        """An EAGLE-2-style dynamic tree of at most ``tree_budget`` nodes (deterministic)."""
        width = min(self.config.tree_width, root_logits.shape[-1])
        tree_start = len(self.session)  # the tree's entries follow the pending token
        tokens: list[int] = []  # every candidate node
        parents: list[int] = []
        scores: list[float] = []  # cumulative draft log-probability of each candidate
        offset_of: dict[int, int] = {-1: -1}  # candidate node -> offset of its fed entry
        frontier: list[int] = [-1]  # candidates expanded at this level (-1: the pending token)
        frontier_logits = root_logits[None]  # (f, vocab)
        for level in range(self.config.k):
            check_finite(frontier_logits, "draft model's forward pass")
            top = torch.log_softmax(frontier_logits.float(), -1).topk(width, dim=-1)  # (f, width)
            base = torch.tensor([scores[node] if node >= 0 else 0.0 for node in frontier])  # (f,)
            child_scores = (top.values + base[:, None]).tolist()
            child_tokens = top.indices.tolist()
            level_nodes = []
            for row, node in enumerate(frontier):
                for rank in range(width):
                    level_nodes.append(len(tokens))
                    tokens.append(child_tokens[row][rank])
                    parents.append(node)
                    scores.append(child_scores[row][rank])
            if level + 1 == self.config.k:
                break
            frontier = sorted(sorted(level_nodes, key=lambda i: -scores[i])[:width])
            for node in frontier:
                offset_of[node] = len(self._fed_parents)
                self._fed_parents.append(offset_of[parents[node]])
            frontier_logits = self.session.forward(
                [tokens[node] for node in frontier], self._fed_parents, tree_start=tree_start
            )  # (f, vocab)
        candidates = Draft(tokens, parents)
        # A child scores at most its parent and is deeper, so it ranks after it: a tree.
        ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], candidates.depths[i], i))
        return candidates.select(sorted(ranked[: self.tree_budget]))

    def describe(self) -> dict:
        facts: dict = {"draft_parameters": sum(p.numel() for p in self.model.parameters())}
        if self.config.tree:
            facts["tree_budget"] = self.tree_budget
            facts["tree_candidates"] = self.max_tree_nodes
            facts["acceptance_by_depth_rank"] = self.profile.as_dict()
        return facts


def follow_tokens(draft: Draft, tokens: list[int]) -> list[int]:
    """The draft nodes spelling the longest prefix of ``tokens`` from the root: given the
    tokens committed after a round, the path the target accepted."""
    path: list[int] = []
    row = 0
    for token in tokens:
        node = next((c for c in draft.children[row] if draft.tokens[c] == token), None)
        if node is None:
            break
        path.append(node)
        row = node + 1
    return path


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids than the target's."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = [t for t in list(target_vocab)[:100000] if draft_vocab.get(t) != target_vocab[t]]
        raise IncompatibleTokenizerError(
            f"draft model {draft_name!r} uses a different tokenizer from the target: "
            f"{len(differing)} of the target's {len(target_vocab)} tokens map to other ids "
            f"(e.g. {differing[:3]}). Speculative decoding compares token ids, so the draft must "
            "share the target's tokenizer; choose a draft from the same model family."
        )
