"""The transformers model zoo in miniature: tiny seeded decoder-only models of many
architectures, built from their configs (2 layers, hidden 64, the byte tokenizer's 320
ids), for the conformance matrix (tests/decoders/models/test_architectures.py).

Each entry names its attention family, so the matrix covers every one: full attention
with rotary positions, partial rotary, learned absolute positions, ALiBi, sliding
windows on every layer, hybrids of sliding and full layers, chunked attention (Llama 4),
and mixtures of experts (float32: their grouped expert products refuse float64). Windows
and chunks are 16 positions, so the matrix's prompts are several windows long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 16
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str  # rotary | partial rotary | absolute | alibi | sliding | hybrid | moe
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    label: str | None = None  # where one model type appears twice
    seed: int = 0  # another where seed 0's model ends its answer at once

    @property
    def id(self) -> str:
        return self.label or self.model_type

    def build(self, seed: int | None = None) -> torch.nn.Module:
        seed = self.seed if seed is None else seed
        config = AutoConfig.for_model(self.model_type, **{**COMMON, **self.options})
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # peaked, text-like distributions (as the tiny Llama's)
            model.get_output_embeddings().weight.mul_(8.0)
        torch.random.set_rng_state(state)
        return model.to(self.dtype).eval().requires_grad_(False)

    def save_draft(self, directory: Path, noise: float = 0.3) -> Path:
        """A draft for the model of seed 0, in a folder with the byte tokenizer as a user's
        would be: the same weights with seeded noise, so it agrees with the target often
        but not always."""
        from specdec.decoders.models.loading import byte_tokenizer

        draft = self.build()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in draft.parameters():
                spread = parameter.std() if parameter.numel() > 1 else parameter.abs()
                parameter.add_(
                    noise * spread * torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
                )
        draft.save_pretrained(directory)
        byte_tokenizer().save_pretrained(directory)
        # AutoTokenizer would otherwise pick the model type's own class (Qwen2's re-maps ids)
        settings = directory / "tokenizer_config.json"
        settings.write_text(
            json.dumps({**json.loads(settings.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"})
        )
        return directory


SLIDING = {"sliding_window": WINDOW}
ARCHITECTURES = [
    Architecture("llama", "rotary"),
    Architecture("qwen2", "rotary"),
    Architecture("qwen3", "rotary", {"head_dim": 16}),
    Architecture("gemma", "rotary", {"head_dim": 16}),
    Architecture("granite", "rotary"),
    Architecture("olmo", "rotary"),
    Architecture("olmo2", "rotary"),
    Architecture("cohere", "rotary"),
    Architecture("glm4", "partial rotary"),
    Architecture("smollm3", "rotary"),
    Architecture("ernie4_5", "rotary"),
    Architecture("phi", "partial rotary"),
    Architecture("stablelm", "partial rotary"),
    Architecture("gpt_neox", "partial rotary"),
    Architecture("persimmon", "partial rotary"),
    Architecture("gpt2", "absolute"),
    Architecture("gpt_bigcode", "absolute"),
    Architecture("opt", "absolute", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    Architecture("biogpt", "absolute"),
    Architecture("falcon", "rotary", seed=1),
    Architecture("bloom", "alibi"),
    Architecture("mistral", "sliding", SLIDING),
    Architecture("phi3", "sliding", SLIDING),
    Architecture("starcoder2", "sliding", SLIDING),
    Architecture("cohere2", "sliding", SLIDING),
    # Qwen2 with its first layer on a sliding window and the second on full attention
    Architecture(
        "qwen2",
        "hybrid",
        {"use_sliding_window": True, "max_window_layers": 1, **SLIDING},
        label="qwen2-hybrid",
    ),
    Architecture("gemma2", "hybrid", {"head_dim": 16, **SLIDING}),
    Architecture("gemma3_text", "hybrid", {"head_dim": 16, "sliding_window_pattern": 2, **SLIDING}),
    Architecture(
        "mixtral", "moe", {"num_local_experts": 4, "num_experts_per_tok": 2, **SLIDING}, torch.float32
    ),
    Architecture(
        "qwen3_moe",
        "moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
        torch.float32,
    ),
    Architecture(
        "gpt_oss",
        "hybrid moe",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, **SLIDING},
        torch.float32,
    ),
    # Llama 4: a chunked layer with rotary positions, then a full one without them whose queries
    # are scaled by their position; floor_scale 4 (8192 in Llama 4) so the scale changes
    # within a draft, as it does every 8192 positions; every second layer a mixture of experts
    Architecture(
        "llama4_text",
        "chunked moe",
        {
            "attention_chunk_size": WINDOW,
            "no_rope_layer_interval": 2,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 4,
            "intermediate_size_mlp": 128,
            "head_dim": 16,
            "floor_scale": 4,
            "attn_scale": 1.0,
        },
        label="llama4",
    ),
]
