"""Exact mode's C attention kernel: it computes attention, each row's bits depend on that row
alone, and where it cannot be built exact attention keeps its Python route."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from specdec.decoders.models import cpu, native
from specdec.decoders.models.exact_attention import exact_attention, visible_layout

needs_kernel = pytest.mark.skipif(
    not cpu.has("native_attention"), reason=f"native_attention: needs {cpu.NEEDS['native_attention']}"
)
PARENTS = [-1, 0, 0, 1, 3, -1, 5]  # two roots, a branch, a chain under it


def reference(query, key, value, prefix, block, scale):
    """Each row's softmax attention over the prefix and its visible block keys, in float64."""
    heads, rows, dim = query.shape
    groups = heads // key.shape[0]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        keys = list(range(prefix)) + [prefix + c for c in block[r].nonzero().flatten().tolist()]
        for h in range(heads):
            k, v = key[h // groups, keys].double(), value[h // groups, keys].double()
            weights = torch.softmax(query[h, r].double() @ k.T * scale, -1)
            out[r, h] = weights @ v
    return out


def tree_block(parents):
    rows = len(parents)
    block = torch.zeros(rows, rows, dtype=torch.bool)
    for r in range(rows):
        node = r
        while node >= 0:
            block[r, node] = True
            node = parents[node]
    return block


def inputs(prefix, rows, dtype, heads=6, kv_heads=2, dim=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, dim, generator=generator).to(dtype)
    k = torch.randn(kv_heads, prefix + rows, dim, generator=generator).to(dtype)
    v = torch.randn(kv_heads, prefix + rows, dim, generator=generator).to(dtype)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("dim", [32, 24])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 1, 17, 64, 131])
def test_the_kernel_computes_attention(dtype, prefix, dim):
    q, k, v = inputs(prefix, len(PARENTS), dtype, dim=dim)
    block = tree_block(PARENTS)
    got = native.attend(native.kernel(dtype), q, k, v, prefix, *native.visible_rows(block), 0.3)
    tolerance = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(
        got.double(), reference(q, k, v, prefix, block, 0.3), rtol=tolerance, atol=tolerance
    )


@needs_kernel
@pytest.mark.parametrize("dim", [32, 24])  # (16-key score blocks where the head dimension allows)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_bits_of_its_own_single_token_pass(dtype, dim):
    """Every node of a tree, after prefixes that put its keys at every offset of a vector's
    lanes and of a 16-key block, against the pass standard decoding makes for it: one row,
    its ancestors cached."""
    kernel = native.kernel(dtype)
    block = tree_block(PARENTS)
    for prefix in range(0, 40, 3):
        q, k, v = inputs(prefix, len(PARENTS), dtype, dim=dim, seed=prefix)
        together = native.attend(kernel, q, k, v, prefix, *native.visible_rows(block), 0.25)
        for row in range(len(PARENTS)):
            seen = [prefix + c for c in block[row].nonzero().flatten().tolist()]
            keys = torch.cat([k[:, :prefix], k[:, seen]], 1)
            values = torch.cat([v[:, :prefix], v[:, seen]], 1)
            alone = native.attend(
                kernel,
                q[:, row : row + 1],
                keys,
                values,
                keys.shape[1] - 1,
                *native.visible_rows(tree_block([-1])),
                0.25,
            )
            assert torch.equal(together[row], alone[0]), (prefix, row)


@needs_kernel
def test_exact_attention_takes_the_kernel_and_steps_aside_when_forced_absent(monkeypatch):
    calls = []
    real = native.attend
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1) or real(*args))
    q, k, v = inputs(40, 3, torch.float32)
    module = torch.nn.Module()
    kernel_out, _ = exact_attention(module, q[None], k[None], v[None], None)
    assert len(calls) == 1
    monkeypatch.setenv(cpu.ABSENT_ENV, "native_attention")
    python_out, _ = exact_attention(module, q[None], k[None], v[None], None)
    assert len(calls) == 1 and not cpu.has("native_attention")
    torch.testing.assert_close(kernel_out, python_out)


def test_a_row_that_misses_part_of_the_prefix_has_no_kernel_layout():
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 1, 0] = False  # (a sliding window or padding)
    assert visible_layout(mask, 4, 2, torch.device("cpu")) is None
    order, counts = visible_layout(None, 4, 3, torch.device("cpu"))
    assert counts.tolist() == [1, 2, 3] and order[2].tolist() == [0, 1, 2]


def test_a_compiler_that_fails_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match=r"^false failed"):
        native.build(tmp_path)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets only")
@pytest.mark.parametrize("arch", ["x86-64-v2", "x86-64-v3", "x86-64-v4"])
def test_the_source_compiles_for_cpus_with_and_without_avx512(arch, tmp_path):
    """``-march=native`` picks the code paths of the CPU at hand; the others must compile too
    (an AVX2-only CPU takes the paths without score blocks or BF16 dot products)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    flags = [f if f != "-march=native" else f"-march={arch}" for f in native.FLAGS]
    result = subprocess.run(
        [compiler, *flags, str(native.SOURCE), "-o", str(tmp_path / "k.so"), "-lm"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
