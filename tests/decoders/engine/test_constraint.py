"""Constrained generation (decoders/engine/constraint.py): lossless in every pipeline.

The tiny model (vocabulary 320, bytes 0-255 as tokens, so every string has one
tokenisation) decodes under a JSON schema and under a regex. Greedy: every (proposer,
lossless verifier) pair and every merge with the grammar proposer reproduce constrained
standard decoding, which itself equals a reference written here from whole-sequence
passes and llguidance's masks. Sampling: the engine's cut of a sampled draft keeps the
constrained target's distribution exactly (enumerated), and sampled pipelines' outputs
follow it (chi-square against the distribution enumerated from the model).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import llguidance
import pytest
import torch
from scipy.stats import chisquare

from specdec.decoders import Pipeline
from specdec.decoders.engine.draft import Draft
from specdec.decoders.engine.registry import proposer_registry
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs
from specdec.decoders.evaluation.peers import GrammarLogitsProcessor
from specdec.verifiers.rejection import residual_distribution
from tests.bench_helpers import run_bench, tiny_overrides
from tests.conftest import REPO_ROOT, TEXT_PROPOSERS, random_prompts
from tests.decoders.engine.test_greedy_identity import shape_cases, shape_id

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "count", "ok"],
    "additionalProperties": False,
}
BRANCHES = "(ab|acd|ad|b{1,3}c?|cab)"  # a finite language with branches at every depth
LANGUAGE = ["ab", "acd", "ad", "b", "bb", "bbb", "bc", "bbc", "bbbc", "cab"]
EOS = 257  # the tiny model's end token


def reference_constrained_greedy(
    pipeline: Pipeline, prompt: list[int], spec: dict, max_new: int
) -> list[int]:
    """Constrained greedy decoding written plainly: a whole-sequence pass per token, the
    argmax over the tokens llguidance's matcher allows."""
    constraint = pipeline.constraint(spec)
    matcher = llguidance.LLMatcher(constraint.vocabulary.tokenizer, constraint.source)
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_new:
            logits = pipeline.model(torch.tensor([prompt + tokens])).logits[0, -1]  # (vocab,)
            allowed = constraint.vocabulary.allowed(matcher.compute_bitmask())
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            tokens.append(token)
            if token in pipeline.eos_token_ids():
                break
            assert matcher.consume_token(token)
    return tokens


def test_constrained_standard_decoding_equals_the_reference(tiny_pipeline):
    completed = 0
    for prompt in random_prompts(4, seed=3):
        for max_new in (1, 9, 80):
            result = tiny_pipeline.generate(prompt, max_new, constraint={"json_schema": SCHEMA})
            assert result.tokens == reference_constrained_greedy(
                tiny_pipeline, prompt, {"json_schema": SCHEMA}, max_new
            )
            completed += bool(result.stats.constraint_complete)
            if result.stats.constraint_complete:
                body = bytes(t for t in result.tokens if t < 256).decode()
                assert set(json.loads(body)) == set(SCHEMA["properties"])
    assert completed > 0, "no output completed its schema: the check saw only prefixes"


@pytest.mark.parametrize("case", shape_cases(constrained=True), ids=[shape_id(c) for c in shape_cases(True)])
def test_constrained_greedy_output_equals_constrained_standard(drafting_pays, trained_pipeline, case):
    """Every proposer in each of its draft shapes, with every lossless verifier, under a JSON
    schema and a regex: constrained standard decoding's tokens exactly."""
    spec, verifier = case
    if spec["name"] in TEXT_PROPOSERS:
        pytest.skip(
            "span copies text, which a random model never writes (tests/conftest.py): its drafts are "
            "all cut here; test_span.py and the structured bench (identical outputs 1.00) cover it"
        )
    pipeline = trained_pipeline.with_components(spec, verifier)
    accepted = 0
    for constraint_spec in ({"json_schema": SCHEMA}, {"regex": "([a-c]{1,3}(yes|no);)+"}):
        constraint = trained_pipeline.constraint(constraint_spec)
        for prompt in random_prompts(3, seed=4):
            for max_new in (1, 7, 30):
                expected = trained_pipeline.generate(prompt, max_new, constraint=constraint).tokens
                result = pipeline.generate(prompt, max_new, constraint=constraint)
                assert result.tokens == expected, (spec, verifier, constraint_spec, prompt, max_new)
                accepted += result.stats.accepted
    assert accepted > 0, "no draft token was ever accepted: the test exercised nothing"


@pytest.mark.parametrize("other", [n for n in proposer_registry.names() if n not in ("grammar", "merge")])
def test_the_grammar_proposer_merges_losslessly_with_every_proposer(drafting_pays, trained_pipeline, other):
    constraint = trained_pipeline.constraint({"json_schema": SCHEMA})
    for members in (["grammar", other], [other, "grammar"]):
        pipeline = trained_pipeline.with_components({"name": "merge", "members": members}, "tree")
        for prompt in random_prompts(2, seed=6):
            expected = trained_pipeline.generate(prompt, 30, constraint=constraint).tokens
            assert pipeline.generate(prompt, 30, constraint=constraint).tokens == expected, members


@pytest.mark.parametrize("proposer", ["ngram", "grammar", "draft_model"])
def test_constrained_output_is_bit_identical_in_exact_mode(proposer):
    from specdec.decoders.models.loading import ModelConfig, byte_tokenizer
    from tests.decoders.models.test_exact import exact_tiny

    base = Pipeline(exact_tiny("bfloat16"), byte_tokenizer(), model_config=ModelConfig(name="tiny-random"))
    pipeline = base.with_components(proposer, "tree")
    constraint = base.constraint({"json_schema": SCHEMA})
    for prompt in random_prompts(3, seed=9):
        expected = base.generate(prompt, 30, constraint=constraint).tokens
        assert pipeline.generate(prompt, 30, constraint=constraint).tokens == expected


def test_the_grammar_proposer_drafts_the_forced_continuation(tiny_pipeline):
    pipeline = tiny_pipeline.with_components("grammar", "greedy")
    result = pipeline.generate([1, 2, 3], 40, constraint={"json_schema": SCHEMA})
    assert result.stats.accepted >= len('"name": "') - 1  # at least the first key came for free
    assert result.stats.acceptance_rate == 1.0  # forced tokens are the canonical spelling here
    unconstrained = pipeline.generate([1, 2, 3], 10)
    assert unconstrained.stats.proposed == 0  # no constraint: nothing drafted, a standard step


def test_forced_tokens_extend_every_leaf_and_prune_cuts_rejected_nodes(tiny_pipeline):
    grammar = tiny_pipeline.constraint({"regex": "x(abc|abd)yz"}).start()
    grammar.advance([ord("x")])
    a, b, c, d = (ord(ch) for ch in "abcd")
    draft = Draft([a, c, b, c, d, ord("q")], [-1, -1, 0, 2, 2, 2])  # 'c' at the root and 'q' are rejected
    pruned = grammar.prune(draft)
    assert (pruned.tokens, pruned.parents) == ([a, b, c, d], [-1, 0, 1, 1])
    extended = grammar.extend_forced(pruned, 8)
    y, z = ord("y"), ord("z")
    assert extended.tokens == [a, b, c, d, y, z, y, z] and extended.parents == [-1, 0, 1, 1, 2, 4, 3, 6]
    assert extended.nodes_in(draft) == [0, 2, 3, 4, None, None, None, None]


def test_forced_tokens_are_kept_where_their_leaf_is_likely_enough_to_pay():
    """The forced continuation is added to every leaf unsized; a request decoded alone then
    keeps the nodes that pay for their rows by their values (a forced node's is its leaf's):
    under a steep T(n) the likely branch with its forced tokens, not the unlikely one; under a
    flat T(n) all; a draft without values, or a sampled one, whole."""
    from types import SimpleNamespace

    from specdec.decoders.engine.round_draft import cut_to_paying
    from specdec.decoders.models.cost import CostCurve
    from specdec.decoders.sizing.policy import SizingPolicy

    # a: likely, b: unlikely, each with three forced tokens after it
    draft = Draft(
        [1, 2, 3, 4, 5, 6, 7, 8], [-1, -1, 0, 2, 3, 1, 5, 6], values=[0.9] * 1 + [0.1] + [0.9] * 3 + [0.1] * 3
    )
    proposer = SimpleNamespace(context=SimpleNamespace(sizing=None))
    for curve, kept in (
        (CostCurve({1: 1.0, 64: 4.0}), [0, 2, 3, 4]),
        (CostCurve({1: 1.0, 64: 1.0}), list(range(8))),
    ):
        proposer.context.sizing = SizingPolicy(lambda curve=curve: curve)
        assert cut_to_paying(draft, proposer).nodes_in(draft) == kept
    whole = Draft(draft.tokens, draft.parents)
    assert cut_to_paying(whole, proposer) is whole
    sampled = Draft(draft.tokens, draft.parents, torch.full((8, 10), 0.1), values=draft.values)
    assert cut_to_paying(sampled, proposer) is sampled


def test_a_cut_sampled_draft_keeps_the_constrained_distribution_exactly(tiny_pipeline):
    """One position, every draw enumerated: x ~ q (unconstrained), the engine cuts x where
    the grammar forbids it and renormalises q over the allowed tokens; speculative sampling
    then emits exactly the constrained target's p_c (without the renormalisation it does not)."""
    grammar = tiny_pipeline.constraint({"regex": "(ab|b|cab)"}).start()
    generator = torch.Generator().manual_seed(0)
    target = torch.rand(320, generator=generator, dtype=torch.float64) ** 4
    draft_q = torch.rand(320, generator=generator, dtype=torch.float64) ** 4
    draft_q /= draft_q.sum()
    target[ord("a")], target[ord("b")], target[ord("c")] = 1.0, 1.0, 2.0  # p over the allowed tokens,
    draft_q[ord("a")], draft_q[ord("c")], draft_q[ord("b")] = 3.0, 1.0, 0.0  # q another, and misses one
    draft_q /= draft_q.sum()
    allowed = grammar.allowed_after(())
    constrained_p = target * allowed / (target * allowed).sum()
    for renormalise in (True, False):
        emitted = torch.zeros(320, dtype=torch.float64)
        for token in draft_q.nonzero().flatten().tolist():
            chance = float(draft_q[token])
            pruned = grammar.prune(Draft([token], [-1], draft_q[None].clone()))
            if not pruned.tokens:  # cut: the position is decoded from the constrained target
                emitted += chance * constrained_p
                continue
            q_row = pruned.draft_probs[0] if renormalise else draft_q
            accept = min(1.0, float(constrained_p[token] / q_row[token]))
            emitted[token] += chance * accept
            emitted += chance * (1 - accept) * residual_distribution(constrained_p, q_row)
        if renormalise:
            torch.testing.assert_close(emitted, constrained_p, atol=1e-12, rtol=0)
        else:
            assert (emitted - constrained_p).abs().max() > 1e-2


def exact_language_distribution(pipeline: Pipeline, prompt: list[int], sampling: SamplingConfig) -> dict:
    """P(output) for each string of BRANCHES followed by the end token, from the model's own
    whole-sequence passes and llguidance's masks (each step's processed p over the allowed tokens)."""
    constraint = pipeline.constraint({"regex": BRANCHES})
    expected = {}
    for text in LANGUAGE:
        tokens = list(text.encode()) + [EOS]
        matcher = llguidance.LLMatcher(constraint.vocabulary.tokenizer, constraint.source)
        probability = 1.0
        with torch.no_grad():
            for i, token in enumerate(tokens):
                logits = pipeline.model(torch.tensor([prompt + tokens[:i]])).logits[0, -1]
                allowed = constraint.vocabulary.allowed(matcher.compute_bitmask())
                probs = processed_probs(logits.masked_fill(~allowed, float("-inf")), sampling)
                probability *= float(probs[token])
                if token != EOS:
                    assert matcher.consume_token(token)
        expected[tuple(tokens)] = probability
    assert abs(sum(expected.values()) - 1.0) < 1e-5, "the language's strings should hold all the mass"
    return expected


SELF_DRAFT = "self_draft"  # stands for a draft model that is the target itself (q = p before the cut)
SAMPLED_PIPELINES = [
    ("ngram", "rejection"),  # deterministic chain
    pytest.param("grammar", "rejection", marks=pytest.mark.slow),  # forced tokens
    ({"name": "ngram", "branches": 3}, "tree"),  # deterministic tree
    pytest.param({"name": "draft_model", "k": 3, "tree": True}, "tree", marks=pytest.mark.slow),  # dynamic
    (
        {"name": "draft_model", "tree": False, "k": 3, "name_or_path": SELF_DRAFT},
        "rejection",
    ),  # sampled chain, q cut
    # the merges (i.i.d. sampled siblings, each cut or kept on its own; text lookup and forced
    # tokens): a minute or more each, in the slow tier (make test-all)
    pytest.param(
        {"name": "merge", "members": [{"name": "draft_model", "k": 2, "name_or_path": SELF_DRAFT}] * 2},
        "tree",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {
            "name": "merge",
            "members": [
                "grammar",
                {"name": "draft_model", "tree": False, "k": 2, "name_or_path": SELF_DRAFT},
            ],
        },
        "tree",
        marks=pytest.mark.slow,
    ),
    pytest.param({"name": "merge", "members": ["grammar", "span"]}, "tree", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory, tiny_model) -> str:
    """The tiny target saved as a Hugging Face folder, to serve as its own draft model."""
    folder = tmp_path_factory.mktemp("self-draft")
    model, tokenizer = tiny_model
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def with_self_draft(spec, folder: str):
    if isinstance(spec, dict):
        return {key: with_self_draft(value, folder) for key, value in spec.items()}
    if isinstance(spec, list):
        return [with_self_draft(value, folder) for value in spec]
    return folder if spec == SELF_DRAFT else spec


@pytest.mark.parametrize(("proposer", "verifier"), SAMPLED_PIPELINES, ids=lambda v: json.dumps(v))
def test_sampled_constrained_outputs_follow_the_constrained_target(
    drafting_pays, tiny_pipeline, saved_target, proposer, verifier
):
    sampling = SamplingConfig(temperature=1.0)
    base = tiny_pipeline.with_components(None, None, sampling)
    pipeline = base.with_components(with_self_draft(proposer, saved_target), verifier)
    prompt = list(b"ab acd ad bbc cab b ab acd cab bb ")  # prompt lookup finds drafts in it
    expected = exact_language_distribution(base, prompt, sampling)
    constraint = base.constraint({"regex": BRANCHES})
    runs, observed, accepted = 1200, Counter(), 0
    for seed in range(runs):
        result = pipeline.generate(prompt, 8, seed=seed, constraint=constraint)
        observed[tuple(result.tokens)] += 1
        accepted += result.stats.accepted
    assert set(observed) <= set(expected), set(observed) - set(expected)
    assert accepted > 50, "drafts were hardly ever accepted: the test would be weak"
    cells = sorted(expected)
    mass = sum(expected.values())  # 1 up to rounding; chisquare wants equal totals
    p_value = chisquare([observed[c] for c in cells], [expected[c] * runs / mass for c in cells]).pvalue
    assert p_value > 1e-3, (observed, expected)


def test_an_output_that_runs_out_of_tokens_is_marked_incomplete(tiny_pipeline):
    result = tiny_pipeline.generate([5, 6, 7], 4, constraint={"json_schema": SCHEMA})
    assert len(result.tokens) == 4 and result.stats.constraint_complete is False
    assert tiny_pipeline.generate([5, 6, 7], 4).stats.constraint_complete is None


@pytest.mark.slow  # a fresh interpreter that imports and runs everything
def test_an_unconstrained_run_never_loads_the_grammar_engine(tmp_path):
    script = (
        "import sys\n"
        "from decoders import Pipeline\n"
        "from decoders.models.loading import ModelConfig\n"
        "Pipeline.load(ModelConfig(name='tiny-random'), 'ngram').generate([1, 2, 3, 1, 2, 3], 12)\n"
        "assert 'llguidance' not in sys.modules, 'llguidance was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": REPO_ROOT},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_peers_logits_processor_follows_the_ids_it_is_given(tiny_pipeline):
    """Prompt lookup calls the processor on longer and shorter prefixes in turn: each
    call's mask is the grammar's after exactly those ids."""
    constraint = tiny_pipeline.constraint({"json_schema": SCHEMA})
    processor = GrammarLogitsProcessor(constraint.start(), prompt_len=2)
    text = list(b'{"name": "ab", "kind": "beta"')
    scores = torch.zeros(1, 320)
    for cut in (5, 12, 3, 20, 20, 8, len(text)):
        masked = processor(torch.tensor([[9, 9] + text[:cut]]), scores)
        fresh = constraint.start()
        fresh.advance(text[:cut])
        assert torch.equal(torch.isfinite(masked[0]), fresh.allowed_after(()))


def test_the_bench_measures_constrained_prompts_and_their_validity(drafting_pays, tmp_path, monkeypatch):
    rows = [
        {"question_id": "j", "category": "extraction", "turns": ["name: ab, kind: beta"], "constraint": {"json_schema": SCHEMA}},
        {"question_id": "r", "category": "choice", "turns": ["yes or no"], "constraint": {"regex": BRANCHES}},
    ]  # fmt: skip
    workload = tmp_path / "structured.jsonl"
    workload.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    run_dir = tmp_path / "run"
    overrides = [
        "bench.pipelines=[grammar+greedy,ngram+greedy,{proposer:{name:merge,members:[grammar,ngram]},verifier:tree}]",
        "bench.peers=[hf_generate,hf_prompt_lookup]", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    run_bench(monkeypatch, tiny_overrides(workload, *overrides, "bench.max_new_tokens=48"))
    results = json.loads((run_dir / "results.json").read_text())
    entries = {e["name"]: e for e in results["pipelines"]}
    for name, entry in entries.items():
        assert entry["valid_outputs"] == entry["complete_outputs"], name  # what completes validates
        if entry["kind"] != "peer":
            assert entry["grammar_ms_per_mask"] > 0
        if name != "standard" and entry["kind"] != "control":
            assert entry["identical_outputs"] == 1.0, name
    assert entries["grammar+greedy"]["mean_accepted_tokens"] > 1.5  # forced keys and quotes came free


def test_the_audit_checks_a_pipeline_under_a_constraint(tmp_path):
    """`audit` with constraint.*: standard decoding and the pipeline both decode under it."""
    from specdec.decoders.evaluation.audit import run_audit
    from tests.bench_helpers import write_workload
    from tests.decoders.evaluation.test_audit import audit_config

    cfg = audit_config(
        tmp_path, "proposer=merge", "proposer.members=[grammar,span]", "verifier=tree",
        "sampling.temperature=1.0", f"workload.path={write_workload(tmp_path)}", "audit.prompts=2",
        "audit.max_new_tokens=24", "audit.sampling_prompts=1", "audit.samples=60", 'constraint.regex="(ab|acd|ad|b{1,3}c?|cab)"',
    )  # fmt: skip
    audit = run_audit(cfg)
    assert audit["passed"] is True, audit["verdict"]
    assert audit["constraint"].startswith("regex") and audit["greedy_identical"] == 1.0


def test_a_pipeline_s_default_constraint_applies_to_every_request_and_its_variants(tiny_pipeline):
    constrained = tiny_pipeline.with_components(None, None)
    constrained.default_constraint = constrained.constraint({"regex": BRANCHES})
    speculative = constrained.with_components("grammar", "greedy")
    for pipeline in (constrained, speculative):
        tokens = pipeline.generate([1, 2, 3], 8).tokens
        assert bytes(t for t in tokens if t != EOS).decode() in LANGUAGE
