"""CPU matmul routing for the narrow passes speculative decoding makes.

A target pass over a handful of tokens (a draft of 2 to 32) is bound by
reading the weights from memory, so it should cost little more than a pass
over one token. With PyTorch's default CPU route, ``F.linear`` over 2 to 16
rows computes ``x @ W.T`` in a way that streams each weight matrix more than
once, so a pass over two tokens cost far more than one over one. Computing the
same product as ``(W @ x.T).T`` reads each weight once (the measured passes are
in docs/performance.md, "Why a verification pass is cheap here").

:func:`route_narrow_linears` switches every ``nn.Linear`` of a model to that
form for passes of 1 to ``max_rows`` rows. Wider passes (prefills) take oneDNN's packed
linear where the route uses it below them (float32 outside exact mode, bfloat16), else
``F.linear``: a SmolLM2-135M prefill of 179 tokens took 265 against 309 ms in float32, 180
against 192 ms in bfloat16 (same logits), on the AVX-512 BF16 EPYC. Single rows (standard
decoding's step) are computed over two columns, the second zero: MKL's one-row route made a whole
SmolLM2-135M float32 pass cost 76 ms (median) where the two-column product costs 52 ms.
From ``PACKED_FROM`` (5) rows on, float32 products take oneDNN's packed linear instead
(``torch.ops.mkldnn._linear_pointwise`` over a copy of the weight reordered once for it):
MKL's transposed product has steps between the widths it vectorises whole (on the AVX2 EPYC
measured, a SmolLM2-135M pass over 6 tokens cost 72 ms against 48 over 4), oneDNN's cost
rises evenly (57 ms over 6, 61 over 8 against 70, 69 over 12 against 89), while over 1-4
rows the transposed product stays the faster (at the cost of a second copy of the weights).

In bfloat16 the narrow route is oneDNN's packed linear at every width, exact mode
included (padded to a multiple of 4 rows, as on the default route; its rows are
checked for batch invariance like the default route's, :func:`exact_product_rows`).
``F.linear`` reorders a bfloat16 weight for oneDNN on every call: on the AVX-512
BF16 EPYC measured, a whole SmolLM2-135M pass in exact mode cost 46 ms on the packed
copy against 61 ms (one token) and 56 against 63 ms (eight), with bit-identical
logits. It changes no weights, only the order of the floating-point sums, and it changes
the module itself, so every decoder that runs the model (standard decoding, the speculative
loop, transformers' ``generate`` in the peers) gets it.

Exact mode (``model.exact``; :meth:`specdec.decoders.models.target.Target.configure`) routes every
pass, single rows included, so that a row's product does not depend on how many
rows share it, and switches attention to :mod:`specdec.decoders.models.exact_attention`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.decoders.models import cpu, native
from specdec.decoders.models.cpu import onednn_linear

DEFAULT_MAX_ROWS = 48
# narrowest pass that takes oneDNN's packed linear instead of the transposed product
# (measured on SmolLM2-135M float32, AMD EPYC with AVX2: equal at 5 rows, faster from 6)
PACKED_FROM = 5
# bfloat16 passes of up to this many rows take the C linear where it runs (exact mode's passes
# all do: a row's bits must not depend on the pass): it read the weights faster than oneDNN up
# to 8 rows on the AVX-512 BF16 EPYC (docs/performance.md, "Where a pass goes")
NATIVE_ROWS = 8
NEVER = 1 << 30
EXACT_BLOCK = 8  # exact narrow route: columns per product (see exact_blocks)
# dtypes whose narrow route is oneDNN's packed linear at every width (see the module's docstring)
PACKED_DTYPES = (torch.bfloat16,)
PACKABLE = (torch.float32, *PACKED_DTYPES)  # dtypes oneDNN's packed linear takes here


@dataclass(eq=False)
class LinearRoute:
    """How the ``nn.Linear`` layers of one model compute their passes (see the module's
    docstring), and the per-layer data those routes keep: the packed weight copies and the
    widest exact product measured for each weight. Installed by :func:`route_linears`
    (a :class:`specdec.decoders.models.target.Target` installs and removes its model's)."""

    max_rows: int = DEFAULT_MAX_ROWS
    transposed: bool = True
    exact: bool = False
    packed_from: int = PACKED_FROM
    packed: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    product_rows: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # exact_product_rows measured per (weight shape, dtype, device, packed): what the kernels
    # do, measured once per owner (a Target passes its own, so every route it installs shares it)
    widths: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the class a routed layer takes: nn.Linear with this route's forward
        self.linear_class = type("RoutedLinear", (RoutedLinear,), {"route": self})


class RoutedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose passes take its class's :class:`LinearRoute`. A layer is
    routed by switching its class to the route's subclass (its parameters, state dict
    and hooks stay as they are) and unrouted by switching it back."""

    route: LinearRoute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return routed_product(self, x, self.route)


def route_linears(model: torch.nn.Module, route: LinearRoute) -> int:
    """Give every ``nn.Linear`` of ``model`` (routed or not) ``route``; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear or isinstance(module, RoutedLinear):
            module.__class__ = route.linear_class
            dtype = module.weight.dtype
            packed = route.transposed and dtype in PACKED_DTYPES and packed_route_available(dtype)
            # exact mode on F.linear: the default route, and bfloat16 without oneDNN's packed linear
            native_route = cpu.has("native_bf16_linear") and native.linear_kernel(module.weight) is not None
            if (
                route.exact
                and not native_route
                and (packed or not route.transposed or dtype in PACKED_DTYPES)
            ):
                rows = exact_product_rows(module.weight.detach(), route.max_rows, packed, route.widths)
                route.product_rows[module] = rows
            count += 1
    return count


def unroute_linears(model: torch.nn.Module) -> None:
    """Put every routed linear of ``model`` back on ``nn.Linear``'s own forward."""
    for module in model.modules():
        if isinstance(module, RoutedLinear):
            module.__class__ = torch.nn.Linear


def linear_route(model: torch.nn.Module) -> LinearRoute | None:
    """The route ``model``'s linears take (None: ``nn.Linear``'s own)."""
    routed = next((m for m in model.modules() if isinstance(m, RoutedLinear)), None)
    return routed.route if routed is not None else None


def routed_product(module: torch.nn.Linear, x: torch.Tensor, route: LinearRoute) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    exact = route.exact
    plain = not exact and not route.transposed
    if plain or not rows or x.device.type != "cpu":
        return F.linear(x, module.weight, module.bias)
    if rows > route.max_rows:  # a wide pass (a prefill): oneDNN's packed linear where the route takes it
        packs = module.weight.dtype in PACKED_DTYPES or route.packed_from < NEVER
        if packs and (packed := _packed_weight(module, route, x)) is not None:
            flat = x.reshape(rows, x.shape[-1])
            return packed(flat, module.bias).reshape(*x.shape[:-1], module.weight.shape[0])
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if (exact or rows <= NATIVE_ROWS) and (function := _native_linear(module, x)) is not None:
        # bfloat16 in C, each output on its own: batch-invariant as it stands (no padding)
        return native.linear(function, flat, module.weight, module.bias).reshape(*x.shape[:-1], -1)
    if route.transposed and module.weight.dtype in PACKED_DTYPES:  # bfloat16: oneDNN's packed linear
        packed = _packed_weight(module, route, x)
        if packed is None and not exact:  # a product autograd must see, or no oneDNN
            return F.linear(x, module.weight, module.bias)
        if packed is None:
            y = _exact_default_route(module, route, flat, lambda block: F.linear(block, module.weight))
        elif not exact:
            return packed(flat, module.bias).reshape(*x.shape[:-1], module.weight.shape[0])
        else:
            y = _exact_default_route(module, route, flat, packed)
    elif not exact and rows >= route.packed_from and (packed := _packed_weight(module, route, x)) is not None:
        return packed(flat, module.bias).reshape(*x.shape[:-1], module.weight.shape[0])
    elif not route.transposed:  # exact mode on the default route
        y = _exact_default_route(module, route, flat, lambda block: F.linear(block, module.weight))
    elif exact:
        y = torch.cat(
            [_transposed_product(module.weight, block, width) for block, width in exact_blocks(flat)]
        )
    else:
        y = _transposed_product(module.weight, flat, padded_rows(rows))
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], module.weight.shape[0])


def _native_linear(module: torch.nn.Linear, x: torch.Tensor):
    """The C bfloat16 linear for ``module``'s weight (:func:`specdec.decoders.models.native.linear_kernel`),
    or None: where it does not run, and for a product autograd must see."""
    weight = module.weight
    if weight.dtype != torch.bfloat16 or (
        torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    ):
        return None
    return native.linear_kernel(weight) if cpu.has("native_bf16_linear") else None


def _exact_default_route(
    module: torch.nn.Linear, route: LinearRoute, flat: torch.Tensor, product
) -> torch.Tensor:
    """Exact mode's product of ``flat`` (rows, in) without bias: padded to a multiple of
    4 rows, in blocks of the widest product measured to give every row the bits of a
    4-row one (:func:`exact_product_rows`)."""
    widest = route.product_rows.get(module)
    if widest is None:  # a layer copied from a routed one (a trained exit's adapted layer): measured now
        packed = (
            route.transposed
            and module.weight.dtype in PACKED_DTYPES
            and packed_route_available(module.weight.dtype)
        )
        widest = route.product_rows[module] = exact_product_rows(
            module.weight.detach(), route.max_rows, packed, route.widths
        )
    if flat.shape[0] <= widest:  # every decode pass measured so far: one product
        return product(_zero_padded(flat, exact_linear_rows(flat.shape[0])))[: flat.shape[0]]
    return torch.cat(
        [product(_zero_padded(b, exact_linear_rows(len(b))))[: len(b)] for b in flat.split(widest)]
    )


class PackedProduct:
    """``x @ weight.T (+ bias)`` for inference, on oneDNN's packed linear over a copy of
    ``weight`` reordered once for it (float32 and bfloat16 on an x86 CPU; :meth:`of` gives
    ``None`` where it does not apply). The linears' narrow route keeps one per module
    (:func:`_packed_weight`). A drafter's vocabulary projection over one to eight states costs a
    quarter to a half of what the plain product does on the AVX-512 BF16 EPYC measured
    (SmolLM2-135M's 8192 draft rows, bfloat16: 164 against 393-631 us for one state)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedProduct | None:
        usable = weight.device.type == "cpu" and weight.dtype in PACKABLE
        return cls(weight) if usable and packed_route_available(weight.dtype) else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (rows, in) -> (rows, out)."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def packed_route_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's packed linear runs here in ``dtype``: x86 builds of PyTorch have it
    in float32; in bfloat16 it also needs avx512bw/vl/dq or avx_ne_convert, which AVX2-only
    CPUs lack (probed, :mod:`specdec.decoders.models.cpu`). Where it does not, the routes that
    would take it take ``F.linear`` instead."""
    return onednn_linear(dtype)


def _packed_weight(module: torch.nn.Linear, route: LinearRoute, x: torch.Tensor) -> PackedProduct | None:
    """``module.weight`` in oneDNN's packed layout, packed on first use and again whenever
    the weight changed (its storage or its in-place version); None where the packed route
    does not apply: not float32 or bfloat16, or a product autograd must see (it has no
    backward: even a frozen layer's input gradient, an adapter's, would be dropped)."""
    weight = module.weight
    if (
        weight.dtype not in PACKABLE
        or not packed_route_available(weight.dtype)
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        return None
    # inference tensors keep no version counter: their storage alone identifies them
    stamp = (weight.data_ptr(), None if weight.is_inference() else weight._version)
    cached = route.packed.get(module)
    if cached is None or cached[0] != stamp:
        cached = route.packed[module] = (stamp, PackedProduct(weight))
    return cached[1]


def _zero_padded(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """``flat`` (r, in) with zero rows appended up to ``rows``."""
    if rows <= flat.shape[0]:
        return flat
    return torch.cat([flat, flat.new_zeros(rows - flat.shape[0], flat.shape[1])])


def _transposed_product(weight: torch.Tensor, flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat @ weight.T`` computed as ``(weight @ flat.T).T`` over ``width`` columns.

    ``flat`` is made row-major first: this product's own output is a transposed view,
    and elementwise ops keep that layout (the MLP's ``act(gate) * up``), but MKL's
    product over a column-major ``flat.T`` took 5x as long (506 against 94 us for
    SmolLM2-135M's down projection over 2 rows, float32)."""
    return torch.matmul(weight, _zero_padded(flat, width).contiguous().T).T[: flat.shape[0]]


def padded_rows(rows: int) -> int:
    """Rows to compute for ``rows``: the measured CPU BLAS is faster on widths it
    vectorises whole (4, then multiples of 8) than on the odd widths between, so
    those are padded with zero rows; 5 rows stay as they are (the SmolLM2-135M
    float32 passes behind this are in docs/performance.md, "Why a verification pass is cheap here").
    A single row takes two columns (see the module's docstring).
    """
    if rows <= 1:
        return 2
    if rows == 3:
        return 4
    if rows <= 5:
        return rows
    return -(-rows // 8) * 8


def exact_linear_rows(rows: int) -> int:
    """Rows ``F.linear`` computes in exact mode: the next multiple of 4. On the CPU
    kernels measured (MKL in float32 and float64, oneDNN in bfloat16), passes of 4,
    8, 12, ... 64 rows give a row the same bits, while a single row takes another
    kernel (gemv; in bfloat16 it differs on SmolLM2's 1536-input down projection) and
    so do 2-3 rows and the widths between (in bfloat16 on narrow outputs, e.g. a
    32-output projection)."""
    return -(-rows // 4) * 4


PRODUCT_PROBES = 3  # random inputs each width is checked on


@torch.no_grad()
def exact_product_rows(
    weight: torch.Tensor, max_rows: int = DEFAULT_MAX_ROWS, packed: bool = False, measured: dict | None = None
) -> int:
    """The widest product (a multiple of 4, at most ``max_rows``) in which, for every
    multiple of 4 up to it, each row comes out as it does in a product of 4 rows,
    measured once per ``measured`` (a route's or its target's record) for ``weight``'s shape and
    dtype (a kernel's choice depends on shapes, not values), on ``F.linear`` or (``packed``) oneDNN's packed linear. The
    exact default route computes wider passes in blocks of this many rows. On the AMD
    EPYC first measured, every width from 4 to 64 agreed; on an Intel Xeon with AMX,
    SmolLM2-135M's products agree up to 32-48 rows in bfloat16 and 12 rows in float32
    (MKL takes another kernel from 16 rows for the 1536-wide and vocabulary products),
    the 576-wide ones up to 48."""
    measured = {} if measured is None else measured
    key = (tuple(weight.shape), weight.dtype, weight.device.type, packed)
    if key not in measured:
        product = PackedProduct(weight) if packed else (lambda x: F.linear(x, weight))

        generator = torch.Generator().manual_seed(0)
        widest = max_rows - max_rows % 4
        for _ in range(PRODUCT_PROBES):  # a kernel's other sums can round alike on some inputs
            x = torch.randn(widest, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
            alone = torch.cat([product(_zero_padded(x[i : i + 1], 4))[:1] for i in range(widest)])
            for rows in range(8, widest + 1, 4):
                if not torch.equal(product(x[:rows]), alone[:rows]):
                    widest = rows - 4
                    break
        measured[key] = widest
    return measured[key]


def exact_blocks(flat: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The exact narrow route's products: blocks of up to 8 rows, each computed over
    4 or 8 columns. MKL (float32, float64) gives each column of ``weight @ X`` the
    same bits whether X has 4 or 8 columns, but other widths take other kernels
    (1: gemv; 2-3, 5-7, 9 and up: differing sums), so a row's product would depend
    on how many rows share the pass."""
    blocks = []
    for start in range(0, flat.shape[0], EXACT_BLOCK):
        block = flat[start : start + EXACT_BLOCK]
        blocks.append((block, 4 if block.shape[0] <= 4 else EXACT_BLOCK))
    return blocks


def route_narrow_linears(
    model: torch.nn.Module,
    max_rows: int = DEFAULT_MAX_ROWS,
    transposed: bool = True,
    exact: bool = False,
    packed_from: int | None = PACKED_FROM,
) -> int:
    """Route the passes of up to ``max_rows`` rows of every ``nn.Linear`` in ``model``
    (a new :class:`LinearRoute`); returns how many layers were routed.

    transposed: the narrow route, ``(W @ x.T).T`` (a single row over two columns).
        Off: ``F.linear`` (only useful with ``exact``).
    exact: make each row's product independent of how many rows share the call,
        single rows included (:func:`exact_blocks` on the narrow route,
        :func:`exact_linear_rows` in blocks of :func:`exact_product_rows` on the default one).
    packed_from: on the narrow route outside exact mode, passes of this many rows (up to
        ``max_rows``) take oneDNN's packed linear over float32 weights (None: never).
    """
    if packed_from is None or not transposed or exact or not packed_route_available():
        packed_from = NEVER
    return route_linears(model, LinearRoute(max_rows, transposed, exact, packed_from))


def narrow_routed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linears take the narrow route."""
    route = linear_route(model)
    return route is not None and route.transposed
