"""Weight-only int8 targets (``model.quantize=int8``).

A decode pass reads every weight once, so its time follows the weights' bytes: int8 weights
are half of bfloat16's and a quarter of float32's. ``quantize_linears`` replaces every
``nn.Linear`` of a model (its LM head included; the embeddings stay as they are) by an
:class:`Int8Linear`: symmetric int8 with one scale per output (``scale = max |w| / 127``),
the activations and outputs in the model's dtype.

A quantized model is a **different target**. Speculative decoding is lossless relative to
it (greedy output identical to its own standard decoding, sampling from its own
distribution), not relative to the unquantized model; ``scripts/quantize_drift.py``
measures how far its greedy output strays from the model it was made from.

Passes of up to ``NATIVE_ROWS`` rows take the C kernel (:func:`specdec.decoders.models.native.linear_int8`:
each output on its own, so a row's bits do not depend on the pass and exact mode holds);
wider passes (prefills) and machines without the kernel (capability ``native_int8_linear``)
multiply by the weight dequantized to the model's dtype. PyTorch's own
``_weight_int8pack_mm`` was measured and not taken: on the AVX-512 BF16 EPYC, a
3072x576 product cost 66 against oneDNN bfloat16's 124 µs for one row, but 225 against 186
for eight and 1.1 ms against 0.35 ms for one float32 row (docs/performance.md, "int8 weights").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.decoders.models import cpu, native

NATIVE_ROWS = 64  # rows per pass the C kernel takes (exact mode's widest passes included)
QUANTIZE_CHOICES = ("none", "int8")


class Int8Linear(torch.nn.Module):
    """``y = x @ (scales * qweight).T + bias``: qweight (out, in) int8, scales (out,) and bias
    float32, x and y in ``dtype``. ``weight`` is the dequantized weight in ``dtype`` (made on
    first read and kept, for code that reads a layer's weight, such as drafters built on the
    LM head); passes never read it on the kernel's route."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self._dequantized: torch.Tensor | None = None

    @classmethod
    @torch.no_grad()
    def of(cls, linear: torch.nn.Linear) -> Int8Linear:
        weight = linear.weight.detach().to(torch.float32)
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).contiguous()
        return cls(qweight, scales.contiguous(), bias, linear.weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        if self._dequantized is None:
            self._dequantized = (self.qweight.to(torch.float32) * self.scales[:, None]).to(self.dtype)
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        flat = x.reshape(rows, self.in_features)
        function = kernel_for(self, x, rows)
        if function is not None:
            y = native.linear_int8(function, flat, self.qweight, self.scales, self.bias)
        else:
            # a prefill, or no kernel here: the dequantized weight (not kept: a transient copy)
            weight = (self.qweight.to(torch.float32) * self.scales[:, None]).to(x.dtype)
            y = F.linear(flat, weight, None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, {self.dtype}"


def kernel_for(module: Int8Linear, x: torch.Tensor, rows: int):
    """The C kernel for a pass of ``rows`` rows of ``x`` through ``module``, or None: a wide
    pass, another device or dtype, inputs not a multiple of ``native.INT8_STEP``, or no kernel here."""
    usable = 0 < rows <= NATIVE_ROWS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    usable = usable and module.in_features % native.INT8_STEP == 0
    return native.int8_kernel() if usable and cpu.has("native_int8_linear") else None


def check_quantize(choice: str) -> None:
    """Refuse, in one line, a ``model.quantize`` that is not a choice."""
    if choice not in QUANTIZE_CHOICES:
        raise ValueError(
            f"model.quantize={choice!r} is not a choice; use one of {', '.join(QUANTIZE_CHOICES)}"
        )


def quantize_linears(model: torch.nn.Module, choice: str) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear` (``choice="int8"``);
    returns how many. ``none`` changes nothing."""
    check_quantize(choice)
    if choice == "none":
        return 0
    if any(
        p.dtype not in (torch.float32, torch.bfloat16) for p in model.parameters() if p.is_floating_point()
    ):
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        raise ValueError(
            f"model.quantize=int8 takes float32 or bfloat16 models, not {', '.join(dtypes)}; "
            "use model.dtype=bfloat16 (or float32)"
        )
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear.of(child))
                count += 1
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is no longer the embeddings' weight
    return count
