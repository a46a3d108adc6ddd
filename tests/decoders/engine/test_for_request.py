"""A batch gives each request its own copy of the proposer (``Proposer.for_request``): what
every request shares is declared (``shared``), what ``begin`` sets anew is declared
(``per_request``), plain data is copied, and anything else is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.decoders import Draft, Proposer
from specdec.decoders.engine.registry import proposer_registry
from tests.conftest import pipeline_or_skip


class Counting(Proposer):
    name = "counting"
    shared = frozenset({"weights"})
    per_request = frozenset({"scratch"})

    @dataclass
    class Config:
        k: int = 1

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.weights = torch.nn.Linear(2, 2)
        self.seen: list[int] = []
        self.scratch = object()

    def propose(self, state) -> Draft:
        return Draft.chain([])


def test_shared_is_shared_plain_state_is_copied_and_per_request_state_starts_empty():
    proposer = Counting(Counting.Config(), context=None)
    proposer.seen.append(3)
    fork = proposer.for_request()
    assert fork.weights is proposer.weights and fork.config is proposer.config
    assert fork.seen == [3] and fork.seen is not proposer.seen
    assert fork.scratch is None and proposer.scratch is not None


def test_an_undeclared_attribute_is_refused_by_name():
    proposer = Counting(Counting.Config(), context=None)
    proposer.cache = torch.zeros(3)  # neither shared, per-request, plain nor forkable
    with pytest.raises(TypeError, match=r"attribute 'cache' \(Tensor\).*Counting.shared"):
        proposer.for_request()


@pytest.mark.parametrize("proposer", proposer_registry.names())
def test_every_proposer_declares_its_state_after_serving_a_request(trained_pipeline, proposer):
    """Forked after a request ran alone (its begin-time state set), every built-in proposer
    forks: nothing it holds is left undeclared."""
    pipeline = pipeline_or_skip(trained_pipeline, proposer, None)
    pipeline.generate([5, 6, 7, 5, 6, 7, 5, 6], 8)
    fork = pipeline.proposer.for_request()
    assert fork.config is pipeline.proposer.config


def test_merge_members_named_twice_stay_one_fork(trained_pipeline):
    """A member merge also keeps under another name (the member whose pass it reuses) is the
    same fork in the copy as in its member list."""
    merge = pipeline_or_skip(trained_pipeline, {"name": "merge"}, None).proposer
    fork = merge.for_request()
    assert all(a is not b for a, b in zip(fork.members, merge.members))
    for name, value in vars(merge).items():
        if isinstance(value, Proposer):  # an alias of a member
            assert getattr(fork, name) is fork.members[merge.members.index(value)]
