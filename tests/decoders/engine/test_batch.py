"""Batched decoding: one target pass per round over every request's block, each request's
output the one it gets alone (greedy: the same tokens; sampling: the target's distribution),
requests of different lengths, chains and trees, joining as others finish."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs
from specdec.decoders.models import native
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.session import ModelSession
from specdec.decoders.sizing.policy import SizingPolicy
from tests.conftest import lossless_verifiers, pipeline_or_skip, random_prompts, requires_cpu

BATCHABLE = [
    None,  # standard decoding, batched
    "ngram",
    "suffix",
    "draft_model",
    "copy_heads",
    {"name": "medusa", "tree": None, "tree_budget": None},
    {"name": "merge", "members": ["suffix", "ngram"]},
    {"name": "merge", "members": ["suffix", "copy_heads"], "fallback": 1},
    "eagle",  # reads the target's layers: the tap gives each request its rows of the packed pass
]


def prompts_of_many_lengths() -> list[list[int]]:
    """Repetitive prompts (drafts get accepted) of 6 to 60 tokens."""
    prompts = random_prompts(5, seed=11)
    return [prompt[: 6 + 13 * i] for i, prompt in enumerate(prompts)]


@pytest.fixture()
def base(trained_pipeline) -> Pipeline:
    return trained_pipeline


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("proposer", BATCHABLE, ids=str)
def test_each_request_decodes_as_it_would_alone(base, proposer, verifier, drafting_pays):
    """Greedy, float64: every request of a batch (sizes 1, 2 and 5 of 5 prompts of different
    lengths) gives the tokens decoding it alone gives; drafts were made and accepted."""
    pipeline = pipeline_or_skip(base, proposer, verifier)
    prompts = prompts_of_many_lengths()
    alone = [pipeline.generate(prompt, 24).tokens for prompt in prompts]
    for size in (1, 2, 5):
        batch = pipeline.generate_batch(prompts, 24, batch_size=size)
        assert [r.tokens for r in batch.results] == alone, size
        assert max(batch.stats.active) == size
        if proposer is not None:
            assert sum(r.stats.accepted for r in batch.results) > 0


def test_the_heads_draft_for_every_request_in_one_call_per_step(base, monkeypatch):
    """Copy heads in a batch draft together: a step of the heads runs once over the rows of
    every request that asks it (its vocabulary product read once), not once per request;
    alone, each step is a call of its own. Outputs are as alone (the test above)."""
    from specdec.proposers.medusa.heads import MedusaHeads

    calls: list[int] = []
    original = MedusaHeads.steps

    def steps(self, works):
        calls.append(len(works))
        return original(self, works)

    monkeypatch.setattr(MedusaHeads, "steps", steps)
    pipeline = pipeline_or_skip(base, "copy_heads", None)
    prompts = prompts_of_many_lengths()
    pipeline.generate(prompts[0], 8)
    assert set(calls) == {1}
    calls.clear()
    pipeline.generate_batch(prompts, 16, batch_size=5)
    assert max(calls) == 5 and sum(calls) > len(calls)


def test_requests_join_as_others_finish(base):
    """Continuous batching: 6 requests, at most 2 at once, the later ones arriving after the
    start: each joins once it has arrived and a place is free, and decodes as it would alone."""
    pipeline = base.with_components("ngram", "greedy")
    prompts = [prompt[: 5 + 7 * i] for i, prompt in enumerate(random_prompts(6, seed=5))]
    alone = [pipeline.generate(prompt, 20).tokens for prompt in prompts]
    arrivals = [0.0, 0.0, 0.0, 0.01, 0.02, 0.5]
    batch = pipeline.generate_batch(prompts, 20, batch_size=2, arrivals=arrivals)
    assert [result.tokens for result in batch.results] == alone
    assert max(batch.stats.active) == 2 and len(batch.stats.latencies) == 6
    assert batch.stats.wall_time >= 0.5  # the last one waited for its arrival
    assert all(latency > 0 for latency in batch.stats.latencies)


@pytest.mark.parametrize("verifier", [v for v in lossless_verifiers() if v != "greedy"])
def test_sampling_keeps_each_requests_distribution(base, verifier, drafting_pays):
    """T = 1: a request decoded in batches beside requests of other lengths (and other
    seeds) has the target's distribution: chi-square on its first two tokens."""
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    chain = {"name": "copy_heads", "tree": None, "tree_budget": None, "adaptive": False}
    heads = "copy_heads" if verifier == "tree" else chain
    pipeline = pipeline_or_skip(base, heads, verifier, sampling)
    probe = base.encode("Explain how")
    others = prompts_of_many_lengths()[1:3]
    samples, accepted = Counter(), 0
    for run in range(400):
        batch = pipeline.generate_batch([others[0], probe, others[1]], 3, seeds=[1000 + run, run, 2000 + run])
        samples[tuple(batch.results[1].tokens[:2])] += 1
        accepted += sum(r.stats.accepted for r in batch.results)
    assert accepted > 20
    session = ModelSession(base.model)
    first = processed_probs(session.forward(probe)[-1], sampling)
    expected = {}
    for t1 in first.nonzero().flatten().tolist():
        session.truncate(len(probe))
        second = processed_probs(session.forward([t1])[-1], sampling)
        for t2 in second.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(first[t1] * second[t2])
    assert set(samples) <= set(expected)
    cells = sorted(expected)
    total = sum(samples.values())
    predicted = [expected[c] * total for c in cells]
    scale = total / sum(predicted)  # the cells' probabilities sum to 1 up to rounding
    assert chisquare([samples[c] for c in cells], [p * scale for p in predicted]).pvalue > 1e-3


def passes_alone(target, prompts, blocks, parents) -> tuple[list[torch.Tensor], list]:
    """Each block's logits in a pass of its own after its prompt, and fresh sessions holding
    the prompts, for the packed pass to compare with."""
    alone = []
    for prompt, block, tree in zip(prompts, blocks, parents):
        session = target.session()
        session.forward(prompt, last_only=True)
        alone.append(session.forward(block, tree))
    sessions = [target.session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.forward(prompt, last_only=True)
    return alone, sessions


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float32"])
def test_a_packed_pass_gives_each_request_its_own_pass(dtype):
    """Model level: the logits of a packed pass over three requests (a tree, a single token,
    a chain; contexts of 100, 3 and 63 tokens) are those of their own passes: the very bits
    where the target runs exact mode, to rounding otherwise (float64: to 1e-12; the LM head
    runs over all the pass's rows, and BLAS rounds a product of few rows apart)."""
    target, _ = load_model(ModelConfig(name="tiny-random", dtype=dtype, device="cpu"))
    prompts = [[5, 6, 7, 8, 9] * 20, [1, 2, 3], [10, 11, 12, 13, 14, 15, 16] * 9]
    blocks, parents = [[3, 4, 5, 6], [7], [1, 2]], [[-1, 0, 0, 1], None, None]
    alone, sessions = passes_alone(target, prompts, blocks, parents)
    packed = target.packed_forward(sessions, blocks, parents)
    assert [len(s) for s in sessions] == [104, 4, 65]
    for got, expected in zip(packed, alone):
        if target.exact:
            assert torch.equal(got, expected)
        elif dtype == "float64":
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@requires_cpu("native_attention")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exact_mode_attends_to_every_request_of_a_packed_pass_in_one_call_a_layer(dtype, monkeypatch):
    target, _ = load_model(ModelConfig(name="tiny-random", dtype=dtype, device="cpu", exact="true"))
    prompts, blocks, parents = [[5, 6, 7] * 30, [1, 2, 3]], [[3, 4, 5], [7]], [[-1, 0, 0], None]
    alone, sessions = passes_alone(target, prompts, blocks, parents)
    calls = []
    many = native.attend_many
    monkeypatch.setattr(native, "attend", lambda *a: pytest.fail("a request's attention ran on its own"))
    monkeypatch.setattr(native, "attend_many", lambda *a: calls.append(len(a[2])) or many(*a))
    packed = target.packed_forward(sessions, blocks, parents)
    assert calls == [2] * len(target.layers())
    for got, expected in zip(packed, alone):
        assert torch.equal(got, expected)


def test_a_packed_pass_takes_input_embeddings_and_trees_grown_over_passes():
    """A feature-level drafter's passes (EAGLE's): blocks given as input embeddings, and a
    tree grown level by level (``tree_starts``, its parents covering the entries cached since
    it began). Packed, each request's logits and cache are those of its own passes (float64,
    to 1e-12); parents that do not cover the tree are refused in one line."""
    target, _ = load_model(ModelConfig(name="tiny-random", dtype="float64", device="cpu"))
    embed = target.input_embeddings()
    prompts = [[5, 6, 7, 8, 9] * 8, [1, 2, 3]]
    levels = [([3, 4], [-1, -1]), ([5, 6, 7], [-1, -1, 0, 0, 1])]  # (tokens, parents since the tree began)
    chained = [[9, 8], [4]]
    expected = []
    for prompt, tail in zip(prompts, chained):
        session = target.session()
        session.forward(prompt, last_only=True)
        outputs = [session.forward(tail, inputs_embeds=embed(torch.tensor(tail)) * 0.5)]
        tree_start = len(session)
        outputs += [session.forward(tokens, tree, tree_start) for tokens, tree in levels]
        expected.append((outputs, session.cache.layers[0].keys.clone()))
    sessions = [target.session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.forward(prompt, last_only=True)
    got = [
        target.packed_forward(
            sessions, chained, [None, None], inputs_embeds=[embed(torch.tensor(t)) * 0.5 for t in chained]
        )
    ]
    starts = [len(session) for session in sessions]
    for tokens, tree in levels:
        got.append(target.packed_forward(sessions, [tokens, tokens], [tree, tree], tree_starts=starts))
    for i, (outputs, keys) in enumerate(expected):
        for packed, alone in zip([step[i] for step in got], outputs):
            torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sessions[i].cache.layers[0].keys, keys, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="parents has 2 entries but the tree holds 5 cached and 1 new"):
        target.packed_forward(sessions, [[1], [1]], [[-1, 0], [-1, 0]], tree_starts=starts)


def test_what_cannot_batch_says_so_in_one_line(base):
    pipeline = pipeline_or_skip(base, {"name": "early_exit", "exit_layer": 1}, "greedy")
    with pytest.raises(ValueError, match="reads the target's inner layers.*one at a time"):
        pipeline.generate_batch([[1, 2, 3]], 4)
    gated = base.with_components("ngram", "greedy", round_gate=True)
    with pytest.raises(ValueError, match="round_gate=false"):
        gated.generate_batch([[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        base.with_components("ngram", "greedy").generate_batch([[1, 2, 3]], 4, batch_size=0)


def test_drafts_shrink_then_stop_as_the_batch_makes_the_pass_dearer(tiny_model, tiny_config):
    """Sizing that knows the batch: under a T(n) flat to 8 rows then steep, a chain
    proposer drafts wherever it finds a match alone and in a batch of 2, and (probes aside)
    nothing in batches of 8 and 16, whose requests' own rows already fill the flat part:
    each draft is weighed by the whole pass's tokens per second."""
    model, tokenizer = tiny_model
    curve = CostCurve({1: 1.0, 8: 1.0, 9: 2.0, 64: 57.0})
    pipeline = Pipeline(
        model, tokenizer, "ngram", "greedy", model_config=tiny_config, max_new_tokens=32,
        sizing=SizingPolicy(lambda: curve),
    )  # fmt: skip
    prompts = random_prompts(16, seed=2)
    drafted = {}
    for size in (1, 2, 8, 16):
        batch = pipeline.generate_batch(prompts[:size], 32)
        drafted[size] = sum(batch.stats.drafted) / sum(batch.stats.active)  # per request per pass
    assert drafted[1] > 0.5 and drafted[2] > 0.5
    assert drafted[8] < 0.1 and drafted[16] < 0.1


def test_a_batch_sizes_by_and_teaches_the_packed_passes_curve(tiny_model, tiny_config):
    """A packed pass over B requests costs more than one request's pass of as many rows, so a
    batch's sizing reads the T(n) of packed passes over B requests (the policy's
    ``batch_curve``) and its passes teach that live curve only: the single requests decoded
    after it are sized by their own passes' curve, as before the batch. Here the batch's
    curve is steep from its first extra row, so (probes aside) nothing is drafted in a batch
    of 4, while the same pipeline drafts alone, before and after it."""
    model, tokenizer = tiny_model
    flat = CostCurve({1: 1.0, 64: 1.0})
    steep = CostCurve({1: 1.0, 64: 64.0})
    asked = []

    def batch_curve(requests: int) -> CostCurve:
        asked.append(requests)
        return steep

    policy = SizingPolicy(lambda: flat, batch_curve=batch_curve)
    pipeline = Pipeline(
        model, tokenizer, "ngram", "greedy", model_config=tiny_config, max_new_tokens=32, sizing=policy
    )
    prompts = random_prompts(4, seed=2)

    def drafted_alone() -> float:  # draft tokens per pass
        stats = [pipeline.generate(p, 32).stats for p in prompts]
        return sum(s.proposed for s in stats) / sum(s.target_passes for s in stats)

    before = drafted_alone()
    batch = pipeline.generate_batch(prompts, 32)
    after = drafted_alone()
    assert 4 in asked and set(asked) <= {1, 2, 3, 4}
    assert sum(batch.stats.drafted) / sum(batch.stats.active) < 0.1  # probes aside
    assert before > 0.5 and after > 0.5

    target = pipeline.target  # the live curves: packed passes recorded apart, by requests per pass
    alone, packed = target.pass_times(flat), target.pass_times(flat, requests=4)
    assert alone is not packed and target.pass_times(flat, requests=2) is not packed
    pipeline.generate_batch(prompts, 8)
    assert packed.passes > 0 and alone.passes == 0


def test_constrained_requests_decode_as_they_would_alone(base, drafting_pays):
    """Each request of a batch under its own constraint (a JSON schema, a regex, none), drafted
    by the grammar proposer merged with the copy heads: the tokens it gets alone."""
    from tests.decoders.engine.test_constraint import SCHEMA

    pipeline = base.with_components({"name": "merge", "members": ["grammar", "copy_heads"]}, "tree")
    prompts = random_prompts(3, seed=4)
    specs = [{"json_schema": SCHEMA}, {"regex": "([a-c]{1,3}(yes|no);)+"}, None]
    constraints = [pipeline.constraint(spec) if spec else None for spec in specs]
    alone = [pipeline.generate(p, 30, constraint=c).tokens for p, c in zip(prompts, constraints)]
    batch = pipeline.generate_batch(prompts, 30, constraints=constraints)
    assert [result.tokens for result in batch.results] == alone
    assert sum(result.stats.accepted for result in batch.results) > 0


class _PlainGate:
    """A batch gate that keeps every round plain."""

    def drafts(self, requests: int, draining=None) -> bool:
        return False

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        assert not drafted and tokens >= 1 and seconds > 0


class _WatchingGate:
    """A batch gate that drafts every round and keeps what each round told it."""

    def __init__(self) -> None:
        self.told: list = []

    def drafts(self, requests: int, draining=None) -> bool:
        self.told.append((requests, draining))
        return True

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        pass


def test_the_batch_gate_is_told_each_request_outlook_once_none_waits_to_join(base):
    """While a request waits for a place, the gate gets no outlook; once every request has
    joined (the batch drains), each active request's tokens left and what its drafted rounds
    gave, as its own counters say."""
    pipeline = base.with_components("suffix", "tree")
    pipeline.batch_gate = gate = _WatchingGate()
    prompts = prompts_of_many_lengths()
    batch = pipeline.generate_batch(prompts, 16, batch_size=2)
    told = [outlook for _, outlook in gate.told]
    start = next(i for i, outlook in enumerate(told) if outlook is not None)
    assert start > 0 and all(o is None for o in told[:start])  # 5 requests, 2 places: some wait
    assert all(o is not None for o in told[start:])  # once draining, always draining
    first = told[start]
    assert len(first) == gate.told[start][0] and all(0 < o.remaining <= 16 for o in first)
    assert all(o.drafted_tokens >= o.drafted_rounds for o in first)
    assert [o.drafted_rounds > 0 for o in first].count(False) == 1  # the one that just joined
    assert len(told[-1]) == 1 and told[-1][0].remaining >= 1  # the last request, alone
    stats = [r.stats for r in batch.results]
    assert all(s.drafted_rounds == s.target_passes for s in stats)  # every round drafted
    assert sum(s.drafted_round_tokens for s in stats) == sum(sum(s.emitted_per_round) for s in stats)


def test_rounds_the_batch_gate_keeps_plain_are_standard_decoding_steps(base):
    """A round the batch gate keeps plain drafts nothing for any request (the proposer told,
    as under the round gate) and each request still gets the tokens it gets alone."""
    pipeline = base.with_components("copy_heads", "tree")
    prompts = prompts_of_many_lengths()[:3]
    alone = [pipeline.generate(p, 20).tokens for p in prompts]
    assert pipeline.batch_gate is None  # the tests' T(n) is fixed: nothing is timed, no gate
    pipeline.batch_gate = _PlainGate()
    batch = pipeline.generate_batch(prompts, 20)
    assert [result.tokens for result in batch.results] == alone
    assert batch.stats.plain_rounds == batch.stats.rounds > 0 and sum(batch.stats.drafted) == 0
    assert all(result.stats.proposed == 0 for result in batch.results)
