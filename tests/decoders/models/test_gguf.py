"""GGUF files as targets and drafts (model.gguf_file): a tiny Llama written as GGUF here loads
back as the model it was written from, with its tokenizer; it is dequantized once, keyed by the
file's content; what cannot load is refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.decoders import Pipeline
from specdec.decoders.models import gguf as gguf_files
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.decoders.models.tiny import BYTE_VOCAB, _byte_level_chars, tiny_random_model


def _permuted(weight: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's order of a query or key projection's rows (its converter permutes them;
    transformers' loader permutes them back)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(weight.shape).numpy()


def write_tiny_gguf(path: Path, model: torch.nn.Module, architecture: str = "llama") -> Path:
    """``model`` (a tiny Llama, float32) as a GGUF file with a byte-level tokenizer."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    chars = _byte_level_chars()
    tokens = [chars[b] for b in range(256)] + ["<bos>", "<eos>", "<pad>", "ab"]
    tokens += [f"<extra_{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * 3 + [1] + [3] * (len(tokens) - 260))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(258)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{i}.{theirs}.weight", state[f"{prefix}{ours}.weight"].numpy())
        writer.add_tensor(
            f"blk.{i}.attn_q.weight",
            _permuted(state[f"{prefix}self_attn.q_proj.weight"], config.num_attention_heads),
        )
        writer.add_tensor(
            f"blk.{i}.attn_k.weight",
            _permuted(state[f"{prefix}self_attn.k_proj.weight"], config.num_key_value_heads),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model = tiny_random_model(vocab_size=BYTE_VOCAB + 5)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model), model


def test_a_gguf_file_loads_as_the_model_it_was_written_from_with_its_tokenizer(tiny_gguf, capsys):
    path, original = tiny_gguf
    target, tokenizer = load_model(
        ModelConfig(name="hf", gguf_file=str(path), dtype="float32", exact="false")
    )
    assert "Dequantizing tiny-llama.gguf once" in capsys.readouterr().err
    prompt = list(range(40, 90))
    with torch.no_grad():
        expected = original(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(target.session().forward(prompt), expected, rtol=1e-5, atol=1e-5)
    assert tokenizer.decode(tokenizer.encode("hello gguf", add_special_tokens=False)) == "hello gguf"
    assert tokenizer.eos_token == "<eos>"
    again, _ = load_model(ModelConfig(name="hf", gguf_file=str(path.parent), dtype="float32", exact="false"))
    assert "Dequantizing" not in capsys.readouterr().err  # the folder form finds the same cache
    pipeline = Pipeline(again, tokenizer, model_config=ModelConfig(name="hf", gguf_file=str(path)))
    assert pipeline.context.target_key == "tiny-llama"
    assert "model.gguf_file=" in pipeline.context.train_command("medusa")


def test_the_cache_is_keyed_by_content(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    copy = tmp_path / "tiny-llama.gguf"
    copy.write_bytes(path.read_bytes())
    assert gguf_files.content_hash(copy) == gguf_files.content_hash(path)
    copy.write_bytes(path.read_bytes()[:-1] + b"\x01")
    assert gguf_files.content_hash(copy) != gguf_files.content_hash(path)


def test_what_is_not_a_gguf_file_is_refused_in_one_line(tmp_path):
    cases = {
        str(tmp_path / "missing.gguf"): "no such file",
        str(tmp_path): "no .gguf file in this folder",
    }
    (tmp_path / "notes.gguf.txt").write_text("x")
    for given, expected in cases.items():
        with pytest.raises(ValueError, match=expected) as error:
            gguf_files.resolve_gguf(given)
        assert "\n" not in str(error.value)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_files.resolve_gguf(str(fake))
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        gguf_files.resolve_gguf(str(tmp_path))


def test_an_architecture_transformers_cannot_load_is_refused_naming_those_it_can(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", tiny_random_model(vocab_size=BYTE_VOCAB + 5), "madeup")
    with pytest.raises(
        ValueError, match=r"odd.gguf: transformers cannot load this GGUF file .*llama"
    ) as error:
        load_model(ModelConfig(name="hf", gguf_file=str(path), dtype="float32"))
    assert "\n" not in str(error.value)


def test_a_gguf_file_drafts_for_a_target(tiny_gguf, drafting_pays):
    path, _ = tiny_gguf
    config = ModelConfig(name="hf", gguf_file=str(path), dtype="float32", exact="true")
    target, tokenizer = load_model(config)
    base = Pipeline(target, tokenizer, model_config=config)
    pipeline = base.with_components(
        {"name": "draft_model", "name_or_path": str(path), "tree": None, "k": 3}, "greedy"
    )
    prompt = list(range(40, 70))
    result = pipeline.generate(prompt, 12)
    assert result.tokens == base.generate(prompt, 12).tokens
    assert result.stats.accepted > 0  # the draft is the target itself: its drafts are accepted
