"""The eagle proposer: drafting equals the training-time test's forward, greedy identity
(chains, dynamic trees, merged with prompt lookup), the target's distribution at T=1,
and the train -> save -> load -> propose round trip, on drafters trained for the tiny model:
EAGLE-3's features with a pointer into the context (the default), the last layer alone,
and no pointer."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.engine.registry import verifier_registry
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.state import DecodeState
from specdec.decoders.models.session import ModelSession
from specdec.decoders.models.target import Target
from specdec.proposers.eagle.artifact import CONFIG_FILE, load_artifact
from specdec.proposers.eagle.drafter import resolve_layers, target_features
from specdec.train.eagle import Config, padded, ranked, unrolled
from specdec.train.job import run
from tests.conftest import random_prompts
from tests.distribution_helpers import assert_first_two_tokens_follow_the_target, assert_greedy_identical
from tests.train.test_train import compose_train

TINY_EAGLE = [
    "model=tiny-random",
    "model.dtype=float64",
    "logger=disabled",
    "drafter=eagle",
    "train.data.magpie_prompts=0",
    "train.data.templated_prompts=44",
    "train.data.passages=4",
    "train.data.max_new_tokens=40",
    "train.data.batch_size=16",
    "train.data.heldout=0.2",
    "drafter.lora_rank=4",
    "drafter.epochs=3",
    "drafter.lr=0.01",
    "drafter.copy_width=16",
]


def train_tiny_eagle(artifacts_dir, extra: tuple[str, ...] = ()):
    return run(compose_train(TINY_EAGLE + [f"artifacts_dir={artifacts_dir}", *extra]))


VARIANTS = {
    "eagle3+pointer": (),
    "last+pointer": ("drafter.feature_layers=[-1]",),
    "eagle3": ("drafter.copy_width=0",),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def artifacts(request, tmp_path_factory):
    """Drafters trained for the tiny model: EAGLE-3's layers with a pointer (the default),
    the last layer alone with a pointer, and EAGLE-3's layers without one."""
    directory = tmp_path_factory.mktemp("eagle")
    train_tiny_eagle(directory, VARIANTS[request.param])
    return directory


@pytest.fixture()
def base(tiny_model, tiny_config, artifacts) -> Pipeline:
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=artifacts, max_new_tokens=32)


def test_feature_layers_resolve_like_hidden_state_indices():
    assert resolve_layers(None, 30) == [2, 15, 30]
    assert resolve_layers([-1], 30) == [30]
    assert resolve_layers(None, 2) == [1, 2]
    with pytest.raises(ValueError, match="hidden-state indices"):
        resolve_layers([31], 30)


def test_the_tap_gives_the_targets_hidden_states(tiny_model):
    """Intermediate features from the forward hooks equal transformers' hidden_states."""
    target = Target(tiny_model[0])
    tap = target.tap([0])
    session = target.session()
    tokens = random_prompts(1, seed=2)[0]
    session.forward(tokens)
    features = target_features([1, 2], 2, session.hidden, tap)  # (q, 2 * hidden)
    with torch.no_grad():
        reference = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([reference[1][0], reference[2][0]], -1))


def prefilled(base, prompt: list[int], sampling: SamplingConfig) -> tuple[ModelSession, DecodeState]:
    """A target session after the prefill of ``prompt``, and the state a proposer sees then."""
    session = ModelSession(base.model)
    pending = int(session.forward(prompt)[-1].argmax())
    return session, DecodeState(
        prompt + [pending], len(prompt), sampling, sampling.generator(), session.hidden
    )


def test_drafts_follow_the_training_time_test_forward(base):
    """A greedy chain's tokens are the argmax of the unrolled training forward's step k at
    the row its path ends on: the draft cache at inference is what training attends to."""
    proposer = base.with_components({"name": "eagle", "adaptive": False, "k": 3}, "greedy").proposer
    drafter = proposer.drafter
    prompt = random_prompts(1, seed=6)[0]
    session, state = prefilled(base, prompt, SamplingConfig())
    proposer.begin(state)
    draft = proposer.propose(state)
    assert len(draft) == 3
    sequence = state.tokens + draft.tokens  # prompt, pending, drafted
    session.reset()
    session.forward(sequence[:-1])
    tap = base.target.tap([])
    features = target_features(drafter.feature_layers, 2, session.hidden, tap)
    data = {"tokens": [sequence], "prompt_len": [len(prompt)], "features": [features]}
    rows = padded(data, [0], drafter.device)
    m = len(prompt)  # the pending token's position; the committed prefix ends at m - 1
    with torch.no_grad():
        for k, _, logits, pointer in unrolled(drafter, rows, 3):
            top = ranked(drafter, logits, pointer, rows["tokens"][:, 1:], 1)  # (1, T, 1)
            assert int(top[0, m - 1 + k, 0]) == draft.tokens[k]  # depth k of the path from prefix m - 1


LOSSLESS = [v for v in verifier_registry.names() if verifier_registry.get(v).lossless]
TREE_VERIFIERS = [v for v in LOSSLESS if verifier_registry.get(v).accepts_trees]
CASES = [("eagle", v) for v in LOSSLESS] + [
    (proposer, verifier)
    for proposer in (
        {"name": "eagle", "adaptive": False, "k": 3},
        {"name": "eagle", "tree": True},
        {"name": "eagle", "tree": True, "tree_width": 2, "tree_budget": 5},
        {"name": "merge", "members": [{"name": "eagle", "tree": True}, {"name": "ngram"}]},
        {"name": "merge", "members": [{"name": "eagle"}, {"name": "ngram"}]},
    )
    for verifier in ["greedy", *TREE_VERIFIERS]
]


@pytest.mark.parametrize(("proposer", "verifier"), CASES, ids=str)
def test_greedy_output_equals_standard_decoding(drafting_pays, base, proposer, verifier):
    pipeline = base.with_components(proposer, verifier)
    prompts = random_prompts(3, seed=8) + ["Write a story about"]
    assert_greedy_identical(base, pipeline, prompts, (1, 5, 24), "EAGLE")


@pytest.mark.parametrize(
    ("proposer", "verifier"),
    [
        ({"name": "eagle", "adaptive": False}, "rejection"),
        ({"name": "eagle", "tree": True}, "tree"),
        ({"name": "merge", "members": [{"name": "eagle", "adaptive": False}, "ngram"]}, "tree"),
    ],
    ids=["chain-rejection", "dynamic-tree", "merged-with-ngram"],
)
def test_sampling_keeps_the_targets_distribution(drafting_pays, base, proposer, verifier):
    """At T=1 the first two tokens follow the target's distribution (chi-square), whether
    drafted as sampled chains (rejection sampling against the drafter's q) or as
    deterministic dynamic trees (point-mass rule)."""
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    pipeline = base.with_components(proposer, verifier, sampling)
    prompt = base.encode("Explain how")
    assert_first_two_tokens_follow_the_target(base, pipeline, prompt, sampling, 300, "the drafter's tokens")


@pytest.mark.parametrize(
    "proposer",
    [{"name": "eagle", "adaptive": False, "k": 3}, {"name": "eagle", "tree": True, "k": 3, "tree_budget": 6}],
    ids=["chain", "tree"],
)
def test_a_batch_runs_each_pass_of_the_drafter_once_for_every_request(
    drafting_pays, base, proposer, monkeypatch
):
    """In a batch, each request drafts in a session of its own over the drafter, and every
    pass of its draft layer (the sync of the committed positions, a chain's tokens, a tree's
    levels) runs as one packed pass over the requests that ask it; alone, each is a call of
    its own. Every request decodes as it would alone (float64)."""
    from specdec.decoders.engine.drafting import ModelPass

    joined: list[tuple[int, bool]] = []  # (requests in the call, a tree level)
    run_together = ModelPass.run_together.__func__

    def recording(cls, works):
        assert all(work.inputs_embeds is not None for work in works)  # the drafter reads features
        joined.append((len(works), works[0].parents is not None))
        return run_together(cls, works)

    monkeypatch.setattr(ModelPass, "run_together", classmethod(recording))
    pipeline = base.with_components(proposer, "tree" if proposer.get("tree") else "greedy")
    # 10 requests: each one's first draft reads its prefill's features after the other 9 prefills
    prompts = [prompt[: 6 + 5 * i] for i, prompt in enumerate(random_prompts(10, seed=13))]
    alone = [pipeline.generate(prompt, 16).tokens for prompt in prompts]
    assert joined and {size for size, _ in joined} == {1}
    joined.clear()
    batch = pipeline.generate_batch(prompts, 16, batch_size=10)
    assert [result.tokens for result in batch.results] == alone
    assert sum(result.stats.accepted for result in batch.results) > 0
    assert max(size for size, _ in joined) == 10
    if proposer.get("tree"):  # a deeper level of every request's tree in one pass
        assert max(size for size, tree in joined if tree) == 10


def test_sampled_chains_carry_the_drafters_distribution(base):
    proposer = base.with_components({"name": "eagle", "adaptive": False}, "rejection").proposer
    sampling = SamplingConfig(temperature=1.0)
    prompt = random_prompts(1, seed=3)[0]
    session, state = prefilled(base, prompt, sampling)
    proposer.begin(state)
    draft = proposer.propose(state)
    assert draft.draft_probs.shape == (4, base.model.config.vocab_size)
    torch.testing.assert_close(draft.draft_probs.sum(-1), torch.ones(4, dtype=draft.draft_probs.dtype))
    outside = torch.ones(base.model.config.vocab_size, dtype=torch.bool)
    outside[proposer.drafter.vocabulary.token_ids] = False
    if proposer.drafter.copy is not None:  # the pointer reaches the context's tokens too
        outside[torch.tensor(state.tokens)] = False
    assert float(draft.draft_probs[:, outside].sum()) == 0.0  # q is 0 off the drafter's support
    assert all(float(draft.draft_probs[i, t]) > 0 for i, t in enumerate(draft.tokens))


def test_training_round_trip(artifacts, tiny_model):
    """The artifact holds only what differs from the target, loads, and drafts."""
    model, _ = tiny_model
    directory = artifacts / "tiny-random-v320-h64-l2-s0" / "eagle"
    meta = json.loads((directory / CONFIG_FILE).read_text())
    assert meta["drafter"] == "eagle" and len(meta["metrics"]["top1"]) == Config.eval_depth
    assert meta["metrics"]["top1"][0] > 0.2, meta["metrics"]
    assert not (directory / "checkpoint").exists()
    stored = {p.name for p in (directory / "adapter").iterdir()}
    assert "adapter_model.safetensors" in stored
    from safetensors.torch import load_file

    names = load_file(str(directory / "adapter" / "adapter_model.safetensors"))
    assert any("lora_A" in n for n in names) and any("fuse" in n for n in names)
    assert not any("lm_head" in n or "embed" in n for n in names)  # the target's weights are not stored
    assert any(".copy." in n for n in names) == bool(meta["copy_width"])  # the pointer, trained in full
    drafter = load_artifact(directory, model).drafter
    assert drafter.dtype == torch.float64 and not any(p.requires_grad for p in drafter.parameters())


def test_untrained_drafter_passes_the_last_feature_through(tiny_model):
    """fuse and combine start as the identity on the highest feature."""
    from specdec.proposers.draft_model import DraftVocabulary
    from specdec.proposers.eagle.drafter import EagleDrafter

    model, _ = tiny_model
    vocabulary = DraftVocabulary(torch.arange(model.config.vocab_size), model.config.vocab_size)
    drafter = EagleDrafter(model, [1, 2], -1, vocabulary)
    features = torch.randn(3, 2 * 64, dtype=torch.float64)
    torch.testing.assert_close(drafter.fuse(features), features[:, 64:])
    tokens = torch.tensor([1, 2, 3])
    torch.testing.assert_close(drafter.inputs(features[:, 64:], tokens), features[:, 64:])


def test_missing_artifact_names_the_training_command(tiny_pipeline):
    with pytest.raises(FileNotFoundError, match="python -m specdec.train drafter=eagle model=tiny-random"):
        tiny_pipeline.with_components("eagle", "greedy")


def test_dynamic_tree_nodes_are_their_parents_top_children(base):
    """Each node of a dynamic tree (no budget cut) is among the drafter's top tree_width
    tokens given its path, per the unrolled training forward; siblings are distinct."""
    proposer = base.with_components(
        {"name": "eagle", "tree": True, "tree_width": 3, "k": 3, "tree_budget": None}, "tree"
    ).proposer
    assert not proposer.sampled
    drafter = proposer.drafter
    prompt = random_prompts(1, seed=4)[0]
    session, state = prefilled(base, prompt, SamplingConfig())
    proposer.begin(state)
    draft = proposer.propose(state)
    assert len(draft) == 3 + 2 * 3 * 3 and draft.draft_probs is None
    for row in draft.children:
        assert len({draft.tokens[c] for c in row}) == len(row)
    m = len(prompt)
    for node in range(len(draft)):
        path = []
        parent = draft.parents[node]
        while parent >= 0:
            path.insert(0, draft.tokens[parent])
            parent = draft.parents[parent]
        sequence = state.tokens + path + [draft.tokens[node]]
        check = ModelSession(base.model)
        check.forward(sequence[:-1])
        features = target_features(drafter.feature_layers, 2, check.hidden, base.target.tap([]))
        rows = padded(
            {"tokens": [sequence], "prompt_len": [len(prompt)], "features": [features]}, [0], drafter.device
        )
        with torch.no_grad():
            *_, logits, pointer = list(unrolled(drafter, rows, len(path) + 1))[-1]
        top = ranked(drafter, logits, pointer, rows["tokens"][:, 1:], 3)[0, m - 1 + len(path)].tolist()
        assert draft.tokens[node] in top


def test_the_pointer_reaches_context_tokens_outside_the_draft_vocabulary(tiny_model):
    """With its gate shut on the layer, the drafter's distribution is the pointer's: all of
    its mass on tokens that followed committed positions, one of them outside the draft
    vocabulary, which the mixture's rows (draft vocabulary, then the context's) give."""
    from specdec.proposers.copy_attention import drafting_log_probs
    from specdec.proposers.draft_model import DraftVocabulary
    from specdec.proposers.eagle.drafter import EagleDrafter

    model, _ = tiny_model
    vocabulary = DraftVocabulary(torch.arange(8), model.config.vocab_size)  # tokens 0..7 only
    drafter = EagleDrafter(model, [1, 2], -1, vocabulary, copy_width=16, copy_depths=2)
    with torch.no_grad():
        drafter.copy.gates[1].bias.fill_(-40.0)  # depth 1 and deeper: all mass on the pointer
    memory = drafter.context_memory()
    tokens = [3, 200, 5, 201, 3]
    hidden = torch.randn(len(tokens) - 1, 64, dtype=torch.float64)
    memory.extend(hidden, tokens[:-1], tokens[1:])
    state = torch.randn(1, 64, dtype=torch.float64)
    head_logits = drafter.lm_head(state)  # (1, 8)
    slot = drafter.copy_slot(5)
    assert slot == 1
    log_probs = drafting_log_probs(
        drafter.copy, slot, state, drafter.embed(torch.tensor([3])), head_logits, memory
    )
    probs = memory.full_rows(log_probs.exp())[0]  # (vocab,)
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0, dtype=probs.dtype))
    reachable = torch.zeros_like(probs, dtype=torch.bool)
    reachable[torch.tensor(tokens[1:])] = True
    assert float(probs[~reachable].sum()) < 1e-12
    assert float(probs[200] + probs[201]) > 0.0  # outside the draft vocabulary, given by the pointer
