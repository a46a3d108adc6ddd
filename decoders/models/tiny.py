"""Tiny seeded test models and their byte-level tokenizer: built from a config, no download.

``model=tiny-random`` loads :func:`tiny_random_model`; the tests build their targets and drafts
from these (:func:`tiny_draft_model`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

BYTE_VOCAB = 259  # 256 bytes + <bos>, <eos>, <pad>


def tiny_random_model(
    vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 2, seed: int = 0
) -> torch.nn.Module:
    """A seeded, randomly initialised Llama-family model for tests and audits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=256 if vocab_size >= BYTE_VOCAB else None,
        eos_token_id=257 if vocab_size >= BYTE_VOCAB else None,
        pad_token_id=258 if vocab_size >= BYTE_VOCAB else None,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default output weights give peaked, text-like distributions.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    torch.random.set_rng_state(generator_state)
    return model.eval()


def tiny_draft_model(target: torch.nn.Module, num_layers: int = 1, seed: int = 1) -> torch.nn.Module:
    """A smaller seeded model sharing the target's vocabulary, embeddings and head.

    Sharing the embeddings and output head makes its guesses agree with the target's
    often enough for tests to see acceptances.
    """
    config = target.config
    draft = tiny_random_model(config.vocab_size, config.hidden_size, num_layers, seed)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        for draft_layer, target_layer in zip(draft.model.layers, target.model.layers):
            draft_layer.load_state_dict(target_layer.state_dict())
    return draft.to(dtype=target.dtype, device=target.device).eval().requires_grad_(False)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer for the tiny models (ids 0-255 are bytes), no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = _byte_level_chars()
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
    )
    return fast


def _byte_level_chars() -> dict[int, str]:
    """The byte-to-character map of byte-level BPE: printable bytes stand for
    themselves, the rest are shifted past 255 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars
