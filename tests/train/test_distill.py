"""The distilled draft model (train/draft_model.py) and the draft_model proposer's
reduced vocabulary: distillation raises acceptance, the artifact is an ordinary
HF model, drafting over a reduced vocabulary stays lossless, and the draft's
cache never reruns committed tokens."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.decoders import Pipeline
from specdec.decoders.cli.config import to_dataclass
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.audit import sample_outcomes
from specdec.decoders.evaluation.audit_statistics import (
    combined_p_value,
    exact_distribution,
    sequential_goodness_of_fit,
)
from specdec.decoders.models.loading import ModelConfig
from specdec.proposers.draft_model import DRAFT_VOCAB_FILE, FROM_TARGET_FILE, load_draft_sharing_target
from specdec.train.data import DataConfig, self_distilled, split_heldout
from specdec.train.draft_model import (
    META_FILE,
    build_draft,
    chosen_layers,
    distillation_loss,
    total_variation,
)
from specdec.train.job import run
from specdec.train.ship import ship
from tests.conftest import spy_drafts
from tests.train.test_train import compose_train

TINY_DISTILL = [
    "model=tiny-random",
    "model.dtype=float64",
    "logger=disabled",
    "drafter=draft_model",
    "train.data.magpie_prompts=0",
    "train.data.templated_prompts=36",
    "train.data.passages=4",
    "train.data.max_new_tokens=40",
    "train.data.batch_size=20",
    "train.data.heldout=0.2",
    "drafter.num_layers=1",
    "drafter.draft_vocab_size=0",
    "drafter.epochs=6",
    "drafter.lr=0.003",
    "drafter.vocab_sizes=[32]",
]
REDUCED = 32  # draft vocabulary of the reduced-vocabulary tests


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> Path:
    """Artifacts directory holding a 1-layer draft distilled from the 2-layer tiny target."""
    artifacts = tmp_path_factory.mktemp("distill")
    run(compose_train(TINY_DISTILL + [f"artifacts_dir={artifacts}"]))
    return artifacts


def pipeline_over(
    tiny_model, tiny_config, artifacts: Path, sampling: SamplingConfig | None = None
) -> Pipeline:
    model, tokenizer = tiny_model
    return Pipeline(model, tokenizer, sampling=sampling, model_config=tiny_config, artifacts_dir=artifacts)


def heldout_prompts(pipeline: Pipeline, artifacts: Path) -> list[list[int]]:
    data_cfg = to_dataclass(DataConfig, compose_train(TINY_DISTILL).train.data, "train.data")
    root = artifacts / pipeline.context.target_key / "data"  # the cache the training run wrote
    _, heldout = split_heldout(self_distilled(pipeline, data_cfg, root), data_cfg.heldout)
    return [s.prompt for s in heldout]


def test_distillation_raises_acceptance_on_heldout_prompts(distilled, tiny_model, tiny_config, tmp_path):
    """Greedy speculative decoding of held-out prompts with the distilled draft accepts
    more than with the draft it started from (the target's layer 0), same outputs."""
    standard = pipeline_over(tiny_model, tiny_config, distilled)
    initial_dir = tmp_path / "initial"
    build_draft(standard.model, [0]).save_pretrained(initial_dir)
    standard.tokenizer.save_pretrained(initial_dir)
    trained = standard.with_components({"name": "draft_model", "tree": False, "k": 4}, "greedy")
    initial = standard.with_components(
        {"name": "draft_model", "tree": False, "k": 4, "name_or_path": str(initial_dir)}, "greedy"
    )
    counts = {"trained": [0, 0], "initial": [0, 0]}  # accepted, proposed
    prompts = heldout_prompts(standard, distilled)
    assert len(prompts) >= 4
    for prompt in prompts:
        expected = standard.generate(prompt, 40).tokens
        for name, pipeline in (("trained", trained), ("initial", initial)):
            result = pipeline.generate(prompt, 40)
            assert result.tokens == expected
            counts[name][0] += result.stats.accepted
            counts[name][1] += result.stats.proposed
    trained_rate, initial_rate = (accepted / proposed for accepted, proposed in counts.values())
    assert trained_rate > initial_rate + 0.15, counts

    meta = json.loads((distilled / standard.context.target_key / "draft_model" / META_FILE).read_text())
    before, after = meta["initial_metrics"]["heldout"], meta["metrics"]["heldout"]
    assert after["top1"] > before["top1"] + 0.15
    assert after["acceptance"] > before["acceptance"] and after["kl"] < 0.5 * before["kl"]
    assert after["chain_tau"] > before["chain_tau"] + 0.5
    assert meta["target_layers"] == [0]


def test_saved_draft_is_an_ordinary_hf_model(distilled, tiny_model):
    target, tokenizer = tiny_model
    artifact = distilled / "tiny-random-v320-h64-l2-s0" / "draft_model"
    assert not (artifact / "checkpoint").exists()
    draft = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float64)
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == 320
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)  # frozen: the target's head
    assert not torch.equal(
        draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight
    )  # trained
    assert AutoTokenizer.from_pretrained(artifact).get_vocab() == tokenizer.get_vocab()
    ranked = json.loads((artifact / DRAFT_VOCAB_FILE).read_text())
    assert ranked["counts"] == sorted(ranked["counts"], reverse=True) and min(ranked["counts"]) > 0
    assert ranked["full_vocab_size"] == 320 and sum(ranked["counts"]) == ranked["counted_tokens"]


def test_total_variation_over_a_draft_vocabulary_raises_agreement_there(distilled, tmp_path):
    """loss=tv with draft_vocab_size=32 (same cached data, another output): the draft's
    greedy agreement with the target among those 32 tokens rises. (Its 1 - TV there
    starts at its ceiling, the target's mass on the 32 tokens: this target is flat.)"""
    data = distilled / "tiny-random-v320-h64-l2-s0" / "data"
    options = [
        "drafter.loss=tv",
        "drafter.draft_vocab_size=32",
        "drafter.epochs=4",
    ]  # 3: 1 seed in 4 misses the bar
    artifact = run(
        compose_train(TINY_DISTILL + options + [f"train.data_dir={data}", f"train.output={tmp_path}"])
    )
    meta = json.loads((artifact / META_FILE).read_text())
    before, after = meta["initial_metrics"]["heldout"], meta["metrics"]["heldout"]
    assert meta["draft_vocab_size"] == 32 and meta["training"]["config"]["loss"] == "tv"
    assert after["top1_v32"] > before["top1_v32"] + 0.1
    assert after["acceptance_v32"] >= before["acceptance_v32"] - 0.005


def test_draft_from_all_layers_is_the_target(tiny_model):
    """Copying every layer rebuilds the target: the weights land where they belong."""
    target, _ = tiny_model
    draft = build_draft(target, [0, 1]).double()
    input_ids = torch.tensor([[5, 17, 200, 3, 99, 42]])
    with torch.no_grad():
        torch.testing.assert_close(draft(input_ids=input_ids).logits, target(input_ids=input_ids).logits)
    assert chosen_layers("spread", 4, 30) == [0, 10, 19, 29]
    assert chosen_layers("first", 3, 30) == [0, 1, 2]
    with pytest.raises(ValueError, match="distinct ascending"):
        chosen_layers([3, 1], 2, 30)


def test_losses_are_kl_and_total_variation():
    target_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    draft_logits = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]))
    torch.testing.assert_close(total_variation(draft_logits, target_logits), torch.tensor([0.3, 0.0]))
    kl = 0.5 * math.log(0.5 / 0.2) + 0.2 * math.log(0.2 / 0.5)
    torch.testing.assert_close(distillation_loss(draft_logits, target_logits, "kl"), torch.tensor(kl / 2))
    torch.testing.assert_close(distillation_loss(draft_logits, target_logits, "tv"), torch.tensor(0.15))


def test_shipped_draft_stores_only_what_differs_from_the_target(distilled, tiny_model, tiny_config, tmp_path):
    """train.ship stores the distilled draft without the embeddings and head it shares with
    the target, nor the tokenizer; the proposer takes those from the target (the very
    tensors) and decodes as the unshipped draft does, losslessly."""
    target, tokenizer = tiny_model
    artifact = distilled / "tiny-random-v320-h64-l2-s0" / "draft_model"
    shipped = tmp_path / "shipped"
    ship(artifact, shipped, target, tokenizer)
    stored = load_file(shipped / "model.safetensors")
    shared = json.loads((shipped / FROM_TARGET_FILE).read_text())["tensors"]
    assert "model.embed_tokens.weight" in shared and not set(shared) & set(stored)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert not any(name.startswith("tokenizer") for name in os.listdir(shipped))
    assert (shipped / DRAFT_VOCAB_FILE).exists()

    standard = pipeline_over(tiny_model, tiny_config, distilled)
    from_ship = standard.with_components(
        {"name": "draft_model", "tree": False, "k": 4, "name_or_path": str(shipped)}, "greedy"
    )
    draft = from_ship.proposer.model
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    layer = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(draft.state_dict()[layer], stored[layer].to(torch.float64))
    accepted = 0
    for prompt in ["Write a haiku about rain.", "List three primes."]:
        result = from_ship.generate(prompt, 40)
        assert result.tokens == standard.generate(prompt, 40).tokens
        accepted += result.stats.accepted
    assert accepted > 0


def test_a_draft_for_another_target_is_refused(distilled, tiny_model, tmp_path):
    target, tokenizer = tiny_model
    shipped = tmp_path / "shipped"
    ship(distilled / "tiny-random-v320-h64-l2-s0" / "draft_model", shipped, target, tokenizer)
    record = json.loads((shipped / FROM_TARGET_FILE).read_text())
    (shipped / FROM_TARGET_FILE).write_text(json.dumps({**record, "tensors": ["model.not_there.weight"]}))
    config = ModelConfig(name="hf", name_or_path=str(shipped), dtype="float64")
    with pytest.raises(ValueError, match="does not fit this target"):
        load_draft_sharing_target(shipped, target, config)


def reduced_spec(**options) -> dict:
    return {"name": "draft_model", "tree": False, "k": 4, "vocab_size": REDUCED, **options}


@pytest.mark.parametrize("options", [{}, {"tree": True, "k": 3, "tree_width": 3}], ids=["chain", "tree"])
def test_reduced_vocabulary_greedy_equals_standard_greedy(distilled, tiny_model, tiny_config, options):
    standard = pipeline_over(tiny_model, tiny_config, distilled)
    speculative = standard.with_components(reduced_spec(**options), "tree" if options else "greedy")
    vocabulary = set(speculative.proposer.vocabulary.token_ids.tolist())
    assert len(vocabulary) == REDUCED and speculative.proposer.session.lm_head.out_features == REDUCED
    drafted: list[int] = []
    spy_drafts(speculative.proposer, lambda state, draft: drafted.extend(draft.tokens))
    accepted = 0
    for prompt in ["Write a haiku about rain.", "Summarize: tides follow the moon.", "List three primes."]:
        result = speculative.generate(prompt, 40)
        assert result.tokens == standard.generate(prompt, 40).tokens
        accepted += result.stats.accepted
    assert accepted > 0 and drafted and set(drafted) <= vocabulary


@pytest.mark.parametrize("options", [{}, {"tree": True, "k": 2, "tree_width": 3}], ids=["chain", "tree"])
def test_a_reduced_vocabulary_draft_drafts_a_batch_in_packed_passes(
    distilled, tiny_model, tiny_config, options, monkeypatch
):
    """In a batch each request has a session of its own over the draft, with the head cut
    to the reduced vocabulary as the first one's; the requests' draft passes (a chain's
    tokens, a tree's levels) run as one packed pass per step, and every request decodes as
    it would alone."""
    from specdec.decoders.engine.drafting import ModelPass

    standard = pipeline_over(tiny_model, tiny_config, distilled)
    speculative = standard.with_components(reduced_spec(**options), "tree" if options else "greedy")
    joined: list[int] = []
    run_together = ModelPass.run_together.__func__

    def recording(cls, works):
        joined.append((len(works), works[0].parents is not None))
        return run_together(cls, works)

    monkeypatch.setattr(ModelPass, "run_together", classmethod(recording))
    prompts = ["Write a haiku about rain.", "Summarize: tides follow the moon.", "List three primes."]
    batch = speculative.generate_batch(prompts, 30, batch_size=3)
    assert [r.tokens for r in batch.results] == [standard.generate(p, 30).tokens for p in prompts]
    assert sum(r.stats.accepted for r in batch.results) > 0
    assert max(joined)[0] == 3  # the three requests' passes in one call
    if options:  # and a tree's deeper level: every request's frontier in one pass
        assert max(size for size, tree in joined if tree) >= 2


def test_reduced_vocabulary_sampling_has_standard_decodings_distribution(distilled, tiny_model, tiny_config):
    """Temperature 1 (top-k 6 keeps the outcomes enumerable): the first 3 tokens of 300
    speculative samples fit standard decoding's exact distribution, although the
    target's candidates include tokens outside the draft's vocabulary (q = 0 there)."""
    sampling = SamplingConfig(temperature=1.0, top_k=6)
    standard = pipeline_over(tiny_model, tiny_config, distilled, sampling)
    speculative = standard.with_components(reduced_spec(k=2), "rejection", sampling)
    prompt = standard.encode("Write a haiku about rain.")
    expected = exact_distribution(standard.model, prompt, sampling, 3, standard.eos_token_ids())
    vocabulary = set(speculative.proposer.vocabulary.token_ids.tolist())
    assert {token for outcome in expected for token in outcome} - vocabulary, "no q = 0 case is exercised"
    observed = sample_outcomes(speculative, prompt, 3, range(300))
    positions = sequential_goodness_of_fit(observed, expected)
    assert sum(test.impossible for test in positions) == 0
    assert min(test.dof for test in positions) >= 3
    assert combined_p_value(positions) > 0.001, positions
    drafts = []
    spy_drafts(speculative.proposer, lambda state, draft: drafts.append(draft))
    speculative.generate(prompt, 8, seed=1)
    outside = torch.ones(320, dtype=torch.bool)  # (vocab,)
    outside[speculative.proposer.vocabulary.token_ids] = False
    assert drafts
    for draft in drafts:  # q rows: full-vocabulary distributions, zero outside the draft's vocabulary
        assert draft.draft_probs.shape[-1] == 320 and bool((draft.draft_probs[:, outside] == 0).all())
        torch.testing.assert_close(draft.draft_probs.sum(-1), torch.ones(len(draft)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("vocab_size", [None, REDUCED])
def test_draft_cache_never_reruns_committed_tokens(
    distilled, tiny_model, tiny_config, temperature, vocab_size
):
    """Every committed token is fed to the draft exactly once in its committed context
    (accepted draft tokens stay cached; only rejected ones are fed again, corrected),
    and each round starts from a cache holding exactly the committed tokens' prefix."""
    sampling = SamplingConfig(temperature=temperature)
    standard = pipeline_over(tiny_model, tiny_config, distilled, sampling)
    speculative = standard.with_components(reduced_spec(vocab_size=vocab_size), None, sampling)
    session = speculative.proposer.session
    fed: list[tuple[int, list[int]]] = []  # each draft forward: (first fed position, cached + fed tokens)
    forward = session.forward

    def counting_forward(tokens, *args, **kwargs):
        fed.append((len(session.cached), session.cached + list(tokens)))
        return forward(tokens, *args, **kwargs)

    session.forward = counting_forward
    checked: list[bool] = []  # each round: synced, pending token fed

    spy_drafts(
        speculative.proposer,
        lambda state, draft: checked.append(session.cached[: len(state.tokens)] == state.tokens),
    )
    prompt = speculative.encode("Explain why the sky is blue.")
    result = speculative.generate(prompt, 40, seed=0)
    assert result.stats.accepted > 0 and result.stats.proposed > result.stats.accepted  # both cases occur
    committed = prompt + result.tokens
    runs = [0] * len(committed)  # times each committed position was fed in its committed context
    for start, context in fed:
        for position in range(start, min(len(context), len(committed))):
            runs[position] += context[: position + 1] == committed[: position + 1]
    assert runs[: len(committed) - 1] == [1] * (len(committed) - 1)
    assert checked and all(checked)


def test_describe_says_which_draft_ran(distilled, tiny_model, tiny_config):
    pipeline = pipeline_over(tiny_model, tiny_config, distilled).with_components("draft_model", "greedy")
    artifact = pipeline.proposer.describe()["artifact"]
    assert artifact["shipped"] is False and artifact["path"].endswith("draft_model")
