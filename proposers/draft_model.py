"""A separate, smaller causal LM drafts k tokens autoregressively.

The draft keeps its own KV cache (a :class:`~decoders.session.ModelSession`).
Before each round it is synced with what the target committed: the cache is
cut back to the longest prefix it shares with the committed tokens (accepted
draft tokens stay cached; rejected ones are dropped) and only the missing
tokens are fed, so accepted prefixes are never re-run.

When sampling, tokens are drawn from the draft's processed distribution
(same temperature / top-k / top-p as the target) and returned as draft_probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders.draft import Draft
from decoders.models import ModelConfig, load_model, tiny_draft_model
from decoders.registry import register_proposer
from decoders.sampling import check_finite, processed_probs, sample
from decoders.session import ModelSession
from proposers.base import Proposer


class IncompatibleTokenizerError(ValueError):
    pass


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    @dataclass
    class Config:
        k: int = 4  # tokens drafted per round
        # HF directory or hub id of the draft; null = the default draft for the target
        # (a smaller seeded model for tiny-random, the distilled draft under artifacts/).
        name_or_path: str | None = None
        dtype: str = "auto"

    sampled = True

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        self.model = self._load_draft()
        self.session = ModelSession(self.model)
        self._draft_start = 0

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

    def begin(self, state) -> None:
        self.session.reset()
        self._draft_start = 0

    def _sync(self, tokens: list[int]) -> None:
        """Cut the draft cache back to the prefix it shares with ``tokens``, minus the
        pending token, which is fed in :meth:`propose`."""
        cached = self.session.cached
        common = self._draft_start  # everything before the last draft was committed
        limit = min(len(cached), len(tokens) - 1)
        while common < limit and cached[common] == tokens[common]:
            common += 1
        self.session.truncate(common)

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        tokens = state.tokens
        self._sync(tokens)
        self._draft_start = len(tokens)
        sampling = state.sampling
        logits = self.session.forward(tokens[len(self.session) :])[-1]  # (vocab,)
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
                logits = self.session.forward([token])[-1]
        draft_probs = torch.stack(draft_rows) if draft_rows else None  # (k, vocab)
        return Draft.chain(draft_tokens, draft_probs)

    def describe(self) -> dict:
        return {"draft_parameters": sum(p.numel() for p in self.model.parameters())}


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
