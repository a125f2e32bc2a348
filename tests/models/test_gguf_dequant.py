from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from inferd.models.gguf_dequant import dequantize, unpermute_rows

Q = gguf.GGMLQuantizationType


def _block(*parts: bytes) -> np.ndarray:
    return np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(1, -1)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_q8_0_block_is_scale_times_int8():
    quants = np.arange(-16, 16, dtype=np.int8)
    out = dequantize(_block(_f16(0.5), quants.tobytes()), Q.Q8_0, (1, 32), torch.float32)
    assert torch.equal(out, torch.arange(-16, 16, dtype=torch.float32).mul(0.5).reshape(1, 32))


def test_q4_0_block_low_nibbles_first_then_high_minus_8():
    # Byte k holds element k (low nibble) and element k + 16 (high nibble); here both are k.
    packed = bytes(k | (k << 4) for k in range(16))
    out = dequantize(_block(_f16(2.0), packed), Q.Q4_0, (1, 32), torch.float32)
    expected = [2.0 * (k - 8) for k in range(16)] * 2
    assert out.tolist() == [expected]


def test_q4_1_block_is_scale_times_nibble_plus_min():
    packed = bytes((15 - k) | (k << 4) for k in range(16))
    out = dequantize(_block(_f16(0.25), _f16(-1.0), packed), Q.Q4_1, (1, 32), torch.float32)
    expected = [0.25 * (15 - k) - 1.0 for k in range(16)] + [0.25 * k - 1.0 for k in range(16)]
    assert out.tolist() == [expected]


def test_bf16_is_the_top_half_of_float32():
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    out = dequantize(bits.view(np.uint8).reshape(1, 8), Q.BF16, (1, 4), torch.float32)
    assert out.tolist() == [[1.0, -2.5, 3.140625, 0.0]]
    assert dequantize(bits.view(np.uint8).reshape(1, 8), Q.BF16, (1, 4), torch.bfloat16).dtype == torch.bfloat16


def test_float_types_copy_and_convert():
    data = np.array([[0.5, -1.25], [3.0, 4.0]], dtype=np.float16)
    out = dequantize(data, Q.F16, (2, 2), torch.float32)
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, -1.25], [3.0, 4.0]]
    data32 = np.array([1.5, 2.5], dtype=np.float32)
    out32 = dequantize(data32, Q.F32, (2,), torch.float16)
    out32[0] = 9.0  # a copy: the (read-only, memory-mapped) source is never written
    assert out32.dtype == torch.float16 and data32.tolist() == [1.5, 2.5]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_matches_gguf_reference_bit_for_bit(qtype):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((8, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(values, qtype)
    reference = gguf.quants.dequantize(blocks, qtype)
    assert torch.equal(dequantize(blocks, qtype, (8, 128), torch.float32), torch.from_numpy(reference))


def test_unsupported_type_is_a_value_error():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(np.zeros((1, 144), dtype=np.uint8), Q.Q4_K, (1, 256), torch.float32)


def test_unpermute_restores_rotate_half_order():
    # One head of 4 rows: llama.cpp interleaves the halves [0, 1 | 2, 3] as [0, 2, 1, 3].
    rows = np.array([0, 2, 1, 3])
    assert unpermute_rows(rows, 1).tolist() == [0, 1, 2, 3]


def test_unpermute_inverts_llama_cpp_permutation(tiny_gguf):
    rng = np.random.default_rng(2)
    for n_head, shape in [(4, (64, 8)), (2, (32,)), (3, (192, 5))]:
        w = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(unpermute_rows(tiny_gguf.permute(w, n_head), n_head), w)
    # Rows of quantized blocks move whole, like float rows.
    blocks = rng.integers(0, 256, (16, 18), dtype=np.uint8)
    assert np.array_equal(unpermute_rows(tiny_gguf.permute(blocks, 2), 2), blocks)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="6 rows into 2 heads"):
        unpermute_rows(np.zeros((6, 4)), 2)
