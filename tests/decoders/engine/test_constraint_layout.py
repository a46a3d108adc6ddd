"""Layout tokens under a constraint (:class:`specdec.decoders.engine.constraint.LayoutHabits`):
forced bytes no forced token covers (the `` "`` before a string value, where `` "a`` is a token
too) are drafted as the token the target wrote there before, valued at its measured share, and
constrained greedy decoding stays identical with them in the draft."""

from __future__ import annotations

import pytest

from specdec.decoders import Pipeline
from tests.conftest import random_prompts


def merged_byte_tokenizer():
    """The tiny byte tokenizer plus merged tokens `` "`` (259), `` "a`` (260) and `` "b`` (261),
    so a string value's opening `` "`` is a layout token: forced bytes no forced token covers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdec.decoders.models.loading import _byte_level_chars

    chars = _byte_level_chars()
    space, quote = chars[ord(" ")], chars[ord('"')]
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258, space + quote: 259})
    vocab.update({space + quote + "a": 260, space + quote + "b": 261})
    merges = [(space, quote), (space + quote, "a"), (space + quote, "b")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


LAYOUT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "tag": {"enum": ["bc", "cb"]}},
    "required": ["name", "tag"],
    "additionalProperties": False,
}


@pytest.fixture()
def layout_pipeline(tiny_model, tiny_config, tmp_path) -> Pipeline:
    model, _ = tiny_model
    return Pipeline(
        model, merged_byte_tokenizer(), model_config=tiny_config, artifacts_dir=tmp_path / "artifacts"
    )


def test_a_layout_token_follows_the_forced_tokens_valued_by_what_the_target_wrote(layout_pipeline):
    """`` "`` after ``"name":`` is not forced (`` "a`` could follow), so the continuation adds
    the token spelling those bytes (one in two before anything is seen); once the target
    wrote `` "a`` there twice and `` "b`` once, `` "a`` comes first, at (2 + 1) / (3 + 2); where
    the grammar rejects it (before the enum ``bc`` or ``cb``), `` "b`` at (1 + 1) / 5, and the
    tokens it then forces at the same value."""
    tokenizer = merged_byte_tokenizer()
    constraint = layout_pipeline.constraint({"json_schema": LAYOUT_SCHEMA})
    key = tokenizer.encode('{"name":', add_special_tokens=False)
    grammar = constraint.start()
    tokens, values = grammar.continuation(16)
    assert tokens == key + [259] and values == [1.0] * len(key) + [0.5]
    for value in ('"ab", "tag": "bc"}', '"ab", "tag": "bc"}', '"bb", "tag": "bc"}'):
        grammar = constraint.start()  # a request writing the value with `` "a`` or `` "``
        grammar.continuation(16)
        grammar.advance(tokenizer.encode('{"name": ' + value, add_special_tokens=False))
    tokens, values = constraint.start().continuation(16)
    assert tokens == key + [260] and values[-1] == pytest.approx(3 / 5)
    grammar = constraint.start()
    grammar.advance(tokenizer.encode('{"name": "bb", "tag":', add_special_tokens=False))
    tokens, values = grammar.continuation(16)
    assert tokenizer.decode(tokens) == ' "bc"}' and tokens[0] == 261
    assert values == [pytest.approx(2 / 5)] * len(tokens)


@pytest.mark.parametrize(
    ("proposer", "verifier"),
    [("grammar", "greedy"), ({"name": "merge", "members": ["grammar", "ngram"]}, "tree")],
)
def test_layout_tokens_keep_constrained_greedy_identical(layout_pipeline, proposer, verifier):
    pipeline = layout_pipeline.with_components(proposer, verifier)
    constraint = layout_pipeline.constraint({"json_schema": LAYOUT_SCHEMA})
    drafted_layout = 0
    for prompt in random_prompts(4, seed=11):
        expected = layout_pipeline.generate(prompt, 40, constraint=constraint).tokens
        result = pipeline.generate(prompt, 40, constraint=constraint)
        assert result.tokens == expected
        drafted_layout += result.stats.proposed
    assert drafted_layout > 0
