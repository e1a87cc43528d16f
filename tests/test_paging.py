"""Host page allocator: reservations, page tables, and release exactly once."""

import numpy as np
import pytest

from qmtp.runtime.paging import CapacityError, PageAllocator


def test_reserve_release_and_page_table():
    alloc = PageAllocator(num_pages=6, page_size=4)
    a, b = alloc.reserve(9), alloc.reserve(4)  # 3 pages and 1 page
    assert alloc.free_pages == 2
    table = alloc.page_table([a, b])
    assert table.shape == (2, 3) and table.dtype == np.int32
    assert len(set(table[0].tolist())) == 3 and table[1, 0] not in table[0] and table[1, 1:].tolist() == [0, 0]
    alloc.release(a)
    assert alloc.free_pages == 5
    with pytest.raises(KeyError, match="already released"):
        alloc.release(a)
    c = alloc.reserve(20)  # 5 pages: reuses the released ones
    assert alloc.free_pages == 0 and sorted(alloc.page_table([c])[0].tolist() + [table[1, 0]]) == list(range(6))


def test_shared_and_retained_pages_are_freed_by_their_last_holder():
    alloc = PageAllocator(num_pages=6, page_size=4)
    a = alloc.reserve(12)  # 3 pages
    prefix = alloc.pages(a)[:2]
    alloc.retain(prefix)  # the prefix cache keeps them
    b = alloc.reserve(16, shared=prefix)  # 2 shared + 2 new
    assert alloc.pages(b)[:2] == prefix and alloc.free_pages == 1
    assert [alloc.refs(p) for p in prefix] == [3, 3]
    alloc.release(a)
    assert alloc.free_pages == 2  # a's third page only
    alloc.release(b)
    assert alloc.free_pages == 4 and [alloc.refs(p) for p in prefix] == [1, 1]
    alloc.drop(prefix)
    assert alloc.free_pages == 6
    with pytest.raises(ValueError, match="dropped more often than held"):
        alloc.drop(prefix[:1])
    with pytest.raises(ValueError, match="include a free page"):
        alloc.reserve(8, shared=prefix)
    with pytest.raises(ValueError, match="retain of a free page"):
        alloc.retain(prefix)


def test_capacity_errors_name_the_limit():
    alloc = PageAllocator(num_pages=2, page_size=8)
    with pytest.raises(CapacityError, match=r"17 tokens need 3 pages of 8, but the KV cache has only 2 pages"):
        alloc.reserve(17)
    alloc.reserve(9)
    with pytest.raises(CapacityError, match="only 0 are free"):
        alloc.reserve(1)
