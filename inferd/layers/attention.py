"""Paged attention over a block-structured KV cache, on plain SDPA.

Each layer's cache is a pair of ``(num_blocks, block_size, num_kv_heads,
head_dim)`` tensors. The token at position ``p`` of a sequence whose block
table is ``blocks`` lives in flat slot ``blocks[p // block_size] * block_size
+ p % block_size``.

A step's flat batch is ordered single-token chunks (decodes) first, then
multi-token chunks (prefill, possibly after earlier chunks already cached).
Every step writes its K/V into the cache first and then attends:

- single-token rows, on CPU, through a compiled kernel that reads each
  row's blocks in place (``cpu_kernels``, when it builds); otherwise
- single-token rows in as few SDPA calls as pay: consecutive rows of similar
  length form a group whose blocks are gathered with one ``index_select``
  from a block table padded to the group's longest sequence, padding is
  masked by sequence length, and the query heads sharing a KV head are folded
  into the query-length axis so no K/V is repeated. Rows sorted by length
  (the runner sorts them) waste little on padding;
- each multi-token chunk in its own SDPA call: causal on the chunk's fresh K/V
  when nothing is cached before it, otherwise over its cached blocks with a
  causal mask shifted by the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.layers.cpu_kernels import paged_decode_attention


class SeqChunk(NamedTuple):
    """One sequence's share of a step, as the metadata builder needs it."""

    context_len: int  # tokens already in the cache
    query_len: int  # tokens run this step
    block_ids: Sequence[int]  # the sequence's block table


@dataclass
class PrefillChunk:
    query_start: int  # first row of the chunk in the flat batch
    query_len: int
    context_len: int
    # Blocks holding positions [0, context_len + query_len); None without context.
    kv_block_ids: Tensor | None
    # (query_len, context_len + query_len) bool, True = attend; None without context.
    attn_mask: Tensor | None


@dataclass
class DecodeGroup:
    """Consecutive single-token rows attended in one SDPA call."""

    start: int  # first row of the group in the flat batch
    num_rows: int
    # (num_rows * max_blocks,) int64: each row's block table, padded to
    # max_blocks with block 0 (masked out).
    block_ids: Tensor
    max_len: int  # longest sequence in the group, including this step's token
    # (num_rows, 1, 1, max_len) bool; None when no row needs padding.
    mask: Tensor | None
    # (num_rows,) int64: each row's length, including this step's token.
    seq_lens: Tensor


# What one more SDPA call and gather cost, in blocks of K/V read: starting a
# new group pays when it saves more padding than this.
_GROUP_CALL_COST_BLOCKS = 64


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once per step
    and shared by all layers."""

    slot_mapping: Tensor  # (T,) int64 cache slot of each row
    num_decodes: int  # rows [0, num_decodes) are single-token chunks
    decodes: list[DecodeGroup]  # covering rows [0, num_decodes) in order
    prefills: list[PrefillChunk]
    # Most blocks one gather reads: a decode group's padded table, or the
    # largest cached prefill context. Sizes ``workspace``.
    gather_blocks: int = 0
    # Flat scratch of at least 2 * gather_blocks * (block elements) in the
    # cache dtype, reused by every layer for gathered K and V: fresh multi-MB
    # allocations each layer cost page faults that dwarf the copy itself.
    # None allocates per call.
    workspace: Tensor | None = None
    # Decode rows attend through the compiled CPU kernel, reading the cache
    # in place (``inferd.layers.cpu_kernels``), instead of gather + SDPA.
    decode_kernel: bool = False

    def __post_init__(self) -> None:
        expected = self.num_decodes + sum(p.query_len for p in self.prefills)
        if self.slot_mapping.shape != (expected,):
            raise ValueError(
                f"slot_mapping must have shape ({expected},), got {tuple(self.slot_mapping.shape)}"
            )
        if sum(g.num_rows for g in self.decodes) != self.num_decodes:
            raise ValueError(f"decode groups must cover exactly {self.num_decodes} rows")

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def _slots(chunk: SeqChunk, block_size: int) -> list[int]:
    slots: list[int] = []
    pos, end = chunk.context_len, chunk.context_len + chunk.query_len
    while pos < end:
        index, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = chunk.block_ids[index] * block_size + offset
        slots.extend(range(base, base + take))
        pos += take
    return slots


def build_attention_metadata(
    chunks: Sequence[SeqChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    decode_kernel: bool = False,
) -> AttentionMetadata:
    """Metadata for a flat batch holding ``chunks`` in order; all single-token
    chunks must come before the multi-token ones. With ``decode_kernel`` the
    decodes form one group: the kernel reads only each row's own blocks, so
    padding costs it nothing."""
    num_decodes = 0
    while num_decodes < len(chunks) and chunks[num_decodes].query_len == 1:
        num_decodes += 1
    slots: list[int] = []
    for chunk in chunks:
        if chunk.query_len <= 0:
            raise ValueError(f"query_len must be positive, got {chunk.query_len}")
        needed = -(-(chunk.context_len + chunk.query_len) // block_size)
        if len(chunk.block_ids) < needed:
            raise ValueError(
                f"block table of {len(chunk.block_ids)} blocks cannot hold "
                f"{chunk.context_len + chunk.query_len} tokens at block_size {block_size}"
            )
        slots.extend(_slots(chunk, block_size))

    decodes: list[DecodeGroup] = []
    gather_blocks = 0
    seq_lens = [c.context_len + 1 for c in chunks[:num_decodes]]
    groups = [(0, num_decodes)] if decode_kernel and num_decodes else _group_decodes(seq_lens, block_size)
    for start, stop in groups:
        group = _decode_group(chunks, start, stop, block_size, device)
        decodes.append(group)
        gather_blocks = max(gather_blocks, group.block_ids.shape[0])

    prefills: list[PrefillChunk] = []
    start = num_decodes
    for chunk in chunks[num_decodes:]:
        if chunk.query_len == 1:
            raise ValueError("single-token chunks must come before multi-token chunks")
        kv_block_ids = attn_mask = None
        if chunk.context_len:
            kv_len = chunk.context_len + chunk.query_len
            blocks = list(chunk.block_ids[: -(-kv_len // block_size)])
            kv_block_ids = torch.tensor(blocks, dtype=torch.int64, device=device)
            gather_blocks = max(gather_blocks, len(blocks))
            # Query i sits at position context_len + i and sees keys 0..that.
            attn_mask = torch.ones(
                chunk.query_len, kv_len, dtype=torch.bool, device=device
            ).tril(diagonal=chunk.context_len)
        prefills.append(
            PrefillChunk(start, chunk.query_len, chunk.context_len, kv_block_ids, attn_mask)
        )
        start += chunk.query_len

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        decodes=decodes,
        prefills=prefills,
        gather_blocks=gather_blocks,
        decode_kernel=decode_kernel,
    )


def _group_decodes(seq_lens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """Splits rows into consecutive ``[start, stop)`` groups: a row joins the
    current group unless padding the group to a common length costs more
    than a call of its own."""
    groups: list[tuple[int, int]] = []
    start, widest = 0, 0  # current group, its longest row in blocks
    for row, length in enumerate(seq_lens):
        blocks = -(-length // block_size)
        rows = row - start
        joined = (rows + 1) * max(widest, blocks)
        alone = rows * widest + blocks + _GROUP_CALL_COST_BLOCKS
        if rows and joined > alone:
            groups.append((start, row))
            start, widest = row, blocks
        else:
            widest = max(widest, blocks)
    if seq_lens:
        groups.append((start, len(seq_lens)))
    return groups


def _decode_group(
    chunks: Sequence[SeqChunk], start: int, stop: int, block_size: int, device: torch.device | str
) -> DecodeGroup:
    seq_lens = [c.context_len + 1 for c in chunks[start:stop]]
    max_len = max(seq_lens)
    max_blocks = -(-max_len // block_size)
    table: list[int] = []
    for chunk in chunks[start:stop]:
        row = list(chunk.block_ids[:max_blocks])
        table.extend(row + [0] * (max_blocks - len(row)))
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    mask = None
    if min(seq_lens) != max_len:
        mask = (torch.arange(max_len, device=device) < lens[:, None]).view(-1, 1, 1, max_len)
    return DecodeGroup(
        start=start,
        num_rows=stop - start,
        block_ids=torch.tensor(table, dtype=torch.int64, device=device),
        max_len=max_len,
        mask=mask,
        seq_lens=lens,
    )


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        """``q`` (T, H, D), ``k``/``v`` (T, KVH, D) -> (T, H * D)."""
        num_tokens = q.shape[0]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)

        if len(meta.decodes) == 1 and not meta.prefills:
            group = meta.decodes[0]
            return self._decode(q, k_cache, v_cache, group, meta).view(num_tokens, -1)
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        for group in meta.decodes:
            rows = slice(group.start, group.start + group.num_rows)
            out[rows] = self._decode(q[rows], k_cache, v_cache, group, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta.workspace
            )
        return out.view(num_tokens, -1)

    def _gather(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        block_ids: Tensor,
        rows: int,
        length: int,
        workspace: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """The cached K and V of ``rows`` sequences, each (rows, KVH, length, D)."""
        out: list[Tensor] = []
        shape = (block_ids.shape[0], *k_cache.shape[1:])
        size = block_ids.shape[0] * k_cache[0].numel()
        for i, cache in enumerate((k_cache, v_cache)):
            if workspace is None:
                gathered = cache.index_select(0, block_ids)
            else:
                buffer = workspace[i * size : (i + 1) * size].view(shape)
                gathered = torch.index_select(cache, 0, block_ids, out=buffer)
            gathered = gathered.view(rows, -1, self.num_kv_heads, self.head_dim)
            out.append(gathered[:, :length].transpose(1, 2))
        return out[0], out[1]

    def _decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        group: DecodeGroup,
        meta: AttentionMetadata,
    ) -> Tensor:
        rows = q.shape[0]
        if meta.decode_kernel:
            tables = group.block_ids.view(rows, -1)
            return paged_decode_attention(q, k_cache, v_cache, tables, group.seq_lens, self.scale)
        keys, values = self._gather(
            k_cache, v_cache, group.block_ids, rows, group.max_len, meta.workspace
        )
        per_kv = self.num_heads // self.num_kv_heads
        # Query heads j*per_kv .. j*per_kv+per_kv-1 share KV head j; as a
        # query axis of length `per_kv` they need no repeated K/V.
        q = q.view(rows, self.num_kv_heads, per_kv, self.head_dim)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=group.mask, scale=self.scale
        )  # (B, KVH, per_kv, D)
        return out.reshape(rows, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        chunk: PrefillChunk,
        workspace: Tensor | None,
    ) -> Tensor:
        q = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if chunk.kv_block_ids is None:
            keys = k.transpose(0, 1).unsqueeze(0)  # (1, KVH, n, D)
            values = v.transpose(0, 1).unsqueeze(0)
        else:
            kv_len = chunk.context_len + chunk.query_len
            keys, values = self._gather(k_cache, v_cache, chunk.kv_block_ids, 1, kv_len, workspace)
        # SDPA's fast CPU kernel takes GQA only with 4-D inputs.
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=chunk.attn_mask,
            is_causal=chunk.attn_mask is None,
            scale=self.scale,
            enable_gqa=True,
        )  # (1, H, n, D)
        return out[0].transpose(0, 1)
