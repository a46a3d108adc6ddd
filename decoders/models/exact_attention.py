"""Batch-invariant attention: a query row's output does not depend on its pass.

Speculative decoding is lossless only if the target gives a draft token the
logits it would give it in a pass of its own. PyTorch's SDPA and transformers'
eager attention do not: on SmolLM2-135M in bfloat16 a verification pass over 4
tokens gave rows up to 0.56 logits away from single-token passes, because the
kernels' sums are grouped by each key's index in the pass (a tree's siblings
sit between a node and its ancestors, a chain's later tokens after it) and by
how many query rows share the call.

:func:`exact_attention` computes every row as a function of its own query and
the keys it may see, laid out as standard decoding would see them: the cached
prefix, then the row's ancestors in the block at consecutive positions. The
keys are cut into chunks of ``CHUNK`` absolute positions; each chunk gives a
row its partial softmax (max, sum, weighted values) from products of a fixed
shape, and the chunks are combined flash-decoding style:

    out = sum_c exp(max_c - max) * values_c / sum_c exp(max_c - max) * sum_c

The scores of every row against every key come from one product, and each row's
are then laid out as its own pass has them (a gather of scores, not of keys).
Chunks wholly inside the prefix are shared by all rows of the pass; only the
values of the last one or two (from the prefix's last chunk boundary on) are
gathered per row, so a tree costs one small gather, not a copy of the prefix per
node.
What this relies on, measured on the CPU kernels (MKL float32/float64, oneDNN
bfloat16) and re-checked at load time by :mod:`specdec.decoders.models.invariance`: a matmul
row's bits do not depend on the batch size, on how many other rows share it or on
how many columns (keys, padded to whole chunks) the product has
(in float32 and float64 once there are at least ``MKL_MIN_ROWS``; products of
fewer are padded with zero rows), and reductions over a fixed length, or
sequential over a leading dimension padded with zeros, do not change.

Passes of more than ``MAX_ROWS`` queries (the prefill) and anything with a
batch of several sequences, padding or dropout go to SDPA: the prefill is the
same pass for standard and speculative decoding.
"""

from __future__ import annotations

import weakref

import torch

from specdec.decoders.models import cpu, native

CHUNK = 64  # keys per chunk, in absolute positions
MKL_MIN_ROWS = 4  # float32/float64 query rows per product: MKL computes 1-3 rows unlike 4 or more
MAX_ROWS = 64  # wider passes (the prefill) use SDPA


class TailLayouts:
    """The tail layouts (:func:`tail_layout`) of the pass running: one pass calls every layer
    with the same mask, so the layers after the first reuse its layout; a packed pass over
    several requests (:mod:`specdec.decoders.models.batch`) has one per request, each
    reused by every layer. Layouts are keyed by the mask's identity, the prefix and the
    rows, and dropped once more than ``keep`` are held (a new pass's masks are new
    tensors). One per :class:`specdec.decoders.models.target.Target` (the attention it
    registers carries it)."""

    def __init__(self, keep: int = 64, build=None) -> None:
        self.keep = keep
        self.build = tail_layout if build is None else build  # or visible_layout (the C kernel's)
        self.held: dict[tuple[int, int, int], tuple[weakref.ref | None, Layout | None]] = {}

    def __call__(self, mask: torch.Tensor | None, prefix: int, rows: int, device: torch.device):
        key = (0 if mask is None else id(mask), prefix, rows)
        if (found := self.held.get(key)) is not None:
            ref, layout = found
            if ref is None or ref() is mask:  # (an id can be reused once its tensor is gone)
                return layout
        layout = self.build(mask, prefix, rows, device)
        if len(self.held) >= self.keep:
            self.held.clear()
        self.held[key] = (None if mask is None else weakref.ref(mask), layout)
        return layout


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    layouts: TailLayouts | None = None,
    visible: TailLayouts | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (1, heads, q, d), key/value
    (1, kv_heads, kv, d) with the pass's q tokens last; returns (1, q, heads, d). A
    :class:`specdec.decoders.models.target.Target` registers it with its own ``layouts`` and
    ``visible`` (memos of :func:`tail_layout` and :func:`visible_layout`).

    Where exact mode's C kernel runs (:mod:`specdec.decoders.models.native`) it computes every
    row; elsewhere the Python route below does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, rows, dim = query.shape
    prefix = key.shape[2] - rows
    decode = batch == 1 and rows <= MAX_ROWS and not dropout and not kwargs.get("softcap")
    decode = decode and not kwargs.get("s_aux")
    scale = dim**-0.5 if scaling is None else scaling
    on_kernel = decode and query.device.type == "cpu" and cpu.has("native_attention")
    function = native.kernel(query.dtype) if on_kernel else None
    if function is not None:
        rows_layout = (visible or visible_layout)(attention_mask, prefix, rows, query.device)
        if rows_layout is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        out = native.attend(function, query[0], key[0], value[0], prefix, *rows_layout, scale)
        return out.unsqueeze(0), None
    layout = (layouts or tail_layout)(attention_mask, prefix, rows, query.device) if decode else None
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    compute = torch.promote_types(query.dtype, torch.float32)  # bfloat16 in float32: MKL's small products
    parts = (query[0].to(compute), key[0].to(compute), value[0].to(compute))
    out = _invariant_attention(*parts, prefix, layout, scale)  # (heads, q, d)
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


def exact_attention_many(
    module: torch.nn.Module,
    query: torch.Tensor,
    spans: list[tuple[int, int]],
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    masks: list[torch.Tensor | None],
    dropout: float = 0.0,
    scaling: float | None = None,
    visible: TailLayouts | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """A packed pass's exact attention over every request in one call of the C kernel
    (:func:`specdec.decoders.models.native.attend_many`): query (1, heads, rows, d) of every
    request, request i's rows ``spans[i]`` against its keys and values ``kv[i]`` under its
    mask ``masks[i]``. Returns (1, rows, heads, d), each row's bits those of the request's own
    :func:`exact_attention`; None where some request would not take the kernel alone (the
    caller then runs each request on its own)."""
    batch, heads, rows, dim = query.shape
    plain = batch == 1 and not dropout and not kwargs.get("softcap") and not kwargs.get("s_aux")
    on_kernel = plain and query.device.type == "cpu" and cpu.has("native_attention")
    function = native.many_kernel(query.dtype) if on_kernel else None
    if function is None:
        return None
    requests = []
    for (start, end), (key, value), mask in zip(spans, kv, masks):
        count = end - start
        prefix = key.shape[2] - count
        layout = (visible or visible_layout)(mask, prefix, count, query.device) if count <= MAX_ROWS else None
        if layout is None:
            return None
        requests.append((key[0], value[0], prefix, start, count, *layout))
    scale = dim**-0.5 if scaling is None else scaling
    return native.attend_many(function, query[0], requests, scale).unsqueeze(0)


Layout = tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Tensor]]]


def tail_layout(mask: torch.Tensor | None, prefix: int, rows: int, device: torch.device) -> Layout | None:
    """Key positions (rows, width) each row reads from the last chunk boundary of
    the prefix on, counted from that boundary (0 where no key), which of them are
    real (rows, width) bool, and the rows that sum
    fewer chunks than the pass has (:func:`_layout_from_block`); None when some
    row does not see the whole prefix (padding: not a decode pass).

    mask: (1, 1, rows, prefix + rows), boolean (True = attend) or additive (0 =
    attend), or None for a causal chain. A row's visible block tokens (its tree
    ancestors and itself, in order) follow the prefix's tail at consecutive slots,
    where standard decoding has them.
    """
    if mask is None:
        block = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        layout = _layout_from_block(block, prefix)
    else:
        visible = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0  # (rows, prefix + rows)
        seen_prefix = bool(visible[:, :prefix].all()) if prefix else True
        layout = _layout_from_block(visible[:, prefix:], prefix) if seen_prefix else None
    return layout


def visible_layout(
    mask: torch.Tensor | None, prefix: int, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C kernel's layout: each row's visible block entries in order and their counts
    (:func:`specdec.decoders.models.native.visible_rows`); None when some row does not see the
    whole prefix (as :func:`tail_layout`)."""
    if mask is None:
        block = torch.ones(rows, rows, dtype=torch.bool).tril()
    else:
        seen = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0  # (rows, prefix + rows)
        if prefix and not bool(seen[:, :prefix].all()):
            return None
        block = seen[:, prefix:].cpu()
    return native.visible_rows(block)


def _layout_from_block(block: torch.Tensor, prefix: int) -> Layout:
    """block: (rows, rows) bool, which block tokens each row sees.

    The third part lists (tail chunks left out, rows (rows,) bool) for rows whose keys
    end before the tail's last chunk: the sum over chunks groups its terms by how many
    there are (CPU sums over 8 or more run in lanes of 4), even when the extra ones are
    zeros, so such a row sums over as many chunks as its own single-token pass has."""
    rows = block.shape[0]
    start = prefix - prefix % CHUNK
    lead = prefix - start  # prefix tokens after the last chunk boundary
    width = -(-(lead + rows) // CHUNK) * CHUNK
    index = torch.zeros(rows, width, dtype=torch.long, device=block.device)
    real = torch.zeros(rows, width, dtype=torch.bool, device=block.device)
    index[:, :lead] = torch.arange(lead, device=block.device)
    real[:, :lead] = True
    row, col = block.nonzero(as_tuple=True)  # row-major: each row's tokens in block order
    slot = lead + block.long().cumsum(1)[row, col] - 1
    index[row, slot] = lead + col
    real[row, slot] = True
    chunks = width // CHUNK
    last_used = real.reshape(rows, chunks, CHUNK).any(-1).long().cumsum(-1).argmax(-1)  # (rows,)
    shorter = [
        (chunks - 1 - used, last_used == used) for used in last_used.unique().tolist() if used + 1 < chunks
    ]
    return index, real, shorter


def _invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix: int,
    layout: Layout,
    scale: float,
) -> torch.Tensor:
    """query (heads, q, d), key/value (kv_heads, kv, d) -> (heads, q, d) in float32
    (float64 for float64 models)."""
    heads, rows, dim = query.shape
    kv_heads = key.shape[0]
    groups = heads // kv_heads
    index, real, shorter = layout
    width = index.shape[1]
    shared = prefix - prefix % CHUNK  # keys in chunks every row sees whole

    # Every query row against the shared keys in one product, and against the tail's keys
    # (padded to whole chunks) in another: a score's bits depend on its query row and key
    # only, not on which other rows or keys share the product (the start-up check and
    # tests/decoders/models/test_exact.py hold this). Each row's tail scores are then gathered into the
    # layout its own pass has: a gather of scores, not of keys.
    packed = query.reshape(kv_heads, groups * rows, dim)  # query rows (group, row) per key head
    parts = []  # (peak, total, mixed): (kv_heads, groups, rows, chunks[, d])
    if shared:
        scores = _rows_product(packed, key[:, :shared].transpose(-1, -2)) * scale  # (kv, g*r, shared)
        peak, total, exps = _partial_softmax(scores)  # (kv, g*r, n[, C])
        values = value[:, :shared].unflatten(1, (shared // CHUNK, CHUNK))  # (kv, n, C, d)
        mixed = _rows_product(exps.transpose(1, 2), values).transpose(1, 2)  # (kv, g*r, n, d)
        unpack = (kv_heads, groups, rows, shared // CHUNK)
        parts.append((peak.reshape(unpack), total.reshape(unpack), mixed.reshape(*unpack, dim)))
    tail_keys = key[:, shared:]
    if tail_keys.shape[1] < width:
        tail_keys = torch.cat([tail_keys, key.new_zeros(kv_heads, width - tail_keys.shape[1], dim)], 1)
    scores = _rows_product(packed, tail_keys.transpose(-1, -2)).reshape(kv_heads, groups, rows, width)
    scores = scores.gather(-1, index.expand(kv_heads, groups, rows, width)) * scale
    peak, total, exps = _partial_softmax(scores.masked_fill(~real, float("-inf")))  # (kv, g, r, nt[, C])
    values = value[:, shared:].index_select(1, index.reshape(-1))  # each row's tail values, its layout
    values = values.reshape(kv_heads, rows, width // CHUNK, CHUNK, dim)
    mixed = _rows_product(exps.permute(0, 2, 3, 1, 4), values)  # (kv, r, nt, g, d)
    parts.append((peak, total, mixed.permute(0, 3, 1, 2, 4)))

    peak = torch.cat([p for p, _, _ in parts], dim=-1)  # (kv_heads, groups, rows, chunks)
    total = torch.cat([t for _, t, _ in parts], dim=-1)
    mixed = torch.cat([m for _, _, m in parts], dim=-2)  # (kv_heads, groups, rows, chunks, d)
    weight = torch.exp(peak - peak.amax(-1, keepdim=True))  # a chunk no key of which the row sees: 0
    # Sums over the chunk axis run along a leading dimension (sequential, so chunks a
    # row does not reach add exact zeros); the softmax sum rides along as column d.
    both = torch.cat([mixed, total.unsqueeze(-1)], dim=-1) * weight.unsqueeze(-1)
    summed = both.sum(-2)  # (kv_heads, groups, rows, d + 1)
    for left_out, selected in shorter:  # rows whose own pass has fewer chunks: sum as it does
        fewer = both[..., : both.shape[-2] - left_out, :].sum(-2)
        summed = torch.where(selected[:, None], fewer, summed)
    out = summed[..., :dim] / summed[..., dim:]
    return out.reshape(heads, rows, dim)


def _partial_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (..., n * CHUNK), -inf where no key -> per chunk the max score (..., n) (-inf:
    no key), the sum of exp(score - max) (..., n), always over CHUNK keys, and the exps
    (..., n, CHUNK) (0 where no key)."""
    scores = scores.unflatten(-1, (-1, CHUNK))
    peak = scores.amax(-1)
    exps = torch.exp(scores - torch.where(peak.isinf(), 0.0, peak).unsqueeze(-1))
    return peak, exps.sum(-1), exps


def _rows_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched), with ``a``'s rows padded with zeros to ``MKL_MIN_ROWS`` in
    float32 and float64: MKL computes products of fewer rows with other sums."""
    rows = a.shape[-2]
    pad = MKL_MIN_ROWS - rows if a.dtype in (torch.float32, torch.float64) else 0
    if pad <= 0:
        return torch.matmul(a, b)
    a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], -2)
    return torch.matmul(a, b)[..., :rows, :]
