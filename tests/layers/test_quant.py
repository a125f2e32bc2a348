from __future__ import annotations

import pytest
import torch

from inferd.layers import quant
from inferd.layers.int4_layout import pack_int4, packed_layout_is_known, unpack_int4
from inferd.layers.quant import Int4Linear, Int8Embedding, Int8Linear, quantize_int4, quantize_int8

# Rows spanning both kernel paths: packed up to INT8_PACKED_MAX_ROWS (12) and
# INT4_PACKED_MAX_ROWS (64), dequantize + bf16 matmul above.
ROWS = (1, 7, 32, 100)
# Output against x @ dequantize().T with x rounded to bf16 as the layer does:
# what is left is bf16 rounding of the output (2^-9 relative) and, on the
# dequantize path, of the weight or a per-channel rescale (2^-9 each).
OUTPUT_TOLERANCE = 2**-7


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different scales, as in real checkpoints.
    return torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g) * 0.1


def _assert_matches_reference(layer: torch.nn.Module, rows: int, dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = x.to(torch.bfloat16).float() @ layer.dequantize().T
    if layer.bias is not None:
        ref += layer.bias.float()
    out = layer(x)
    assert out.shape == (rows, layer.out_features) and out.dtype == dtype
    err = (out.float() - ref).abs().max().item()
    assert err <= OUTPUT_TOLERANCE * ref.abs().max().item(), f"rows={rows}: max error {err}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(192, 64), (100, 40)])  # 40 inputs: no packed kernel, always dequantized
def test_int8_linear_matches_its_dequantized_weight(rows, shape):
    _assert_matches_reference(Int8Linear.from_float(_weight(*shape)), rows)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_its_dequantized_weight(rows, group_size):
    # 208 rows: three whole 64-row blocks of the packed layout and a 16-row tail.
    _assert_matches_reference(Int4Linear.from_float(_weight(208, 256), group_size), rows)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_output_keeps_the_activation_dtype_and_adds_the_bias(cls):
    weight, bias = _weight(64, 64), torch.randn(64)
    layer = Int8Linear.from_float(weight, bias) if cls is Int8Linear else Int4Linear.from_float(weight, 32, bias)
    for rows in (1, 100):
        _assert_matches_reference(layer, rows, torch.bfloat16)
        _assert_matches_reference(layer, rows, torch.float32)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_and_dequantized_paths_agree(kind, monkeypatch):
    layer = Int8Linear.from_float(_weight(128, 96)) if kind == "int8" else Int4Linear.from_float(_weight(128, 96), 32)
    x = torch.randn(20, 96)
    threshold = "INT8_PACKED_MAX_ROWS" if kind == "int8" else "INT4_PACKED_MAX_ROWS"
    monkeypatch.setattr(quant, threshold, 1000)
    packed = layer(x)
    monkeypatch.setattr(quant, threshold, 0)
    dequantized = layer(x)
    assert (packed - dequantized).abs().max() <= OUTPUT_TOLERANCE * packed.abs().max()


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


def test_int4_layout_round_trips():
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert packed_layout_is_known()
    if not packed_layout_is_known():
        pytest.skip("this torch build packs int4 in a layout inferd does not decode")
    g = torch.Generator().manual_seed(3)
    for rows in (16, 48, 64, 80, 192):
        codes = torch.randint(0, 16, (rows, 64), dtype=torch.uint8, generator=g)
        assert torch.equal(unpack_int4(pack_int4(codes), rows), codes), rows


def test_bad_group_sizes_and_shapes_are_value_errors():
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        Int4Linear.from_float(_weight(64, 64), 16)
    with pytest.raises(ValueError, match="quantization_group_size 128 does not divide in_features 576"):
        Int4Linear.from_float(_weight(64, 576), 128)
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        Int4Linear.from_float(_weight(40, 64), 32)
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
