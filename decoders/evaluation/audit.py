"""The fidelity audit: does a pipeline reproduce standard decoding?

Two checks, both against standard decoding on the same target:

* **greedy** (:func:`greedy_audit`): the pipeline's verifier at temperature 0
  must reproduce standard greedy decoding token for token. Each prompt where it
  does not is a *divergence*: prompt id, position, both tokens and the target's
  logit gap between them there (standard's token minus the pipeline's, from a
  plain target pass over the common prefix). A divergence whose gap is within
  ``audit.tie_tolerance`` is a floating-point tie and does not fail the audit.
  ``bit_identical`` is the share of prompts where, beyond the tokens, every
  target logit row the pipeline decided from equals standard decoding's at the
  same position bit for bit (what exact mode, ``model.exact``, guarantees).
* **sampling** (:func:`sampling_audit`, only when sampling.temperature > 0): the
  first ``audit.sampled_tokens`` generated tokens must have standard decoding's
  distribution; the chi-square tests and the exact enumeration are in
  :mod:`specdec.decoders.evaluation.audit_statistics`.

A lossy verifier (``lossless = False``) is refused unless
``audit.require_lossless=false``, in which case the audit measures its loss.
The command line is :mod:`specdec.decoders.audit`; :func:`run_audit` is what it runs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.decoders.cli.config import (
    check_proposer_options,
    component,
    constraint_config,
    load_plugins,
    model_config,
    sampling_config,
    store_schema,
    to_dataclass,
)
from specdec.decoders.engine.decoding import default_verifier
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.registry import verifier_registry
from specdec.decoders.evaluation.audit_statistics import (
    ChiSquare,
    TestKey,
    combined_p_value,
    exact_distribution,
    sequence_tests,
)
from specdec.decoders.evaluation.metrics import Divergence, first_divergence
from specdec.decoders.evaluation.prompt_reuse import reusing_prompts
from specdec.decoders.evaluation.workloads import Prompt, load_workload, workload_config
from specdec.decoders.models.loading import load_model

AuditPrompt = tuple[str, list[int]]  # (prompt id, token ids)

#: Default ``audit.tie_tolerance`` per model dtype: logit gaps this small are rounding.
TIE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


class LossyVerifierError(ValueError):
    """The audit was asked to prove losslessness of a verifier that declares itself lossy."""


@dataclass
class AuditConfig:
    """``audit.*`` (stored as the ``audit`` section's structured config; conf/audit.yaml
    only points ``output`` into the run directory)."""

    output: str = "audit.json"
    prompts: int = 10  # greedy test: prompts (round-robin over the workload's categories)
    max_new_tokens: int = 64  # greedy test: tokens per prompt
    sampling_prompts: int = 3  # sampling test: the first N of those prompts
    samples: int = 300  # sampling test: seeds per prompt (and per decoder in the two-sample test)
    sampled_tokens: int = 3  # sampling test: leading generated tokens whose joint distribution is compared
    max_enumerable_vocab: int = 64  # vocabularies up to this size get the exact (enumerated) distribution
    alpha: float = 0.01  # the sampling test fails below this p-value
    tie_tolerance: float | None = (
        None  # greedy divergences with |logit gap| <= this are ties; null = by dtype
    )
    require_lossless: bool = True  # refuse verifiers declaring lossless = False (false = measure their loss)

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens", "sampling_prompts", "samples", "sampled_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"audit.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"audit.alpha must be in (0, 1), got {self.alpha}")


store_schema("audit", "default", AuditConfig)


# ------------------------------------------------------------------ sampled


def sample_outcomes(
    pipeline: Pipeline, prompt_ids: list[int], length: int, seeds: Iterable[int], progress: tqdm | None = None
) -> Counter:
    """The first ``length`` generated tokens of one generation per seed, counted.

    Generates one token more than compared, so the round that emits the last
    compared token may have drafted past it, as in ordinary use.
    """
    counts: Counter = Counter()
    for seed in seeds:
        tokens = pipeline.generate(prompt_ids, length + 1, seed=seed).tokens
        counts[tuple(tokens[:length])] += 1
        if progress is not None:
            progress.update()
    return counts


# ----------------------------------------------------------------------- greedy


def target_logits_after(pipeline: Pipeline, token_ids: list[int]) -> torch.Tensor:
    """(vocab,) the target's logits after ``token_ids``, from one plain prefill pass."""
    session = pipeline.session
    session.reset()
    return session.forward(token_ids)[-1].double()


def decided_rows(pipeline: Pipeline):
    """Collects, while in the block, the target logit row behind each position the
    pipeline's session commits (:meth:`ModelSession.recording_kept_rows`)."""
    return pipeline.session.recording_kept_rows()


def greedy_audit(
    standard: Pipeline,
    speculative: Pipeline,
    prompts: list[AuditPrompt],
    max_new_tokens: int,
    checkpoint: Callable[[tuple[float, float, list[Divergence], int]], None] | None = None,
) -> tuple[float, float, list[Divergence]]:
    """Shares of prompts whose outputs are identical and whose decisive logits are
    bit-identical too (:func:`decided_rows`), and the divergences. ``checkpoint`` gets
    them over the prompts done so far, and their number, after each prompt."""
    divergences: list[Divergence] = []
    bit_identical = 0
    for done, (prompt_id, prompt_ids) in enumerate(tqdm(prompts, desc="greedy")):
        if checkpoint is not None and done:
            checkpoint((1 - len(divergences) / done, bit_identical / done, list(divergences), done))
        with decided_rows(standard) as expected_rows:
            expected = standard.generate(prompt_ids, max_new_tokens).tokens
        with decided_rows(speculative) as produced_rows:
            produced = speculative.generate(prompt_ids, max_new_tokens).tokens
        position = first_divergence(produced, expected)
        if position is None:
            common = min(len(expected_rows), len(produced_rows))
            same = all(torch.equal(a, b) for a, b in zip(expected_rows[:common], produced_rows[:common]))
            if same and common >= len(expected) - 1:
                bit_identical += 1
            continue
        standard_token = expected[position] if position < len(expected) else None
        pipeline_token = produced[position] if position < len(produced) else None
        gap = None
        if standard_token is not None and pipeline_token is not None:
            logits = target_logits_after(standard, prompt_ids + expected[:position])
            gap = float(logits[standard_token] - logits[pipeline_token])
        divergences.append(Divergence(prompt_id, position, standard_token, pipeline_token, gap))
    return 1 - len(divergences) / len(prompts), bit_identical / len(prompts), divergences


# ------------------------------------------------------------------------ audit


def synthetic_prompts(vocab_size: int, count: int, seed: int = 0) -> list[AuditPrompt]:
    """Token-id prompts for tokenizer-less test models: a random phrase said twice
    and a half, so prompt lookup finds something to propose."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for number in range(count):
        phrase = torch.randint(0, vocab_size, (6,), generator=generator).tolist()
        prompts.append((f"synthetic-{number}", phrase + phrase + phrase[:3]))
    return prompts


def workload_prompts(workload: list[Prompt], pipeline: Pipeline, count: int) -> list[AuditPrompt]:
    """The workload's first turns, taken round-robin across its categories."""
    by_category: dict[str, list] = {}
    for prompt in workload:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = [p for rank in zip(*by_category.values()) for p in rank]  # first of each, second of each...
    leftovers = [p for ps in by_category.values() for p in ps if p not in ordered]
    return [(p.id, pipeline.encode(p.turns[0])) for p in (ordered + leftovers)[:count]]


def check_lossless_claim(verifier_name: str, audit: AuditConfig) -> bool:
    """The verifier's declared losslessness; raises if the audit requires it and it is lossy."""
    lossless = bool(verifier_registry.get(verifier_name).lossless)
    if not lossless and audit.require_lossless:
        raise LossyVerifierError(
            f"verifier={verifier_name} declares itself lossy (lossless = False), so it cannot pass an "
            "audit that requires losslessness. Run with audit.require_lossless=false to measure its "
            "quality loss instead."
        )
    return lossless


def sampling_audit(
    standard: Pipeline,
    speculative: Pipeline,
    prompts: list[AuditPrompt],
    audit: AuditConfig,
    checkpoint: Callable[[dict], None] | None = None,
) -> dict:
    """Exact or two-sample chi-square test of the first generated tokens' distribution.

    ``checkpoint`` gets the summary over the prompts done so far after each prompt.
    """
    exact = standard.model.config.vocab_size <= audit.max_enumerable_vocab
    length = audit.sampled_tokens
    seeds = range(audit.samples)
    standard_seeds = range(10**6, 10**6 + audit.samples)  # disjoint from the pipeline's
    totals: dict[TestKey, ChiSquare] = {}
    per_prompt: list[dict] = []
    progress = tqdm(total=len(prompts) * audit.samples * (1 if exact else 2), desc="sampling")
    for prompt_id, prompt_ids in prompts:
        observed = sample_outcomes(speculative, prompt_ids, length, seeds, progress)
        if exact:
            reference = exact_distribution(
                standard.model, prompt_ids, standard.sampling, length, standard.eos_token_ids()
            )
        else:
            reference = sample_outcomes(standard, prompt_ids, length, standard_seeds, progress)
        tests = sequence_tests(observed, reference, exact)
        for key, test in tests.items():
            totals[key] = totals.get(key, ChiSquare()) + test
        per_prompt.append(
            {
                "prompt": prompt_id,
                "p_value": combined_p_value(tests.values()),
                "distinct_outcomes": len(observed),
            }
        )
        if checkpoint is not None:
            checkpoint(sampling_summary(totals, per_prompt, exact, audit))
    progress.close()
    return sampling_summary(totals, per_prompt, exact, audit)


def sampling_summary(
    totals: dict[TestKey, ChiSquare], per_prompt: list[dict], exact: bool, audit: AuditConfig
) -> dict:
    """The sampling test's record over the prompts in ``per_prompt``."""
    p_value = combined_p_value(totals.values())
    samples = audit.samples * len(per_prompt)
    return {
        "method": "exact" if exact else "two_sample",
        "prompts": len(per_prompt),
        "sampled_tokens": audit.sampled_tokens,
        "pipeline_samples": samples,
        "standard_samples": 0 if exact else samples,
        "p_value": p_value,
        "alpha": audit.alpha,
        "passed": p_value >= audit.alpha,
        "tests": [
            {
                "position": position,
                "kind": kind,
                "statistic": t.statistic,
                "dof": t.dof,
                "impossible": t.impossible,
                "p_value": t.p_value,
            }
            for (position, kind), t in sorted(totals.items())
        ],  # fmt: skip
        "per_prompt": per_prompt,
    }


def run_audit(cfg: DictConfig, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run both checks for the configured pipeline; returns the audit record.

    ``checkpoint`` gets the record so far (``complete: false``) after the greedy
    test and after each prompt of the sampling test, so a long audit that is
    interrupted keeps what it finished.
    """
    load_plugins(cfg)
    audit = to_dataclass(AuditConfig, cfg.audit, "audit")
    sampling = sampling_config(cfg)
    proposer_cfg = component(cfg, "proposer")
    if proposer_cfg is None:
        raise ValueError(
            "the audit needs a pipeline to check: choose one with proposer=NAME (e.g. proposer=ngram)."
        )
    verifier_cfg = component(cfg, "verifier")  # None: the pipeline's default for its drafts
    if verifier_cfg is not None:  # a lossy verifier is refused before the model loads
        check_lossless_claim(verifier_cfg if isinstance(verifier_cfg, str) else verifier_cfg["name"], audit)
    check_proposer_options(cfg)
    workload = load_workload(workload_config(cfg))  # a missing workload file: before the model loads

    model_cfg = model_config(cfg)
    target, tokenizer = load_model(model_cfg)
    greedy_sampling = replace(sampling, temperature=0.0)
    standard = Pipeline(target, tokenizer, sampling=greedy_sampling, model_config=model_cfg,
                        artifacts_dir=cfg.artifacts_dir, max_new_tokens=audit.max_new_tokens,
                        round_gate=cfg.round_gate,
                        constraint=constraint_config(cfg))  # both pipelines decode under it, if given  # fmt: skip
    count = max(audit.prompts, audit.sampling_prompts)
    if tokenizer is None:
        prompts = synthetic_prompts(target.config.vocab_size, count)
    else:
        prompts = workload_prompts(workload, standard, count)
    tolerance = audit.tie_tolerance
    if tolerance is None:
        tolerance = TIE_TOLERANCE.get(standard.session.dtype, 1e-3)
    start = time.perf_counter()

    speculative = standard.with_components(proposer_cfg, verifier_cfg)
    if verifier_cfg is None:  # the default for the run's sampling, the same verifier in both checks
        verifier_cfg = default_verifier(sampling, speculative.verifier.name == "tree")
        if verifier_cfg != speculative.verifier.name:
            speculative = standard.with_components(proposer_cfg, verifier_cfg)
    verifier_name = speculative.verifier.name
    declared_lossless = check_lossless_claim(verifier_name, audit)
    greedy_prompts = len(prompts[: audit.prompts])
    identical, bit_identical, divergences, greedy_done = 0.0, 0.0, [], 0

    def record(sampling_result: dict | None, complete: bool) -> dict:
        """The audit so far. Until it is complete it has not passed, whatever it found: an
        interrupted test is neither passed nor skipped."""
        ties_only = all(d.logit_gap is not None and abs(d.logit_gap) <= tolerance for d in divergences)
        passed = complete and ties_only and (sampling_result is None or sampling_result["passed"])
        unfinished = None
        if not complete:
            unfinished = (
                f"greedy test interrupted after {greedy_done} of {greedy_prompts} prompts"
                if greedy_done < greedy_prompts
                else "sampling test interrupted after "
                f"{(sampling_result or {}).get('prompts', 0)} of {audit.sampling_prompts} prompts"
            )
        return {
            "passed": passed,
            "complete": complete,
            "unfinished": unfinished,
            "verdict": verdict(
                passed,
                identical,
                bit_identical,
                divergences,
                tolerance,
                sampling_result,
                declared_lossless,
                unfinished,
            ),
            "pipeline": speculative.name,
            "proposer": speculative.proposer.name,  # type: ignore[union-attr]
            "verifier": verifier_name,
            "declared_lossless": declared_lossless,
            "model": standard.context.target_key,
            "dtype": str(standard.session.dtype).removeprefix("torch."),
            "constraint": None
            if standard.default_constraint is None
            else standard.default_constraint.description,
            "device": str(standard.session.device),
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "greedy_identical": identical,
            "bit_identical": bit_identical,
            "exact_mode": target.exact,
            "greedy_prompts": greedy_done,
            "greedy_max_new_tokens": audit.max_new_tokens,
            "tie_tolerance": tolerance,
            "divergences": [asdict(d) for d in divergences],
            "sampling_p_value": None if sampling_result is None else sampling_result["p_value"],
            "pipeline_samples": 0 if sampling_result is None else sampling_result["pipeline_samples"],
            "standard_samples": 0 if sampling_result is None else sampling_result["standard_samples"],
            "sampling": sampling_result,
            "audit_seconds": time.perf_counter() - start,
            "config": OmegaConf.to_container(cfg, resolve=True),
        }

    def greedy_so_far(partial: tuple[float, float, list[Divergence], int]) -> None:
        nonlocal identical, bit_identical, divergences, greedy_done
        identical, bit_identical, divergences, greedy_done = partial
        if checkpoint is not None:
            checkpoint(record(None, complete=False))

    identical, bit_identical, divergences = greedy_audit(
        standard, speculative, prompts[:greedy_prompts], audit.max_new_tokens, greedy_so_far
    )
    greedy_done = greedy_prompts
    if sampling.greedy:
        return record(None, complete=True)
    if checkpoint is not None:
        checkpoint(record(None, complete=False))
    sampling_result = sampling_audit(
        reusing_prompts(standard.with_components(None, None, sampling)),
        reusing_prompts(standard.with_components(proposer_cfg, verifier_cfg, sampling)),
        prompts[: audit.sampling_prompts],
        audit,
        None if checkpoint is None else lambda partial: checkpoint(record(partial, complete=False)),
    )
    return record(sampling_result, complete=True)


def verdict(
    passed: bool,
    identical: float,
    bit_identical: float,
    divergences: list[Divergence],
    tolerance: float,
    sampling: dict | None,
    declared_lossless: bool,
    unfinished: str | None = None,
) -> str:
    """One line a person can act on."""
    ties = sum(1 for d in divergences if d.logit_gap is not None and abs(d.logit_gap) <= tolerance)
    parts = [
        f"greedy identical on {identical:.0%} of prompts ({len(divergences)} divergence(s), "
        f"{ties} of them floating-point ties within {tolerance:g}), "
        f"bit-identical logits on {bit_identical:.0%}"
    ]
    if unfinished:
        parts.append(unfinished)
    if sampling is None:
        if not unfinished:
            parts.append("sampling test skipped (sampling.temperature=0)")
    else:
        parts.append(
            f"sampling {sampling['method']} chi-square p={sampling['p_value']:.4g} "
            f"({sampling['pipeline_samples']} pipeline / {sampling['standard_samples']} standard samples)"
        )
    head = "INCOMPLETE" if unfinished else "PASSED" if passed else "FAILED"
    if not declared_lossless:
        head += " (verifier declared lossy)"
    return f"{head}: " + "; ".join(parts)
