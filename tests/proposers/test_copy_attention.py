"""Copy heads: the pointer's mixture, the request memory the proposer keeps across
verification passes, and the whole-sequence training rows."""

from __future__ import annotations

import pytest
import torch

from specdec.decoders.models.session import ModelSession
from specdec.proposers.copy_attention import ContextMemory, CopyAttention, mixture
from specdec.train.data import Sequence
from specdec.train.medusa import IGNORE, head_inputs, sequence_views, training_rows
from tests.conftest import random_prompts
from tests.train.test_train import train_tiny_medusa


def entries_of(heads, hidden: torch.Tensor, text: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0 .. len(text) - 2 computed in one go (not through
    ContextMemory): hidden (len(text) - 1, hidden) the target's states there."""
    before = torch.cat([hidden.new_zeros(1, hidden.shape[-1]), hidden[:-1]])
    tokens = torch.tensor(text)
    return heads.copy.entries(
        before, heads.embed(tokens[:-1], hidden.dtype), hidden, heads.embed(tokens[1:], hidden.dtype)
    )


def test_mixture_is_a_distribution_that_gives_the_pointer_its_share():
    head = torch.softmax(torch.randn(3, 5, dtype=torch.float64), -1)  # (R, n)
    draft_vocab = torch.tensor([1, 4, 7, 8, 9])
    weights = torch.softmax(torch.randn(3, 6, dtype=torch.float64), -1)  # (R, L)
    gate = torch.tensor([[0.2], [0.9], [1.0]], dtype=torch.float64)
    following = torch.tensor([2, 2, 4, 11, 0, 4])  # outside the draft vocabulary too
    probs = mixture(head, weights, gate, following, 12, draft_vocab)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    expected_2 = (1 - gate[:, 0]) * (weights[:, 0] + weights[:, 1])
    torch.testing.assert_close(probs[:, 2], expected_2)
    expected_4 = gate[:, 0] * head[:, 1] + (1 - gate[:, 0]) * (weights[:, 2] + weights[:, 5])
    torch.testing.assert_close(probs[:, 4], expected_4)
    assert probs[2, 11] == 0  # gate 1: the head alone


def test_memory_rows_are_the_draft_vocabulary_then_the_contexts_new_tokens():
    """Copy heads draft over the draft vocabulary plus the context's tokens: the
    mixture over those rows is the whole-vocabulary mixture restricted to its support."""
    torch.manual_seed(3)
    embeddings = torch.nn.Embedding(20, 8).double()
    attention = CopyAttention(8, num_heads=1, width=4).double()
    draft_vocab = torch.tensor([3, 0, 7])
    memory = ContextMemory(attention, embeddings, draft_vocab)
    tokens = [5, 0, 11, 5, 3, 11, 9]
    memory.extend(torch.randn(4, 8, dtype=torch.float64), tokens[:4], tokens[1:5])
    memory.extend(torch.randn(2, 8, dtype=torch.float64), tokens[4:6], tokens[5:7])
    # rows 0-2: the draft vocabulary; then 11, 5, 9 in order of first appearance as an x_(j+1)
    assert memory.vocab.tolist() == [3, 0, 7, 11, 5, 9]
    assert memory.token_ids(memory.following_rows).tolist() == tokens[1:7]
    head = torch.softmax(torch.randn(2, 3, dtype=torch.float64), -1)
    weights = torch.softmax(torch.randn(2, 6, dtype=torch.float64), -1)
    gate = torch.tensor([[0.3], [0.7]], dtype=torch.float64)
    rows = mixture(head, weights, gate, memory.following_rows, memory.rows)  # (2, 6)
    whole = mixture(head, weights, gate, memory.following, 20, draft_vocab)  # (2, 20)
    torch.testing.assert_close(memory.full_rows(rows), whole)
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, dtype=torch.float64))
    everything = ContextMemory(attention, embeddings)  # heads over every token: rows are ids
    everything.extend(torch.randn(6, 8, dtype=torch.float64), tokens[:6], tokens[1:7])
    assert everything.vocab is None and torch.equal(everything.following_rows, everything.following)


@torch.no_grad()
def test_a_fresh_pointer_looks_for_the_same_token():
    torch.manual_seed(0)
    embeddings = torch.nn.Embedding(50, 32).double()
    attention = CopyAttention(32, num_heads=2, width=16).double()
    memory = ContextMemory(attention, embeddings)
    tokens = [5, 9, 3, 7, 1, 8]  # x_j; 3 sits at position 2 and is followed by 7
    hidden = torch.randn(len(tokens), 32, dtype=torch.float64)
    memory.extend(hidden, tokens, tokens[1:] + [3])
    state = torch.randn(1, 32, dtype=torch.float64)
    weights, gate = attention.point(0, state, embeddings(torch.tensor([3])), memory.keys, memory.values)
    assert int(weights.argmax()) == 2 and float(weights[0, 2]) > 0.5
    assert 0.8 < float(gate) < 0.85  # a fresh gate leaves most of the mass to the head
    empty = ContextMemory(attention, embeddings)
    weights, gate = attention.point(1, state, embeddings(torch.tensor([3])), empty.keys, empty.values)
    assert weights.shape == (1, 0) and float(gate) == 1.0


def test_memory_grown_in_pieces_equals_one_pass():
    torch.manual_seed(1)
    embeddings = torch.nn.Embedding(40, 16).double()
    attention = CopyAttention(16, num_heads=1, width=8).double()
    tokens = torch.randint(40, (11,)).tolist()
    hidden = torch.randn(10, 16, dtype=torch.float64)
    whole = ContextMemory(attention, embeddings)
    whole.extend(hidden, tokens[:10], tokens[1:])
    pieces = ContextMemory(attention, embeddings)
    for start, end in [(0, 4), (4, 5), (5, 10)]:
        pieces.extend(hidden[start:end], tokens[start:end], tokens[start + 1 : end + 1])
    assert len(pieces) == 10
    torch.testing.assert_close(pieces.keys, whole.keys)
    torch.testing.assert_close(pieces.values, whole.values)
    assert torch.equal(pieces.following, whole.following)
    with pytest.raises(ValueError, match="hidden states"):
        pieces.extend(hidden[:2], tokens[:3], tokens[1:4])


def test_a_batchs_memories_are_stored_together_as_each_alone():
    """A batch stores every request's committed positions in one product per projection
    (``MemoryStore``): each memory ends as it would extended alone, rows and all, and a
    request with nothing new is left as it was."""
    from specdec.decoders.engine.drafting import DraftClock, draft_together
    from specdec.proposers.copy_attention import MemoryStore

    torch.manual_seed(2)
    embeddings = torch.nn.Embedding(40, 16).double()
    attention = CopyAttention(16, num_heads=1, width=8).double()
    draft_vocab = torch.arange(0, 40, 3)
    texts = [torch.randint(40, (n + 1,)).tolist() for n in (6, 1, 9)]
    hiddens = [torch.randn(len(t) - 1, 16, dtype=torch.float64) for t in texts]
    alone = [ContextMemory(attention, embeddings, draft_vocab) for _ in texts]
    together = [ContextMemory(attention, embeddings, draft_vocab) for _ in texts]
    for memory in alone + together:  # each holds a first piece already
        memory.extend(hiddens[0][:2], texts[0][:2], texts[0][1:3])
    for memory, hidden, text in zip(alone, hiddens, texts):
        memory.extend(hidden, text[:-1], text[1:])
    works = [MemoryStore(m, h, t[:-1], t[1:]) for m, h, t in zip(together, hiddens, texts)]
    works.append(MemoryStore(together[0], hiddens[0][:0], [], []))  # nothing new
    steps = [(yield_once(work)) for work in works]
    draft_together(steps, [DraftClock() for _ in steps])
    for mine, expected in zip(together, alone):
        torch.testing.assert_close(mine.keys, expected.keys)
        torch.testing.assert_close(mine.values, expected.values)
        assert torch.equal(mine.following, expected.following)
        assert torch.equal(mine.following_rows, expected.following_rows)
        assert torch.equal(mine.vocab, expected.vocab) and mine.rows == expected.rows
        torch.testing.assert_close(mine.last_hidden, expected.last_hidden)


def yield_once(work):
    yield work


@pytest.fixture(scope="module")
def copy_artifacts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("copy")
    train_tiny_medusa(directory, ("drafter.copy_width=16",))
    return directory


@pytest.mark.parametrize(
    ("proposer", "verifier"),
    [({"name": "medusa"}, "greedy"), ({"name": "medusa", "tree": "auto"}, "tree")],
    ids=["chain", "tree"],
)
def test_the_proposers_memory_matches_the_committed_text(
    drafting_pays, tiny_model, tiny_config, copy_artifacts, proposer, verifier
):
    """After speculative rounds (accepted paths compacted out of trees), the memory holds
    exactly the keys and values a single target pass over the committed text gives."""
    from specdec.decoders import Pipeline

    model, tokenizer = tiny_model
    base = Pipeline(
        model, tokenizer, model_config=tiny_config, artifacts_dir=copy_artifacts, max_new_tokens=32
    )
    pipeline = base.with_components(proposer, verifier)
    heads = pipeline.proposer.heads
    for prompt in random_prompts(2, seed=5):
        result = pipeline.generate(prompt, 30)
        assert result.stats.accepted > 0
        memory = pipeline.proposer.memory
        committed = len(memory)
        text = list(prompt) + result.tokens
        assert len(prompt) < committed < len(text)
        session = ModelSession(model)
        session.forward(text[:committed])
        keys, values = entries_of(heads, session.hidden, text[: committed + 1])
        torch.testing.assert_close(memory.keys, keys)
        torch.testing.assert_close(memory.values, values)
        assert memory.following.tolist() == text[1 : committed + 1]


def test_whole_sequence_rows_are_the_position_rows():
    """The copy heads' rows (whole sequences) hold the same head inputs, labels and
    hidden states as the per-position rows other heads train on, plus a causal mask."""
    torch.manual_seed(2)
    sequences = []
    for i, (prompt_len, response_len) in enumerate([(3, 6), (5, 2), (1, 4)]):
        tokens = torch.randint(100, (prompt_len + response_len,)).tolist()
        hidden = torch.randn(prompt_len + response_len - 1, 8)  # positions 0 .. L-2
        sequences.append(
            (
                Sequence(
                    f"s{i}", "x", tokens[:prompt_len], tokens[prompt_len:], hidden[prompt_len - 1 :].half()
                ),
                hidden,
            )
        )
    length = max(len(s.prompt) + len(s.response) for s, _ in sequences)
    batch = {
        "tokens": torch.zeros(3, length, dtype=torch.long),
        "hidden": torch.zeros(3, length - 1, 8, dtype=torch.float16),
        "prompt_len": torch.tensor([len(s.prompt) for s, _ in sequences]),
        "length": torch.tensor([len(s.prompt) + len(s.response) for s, _ in sequences]),
    }
    for i, (s, hidden) in enumerate(sequences):
        n = len(s.prompt) + len(s.response)
        batch["tokens"][i, :n] = torch.tensor(s.prompt + s.response)
        batch["hidden"][i, : n - 1] = hidden.half()
    view = sequence_views(batch, num_heads=3)
    valid = view["labels"][..., 0] != IGNORE
    rows = training_rows([s for s, _ in sequences], 3)
    assert torch.equal(view["labels"][valid], rows["labels"])
    assert torch.equal(view["inputs"][valid], head_inputs(rows))
    torch.testing.assert_close(view["hidden"][valid], rows["hidden"].float())
    # the first sequence's first query (t = 2) may read positions 0..2 only
    assert view["mask"][0, 0].tolist()[: length - 1] == [True, True, True] + [False] * (length - 4)
    # the second sequence (5 + 2 tokens) has one query; padding is never read
    assert view["mask"][1, 0].tolist() == [True] * 5 + [False] * (length - 6)


def test_distilling_on_the_targets_distribution(tiny_model, tmp_path):
    """drafter.distill_weight: the target's distributions are read at the position before
    each label (its top tokens, renormalised), so a one-hot distribution on the label gives
    the labels' loss exactly; the recipe trains end to end with it."""
    from specdec.proposers.medusa.artifact import load_artifact
    from specdec.train.medusa import copy_loss, target_distributions

    model, _ = tiny_model
    directory = train_tiny_medusa(tmp_path, ("drafter.copy_width=16", "drafter.distill_weight=0.5"))
    lm_head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    artifact = load_artifact(directory, lm_head, embeddings)
    heads = artifact.heads
    assert heads.copy is not None
    sampled = artifact.meta["metrics"]["sampled_acceptance"]  # T=1 acceptance per head, held out
    assert len(sampled) == heads.num_heads and all(0 < a <= 1 for a in sampled)
    torch.manual_seed(3)
    prompt_lens, lengths = torch.tensor([3, 5, 1]), torch.tensor([9, 7, 5])
    length = int(lengths.max())
    hidden = torch.randn(3, length - 1, lm_head.weight.shape[1], dtype=torch.float64)
    batch = {
        "tokens": torch.randint(heads.vocab_size, (3, length)),
        "hidden": hidden.half(),
        "prompt_len": prompt_lens,
        "length": lengths,
    }
    soft = target_distributions(lm_head, batch, top=4)
    expected = torch.softmax(lm_head(batch["hidden"][0, 2:8].double()), -1).topk(4, dim=-1)
    assert torch.equal(soft["soft_ids"][0, 2:8].long(), expected.indices)
    torch.testing.assert_close(
        soft["soft_probs"][0, 2:8].double(),
        expected.values / expected.values.sum(-1, keepdim=True),
        atol=1e-3,
        rtol=1e-3,
    )
    assert not soft["soft_probs"][0, :2].any() and not soft["soft_probs"][1, 6:].any()  # prompt, padding
    # one-hot on the token that follows each position: the labels' own loss
    one_hot = {
        "soft_ids": torch.cat(
            [batch["tokens"][:, 1:, None], torch.zeros(3, length - 1, 3, dtype=torch.long)], -1
        ),
        "soft_probs": torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(3, length - 1, 4).half(),
    }
    weights = torch.tensor([0.8**k for k in range(heads.num_heads)])
    labels_only, _ = copy_loss(heads, heads, weights)(batch)
    distilled, _ = copy_loss(heads, heads, weights, distill_weight=1.0)({**batch, **one_hot})
    torch.testing.assert_close(distilled, labels_only)
    shifted = {**one_hot, "soft_ids": one_hot["soft_ids"].roll(1, dims=1)}  # read one position off
    off, _ = copy_loss(heads, heads, weights, distill_weight=1.0)({**batch, **shifted})
    assert not torch.allclose(off, labels_only)
