"""A separate, smaller causal LM drafts k tokens autoregressively.

The draft keeps its own KV cache (a :class:`~specdec.decoders.models.session.ModelSession`).
Before each round it is synced with what the target committed: the cache is
cut back to the longest prefix it shares with the committed tokens (accepted
draft tokens stay cached; rejected ones are dropped) and only the missing
tokens are fed, so accepted prefixes are never re-run.

When sampling, tokens are drawn from the draft's processed distribution
(same temperature / top-k / top-p as the target) and returned as draft_probs.

With ``tree=true`` it drafts a dynamic tree instead (EAGLE-2, Li et al. 2024;
decoders/sizing/dynamic_tree.py): ``k`` levels, each one draft forward over the
``tree_width`` most probable frontier nodes (the levels share one tree in the
draft's cache, see ``ModelSession.forward(tree_start=...)``), then the best
``tree_budget`` candidates by cumulative log-probability, or with
``tree_budget=auto`` each round's best size from the target's cost curve and
the acceptance measured per depth and confidence. The tree is deterministic
(draft_probs None) at every temperature: the tree verifier's point-mass rule is
lossless for any deterministic tree, while sampled siblings would only be if
the tree's shape did not depend on the sampled tokens (verifiers/tree.py),
which reranking breaks.

Syncing after a round works the same for chains and trees: the draft's cache
holds the committed prefix followed by the drafted entries it fed (a chain or a
tree); :meth:`DraftModelProposer.observe` maps the round's accepted path (in the
draft's own numbering) to the fed entries along it, which the next round keeps
(``ModelSession.keep``), the rest dropped. A round not observed keeps none (its
tokens are fed again).

In a batch (decoders/engine/batch.py) each request drafts in a session of its own over
the one draft, and the passes its requests' drafts need over a chain (the committed
tokens a session lacks and the pending token; each token of a chain draft; each level
of a tree) run as one packed pass of the draft per step (a
:class:`~specdec.decoders.engine.drafting.ModelPass`): the draft's weights are read once
for all of them.

Reduced draft vocabulary (``vocab_size=N``, FR-Spec, Zhao et al. 2025): the
draft's cost per token is dominated by its LM head over the whole vocabulary
(49,152 rows for SmolLM2). With ``vocab_size`` set, the head's weight rows are
sliced once to the N tokens the target itself outputs most often (ranked at
training time from the self-distillation data, ``draft_vocab.json`` in the
draft's directory), so the draft scores only those. Drafted tokens are mapped
back to full-vocabulary ids and draft_probs rows are full-vocabulary rows with
q = 0 outside the N tokens. Verification stays lossless: greedy drafts are the
argmax among the N tokens (any deterministic draft is), and rejection sampling
is exact for any q, zeros included (the residual max(0, p - q) keeps the
target's mass outside the N tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.decoders.engine.context import artifact_source
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.drafting import DraftSteps, ModelPass, run_alone
from specdec.decoders.engine.files import readable_artifact
from specdec.decoders.engine.proposer import Preset, Proposer, constrained_rows, draft_token
from specdec.decoders.engine.registry import register_proposer
from specdec.decoders.engine.sampling import check_finite
from specdec.decoders.models.gguf import is_gguf
from specdec.decoders.models.loading import (
    ModelConfig,
    load_model,
    prepare_model,
    resolve_device,
    resolve_dtype,
    tiny_draft_model,
)
from specdec.decoders.models.target import Target
from specdec.decoders.sizing.policy import TreeOptions, tree_shape
from specdec.proposers.vocabulary import ReducedVocabulary

DRAFT_VOCAB_FILE = "draft_vocab.json"
AUTO_VOCAB_SIZE = 4096  # vocab_size: auto (FR-Spec's vocabulary; measured best on the default target)
FROM_TARGET_FILE = "from_target.json"  # what a shipped draft takes from its target (train/ship.py)


class IncompatibleTokenizerError(ValueError):
    pass


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    shared = frozenset({"draft", "model", "vocabulary"})  # the draft model and its vocabulary
    artifact = "draft_model"
    trainer = "specdec.train.draft_model"
    presets = (Preset("draft_model_chain", {"tree": False, "k": 4}),)

    @dataclass
    class Config(TreeOptions):
        # The defaults are the best configuration measured on the default target (held-out
        # Spec-Bench, float32: 1.07x where the chain of 4 over the full vocabulary ran 0.53x):
        # a one-level dynamic tree over the 4,096 likeliest tokens, sized from T(n).
        k: int = 1  # tokens drafted per round (the tree's depth with tree=true)
        # HF directory or hub id of the draft, or a GGUF file (or a folder holding one); null =
        # the default draft for the target
        # (a smaller seeded model for tiny-random, the distilled draft under artifacts/).
        name_or_path: str | None = None
        dtype: str = "auto"
        tree: Any = "dynamic"  # EAGLE-2-style dynamic tree; null: a chain of k tokens
        # null = the full vocabulary; N = draft only over the N tokens the target outputs
        # most often (FR-Spec), from draft_vocab.json next to the distilled draft; "auto" =
        # 4,096 of them where the draft has that file, else the full vocabulary
        vocab_size: Any = "auto"
        min_confidence: float = 0.0  # end a chain draft at a token the draft gives less probability (0 = off)

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        config.tree = tree_shape(config.tree, "draft_model")
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        self.tree = context.sizing.dynamic_tree(config.tree_width, config.k, config.tree_budget)
        draft_dir = self._draft_dir()
        # which draft ran: the user's, the shipped one, a hub/path draft (None: the seeded tiny draft)
        self.artifact_source = artifact_source(draft_dir) if draft_dir is not None else None
        self.draft = self._load_draft(draft_dir)  # the draft model as a Target of its own
        self.model = self.draft.model
        self.session = self.draft.session()
        self.vocabulary: DraftVocabulary | None = None
        vocab_size = config.vocab_size
        if vocab_size == "auto":
            ranked = draft_dir is not None and (draft_dir / DRAFT_VOCAB_FILE).exists()
            vocab_size = DraftVocabulary.ranked_size(draft_dir, AUTO_VOCAB_SIZE) if ranked else None
        if vocab_size is not None:
            self.vocabulary = DraftVocabulary.load(draft_dir, vocab_size)
            self.session.lm_head = self.vocabulary.head(self.session.lm_head)
        self._draft_start = 0  # committed tokens when the last draft was made
        self._fed_parents: list[int] = []  # tree structure of the drafted entries cached after them
        self._fed_of_node: list[int | None] = []  # the last draft's nodes -> their fed entry (None: not fed)
        self._keep_fed: list[int] = []  # fed entries along the last observed round's accepted path

    @property
    def drafts_trees(self) -> bool:
        return self.config.tree is not None

    @property
    def sampled(self) -> bool:
        return not self.config.tree  # tree drafts are deterministic (see the module docstring)

    def _draft_dir(self) -> Path | None:
        """The draft's directory or hub id: ``name_or_path``, else the distilled draft under
        artifacts/; None for tiny-random without one (its seeded tiny draft is built instead)."""
        context = self.context
        if self.config.name_or_path is not None:
            return Path(self.config.name_or_path)
        artifact = context.artifact_path(self.artifact)
        if (artifact / "config.json").exists():
            return artifact
        if context.model_config.name == "tiny-random":
            return None
        raise FileNotFoundError(
            f"no draft model for target {context.target_key!r} at {artifact}. Train one "
            f"with `python -m specdec.train drafter=draft_model model={context.model_config.name}` "
            "or point proposer.name_or_path at a Hugging Face causal LM with the same tokenizer."
        )

    def _load_draft(self, draft_dir: Path | None) -> Target:
        target = self.context.target
        if draft_dir is None:
            return Target(tiny_draft_model(target.model))
        path = str(draft_dir)
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = str(target.dtype).removeprefix("torch.")
        device = str(target.device)
        gguf = is_gguf(draft_dir)  # dequantized once, cached
        where = {"gguf_file": path} if gguf else {"name_or_path": path}
        model_config = ModelConfig(name="hf", dtype=dtype, device=device, **where)
        if (draft_dir / FROM_TARGET_FILE).exists():
            with readable_artifact(draft_dir, "python -m specdec.train drafter=draft_model"):
                return load_draft_sharing_target(draft_dir, target.model, model_config)
        model, tokenizer = load_model(model_config)
        check_same_tokenizer(self.context.tokenizer, tokenizer, path)
        return model

    def begin(self, state) -> None:
        self.session.reset()
        self._draft_start = 0
        self._fed_parents = []
        self._fed_of_node = []
        self._keep_fed = []

    def observe(self, state, round: Round) -> None:
        """The fed entries of the accepted nodes stay cached for the next round."""
        keep: list[int] = []
        for node in round.path:
            fed = self._fed_of_node[node]
            if fed is None:  # a leaf: never fed (the next round feeds its token)
                break
            keep.append(fed)
        self._keep_fed = keep
        if self.config.tree:
            self.tree.observe(round)

    def _sync(self) -> None:
        """Keep in the draft cache the committed prefix and the fed draft entries the
        target accepted (:meth:`observe`); drop the rest. The missing committed tokens
        and the pending token are fed in :meth:`propose`."""
        self.session.keep(self._draft_start, self._keep_fed)
        self._keep_fed = []

    def propose(self, state) -> Draft:
        return run_alone(self.drafting(state))

    def drafting(self, state) -> DraftSteps:
        """The draft, as steps: each pass of the draft over a chain (the committed tokens it
        lacks and the pending token, then each token of a chain draft or each level of a tree)
        is a :class:`ModelPass`, which a batch runs for all its requests as one packed pass."""
        tokens = state.tokens
        self._sync()
        self._draft_start = len(tokens)
        self._fed_parents = []
        fed = tokens[len(self.session) :]
        logits = (yield ModelPass(self.session, fed, last_only=True))[-1]  # (vocab,)
        if not self.config.tree:
            draft = yield from self._draft_chain(logits, state)
            fed = len(self._fed_parents)  # the chain's first nodes, each fed for the next
            self._fed_of_node = [node if node < fed else None for node in range(len(draft))]
            return draft
        return (yield from self._draft_tree(logits, state))

    def _draft_chain(self, logits: torch.Tensor, state) -> DraftSteps:
        """k tokens, each fed back for the next; sampled from the processed draft
        distribution when sampling."""
        draft_tokens: list[int] = []
        draft_rows: list[torch.Tensor] = []
        token_ids = None if self.vocabulary is None else self.vocabulary.token_ids
        for i in range(self.config.k):
            check_finite(logits, "draft model's forward pass")
            allowed = constrained_rows(state, draft_tokens, token_ids)  # None without a constraint
            if allowed is not None and not bool(allowed.any()):
                break
            index, probs, confidence = draft_token(logits, state, self.config.min_confidence > 0, allowed)
            if confidence < self.config.min_confidence:
                break
            token = self._token_ids([index])[0]
            if probs is not None:
                draft_rows.append(probs if self.vocabulary is None else self.vocabulary.full_row(probs))
            draft_tokens.append(token)
            if i + 1 < self.config.k:
                self._fed_parents.append(i - 1)
                logits = (yield ModelPass(self.session, [token], last_only=True))[-1]
        draft_probs = torch.stack(draft_rows) if draft_rows else None  # (k, vocab)
        return Draft.chain(draft_tokens, draft_probs)

    def _draft_tree(self, root_logits: torch.Tensor, state) -> DraftSteps:
        """A dynamic tree (deterministic): each level's frontier is fed to the draft as
        one more level of a tree in its cache (a drafting step)."""
        tree_start = len(self.session)  # the tree's entries follow the pending token
        offset_of: dict[int, int] = {-1: -1}  # candidate node -> offset of its fed entry

        def expand(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> DraftSteps:
            for node in frontier:
                offset_of[node] = len(self._fed_parents)
                self._fed_parents.append(offset_of[parents[node]])
            tokens = self._token_ids([rows[node] for node in frontier])
            return (yield ModelPass(self.session, tokens, list(self._fed_parents), tree_start))  # (f, n)

        token_ids = None if self.vocabulary is None else self.vocabulary.token_ids
        allowed = None
        if state.grammar is not None:  # under a constraint: children among the allowed tokens only

            def allowed(path: list[int]) -> torch.Tensor:
                return constrained_rows(state, self._token_ids(path), token_ids)

        tree = yield from self.tree.build_steps(
            root_logits, expand, "draft model's forward pass", allowed, state.clock
        )
        self._fed_of_node = [offset_of.get(candidate) for candidate in tree.origin[1]]
        return Draft(self._token_ids(tree.tokens), tree.parents, values=tree.values)  # rows -> token ids

    def _token_ids(self, rows: list[int]) -> list[int]:
        return rows if self.vocabulary is None else self.vocabulary.token_ids[rows].tolist()

    def describe(self) -> dict:
        facts: dict = {
            "artifact": self.artifact_source,
            "draft_parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.vocabulary is not None:
            facts["draft_vocab_size"] = len(self.vocabulary.token_ids)
        if self.config.tree:
            facts.update(self.tree.describe())
        return facts


def load_draft_sharing_target(directory: Path, target: torch.nn.Module, cfg: ModelConfig) -> Target:
    """Load a draft stored without what it shares with its target (``python -m specdec.train.ship``).

    ``from_target.json`` lists the tensors the draft took unchanged from the target
    (embeddings, LM head): they are not stored but taken from the loaded target by name,
    as the same tensors when the dtypes agree, so they cost neither disk nor memory. The
    tokenizer is the target's too (checked when the draft was shipped)."""
    shared = json.loads((directory / FROM_TARGET_FILE).read_text())["tensors"]
    draft = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    missing, unexpected = draft.load_state_dict(load_file(directory / "model.safetensors"), strict=False)
    dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    draft = draft.to(dtype=dtype, device=next(target.parameters()).device)
    target_tensors = target.state_dict(keep_vars=True)
    absent = [name for name in shared if name not in target_tensors]
    if absent or unexpected:
        raise ValueError(
            f"the draft at {directory} does not fit this target: {absent or unexpected} "
            "(ship it again with `python -m specdec.train.ship` for this target)"
        )
    for name in shared:
        tensor = target_tensors[name]
        if tensor.dtype != dtype:
            tensor = torch.nn.Parameter(tensor.detach().to(dtype), requires_grad=False)
        module, _, attr = name.rpartition(".")
        setattr(draft.get_submodule(module), attr, tensor)
    if getattr(draft.config, "tie_word_embeddings", False):
        draft.get_output_embeddings().weight = draft.get_input_embeddings().weight
    tied = {"lm_head.weight"} if getattr(draft.config, "tie_word_embeddings", False) else set()
    unfilled = set(missing) - set(shared) - tied
    if unfilled:
        raise ValueError(
            f"the draft at {directory} lacks {sorted(unfilled)}; ship it again with `python -m specdec.train.ship`"
        )
    return prepare_model(draft, cfg)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids than the target's: a
    token of the target's at another id in the draft's, or a token of the draft's only at
    an id the target gives another token. Tokens the draft adds at ids the target leaves
    unused (a model type's own special tokens) change no id's meaning."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = [t for t in list(target_vocab)[:100000] if draft_vocab.get(t) != target_vocab[t]]
    target_ids = set(target_vocab.values())
    colliding = [t for t, i in draft_vocab.items() if t not in target_vocab and i in target_ids]
    if differing or colliding:
        examples = differing[:3] or colliding[:3]
        raise IncompatibleTokenizerError(
            f"draft model {draft_name!r} uses a different tokenizer from the target: "
            f"{len(differing)} of the target's {len(target_vocab)} tokens map to other ids and "
            f"{len(colliding)} of the draft's own sit at ids the target uses (e.g. {examples}). "
            "Speculative decoding compares token ids, so the draft must share the target's "
            "tokenizer; choose a draft from the same model family."
        )


class DraftVocabulary(ReducedVocabulary):
    """The draft's reduced output vocabulary, as stored with a draft.

    Stored as ``draft_vocab.json`` with a draft: ``token_ids`` ranked most frequent
    first in the target's own outputs, and their ``counts``; the first N are used.
    """

    @staticmethod
    def ranked_size(draft_dir: Path, most: int) -> int:
        """``most``, or fewer if ``draft_dir``'s draft_vocab.json ranks fewer tokens."""
        return min(most, len(json.loads((draft_dir / DRAFT_VOCAB_FILE).read_text())["token_ids"]))

    @classmethod
    def load(cls, draft_dir: Path | None, size: int) -> DraftVocabulary:
        """The ``size`` most frequent tokens listed in ``draft_dir``'s draft_vocab.json."""
        path = (draft_dir or Path("<the seeded tiny draft has no directory>")) / DRAFT_VOCAB_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"proposer.vocab_size needs {path} (the draft's ranked vocabulary); "
                "`python -m specdec.train drafter=draft_model` writes it next to the distilled draft, "
                "or leave proposer.vocab_size=null to draft over the full vocabulary."
            )
        ranked = json.loads(path.read_text())
        if not 1 <= size <= len(ranked["token_ids"]):
            raise ValueError(
                f"proposer.vocab_size={size}, but {path} ranks {len(ranked['token_ids'])} tokens "
                "(those the target output while generating the training data); choose 1 to that many."
            )
        return cls(torch.tensor(ranked["token_ids"][:size], dtype=torch.long), ranked["full_vocab_size"])


def save_draft_vocab(directory: Path, token_counts: torch.Tensor) -> None:
    """Rank the tokens with a positive count, most frequent first (ties: lower id first),
    and write them to ``directory``/draft_vocab.json for :meth:`DraftVocabulary.load`."""
    counts = token_counts.long()  # (full vocab,)
    order = sorted(counts.nonzero().flatten().tolist(), key=lambda token: (-int(counts[token]), token))
    ranked = {
        "full_vocab_size": len(counts),
        "counted_tokens": int(counts.sum()),
        "token_ids": order,
        "counts": [int(counts[token]) for token in order],
    }
    (directory / DRAFT_VOCAB_FILE).write_text(json.dumps(ranked))
