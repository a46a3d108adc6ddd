"""A trained EAGLE drafter on disk: eagle.json, draft_vocab.json and the PEFT adapter."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.decoders.models.architecture import decoder_of
from specdec.proposers.draft_model import DraftVocabulary
from specdec.proposers.eagle.drafter import EagleDrafter

CONFIG_FILE = "eagle.json"
ADAPTER_DIR = "adapter"
# PEFT: LoRA on the draft layer's projections; the new modules and norms in full
LORA_TARGETS = r"decoder\.layers\.0\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
FULL_MODULES = ["fuse", "combine", "input_layernorm", "post_attention_layernorm", "norm"]
POINTER = "copy"  # a drafter's pointer into the context, trained in full too


def full_modules(copy_width: int) -> list[str]:
    """PEFT ``modules_to_save``: the new modules, the norms and, with one, the pointer."""
    return FULL_MODULES + ([POINTER] if copy_width else [])


@dataclass
class EagleArtifact:
    drafter: EagleDrafter
    meta: dict


def save_artifact(peft_drafter: nn.Module, directory: Path, meta: dict, token_counts: torch.Tensor) -> None:
    """Write adapter/ (LoRA + the modules trained in full), draft_vocab.json and eagle.json."""
    from specdec.proposers.draft_model import save_draft_vocab

    directory.mkdir(parents=True, exist_ok=True)
    peft_drafter.save_pretrained(str(directory / ADAPTER_DIR))
    save_draft_vocab(directory, token_counts)
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def load_artifact(directory: Path, target: nn.Module) -> EagleArtifact:
    """Rebuild the drafter over ``target``, apply the adapter and merge it (plain modules
    draft fastest), in the target's dtype."""
    from peft import PeftModel

    meta = json.loads((directory / CONFIG_FILE).read_text())
    weight = target.get_output_embeddings().weight
    vocab_size, hidden_size = weight.shape
    num_layers = len(decoder_of(target).layers)
    if (meta["vocab_size"], meta["hidden_size"], meta["num_target_layers"]) != (
        vocab_size,
        hidden_size,
        num_layers,
    ):
        raise ValueError(
            f"the EAGLE drafter in {directory} was trained for a target with vocab {meta['vocab_size']}, hidden "
            f"size {meta['hidden_size']} and {meta['num_target_layers']} layers, but this target has "
            f"{vocab_size}, {hidden_size} and {num_layers}; retrain it with `python -m specdec.train drafter=eagle`."
        )
    vocabulary = DraftVocabulary.load(directory, meta["draft_vocab_size"])
    drafter = EagleDrafter(
        target,
        meta["feature_layers"],
        meta["init_layer"],
        vocabulary,
        meta.get("copy_width", 0),
        meta.get("copy_depths", 1),
    )
    drafter = PeftModel.from_pretrained(drafter, str(directory / ADAPTER_DIR)).merge_and_unload()
    drafter.to(weight.dtype).eval().requires_grad_(False)
    return EagleArtifact(drafter, meta)
