"""Paged KV-cache bookkeeping: which blocks each request owns. No torch here.

The cache is a pool of fixed-size blocks (``block_size`` token slots each).
A request's block table lists the blocks that hold its tokens in order: token
``p`` lives in slot ``p % block_size`` of block ``table[p // block_size]``.
The runner owns the tensors; this module owns only the ids.

Prefix caching: once a block is full and its K/V computed, it gets a
chained hash (its parent block's hash, its token ids and an optional extra
key such as a cache salt) and goes into a hash -> block index. A new request
looks its full prompt blocks up in order and shares every hit by ref count;
the prompt's last token is always recomputed, so a hit never covers a whole
prompt. Blocks are ref-counted: a block with ``ref_cnt == 0`` sits in the
free queue and keeps its hash, so it can still be hit until it is reused.
The free queue is a doubly linked list threaded through the blocks, so
taking a block from the front (eviction, lazily dropping its hash),
returning one to either end (hashed blocks to the back, to be evicted last;
blocks with nothing cached to the front, to be reused first), and pulling
one out of the middle (a hit on a freed-but-still-cached block) are all O(1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None) -> BlockHash:
    """The chained hash of a full block: 16 bytes of BLAKE2b, so two
    different prefixes sharing a hash is not a practical concern."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else (extra_key or "").encode())
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Chained hash of the full block's tokens (and of its prefix), set by
        # prefix caching once the block is full; None while partial or evicted.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Free blocks in eviction order: the front is taken first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels so that insertion and removal never special-case the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, node: KVCacheBlock, block: KVCacheBlock) -> None:
        block.prev_free, block.next_free = node, node.next_free
        node.next_free.prev_free = block
        node.next_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        ids = []
        node = self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evicted: its K/V is about to be overwritten
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each (prefix hits); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index a full, computed block; the first block with a hash keeps it."""
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. An unreferenced block with a
        hash goes to the back of the free queue (evicted last; pass a table
        tail-first so its first blocks outlive its last); one without a hash
        holds nothing to keep and goes to the front, reused first: its memory
        is already committed and warm, so an idle KV budget stays untouched."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)


class KVCacheManager:
    """Per-request block tables over a ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # Prefix hits found by get_computed_blocks, taken by allocate_slots.
        self._hits: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many leading blocks of its table are hashed.
        self._num_hashed: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], extra_key: str | None = None) -> int:
        """Number of leading tokens of ``token_ids`` already in the cache: the
        full blocks whose chained hashes hit, never the last token. The hits
        are held for this request's next ``allocate_slots``, which shares them."""
        hits: list[KVCacheBlock] = []
        if self.enable_prefix_caching:
            parent = None
            for start in range(0, len(token_ids) - self.block_size, self.block_size):
                parent = hash_block(parent, token_ids[start : start + self.block_size], extra_key)
                block = self.pool.lookup(parent)
                if block is None:
                    break
                hits.append(block)
        self._hits[request_id] = hits
        return len(hits) * self.block_size

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover ``num_tokens`` tokens, starting a
        new table from the prefix hits found for it.

        Returns the ids of the newly added blocks (hits included), or None,
        taking nothing, when the pool has too few free blocks.
        """
        table = self._tables.get(request_id)
        hits = self._hits.get(request_id, []) if table is None else []
        have = len(hits) if table is None else len(table)
        need = self.blocks_needed(num_tokens) - have
        # Free hits leave the free queue when shared: they count against it.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > 0 and need + free_hits > self.pool.num_free_blocks:
            return None
        if table is None:
            self._hits.pop(request_id, None)
            self.pool.touch(hits)
            table = self._tables[request_id] = list(hits)
            self._num_hashed[request_id] = len(hits)
        new = self.pool.allocate(need) if need > 0 else []
        table.extend(new)
        return [b.block_id for b in (hits + new)]

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int, extra_key: str | None = None) -> None:
        """Index the request's blocks that ``num_computed`` tokens (K/V written)
        have filled; ``token_ids`` are its tokens so far."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        done = self._num_hashed.get(request_id, 0)
        full = min(num_computed, len(token_ids)) // self.block_size
        parent = table[done - 1].block_hash if done else None
        for i in range(done, min(full, len(table))):
            bs = self.block_size
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
            self.pool.cache(table[i], parent)
        self._num_hashed[request_id] = max(done, min(full, len(table)))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: its last blocks (the
        least likely to be shared) are evicted before its first ones."""
        self._hits.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables
