"""The compiled CPU paged-attention kernel against gather + SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.layers.cpu_kernels import kernels_available, paged_decode_attention


def test_the_kernel_builds_on_this_machine():
    # CI runs on this kind of machine: a missing compiler must fail loudly,
    # not fall back silently to the slow path.
    assert kernels_available()


def _reference(q, k_cache, v_cache, tables, seq_lens, scale):  # noqa: ANN001, ANN202
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = []
    for i in range(rows):
        n = int(seq_lens[i])
        blocks = tables[i, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()
        o = F.scaled_dot_product_attention(
            q[i].float().view(kv_heads, heads // kv_heads, dim), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        out.append(o.reshape(heads, dim))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 1)])
def test_matches_sdpa_over_the_gathered_cache(dtype, heads, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(heads * dim + block_size)
    num_blocks, rows = 64, 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5])
    max_blocks = int(-(-seq_lens.max() // block_size))
    # Distinct random blocks per row; padding entries point at block 0.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: rows * max_blocks].view(rows, max_blocks).clone()
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, k_cache, v_cache, tables, seq_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max() <= tol


def test_reads_only_each_rows_own_blocks():
    # NaNs everywhere but the blocks in use: any stray read would show.
    k_cache = torch.full((8, 4, 1, 16), float("nan"))
    v_cache = torch.full((8, 4, 1, 16), float("nan"))
    k_cache[5], v_cache[5] = torch.randn(4, 1, 16), torch.randn(4, 1, 16)
    k_cache[2, :2], v_cache[2, :2] = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    tables = torch.tensor([[5, 2, 7]])  # block 7 lies beyond the length
    out = paged_decode_attention(torch.randn(1, 2, 16), k_cache, v_cache, tables, torch.tensor([6]), 0.25)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(seq_lens=torch.tensor([0])), "sequence length"),
        (dict(seq_lens=torch.tensor([13])), "sequence length"),
        (dict(tables=torch.tensor([[0, 99, 1]])), "block id"),
        (dict(q=torch.randn(1, 3, 16)), "multiple of num_kv_heads"),
        (dict(q=torch.randn(1, 4, 16).half()), "dtype"),
        (dict(tables=torch.tensor([0, 1, 2])), "tables must be"),
    ],
)
def test_bad_arguments_are_value_errors(change, message):
    args = dict(
        q=torch.randn(1, 4, 16),
        k_cache=torch.randn(4, 4, 2, 16),
        v_cache=torch.randn(4, 4, 2, 16),
        tables=torch.tensor([[0, 1, 2]]),
        seq_lens=torch.tensor([9]),
    ) | change
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, scale=0.25)


def test_loading_the_kernels_keeps_subnormal_floats():
    # A library built with -ffast-math by GCC < 13 would switch the whole
    # process to flush-to-zero when loaded.
    import numpy as np

    from inferd.layers import cpu_kernels

    assert cpu_kernels.kernels_available()
    tiny = np.array([1e-38], dtype=np.float32)
    assert (tiny / np.float32(1000))[0] > 0
    assert float(torch.tensor([1e-38]) / 1000) > 0
