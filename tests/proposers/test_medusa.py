"""The medusa proposer: trees, the artifact round trip, and losslessness with
greedy and sampling verifiers, on heads trained for the tiny model."""

from __future__ import annotations

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.engine.registry import verifier_registry
from specdec.decoders.engine.sampling import SamplingConfig, processed_probs
from specdec.decoders.engine.state import DecodeState
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.session import ModelSession
from specdec.proposers.copy_attention import mixture
from specdec.proposers.medusa.artifact import load_artifact, save_artifact
from specdec.proposers.medusa.trees import best_tree, build_tree, draw_siblings
from specdec.train.medusa import Config, build_heads
from tests.conftest import random_prompts
from tests.distribution_helpers import assert_first_two_tokens_follow_the_target, assert_greedy_identical
from tests.proposers.test_copy_attention import entries_of
from tests.train.test_train import train_tiny_medusa

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


HEAD_KINDS = {
    "sequential": ("drafter.sequential=true",),
    "medusa1": ("drafter.sequential=false", "drafter.copy_width=0"),
    "copy": ("drafter.sequential=true", "drafter.copy_width=16"),
}


@pytest.fixture(scope="module", params=list(HEAD_KINDS))
def artifacts(request, tmp_path_factory):
    """Heads trained for the tiny model: sequential (the default), Medusa-1, and copy heads."""
    directory = tmp_path_factory.mktemp("medusa")
    train_tiny_medusa(directory, HEAD_KINDS[request.param])
    return directory


@pytest.fixture()
def base(tiny_model, tiny_config, artifacts) -> Pipeline:
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=artifacts, max_new_tokens=32)


def decode_state(pipeline: Pipeline, prompt: list[int], sampling: SamplingConfig) -> DecodeState:
    """The state a proposer sees right after the prefill of ``prompt``."""
    session = ModelSession(pipeline.model)
    first = int(session.forward(prompt)[-1].argmax())
    return DecodeState(prompt + [first], len(prompt), sampling, sampling.generator(), session.hidden)


def reference_logits(heads, state: DecodeState, path: list[int]) -> torch.Tensor:
    """(vocab,) what the head at depth len(path) gives after the drafted ``path``,
    through the PEFT forward used in training (not the drafting code). Copy heads:
    the log of the mixture with the pointer, over keys computed here from the prefill."""
    tokens = torch.tensor([state.tokens[-1], *path] + [0] * (heads.num_heads - len(path) - 1))
    k = len(path)
    with torch.no_grad():
        if heads.copy is None:
            rows = heads(state.last_hidden, tokens)[k]  # (n,) over the draft vocabulary
            full = rows.new_full((heads.vocab_size,), torch.finfo(rows.dtype).min)
            full[heads.draft_vocab] = rows
            return full
        sequence = torch.tensor(state.tokens)  # prompt + pending
        context = entries_of(heads, state.hidden, state.tokens)  # the prefill's rows: the prompt
        logits, weights, gates = heads(state.last_hidden[None], tokens[None], (*context, None))
        probs = mixture(
            torch.softmax(logits[0, k][None], -1), weights[0, k][None], gates[0, k].view(1, 1),
            sequence[1:], heads.vocab_size, heads.draft_vocab,
        )  # fmt: skip
        return probs[0].log().clamp(min=torch.finfo(probs.dtype).min)


def ancestors(draft, node: int) -> list[int]:
    """Tokens on the path from the root down to ``node``'s parent."""
    path = []
    while (node := draft.parents[node]) >= 0:
        path.insert(0, draft.tokens[node])
    return path


def test_tree_paths_become_a_draft_tree_with_the_all_zero_path_first():
    depths, ranks, parents = build_tree([[1, 0], [0, 1], [1], [0], [0, 0]], num_heads=4)
    # sorted: [0], [1], [0, 0], [0, 1], [1, 0]
    assert depths == [0, 0, 1, 1, 1]
    assert ranks == [0, 1, 0, 1, 0]
    assert parents == [-1, -1, 0, 0, 1]


@pytest.mark.parametrize(
    ("paths", "message"),
    [([[0], [0, 1, 2]], "prefix"), ([[0], [0]], "twice"), ([[0, 0, 0, 0, 0]], "deeper"), ([[]], "non-empty")],
)
def test_bad_tree_paths_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        build_tree(paths, num_heads=4)


def test_best_tree_takes_the_likeliest_paths():
    rank_accuracy = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    # path values: [0] .5, [0,0] .2, [1] .2, [2] .1, [1,0] .08, [0,1] .05
    assert sorted(best_tree(rank_accuracy, 4)) == [[0], [0, 0], [1], [2]]
    assert len(best_tree(rank_accuracy, 100)) == 3 + 3 * 3


def test_drafts_follow_the_peft_forward_over_the_draft_vocabulary(base):
    heads = base.with_components("medusa", "greedy").proposer.heads
    assert heads.draft_vocab is not None and 40 < len(heads.draft_vocab) < 320
    if not heads.sequential:  # Medusa-1: all heads from one fused matmul
        hidden = torch.randn(64, dtype=torch.float64)
        torch.testing.assert_close(heads.fused_logits(hidden)[:, heads.draft_vocab], heads(hidden))
    prompt = random_prompts(1, seed=1)[0]
    proposer = base.with_components({"name": "medusa", "adaptive": False}, "greedy").proposer
    state = decode_state(base, prompt, SamplingConfig())
    draft = proposer.propose(state).tokens
    assert len(draft) == heads.num_heads
    assert draft == [int(reference_logits(heads, state, draft[:k]).argmax()) for k in range(len(draft))]

    sampling = SamplingConfig(temperature=1.0)
    proposer = base.with_components({"name": "medusa", "adaptive": False}, "rejection", sampling).proposer
    state = decode_state(base, prompt, sampling)
    draft = proposer.propose(state)
    if heads.copy is None:  # copy heads may also propose tokens the context holds
        outside = torch.ones(320, dtype=torch.bool)
        outside[heads.draft_vocab] = False
        assert set(draft.tokens) <= set(heads.draft_vocab.tolist())
        assert draft.draft_probs[:, outside].sum() == 0
    for k in range(len(draft)):
        expected = processed_probs(reference_logits(heads, state, draft.tokens[:k]), sampling)
        torch.testing.assert_close(draft.draft_probs[k], expected)


@pytest.mark.parametrize("sequential", [True, False])
def test_save_load_round_trip_gives_identical_proposals(tmp_path, sequential):
    config = ModelConfig(name="tiny-random", dtype="float32")
    target, tokenizer = load_model(config)
    model = target.model
    draft_vocab = torch.randperm(320)[:100].sort().values
    heads, peft_heads = build_heads(
        model.get_output_embeddings(),
        Config(num_heads=3, lora_rank=4, sequential=sequential, copy_width=0),
        draft_vocab,
        model.get_input_embeddings(),
    )
    with torch.no_grad():  # trained-looking values everywhere (LoRA's B starts at zero)
        for parameter in heads.parameters():
            if parameter.requires_grad:
                parameter.normal_(0, 0.2)
    directory = tmp_path / "medusa"
    meta = {"num_heads": 3, "hidden_size": 64, "vocab_size": 320, "tree": TREE, "sequential": sequential}
    save_artifact(peft_heads, directory, meta)
    artifact = load_artifact(directory, model.get_output_embeddings(), model.get_input_embeddings())
    assert torch.equal(artifact.heads.draft_vocab, draft_vocab) and artifact.meta == meta
    assert artifact.heads.sequential == sequential
    loaded = artifact.heads
    pipeline = Pipeline(target, tokenizer, model_config=config, artifacts_dir=tmp_path)
    spec = {"name": "medusa", "path": str(directory), "adaptive": False}
    proposer = pipeline.with_components(spec, "greedy").proposer
    for prompt in random_prompts(4, seed=2):
        state = decode_state(pipeline, prompt, SamplingConfig())
        proposer.begin(state)
        tokens = torch.randint(320, (3,))
        with torch.no_grad():
            assert torch.equal(loaded(state.last_hidden, tokens), heads(state.last_hidden, tokens))
        chain: list[int] = []
        for _ in range(3):
            chain.append(int(reference_logits(heads, state, chain).argmax()))
        assert proposer.propose(state).tokens == chain


def test_greedy_tree_holds_each_heads_top_k_tokens(base):
    proposer = base.with_components({"name": "medusa", "tree": TREE}, "greedy").proposer
    state = decode_state(base, random_prompts(1, seed=4)[0], SamplingConfig())
    draft = proposer.propose(state)
    # nodes in order: [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    assert draft.parents == [-1, -1, 0, 0, 1, 2]
    ranks = [0, 1, 0, 1, 0, 0]
    for node, rank in enumerate(ranks):
        top = reference_logits(proposer.heads, state, ancestors(draft, node)).topk(2).indices
        assert draft.tokens[node] == top[rank]
    assert draft.as_chain().tokens == [draft.tokens[0], draft.tokens[2], draft.tokens[5]]


@pytest.mark.parametrize("siblings", ["without_replacement", "iid"])
def test_sampled_drafts_carry_each_heads_distribution(base, siblings):
    """Each sampled node records the row it was drawn from: its head's distribution given
    its path, without the tokens its earlier siblings drew (renormalised) unless i.i.d."""
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    for tree in (None, TREE):
        spec = {"name": "medusa", "tree": tree, "adaptive": False, "sibling_sampling": siblings}
        proposer = base.with_components(spec, "rejection", sampling).proposer
        state = decode_state(base, random_prompts(1, seed=6)[0], sampling)
        draft = proposer.propose(state)
        for node in range(len(draft)):
            logits = reference_logits(proposer.heads, state, ancestors(draft, node))
            expected = processed_probs(logits, sampling)
            earlier = [
                s for s in draft.children[draft.parents[node] + 1] if s < node
            ]  # siblings drawn before
            if siblings == "without_replacement" and earlier:
                expected[[draft.tokens[s] for s in earlier]] = 0.0
                expected /= expected.sum()
            torch.testing.assert_close(draft.draft_probs[node], expected)
        assert all(draft.draft_probs[i, token] > 0 for i, token in enumerate(draft.tokens))
        if siblings == "without_replacement":
            for children in draft.children:
                assert len({draft.tokens[c] for c in children}) == len(children)  # siblings are distinct


def test_siblings_drawn_without_replacement_fall_back_to_the_whole_row_when_it_is_used_up():
    """Two siblings under top_k=1: the second has no mass left, so it draws from the
    whole row again (and records it), instead of dividing by zero."""
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    drawn = draw_siblings(probs, [0, 0], iid=False, generator=torch.Generator().manual_seed(0))
    assert [token for token, _ in drawn] == [1, 1]
    for _, row in drawn:
        assert torch.equal(row, probs[0])


def test_auto_budget_drafts_the_tree_its_measured_ranks_favour(base):
    """Once the budget has measured acceptance per (depth, rank), a static tree drafts
    the best rank paths under those rates, not the first paths of its given tree."""
    proposer = base.with_components({"name": "medusa", "tree": TREE, "tree_budget": "auto"}, "tree").proposer
    state = decode_state(base, random_prompts(1, seed=4)[0], SamplingConfig())
    assert proposer.propose(state).parents == build_tree(TREE, 3)[2]  # the given tree until measured
    proposer.tuner.paths = [(0,), (1,), (2,), (1, 0)]  # as a retune would set them
    proposer.begin(state)  # the same state again: copy heads rebuild their memory
    draft = proposer.propose(state)
    assert draft.parents == [-1, -1, -1, 1]
    top = reference_logits(proposer.heads, state, []).topk(3).indices
    assert draft.tokens[:3] == top.tolist()
    assert proposer.describe()["tree_paths"] == [[0], [1], [2], [1, 0]]


LOSSLESS = [v for v in verifier_registry.names() if verifier_registry.get(v).lossless]
TREE_VERIFIERS = [v for v in LOSSLESS if verifier_registry.get(v).accepts_trees]
CASES = [("medusa", v) for v in LOSSLESS] + [
    (proposer, verifier)
    for proposer in (
        {"name": "medusa", "tree": "auto"},
        {"name": "medusa", "tree": TREE},
        {"name": "medusa", "num_heads": 2},
        {"name": "medusa", "tree": TREE, "tree_budget": 3},
        {"name": "medusa", "tree": "auto", "tree_budget": "auto"},
        {"name": "medusa", "adaptive": False},
        {"name": "medusa", "tree": "dynamic", "tree_budget": "auto"},
        {"name": "medusa", "tree": "dynamic", "tree_width": 2, "tree_budget": 5},
        {"name": "merge", "members": [{"name": "medusa", "tree": "auto"}, {"name": "ngram"}]},
    )
    for verifier in ["greedy", *TREE_VERIFIERS]
]


@pytest.mark.parametrize(("proposer", "verifier"), CASES)
def test_greedy_output_equals_standard_decoding(drafting_pays, base, proposer, verifier):
    pipeline = base.with_components(proposer, verifier)
    prompts = random_prompts(3, seed=8) + ["Write a story about"]
    assert_greedy_identical(base, pipeline, prompts, (1, 5, 24), "Medusa")


@pytest.mark.parametrize(
    ("proposer", "verifier"),
    [
        ("medusa", "rejection"),
        (
            {"name": "medusa", "tree": "dynamic", "tree_budget": "auto", "when_sampling": "point_masses"},
            "tree",
        ),
        ({"name": "medusa", "tree": "dynamic", "tree_budget": "auto"}, "tree"),
        ({"name": "medusa", "tree": TREE, "tree_budget": "auto"}, "tree"),
        ({"name": "medusa", "tree": TREE, "sibling_sampling": "iid"}, "tree"),
        ({"name": "merge", "members": ["medusa", "ngram"]}, "tree"),
    ],
    ids=[
        "chain-rejection",
        "dynamic-tree",
        "dynamic-as-sampled-tree",
        "sampled-tree",
        "sampled-tree-iid",
        "merged-with-ngram",
    ],
)
def test_sampling_keeps_the_targets_distribution(drafting_pays, base, proposer, verifier):
    """Drafted tokens (from the second generated one on) follow the target's
    distribution exactly, whether sampled chains (rejection sampling against the
    heads' draft_probs) or deterministic dynamic trees (point-mass rule): chi-square
    on the first two tokens."""
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    pipeline = base.with_components(proposer, verifier, sampling)
    prompt = base.encode("Explain how")  # a chat prompt like the training ones: drafts get accepted
    assert_first_two_tokens_follow_the_target(base, pipeline, prompt, sampling, 400, "the heads' drafts")


def test_dynamic_tree_nodes_are_their_parents_top_children(base):
    spec = {"name": "medusa", "tree": "dynamic", "tree_width": 3, "when_sampling": "point_masses"}
    proposer = base.with_components(spec, "tree").proposer
    assert not proposer.sampled
    state = decode_state(base, random_prompts(1, seed=4)[0], SamplingConfig())
    draft = proposer.propose(state)
    assert (
        len(draft) == 3 + (proposer.num_heads - 1) * 3 * 3
        and not draft.is_chain
        and draft.draft_probs is None
    )
    for node in range(len(draft)):
        top = reference_logits(proposer.heads, state, ancestors(draft, node)).topk(3).indices.tolist()
        assert draft.tokens[node] in top
    for row in draft.children:  # siblings are distinct
        assert len({draft.tokens[c] for c in row}) == len(row)


def test_dynamic_trees_draft_the_sampled_tree_when_sampling(base):
    """tree=dynamic: point masses at temperature 0; above it, by default, the artifact's tree
    with sampled siblings (draft_probs given) from the budget's measured shape; with
    when_sampling=point_masses, the dynamic tree at every temperature. Each shape's rounds
    go to its own sizer."""
    sampling = SamplingConfig(temperature=1.0)
    prompt = random_prompts(1, seed=4)[0]
    spec = {"name": "medusa", "tree": "dynamic", "tree_budget": "auto"}
    proposer = base.with_components(spec, "tree").proposer
    assert proposer.sampled and proposer.tuner is not None
    greedy = proposer.propose(decode_state(base, prompt, SamplingConfig()))
    assert greedy.draft_probs is None and proposer.sizer is proposer.dynamic
    proposer.begin(None)
    sampled = proposer.propose(decode_state(base, prompt, sampling))
    assert sampled.draft_probs is not None and proposer.sizer is proposer.tuner
    assert sampled.parents == proposer._budget_tree()[2]
    kept = base.with_components({**spec, "when_sampling": "point_masses"}, "tree").proposer
    assert not kept.sampled and kept.propose(decode_state(base, prompt, sampling)).draft_probs is None
    fewer = base.with_components(
        {**spec, "num_heads": 1}, "tree"
    ).proposer  # the artifact's tree, cut to one head
    assert fewer.tree is not None and set(fewer.tree[0]) == {0}
    with pytest.raises(ValueError, match="proposer.when_sampling must be sampled_tree or point_masses"):
        base.with_components({**spec, "when_sampling": "sometimes"}, "tree")


def test_missing_artifact_names_the_training_command(tiny_pipeline):
    with pytest.raises(FileNotFoundError, match="python -m specdec.train drafter=medusa model=tiny-random"):
        tiny_pipeline.with_components("medusa", "greedy")


def test_heads_for_another_target_are_refused(artifacts):
    config = ModelConfig(name="tiny-random", vocab_size=300)
    model, tokenizer = load_model(config)
    other = Pipeline(model, tokenizer, model_config=config)
    directory = artifacts / "tiny-random-v320-h64-l2-s0" / "medusa"
    with pytest.raises(ValueError, match="retrain"):
        other.with_components({"name": "medusa", "path": str(directory)}, "greedy")


def test_tree_budget_keeps_the_first_paths(base, tiny_model):
    pipeline = base.with_components({"name": "medusa", "tree": TREE, "tree_budget": 3}, "tree")
    state = decode_state(pipeline, random_prompts(1, seed=4)[0], SamplingConfig())
    draft = pipeline.proposer.propose(state)
    assert len(draft) == 3 and draft.parents == [-1, -1, 0]  # paths [0], [1], [0, 0]
    with pytest.raises(ValueError, match="tree_budget"):
        base.with_components({"name": "medusa", "tree": TREE, "tree_budget": 0}, "tree")
    with pytest.raises(ValueError, match="proposer.sibling_sampling must be without_replacement or iid"):
        base.with_components({"name": "medusa", "tree": TREE, "sibling_sampling": "random"}, "tree")


def test_auto_budget_is_rechosen_from_measured_acceptance(base):
    pipeline = base.with_components({"name": "medusa", "tree": TREE, "tree_budget": "auto"}, "tree")
    tuner = pipeline.proposer.tuner
    assert tuner.budget == len(TREE)  # explores the whole tree until measured
    for prompt in random_prompts(4, seed=6):
        pipeline.generate(prompt, 24)
    assert tuner.rounds > tuner.every
    assert tuner.expected_tokens_per_s is not None and 1 <= tuner.budget <= len(TREE)


def test_shipped_heads_load_from_package_data_and_stay_lossless(
    artifacts, tiny_model, tiny_config, tmp_path, monkeypatch
):
    """`python -m specdec.train.ship` copies the heads in bfloat16 into the shipped drafters; a
    pipeline with no artifacts of its own then finds them, says so, and its greedy output
    is still standard decoding's."""
    from specdec.decoders.engine import context as context_module
    from specdec.train.ship import ship

    model, tokenizer = tiny_model
    key = Pipeline(model, tokenizer, model_config=tiny_config).context.target_key
    shipped_root = tmp_path / "shipped"
    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", shipped_root)
    ship(artifacts / key / "medusa", shipped_root / key / "medusa")
    assert not (shipped_root / key / "medusa" / "checkpoint.pt").exists()

    base = Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=tmp_path / "none")
    pipeline = base.with_components("medusa", "greedy")
    assert pipeline.proposer.describe()["artifact"]["shipped"] is True
    for prompt in random_prompts(3, seed=4):
        assert pipeline.generate(prompt, 16).tokens == base.generate(prompt, 16).tokens
