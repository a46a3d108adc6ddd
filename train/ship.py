"""Copy trained drafters into the project as package data: ``python -m train.ship``.

    python -m train.ship artifacts/smollm2-135m/medusa artifacts/smollm2-135m/early_exit

Each artifact directory lands under ``proposers/shipped/<target>/<drafter>``,
where :meth:`decoders.engine.context.PipelineContext.artifact_path` finds it when the
user's artifacts dir has none. Training already stores only what differs from
the target (heads, adapters, exits; never the target's layers, embeddings or
LM head); shipping also stores floating-point tensors in bfloat16 (proposers
cast them to the target's dtype on load) and leaves out checkpoints and
training logs, so a fresh clone or ``pip install`` carries them for a few MB.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from decoders.engine.context import SHIPPED_ARTIFACTS

LEFT_OUT = {"checkpoint", "README.md"}  # resumption state (a folder); PEFT's generated model card


def ship(artifact: Path, destination: Path) -> int:
    """Copy ``artifact`` to ``destination`` with float tensors in bfloat16; returns bytes written."""
    if destination.exists():
        shutil.rmtree(destination)
    written = 0
    kept = (
        p for p in artifact.rglob("*") if p.is_file() and not LEFT_OUT & set(p.relative_to(artifact).parts)
    )
    for source in sorted(kept):
        target = destination / source.relative_to(artifact)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == ".safetensors":
            tensors = {
                name: t.to(torch.bfloat16) if t.is_floating_point() else t
                for name, t in load_file(source).items()
            }
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(target))
        else:
            shutil.copy2(source, target)
        written += target.stat().st_size
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "artifacts", type=Path, nargs="+", help="ARTIFACTS_DIR/<target>/<drafter> directories"
    )
    args = parser.parse_args(argv)
    for artifact in args.artifacts:
        if not artifact.is_dir():
            parser.error(f"{artifact} is not a directory; pass e.g. artifacts/smollm2-135m/medusa")
        drafter, target = artifact.resolve().name, artifact.resolve().parent.name
        destination = SHIPPED_ARTIFACTS / target / drafter
        size = ship(artifact, destination)
        print(f"[ship] {artifact} -> {destination} ({size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
