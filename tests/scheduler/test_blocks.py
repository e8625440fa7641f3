"""BlockManager unit tests: accounting, reference counts, prefix cache, LRU eviction.

Pure Python: must not import torch (nor tandem modules that do).
"""
import pytest

from tandem.sampling_params import SamplingParams
from tandem.scheduler.blocks import BlockManager
from tandem.scheduler.request import Request

_IDS = iter(range(10**9))


def make_req(tokens, outputs=()):
    req = Request(req_id=next(_IDS), prompt_token_ids=list(tokens), params=SamplingParams(), seed=0, max_tokens=16)
    req.output_token_ids = list(outputs)
    return req


def compute_all(bm: BlockManager, req: Request) -> None:
    """Allocate blocks for every token of req, mark them computed and register full blocks."""
    assert bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def check_consistency(bm: BlockManager, live: list[Request]) -> None:
    """Ref counts equal the number of live holders; every block is exactly one of used/free/evictable."""
    holders = [0] * bm.num_blocks
    for r in live:
        for b in r.block_ids:
            holders[b] += 1
    assert holders == bm.ref_counts
    used = {b for b in range(bm.num_blocks) if holders[b]}
    free, evictable = set(bm.free_ids), set(bm.evictable)
    assert len(free) == len(bm.free_ids), "a block is twice on the free list"
    assert not (used & free) and not (used & evictable) and not (free & evictable)
    assert used | free | evictable == set(range(bm.num_blocks))
    assert bm.num_free_blocks == bm.num_blocks - len(used)
    # The cache maps keys to blocks and back consistently; free-list blocks hold no content.
    for key, b in bm.cached.items():
        assert bm.block_keys[b] == key
    assert all(bm.block_keys[b] is None for b in free)
    assert all(bm.block_keys[b] is not None for b in evictable)


# ---------------------------------------------------------------- accounting


def test_token_ids_in_reads_across_prompt_and_output():
    req = make_req(range(10, 17), outputs=range(50, 54))  # positions 0..6 prompt, 7..10 output
    for start in range(12):
        for end in range(start, 12):
            assert req.token_ids_in(start, end) == req.all_token_ids[start:end], (start, end)


def test_allocate_grows_block_table_and_free_returns_everything():
    bm = BlockManager(num_blocks=10, block_size=4)
    req = make_req(range(9))
    assert bm.blocks_needed(req, 9) == 3
    assert bm.allocate(req, 9)
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    assert all(bm.ref_counts[b] == 1 for b in req.block_ids)
    # Positions that fit the table need nothing more; one more position needs one block.
    assert bm.blocks_needed(req, 12) == 0 and bm.allocate(req, 12) and len(req.block_ids) == 3
    assert bm.blocks_needed(req, 13) == 1 and bm.allocate(req, 13) and len(req.block_ids) == 4
    check_consistency(bm, [req])
    bm.free(req)
    assert req.block_ids == [] and req.block_hashes == []
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert bm.ref_counts == [0] * 10
    check_consistency(bm, [])


def test_allocate_refuses_without_partial_change():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_req(range(12)), make_req(range(100, 108))
    assert bm.allocate(a, 12)
    before = (list(b.block_ids), bm.num_free_blocks, list(bm.ref_counts))
    assert not bm.allocate(b, 8)  # needs 2, only 1 free
    assert (b.block_ids, bm.num_free_blocks, bm.ref_counts) == before
    assert bm.allocate(b, 4)  # one block is fine
    assert bm.num_free_blocks == 0
    assert not bm.allocate(b, 5)
    check_consistency(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    check_consistency(bm, [])


def test_distinct_requests_get_distinct_blocks():
    bm = BlockManager(num_blocks=16, block_size=2)
    reqs = [make_req(range(i * 10, i * 10 + 5)) for i in range(5)]
    for r in reqs:
        assert bm.allocate(r, 5)
    all_ids = [b for r in reqs for b in r.block_ids]
    assert len(all_ids) == 15 == len(set(all_ids))
    check_consistency(bm, reqs)
    for r in reqs[::2]:
        bm.free(r)
    check_consistency(bm, reqs[1::2])
    for r in reqs[1::2]:
        bm.free(r)
    assert bm.num_free_blocks == 16


# ---------------------------------------------------------------- prefix cache


def test_cache_salt_roots_the_chain():
    """Blocks are shared among requests of one cache_salt only (a salt roots the chained hash), and
    the chained hashes are sha256 digests, not Python's hash()."""
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_req(range(10))
    a.cache_salt = "alice"
    compute_all(bm, a)
    for salt, hit in (("alice", 8), ("bob", 0), (None, 0)):
        b = make_req(range(10))
        b.cache_salt = salt
        assert len(bm.prefix_blocks(b)) * 4 == hit, salt
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a.block_hashes)
    plain = make_req(range(10))
    compute_all(bm, plain)
    assert plain.block_hashes[0] != a.block_hashes[0] and plain.block_ids[0] != a.block_ids[0]
    again = make_req(range(10))
    assert bm.match_prefix(again) == 8 and again.block_ids == plain.block_ids[:2]


def test_prefix_hit_shares_blocks_with_ref_count_two():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_req(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    compute_all(bm, a)
    assert len(a.block_hashes) == 2 and len(bm.cached) == 2  # the partial block is not cached
    b = make_req(list(range(8)) + [50, 51, 52])
    assert bm.match_prefix(b) == 8
    assert b.block_ids == a.block_ids[:2]
    assert b.block_hashes == a.block_hashes
    assert [bm.ref_counts[x] for x in b.block_ids] == [2, 2]
    assert bm.ref_counts[a.block_ids[2]] == 1
    assert bm.num_free_blocks == 7  # sharing takes no new block
    # b grows into its own blocks, never into a's partial block.
    assert bm.allocate(b, b.num_tokens)
    assert b.block_ids[2] != a.block_ids[2] and bm.ref_counts[b.block_ids[2]] == 1
    check_consistency(bm, [a, b])
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_ids[:2]] == [1, 1]
    check_consistency(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.ref_counts == [0] * 10
    check_consistency(bm, [])


def test_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_req(range(12))
    compute_all(bm, a)
    assert len(bm.cached) == 3
    # Identical 12-token prompt: all 3 blocks are cached, but only 2 are used so that >= 1 token
    # is left to compute and the step has logits.
    same = make_req(range(12))
    assert bm.match_prefix(same) == 8
    assert same.num_tokens - 8 >= 1
    # 9 tokens: 2 full blocks can be reused and one token remains.
    nine = make_req(range(9))
    assert bm.match_prefix(nine) == 8
    # 8 tokens: only one block, so the last token (in block 2) is recomputed.
    eight = make_req(range(8))
    assert bm.match_prefix(eight) == 4
    # A prompt shorter than a block, or exactly one block, cannot hit.
    assert bm.match_prefix(make_req(range(4))) == 0
    assert bm.match_prefix(make_req(range(3))) == 0
    # Output tokens count as tokens of the prefix too (a preempted request recomputing).
    with_out = make_req(range(6), outputs=range(6, 12))
    assert bm.match_prefix(with_out) == 8


def test_prefix_match_follows_the_hash_chain():
    bm = BlockManager(num_blocks=12, block_size=4)
    a = make_req(list(range(8)) + [9, 9, 9, 9] + [0])
    compute_all(bm, a)
    # Same second block contents under a different first block: no hit at all.
    b = make_req([70, 71, 72, 73] + list(range(4, 8)) + [9, 9, 9, 9] + [0])
    assert bm.match_prefix(b) == 0 and b.block_ids == [] and b.block_hashes == []
    # Diverging in the second block: only the first block hits.
    c = make_req(list(range(4)) + [4, 5, 6, 99] + [9, 9, 9, 9] + [0])
    assert bm.match_prefix(c) == 4 and c.block_ids == a.block_ids[:1]
    assert bm.ref_counts[a.block_ids[0]] == 2


def test_match_prefix_disabled_or_with_blocks_already():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_req(range(9))
    compute_all(bm, a)
    assert bm.cached == {} and a.block_hashes == []
    assert bm.match_prefix(make_req(range(9))) == 0
    bm.free(a)
    assert bm.num_free_blocks == 8 and not bm.evictable and len(bm.free_ids) == 8

    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req(range(9))
    compute_all(bm, a)
    b = make_req(range(9))
    assert bm.allocate(b, 1)
    assert bm.match_prefix(b) == 0  # a request that already holds blocks is not matched again


def test_cache_full_blocks_is_incremental():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req(range(14))
    assert bm.allocate(a, 14)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert a.block_hashes == [] and not bm.cached
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2 and len(bm.cached) == 2
    first = list(a.block_hashes)
    a.num_computed_tokens = 14
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 3 and a.block_hashes[:2] == first
    assert set(bm.cached.values()) == set(a.block_ids[:3])


def test_duplicate_content_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_req(range(9)), make_req(range(9))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # computed side by side, no sharing
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r)
    assert a.block_hashes == b.block_hashes
    assert len(bm.cached) == 2 and set(bm.cached.values()) == set(a.block_ids[:2])
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)
    bm.free(b)
    # a's full blocks stay cached (evictable); b's duplicates carry no content and are plain free.
    assert set(bm.evictable) == set(a_blocks[:2])
    assert set(b_blocks) <= set(bm.free_ids)
    assert bm.num_free_blocks == 8
    check_consistency(bm, [])


def test_freed_cached_blocks_are_revived_by_a_hit():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_req(range(9))
    compute_all(bm, a)
    blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert set(bm.evictable) == set(blocks[:2])  # full computed blocks keep their content
    assert blocks[2] in bm.free_ids
    b = make_req(list(range(8)) + [42])
    assert bm.match_prefix(b) == 8
    assert b.block_ids == blocks[:2]
    assert not bm.evictable and bm.num_free_blocks == 4
    assert [bm.ref_counts[x] for x in blocks[:2]] == [1, 1]
    check_consistency(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 6
    check_consistency(bm, [])


# ---------------------------------------------------------------- eviction


def _fill(bm, tokens):
    r = make_req(tokens)
    compute_all(bm, r)
    return r


def test_free_list_is_used_before_evicting_cached_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _fill(bm, [1, 2, 3, 4, 5, 6])  # 3 full cached blocks
    bm.free(a)
    x = make_req(range(100, 106))
    assert bm.allocate(x, 6)  # three never-used blocks are free: no eviction
    cached_blocks = set(bm.cached.values())
    assert len(cached_blocks) == 3 and set(x.block_ids).isdisjoint(cached_blocks)
    assert len(bm.evictable) == 3
    assert bm.match_prefix(make_req([1, 2, 3, 4, 5, 6, 7])) == 6


def test_eviction_takes_tail_blocks_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = _fill(bm, [1, 2, 3, 4, 5, 6])
    a0, a1, a2 = a.block_ids
    bm.free(a)
    assert list(bm.evictable) == [a2, a1, a0]  # LRU first: the tail of the sequence
    x = make_req([9])
    assert bm.allocate(x, 1)
    assert x.block_ids == [a2]
    assert bm.block_keys[a2] is None and a2 not in bm.cached.values()
    # The head of the prefix survives, so a later request still hits 2 blocks.
    probe = make_req([1, 2, 3, 4, 5, 6, 7])
    assert bm.match_prefix(probe) == 4 and probe.block_ids == [a0, a1]
    bm.free(probe)
    assert bm.allocate(x, 3)
    assert x.block_ids == [a2, a1]  # a1 is the tail again and goes next
    probe = make_req([1, 2, 3, 4, 5, 6, 7])
    assert bm.match_prefix(probe) == 2 and probe.block_ids == [a0]
    check_consistency(bm, [x, probe])


def test_eviction_is_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _fill(bm, [1, 2, 3, 4])
    b = _fill(bm, [5, 6, 7, 8])
    (a0, a1), (b0, b1) = a.block_ids, b.block_ids
    bm.free(a)
    bm.free(b)
    assert list(bm.evictable) == [a1, a0, b1, b0]  # a released first, tails first
    # Touch a's prefix again (a hit, then a release): now b is the least recently used.
    probe = make_req([1, 2, 3, 4, 0])
    assert bm.match_prefix(probe) == 4
    bm.free(probe)
    assert list(bm.evictable) == [b1, b0, a1, a0]
    x = make_req([0, 0, 0])
    assert bm.allocate(x, 3)
    assert x.block_ids == [b1, b0]
    assert bm.match_prefix(make_req([5, 6, 7, 8, 0])) == 0
    assert bm.match_prefix(make_req([1, 2, 3, 4, 0])) == 4


def test_evicted_block_is_reset_and_reusable_for_new_content():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = _fill(bm, [1, 2, 3])  # one full block cached, one partial
    bm.free(a)
    b = _fill(bm, [7, 8, 9, 10])  # needs both blocks: evicts a's cached block
    assert bm.match_prefix(make_req([1, 2, 3])) == 0
    assert len(bm.cached) == 2 and set(bm.cached.values()) == set(b.block_ids)
    check_consistency(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 2
    check_consistency(bm, [])


def test_reset_prefix_cache_drops_only_unreferenced_content():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _fill(bm, [1, 2, 3, 4])
    b = _fill(bm, [5, 6, 7, 8])
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.evictable
    assert bm.num_free_blocks == 6
    assert bm.match_prefix(make_req([1, 2, 3, 4, 0])) == 0
    # b's blocks are in use: they stay cached and shareable.
    c = make_req([5, 6, 7, 8, 0])
    assert bm.match_prefix(c) == 4 and c.block_ids == b.block_ids
    check_consistency(bm, [b, c])
    bm.free(b)
    bm.free(c)
    bm.reset_prefix_cache()
    assert bm.cached == {} and bm.num_free_blocks == 8 and len(bm.free_ids) == 8
    assert all(k is None for k in bm.block_keys)
    check_consistency(bm, [])


def test_failed_admission_after_a_hit_releases_the_hit():
    """The scheduler's _admit pattern: match_prefix, allocate fails, free -> nothing leaks."""
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _fill(bm, [1, 2, 3, 4])
    bm.free(a)
    hog = make_req([0, 0, 0, 0])
    assert bm.allocate(hog, 4)  # takes the 2 never-used blocks
    b = make_req([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(b) == 4
    assert not bm.allocate(b, 8)  # would need 2 more, none left
    bm.free(b)
    assert b.block_ids == [] and b.block_hashes == []
    assert bm.num_free_blocks == 2
    check_consistency(bm, [hog])
    assert bm.match_prefix(make_req([1, 2, 3, 4, 0])) == 4  # the cached content survived
