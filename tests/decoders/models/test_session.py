"""ModelSession: tree forward (mask, positions, logits), keep() compaction, truncate rollback.

Every tree check compares against the plain chain computation on a tiny float64
model: a tree node must see exactly the prefix and its ancestors, at position
prefix + depth, so its logits equal those of running its root-to-node path as a chain.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.decoders.models.loading import tiny_random_model
from specdec.decoders.models.session import ModelSession, tree_attention_mask

VOCAB = 40
TIGHT = {"rtol": 0.0, "atol": 1e-10}  # float64: only summation-order rounding differs
PREFIX = [3, 1, 4, 1, 5, 9, 2]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_random_model(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=0).double()


def chain_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab) logits of a fresh session run on ``tokens`` as a chain."""
    return ModelSession(model).forward(tokens)


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root level down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


HAND_BUILT_TREES = [
    [-1, 0, 0, -1, 3],  # two root children, one with two children
    [-1, -1, -1],  # three siblings
    [-1, 0, 1, 1, 0, 4, 5],  # uneven depths
    [-1, 0, 1, 2],  # a chain given with parents
]


def test_tree_attention_mask_of_a_hand_built_tree() -> None:
    parents = [-1, 0, 0, -1, 3]
    mask = tree_attention_mask(parents, prefix_len=2, dtype=torch.float64, device=torch.device("cpu"))
    assert mask.shape == (1, 1, 5, 7)
    allowed = (mask[0, 0] == 0).int().tolist()
    #            prefix  n0 n1 n2 n3 n4
    expected = [[1, 1, 1, 0, 0, 0, 0],
                [1, 1, 1, 1, 0, 0, 0],
                [1, 1, 1, 0, 1, 0, 0],
                [1, 1, 0, 0, 0, 1, 0],
                [1, 1, 0, 0, 0, 1, 1]]  # fmt: skip
    assert allowed == expected
    assert mask[0, 0, 0, 3].item() == torch.finfo(torch.float64).min


def test_tree_forward_passes_depth_positions_and_the_tree_mask(model) -> None:
    session = ModelSession(model)
    session.forward(PREFIX)
    seen: dict = {}
    decoder = session.decoder

    def recording_decoder(**kwargs):
        seen.update(kwargs)
        return decoder(**kwargs)

    session.decoder = recording_decoder
    parents = [-1, 0, 0, -1, 3, 4]
    session.forward([7, 8, 9, 10, 11, 12], parents)
    start = len(PREFIX)
    assert seen["position_ids"].tolist() == [[start + d for d in (0, 1, 1, 0, 1, 2)]]
    expected_mask = tree_attention_mask(parents, start, torch.float64, torch.device("cpu"))
    assert torch.equal(seen["attention_mask"], expected_mask)

    seen.clear()
    session.forward([13, 14, 15], [-1, 0, 1])  # a chain needs neither
    assert "position_ids" not in seen and "attention_mask" not in seen


@pytest.mark.parametrize(
    "parents", HAND_BUILT_TREES + [random_parents(10, random.Random(s)) for s in range(3)]
)
def test_every_tree_node_has_the_logits_of_its_path_run_as_a_chain(model, parents) -> None:
    rng = random.Random(len(parents))
    tokens = [rng.randrange(VOCAB) for _ in parents]
    session = ModelSession(model)
    session.forward(PREFIX)
    tree_logits = session.forward(tokens, parents)  # (n, vocab)
    assert session.cached == PREFIX + tokens
    for node in range(len(parents)):
        path = path_to(parents, node)
        expected = chain_logits(model, PREFIX + [tokens[i] for i in path])[-1]
        torch.testing.assert_close(tree_logits[node], expected, **TIGHT)


def test_a_tree_grown_over_several_passes_has_the_logits_of_its_paths(model) -> None:
    """Level-by-level growth (tree_start): later passes see only their own ancestors among
    the tree entries already cached, not the whole cache."""
    parents = [-1, -1, 0, 0, 1, 2, 4, 4]
    tokens = [30, 31, 32, 33, 34, 35, 36, 37]
    levels = [(0, 2), (2, 5), (5, 8)]  # node ranges fed per pass
    session = ModelSession(model)
    session.forward(PREFIX)
    tree_start = len(session)
    logits = torch.cat(
        [session.forward(tokens[a:b], parents[:b], tree_start=tree_start) for a, b in levels]
    )  # (8, vocab)
    for node in range(len(parents)):
        expected = chain_logits(model, PREFIX + [tokens[i] for i in path_to(parents, node)])[-1]
        torch.testing.assert_close(logits[node], expected, **TIGHT)
    session.keep(tree_start, [1, 4, 7])
    torch.testing.assert_close(
        session.forward([20]), chain_logits(model, PREFIX + [31, 34, 37, 20])[-1:], **TIGHT
    )
    with pytest.raises(ValueError, match="one parent per tree entry"):
        session.forward([1, 2], [-1, 0, 1], tree_start=len(session))


@pytest.mark.parametrize(
    "parents, accepted",
    [
        ([-1, 0, 0, -1, 3], [3, 4]),  # second branch: entries move down
        ([-1, 0, 0, -1, 3], [0, 2]),  # skips a sibling
        ([-1, 0, 0, -1, 3], [0]),
        ([-1, 0, 0, -1, 3], []),  # nothing accepted: only the pending token stays
        ([-1, 0, 1, 2], [0, 1, 2, 3]),  # everything accepted: nothing moves
    ],
)
def test_keep_leaves_the_cache_of_a_fresh_run_on_the_accepted_sequence(model, parents, accepted) -> None:
    pending = 6
    tokens = [11, 12, 13, 14, 15][: len(parents)]
    session = ModelSession(model)
    session.forward(PREFIX)
    start = len(session)
    # The decode loop's block: the pending token, then the draft nodes (shifted by one).
    session.forward([pending] + tokens, [-1] + [p + 1 for p in parents])
    session.keep(start, [0] + [node + 1 for node in accepted])

    committed = PREFIX + [pending] + [tokens[i] for i in accepted]
    assert session.cached == committed
    assert all(layer.keys.shape[2] == len(committed) for layer in session.cache.layers)
    next_tokens = [21, 22]
    torch.testing.assert_close(
        session.forward(next_tokens), chain_logits(model, committed + next_tokens)[-2:], **TIGHT
    )


def test_two_tree_rounds_with_keep_match_a_fresh_run(model) -> None:
    """A second tree pass on a compacted cache still sees the right prefix and positions."""
    session = ModelSession(model)
    session.forward(PREFIX)
    committed = list(PREFIX)
    for tokens, parents, accepted in [
        ([30, 31, 32, 33], [-1, -1, 1, 2], [1, 2]),
        ([34, 35, 36], [-1, 0, -1], [2]),
    ]:
        start = len(session)
        logits = session.forward(tokens, parents)
        for node in range(len(tokens)):
            path = path_to(parents, node)
            expected = chain_logits(model, committed + [tokens[i] for i in path])[-1]
            torch.testing.assert_close(logits[node], expected, **TIGHT)
        session.keep(start, accepted)
        committed += [tokens[i] for i in accepted]
        assert session.cached == committed


def test_truncate_rolls_back_to_a_fresh_run(model) -> None:
    session = ModelSession(model)
    session.forward(PREFIX + [10, 11, 12, 13])
    session.truncate(len(PREFIX) + 1)
    assert session.cached == PREFIX + [10]
    assert all(layer.keys.shape[2] == len(PREFIX) + 1 for layer in session.cache.layers)
    torch.testing.assert_close(
        session.forward([20, 21]), chain_logits(model, PREFIX + [10, 20, 21])[-2:], **TIGHT
    )
    session.truncate(100)  # past the end: a no-op
    assert session.cached == PREFIX + [10, 20, 21]


def test_growing_cache_matches_transformers_cache_through_rounds(model):
    """The in-place cache (decoders/models/kv_cache.py) gives the logits transformers'
    concatenating cache gives, through chain and tree passes, keep() and truncate(),
    past its first buffer's capacity; a cut is written over in place, not reallocated."""
    from transformers import DynamicCache

    from specdec.decoders.models.kv_cache import MIN_CAPACITY, GrowingLayer

    growing, plain = ModelSession(model), ModelSession(model)
    plain.cache = DynamicCache(config=model.config)
    assert all(type(layer) is GrowingLayer for layer in growing.cache.layers)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    torch.testing.assert_close(growing.forward(prompt), plain.forward(prompt), **TIGHT)
    parents = [-1, 0, 0, 1, 2]
    first_capacity = growing.cache.layers[0]._key_buffer.shape[-2]
    assert first_capacity >= MIN_CAPACITY
    while len(growing) < first_capacity + 10:  # crosses the first buffer's end
        start = len(growing)
        tokens = [rng.randrange(VOCAB) for _ in parents]
        torch.testing.assert_close(growing.forward(tokens, parents), plain.forward(tokens, parents), **TIGHT)
        kept = [0, 2]  # a path that is not a prefix of the pass: moved into place
        growing.keep(start, kept)
        plain.keep(start, kept)
        chain = [rng.randrange(VOCAB) for _ in range(3)]
        torch.testing.assert_close(growing.forward(chain), plain.forward(chain), **TIGHT)
        growing.truncate(len(growing) - 1)
        plain.truncate(len(plain) - 1)
    assert growing.cached == plain.cached
    layer = growing.cache.layers[0]
    assert layer._key_buffer.shape[-2] > first_capacity
    buffer = layer._key_buffer.data_ptr()
    growing.truncate(len(growing) - 5)
    growing.forward([1, 2])
    assert layer._key_buffer.data_ptr() == buffer and layer.keys.data_ptr() == buffer
