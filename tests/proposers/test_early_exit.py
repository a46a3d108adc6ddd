"""Early-exit self-drafting: lossless with and without KV reuse, and the reused
verification pass equals an ordinary full pass (logits and every layer's KV)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.state import DecodeState
from specdec.decoders.models.cost import CostCurve
from specdec.decoders.models.layered import (
    LayeredDecoder,
    UnsupportedArchitectureError,
    check_layered_equivalence,
)
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.session import ModelSession
from specdec.proposers.early_exit import EarlyExitProposer, ExitHead, exit_artifact_dir
from tests.conftest import REPO_ROOT, random_prompts

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def deep_config() -> ModelConfig:
    return ModelConfig(name="tiny-random", dtype="float64", device="cpu", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def deep_model(deep_config):
    target, tokenizer = load_model(deep_config)
    return target.model, tokenizer


@pytest.fixture()
def base(deep_model, deep_config, tmp_path) -> Pipeline:
    model, tokenizer = deep_model
    return Pipeline(model, tokenizer, model_config=deep_config, artifacts_dir=tmp_path / "artifacts")


def early_exit(base: Pipeline, verifier: str = "greedy", **options) -> Pipeline:
    return base.with_components({"name": "early_exit", **options}, verifier)


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_greedy_output_equals_standard(base, kv_reuse):
    prompts = random_prompts(3, seed=1)
    # Greedy output under a smaller budget is a prefix of this one (EOS included).
    standard = [base.generate(prompt, 23).tokens for prompt in prompts]
    accepted = 0
    for exit_layer in (1, 2, 3):
        pipeline = early_exit(base, exit_layer=exit_layer, kv_reuse=kv_reuse)
        for k in (1, 4):
            pipeline.proposer.config.k = k
            for prompt, expected in zip(prompts, standard):
                for max_new in (1, 6, 23):
                    result = pipeline.generate(prompt, max_new)
                    assert result.tokens == expected[:max_new], (exit_layer, k, kv_reuse, prompt, max_new)
                    accepted += result.stats.accepted
    assert accepted > 0, "no draft token was ever accepted: the test exercised nothing"


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_full_depth_exit_is_always_accepted_and_stops_mid_draft(base, kv_reuse):
    """exit_layer = L drafts with the whole target: every draft token is accepted, so
    max_new_tokens and EOS fall inside drafts, and output must still stop right there."""
    pipeline = early_exit(base, exit_layer=NUM_LAYERS, k=4, kv_reuse=kv_reuse)
    proposed = 0
    for prompt in random_prompts(4, seed=3):
        for max_new in (2, 7, 13):
            result = pipeline.generate(prompt, max_new)
            assert result.tokens == base.generate(prompt, max_new).tokens
            assert result.stats.accepted == result.stats.proposed
            proposed += result.stats.proposed
        free = base.generate(prompt, 30).tokens
        eos = free[len(free) // 2]
        expected = free[: free.index(eos) + 1]
        base.model.generation_config.eos_token_id = eos
        try:
            assert pipeline.generate(prompt, 30).tokens == expected
        finally:
            base.model.generation_config.eos_token_id = 257
    assert proposed > 0


def drafted_round(proposer: EarlyExitProposer, model, prompt: list[int]):
    """A session after prefill + one drafting round, and the block the target verifies."""
    session = ModelSession(model)
    sampling = SamplingConfig()
    first = int(session.forward(prompt)[-1].argmax())
    state = DecodeState(
        prompt + [first], len(prompt), sampling, sampling.generator(), session.hidden, session=session
    )
    proposer.begin(state)
    draft = proposer.propose(state)
    return session, [first] + draft.tokens


def assert_same_cache(session: ModelSession, reference: ModelSession) -> None:
    assert session.cached == reference.cached
    for layer, expected in zip(session.cache.layers, reference.cache.layers):
        torch.testing.assert_close(layer.keys, expected.keys)
        torch.testing.assert_close(layer.values, expected.values)


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("cut", [0, 2, None])  # draft tokens the verifier sees (None = all)
def test_reused_verify_pass_equals_full_pass(base, deep_model, exit_layer, cut):
    model, _ = deep_model
    proposer = early_exit(base, exit_layer=exit_layer, k=4, adaptive=False).proposer
    for prompt in random_prompts(3, seed=exit_layer):
        session, block = drafted_round(proposer, model, prompt)
        block = block if cut is None else block[: cut + 1]
        # Drafting advanced only the shallow layers.
        assert session.cache.get_seq_length(0) == len(prompt) + 4
        assert session.cache.get_seq_length(NUM_LAYERS - 1) == len(prompt)
        logits = proposer.verify_forward(session, block, None)

        reference = ModelSession(model)
        reference.forward(prompt)
        torch.testing.assert_close(logits, reference.forward(block))
        torch.testing.assert_close(session.hidden, reference.hidden)
        assert_same_cache(session, reference)
        # Rollback after a partial acceptance applies to every layer alike.
        kept = [0, 1] if len(block) > 1 else [0]
        session.keep(len(prompt), kept)
        reference.keep(len(prompt), kept)
        assert_same_cache(session, reference)


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_kv_reuse_replaces_the_full_verification_pass(base, kv_reuse):
    """With reuse the target's full forward runs only for the prefill; without it,
    once per round as well, and the shallow layers never run ahead afterwards."""
    pipeline = early_exit(base, exit_layer=2, k=3, kv_reuse=kv_reuse, adaptive=False)
    session = pipeline.session
    full_passes = []
    forward = session.forward
    session.forward = lambda tokens, parents=None, **kw: (
        full_passes.append(len(tokens)) or forward(tokens, parents, **kw)
    )
    result = pipeline.generate(random_prompts(1, seed=5)[0], 20)
    rounds = result.stats.target_passes
    assert len(full_passes) == (1 if kv_reuse else 1 + rounds)
    assert session.cache.get_seq_length(0) == session.cache.get_seq_length(NUM_LAYERS - 1) == len(session)


def test_the_exit_stops_drafting_where_no_draft_can_pay(deep_model, deep_config, tmp_path, monkeypatch):
    """Drafting with every layer costs a full pass per drafted token, so no draft pays
    though every one is accepted: the adaptive length is 0 but for one-token probes
    (after 16 rounds, then 32, ...), a round without a draft runs no layer while drafting, and the
    output is standard decoding's. A shallow exit (a quarter of the cost) drafts."""
    model, tokenizer = deep_model
    flat = CostCurve({n: 0.01 for n in (1, 2, 4, 8)})
    base = Pipeline(model, tokenizer, model_config=deep_config, artifacts_dir=tmp_path, cost_curve=flat)
    prompt = random_prompts(1, seed=3)[0]
    whole = early_exit(base, exit_layer=NUM_LAYERS, k=3)
    layer_runs = []
    run = LayeredDecoder.run
    monkeypatch.setattr(
        LayeredDecoder, "run", lambda self, *args: layer_runs.append(args[1:]) or run(self, *args)
    )
    propose = whole.proposer.propose
    drafts = []  # (draft size, layer runs while drafting) per round

    def counted(state):
        before = len(layer_runs)
        draft = propose(state)
        drafts.append((len(draft), len(layer_runs) - before))
        return draft

    whole.proposer.propose = counted
    result = whole.generate(prompt, 40)
    assert result.tokens == base.generate(prompt, 40).tokens
    assert all(runs == 0 for size, runs in drafts if size == 0)
    drafted = [size for size, _ in drafts if size]
    assert drafted and max(drafted) == 1 and len(drafted) <= len(drafts) // 16 + 1
    assert early_exit(base, exit_layer=1, k=3).generate(prompt, 40).stats.draft_sizes[0] == 3
    # an exit never sure enough (min_confidence 1) drafts nothing, but each try costs a
    # shallow pass: the tries count as failures, and the shallow layers soon stop running
    unsure = early_exit(base, exit_layer=1, k=3, min_confidence=1.0)
    propose, drafts = unsure.proposer.propose, []  # what counted() wraps and fills
    unsure.proposer.propose = counted
    assert unsure.generate(prompt, 40).tokens == result.tokens
    tried = [runs for _, runs in drafts if runs]
    assert len(tried) <= 3 + len(drafts) // 16


def test_sampled_drafts_carry_their_distribution(base):
    """At temperature 1 the draft tokens come with draft_probs; drafting with the whole
    target (p = q) is then accepted every time by speculative sampling."""
    sampled = Pipeline(
        base.model, base.tokenizer, sampling=SamplingConfig(temperature=1.0, seed=7),
        model_config=base.context.model_config, artifacts_dir=base.context.artifacts_dir,
    )  # fmt: skip
    pipeline = early_exit(sampled, "rejection", exit_layer=NUM_LAYERS, k=3)
    result = pipeline.generate(random_prompts(1, seed=2)[0], 24)
    assert result.stats.proposed > 0 and result.stats.acceptance_rate == 1.0
    shallow = early_exit(sampled, "rejection", exit_layer=1, k=3)
    assert shallow.generate(random_prompts(1, seed=2)[0], 24).stats.new_tokens == 24


def test_untrained_exit_is_the_targets_norm_and_head(deep_model):
    model, _ = deep_model
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    expected = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(ExitHead(model, 2)(hidden), expected)


def trained_exit(model, exit_layer: int, adapt_layer: int | None = None) -> ExitHead:
    """An ExitHead with nonzero adapter and head LoRA weights, as if trained."""
    head = ExitHead(model, exit_layer, adapter_rank=4, head_lora_rank=2)
    if adapt_layer is not None:
        head.adapt_shallow_layer(model, adapt_layer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.05)
    return head


@pytest.mark.parametrize("adapt_layer", [None, 1])
def test_trained_exit_loads_and_stays_lossless(base, deep_model, adapt_layer):
    model, _ = deep_model
    head = trained_exit(model, 2, adapt_layer)
    head.save(exit_artifact_dir(base.context, 2))
    untrained = early_exit(base, exit_layer=2, k=3)
    if adapt_layer is None:
        trained = early_exit(base, exit_layer=2, k=3, trained=True)
        assert trained.proposer.kv_reuse, "an exit that leaves the shallow layers alone keeps reuse"
    else:
        with pytest.warns(UserWarning, match="kv_reuse is off"):
            trained = early_exit(base, exit_layer=2, k=3, trained=True)
        assert not trained.proposer.kv_reuse
        assert trained.proposer.describe()["adapted_shallow_layers"] == [adapt_layer]
    loaded = trained.proposer.exit_head
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden), head(hidden))
    drafts_differ = False
    for prompt in random_prompts(4, seed=9):
        expected = base.generate(prompt, 20).tokens
        assert trained.generate(prompt, 20).tokens == expected
        session, trained_block = drafted_round(trained.proposer, model, prompt)
        _, untrained_block = drafted_round(untrained.proposer, model, prompt)
        drafts_differ |= trained_block != untrained_block
    assert drafts_differ, "the trained exit never changed a draft: was it applied?"


def test_missing_trained_exit_names_the_training_command(base):
    with pytest.raises(FileNotFoundError, match="python -m specdec.train drafter=early_exit"):
        early_exit(base, exit_layer=2, trained=True)


@pytest.mark.parametrize("exit_layer", [0, NUM_LAYERS + 1])
def test_exit_layer_out_of_range_is_refused(base, exit_layer):
    with pytest.raises(ValueError, match=r"exit_layer must be in \[1, 4\]"):
        early_exit(base, exit_layer=exit_layer)


def test_default_exit_layer_is_recorded_in_the_config(base):
    proposer = early_exit(base).proposer
    assert proposer.config.exit_layer == proposer.describe()["exit_layer"] == NUM_LAYERS // 2


def test_gemma_runs_layer_by_layer():
    """Gemma scales embeddings inside its embedding module, so range-by-range runs match."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    check_layered_equivalence(GemmaForCausalLM(config).double().eval(), 1)


def test_sliding_window_attention_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=8, max_window_layers=0,
    )  # fmt: skip
    with pytest.raises(UnsupportedArchitectureError, match="sliding_attention"):
        LayeredDecoder(ModelSession(Qwen2ForCausalLM(config).eval()))


def test_decoders_that_do_more_than_stack_layers_are_refused(deep_config):
    """A decoder whose forward changes the embeddings before layer 0 (as Gemma's did
    before its scaling moved into the embedding module): range-by-range runs would
    silently differ, so the equivalence probe refuses the model."""
    model = load_model(deep_config)[0].model
    decoder_forward = model.model.forward

    def scaled_forward(input_ids=None, **kwargs):
        return decoder_forward(inputs_embeds=model.model.embed_tokens(input_ids) * 2.0, **kwargs)

    model.model.forward = scaled_forward
    with pytest.raises(UnsupportedArchitectureError, match="does not reproduce its forward pass"):
        check_layered_equivalence(model, 2)


TINY_EXIT_RECIPE = [
    "model=tiny-random",
    f"model.num_layers={NUM_LAYERS}",
    "model.dtype=float64",
    "logger=disabled",
    "train.data.magpie_prompts=0",
    "train.data.templated_prompts=40",
    "train.data.passages=4",
    "train.data.max_new_tokens=32",
    "train.data.batch_size=20",
    "train.data.heldout=0.2",
    "drafter=early_exit",
    "drafter.exit_layer=2",
    "drafter.adapter_rank=16",
    "drafter.head_lora_rank=4",
    "drafter.epochs=4",
    "drafter.batch_size=4",
    "drafter.lr=0.01",
]


def test_training_the_exit_brings_it_closer_to_the_target(tmp_path, deep_model, deep_config):
    """`python -m specdec.train drafter=early_exit` on the tiny model: the held-out KL to the
    full-depth distribution drops, the artifact loads into the proposer (reuse kept),
    and a shallow-LoRA exit loads with reuse switched off; both stay lossless."""
    from hydra import compose, initialize_config_dir

    from specdec.train.job import run

    model, tokenizer = deep_model
    base = Pipeline(model, tokenizer, model_config=deep_config, artifacts_dir=tmp_path)
    prompts = random_prompts(3, seed=4)
    standard = [base.generate(prompt, 20).tokens for prompt in prompts]
    for shallow_lora_layers in (0, 1):
        overrides = TINY_EXIT_RECIPE + [
            f"artifacts_dir={tmp_path}",
            f"drafter.shallow_lora_layers={shallow_lora_layers}",
        ]
        with initialize_config_dir(config_dir=str(Path(REPO_ROOT) / "conf"), version_base="1.3"):
            output = run(compose("train", overrides=overrides))
        assert output == exit_artifact_dir(base.context, 2)
        metrics = json.loads((output / "training.json").read_text())
        assert metrics["trained"]["heldout"]["kl"] < 0.8 * metrics["untrained"]["heldout"]["kl"]
        assert metrics["trained"]["heldout"]["positions"] > 0
        pipeline = early_exit(base, exit_layer=2, k=3, trained=True)
        assert pipeline.proposer.kv_reuse == (shallow_lora_layers == 0)
        for prompt, expected in zip(prompts, standard):
            assert pipeline.generate(prompt, 20).tokens == expected


def test_a_bfloat16_target_trains_its_exit_in_float32(tmp_path):
    """The README's command on a CPU with native bf16 (dtype auto = bfloat16): the data
    comes from the bfloat16 target, the exit trains in float32 instead of being refused."""
    from hydra import compose, initialize_config_dir
    from safetensors.torch import load_file

    from specdec.proposers.early_exit import EXIT_WEIGHTS
    from specdec.train.job import run

    overrides = [o for o in TINY_EXIT_RECIPE if not o.startswith("model.dtype")] + [
        "model.dtype=bfloat16",
        "drafter.epochs=1",
        f"artifacts_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=str(Path(REPO_ROOT) / "conf"), version_base="1.3"):
        output = run(compose("train", overrides=overrides))
    assert json.loads((output / "training.json").read_text())["trained"]["heldout"]["positions"] > 0
    weights = load_file(output / EXIT_WEIGHTS)
    assert weights and all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
