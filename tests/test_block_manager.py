"""Block manager: block 0 reserved, reference counts, prefix hits by chained hashes, LRU eviction."""

import random

import pytest

from tripath.engine.requests.request import Request
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.block_manager import BlockManager, blocks_needed, hash_block


def make_request(tokens, max_tokens=4):
    return Request(list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0))


def finish_prefill(bm, request, num_new):
    """What a step does to the cache bookkeeping: the tokens are computed, full blocks get registered."""
    request.num_computed_tokens += num_new
    bm.cache_computed_blocks(request)


def test_block_zero_is_never_handed_out():
    bm = BlockManager(9, 4)
    blocks = bm.allocate(8)
    assert sorted(blocks) == list(range(1, 9))
    assert bm.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="cannot allocate 1 KV blocks: only 0 free"):
        bm.allocate(1)


def test_reference_counts_and_double_free():
    bm = BlockManager(5, 4)
    blocks = bm.allocate(2)
    bm.share(blocks)
    bm.free(blocks)
    assert bm.num_free_blocks == 2  # still one user each
    bm.free(blocks)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match=f"block {blocks[-1]} freed more often than allocated"):
        bm.free(blocks)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockManager(1, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockManager(8, 0)


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block(None, [1, 2])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(a, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_prefix_hit_shares_full_blocks_and_leaves_one_token():
    rng = random.Random(1)
    bs = 4
    bm = BlockManager(32, bs)
    prompt = [rng.randrange(1000) for _ in range(11)]  # 2 full blocks + 3 tokens
    first = make_request(prompt)
    assert bm.admit(first, 100) == 11
    finish_prefill(bm, first, 11)
    assert len(first.block_hashes) == 2

    # Same first 9 tokens, then different: the two full blocks are hits, the request extends from 8.
    second = make_request(prompt[:9] + [7, 7, 7])
    assert bm.admit(second, 100) == 4
    assert second.num_computed_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert [bm.ref_counts[b] for b in first.block_ids[:2]] == [2, 2]

    # A prompt that is exactly the two cached blocks keeps its last token to compute (its logits).
    third = make_request(prompt[:8])
    assert bm.admit(third, 100) == 4
    assert third.num_computed_tokens == 4 and third.block_ids[0] == first.block_ids[0]

    # A different first block misses everything, even with an equal second block.
    fourth = make_request([prompt[0] + 1] + prompt[1:])
    assert bm.admit(fourth, 100) == 11 and fourth.num_computed_tokens == 0
    assert bm.prefix_hit_rate == pytest.approx((0 + 8 + 4 + 0) / (11 + 12 + 8 + 11))


def test_prefix_caching_off_never_hits():
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    a = make_request(range(1, 10))
    bm.admit(a, 100)
    finish_prefill(bm, a, 9)
    b = make_request(range(1, 10))
    assert bm.admit(b, 100) == 9 and b.num_computed_tokens == 0
    assert not set(a.block_ids) & set(b.block_ids)


def test_freed_cached_blocks_are_reused_on_hit_then_evicted_lru():
    bs = 2
    bm = BlockManager(7, bs)  # 6 usable blocks
    a = make_request([1, 2, 3, 4, 5])  # 3 blocks, 2 full
    bm.admit(a, 100)
    finish_prefill(bm, a, 5)
    a_blocks = list(a.block_ids)
    bm.release(a)
    assert bm.num_free_blocks == 6  # cached blocks are evictable, so they count as free

    # A hit takes the cached blocks back out of the evictable set.
    b = make_request([1, 2, 3, 4, 9])
    assert bm.admit(b, 100) == 1
    assert b.block_ids[:2] == a_blocks[:2]
    bm.release(b)

    # Filling the cache: never-cached blocks go first, then cached ones, least recently freed first.
    # b freed its tail (no hash) then its two cached blocks head-last, so the head block is evicted last.
    fresh = bm.allocate(4)
    assert not set(fresh) & set(a_blocks[:2])
    evicted = bm.allocate(1)
    assert evicted == [a_blocks[1]] and a_blocks[1] not in bm.cached.values()
    assert a_blocks[0] in bm.cached.values()
    c = make_request([1, 2, 3, 4, 9])
    assert bm.match_prefix(c.all_token_ids, 4)[0] == [a_blocks[0]]


def test_admit_changes_nothing_when_blocks_run_short():
    bm = BlockManager(4, 4)  # 3 usable
    a = make_request(range(1, 9))
    assert bm.admit(a, 100) == 8
    b = make_request(range(20, 29))  # needs 3 blocks, 1 free
    before = (bm.num_free_blocks, list(bm.ref_counts))
    assert bm.admit(b, 100) is None
    assert (bm.num_free_blocks, bm.ref_counts) == before and b.block_ids == []
    assert bm.admit(b, 4) == 4  # a 4-token chunk fits in the one free block
    assert len(b.block_ids) == 1


def test_admit_whole_refuses_a_partial_prompt():
    bm = BlockManager(16, 4)
    a = make_request(range(1, 11))
    assert bm.admit(a, 8, whole=True) is None and a.block_ids == []
    assert bm.admit(a, 10, whole=True) == 10


def test_reactivated_cached_blocks_count_against_free_blocks():
    bs = 2
    bm = BlockManager(4, bs)  # 3 usable
    a = make_request([1, 2, 3, 4, 5])
    bm.admit(a, 100)
    finish_prefill(bm, a, 5)
    bm.release(a)  # 2 cached evictable + 1 free
    b = make_request([1, 2, 3, 4, 6, 7, 8])  # hits 2 blocks, needs 2 more: 4 > 3
    assert bm.admit(b, 100) is None
    assert bm.num_free_blocks == 3 and all(bm.ref_counts[x] == 0 for x in range(1, 4))


def test_grow_and_random_alloc_free_keep_the_books():
    rng = random.Random(0)
    bs = 4
    bm = BlockManager(40, bs)
    live = []
    for step in range(300):
        if live and rng.random() < 0.4:
            bm.release(live.pop(rng.randrange(len(live))))
        else:
            r = make_request([rng.randrange(3) for _ in range(rng.randrange(1, 13))])
            n = bm.admit(r, 64)
            if n is not None:
                finish_prefill(bm, r, n)
                if bm.grow(r, rng.randrange(1, 9)):
                    assert len(r.block_ids) * bs >= r.num_computed_tokens
                live.append(r)
        held = [b for r in live for b in r.block_ids]
        assert 0 not in held
        for b in range(1, 40):
            assert bm.ref_counts[b] == held.count(b)
        assert bm.num_free_blocks == sum(1 for b in range(1, 40) if bm.ref_counts[b] == 0)
        for h, b in bm.cached.items():
            assert bm.block_hash[b] == h


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_blocks_registered_chunk_by_chunk_hash_every_token_before_them():
    """Full blocks registered while a prompt is computed in chunks and outputs arrive (one block spanning the
    prompt's end) carry the chained hash of every token up to their end and their own tokens, as a chain
    computed from scratch over the whole sequence gives."""
    rng = random.Random(2)
    bs = 4
    bm = BlockManager(64, bs)
    request = make_request([rng.randrange(1000) for _ in range(10)], max_tokens=20)
    assert bm.admit(request, 100) == 10
    finish_prefill(bm, request, 3)
    assert request.block_hashes == []  # no full block yet
    finish_prefill(bm, request, 7)
    assert len(request.block_hashes) == 2
    request.block_ids += bm.allocate(3)
    for step in (3, 1, 5):  # outputs computed a few at a time: blocks 2 (prompt + outputs), 3 and 4
        for _ in range(step):
            request.append_token(rng.randrange(1000))
        finish_prefill(bm, request, step)
    tokens = request.all_token_ids
    assert len(tokens) == 19 and len(request.block_hashes) == 4
    parent = None
    for i, block in enumerate(request.block_ids[:4]):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
        assert request.block_hashes[i] == parent == bm.block_hash[block]
        assert bm.block_tokens[block] == tuple(tokens[i * bs:(i + 1) * bs])
