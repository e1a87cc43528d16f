"""qmtp/serve/prefix_cache.py's host side: the hash chain, the deepest usable checkpoint, the boundaries a
prefill keeps (from the prompts it saw), byte accounting over shared pages, and LRU eviction that gives
the pages back."""

from __future__ import annotations

import numpy as np

from qmtp.runtime.paging import PageAllocator
from qmtp.serve.prefix_cache import PrefixCache, chain

BLOCK, PAGE = 8, 4
RNG = np.random.default_rng(0)
SYSTEM = RNG.integers(0, 500, 20).tolist()


def make(budget=10_000, pages=64):
    alloc = PageAllocator(pages, PAGE)
    return PrefixCache(BLOCK, budget, alloc, page_bytes=100), alloc


def store(cache, alloc, tokens, b, state_bytes=50):
    """A request's prefill reaching boundary b: its pages, and the checkpoint the cache keeps."""
    handle = alloc.reserve(len(tokens) + 4)
    cache.put(chain(tokens, BLOCK)[:b // BLOCK], alloc.pages(handle)[:b // PAGE], "gdn", "h", state_bytes)
    return handle


def test_chain_names_equal_prefixes_alike():
    a, b = chain(SYSTEM + [1, 2, 3, 4], BLOCK), chain(SYSTEM + [9, 2, 3, 4], BLOCK)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert chain(SYSTEM[:7], BLOCK) == []


def test_lookup_finds_the_deepest_checkpoint_before_the_last_token():
    cache, alloc = make()
    prompt = SYSTEM + [1, 2, 3, 4]  # 24 tokens: boundaries 8, 16, 24
    store(cache, alloc, prompt, 16)
    assert cache.lookup(prompt)[0] == 16
    assert cache.lookup(SYSTEM[:16] + [7])[0] == 16  # 17 tokens: 16 leaves one to prefill
    assert cache.lookup(SYSTEM[:16])[0] == 0  # the boundary is its end: nothing left to prefill from 16
    assert cache.lookup(SYSTEM[:15] + [499, 5, 6])[0] == 0  # the second block differs
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (4, 2, 32)


def test_keep_points_are_the_branch_point_and_in_a_long_prefill_the_deepest():
    cache, alloc = make()
    first = SYSTEM + [1] * 20  # 40 tokens
    digests = chain(first, BLOCK)
    assert cache.keep_points(len(first), digests, 0, several_passes=False) == []  # nothing shared: no pass more
    assert cache.keep_points(len(first), digests, 0, several_passes=True) == [32]  # the deepest before 39
    cache.remember(digests)  # prefilled: its blocks are seen
    second = SYSTEM + [2] * 20  # shares blocks 1-2 (16 tokens) with the first
    b, hit, d2 = cache.lookup(second)
    assert hit is None and cache.keep_points(len(second), d2, b, several_passes=False) == [16]  # the branch point
    assert cache.keep_points(len(second), d2, b, several_passes=True) == [16, 32]
    store(cache, alloc, second, 16)
    b, hit, d3 = cache.lookup(SYSTEM + [3] * 20)
    assert b == 16 and cache.keep_points(40, d3, b, several_passes=False) == []  # resumed at the branch point
    assert cache.keep_points(40, d3, b, several_passes=True) == [32]


def test_remembered_prompts_are_bounded():
    cache = PrefixCache(BLOCK, 10_000, PageAllocator(64, PAGE), page_bytes=100, seen_blocks=3)
    old, new = chain([1] * 16, BLOCK), chain([2] * 24, BLOCK)
    cache.remember(old)
    assert cache.keep_points(17, old, 0, several_passes=False) == [16]
    cache.remember(new)  # 5 digests: the oldest two go
    assert cache.keep_points(17, old, 0, several_passes=False) == []
    assert cache.keep_points(24, new, 0, several_passes=False) == [16]


def test_bytes_count_shared_pages_once_and_eviction_frees_them():
    cache, alloc = make(budget=1_000)
    h1 = store(cache, alloc, SYSTEM + [1] * 12, 16)  # 4 pages, 50 state bytes
    h2 = store(cache, alloc, SYSTEM[:16] + [5] * 8, 8)  # another request's own pages
    assert cache.bytes == 2 * 50 + (4 + 2) * 100
    alloc.release(h1)
    alloc.release(h2)
    assert alloc.free_pages == 64 - 6  # the cache holds 6 pages alive
    cache.evict_for_pages(64 - 2)  # the LRU entry (h1's 4 pages) goes first
    assert len(cache) == 1 and alloc.free_pages == 62 and cache.evicted == 1
    cache.clear()
    assert alloc.free_pages == 64 and cache.bytes == 0


def test_the_budget_evicts_least_recently_used_first():
    cache, alloc = make(budget=2 * (50 + 2 * 100))
    prompts = [[k] * 16 for k in range(3)]
    for p in prompts[:2]:
        alloc.release(store(cache, alloc, p, 8))
    cache.lookup(prompts[0] + [1])  # the first is now the most recently used
    alloc.release(store(cache, alloc, prompts[2], 8))
    assert cache.lookup(prompts[0] + [1])[0] == 8 and cache.lookup(prompts[1] + [1])[0] == 0
    assert cache.bytes <= cache.budget_bytes and cache.evicted == 1


def test_a_prompt_end_serves_the_same_prompt_again():
    cache, alloc = make()
    prompt = SYSTEM + [7, 8, 9]  # 23 tokens; the prefill pass that ended at 22 wrote the MTP entry for 9
    handle = alloc.reserve(32)
    cache.put_end(prompt, alloc.pages(handle)[:6], "gdn", 50)
    assert cache.lookup(prompt)[0] == 22  # one token left to prefill
    assert cache.lookup(prompt + [1, 2])[0] == 22
    assert cache.lookup(prompt[:-1] + [4])[0] == 0  # its last token differs: a miss (no block boundary kept)
    short = [3, 1, 4]  # shorter than a block: still kept
    cache.put_end(short, alloc.pages(handle)[:1], "gdn", 50)
    assert cache.lookup(short)[0] == 2
    alloc.release(handle)
    cache.clear()


def test_a_response_end_is_found_only_when_its_last_token_follows():
    cache, alloc = make()
    turn = SYSTEM + [1, 2, 3, 4, 5, 6, 7]  # 27 tokens: prompt and response; the state holds 26
    handle = alloc.reserve(32)
    cache.put_end(turn, alloc.pages(handle)[:7], "gdn", 50)
    assert cache.lookup(turn + [8, 9])[0] == 26  # the next turn: resumes at the response's end
    assert cache.lookup(turn)[0] == 26  # the same tokens: the last one is prefilled
    assert cache.lookup(turn[:-1] + [99, 8])[0] == 0  # another token at 26: its MTP entry at 25 would differ
    assert cache.lookup(turn[:-1])[0] == 0  # nothing left to prefill past 26
    alloc.release(handle)
    cache.clear()
    assert alloc.free_pages == 64 and not cache._ends
