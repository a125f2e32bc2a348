from __future__ import annotations

import pytest
import torch

from inferd.layers import quant
from inferd.layers.int4_layout import pack_int4, unpack_int4
from inferd.layers.quant import Int4Linear, Int8Embedding, Int8Linear, quantize_int4, quantize_int8

# Rows spanning both paths: the C kernel up to INT8/INT4_KERNEL_MAX_ROWS (16),
# dequantize + bf16 matmul above.
ROWS = (1, 3, 16, 40)
# Each path's output against x @ dequantize().T (x in its own dtype), as a
# fraction of the largest output:
# - int8 kernel: float32 sums of exact products, then the output dtype's
#   rounding (bf16: 2^-9);
# - int4 kernel: the inputs are rounded to int8 per 32-input block (half a
#   step of max|x| / 127 each), about 1% of the largest output at worst here;
# - matmul path: x and the weight rounded to bf16 (2^-9 each), bf16 output.
KERNEL_TOLERANCE = {"int8": 2**-8, "int4": 2**-5}
MATMUL_TOLERANCE = 2**-7


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different scales, as in real checkpoints.
    return torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g) * 0.1


def _kind(layer: torch.nn.Module) -> str:
    return "int8" if isinstance(layer, Int8Linear) else "int4"


def _max_rows(layer: torch.nn.Module) -> int:
    return quant.INT8_KERNEL_MAX_ROWS if isinstance(layer, Int8Linear) else quant.INT4_KERNEL_MAX_ROWS


def _assert_matches_reference(layer: torch.nn.Module, rows: int, dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    kernel = layer.use_kernel and rows <= _max_rows(layer)
    ref = (x.float() if kernel else x.to(torch.bfloat16).float()) @ layer.dequantize().T
    if layer.bias is not None:
        ref += layer.bias.float()
    out = layer(x)
    assert out.shape == (rows, layer.out_features) and out.dtype == dtype
    tolerance = KERNEL_TOLERANCE[_kind(layer)] if kernel else MATMUL_TOLERANCE
    err = (out.float() - ref).abs().max().item()
    assert err <= tolerance * ref.abs().max().item(), f"rows={rows} kernel={kernel}: max error {err}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(192, 64), (100, 40)])  # 40 inputs: the kernel's scalar tail
def test_int8_linear_matches_its_dequantized_weight(rows, shape):
    _assert_matches_reference(Int8Linear.from_float(_weight(*shape)), rows)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_its_dequantized_weight(rows, group_size):
    # 206 rows: the kernel's 4-row tiles and a 2-row tail.
    _assert_matches_reference(Int4Linear.from_float(_weight(206, 256), group_size), rows)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_output_keeps_the_activation_dtype_and_adds_the_bias(cls):
    weight, bias = _weight(64, 64), torch.randn(64)
    layer = Int8Linear.from_float(weight, bias) if cls is Int8Linear else Int4Linear.from_float(weight, 32, bias)
    for rows in (1, 100):
        _assert_matches_reference(layer, rows, torch.bfloat16)
        _assert_matches_reference(layer, rows, torch.float32)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_and_matmul_paths_agree(kind):
    layer = Int8Linear.from_float(_weight(128, 96)) if kind == "int8" else Int4Linear.from_float(_weight(128, 96), 32)
    x = torch.randn(5, 96)
    kernel = layer(x)
    layer.use_kernel = False
    matmul = layer(x)
    assert (kernel - matmul).abs().max() <= KERNEL_TOLERANCE[kind] * kernel.abs().max()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_without_the_compiled_kernels_every_path_is_the_torch_matmul(kind, monkeypatch):
    layer = Int8Linear.from_float(_weight(64, 64)) if kind == "int8" else Int4Linear.from_float(_weight(64, 64), 32)
    x = torch.randn(2, 64)
    expected = x.to(torch.bfloat16).float() @ layer.dequantize().T
    monkeypatch.setattr(quant, "kernels_available", lambda: False)
    monkeypatch.setattr(quant, "linear_small", None)  # would raise if called
    monkeypatch.setattr(quant, "dequantize_int4", None)
    out = layer(x)
    assert (out - expected).abs().max() <= MATMUL_TOLERANCE * expected.abs().max()


def test_int8_error_is_at_most_half_a_step_per_channel():
    weight = _weight(300, 128)
    codes, scales = quantize_int8(weight)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127
    # Scales are rounded up to bf16, so nothing clips: every row reaches at most 127.
    assert scales.dtype == torch.bfloat16 and (scales.float() >= weight.abs().amax(1) / 127).all()
    error = (codes.float() * scales.float()[:, None] - weight).abs()
    assert (error <= scales.float()[:, None] * 0.5 * (1 + 1e-6)).all()
    assert error.norm() / weight.norm() < 0.01


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_about_half_a_step_per_group(group_size):
    weight = _weight(128, 256)
    codes, scales, zeros = quantize_int4(weight, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    grouped = weight.view(128, -1, group_size)
    restored = (codes.view(128, -1, group_size).float() - 8) * scales.float()[..., None] + zeros.float()[..., None]
    error = (restored - grouped).abs().amax(dim=2)
    # Half a step, plus the bf16 rounding of the stored scale and zero at the
    # ends of the range (2^-8 relative of 15 steps and of the zero).
    bound = scales.float() * (0.5 + 15 * 2**-8) + zeros.float().abs() * 2**-8
    assert (error <= bound).all()
    relative = (restored - grouped).norm() / weight.norm()
    assert relative < {32: 0.09, 64: 0.10, 128: 0.11}[group_size]
    layer = Int4Linear(codes, scales, zeros, group_size)
    assert torch.equal(layer.dequantize(), restored.view(128, 256))


def test_int4_layout_is_ggufs_block_layout_and_round_trips():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (6, 96), dtype=torch.uint8, generator=g)
    packed = pack_int4(codes)
    assert packed.shape == (6, 48) and packed.dtype == torch.uint8
    # Byte j of each 32-input block: input j low, input j + 16 high.
    assert int(packed[2, 16 + 5]) == int(codes[2, 32 + 5]) | int(codes[2, 32 + 21]) << 4
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_int4(torch.zeros(2, 48, dtype=torch.uint8))


def test_bad_group_sizes_and_shapes_are_value_errors():
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        Int4Linear.from_float(_weight(64, 64), 16)
    with pytest.raises(ValueError, match="quantization_group_size 128 does not divide in_features 576"):
        Int4Linear.from_float(_weight(64, 576), 128)
    with pytest.raises(ValueError, match="int8 codes"):
        Int8Linear(torch.zeros(4, 16, dtype=torch.int32), torch.ones(4))
    with pytest.raises(ValueError, match=r"expected input of shape \(T, 64\)"):
        Int8Linear.from_float(_weight(64, 64))(torch.zeros(2, 32))


def test_int8_embedding_reads_rows_of_the_head():
    head = Int8Linear.from_float(_weight(50, 32))
    embed = Int8Embedding(head, torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    rows = embed(ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (4, 32)
    assert torch.equal(rows, head.dequantize()[ids].to(torch.bfloat16))
    assert embed.codes.data_ptr() == head.codes.data_ptr()  # one table, not two
