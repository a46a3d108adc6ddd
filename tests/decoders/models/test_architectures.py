"""The conformance matrix: every architecture of tests/architectures.py crossed with chain
and tree drafts from a model-free proposer (prompt lookup) and from a drafter that runs
beside the target (a draft model of the same architecture, loaded from a folder as a
user's would be), greedy output identical to standard decoding on a prompt several
sliding windows long; and, one architecture per attention family, the exact sampling
distribution at temperature 1. A transformers release that breaks a family fails here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.models.architecture import UnsupportedArchitectureError
from specdec.decoders.models.loading import byte_tokenizer
from tests.architectures import ARCHITECTURES, WINDOW, Architecture
from tests.distribution_helpers import assert_first_two_tokens_follow_the_target

TEXT = b"the cat sat on the mat. the dog sat on the log. the cat sat on the log. "
PROMPT = list(TEXT[: 4 * WINDOW + 10])  # 74 tokens: past four 16-position windows
NEW_TOKENS = 48


def draft_spec(arch: Architecture, **options) -> dict:
    dtype = str(arch.dtype).removeprefix("torch.")
    return {
        "name": "draft_model",
        "tree": False,
        "k": 4,
        "name_or_path": str(loaded(arch)[1]),
        "dtype": dtype,
        **options,
    }


PIPELINES = {
    "ngram chain": (lambda arch: {"name": "ngram", "adaptive": False}, "greedy"),
    "ngram tree": (lambda arch: {"name": "ngram", "branches": 3, "adaptive": False}, "tree"),
    "draft chain": (lambda arch: draft_spec(arch, k=3), "greedy"),
    "draft tree": (lambda arch: draft_spec(arch, tree=True, tree_budget=8), "tree"),
}


_LOADED: dict[str, tuple[Pipeline, Path, list[int]]] = {}


def loaded(arch: Architecture) -> tuple[Pipeline, Path, list[int]]:
    """(standard decoding on the architecture's tiny model, its draft's folder, the greedy
    output of standard decoding), once per architecture."""
    if arch.id not in _LOADED:
        model = arch.build()
        draft_dir = arch.save_draft(Path(tempfile.mkdtemp(prefix=f"draft-{arch.id}-")))
        base = Pipeline(model, byte_tokenizer())
        _LOADED[arch.id] = (base, draft_dir, base.generate(PROMPT, NEW_TOKENS).tokens)
    return _LOADED[arch.id]


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.id)
def test_standard_decoding_is_transformers_generate(arch):
    """The session's own decoding (every layer's entries kept, the window in the mask) is
    what transformers' generate gives with its own caches."""
    base, _, expected = loaded(arch)
    prompt = torch.tensor([PROMPT])
    generated = base.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(expected), do_sample=False,
        eos_token_id=None, pad_token_id=258,
    )[0, len(PROMPT) :].tolist()  # fmt: skip
    assert generated == expected


def test_the_matrix_covers_every_family():
    families = {a.family for a in ARCHITECTURES}
    assert len(ARCHITECTURES) >= 25
    assert {
        "rotary",
        "partial rotary",
        "absolute",
        "alibi",
        "sliding",
        "hybrid",
        "moe",
        "chunked moe",
    } <= families
    for model_type in (
        "mistral",
        "gemma2",
        "gemma3_text",
        "bloom",
        "mixtral",
        "qwen3_moe",
        "gpt2",
        "opt",
        "llama4_text",
    ):
        assert model_type in {a.model_type for a in ARCHITECTURES}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.id)
def test_greedy_identical_on_every_architecture(arch, pipeline):
    base, _, expected = loaded(arch)
    proposer, verifier = PIPELINES[pipeline]
    speculative = base.with_components(proposer(arch), verifier)
    result = speculative.generate(PROMPT, NEW_TOKENS)
    assert result.tokens == expected
    assert result.stats.proposed > 0, "nothing was drafted: the pipeline was not exercised"


def test_every_architecture_accepts_drafts():
    """Across its pipelines, each architecture accepted draft tokens in chains and in trees,
    so identity above was tested on accepted paths, not only on rejected drafts."""
    for arch in ARCHITECTURES:
        base, _, _ = loaded(arch)
        accepted = {}
        for name, (proposer, verifier) in PIPELINES.items():
            accepted[name] = (
                base.with_components(proposer(arch), verifier).generate(PROMPT, 24).stats.accepted
            )
        assert accepted["draft chain"] + accepted["ngram chain"] > 0, (arch.id, accepted)
        assert accepted["draft tree"] + accepted["ngram tree"] > 0, (arch.id, accepted)


ONE_PER_FAMILY = ["llama", "phi", "gpt2", "bloom", "mistral", "gemma3_text", "mixtral", "llama4"]


@pytest.mark.parametrize("pipeline", ["draft chain", "draft tree"])
@pytest.mark.parametrize(
    "arch",
    [  # the default target's family in every tier; the others (20-30 s each) in the slow one
        a if a.id == "llama" else pytest.param(a, marks=pytest.mark.slow)
        for a in ARCHITECTURES
        if a.id in ONE_PER_FAMILY
    ],
    ids=lambda a: a.id,
)
def test_sampling_distribution_on_every_attention_family(arch, pipeline):
    """At temperature 1 (top-k 4, so 16 cells), the first two tokens after a prompt four
    windows long follow the target's own two-token distribution: rejection sampling on
    chains, the tree verifier on trees."""
    base, _, _ = loaded(arch)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    proposer, _ = PIPELINES[pipeline]
    verifier = "rejection" if pipeline == "draft chain" else "tree"
    speculative = base.with_components(proposer(arch), verifier, sampling=sampling)
    assert_first_two_tokens_follow_the_target(base, speculative, PROMPT, sampling, 400, f"{arch.id} drafts")


def test_llama4_tree_and_packed_passes_scale_each_query_by_its_own_position():
    """Llama 4 scales a query without rotary positions by its position, which transformers
    takes from the cache's length. A tree node (position = depth) and a packed pass (several
    requests) get the logits of a chain pass over the node's own path (they did not when the
    scale changed inside the pass: floor_scale 4 in the tiny model)."""
    from specdec.decoders.models.target import Target

    target = Target(loaded(next(a for a in ARCHITECTURES if a.id == "llama4"))[0].model)
    prompt, block, parents = PROMPT[:30], [5, 6, 7, 8], [-1, -1, -1, 2]  # three roots, one child
    session = target.session()
    session.forward(prompt)
    tree = session.forward(block, parents)
    paths = [[5], [6], [7], [7, 8]]
    for node, path in enumerate(paths):
        session.truncate(len(prompt))
        torch.testing.assert_close(tree[node], session.forward(path)[-1], rtol=1e-12, atol=1e-12)
    sessions = [target.session(), target.session()]
    for other in sessions:
        other.forward(prompt)
    packed = target.packed_forward(sessions, [block, [9, 10]], [parents, None])
    torch.testing.assert_close(packed[0], tree, rtol=1e-12, atol=1e-12)
    session.truncate(len(prompt))
    torch.testing.assert_close(packed[1], session.forward([9, 10]), rtol=1e-12, atol=1e-12)


def test_a_recurrent_cache_is_refused_when_the_session_is_built():
    """A model with a layer whose cache cannot be cut back (a linear-attention state) is
    refused in one line naming the model and the layer, before anything runs."""
    from specdec.decoders.models.session import ModelSession

    model = ARCHITECTURES[0].build(0)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM: layer 1 is 'linear_attention'"):
        ModelSession(model)


def test_alibi_without_per_key_positions_refuses_trees_and_runs_chains():
    """MPT builds its ALiBi biases from key indexes inside its forward: chains run, a tree
    verifier is refused when the pipeline is built, and a tree pass by any other route in
    one line, instead of giving its nodes the wrong biases."""
    mpt = Architecture("mpt", "alibi")
    base = Pipeline(mpt.build(0), byte_tokenizer())
    expected = base.generate(PROMPT, 16).tokens
    chain = base.with_components({"name": "ngram", "adaptive": False}, "greedy")
    assert chain.generate(PROMPT, 16).tokens == expected
    with pytest.raises(UnsupportedArchitectureError, match="verifier=tree: MptForCausalLM adds ALiBi biases"):
        base.with_components({"name": "ngram", "branches": 3}, "tree")
    base.session.reset()
    base.session.forward(PROMPT)
    with pytest.raises(UnsupportedArchitectureError, match="tree drafts: MptForCausalLM"):
        base.session.forward([1, 2, 3], parents=[-1, -1, 0])


@pytest.mark.parametrize("model_type", ["gpt2", "mistral"])
def test_exact_mode_refuses_what_it_cannot_make_bit_identical(model_type):
    """model.exact=true on an architecture whose passes exact mode cannot route (GPT-2's Conv1D
    projections; a sliding window) is refused in one line."""
    from specdec.decoders.models.loading import ModelConfig, prepare_model

    arch = next(a for a in ARCHITECTURES if a.id == model_type)
    with pytest.raises(
        UnsupportedArchitectureError, match="model.exact=true: .* NOT bit-identical.*model.exact=false"
    ):
        prepare_model(arch.build(), ModelConfig(name="hf", dtype="float32", exact="true", device="cpu"))


def test_early_exit_refuses_a_decoder_it_cannot_split():
    """The early exit runs the target's layers range by range; on a sliding-window model it
    is refused in one line naming the decoder and what is missing."""
    base, _, _ = loaded(next(a for a in ARCHITECTURES if a.id == "mistral"))
    with pytest.raises(UnsupportedArchitectureError, match="MistralModel uses attention layer types"):
        base.with_components({"name": "early_exit", "exit_layer": 1}, "greedy")


def test_exact_auto_goes_off_where_the_check_fails(monkeypatch, capsys):
    """model.exact=auto (on for bfloat16 on CPU) switches exact mode off, saying why, where
    the start-up check finds the rows not bit-identical on this machine or architecture."""
    from specdec.decoders.models import invariance
    from specdec.decoders.models.loading import ModelConfig, load_model

    failing = invariance.InvarianceReport(0, 5, 0, 6, max_difference=1e-3)
    monkeypatch.setattr(invariance, "check_pass_invariance", lambda model: failing)
    model, _ = load_model(ModelConfig(name="tiny-random", dtype="bfloat16", exact="auto"))
    assert not model.exact and not model.exact_attention
    assert "but verification rows NOT bit-identical" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["gpt2", "bloom", "opt"])
def test_eagle_refuses_a_decoder_that_is_not_llama_style(model_type):
    """EAGLE copies a decoder layer of the target and adapts its projections: on a decoder
    without them it is refused in one line, before it asks for an artifact to be trained."""
    base, _, _ = loaded(next(a for a in ARCHITECTURES if a.id == model_type))
    with pytest.raises(UnsupportedArchitectureError, match="eagle needs a Llama-style decoder"):
        base.with_components("eagle", "greedy")


def test_tree_masks_apply_each_layer_types_window():
    """A tree after 6 cached positions, nodes at the positions of their depth: a sliding
    layer (window 3) sees keys less than 3 positions back, a chunked one (chunks of 4) keys
    in the node's chunk, a full one every ancestor and the whole prefix."""
    from specdec.decoders.models.architecture import AttentionPattern
    from specdec.decoders.models.session import tree_attention_masks

    parents = [-1, 0, 0, 1]  # positions 6, 7, 7, 8
    patterns = [
        AttentionPattern("full", None, "full_attention"),
        AttentionPattern("sliding", 3, "sliding_attention"),
        AttentionPattern("chunked", 4, "chunked_attention"),
    ]
    masks = tree_attention_masks(parents, 6, patterns, torch.float32, torch.device("cpu"))
    allowed = {kind: (mask[0, 0] == 0) for kind, mask in masks.items()}  # (4 nodes, 6 + 4 keys)
    # node 3 (position 8, ancestors 0 and 1 at positions 6 and 7)
    assert allowed["full_attention"][3].tolist() == [True] * 6 + [True, True, False, True]
    assert allowed["sliding_attention"][3].tolist() == [False] * 6 + [True, True, False, True]
    chunk = allowed["chunked_attention"]
    assert chunk[3].tolist() == [False] * 6 + [False, False, False, True]  # position 8 starts a chunk
    assert chunk[1].tolist() == [False] * 4 + [True, True] + [True, True, False, False]  # 7: chunk 4-7
    assert allowed["sliding_attention"][0].tolist() == [False] * 4 + [True, True] + [
        True,
        False,
        False,
        False,
    ]
