"""PyTorch's packed int4 CPU weight layout, read back.

``torch._convert_weight_to_int4pack_for_cpu`` turns ``(N, K)`` codes in 0..15
into an opaque ``(N, K / 2)`` uint8 tensor for ``_weight_int4pack_mm_for_cpu``.
The packed kernel is a GEMV: its cost grows with the rows of the input, so many
rows are faster through a bf16 matmul on the dequantized weight, and that
needs the codes back. Keeping a second, plain copy of the codes would double
the int4 weight memory, so this decodes the packed layout instead.

The layout depends on the CPU build torch dispatches to. With AVX-512 the
rows go in blocks of 64; within a block the bytes are ``(K, 32)``, byte
``[k, j]`` holding row ``j`` in its low nibble and row ``32 + j`` in its high
one. A last block of 16, 32 or 48 rows is ``(K, rows / 2)``, byte ``[k, j]``
holding rows ``2j`` (low) and ``2j + 1`` (high). ``packed_layout_is_known``
checks that once per process against torch itself; where it does not hold
(AVX2 or other builds) callers must not decode.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_BLOCK_ROWS = 64
_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_EIGHTS = 0x0808080808080808


def pack_int4(codes: Tensor) -> Tensor:
    """``(N, K)`` codes in 0..15 (any integer dtype) -> torch's packed layout.

    Where the layout is known, 256 rows at a time: each 64-row block packs
    on its own, so the int32 copy torch wants is 256 rows, not 4 bytes per
    weight of the whole matrix (the short last block stays in the last slice)."""
    n, k = codes.shape
    if not packed_layout_is_known():
        return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    out = torch.empty(n, k // 2, dtype=torch.uint8, device=codes.device)
    step = 4 * _BLOCK_ROWS
    for start in range(0, n, step):
        rows = codes[start : start + step].to(torch.int32)
        out[start : start + step] = torch._convert_weight_to_int4pack_for_cpu(rows, 1)
    return out


def row_segments(n_rows: int, max_rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges that can be decoded one at a time: whole
    64-row blocks in chunks of at most ``max_rows`` (rounded down to a block),
    then the short last block if there is one."""
    full = n_rows // _BLOCK_ROWS * _BLOCK_ROWS
    step = max(_BLOCK_ROWS, max_rows // _BLOCK_ROWS * _BLOCK_ROWS)
    segments = [(start, min(start + step, full)) for start in range(0, full, step)]
    if full < n_rows:
        segments.append((full, n_rows))
    return segments


def _nibbles(data: Tensor, centered: bool) -> Tensor:
    """``(2, *data.shape)``: the low then the high nibble of each byte, as uint8
    codes, or ``centered`` as int8 ``code - 8``. Computed on 8 bytes at a time
    when the length allows: 8x fewer elements."""
    if data.numel() % 8 or data.storage_offset() % 8:
        codes = torch.stack([data & 15, data >> 4])
        return codes.to(torch.int8) - 8 if centered else codes
    wide = data.reshape(-1).view(torch.int64)
    out = torch.empty(2, wide.numel(), dtype=torch.int64, device=data.device)
    torch.bitwise_and(wide, _LOW_NIBBLES, out=out[0])
    torch.bitwise_right_shift(wide, 4, out=out[1]).bitwise_and_(_LOW_NIBBLES)
    if centered:
        # code - 8 is the nibble's top bit flipped, sign-extended: bytes whose
        # bit 3 is then set gain 0xF0 (0x08 * 30, no carry into the next byte).
        out.bitwise_xor_(_EIGHTS)
        out.bitwise_or_(out.bitwise_and(_EIGHTS).mul_(30))
    return out.view(torch.int8 if centered else torch.uint8).view(2, *data.shape)


def unpack_int4_t(
    packed: Tensor, n_rows: int, start: int, stop: int, out: Tensor, centered: bool = False
) -> Tensor:
    """Writes the codes of rows ``[start, stop)`` transposed, ``(K, stop -
    start)``, into ``out`` (an integer or float dtype) and returns it;
    ``centered`` writes ``code - 8``. ``[start, stop)`` must be one of
    ``row_segments``: whole 64-row blocks, or the short last block."""
    k = packed.shape[1] * 2
    rows = stop - start
    full = n_rows // _BLOCK_ROWS * _BLOCK_ROWS
    data = packed.view(-1)[start * k // 2 : stop * k // 2]
    if start % _BLOCK_ROWS == 0 and rows % _BLOCK_ROWS == 0 and stop <= full:
        blocks = rows // _BLOCK_ROWS
        # (2, blocks, K, 32) -> (K, blocks, 2, 32): a block's 64 rows in order.
        nibbles = _nibbles(data.view(blocks, k, 32), centered)
        out.view(k, blocks, 2, 32).copy_(nibbles.permute(2, 1, 0, 3))
        return out
    if start != full or stop != n_rows:
        raise ValueError(f"rows [{start}, {stop}) are not a decodable segment of {n_rows} rows")
    # (2, K, rows / 2) -> (K, rows / 2, 2): rows 2j (low) and 2j + 1 (high).
    nibbles = _nibbles(data.view(k, rows // 2), centered)
    out.view(k, rows // 2, 2).copy_(nibbles.permute(1, 2, 0))
    return out


def unpack_int4(packed: Tensor, n_rows: int) -> Tensor:
    """All codes, ``(N, K)`` uint8 (for tests and ``dequantize``)."""
    k = packed.shape[1] * 2
    out = torch.empty(k, n_rows, dtype=torch.uint8)
    for start, stop in row_segments(n_rows, n_rows):
        out[:, start:stop] = unpack_int4_t(packed, n_rows, start, stop, torch.empty(k, stop - start, dtype=torch.uint8))
    return out.T.contiguous()


@functools.cache
def packed_layout_is_known() -> bool:
    """Whether ``unpack_int4`` reads this torch build's layout back exactly:
    checked on 80 random rows (a full block and a short one)."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (80, 64), dtype=torch.int32, generator=generator)
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        return torch.equal(unpack_int4(packed, 80), codes.to(torch.uint8))
    except (RuntimeError, ValueError):
        return False
