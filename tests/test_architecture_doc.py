"""docs/architecture.md's example proposer, as a reader would copy it: it registers, builds
by name, and is lossless under every lossless verifier, with no other file touched."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from specdec.decoders.engine.registry import proposer_registry
from tests.conftest import lossless_verifiers, random_prompts

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def example_source() -> str:
    """The Python block of the doc's "Adding a proposer" section."""
    section = DOC.read_text().split("## Adding a proposer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the checklist holds one example"
    return blocks[0]


@pytest.fixture()
def example_proposer():
    """Runs the doc's example as a module of its own; unregistered afterwards."""
    module = types.ModuleType("architecture_doc_example")
    sys.modules[module.__name__] = module  # a dataclass looks its module up there
    exec(compile(example_source(), str(DOC), "exec"), module.__dict__)
    yield "last_follower"
    proposer_registry._classes.pop("last_follower", None)
    del sys.modules[module.__name__]


def test_the_documented_proposer_is_registered_and_lossless(tiny_pipeline, example_proposer):
    assert example_proposer in proposer_registry.names()
    proposed = 0
    for verifier in lossless_verifiers():
        pipeline = tiny_pipeline.with_components(example_proposer, verifier)
        for prompt in random_prompts(3, seed=4):
            result = pipeline.generate(prompt, 24)
            assert result.tokens == tiny_pipeline.generate(prompt, 24).tokens, verifier
            proposed += result.stats.proposed
    assert proposed > 0, "the example never drafted: the test exercised nothing"


def test_the_proposer_contract_fits_its_one_screen_summary():
    """decoders/engine/proposer.py's docstring groups every public hook, property and
    declaration of ``Proposer`` on one screen: a new one is added there or this fails."""
    import specdec.decoders.engine.proposer as contract

    summary = contract.__doc__
    assert len(summary.splitlines()) <= 45, "the summary outgrew one screen"
    public = {name for name in vars(contract.Proposer) if not name.startswith("_")} - {
        "name",
        "batches_drafting",
    }
    missing = sorted(name for name in public if not re.search(rf"\b{name}\b", summary))
    assert not missing, f"Proposer members missing from the summary: {missing}"
