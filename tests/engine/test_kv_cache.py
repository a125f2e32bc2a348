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
    assert pool.free_queue.block_ids() == [3, 0, 2]


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


def test_free_returns_tail_first_so_last_blocks_are_reused_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 6)  # blocks 0, 1, 2
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.allocate_slots("b", 4) == [3, 2]
    kv.free("missing")  # freeing an unknown request is a no-op
    assert kv.num_free_blocks == 2


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
