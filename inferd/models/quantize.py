"""Weight-only quantization of a model: its linear layers are replaced by
``inferd.layers.quant`` ones.

Runs after ``load_weights``, so fused projections (``qkv_proj``,
``gate_up_proj``) are quantized whole, their shards stacked by rows. The
decoder's linears become int8 or int4; the output projection becomes int8 in
both modes (``LM_HEAD_METHOD``): it is a fifth of the default model's weights
and feeds the logits directly (measured: int4 with an int4 head +5.5%
perplexity, with an int8 head +0.25%: benchmarks/results/accuracy.json), and
the default model's own GGUF keeps it at 8 bits (Q8_0 beside Q4_1 linears).
A tied embedding then reads its rows from the head's int8 table, so no float
table is kept.

From a GGUF file everything is read from the file itself, so the engine need
not load those float weights at all (``weights_from_file``). Q4_0/Q4_1
tensors go straight into the int4 layout (their own 4-bit codes, one scale
and offset per block of 32) under ``int4``, whatever the group size asked
for: re-grouping would be a second lossy rounding. Everything else is
dequantized to float32 a slice of rows at a time and quantized.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from inferd.layers.linear import MergedLinear
from inferd.layers.quant import (
    INT4_GROUP_SIZES,
    SCALE_DTYPE,
    QUANTIZATION_METHODS,
    DequantScratch,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)
from inferd.models.gguf_dequant import GGUF_BLOCK_SIZE, INT4_BLOCK_TYPES, dequantize, q4_affine
from inferd.models.gguf_loader import GGUFCheckpoint

logger = logging.getLogger(__name__)

# The decoder's linear layers, by module name.
LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# How the output projection is stored, under either method.
LM_HEAD_METHOD = "int8"
# Float32 elements dequantized and quantized at a time: bounds the temporary
# memory (the 49152 x 576 head would be 113 MB at once).
_ROWS_ELEMENTS = 1 << 20
_LINEAR_WEIGHT = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight")


def weights_from_file(names: Iterable[str], tie_word_embeddings: bool) -> set[str]:
    """The checkpoint tensors that ``quantize_model`` reads from a GGUF file
    itself: the engine can skip loading them (``load_weights(deferred=...)``)."""
    from_file = {n for n in names if _LINEAR_WEIGHT.fullmatch(n) or n == "lm_head.weight"}
    if tie_word_embeddings and LM_HEAD_METHOD == "int8":
        from_file.add("model.embed_tokens.weight")
    return from_file


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int = 32,
    gguf: GGUFCheckpoint | None = None,
    lm_head_method: str | None = None,
) -> dict[str, str]:
    """Replaces the linear layers of a Llama-family model in place, from the
    GGUF file when one is given, else from the loaded weights.

    Returns how each replaced module was stored, by name: "int8", "int4/G"
    (group size G) or "int4/32 gguf" (codes taken from the file).
    ``lm_head_method`` overrides ``LM_HEAD_METHOD`` (for measurements; an
    int4 head leaves a tied embedding in float, since packed int4 rows
    cannot be looked up, so the embedding must have been loaded).
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {method!r}")
    if method == "none":
        return {}
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantization {method} runs on CPU only, but the model is on {device}")
    scratch = DequantScratch()
    done: dict[str, str] = {}
    # Names, not modules: each float layer is freed as soon as it is replaced.
    names = [n for n, m in model.named_modules() if n.rpartition(".")[2] in LINEAR_MODULES and isinstance(m, nn.Linear)]
    for name in names:
        layer, done[name] = _quantize_linear(name, model.get_submodule(name), method, group_size, gguf, scratch)
        _replace(model, name, layer)
    done["lm_head"] = _quantize_lm_head(model, lm_head_method or LM_HEAD_METHOD, group_size, gguf, scratch)
    _return_free_heap()
    return done


def _return_free_heap() -> None:
    """Hands the heap's free pages back to the OS (glibc ``malloc_trim``).

    Quantizing churns through temporaries of every size, and glibc keeps
    what they leave free: measured ~190 MB of resident but unused memory
    after the default model, of a 95 MB int4 model. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def _checkpoint_parts(name: str, linear: nn.Linear) -> list[str]:
    """The checkpoint weight names a layer was loaded from, in row order."""
    if isinstance(linear, MergedLinear):
        parent = name.rpartition(".")[0]
        return [f"{parent}.{shard}.weight" for shard in linear.shards]
    return [f"{name}.weight"]


def _float_rows(parts: list[str], loaded: Tensor, gguf: GGUFCheckpoint | None) -> Iterator[Tensor]:
    """A layer's float32 weight, a slice of rows at a time: dequantized from
    the file's tensors ``parts`` (stacked) when it is a GGUF, so nothing is
    rounded to the model dtype in between; else the loaded parameter."""
    step = max(1, _ROWS_ELEMENTS // loaded.shape[1])
    if gguf is None:
        for start in range(0, loaded.shape[0], step):
            yield loaded[start : start + step].detach().float()
        return
    for part in parts:
        raw = gguf.raw_tensor(part)
        rows, cols = raw.shape
        data = raw.data.reshape(rows, -1)  # a row of blocks, or of values
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            yield dequantize(data[start:stop], raw.qtype, (stop - start, cols), torch.float32)


# The quantized tensors are allocated whole up front and filled slice by
# slice: long-lived pieces interleaved with the temporaries would fragment the
# heap (measured: +260 MB of retained free memory over the default model).


def _int8(rows: Iterator[Tensor], shape: tuple[int, int], bias: Tensor | None, scratch: DequantScratch) -> Int8Linear:
    codes = torch.empty(shape, dtype=torch.int8)
    scales = torch.empty(shape[0], dtype=SCALE_DTYPE)
    start = 0
    for chunk in rows:
        stop = start + chunk.shape[0]
        codes[start:stop], scales[start:stop] = quantize_int8(chunk)
        start = stop
    return Int8Linear(codes, scales, bias, scratch)


def _int4(
    rows: Iterator[Tensor], shape: tuple[int, int], group: int, bias: Tensor | None, scratch: DequantScratch
) -> Int4Linear:
    codes = torch.empty(shape, dtype=torch.uint8)
    scales = torch.empty(shape[0], shape[1] // group, dtype=SCALE_DTYPE)
    zeros = torch.empty_like(scales)
    start = 0
    for chunk in rows:
        stop = start + chunk.shape[0]
        codes[start:stop], scales[start:stop], zeros[start:stop] = quantize_int4(chunk, group)
        start = stop
    return Int4Linear(codes, scales, zeros, group, bias, scratch)


def _quantize_linear(
    name: str, linear: nn.Linear, method: str, group_size: int, gguf: GGUFCheckpoint | None, scratch: DequantScratch
) -> tuple[nn.Module, str]:
    parts = _checkpoint_parts(name, linear)
    if method == "int4":
        direct = _gguf_int4(name, linear, parts, gguf, scratch)
        if direct is not None:
            return direct, f"int4/{GGUF_BLOCK_SIZE} gguf"
        group = _int4_group(name, linear.out_features, linear.in_features, group_size)
        if group is not None:
            rows = _float_rows(parts, linear.weight, gguf)
            return _int4(rows, linear.weight.shape, group, linear.bias, scratch), f"int4/{group}"
    return _int8(_float_rows(parts, linear.weight, gguf), linear.weight.shape, linear.bias, scratch), "int8"


def _int4_group(name: str, out_features: int, in_features: int, group_size: int) -> int | None:
    """The group size an int4 layer gets: the one asked for, or the largest
    smaller allowed one that divides ``in_features`` (576 = 4.5 x 128, so the
    default model takes 64 where 128 is asked). None, with a warning, when
    the layer cannot be int4 at all (it then stays int8)."""
    if out_features % 16:
        logger.warning("%s: %d outputs is not a multiple of 16, so it stays int8", name, out_features)
        return None
    for group in sorted((g for g in INT4_GROUP_SIZES if g <= group_size), reverse=True):
        if in_features % group == 0:
            if group != group_size:
                logger.info("%s: group size %d does not divide %d inputs; using %d", name, group_size, in_features, group)
            return group
    logger.warning("%s: no int4 group size divides %d inputs, so it stays int8", name, in_features)
    return None


def _gguf_int4(
    name: str, linear: nn.Linear, parts: list[str], gguf: GGUFCheckpoint | None, scratch: DequantScratch
) -> Int4Linear | None:
    """The layer straight from its Q4_0/Q4_1 blocks, or None when any part of
    it is stored another way (or the layer cannot be int4)."""
    if gguf is None or linear.out_features % 16:
        return None
    if any(gguf.raw_tensor(part).qtype not in INT4_BLOCK_TYPES for part in parts):
        return None
    n, k = linear.weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // GGUF_BLOCK_SIZE)
    mins = torch.empty_like(scales)
    start = 0
    for part in parts:
        raw = gguf.raw_tensor(part)
        stop = start + raw.shape[0]
        if stop > n or raw.shape[1] != k:
            raise ValueError(f"{name}: GGUF tensor {part} has shape {raw.shape}, which does not fit {(n, k)}")
        codes[start:stop], scales[start:stop], mins[start:stop] = q4_affine(raw.data, raw.qtype, raw.shape)
        start = stop
    if start != n:
        raise ValueError(f"{name}: GGUF tensors give {start} rows, expected {n}")
    return Int4Linear.from_affine(codes, scales, mins, GGUF_BLOCK_SIZE, linear.bias, scratch)


def _quantize_lm_head(
    model: nn.Module, method: str, group_size: int, gguf: GGUFCheckpoint | None, scratch: DequantScratch
) -> str:
    embed = model.model.embed_tokens
    tied = model.lm_head is None
    source = embed.weight if tied else model.lm_head.weight
    rows = _float_rows(["model.embed_tokens.weight" if tied else "lm_head.weight"], source, gguf)
    vocab, hidden = source.shape
    group = _int4_group("lm_head", vocab, hidden, group_size) if method == "int4" else None
    if group is not None:
        model.lm_head = _int4(rows, source.shape, group, None, scratch)
        return f"int4/{group}"
    head = model.lm_head = _int8(rows, source.shape, None, scratch)
    if tied:
        model.model.embed_tokens = Int8Embedding(head, embed.weight.dtype)
    return "int8"
