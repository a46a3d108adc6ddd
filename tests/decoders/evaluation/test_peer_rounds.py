"""transformers' assisted peers' rounds are counted (drafted and accepted tokens), and the bench
shows each contender's draft length and acceptance per category beside its tok/s."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.bench_config import BenchConfig
from specdec.decoders.evaluation.bench_results import category_drafts
from specdec.decoders.evaluation.contenders import peer_contender
from specdec.decoders.evaluation.metrics import summarize
from specdec.decoders.evaluation.peers import HFPeer
from tests.architectures import COMMON


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(**COMMON)  # the architecture matrix's tiny sizes
    return LlamaForCausalLM(config).eval()


def test_prompt_lookup_rounds_add_up_to_its_output(tiny_model):
    greedy = SamplingConfig(temperature=0.0)
    lookup = HFPeer(
        "hf_prompt_lookup",
        tiny_model,
        [],
        greedy,
        {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3},
    )
    prompt = [1, 2, 3, 4, 5] * 4 + [1, 2, 3]
    record = peer_contender(lookup).run(prompt, 24)
    plain = peer_contender(HFPeer("hf_generate", tiny_model, [], greedy)).run(prompt, 24)
    assert record.tokens == plain.tokens  # the counting changes nothing
    assert sum(record.emitted_per_round) == record.new_tokens == 24
    assert record.target_passes == len(record.draft_sizes) == len(record.emitted_per_round)
    assert record.proposed == sum(record.draft_sizes) > 0
    assert 0 <= record.accepted <= record.proposed
    assert all(0 <= size <= 4 for size in record.draft_sizes)
    # plain generate has no rounds to count; the model is left as it was
    assert plain.target_passes is None and plain.proposed is None
    assert "_get_candidate_generator" not in vars(tiny_model)
    figures = summarize([record])
    assert figures["mean_draft_size"] == pytest.approx(record.proposed / record.target_passes)
    assert figures["acceptance_rate"] == pytest.approx(record.accepted / record.proposed)


def test_prompt_lookup_drafts_its_own_setting_not_ngram_k():
    assert BenchConfig().prompt_lookup_tokens == 10
    with pytest.raises(ValueError, match="bench.prompt_lookup_tokens=0"):
        BenchConfig(prompt_lookup_tokens=0)


def test_the_category_table_shows_draft_length_and_acceptance_where_counted():
    payload = {
        "pipelines": [
            {
                "name": "standard",
                "kind": "standard",
                "categories": {"qa": {"tokens_per_s": 10.0}, "rag": {"tokens_per_s": 8.0}},
            },
            {
                "name": "ngram",
                "kind": "speculative",
                "categories": {
                    "qa": {"tokens_per_s": 15.0, "mean_draft_size": 6.25, "acceptance_rate": 0.5},
                    "rag": {"tokens_per_s": 9.0, "mean_draft_size": 2.0, "acceptance_rate": 0.25},
                },
            },
            {"name": "standard (A/A)", "kind": "control", "categories": {"qa": {"tokens_per_s": 10.0}}},
        ]
    }
    lines = category_drafts(payload)
    assert "draft tokens per pass / their acceptance" in lines[0]
    assert "standard (A/A)" not in lines[1] and "ngram" in lines[1]
    qa = next(line for line in lines if line.strip().startswith("qa"))
    assert "10.0" in qa and "15.0 6.2/0.50" in qa
    payload["pipelines"] = [{**e, "categories": {"qa": e["categories"]["qa"]}} for e in payload["pipelines"]]
    assert category_drafts(payload) == []  # one category: nothing to break down


def test_the_compiled_peer_runs_on_the_model_as_built_and_warms_two_lengths(monkeypatch):
    """``hf_compiled`` asks for transformers' static cache and compiled decoding, on the model as
    transformers builds it (the target's routes off for its calls, back on after), compiling on
    its first call over two prompt lengths."""
    from specdec.decoders.evaluation.peers import compiled_generate_kwargs
    from specdec.decoders.models.fused_layers import FusedLayer
    from specdec.decoders.models.kernels import RoutedLinear
    from specdec.decoders.models.loading import ModelConfig, load_model

    target, _ = load_model(ModelConfig(name="tiny-random", dtype="bfloat16", exact="true"))
    kwargs = compiled_generate_kwargs()
    assert kwargs["cache_implementation"] == "static" and kwargs["compile_config"]._compile_all_devices
    seen = []

    def generate(**options):
        routed = any(isinstance(m, (RoutedLinear, FusedLayer)) for m in target.model.modules())
        seen.append((options["input_ids"].shape[1], routed, options["cache_implementation"]))
        return torch.cat([options["input_ids"], options["input_ids"][:, :3]], dim=1)

    monkeypatch.setattr(target.model, "generate", generate)
    peer = HFPeer("hf_compiled", target.model, [], SamplingConfig(temperature=0.0), kwargs, plain=True)
    contender = peer_contender(peer, target)
    assert contender.run(list(range(10, 30)), 3).tokens == [10, 11, 12]
    assert seen == [(10, False, "static"), (20, False, "static"), (20, False, "static")]
    contender.run(list(range(10, 30)), 3)
    assert len(seen) == 4  # warmed once
    assert target.exact and any(isinstance(m, FusedLayer) for m in target.model.modules())
