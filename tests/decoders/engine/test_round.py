"""The round contract: a proposer sees its own draft and its accepted path in that
draft's numbering, whatever the engine and the verifier pruned, with the engine's times."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import build, verifier_registry
from specdec.decoders.engine.verifier import Verifier
from tests.conftest import random_prompts


class OracleTree(Proposer):
    """Knows the target's greedy output; drafts [good, wrong, wrong's child, good's child]
    (parents [-1, -1, 1, 0]): the principal path is nodes 0 and 3, so a chain verifier's
    view renumbers node 3 as 1."""

    name = "oracle_tree"

    @dataclass
    class Config:
        pass

    def __init__(self, expected: list[int], prompt_len: int, vocab: int) -> None:
        super().__init__(self.Config(), None)
        self.expected, self.prompt_len, self.vocab = expected, prompt_len, vocab
        self.rounds: list[Round] = []
        self.drafts: list[Draft] = []

    def propose(self, state) -> Draft:
        done = len(state.tokens) - self.prompt_len  # the pending token is expected[done - 1]
        good = self.expected[done : done + 2] + [0, 0]
        wrong = (good[0] + 1) % self.vocab
        draft = Draft([good[0], wrong, wrong, good[1]], [-1, -1, 1, 0])
        self.drafts.append(draft)
        return draft

    def observe(self, state, round: Round) -> None:
        self.rounds.append(round)


class RebuildingGreedy(Verifier):
    """A chain verifier whose prepare builds a new draft (no selection to map back)."""

    name = "rebuilding"
    inner = None

    def prepare(self, draft: Draft) -> Draft:
        chain = draft.as_chain()
        return Draft(list(chain.tokens), list(chain.parents), chain.draft_probs)

    def verify(self, draft, target_logits, sampling, generator):
        return self.inner.verify(draft, target_logits, sampling, generator)


@pytest.mark.parametrize("verifier", ["tree", "greedy", "rebuilding"])
def test_observe_gets_the_path_in_the_proposers_numbering(tiny_pipeline, verifier):
    prompt = random_prompts(1, seed=5)[0]
    max_new = 9
    expected = tiny_pipeline.generate(prompt, max_new).tokens
    vocab = tiny_pipeline.context.target.config.vocab_size
    proposer = OracleTree(expected, len(prompt), vocab)
    if verifier == "rebuilding":
        chosen = RebuildingGreedy(Verifier.Config())
        chosen.inner = build(verifier_registry, "greedy")
    else:
        chosen = build(verifier_registry, verifier)
    result = tiny_pipeline.with_components(proposer, chosen).generate(prompt, max_new)
    assert result.tokens == expected
    assert proposer.rounds
    for round, draft in zip(proposer.rounds, proposer.drafts):
        assert round.draft is draft
        assert round.path and round.path[0] == 0  # the good root, in the proposer's numbering
        assert round.path == [0, 3][: len(round.path)]
        assert [draft.tokens[node] for node in round.path] == round.tokens[: len(round.path)]
        assert round.verified == ([0, 1, 2, 3] if verifier == "tree" else [0, 3])
        assert round.draft_seconds >= 0.0 and round.verify_seconds > 0.0
    assert result.stats.observe_time > 0.0 and result.stats.draft_time >= result.stats.observe_time


class LateMiss(OracleTree):
    """The oracle, with a wrong root from the 10th generated token on."""

    def propose(self, state) -> Draft:
        draft = super().propose(state)
        if len(state.tokens) - self.prompt_len >= 10:
            draft.tokens[0] = draft.tokens[1]  # wrong
        return draft


def test_nodes_past_the_token_budget_are_not_verified(tiny_pipeline):
    """A round cut to the tokens still wanted reports only the nodes the target saw:
    generated 10 of 12, the round may draft one level (its two roots), and both are
    wrong, so the request goes on and the round is observed."""
    prompt = random_prompts(1, seed=5)[0]
    expected = tiny_pipeline.generate(prompt, 12).tokens
    vocab = tiny_pipeline.context.target.config.vocab_size
    proposer = LateMiss(expected, len(prompt), vocab)
    result = tiny_pipeline.with_components(proposer, "tree").generate(prompt, 12)
    assert result.tokens == expected
    verified = [(round.verified, round.path) for round in proposer.rounds]
    assert verified[:3] == [([0, 1, 2, 3], [0, 3])] * 3  # 1 + 3 * 3 tokens
    assert verified[3] == ([0, 1], [])  # depth 0 only: nodes 2 and 3 were never tried


class Peeking(Proposer):
    """Records what the engine hands it each round; drafts nothing."""

    name = "peeking"

    @dataclass
    class Config:
        pass

    def __init__(self, in_target: bool) -> None:
        super().__init__(self.Config(), None)
        self.in_target = in_target
        self.seen: list[tuple] = []

    @property
    def drafts_in_target(self) -> bool:
        return self.in_target

    def propose(self, state) -> Draft:
        self.seen.append((state.session, state.last_hidden.clone(), len(state.committed_hidden)))
        return Draft.empty()


@pytest.mark.parametrize("in_target", [False, True])
def test_a_proposer_gets_the_session_only_if_it_drafts_in_the_target(tiny_pipeline, in_target):
    """Hidden states of the last pass reach every proposer; the target's session only
    one that declares drafts_in_target (the others have no way to disturb its cache)."""
    prompt = random_prompts(1, seed=2)[0]
    proposer = Peeking(in_target)
    tiny_pipeline.with_components(proposer, "greedy").generate(prompt, 4)
    sessions = {id(session) for session, _, _ in proposer.seen}
    assert len(proposer.seen) == 3
    assert (None not in [s for s, _, _ in proposer.seen]) == in_target and len(sessions) == 1
    assert [count for _, _, count in proposer.seen] == [len(prompt), 1, 1]  # prefill, then one per round
    first, second = proposer.seen[0][1], proposer.seen[1][1]
    assert first.shape == (tiny_pipeline.context.target.config.hidden_size,)
    assert not torch.equal(first, second)  # the state moved on with the request
