import pytest

from inferd.engine.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])


def test_free_queue_popleft_on_empty_raises():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()


def test_pool_allocates_in_order_and_counts_refs():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(ValueError, match="cannot allocate 2 blocks: 1 free"):
        pool.allocate(2)
    a[1].ref_cnt += 1  # shared by a second owner
    pool.free(a)
    assert a[1].ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 0, 3]  # nothing cached: to the front


def test_manager_grows_tables_block_by_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("a", 8) == []  # still fits in two blocks
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.allocate_slots("b", 4) == [3]
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == [3]
    assert kv.num_free_blocks == 2


def test_manager_allocates_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8) == [0, 1]
    assert kv.allocate_slots("b", 9) is None
    assert not kv.has("b") and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 13) is None
    assert kv.block_ids("a") == [0, 1]


def test_blocks_holding_nothing_cached_are_reused_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 6)  # blocks 0, 1, 2, never hashed
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [0, 1, 2, 3]  # the used ones before the never-touched 3
    assert kv.allocate_slots("b", 4) == [0, 1]
    kv.free("missing")  # freeing an unknown request is a no-op
    assert kv.num_free_blocks == 2


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


# Prefix caching ---------------------------------------------------------------------


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request the way the scheduler does and compute all its tokens."""
    hit = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens)) is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    return [hit, *kv.block_ids(rid)]


def test_full_blocks_are_shared_by_ref_count():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    assert _run(kv, "a", a) == [0, 0, 1, 2, 3]
    b = a[:8] + [7, 7, 7]  # shares two blocks
    assert _run(kv, "b", b) == [8, 0, 1, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 1, 1]
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 0, 1]
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_the_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = list(range(12))  # exactly 3 full blocks
    _run(kv, "a", a)
    assert kv.get_computed_blocks("c", a) == 8  # not 12: the last block holds the last token
    assert kv.get_computed_blocks("d", a + [99]) == 12


def test_freed_blocks_keep_their_hash_until_evicted_least_recent_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = [1, 2, 3, 4, 5, 6, 9]  # blocks 0, 1, 2 full; 3 partial
    _run(kv, "a", a)
    kv.free("a")  # tail first: the partial 3 to the front, then 2, 1, 0 to the back
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert kv.get_computed_blocks("x", a) == 6  # all three full blocks still hit
    # A stranger takes 4 blocks: 3, the never-used 4 and 5, then 2, evicting 2's hash.
    assert _run(kv, "s", [50, 51, 52, 53, 54, 55, 56]) == [0, 3, 4, 5, 2]
    assert kv.get_computed_blocks("x", a) == 4  # blocks 0 and 1 are left
    assert kv.pool.free_queue.block_ids() == [1, 0]
    # A hit on a free block takes it out of the free queue; the new block
    # evicts block 1, the least recently freed one left.
    assert _run(kv, "y", a[:4]) == [2, 0, 1]
    assert kv.num_free_blocks == 0 and kv.pool.blocks[0].ref_cnt == 1
    # y recomputed tokens 3 and 4 into block 1, which is indexed again.
    assert kv.get_computed_blocks("z", a) == 4


def test_a_hit_that_cannot_be_allocated_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5]
    _run(kv, "a", a)
    kv.free("a")
    assert kv.allocate_slots("big", 4) == [2, 3]  # the partial block 2, then the never-used 3
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # blocks 0 and 1
    assert kv.allocate_slots("b", 9) is None  # the 2 free hits plus 3 new blocks; 2 are free
    assert not kv.has("b") and kv.pool.blocks[0].ref_cnt == 0 and kv.num_free_blocks == 2


def test_an_extra_key_separates_caches_and_caching_can_be_off():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    kv.get_computed_blocks("a", tokens, extra_key="tenant-1")
    kv.allocate_slots("a", 5)
    kv.cache_blocks("a", tokens, 5, extra_key="tenant-1")
    assert kv.get_computed_blocks("b", tokens, extra_key="tenant-1") == 4
    assert kv.get_computed_blocks("c", tokens, extra_key="tenant-2") == 0
    assert kv.get_computed_blocks("d", tokens) == 0

    off = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    _run(off, "a", tokens)
    assert off.get_computed_blocks("b", tokens) == 0 and not off.pool.cached
