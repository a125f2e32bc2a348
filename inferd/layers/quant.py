"""Weight-only int8 and int4 linear layers for CPU.

Weights are stored in 8 or 4 bits and activations stay floating point.
Decoding a few sequences is bound by reading the weights, so 1 or 0.5 bytes
per weight instead of 4 is the speed-up. Each layer picks one of two ways per
call, by the number of input rows:

- few rows: PyTorch's packed kernels (``torch._weight_int8pack_mm``,
  ``torch._weight_int4pack_mm_for_cpu``), which stream the low-bit weight at
  memory speed. They are GEMV-like, so their cost grows linearly with rows,
  and they are fast only with bfloat16 activations (with float32 ones, 10x
  slower for int8 and 27x for int4 at one row);
- many rows (prefill chunks, large decode batches): dequantize the weight into
  a shared bf16 scratch buffer and run one bf16 matmul (oneDNN, AMX), whose
  cost is nearly flat in rows.

Both compute in bfloat16, whatever the model's activation dtype; the output
comes back in the input's dtype. The crossovers below were measured with
``benchmarks/quant_kernels.py`` (results/quant_kernels.json) on 2 cores with
AVX-512 and AMX, default model shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.layers.int4_layout import pack_int4, packed_layout_is_known, row_segments, unpack_int4, unpack_int4_t

KERNEL_DTYPE = torch.bfloat16
QUANTIZATION_METHODS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
# Rows up to which the packed kernels beat dequantize + bf16 matmul, summed
# over a decoder layer's qkv, o, gate_up and down (us, 2 threads, from
# benchmarks/results/quant_kernels.json):
#   int8  M=12: packed 519 vs dequantized 610;  M=16: 698 vs 621
#   int4  M=64: packed 2582 vs dequantized 2894; M=128: 5084 vs 2993
# (int8 LM head 49152x576: M=12 4579 vs 5096, M=16 6041 vs 5191).
# Unpacking int4 in eager torch is the costly part (1.4 ms for 3072x576,
# against 0.3 ms to widen int8), hence its higher crossover.
INT8_PACKED_MAX_ROWS = 12
INT4_PACKED_MAX_ROWS = 64
# Weight elements dequantized at a time on the matmul path: the 49152-row LM
# head goes in slices so the scratch stays 8 MB. Smaller, cache-sized slices
# were slower (3072x576 at 32 rows: int4 6.0 ms in 32K-element slices, 1.6 ms
# whole; int8 0.80 vs 0.35 ms): in eager torch per-op overhead wins over cache reuse.
_DEQUANT_CHUNK_ELEMENTS = 1 << 22
# _weight_int8pack_mm reads K in 16-wide vectors: other K give wrong sums or
# crash (measured: K = 8, 24, 36, 40), so those layers always dequantize.
_INT8_PACKED_K_MULTIPLE = 16


class DequantScratch:
    """Buffers the quantized layers of one model share on the dequantize path.

    Steps run one at a time, so one buffer per dtype, sized to the largest
    chunk, serves every layer and the path never allocates a weight-sized
    tensor: memory stays one chunk whatever the batch. (Speed is the same
    either way here: 129 vs 131 us to widen 3072x576 int8 into it or into a
    fresh tensor.)
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = rows * cols
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(rows, cols)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: ``(out, in)`` float -> int8 codes in
    -127..127 and ``(out,)`` bf16 scales with ``weight ~ codes * scales``.

    The scale is rounded up to a bf16 value before the codes are chosen, so
    the stored scale is the one the codes were rounded against and nothing
    clips."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    stored = scale.to(KERNEL_DTYPE)
    low = stored.float() < scale
    stored[low] = torch.nextafter(stored[low], torch.full_like(stored[low], float("inf")))
    codes = torch.round(w / stored.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, stored


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 per group of ``group_size`` inputs: ``(out, in)`` float ->
    codes in 0..15 (uint8) and ``(out, in / group_size)`` scales and zeros,
    bf16, with ``weight ~ (codes - 8) * scale + zero`` (the kernel's form).

    Codes are rounded against the bf16 scale and zero actually stored."""
    n, k = weight.shape
    _check_group(group_size, k)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).to(KERNEL_DTYPE)
    zero = (lo + 8 * scale.float()).to(KERNEL_DTYPE)
    codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scale, zero


def _check_group(group_size: int, in_features: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(
            f"quantization_group_size {group_size} does not divide in_features {in_features}"
        )


def _finish(out: Tensor, dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    out = out.to(dtype)
    return out if bias is None else out.add_(bias)


def _check_input(x: Tensor, in_features: int) -> None:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected input of shape (T, {in_features}), got {tuple(x.shape)}")


class Int8Linear(nn.Module):
    """``y = x @ (codes * scales[:, None]).T + bias``: int8 codes ``(out, in)``
    and one bf16 scale per output channel."""

    def __init__(
        self, codes: Tensor, scales: Tensor, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"int8 codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
        self.out_features, self.in_features = codes.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"scales must have shape ({self.out_features},), got {tuple(scales.shape)}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.scratch = scratch if scratch is not None else DequantScratch()
        self._packed = self.in_features % _INT8_PACKED_K_MULTIPLE == 0

    @classmethod
    def from_float(
        cls, weight: Tensor, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> Int8Linear:
        codes, scales = quantize_int8(weight)
        return cls(codes, scales, bias, scratch)

    def forward(self, x: Tensor) -> Tensor:
        """(T, in) -> (T, out) in x's dtype."""
        _check_input(x, self.in_features)
        xb = x.to(KERNEL_DTYPE).contiguous()
        if self._packed and x.shape[0] <= INT8_PACKED_MAX_ROWS:
            out = torch._weight_int8pack_mm(xb, self.codes, self.scales)
        else:
            out = self._dequantized_matmul(xb)
        return _finish(out, x.dtype, self.bias)

    def _dequantized_matmul(self, x: Tensor) -> Tensor:
        # The per-channel scale factors out of the matmul: (x @ codes.T) * scales.
        step = max(1, _DEQUANT_CHUNK_ELEMENTS // self.in_features)
        parts = []
        for start in range(0, self.out_features, step):
            rows = self.codes[start : start + step]
            weight = self.scratch.take(rows.shape[0], self.in_features, KERNEL_DTYPE, x.device)
            parts.append(F.linear(x, weight.copy_(rows)))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.mul_(self.scales)

    def dequantize(self) -> Tensor:
        """The float32 ``(out, in)`` weight this layer multiplies by."""
        return self.codes.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """A token embedding that reads an ``Int8Linear``'s table: a tied LM head
    and embedding share the int8 codes, and looked-up rows are dequantized."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype
        self.register_buffer("codes", table.codes)
        self.register_buffer("scales", table.scales)

    def forward(self, input_ids: Tensor) -> Tensor:
        """(T,) token ids -> (T, hidden) in the model's dtype."""
        rows = self.codes.index_select(0, input_ids).float()
        return (rows * self.scales.index_select(0, input_ids).float()[:, None]).to(self.dtype)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias``, ``W[n, k] = (codes[n, k] - 8) * scale[n, g] +
    zero[n, g]`` with ``g = k // group_size``: 4-bit codes and one bf16 scale
    and zero per group of consecutive inputs (asymmetric)."""

    def __init__(
        self,
        codes: Tensor,
        scales: Tensor,
        zeros: Tensor,
        group_size: int,
        bias: Tensor | None = None,
        scratch: DequantScratch | None = None,
    ) -> None:
        super().__init__()
        if codes.dim() != 2:
            raise ValueError(f"int4 codes must be 2-D, got shape {tuple(codes.shape)}")
        self.out_features, self.in_features = codes.shape
        _check_group(group_size, self.in_features)
        if self.out_features % 16:
            raise ValueError(f"int4 layers need out_features divisible by 16, got {self.out_features}")
        groups = (self.out_features, self.in_features // group_size)
        if scales.shape != groups or zeros.shape != groups:
            raise ValueError(
                f"scales and zeros must have shape {groups}, got {tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        self.group_size = group_size
        self.register_buffer("packed", pack_int4(codes))
        # (in / group, out, 2) bf16: the kernel's scales_and_zeros.
        pairs = torch.stack([scales.T.to(KERNEL_DTYPE), zeros.T.to(KERNEL_DTYPE)], dim=-1)
        self.register_buffer("scales_and_zeros", pairs.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.scratch = scratch if scratch is not None else DequantScratch()
        self._decodable = packed_layout_is_known()

    @classmethod
    def from_float(
        cls, weight: Tensor, group_size: int, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> Int4Linear:
        codes, scales, zeros = quantize_int4(weight, group_size)
        return cls(codes, scales, zeros, group_size, bias, scratch)

    @classmethod
    def from_affine(
        cls,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor,
        group_size: int,
        bias: Tensor | None = None,
        scratch: DequantScratch | None = None,
    ) -> Int4Linear:
        """From ``W = codes * scale + min`` per group (GGUF Q4_1; Q4_0 is
        ``min = -8 * scale``): the zero is ``min + 8 * scale``, in float32,
        then both are rounded to bf16."""
        zeros = mins.float() + 8 * scales.float()
        return cls(codes, scales.float(), zeros, group_size, bias, scratch)

    def forward(self, x: Tensor) -> Tensor:
        """(T, in) -> (T, out) in x's dtype."""
        _check_input(x, self.in_features)
        xb = x.to(KERNEL_DTYPE).contiguous()
        if x.shape[0] <= INT4_PACKED_MAX_ROWS or not self._decodable:
            out = torch._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = self._dequantized_matmul(xb)
        return _finish(out, x.dtype, self.bias)

    def _dequantized_matmul(self, x: Tensor) -> Tensor:
        k, g = self.in_features, self.group_size
        parts = []
        for start, stop in row_segments(self.out_features, _DEQUANT_CHUNK_ELEMENTS // k):
            rows = stop - start
            weight_t = self.scratch.take(k, rows, KERNEL_DTYPE, x.device)  # (in, rows)
            unpack_int4_t(self.packed, self.out_features, start, stop, weight_t, centered=True)
            # (codes - 8) * s + z as the kernel computes it: float32 math on the
            # stored bf16 scale and zero, rounded once. (Folding the 8 into the
            # zero would round z - 8 s, an error shared by the whole group.)
            pairs = self.scales_and_zeros[:, start:stop]  # (in / g, rows, 2)
            # Contiguous copies (small): broadcasting a stride-2 operand is 5x slower.
            scales, zeros = pairs[..., 0].contiguous(), pairs[..., 1].contiguous()
            grouped = weight_t.view(k // g, g, rows)
            torch.addcmul(zeros[:, None], grouped, scales[:, None], out=grouped)
            parts.append(x @ weight_t)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def dequantize(self) -> Tensor:
        """The float32 ``(out, in)`` weight this layer multiplies by."""
        if not self._decodable:
            # Through the kernel itself: float32 rows of the identity pick out W.T exactly.
            eye = torch.eye(self.in_features, device=self.packed.device)
            return torch._weight_int4pack_mm_for_cpu(
                eye, self.packed, self.group_size, self.scales_and_zeros.float()
            ).T.contiguous()
        codes = unpack_int4(self.packed, self.out_features).float()
        pairs = self.scales_and_zeros.float().transpose(0, 1)  # (out, in / g, 2)
        grouped = codes.view(self.out_features, -1, self.group_size)
        return ((grouped - 8) * pairs[..., :1] + pairs[..., 1:]).view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )
