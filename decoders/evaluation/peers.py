"""Hugging Face implementations measured in the same run as peers.

Each peer runs ``transformers``' own ``model.generate`` on the same prompt ids
with the same sampling settings:

    hf_generate       plain generate (its counterpart: standard decoding)
    hf_compiled       generate with a static cache, compiled by torch.compile (transformers'
                      own compiled decoding; its counterpart: standard decoding)
    hf_prompt_lookup  prompt lookup decoding (counterpart: ngram)
    hf_assisted       assisted generation with the same draft model (draft_model)
    hf_early_exit     assistant_early_exit self-speculation (early_exit)

``hf_compiled`` runs on the model as transformers builds it: the target's CPU routes (routed
linears, fused layers, exact attention) are off for its calls, since its compiler would trace
them. It compiles on its first calls (the bench's warm-up, discarded), over two prompt lengths so
that its graphs are dynamic before any measured prompt.

Under a constraint each peer gets the same grammar as a logits processor
(:class:`GrammarLogitsProcessor`): transformers applies it at every position it decodes, the
rows prompt lookup verifies included; that is all it offers for structured output.

``bench.peers=true`` measures the ``bench.default_peers`` (those that can pay on the default
target: on it, assisted generation ran at 0.30-0.36x and its early exit at 0.25-0.28x of
standard decoding, and took a third of the quickstart's time); ``bench.peers=all`` every peer
whose counterpart runs; a list (``bench.peers=[hf_generate,hf_assisted]``) those named.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.decoders.engine.constraint import Constraint, GrammarState
from specdec.decoders.engine.sampling import SamplingConfig

# Prompt lookup drafts this many tokens from every match (bench.prompt_lookup_tokens): the
# method's reference setting (10 tokens, n-grams up to 3). It cannot size a draft, so it is not
# given our ngram's k, the longest draft ngram's sizing may choose.
PROMPT_LOOKUP_TOKENS = 10

PEER_COUNTERPART = {
    "hf_generate": None,
    "hf_compiled": None,
    "hf_prompt_lookup": "ngram",
    "hf_assisted": "draft_model",
    "hf_early_exit": "early_exit",
}


@dataclass
class HFPeer:
    name: str
    model: torch.nn.Module
    eos_token_ids: list[int]
    sampling: SamplingConfig
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    rounds: PeerRounds | None = None  # the last run's rounds (an assisted peer's counts)
    family: str = ""  # the name bench.peers picks it by (default: its name)
    plain: bool = False  # runs on the model as transformers builds it (the target's routes off)
    warmed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.family = self.family or self.name

    @torch.inference_mode()
    def run(
        self, prompt_ids: list[int], max_new_tokens: int, constraint: Constraint | None = None
    ) -> tuple[list[int], float, bool | None]:
        """Generated token ids, wall seconds, and under ``constraint`` whether the output is
        complete (None without one)."""
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt_ids], device=device)
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
        )
        if self.sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=self.sampling.temperature,
                top_k=self.sampling.top_k or None,
                top_p=self.sampling.top_p,
            )
        kwargs.update(self.generate_kwargs)
        if self.plain and not self.warmed:  # compile now, for two prompt lengths: dynamic graphs
            self.warmed = True
            for length in (max(1, len(prompt_ids) // 2), len(prompt_ids)):
                ids = input_ids[:, :length]
                self.model.generate(**{**kwargs, "input_ids": ids, "attention_mask": torch.ones_like(ids)})
        start = time.perf_counter()
        processor = None
        if constraint is not None:  # its start (a matcher) is timed: our pipelines' is too
            processor = GrammarLogitsProcessor(constraint.start(), len(prompt_ids))
            kwargs["logits_processor"] = LogitsProcessorList([processor])
        self.rounds = PeerRounds()
        with self.rounds.counting(self.model):
            output = self.model.generate(**kwargs)
        elapsed = time.perf_counter() - start
        tokens = output[0, len(prompt_ids) :].tolist()
        return tokens, elapsed, None if processor is None else processor.complete(tokens)


@dataclass
class PeerRounds:
    """An assisted peer's rounds, as transformers ran them (its drafted and accepted counts):
    each round's candidate tokens, and how many of them its verification kept. transformers
    returns neither, so for the length of one ``generate`` the candidate generator it builds
    is wrapped, reading what its ``get_candidates`` returns and the matches its loop reports to
    ``update_candidate_strategy``. Plain ``generate`` builds none: no rounds (``None``)."""

    sizes: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def counted(self) -> bool:
        return bool(self.accepted)

    @contextlib.contextmanager
    def counting(self, model: torch.nn.Module) -> Iterator[None]:
        build = model._get_candidate_generator
        rounds = self

        def counted_generator(*args: Any, **kwargs: Any) -> Any:
            generator = build(*args, **kwargs)
            propose, update = generator.get_candidates, generator.update_candidate_strategy

            def get_candidates(input_ids: torch.Tensor, *more: Any, **options: Any) -> Any:
                candidates, logits = propose(input_ids, *more, **options)
                rounds.sizes.append(int(candidates.shape[1] - input_ids.shape[1]))
                return candidates, logits

            def update_candidate_strategy(input_ids: torch.Tensor, scores: Any, num_matches: Any) -> Any:
                rounds.accepted.append(int(num_matches))
                return update(input_ids, scores, num_matches)

            generator.get_candidates = get_candidates
            generator.update_candidate_strategy = update_candidate_strategy
            return generator

        model.__dict__["_get_candidate_generator"] = counted_generator  # this model, this call only
        try:
            yield
        finally:
            model.__dict__.pop("_get_candidate_generator", None)

    def record_fields(self) -> dict[str, Any]:
        """The counters of a benchmark record (:class:`~specdec.decoders.evaluation.metrics.Record`),
        empty when nothing was counted. Every round emits its matches and one token of the
        target's own."""
        if not self.counted:
            return {}
        sizes = self.sizes[: len(self.accepted)]
        return {
            "target_passes": len(self.accepted),
            "proposed": sum(sizes),
            "accepted": sum(self.accepted),
            "draft_sizes": sizes,
            "emitted_per_round": [matches + 1 for matches in self.accepted],
        }


class GrammarLogitsProcessor(LogitsProcessor):
    """A constraint as transformers' logits processor: each call masks the scores with the
    grammar's state after the ids it is given. Prompt lookup calls it on each verified row
    with a longer or shorter prefix than the last call's, so the state follows the ids
    (rolled back to the common prefix, then advanced), not the order of calls."""

    def __init__(self, grammar: GrammarState, prompt_len: int) -> None:
        self.grammar, self.prompt_len = grammar, prompt_len
        self.consumed: list[int] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len :].tolist()  # (one request)
        common = 0
        while common < min(len(generated), len(self.consumed)) and generated[common] == self.consumed[common]:
            common += 1
        if common < len(self.consumed):
            self.grammar.rollback(len(self.consumed) - common)
        self.grammar.advance(generated[common:])
        self.consumed = generated
        allowed = self.grammar.allowed_after(())  # (vocab,)
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def complete(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` (the final output) is a complete sentence of the grammar."""
        return self.grammar.constraint.accepts(tokens)


def chosen_peers(setting: Any, default_peers: list[str]) -> list[str] | None:
    """The peer names ``bench.peers`` asks for (None: every one whose counterpart runs);
    ``[]`` for none. Unknown names are refused with the known ones."""
    if setting in (False, None, "false", "off", "none"):
        return []
    if setting in (True, "true", "on", "default"):
        names = list(default_peers)
    elif setting == "all":
        return None
    elif isinstance(setting, (list, tuple)):
        names = [str(name) for name in setting]
    else:
        names = [str(setting)]
    unknown = [name for name in names if name not in PEER_COUNTERPART]
    if unknown:
        raise ValueError(
            f"bench.peers: unknown peer {unknown[0]!r}; use true (bench.default_peers), all, false "
            f"or a list of {sorted(PEER_COUNTERPART)}"
        )
    return names


def make_peers(
    target: torch.nn.Module,
    eos_token_ids: list[int],
    sampling: SamplingConfig,
    proposers: dict[str, Any],
    names: list[str] | None = None,
    prompt_lookup_tokens: int | list[int] = PROMPT_LOOKUP_TOKENS,
) -> list[HFPeer]:
    """hf_generate plus each peer whose counterpart proposer is being benchmarked, of
    ``names`` (None: all of them).

    proposers: name -> Proposer instance of the pipelines in this run (their
    options set the peer's: same draft model, same exit layer, same n-gram sizes).
    ``prompt_lookup_tokens``: the tokens prompt lookup drafts from a match
    (``bench.prompt_lookup_tokens``); not our ngram's ``k``, which is only its longest draft.
    Several: one peer per setting, ``hf_prompt_lookup_N``.
    """
    peers = _counterpart_peers(target, eos_token_ids, sampling, proposers, prompt_lookup_tokens)
    return [peer for peer in peers if names is None or peer.family in names]


def compiled_generate_kwargs() -> dict[str, Any]:
    """``generate``'s options for its compiled decoding: a static cache and a compile config
    that compiles on any device (transformers compiles on GPUs only unless told)."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True  # a class attribute transformers reads, not an argument
    return {"cache_implementation": "static", "compile_config": config}


def _counterpart_peers(
    target: torch.nn.Module,
    eos_token_ids: list[int],
    sampling: SamplingConfig,
    proposers: dict[str, Any],
    prompt_lookup_tokens: int | list[int],
) -> list[HFPeer]:
    peers = [HFPeer("hf_generate", target, eos_token_ids, sampling)]
    peers.append(
        HFPeer("hf_compiled", target, eos_token_ids, sampling, compiled_generate_kwargs(), plain=True)
    )
    if "ngram" in proposers:
        ngram = proposers["ngram"].config
        settings = prompt_lookup_tokens if isinstance(prompt_lookup_tokens, list) else [prompt_lookup_tokens]
        for tokens in settings:
            peers.append(
                HFPeer(
                    "hf_prompt_lookup" if len(settings) == 1 else f"hf_prompt_lookup_{tokens}",
                    target,
                    eos_token_ids,
                    sampling,
                    {"prompt_lookup_num_tokens": tokens, "max_matching_ngram_size": ngram.max_n},
                    family="hf_prompt_lookup",
                )
            )
    if "draft_model" in proposers:
        draft = proposers["draft_model"]
        peers.append(
            HFPeer(
                "hf_assisted",
                target,
                eos_token_ids,
                sampling,
                {"assistant_model": draft.model, "num_assistant_tokens": draft.config.k},
            )
        )
    if "early_exit" in proposers:
        early_exit = proposers["early_exit"].config
        peers.append(
            HFPeer(
                "hf_early_exit",
                target,
                eos_token_ids,
                sampling,
                {"assistant_early_exit": early_exit.exit_layer, "num_assistant_tokens": early_exit.k},
            )
        )
    return peers
