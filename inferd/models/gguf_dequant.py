"""Dequantization of GGUF tensor data, and undoing llama.cpp's q/k row permutation.

GGUF stores a tensor's dims fastest-first (``ne0`` = columns), so the bytes of
a 2-D tensor read as a row-major ``(rows, cols)`` array are already in Hugging
Face ``[out_features, in_features]`` order. Block-quantized types pack each
row into blocks of 32 consecutive columns; the reader hands those rows over as
``(rows, bytes_per_row)`` uint8.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The types inferd turns into floating-point tensors.
DEQUANTIZABLE_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)


def dequantize(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A new ``shape`` tensor of ``dtype`` from raw GGUF tensor data.

    ``data`` is what ``gguf.GGUFReader`` gives for the tensor (a read-only
    memmap view); ``shape`` is in HF order (slowest dim first). The arithmetic
    is float32, in the same order as ``gguf.quants``, so results match it bit
    for bit.
    """
    if qtype == GGMLQuantizationType.BF16:
        # bfloat16 is the top half of a float32: no arithmetic needed.
        bits = torch.from_numpy(np.array(data).view(np.int16).reshape(shape))
        return bits.view(torch.bfloat16).to(dtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(data).reshape(shape)).to(dtype)
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == GGMLQuantizationType.Q8_0:
        values = _q8_0(blocks)
    elif qtype == GGMLQuantizationType.Q4_0:
        values = _q4_0(blocks)
    elif qtype == GGMLQuantizationType.Q4_1:
        values = _q4_1(blocks)
    else:
        raise ValueError(f"cannot dequantize GGUF tensor type {qtype.name}")
    return torch.from_numpy(values.reshape(shape)).to(dtype)


def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    # (n_blocks, 1) float32 from the float16 at byte ``start`` of each block.
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    # (n_blocks, 16) bytes -> (n_blocks, 32): element j is the low nibble of byte j,
    # element 16 + j its high nibble.
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # Block: float16 scale d, then 32 int8 quants q; value = d * q.
    quants = blocks[:, 2:].view(np.int8).astype(np.float32)
    return _scale(blocks, 0) * quants


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # Block: float16 scale d, then 16 bytes of 4-bit quants q; value = d * (q - 8).
    quants = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return _scale(blocks, 0) * quants.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # Block: float16 scale d, float16 minimum m, then 16 bytes of 4-bit quants q;
    # value = d * q + m.
    quants = _nibbles(blocks[:, 4:]).astype(np.float32)
    return _scale(blocks, 0) * quants + _scale(blocks, 2)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k projection's rows.

    llama.cpp's converter reorders each head's rows from HF's rotate-half
    layout to interleaved pairs: viewing the rows as ``(n_head, 2, half)`` it
    stores them as ``(n_head, half, 2)``. Rows are moved whole, so this works
    on float rows and on rows of quantized blocks alike. ``n_head`` is the
    number of KV heads for k.
    """
    n_rows = rows.shape[0]
    if n_rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {n_rows} rows into {n_head} heads of pairs")
    half = n_rows // n_head // 2
    # (n_head, half, 2, ...) -> (n_head, 2, half, ...)
    grouped = rows.reshape(n_head, half, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(rows.shape)


# Types whose blocks map one to one onto inferd's int4 layout (group size 32).
INT4_BLOCK_TYPES: tuple[GGMLQuantizationType, ...] = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
GGUF_BLOCK_SIZE = 32


def q4_affine(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 tensor's own codes and block constants, no float round trip:
    ``(rows, cols)`` uint8 codes in 0..15 and ``(rows, cols / 32)`` float32
    scales and minimums with ``value = code * scale + minimum`` exactly as
    ``dequantize`` computes it (Q4_0: minimum = -8 * scale)."""
    if qtype not in INT4_BLOCK_TYPES:
        raise ValueError(f"GGUF tensor type {qtype.name} has no 4-bit codes")
    rows, cols = shape
    blocks = np.asarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    scale = _scale(blocks, 0)
    if qtype == GGMLQuantizationType.Q4_0:
        codes, minimum = _nibbles(blocks[:, 2:]), -8 * scale
    else:
        codes, minimum = _nibbles(blocks[:, 4:]), _scale(blocks, 2)
    per_row = cols // GGUF_BLOCK_SIZE
    return (
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
        torch.from_numpy(scale.reshape(rows, per_row)),
        torch.from_numpy(np.ascontiguousarray(minimum).reshape(rows, per_row)),
    )
