"""Bad input fails early with a message that names the problem and the fix."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.decoders.evaluation.workloads import WorkloadConfig, load_workload
from specdec.decoders.models.loading import ModelConfig, byte_tokenizer, resolve_dtype, tiny_random_model
from specdec.proposers.draft_model import IncompatibleTokenizerError, check_same_tokenizer


def test_prompt_longer_than_context(tiny_pipeline):
    too_long = [1] * (tiny_pipeline.model.config.max_position_embeddings - 3)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        tiny_pipeline.generate(too_long, max_new_tokens=8)


def test_empty_prompt_and_bad_max_new_tokens(tiny_pipeline):
    with pytest.raises(ValueError, match="empty"):
        tiny_pipeline.generate([], max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        tiny_pipeline.generate([1, 2], max_new_tokens=-1)


def test_greedy_verifier_refuses_sampling(tiny_pipeline):
    from specdec.decoders.engine.sampling import SamplingConfig

    with pytest.raises(ValueError, match="verifier=rejection"):
        tiny_pipeline.with_components("ngram", "greedy", SamplingConfig(temperature=0.7))


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    shuffled = {token: (index * 7) % 259 for token, index in byte_tokenizer().get_vocab().items()}
    other = Tokenizer(models.BPE(vocab=shuffled, merges=[]))
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    with pytest.raises(IncompatibleTokenizerError, match="same tokenizer|different tokenizer"):
        check_same_tokenizer(byte_tokenizer(), PreTrainedTokenizerFast(tokenizer_object=other), "other-draft")
    check_same_tokenizer(byte_tokenizer(), byte_tokenizer(), "same-draft")  # no error


def test_draft_model_directory_with_another_tokenizer_fails_end_to_end(tiny_pipeline, tmp_path):
    draft_dir = tmp_path / "draft"
    tiny_random_model(num_layers=1).save_pretrained(draft_dir)
    shuffled = {token: (index * 7) % 259 for token, index in byte_tokenizer().get_vocab().items()}
    other = Tokenizer(models.BPE(vocab=shuffled, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=other, eos_token="<eos>").save_pretrained(draft_dir)
    with pytest.raises(IncompatibleTokenizerError, match="draft must share"):
        tiny_pipeline.with_components(
            {"name": "draft_model", "tree": False, "k": 4, "name_or_path": str(draft_dir)}, "greedy"
        )


def test_missing_draft_artifact_names_the_training_command(tiny_pipeline, tmp_path, monkeypatch):
    from dataclasses import replace

    from specdec.decoders.engine import context as context_module

    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", tmp_path / "none-shipped")
    tiny_pipeline.context.model_config = replace(tiny_pipeline.context.model_config, name="smollm2-135m")
    with pytest.raises(FileNotFoundError, match="python -m specdec.train drafter=draft_model"):
        tiny_pipeline.with_components("draft_model", "greedy")


def test_unreadable_or_malformed_workload(tmp_path):
    with pytest.raises(FileNotFoundError, match="workload.path"):
        load_workload(WorkloadConfig(path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["ok"]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_workload(WorkloadConfig(path=str(bad)))


def test_workload_selection(tmp_path):
    rows = [
        json.dumps({"question_id": i, "category": c, "turns": [f"q{i}", "follow-up"]})
        for i, c in enumerate(["writing", "roleplay", "qa", "qa", "qa"])
    ]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(rows))
    prompts = load_workload(WorkloadConfig(path=str(path), limit=2))
    assert [p.category for p in prompts] == ["mt_bench", "mt_bench", "qa", "qa"]
    assert all(len(p.turns) == 1 for p in prompts)
    assert len(load_workload(WorkloadConfig(path=str(path), turns=2))[0].turns) == 2
    default = load_workload(WorkloadConfig())
    assert {p.category for p in default} == {
        "mt_bench",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }


def test_bad_dtype_and_model_names():
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("float33", __import__("torch").device("cpu"))
    from specdec.decoders.models.loading import load_model

    with pytest.raises(ValueError, match="model.name_or_path"):
        load_model(ModelConfig(name="hf"))


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"device": "meta"}, "model.device=meta: meta tensors hold no values.*use model.device=cpu"),
        ({"device": "cuda:99"}, "model.device=cuda:99: "),  # no CUDA here, or no 100th card
        ({"dtype": "int8"}, "model.dtype=int8: .*use auto, float32, bfloat16, float16, float64"),
        ({"dtype": "float8_e4m3fn"}, "model.dtype=float8_e4m3fn: "),
    ],
)
def test_a_device_or_dtype_no_model_runs_on_is_refused_by_the_config(setting, expected):
    """Refused where the options become a ModelConfig, before any model loads (meta failed in
    sampling, int8 inside the model's loading, blaming the model folder)."""
    with pytest.raises(ValueError, match=expected):
        ModelConfig(name="tiny-random", **setting)


def test_an_empty_stop_string_is_refused(tiny_model, tiny_config):
    """Every text holds the empty string: it ended every output after one token, silently."""
    from specdec.decoders import Pipeline
    from specdec.decoders.engine.request import StopConditions

    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match=r"stop=\['\\n', ''\]: an empty stop string ends every output"):
        Pipeline(model, tokenizer, model_config=tiny_config, stop_strings=["\n", ""])
    with pytest.raises(ValueError, match="an empty stop string"):
        StopConditions(8, stop_strings=("",), tokenizer=tokenizer)
