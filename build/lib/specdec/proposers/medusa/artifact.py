"""Medusa artifacts: reading and writing trained heads.

Artifact layout (written by ``python -m specdec.train drafter=medusa``)::

    medusa.json         architecture, target key, training summary, default tree
    heads.safetensors   the residual blocks, input mixers (sequential heads) and
                        the draft vocabulary (token ids)
    adapter/            PEFT LoRA adapter of the heads' lm projections
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from specdec.proposers.medusa.heads import MedusaHeads

CONFIG_FILE = "medusa.json"
BLOCKS_FILE = "heads.safetensors"
VOCAB_KEY = "draft_vocab"
ADAPTER_DIR = "adapter"


@dataclass
class MedusaArtifact:
    """A loaded artifact: heads (adapter applied) and the metadata in medusa.json."""

    heads: MedusaHeads
    meta: dict


def save_artifact(peft_heads: nn.Module, directory: Path, meta: dict) -> None:
    """Write adapter/, heads.safetensors and medusa.json (``peft_heads`` is the PeftModel)."""
    directory.mkdir(parents=True, exist_ok=True)
    heads: MedusaHeads = peft_heads.get_base_model()
    peft_heads.save_pretrained(str(directory / ADAPTER_DIR))
    tensors = {
        f"{part}.{name}": t.detach().contiguous()
        for part, module in heads.trained_modules().items()
        for name, t in module.state_dict().items()
    }
    if heads.draft_vocab is not None:
        tensors[VOCAB_KEY] = heads.draft_vocab.cpu().contiguous()
    save_file(tensors, str(directory / BLOCKS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def load_artifact(
    directory: Path, lm_head: nn.Linear, embeddings: nn.Embedding | None = None
) -> MedusaArtifact:
    """Build heads over ``lm_head`` (and ``embeddings``, which sequential heads read)
    and load the trained parts, draft vocabulary and adapter."""
    from peft import PeftModel

    meta = json.loads((directory / CONFIG_FILE).read_text())
    vocab_size, hidden_size = lm_head.weight.shape
    if (meta["vocab_size"], meta["hidden_size"]) != (vocab_size, hidden_size):
        raise ValueError(
            f"the Medusa heads in {directory} were trained for a target with vocab {meta['vocab_size']} and "
            f"hidden size {meta['hidden_size']}, but this target has {vocab_size} and {hidden_size}; "
            "retrain them for this target with `python -m specdec.train drafter=medusa`."
        )
    sequential = bool(meta.get("sequential", False))
    if sequential and embeddings is None:
        raise ValueError(
            f"the heads in {directory} are sequential: load them with the target's input embeddings"
        )
    tensors = load_file(str(directory / BLOCKS_FILE))
    draft_vocab = tensors.pop(VOCAB_KEY, None)
    heads = MedusaHeads(
        lm_head, meta["num_heads"], draft_vocab, embeddings if sequential else None, meta.get("copy_width", 0)
    )
    for part, module in heads.trained_modules().items():
        module.load_state_dict(
            {name.removeprefix(f"{part}."): t for name, t in tensors.items() if name.startswith(f"{part}.")}
        )
    PeftModel.from_pretrained(heads, str(directory / ADAPTER_DIR))  # injects LoRA into `heads`
    heads.to(lm_head.weight.dtype).eval().requires_grad_(False)
    return MedusaArtifact(heads, meta)
