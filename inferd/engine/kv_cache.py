"""Paged KV-cache bookkeeping: which blocks each request owns. No torch here.

The cache is a pool of fixed-size blocks (``block_size`` token slots each).
A request's block table lists the blocks that hold its tokens in order: token
``p`` lives in slot ``p % block_size`` of block ``table[p // block_size]``.
The runner owns the tensors; this module owns only the ids.

Blocks are ref-counted so a later prefix cache can share full blocks between
requests: a block with ``ref_cnt == 0`` sits in the free queue. The free queue
is a doubly linked list threaded through the blocks, so taking a block from the
front, returning one to the back, and pulling one out of the middle (a prefix
hit on a freed-but-still-cached block) are all O(1).
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens (and of its prefix), set by prefix
        # caching once the block is full; None while the block is partial.
        self.block_hash: int | None = None
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
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
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
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; the unreferenced go to the back
        of the free queue in the order given (so pass a table tail-first to
        have a request's last blocks reused first)."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)


class KVCacheManager:
    """Per-request block tables over a ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVCacheBlock]] = {}

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

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> int:
        """Number of leading tokens of ``token_ids`` already in the cache.

        This is where prefix caching plugs in (a hash per full block, looked
        up in an index, hits shared by ref count). Without it nothing is ever
        cached across requests, so the answer is 0.
        """
        return 0

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover ``num_tokens`` tokens.

        Returns the ids of the newly added blocks, or None, allocating
        nothing, when the pool has too few free blocks.
        """
        table = self._tables.setdefault(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not table:
                del self._tables[request_id]
            return None
        new = self.pool.allocate(need)
        table.extend(new)
        return [b.block_id for b in new]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables
