"""proposer=suffix: its suffix index against brute force, its memory across requests
(bounds, eviction, save and load), and losslessness with the tree verifier."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.decoders.engine.context import PipelineContext
from specdec.decoders.engine.draft import Round
from specdec.decoders.engine.registry import build, proposer_registry
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.audit import sample_outcomes
from specdec.decoders.evaluation.audit_statistics import (
    combined_p_value,
    exact_distribution,
    sequential_goodness_of_fit,
)
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.proposers.suffix_index import SuffixIndex
from tests.conftest import random_prompts

FLAT_COST = CostCurve({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.2, 16: 1.5, 32: 2.5})  # cheap wide passes


@pytest.fixture(autouse=True)
def fixed_cost_curve(monkeypatch):
    """Tree sizes follow T(n): a fixed curve, never the speed of this machine."""
    monkeypatch.setattr(PipelineContext, "cost_curve", lambda self: FLAT_COST)


# ------------------------------------------------------------ the index vs brute force


def occurrences(documents: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    """(document, start) of every occurrence of ``pattern``."""
    n = len(pattern)
    return [
        (d, i)
        for d, doc in enumerate(documents)
        for i in range(len(doc) - n + 1)
        if doc[i : i + n] == pattern
    ]


def next_tokens(documents: list[list[int]], pattern: list[int]) -> Counter:
    """What followed each occurrence of ``pattern`` (where something did)."""
    n = len(pattern)
    return Counter(
        documents[d][i + n] for d, i in occurrences(documents, pattern) if i + n < len(documents[d])
    )


def brute_latest_continuation(
    documents: list[list[int]], pattern: list[int], depth: int, limit: int
) -> list[int]:
    """Up to ``limit`` tokens after the latest occurrence of ``pattern`` that continued
    (none for a string of the index's full depth, whose continuations are not kept)."""
    n = len(pattern)
    continued = [(d, i) for d, i in occurrences(documents, pattern) if i + n < len(documents[d])]
    if not continued or n >= depth:
        return []
    d, i = max(continued)
    return documents[d][i + n : i + n + limit]


tokens = st.lists(st.integers(0, 2), max_size=14)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), tokens),
        st.tuples(st.just("extend"), tokens),
        st.tuples(st.just("remove"), st.just([])),
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(
    depth=st.integers(2, 6),
    ops=operations,
    probes=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7)),
)
def test_counts_and_continuations_match_brute_force(depth, ops, probes):
    """After any mix of whole documents, a growing last document and evictions, every
    string of at most ``depth`` tokens has its brute-force count, continuations and
    latest continuation."""
    index = SuffixIndex(depth)
    documents: list[list[int]] = []
    growing = False
    for op, values in ops:
        if op == "add":
            index.add_document(values)
            documents.append(list(values))
            growing = False
        elif op == "extend":
            if not growing:
                index.open_document()
                documents.append([])
                growing = True
            index.extend(values)
            documents[-1].extend(values)
        elif len(documents) > (1 if growing else 0):
            index.remove_oldest()
            documents.pop(0)
    assert [index.document(i) for i in range(index.documents)] == documents
    assert index.tokens == sum(len(doc) for doc in documents)
    substrings = [doc[i : i + n] for doc in documents for i in range(len(doc)) for n in range(1, depth + 1)]
    for pattern in substrings + probes:
        if len(pattern) > depth:
            assert index.walk(pattern) is None
            continue
        assert index.count(pattern) == len(occurrences(documents, pattern)), pattern
        state = index.walk(pattern)
        if state is None:
            continue
        found = {c.token: c.count for c in index.continuations(state)}  # a dict: zero counts differ
        expected = dict(next_tokens(documents, pattern)) if len(pattern) < depth else {}
        assert found == expected, (pattern, found, expected)
        assert index.latest_continuation(state, 3) == brute_latest_continuation(documents, pattern, depth, 3)


@settings(max_examples=150, deadline=None)
@given(
    depth=st.integers(2, 8),
    document=st.lists(st.integers(0, 3), max_size=30),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    max_length=st.integers(1, 10),
    most=st.integers(1, 4),
)
def test_matches_are_suffixes_each_more_frequent_than_the_last(depth, document, context, max_length, most):
    """matches(): longest first, each kept suffix continued more often than the one kept
    before it, up to ``most``; the first is longest_match(), the longest suffix that
    continued."""
    index = SuffixIndex(depth)
    index.add_document(document)
    expected, best = [], 0
    for n in range(min(max_length, len(context), depth - 1), 0, -1):
        continued = sum(next_tokens([document], context[len(context) - n :]).values())
        if continued > best and len(expected) < most:
            expected.append(n)
            best = continued
    assert [depth for _, depth in index.matches(context, max_length, most)] == expected
    longest = index.longest_match(context, max_length)
    assert (longest[1] if longest else 0) == (expected[0] if expected else 0)


def test_the_index_refuses_misuse():
    with pytest.raises(ValueError, match="depth >= 2"):
        SuffixIndex(1)
    index = SuffixIndex(4)
    with pytest.raises(RuntimeError, match="open_document first"):
        index.extend([1])
    with pytest.raises(IndexError, match="no document"):
        index.remove_oldest()
    index.open_document()
    index.extend([1, 2])
    with pytest.raises(RuntimeError, match="still growing"):
        index.remove_oldest()


# ------------------------------------------------------------------ the proposer


def suffix_proposer(tiny_pipeline, **options):
    return build(proposer_registry, {"name": "suffix", **options}, context=tiny_pipeline.context)


def paths(draft) -> list[list[int]]:
    """Every root-to-node token path of a draft."""
    result = []
    for node in range(len(draft)):
        path = []
        while node >= 0:
            path.insert(0, draft.tokens[node])
            node = draft.parents[node]
        result.append(path)
    return result


def drafted_streams(proposer):
    """Drive ``proposer`` (no memory) over short requests: yield (stream, draft) for every
    non-empty draft, each then observed as wholly rejected."""
    for prompt in random_prompts(6, vocab=6, seed=3):
        stream = list(prompt)
        proposer.begin(None)
        for token in [1, 2, 3, 1, 2]:
            stream.append(token)
            draft = proposer.propose(_State(stream))
            if len(draft):
                yield stream, draft
                proposer.observe(None, _accept_nothing(draft))


def test_drafts_are_continuations_that_occurred(tiny_pipeline):
    """Without memory and with the longest match only, every drafted path is what followed
    the longest repeated suffix of the request somewhere in it, and the principal path is
    the most frequent one."""
    proposer = suffix_proposer(
        tiny_pipeline, memory_requests=0, adaptive=False, k=4, max_nodes=8, match_lengths=1
    )
    drafted = 0
    for stream, draft in drafted_streams(proposer):
        drafted += 1
        length = max(n for n in range(1, 17) if n < len(stream) and next_tokens([stream], stream[-n:]))
        match = stream[-length:]
        for path in paths(draft):
            assert occurrences([stream], match + path), (stream, match, path)
        principal = [draft.tokens[i] for i in draft.principal_path()]
        assert next_tokens([stream], match).most_common(1)[0][1] == next_tokens([stream], match)[principal[0]]
    assert drafted > 10


def test_drafts_of_several_match_lengths_are_continuations_of_one_of_them(tiny_pipeline):
    """With match_lengths=3 every drafted path followed one of the request's matches
    (index.matches), and the drafts are trees within max_nodes."""
    proposer = suffix_proposer(tiny_pipeline, memory_requests=0, adaptive=False, k=4, max_nodes=8)
    assert proposer.config.match_lengths == 3
    several = 0
    for stream, draft in drafted_streams(proposer):
        assert len(draft) <= 8 and all(p < i for i, p in enumerate(draft.parents))
        lengths = [state[1] for state in proposer.request.matches(stream, 16, 3)]
        several += len(lengths) > 1
        for path in paths(draft):
            assert any(occurrences([stream], stream[-n:] + path) for n in lengths), (stream, path)
    assert several > 5


class _State:
    def __init__(self, tokens: list[int], prompt_len: int = 0) -> None:
        self.tokens = tokens
        self.prompt_len = prompt_len


def _accept_nothing(draft) -> Round:
    """A round whose every draft node was rejected (token -1: none of them)."""
    return Round.of(draft, [], [-1])


def test_memory_drafts_a_repeated_request_in_few_passes(tiny_pipeline):
    """A request seen before is drafted from memory: far fewer target passes the second
    time, the same tokens; without memory the second run is no faster than the first."""
    prompt = random_prompts(1, seed=21, repetitive=False)[0]
    remembering = tiny_pipeline.with_components("suffix", "tree")
    first = remembering.generate(prompt, 40)
    second = remembering.generate(prompt, 40)
    assert second.tokens == first.tokens == tiny_pipeline.generate(prompt, 40).tokens
    assert second.stats.target_passes * 2 < first.stats.target_passes
    assert remembering.proposer.describe()["accepted_nodes_from"]["memory"] >= second.stats.accepted // 2
    forgetting = tiny_pipeline.with_components({"name": "suffix", "memory_requests": 0}, "tree")
    passes = [forgetting.generate(prompt, 40).stats.target_passes for _ in range(2)]
    assert passes[0] == first.stats.target_passes and passes[1] > second.stats.target_passes
    remembering.proposer.forget()
    assert remembering.proposer.memory.documents == 0
    assert remembering.generate(prompt, 40).stats.target_passes > second.stats.target_passes


@pytest.mark.parametrize("memory_prompts", [False, True])
def test_memory_keeps_the_newest_requests_within_both_bounds(tiny_pipeline, memory_prompts):
    """Each request's output (with memory_prompts, prompt and output) is kept, the oldest
    evicted first, within both bounds."""
    bound = 60 if memory_prompts else 25
    pipeline = tiny_pipeline.with_components(
        {"name": "suffix", "memory_requests": 3, "memory_tokens": bound, "memory_prompts": memory_prompts},
        "tree",
    )
    proposer = pipeline.proposer
    kept: list[list[int]] = []
    for prompt in random_prompts(8, seed=4, repetitive=False):
        output = pipeline.generate(prompt, 10).tokens
        kept.append(((prompt if memory_prompts else []) + output)[-bound:])
        while len(kept) > 3 or sum(map(len, kept)) > bound:
            kept.pop(0)
        memory = proposer.memory
        assert [memory.document(i) for i in range(memory.documents)] == kept
        assert memory.documents <= 3 and memory.tokens <= bound
    evicted = random_prompts(8, seed=4, repetitive=False)[0]
    assert memory.count(evicted[:3]) == len(occurrences(kept, evicted[:3]))


def test_memory_is_saved_and_loaded(tiny_pipeline, tmp_path):
    """After each request the memory is on disk; a new proposer starts from it and drafts
    what the old one would; forget() returns to what the proposer loaded; bad files are
    refused."""
    path = tmp_path / "memory" / "suffix.json"
    options = {"name": "suffix", "memory_path": str(path), "adaptive": False}  # same drafts, learnt or not
    pipeline = tiny_pipeline.with_components(options, "tree")
    prompts = random_prompts(3, seed=8)
    for prompt in prompts:
        pipeline.generate(prompt, 12)
    saved = json.loads(path.read_text())
    assert len(saved["requests"]) == 3 and saved["target"] == tiny_pipeline.context.target_key
    reloaded = tiny_pipeline.with_components(options, "tree").proposer
    old = pipeline.proposer.memory
    assert [reloaded.memory.document(i) for i in range(reloaded.memory.documents)] == [
        old.document(i) for i in range(old.documents)
    ]
    probe = _State(prompts[0][:6])
    for proposer in (pipeline.proposer, reloaded):
        proposer.begin(probe)
    assert paths(pipeline.proposer.propose(probe)) == paths(reloaded.propose(probe))
    pipeline.generate(prompts[0], 12)
    assert len(json.loads(path.read_text())["requests"]) == 4
    pipeline.proposer.forget()  # back to what it started from: no file, no memory
    assert pipeline.proposer.memory.documents == 0
    reloaded.finish(_State(prompts[1]))
    reloaded.forget()  # back to the three requests it loaded
    assert [reloaded.memory.document(i) for i in range(3)] == [old.document(i) for i in range(3)]
    assert reloaded.memory.documents == 3

    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a suffix memory file"):
        tiny_pipeline.with_components(options, "tree")
    path.write_text(json.dumps({"format": 1, "target": "another-model", "requests": [[1, 2]]}))
    with pytest.raises(ValueError, match="token ids of 'another-model'"):
        tiny_pipeline.with_components(options, "tree")


def test_bad_options_are_refused_naming_them(tiny_pipeline):
    with pytest.raises(ValueError, match="proposer.max_nodes must be >= 1"):
        suffix_proposer(tiny_pipeline, max_nodes=0)
    with pytest.raises(ValueError, match="proposer.memory_requests"):
        suffix_proposer(tiny_pipeline, memory_requests=-1)


def test_trees_shrink_to_nothing_where_drafts_do_not_pay(tiny_pipeline, monkeypatch):
    """A periodic request is first drafted as a tree (acceptance is optimistic until
    measured); once its drafts are always rejected, and a node must be accepted 10% of
    the time to pay for a wider pass, the tree falls to no draft, with a one-node probe
    after explore_every rounds, then after twice as many (the probe left it off)."""
    dearer = CostCurve({1: 1.0, 2: 1.1, 32: 4.0})
    monkeypatch.setattr(PipelineContext, "cost_curve", lambda self: dearer)
    proposer = suffix_proposer(tiny_pipeline, memory_requests=0, explore_every=4)
    stream = [1, 2, 3] * 6
    proposer.begin(None)
    sizes = []
    for _ in range(60):
        draft = proposer.propose(_State(stream))
        sizes.append(len(draft))
        proposer.observe(None, _accept_nothing(draft))
    off = sizes.index(0)
    assert sizes[0] > 1 and off < 30
    probes = [i for i in range(off, 60) if sizes[i]]
    assert set(sizes[i] for i in probes) == {1}
    # probed after 4 rounds switched off, then 8, then 16 (each probe left it off)
    assert [b - a for a, b in zip([off - 1] + probes, probes)] == [4, 8, 16]


# ---------------------------------------------------------------- losslessness


@pytest.mark.parametrize("verifier", ["tree", "greedy"])
def test_greedy_output_equals_standard_with_memory(tiny_pipeline, verifier):
    pipeline = tiny_pipeline.with_components({"name": "suffix", "k": 4, "max_nodes": 10}, verifier)
    accepted = branched = 0
    for prompt in random_prompts(6, seed=13) * 2:  # the second pass finds the first in memory
        for max_new in (1, 7, 30):
            expected = tiny_pipeline.generate(prompt, max_new).tokens
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == expected, (verifier, prompt, max_new)
            accepted += result.stats.accepted
            branched += sum(size > 4 for size in result.stats.draft_sizes)
    assert accepted > 0 and (branched > 0) == (verifier == "tree")


SAMPLING = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)


def test_sampled_tree_decoding_has_standard_decodings_distribution(tmp_path):
    """Chi-square of 300 tree-verified samples of the first 3 tokens (one per seed, the
    memory growing from sample to sample) against the exact standard distribution."""
    from specdec.decoders import Pipeline

    config = ModelConfig(name="tiny-random", vocab_size=8, dtype="float64", device="cpu")
    model, _ = load_model(config)
    standard = Pipeline(model, None, sampling=SAMPLING, model_config=config, artifacts_dir=tmp_path)
    speculative = standard.with_components({"name": "suffix", "k": 3}, "tree", SAMPLING)
    prompt = [1, 5, 2, 7, 1, 5, 2, 3, 1, 5]
    expected = exact_distribution(standard.model, prompt, SAMPLING, 3)
    assert math.isclose(sum(expected.values()), 1.0, abs_tol=1e-6)
    observed = sample_outcomes(speculative, prompt, 3, range(300))
    positions = sequential_goodness_of_fit(observed, expected)
    assert sum(test.impossible for test in positions) == 0
    assert combined_p_value(positions) > 0.001, positions
    stats = speculative.generate(prompt, 4, seed=0).stats
    assert stats.proposed > 1 and stats.accepted > 0


# ------------------------------------------------------------------ the agentic workload


def test_agentic_workload_runs_families_in_order_with_first_requests_apart():
    from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload

    prompts = load_workload(WorkloadConfig(name="agentic"))
    families = list(dict.fromkeys(p.category.partition("/")[0] for p in prompts))
    assert len(families) == 4 and len(prompts) == 40
    for number, family in enumerate(families):
        block = prompts[number * 10 : (number + 1) * 10]
        assert [p.category for p in block] == [f"{family}/first"] + [f"{family}/later"] * 9
    assert len(load_workload(WorkloadConfig(name="agentic", limit=3))) == 4 * (1 + 3)


def test_stages_are_reported_over_every_family():
    from specdec.decoders.evaluation.metrics import Record, pipeline_entry

    def record(category: str, seconds: float, passes: int) -> Record:
        return Record("p", category, 0, 0, 10, seconds, [0] * 10, passes, 0, 0, 0.0, 0.0, [1] * passes)

    baseline = [record(c, 1.0, 10) for c in ("a/first", "a/later", "b/first", "b/later")]
    mine = [
        record("a/first", 1.0, 10),
        record("a/later", 0.5, 5),
        record("b/first", 1.0, 10),
        record("b/later", 0.25, 2),
    ]
    entry = pipeline_entry("suffix+tree", "speculative", "suffix", "tree", mine, baseline, True)
    assert entry["stages"]["first"]["speedup"] == pytest.approx(1.0)
    assert entry["stages"]["later"]["speedup"] == pytest.approx(20 / 0.75 / 10)
    assert set(entry["categories"]) == {"a/first", "a/later", "b/first", "b/later"}


def test_bench_runs_the_agentic_workload_in_order_and_reports_stages(tmp_path, monkeypatch):
    """The bench on workload=agentic (tiny model): results by stage and family, greedy
    output unchanged, and the suffix memory holds the measured requests only (the
    warm-up request is forgotten)."""
    from tests.bench_helpers import run_bench

    output = tmp_path / "results.json"
    overrides = [
        "model=tiny-random",
        "model.dtype=float64",
        "workload=agentic",
        "workload.limit=1",
        "experiment=suffix_vs_ngram",
        "bench.peers=false",
        "bench.max_new_tokens=8",
        "bench.plots=false",
        "logger=disabled",
        "bench.cost_cache=false",  # T(n) measured into the run directory, the user's cache left alone
        f"bench.output={output}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    run_bench(monkeypatch, overrides)
    payload = json.loads(output.read_text())
    entries = {e["name"]: e for e in payload["pipelines"]}
    assert (
        set(entries) == {"standard", "suffix+tree", "ngram+greedy", "standard (A/A)"}
        and payload["prompts"] == 8
    )
    suffix = entries["suffix+tree"]
    assert set(suffix["stages"]) == {"first", "later"} and len(suffix["categories"]) == 8
    assert suffix["identical_outputs"] == 1.0
    assert suffix["info"]["proposer"]["memory_requests"] == 8
