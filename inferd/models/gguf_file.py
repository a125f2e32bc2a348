"""A fast reader of a GGUF file's header: metadata and tensor directory.

The ``gguf`` package's ``GGUFReader`` builds one numpy view per metadata
part: for a 49,152-token vocabulary that is about a million memmap slices,
3.7 s of a 5 s model load on this machine. This reader walks the same header
with ``struct`` over one memory map and yields plain Python values (strings,
ints, floats, bools, lists) and zero-copy numpy views of the tensor data,
shaped and typed as ``GGUFReader`` shapes them, in a few tens of ms.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count
u64, metadata count u64; each metadata entry is a key string, a value type
u32 and a value (an array is an element type u32, a count u64, then the
elements); each tensor entry is a name string, n_dims u32, dims u64 x n_dims
(fastest-varying first), ggml type u32, data offset u64. Tensor data begins
at the next multiple of ``general.alignment`` (default 32) after the header.
Strings are a length u64 and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# Unquantized tensor types are typed views; the rest are bytes, one row of
# blocks per output row, as GGUFReader gives them.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # read-only view of the file


class GGUFFile:
    """An open GGUF file's metadata and tensors. Raises ValueError (any
    message) for a file that is not GGUF or is cut short; the caller names
    the file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"cannot map the file ({e})") from e
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, KeyError) as e:
            raise ValueError(f"malformed header at byte {self._pos} ({type(e).__name__}: {e})") from e

    # Header -------------------------------------------------------------------

    def _parse(self) -> None:
        if self._map[:4] != _MAGIC:
            raise ValueError("no GGUF magic")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicated metadata key {key!r}")
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicated tensor names")

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self._pos + length
        if end > len(self._map):
            raise ValueError("string runs past the end of the file")
        text = self._map[self._pos : end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item = GGUFValueType(self._unpack("<I"))
            count = self._unpack("<Q")
            if item == GGUFValueType.ARRAY:
                raise ValueError("nested arrays are not supported")
            if item == GGUFValueType.STRING:
                return [self._string() for _ in range(count)]
            _, dtype = _SCALARS[item]
            end = self._pos + count * dtype.itemsize
            if end > len(self._map):
                raise ValueError("array runs past the end of the file")
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos = end
            return _plain(values, item)
        fmt, _ = _SCALARS[kind]
        value = self._unpack(fmt)
        return _plain(np.array([value], dtype=_SCALARS[kind][1]), kind)[0]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        dims = tuple(self._unpack("<Q") for _ in range(n_dims))
        qtype = GGMLQuantizationType(self._unpack("<I"))
        return name, dims, qtype, self._unpack("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block_size
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} data runs past the end of the file")
        np_dims = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(qtype)
        if dtype is None:  # quantized (and BF16): rows of raw bytes
            data = self.data[begin : begin + n_bytes]
            if np_dims:
                data = data.reshape(*np_dims[:-1], np_dims[-1] // block_size * type_size)
        else:
            data = np.frombuffer(self._map, dtype=dtype, count=n_elements, offset=begin).reshape(np_dims)
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, begin, data)


def _plain(values: np.ndarray, kind: GGUFValueType) -> list[Any]:
    if kind == GGUFValueType.BOOL:
        return [bool(v) for v in values]
    if kind == GGUFValueType.FLOAT32:
        # float32 1e-05 as the Python float 1e-05, not 9.999999747378752e-06.
        return [float(str(v)) for v in values]
    if kind == GGUFValueType.FLOAT64:
        return [float(v) for v in values]
    return values.tolist()
