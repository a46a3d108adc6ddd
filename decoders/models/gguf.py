"""GGUF files as targets and drafts: ``model.gguf_file=PATH`` (a file, or a folder holding one).

The llama.cpp ecosystem keeps its models as GGUF files. transformers' GGUF loader reads one
(and its tokenizer) into a float32 model; that takes from seconds to minutes, so it is done
once: the model is saved as an ordinary safetensors folder in the cache
(``~/.cache/specdec/models/gguf-<name>-<hash>``), keyed by the file's content (its SHA-256), and
every later load reads that folder. Which architectures load is transformers' decision
(``GGUF_SUPPORTED_ARCHITECTURES``); any other is refused in one line naming them. The project's
default target is a GGUF file too (:func:`specdec.decoders.models.loading.smollm2_directory`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdec.decoders.models.cache import cache_dir

HASH_CHUNK = 1 << 24  # bytes read at a time while hashing


def resolve_gguf(path: str) -> Path:
    """The GGUF file ``model.gguf_file`` names: the file itself, or the one ``.gguf`` file of a
    folder; one line naming the problem otherwise."""
    given = Path(path).expanduser()
    if given.is_dir():
        files = sorted(given.glob("*.gguf"))
        if not files:
            raise ValueError(f"model.gguf_file={path}: no .gguf file in this folder; give the file's path")
        if len(files) > 1:
            names = ", ".join(f.name for f in files[:4])
            raise ValueError(
                f"model.gguf_file={path}: this folder holds {len(files)} GGUF files ({names}); give one"
            )
        return files[0]
    if not given.is_file():
        raise ValueError(f"model.gguf_file={path}: no such file; give a .gguf file or a folder holding one")
    with given.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"model.gguf_file={path}: not a GGUF file (it does not start with 'GGUF')")
    return given


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` file, or a folder holding one and no
    ``config.json`` (a model folder)."""
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def content_hash(file: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (a progress bar for large files)."""
    digest = hashlib.sha256()
    size = file.stat().st_size
    with (
        file.open("rb") as handle,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"hashing {file.name}",
            disable=size < (256 << 20),
            leave=False,
        ) as bar,
    ):
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()[:16]


def gguf_directory(path: str) -> Path:
    """The cached safetensors folder of the GGUF file ``path`` names, made on first use."""
    file = resolve_gguf(path)
    target = cache_dir() / "models" / f"gguf-{file.stem}-{content_hash(file)}"
    if (target / "config.json").exists():
        return target
    dequantize_gguf(file.parent, file.name, target)
    return target


def dequantize_gguf(folder: Path, name: str, target: Path) -> None:
    """Load GGUF file ``folder/name`` with transformers and publish it as a safetensors folder
    (float32, with its tokenizer) at ``target``."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    print(f"Dequantizing {name} once into {target} ...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"{name}: transformers cannot load this GGUF file ({first}); it loads these architectures: "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}"
        ) from None
    # The GGUF-loaded model refuses to serialize; copy its dequantized weights into
    # a plain model built from the same config minus the quantization record.
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        config_dict.pop(key, None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_dict), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    del quantized
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # a folder like any of the user's, not mkdtemp's 0700
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_directory(tmp, target, "config.json")


def publish_directory(tmp: Path, target: Path, marker: str) -> None:
    """Move a finished cache folder into place, atomically: a half-written cache never looks
    complete. Where another process published it first (two first loads at once), theirs is
    kept and ``tmp`` dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / marker).exists():
            raise
