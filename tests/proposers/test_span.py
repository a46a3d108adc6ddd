"""Span lookup (proposers/span.py): the prompt's text copied whatever its tokenisation, and
under a constraint, branches that close a JSON string (the engine then appends the next key)."""

from __future__ import annotations

import pytest

from specdec.decoders.engine.registry import build, proposer_registry
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.state import DecodeState

PROMPT = "The station is in Tartu, Estonia, by the river."
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def state_after(pipeline, generated: str, grammar=None) -> DecodeState:
    tokenizer = pipeline.tokenizer
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    output = tokenizer.encode(generated, add_special_tokens=False)
    state = DecodeState(prompt + output, len(prompt), SamplingConfig(), SamplingConfig().generator(), None)
    state.grammar = grammar
    return state


def span_proposer(pipeline, **options):
    return build(proposer_registry, {"name": "span", **options}, context=pipeline.context)


def text(pipeline, tokens: list[int]) -> str:
    return pipeline.tokenizer.decode(tokens)


def test_a_tail_is_matched_as_text_and_its_continuation_tokenised_afresh(tiny_pipeline):
    proposer = span_proposer(tiny_pipeline, k=6, adaptive=False)
    state = state_after(tiny_pipeline, '{"city": "Tar')  # the prompt spells it " Tartu"
    proposer.begin(state)
    draft = proposer.propose(state)
    assert draft.is_chain and text(tiny_pipeline, draft.tokens) == "tu, Es"
    short = state_after(tiny_pipeline, '{"city": "T')  # too short alone: the latest word it starts
    proposer.begin(short)
    assert text(tiny_pipeline, proposer.propose(short).tokens) == "artu, "
    nothing = state_after(tiny_pipeline, '{"city": "Zq')
    proposer.begin(nothing)
    assert len(proposer.propose(nothing)) == 0


def test_under_a_constraint_the_span_branches_into_the_string_s_end_and_the_next_key(tiny_pipeline):
    grammar = tiny_pipeline.constraint({"json_schema": SCHEMA}).start()
    generated = '{"city": "Tar'
    grammar.advance(tiny_pipeline.tokenizer.encode(generated, add_special_tokens=False))
    proposer = span_proposer(tiny_pipeline, k=6, endings=1, adaptive=False)
    state = state_after(tiny_pipeline, generated, grammar)
    proposer.begin(state)
    draft = proposer.propose(state)
    kept = grammar.extend_forced(grammar.prune(draft), 16)
    paths = {text(tiny_pipeline, [kept.tokens[n] for n in path]) for path in leaf_paths(kept)}
    # the span as the prompt goes on, and the value ended after "tu" with the next key forced
    assert "tu, Es" in paths and 'tu", "country": "' in paths
    assert not any('"}' in path or '"]' in path for path in paths)  # closings the schema forbids: cut


def test_an_ending_is_valued_by_how_often_values_ended_at_its_boundary(tiny_pipeline):
    """An ending branch's value is its boundary's survival times the measured share of
    rounds in which the value ended there; a span node's is its survival alone. Rounds
    whose ending the target rejected lower the endings' values, not the span's."""
    from specdec.decoders.engine.draft import Round

    grammar = tiny_pipeline.constraint({"json_schema": SCHEMA}).start()
    generated = '{"city": "Tar'
    grammar.advance(tiny_pipeline.tokenizer.encode(generated, add_special_tokens=False))
    proposer = span_proposer(tiny_pipeline, k=6, endings=1)
    state = state_after(tiny_pipeline, generated, grammar)
    proposer.begin(state)

    def ending(draft) -> int:  # the first ending's first node: the first off the span's chain
        return next(i for i in range(1, len(draft)) if draft.parents[i] != i - 1)

    def ending_value(draft) -> tuple[float, float]:
        first = ending(draft)
        parent = draft.parents[first]
        return draft.values[first], (draft.values[parent] if parent >= 0 else 1.0)

    draft = proposer.propose(state)
    value, boundary = ending_value(draft)
    assert value == pytest.approx(boundary * 0.5)  # the prior: one in two
    for _ in range(6):  # the span goes on past its boundary; the ending was tried and rejected
        draft = proposer.propose(state)
        span = list(range(ending(draft)))
        tried = span + [ending(draft)]  # (the grammar keeps one closing: the others are not tried)
        proposer.observe(state, Round(draft, span, tried, [0] * 7))
    value, boundary = ending_value(proposer.propose(state))
    assert value == pytest.approx(boundary * 1 / 8)


def leaf_paths(draft) -> list[list[int]]:
    paths = []
    for node in range(len(draft)):
        if not draft.children[node + 1]:
            path, at = [], node
            while at >= 0:
                path.append(at)
                at = draft.parents[at]
            paths.append(path[::-1])
    return paths


def test_span_needs_a_tokenizer_and_sane_options(tiny_pipeline):
    with pytest.raises(ValueError, match="min_chars"):
        span_proposer(tiny_pipeline, min_chars=0)
    context = tiny_pipeline.context
    context.tokenizer, saved = None, context.tokenizer
    try:
        with pytest.raises(ValueError, match="needs the model's tokenizer"):
            span_proposer(tiny_pipeline)
    finally:
        context.tokenizer = saved
