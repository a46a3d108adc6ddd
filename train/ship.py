"""Copy trained drafters into the project as package data: ``python -m specdec.train.ship``.

    python -m specdec.train.ship artifacts/smollm2-135m/medusa artifacts/smollm2-135m/early_exit

Each artifact directory lands under ``proposers/shipped/<target>/<drafter>``,
where :meth:`specdec.decoders.engine.context.PipelineContext.artifact_path` finds it when the
user's artifacts dir has none. Heads, adapters and exits already hold only
what differs from the target; a distilled draft, an ordinary model directory,
ships without the tensors it shares with the target (its embeddings and LM head,
listed in ``from_target.json`` and taken from the loaded target) and without the
tokenizer files. Shipping also stores floating-point tensors in bfloat16 (proposers
cast them to the target's dtype on load) and leaves out checkpoints and
training logs, so a fresh clone or ``pip install`` carries them for a few MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.decoders.engine.context import SHIPPED_ARTIFACTS
from specdec.decoders.models.loading import ModelConfig, load_model
from specdec.proposers.draft_model import FROM_TARGET_FILE, check_same_tokenizer

LEFT_OUT = {"checkpoint", "README.md"}  # resumption state (a folder); PEFT's generated model card
# what a tokenizer's save_pretrained writes; a whole-model draft ships without them (it uses the target's)
TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
}


def is_whole_model(artifact: Path) -> bool:
    """A drafter stored as an ordinary Hugging Face model (the distilled draft), as opposed
    to heads or adapters that already hold only what differs from the target."""
    return (artifact / "config.json").exists() and (artifact / "model.safetensors").exists()


def shared_with_target(tensors: dict[str, torch.Tensor], target: torch.nn.Module) -> list[str]:
    """Names of the tensors equal (in bfloat16) to the target's tensor of the same name:
    the layers, embeddings and head a draft copied from its target and never trained."""
    reference = target.state_dict()
    return sorted(
        name
        for name, t in tensors.items()
        if name in reference
        and reference[name].shape == t.shape
        and torch.equal(reference[name].to(torch.bfloat16), t.to(torch.bfloat16))
    )


def ship(artifact: Path, destination: Path, target: torch.nn.Module | None = None, tokenizer=None) -> int:
    """Copy ``artifact`` to ``destination`` with float tensors in bfloat16; returns bytes written.

    With the ``target`` (and its ``tokenizer``) given, a whole-model draft is stored without
    the tensors it shares with the target and without the tokenizer files, and
    ``from_target.json`` names what the proposer takes from the target instead."""
    if destination.exists():
        shutil.rmtree(destination)
    whole = target is not None and is_whole_model(artifact)
    if whole:
        _, draft_tokenizer = load_model(ModelConfig(name="hf", name_or_path=str(artifact), dtype="float32"))
        check_same_tokenizer(tokenizer, draft_tokenizer, str(artifact))
    written = 0
    left_out = LEFT_OUT | (TOKENIZER_FILES if whole else set())
    kept = (
        p for p in artifact.rglob("*") if p.is_file() and not left_out & set(p.relative_to(artifact).parts)
    )
    shared: list[str] = []
    for source in sorted(kept):
        destination_file = destination / source.relative_to(artifact)
        destination_file.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == ".safetensors":
            tensors = load_file(source)
            if whole and source.name == "model.safetensors":
                shared = shared_with_target(tensors, target)
                tensors = {name: t for name, t in tensors.items() if name not in shared}
            tensors = {
                name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()
            }
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(destination_file))
        else:
            shutil.copy2(source, destination_file)
        written += destination_file.stat().st_size
    if whole:
        record = destination / FROM_TARGET_FILE
        record.write_text(json.dumps({"tensors": shared, "tokenizer": True}, indent=1) + "\n")
        written += record.stat().st_size
    return written


# the file each drafter's artifact is known by (what its proposer checks before loading)
ARTIFACT_MARKERS = ("medusa.json", "eagle.json", "exit_config.json", "config.json")


def is_artifact(directory: Path) -> bool:
    """Whether ``directory`` holds an artifact ``python -m specdec.train`` wrote."""
    return any((directory / marker).exists() for marker in ARTIFACT_MARKERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "artifacts", type=Path, nargs="+", help="ARTIFACTS_DIR/<target>/<drafter> directories"
    )
    parser.add_argument(
        "--model",
        help="the target (a model= name or a Hugging Face directory) a whole-model draft shares "
        "tensors with; default: the artifact's parent directory name, e.g. smollm2-135m",
    )
    args = parser.parse_args(argv)
    targets: dict[str, tuple] = {}
    for artifact in args.artifacts:
        if not artifact.is_dir():
            parser.error(f"{artifact} is not a directory; pass e.g. artifacts/smollm2-135m/medusa")
        if not is_artifact(artifact):
            parser.error(
                f"{artifact} holds no trained drafter (none of {', '.join(ARTIFACT_MARKERS)}); "
                "pass a folder written by python -m specdec.train, e.g. artifacts/smollm2-135m/medusa"
            )
        drafter, target_key = artifact.resolve().name, artifact.resolve().parent.name
        destination = SHIPPED_ARTIFACTS / target_key / drafter
        target = tokenizer = None
        if is_whole_model(artifact):
            name = args.model or target_key
            if name not in targets:
                config = ModelConfig(name=name, dtype="float32")
                if Path(name).is_dir():
                    config = ModelConfig(name="hf", name_or_path=name, dtype="float32")
                loaded, loaded_tokenizer = load_model(config)
                targets[name] = (loaded.model, loaded_tokenizer)  # ship compares tensors: the module
            target, tokenizer = targets[name]
        size = ship(artifact, destination, target, tokenizer)
        print(f"[ship] {artifact} -> {destination} ({size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
