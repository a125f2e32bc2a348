from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.layers.attention import PagedAttention, SeqChunk, build_attention_metadata

HEADS, KV_HEADS, DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 32
SCALE = DIM**-0.5

Seq = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one whole sequence: (L, H, D), (L, KVH, D) -> (L, H, D)."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=SCALE
    )
    return out.transpose(0, 1)


def _run(
    attn: PagedAttention,
    step: dict[int, SeqChunk],
    seqs: list[Seq],
    caches: tuple[torch.Tensor, torch.Tensor],
    use_workspace: bool,
    decode_kernel: bool = False,
) -> torch.Tensor:
    """One step over ``step`` (sequence index -> chunk, in batch order)."""
    meta = build_attention_metadata(list(step.values()), BLOCK_SIZE, decode_kernel=decode_kernel)
    if use_workspace:
        # NaN-filled: any read of scratch that the gather did not write shows.
        size = 2 * meta.gather_blocks * BLOCK_SIZE * KV_HEADS * DIM
        meta.workspace = torch.full((size,), float("nan"))
    rows = step.items()
    q, k, v = (
        torch.cat([seqs[i][part][c.context_len : c.context_len + c.query_len] for i, c in rows])
        for part in range(3)
    )
    return attn(q, k, v, caches[0], caches[1], meta).view(-1, HEADS, DIM)


@pytest.mark.parametrize(
    ("use_workspace", "decode_kernel"),
    [(False, False), (True, False), (True, True)],
    ids=["alloc", "workspace", "cpu-kernel"],
)
def test_mixed_decode_and_chunked_prefill_match_causal_sdpa(use_workspace: bool, decode_kernel: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [11, 6, 1, 9, 14]
    seqs = [
        (
            torch.randn(n, HEADS, DIM, generator=gen),
            torch.randn(n, KV_HEADS, DIM, generator=gen),
            torch.randn(n, KV_HEADS, DIM, generator=gen),
        )
        for n in lengths
    ]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[0:4], perm[4:6], perm[6:7], perm[7:10], perm[10:14]]
    caches = (
        torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM),
        torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM),
    )
    attn = PagedAttention(HEADS, KV_HEADS, DIM, SCALE)
    # Step 1 caches context with fresh prefills.
    step1 = {
        0: SeqChunk(0, 10, tables[0]),
        1: SeqChunk(0, 5, tables[1]),
        3: SeqChunk(0, 3, tables[3]),
    }
    # Step 2 mixes every case: decodes after context (0, 1), a one-token
    # prompt (2), a chunk after cached context crossing blocks (3) and a fresh
    # multi-block prefill (4).
    step2 = {
        0: SeqChunk(10, 1, tables[0]),
        1: SeqChunk(5, 1, tables[1]),
        2: SeqChunk(0, 1, tables[2]),
        3: SeqChunk(3, 6, tables[3]),
        4: SeqChunk(0, 14, tables[4]),
    }
    expected = [_reference(*seq) for seq in seqs]
    for step in (step1, step2):
        out = _run(attn, step, seqs, caches, use_workspace, decode_kernel)
        assert out.shape == (sum(c.query_len for c in step.values()), HEADS, DIM)
        row = 0
        for i, chunk in step.items():
            ref = expected[i][chunk.context_len : chunk.context_len + chunk.query_len]
            assert (out[row : row + chunk.query_len] - ref).abs().max() <= 1e-5, (i, chunk)
            row += chunk.query_len


def test_cache_holds_each_token_at_its_slot() -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, KV_HEADS, DIM, generator=gen)
    v = torch.randn(3, KV_HEADS, DIM, generator=gen)
    q = torch.randn(3, HEADS, DIM, generator=gen)
    caches = (
        torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM),
        torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM),
    )
    # Positions 3, 4, 5 with blocks [7, 2]: slot 7*4+3, then block 2 slots 0, 1.
    meta = build_attention_metadata([SeqChunk(3, 3, [7, 2])], BLOCK_SIZE)
    assert meta.slot_mapping.tolist() == [31, 8, 9]
    PagedAttention(HEADS, KV_HEADS, DIM, SCALE)(q, k, v, caches[0], caches[1], meta)
    assert torch.equal(caches[0][7, 3], k[0])
    assert torch.equal(caches[0][2, :2], k[1:])
    assert torch.equal(caches[1][2, :2], v[1:])
    assert caches[0].count_nonzero() == 3 * KV_HEADS * DIM


def test_decode_metadata_pads_block_tables_and_masks_by_length() -> None:
    meta = build_attention_metadata(
        [SeqChunk(5, 1, [3, 9]), SeqChunk(1, 1, [4]), SeqChunk(0, 6, [0, 1])], BLOCK_SIZE
    )
    assert meta.num_decodes == 2
    (group,) = meta.decodes
    assert (group.start, group.num_rows, group.max_len) == (0, 2, 6)
    assert group.block_ids.tolist() == [3, 9, 4, 0]
    assert group.mask.shape == (2, 1, 1, 6)
    assert group.mask[:, 0, 0].tolist() == [[True] * 6, [True, True] + [False] * 4]
    assert len(meta.prefills) == 1
    assert (meta.prefills[0].query_start, meta.prefills[0].query_len) == (2, 6)
    assert meta.prefills[0].attn_mask is None

    same_length = build_attention_metadata([SeqChunk(2, 1, [5]), SeqChunk(2, 1, [6])], BLOCK_SIZE)
    assert same_length.decodes[0].mask is None


def test_decode_rows_of_very_different_lengths_get_their_own_groups() -> None:
    # With block_size 1, one long row padded onto many short ones would read
    # far more padding than a second call costs.
    long_row = SeqChunk(999, 1, list(range(1000)))
    short_rows = [SeqChunk(9, 1, list(range(10))) for _ in range(8)]
    meta = build_attention_metadata([long_row, *short_rows, long_row], 1)
    assert [(g.start, g.num_rows, g.max_len) for g in meta.decodes] == [
        (0, 1, 1000),
        (1, 8, 10),
        (9, 1, 1000),
    ]
    assert meta.decodes[1].mask is None
    assert meta.gather_blocks == 1000


def test_context_mask_is_causal_shifted_by_context() -> None:
    meta = build_attention_metadata([SeqChunk(2, 3, [1, 2])], BLOCK_SIZE)
    chunk = meta.prefills[0]
    assert chunk.kv_block_ids.tolist() == [1, 2]
    assert chunk.attn_mask.int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]


def test_metadata_rejects_bad_chunks() -> None:
    with pytest.raises(ValueError, match="single-token chunks must come before multi-token chunks"):
        build_attention_metadata([SeqChunk(0, 3, [0]), SeqChunk(4, 1, [1, 2])], BLOCK_SIZE)
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 5 tokens"):
        build_attention_metadata([SeqChunk(2, 3, [0])], BLOCK_SIZE)
    with pytest.raises(ValueError, match="query_len must be positive, got 0"):
        build_attention_metadata([SeqChunk(2, 0, [0])], BLOCK_SIZE)
