"""The Python API: a target model + a proposer + a verifier = a pipeline.

    from specdec.decoders import Pipeline
    pipe = Pipeline.load(model="smollm2-135m", proposer="ngram", verifier="greedy")
    result = pipe.generate("Summarize: ...", max_new_tokens=64)
    print(result.text, result.stats.mean_accepted_tokens)

Without a proposer, a pipeline decodes normally (the standard baseline). Any pipeline
takes a constraint per request (decoders/engine/constraint.py):

    result = pipe.generate("Extract ...", constraint={"json_schema": schema})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from specdec.decoders.engine.constraint import Constraint, GrammarVocabulary
from specdec.decoders.engine.constraint_source import ConstraintConfig
from specdec.decoders.engine.context import ARTIFACTS_DIR, PipelineContext, Sizing
from specdec.decoders.engine.decoding import Decoding, RoundGate, default_verifier
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import build, proposer_registry, verifier_registry
from specdec.decoders.engine.request import GenerationStats, StopConditions, check_stop_strings
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.verifier import Verifier
from specdec.decoders.models.architecture import UnsupportedArchitectureError
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.target import Target, as_target

ComponentSpec = str | dict | Any  # a registered name, a config mapping (with `name`), or an instance
ConstraintSpec = Constraint | ConstraintConfig | dict  # {"json_schema" | "regex" | "grammar": ...}


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: GenerationStats


@dataclass
class BatchResult:
    """:meth:`Pipeline.generate_batch`'s results, in the order of its prompts, and what the
    batch measured as a whole (wall time, passes, rows per pass, latencies)."""

    results: list[GenerationResult]
    stats: Any  # specdec.decoders.engine.batch.BatchStats


# The Python API's defaults, declared once: the command lines' schemas take them
# (decoders/cli/commands.py), so `generate` and `Pipeline.load(...).generate` agree.
MAX_NEW_TOKENS = 128
CHAT_TEMPLATE = True  # wrap a text prompt in the tokenizer's chat template
ROUND_GATE = False  # measured, the round gate has not paid yet (docs/round_gate.md)


class Pipeline:
    def __init__(
        self,
        model: Target | torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        proposer: ComponentSpec | None = None,
        verifier: ComponentSpec | None = None,
        sampling: SamplingConfig | None = None,
        *,
        model_config: ModelConfig | None = None,
        artifacts_dir: str | Path = ARTIFACTS_DIR,
        max_new_tokens: int = MAX_NEW_TOKENS,
        stop_strings: Sequence[str] = (),
        chat_template: bool = CHAT_TEMPLATE,
        cost_curve: CostCurve | None = None,
        round_gate: bool = ROUND_GATE,
        constraint: ConstraintSpec | None = None,
        sizing: Sizing | None = None,
    ) -> None:
        # a bare module runs its passes as they are; a loaded model comes as its Target
        self.target = as_target(model)
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        # sizing: how big every draft is (decoders/sizing/policy.py; None: the default policy),
        # which the proposers reach through their context
        self.context = PipelineContext(
            self.target,
            tokenizer,
            model_config or ModelConfig(name="hf"),
            Path(artifacts_dir),
            cost_curve,
            sizing,
        )
        self.sizing = self.context.sizing
        # first: a model whose attention the session cannot serve is refused before anything loads
        self.session = self.target.session()
        self.proposer: Proposer | None = self._component(proposer, proposer_registry, Proposer)
        if verifier is None and self.proposer is not None:
            trees = self.proposer.drafts_trees and not self.session.tree_refusal
            verifier = default_verifier(self.sampling, trees)
        self.verifier: Verifier | None = self._component(verifier, verifier_registry, Verifier)
        if self.verifier is not None:
            self.verifier.check(self.sampling)
            if self.verifier.accepts_trees and self.session.tree_refusal:
                raise UnsupportedArchitectureError(
                    f"verifier={self.verifier.name}: {self.session.tree_refusal}; use a chain "
                    "verifier (greedy or rejection)"
                )
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(stop_strings)
        check_stop_strings(self.stop_strings)
        self.chat_template = chat_template
        # round_gate: whether a round drafts at all is decided from earlier rounds
        # (decoders/sizing/round_gate.py; off by default: measured, it has not paid yet). A
        # proposer that drafts inside the target (early exit) sizes its drafts down to none
        # itself, drafting cost included, and is never gated.
        self.round_gate = round_gate
        gated = self.round_gate and self.proposer is not None and not self.proposer.drafts_in_target
        self.gate: RoundGate | None = self.sizing.round_gate() if gated else None
        # a batch's rounds draft only where drafted rounds have paid at that many requests
        # (decoders/sizing/batch_gate.py); a pipeline's own, like its round gate. It times the
        # rounds, so it runs where the T(n) is followed live, not where it is fixed
        gated_batches = self.proposer is not None and self.context.live_cost
        self.batch_gate = self.sizing.batch_gate() if gated_batches else None
        self.label: str | None = None  # a name for results tables (default proposer+verifier)
        self._grammar_vocabulary: GrammarVocabulary | None = None  # built on the first constraint
        # every request's constraint unless it brings its own (None: unconstrained)
        self.default_constraint: Constraint | None = (
            None if constraint is None else self.constraint(constraint)
        )

    @property
    def model(self) -> torch.nn.Module:
        """The target's module, for code that runs it as transformers does (peers, training)."""
        return self.target.model

    # ------------------------------------------------------------------ building

    @classmethod
    def load(
        cls,
        model: str | ModelConfig = "smollm2-135m",
        proposer: ComponentSpec | None = None,
        verifier: ComponentSpec | None = None,
        sampling: SamplingConfig | None = None,
        **kwargs: Any,
    ) -> Pipeline:
        """Load a model by config name (or ModelConfig) and build the pipeline."""
        model_config = ModelConfig(name=model) if isinstance(model, str) else model
        target, tokenizer = load_model(model_config)
        return cls(target, tokenizer, proposer, verifier, sampling, model_config=model_config, **kwargs)

    def with_components(
        self,
        proposer: ComponentSpec | None,
        verifier: ComponentSpec | None,
        sampling: SamplingConfig | None = None,
        round_gate: bool | None = None,
    ) -> Pipeline:
        """Another pipeline over the same loaded target (no reload); ``round_gate``
        None keeps this one's."""
        return Pipeline(
            self.target,
            self.tokenizer,
            proposer,
            verifier,
            sampling or self.sampling,
            model_config=self.context.model_config,
            artifacts_dir=self.context.artifacts_dir,
            max_new_tokens=self.max_new_tokens,
            stop_strings=self.stop_strings,
            chat_template=self.chat_template,
            cost_curve=self.context.fixed_cost_curve,
            round_gate=self.round_gate if round_gate is None else round_gate,
            constraint=self.default_constraint,
            sizing=self.sizing,
        )

    def _component(self, spec: ComponentSpec | None, registry, base: type) -> Any:
        if spec is None or isinstance(spec, base):
            return spec
        return build(registry, spec, context=self.context)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.proposer is None:
            return "standard"
        return f"{self.proposer.name}+{self.verifier.name}"  # type: ignore[union-attr]

    # ---------------------------------------------------------------- generating

    def encode(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
        """Token ids for a prompt: text (through the chat template unless disabled),
        chat messages, or ids passed through."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if self.chat_template and self.tokenizer.chat_template:
                encoded = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
                ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
                return list(ids)
            return self.tokenizer.encode(messages[-1]["content"])
        return [int(t) for t in prompt]

    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_text: Callable[[str], None] | None = None,
        constraint: ConstraintSpec | None = None,
    ) -> GenerationResult:
        """Generate a continuation. ``on_tokens`` gets each round's new token ids,
        ``on_text`` the new text, as they are produced; ``constraint`` (a
        :class:`Constraint` or ``{"json_schema" | "regex" | "grammar": ...}``) restricts
        the output to a grammar's sentences."""
        callback = on_tokens
        if on_text is not None:
            callback = self.text_streamer(on_text, on_tokens)
        decoding = self.start(prompt, max_new_tokens, seed=seed, on_tokens=callback, constraint=constraint)
        while not decoding.done:
            decoding.step()
        return self.result(decoding)

    def start(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        constraint: ConstraintSpec | None = None,
    ) -> Decoding:
        """A request decoded a round at a time: prefilled, then ``step()`` it until
        ``done`` and pass it to :meth:`result`. Requests of different pipelines can be
        stepped in turn (each pipeline has a KV cache of its own); one pipeline decodes
        one request at a time (several at once: :meth:`generate_batch`)."""
        return self._decoding(
            prompt, max_new_tokens, seed, on_tokens, constraint, self.session, self.proposer
        )

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int] | Sequence[dict]],
        max_new_tokens: int | None = None,
        *,
        batch_size: int | None = None,
        seeds: Sequence[int | None] | None = None,
        constraints: Sequence[ConstraintSpec | None] | None = None,
        arrivals: Sequence[float] | None = None,
    ) -> BatchResult:
        """Decode ``prompts`` together, at most ``batch_size`` at once (default: all), one
        target pass per round over every request's pending token and draft
        (:mod:`specdec.decoders.engine.batch`). Each request's output is the one
        :meth:`generate` gives it alone. ``arrivals``: seconds after the start at which each
        request arrives (continuous batching: it joins once a place is free).
        Results in the order of ``prompts``, with the batch's own measures."""
        from specdec.decoders.engine.batch import check_batchable, decode_batch

        check_batchable(self.proposer, self.gate)
        count = len(prompts)
        seeds = list(seeds) if seeds is not None else [None] * count
        constraints = list(constraints) if constraints is not None else [None] * count
        for name, values in (("seeds", seeds), ("constraints", constraints)):
            if len(values) != count:
                raise ValueError(f"{name} has {len(values)} entries for {count} prompts")
        results: list[GenerationResult | None] = [None] * count

        def start(i: int, session, proposer) -> Decoding:
            return self._decoding(
                prompts[i], max_new_tokens, seeds[i], None, constraints[i], session, proposer
            )

        def done(i: int, decoding: Decoding) -> None:
            results[i] = self.result(decoding)

        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        size = max(1, min(count, batch_size or count))
        stats = decode_batch(
            start,
            count,
            size,
            self.target.session,
            self.proposer,
            self.sizing,
            arrivals,
            done,
            self.batch_gate,
        )
        return BatchResult(results, stats)  # type: ignore[arg-type]

    def _decoding(self, prompt, max_new_tokens, seed, on_tokens, constraint, session, proposer) -> Decoding:
        prompt_ids = self.encode(prompt)
        if proposer is not None:  # T(n) measured (or read) now, before the request's clock starts
            self.context.cost_curve()
        sampling = self.sampling if seed is None else replace(self.sampling, seed=seed)
        stop = StopConditions(
            max_new_tokens or self.max_new_tokens, self.eos_token_ids(), self.stop_strings, self.tokenizer
        )
        if constraint is None:
            constraint = self.default_constraint
        grammar = self.constraint(constraint).start() if constraint is not None else None
        return Decoding(
            session, prompt_ids, stop, sampling, proposer, self.verifier, on_tokens, self.gate, grammar
        )

    def constraint(self, spec: ConstraintSpec) -> Constraint:
        """``spec`` compiled for this pipeline's tokenizer (a Constraint passes through);
        a schema, regex or grammar that does not compile raises a ConstraintError."""
        if isinstance(spec, Constraint):
            return spec
        if self._grammar_vocabulary is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._grammar_vocabulary = GrammarVocabulary(self.tokenizer, vocab, sorted(self.eos_token_ids()))
        return self._grammar_vocabulary.compile(spec)

    def result(self, decoding: Decoding) -> GenerationResult:
        """The finished request of :meth:`start` as text, tokens and stats."""
        output = decoding.output()
        text = self.tokenizer.decode(output.tokens, skip_special_tokens=True) if self.tokenizer else ""
        return GenerationResult(text, output.tokens, decoding.state.prompt_len, output.stats)

    def text_streamer(
        self, on_text: Callable[[str], None], on_tokens: Callable[[list[int]], None] | None = None
    ) -> Callable[[list[int]], None]:
        """An ``on_tokens`` callback for :meth:`start` that hands ``on_text`` the new text (a
        multi-byte character once whole), as :meth:`generate`'s ``on_text`` does."""
        generated: list[int] = []
        shown = [0]

        def callback(tokens: list[int]) -> None:
            if on_tokens:
                on_tokens(tokens)
            generated.extend(tokens)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)  # type: ignore[union-attr]
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait
                return
            on_text(text[shown[0] :])
            shown[0] = len(text)

        return callback
