"""The compiled few-row linear kernels against PyTorch on the same weights."""

from __future__ import annotations

import pytest
import torch

from inferd.layers.cpu_kernels import LINEAR_MAX_ROWS, dequantize_int4, kernels_available, linear_small
from inferd.layers.linear import FLOAT32_KERNEL_MAX_ROWS, Linear, dense_kernel_max_rows, dense_linear
from inferd.layers.quant import Int4Linear, Int8Linear


def test_the_kernels_build_on_this_machine():
    # CI runs on this kind of machine: a missing compiler must fail loudly.
    assert kernels_available()


def _inputs(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, LINEAR_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 40), (7, 1000)])  # 40, 1000: tails past the 32-wide loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weights_match_torch(rows, n, k, dtype):
    weight = _inputs(n, k, dtype, seed=1)
    x = _inputs(rows, k, dtype)
    out = linear_small(x, weight)
    # float32 sums of the same products: only summation order (and the
    # output's bf16 rounding) differs.
    ref = x.float() @ weight.float().T
    assert out.dtype == dtype and out.shape == (rows, n)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    assert (out.float() - ref).abs().max() <= tolerance * ref.abs().max()


@pytest.mark.parametrize("rows", [1, 5, LINEAR_MAX_ROWS])
def test_int8_kernel_is_exact_in_float32(rows):
    layer = Int8Linear.from_float(_inputs(70, 96, torch.float32, seed=2))
    x = _inputs(rows, 96, torch.float32)
    out = linear_small(x, layer.codes, layer.scales)
    ref = x @ layer.dequantize().T
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_int4_kernel_is_exact_on_its_int8_rounded_inputs():
    layer = Int4Linear.from_float(_inputs(64, 256, torch.float32, seed=3), 32)
    x = _inputs(3, 256, torch.float32)
    out = linear_small(x, layer.packed, layer.scales_zeros, 32)
    # The kernel's own arithmetic redone in float64: inputs rounded to int8
    # per 32-input block (half away from zero), times the float weight, the
    # codes' part and the zero point's alike.
    blocks = x.double().view(-1, 32)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    rounded = ((blocks / scale).abs().add(0.5).floor() * blocks.sign() * scale).view(3, 256)
    exact = rounded @ layer.dequantize().double().T
    assert (out.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # And within the rounding of the float answer.
    ref = x @ layer.dequantize().T
    assert (out - ref).abs().max() <= 2**-5 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantization_matches_the_layers_float_weight(dtype):
    layer = Int4Linear.from_float(_inputs(40, 128, torch.float32, seed=4), 64)
    out = torch.empty(30, 128, dtype=dtype)
    dequantize_int4(layer.packed, layer.scales_zeros, 64, 5, 35, out)
    assert torch.equal(out, layer.dequantize()[5:35].to(dtype))


def test_bad_arguments_are_value_errors():
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="does not fit"):
        linear_small(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="rows outside"):
        linear_small(torch.randn(LINEAR_MAX_ROWS + 1, 64), weight)
    with pytest.raises(ValueError, match="does not fit"):
        linear_small(torch.randn(2, 64, dtype=torch.float64), weight)
    layer = Int4Linear.from_float(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="group_size"):
        linear_small(torch.randn(1, 64), layer.packed, layer.scales_zeros, 48)
    with pytest.raises(ValueError, match="rows"):
        dequantize_int4(layer.packed, layer.scales_zeros, 32, 4, 12, torch.empty(8, 64))


def test_dense_linear_uses_the_kernel_for_few_rows_only(monkeypatch):
    import inferd.layers.linear as linear_module

    layer = Linear(64, 48, bias=True)
    calls = []
    real = linear_module.linear_small
    monkeypatch.setattr(linear_module, "linear_small", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    with torch.inference_mode():
        for rows in (1, FLOAT32_KERNEL_MAX_ROWS, FLOAT32_KERNEL_MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5)
    assert calls == [1, FLOAT32_KERNEL_MAX_ROWS]
    assert dense_kernel_max_rows(torch.float32) == FLOAT32_KERNEL_MAX_ROWS
    assert dense_kernel_max_rows(torch.float16) == 0
    # Autograd keeps PyTorch's path: the kernel records no graph.
    x = torch.randn(1, 64)
    assert dense_linear(x, layer.weight).requires_grad
