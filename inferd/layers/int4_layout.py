"""inferd's packed int4 weight layout: two 4-bit codes a byte.

``(N, K)`` codes in 0..15 are stored as ``(N, K / 2)`` uint8, each row in
blocks of 32 inputs taking 16 bytes: byte ``j`` of a block holds input ``j``
in its low nibble and input ``j + 16`` in its high one. It is GGUF's Q4_0 /
Q4_1 block layout, and it suits the CPU kernel (``kernels/linear.c``): 8
bytes widen to 8 lanes whose low nibbles are 8 consecutive inputs and whose
high nibbles are the 8 inputs 16 further on, so no shuffle is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32


def _check(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"int4 packing needs in_features divisible by {BLOCK}, got {k}")


def pack_int4(codes: Tensor) -> Tensor:
    """``(N, K)`` codes in 0..15 (any integer dtype) -> ``(N, K / 2)`` uint8."""
    n, k = codes.shape
    _check(k)
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """``(N, K / 2)`` uint8 -> ``(N, K)`` uint8 codes."""
    n, half = packed.shape
    blocks = packed.reshape(n, half * 2 // BLOCK, 1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, half * 2)
