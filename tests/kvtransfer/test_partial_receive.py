"""A partial receive: the decode side reads a lease from block k on (it holds the first k),
or blocks k..e-1 only (a peer pull reads a prefix of the lease).

Over the in-process backend, pull and push, with equal and different TP sizes: exactly the
lease's blocks from ``first_block`` on land in the destination blocks, nothing else of the
decode cache is written, only their bytes count, and the lease ends as for a whole receive.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvtransfer.local_backend import LocalFabric
from kvtransfer.messages import KVHandle, PushRequest, decode_as, encode

from .helpers import empty_cache, full_kv, rank_cache
from .test_connector_local import HEADS, Side, connect, wait_until


@pytest.fixture
def fabric():
    return LocalFabric()


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("end", [None, 4], ids=["suffix", "prefix"])  # 4: a peer pull's
def test_only_the_blocks_from_first_block_on_are_written(fabric, p, d, direction, end):
    full = full_kv(16, num_kv_heads=HEADS, seed=4)
    prefills = [Side(fabric, f"p{r}", rank_cache(full, r, p), r, p) for r in range(p)]
    decodes = [
        Side(fabric, f"d{r}", empty_cache(full, r, d, 16), r, d, direction=direction)
        for r in range(d)
    ]
    connect(*prefills, *decodes)
    src = [11, 2, 7, 3, 5]  # the lease: the whole prompt's blocks
    handles = [side.offer("a", src, dst_tp_size=d) for side in prefills]
    suffix = [h.from_block(2, end) for h in handles]  # the decode side holds the first two
    assert [h.block_ids for h in suffix] == [tuple(src[2:end])] * p
    assert all(
        h.first_block == 2 and h.lease_id == g.lease_id
        for h, g in zip(suffix, handles, strict=True)
    )
    assert decode_as(encode(suffix[0]), KVHandle) == suffix[0]  # travels to other ranks
    dst = [9, 4, 15][: len(src[2:end])]
    before = [side.cache.clone() for side in decodes]
    for side in decodes:
        result = side.conn.receive(suffix, dst).result(timeout=5)
        assert result.num_bytes == len(dst) * side.layout.block_bytes
    reassembled = torch.cat([side.cache[dst] for side in decodes], dim=3)
    assert torch.equal(reassembled, full[src[2:end]])
    others = [b for b in range(16) if b not in dst]
    for side, old in zip(decodes, before, strict=True):
        assert torch.equal(side.cache[others], old[others])  # nothing else written
    for side in prefills:
        assert wait_until(lambda side=side: side.released == [("a", "done")])


def test_a_handle_reads_from_a_block_it_holds_only():
    handle = KVHandle("p#1", "a", 1, (4, 5, 6), "fp", 24, 3, 30.0, 0.0)
    with pytest.raises(ValueError, match=r"cannot read blocks 3\.\.2"):
        handle.from_block(3)  # no block would remain
    assert handle.from_block(0) == handle
    later = handle.from_block(1).from_block(2)
    assert (later.block_ids, later.first_block) == ((6,), 2)
    with pytest.raises(ValueError, match=r"holds blocks 2\.\.2"):
        later.from_block(1)  # the blocks before 2 are not in it any more
    prefix = handle.from_block(1, 2)  # a peer pull reads a prefix of the lease
    assert (prefix.block_ids, prefix.first_block) == ((5,), 1)
    with pytest.raises(ValueError, match=r"cannot read blocks 1\.\.3"):
        handle.from_block(1, 4)
    with pytest.raises(ValueError, match="first_block must be >= 0"):
        msgspec.structs.replace(handle, first_block=-1)
    with pytest.raises(ValueError, match="first_block must be >= 0"):
        PushRequest(1, "a", (1,), 5.0, first_block=-1)


def test_a_push_request_for_more_blocks_than_remain_fails_and_ends_the_lease(fabric):
    full = full_kv(8, num_kv_heads=HEADS)
    prefill = Side(fabric, "prefill", full.clone())
    decode = Side(fabric, "decode", empty_cache(full, 0, 1, 8), direction="push")
    connect(prefill, decode)
    handle = prefill.offer("a", [1, 2, 3])
    wrong = msgspec.structs.replace(handle, first_block=1)  # claims 3 blocks from 1 on
    with pytest.raises(Exception, match="3 destination blocks for 2 source blocks"):
        decode.conn.receive([wrong], [0, 1, 2]).result(timeout=5)
    assert wait_until(lambda: prefill.released == [("a", "failed")])
    assert not decode.cache.any()


def test_an_owner_declining_its_own_handle_ends_the_lease_at_once(fabric):
    # A peer export nobody reads may be declined through its owner (no notice can reach
    # itself): the lease ends there, and the blocks are freed.
    full = full_kv(8, num_kv_heads=HEADS)
    owner = Side(fabric, "a", full.clone())
    other = Side(fabric, "b", empty_cache(full, 0, 1, 8))
    connect(owner, other)
    mine, theirs = owner.offer("x", [1, 2]), other.offer("y", [3])
    owner.conn.decline([mine, theirs], "aborted")
    assert wait_until(lambda: owner.released == [("x", "aborted")])
    assert wait_until(lambda: other.released == [("y", "aborted")])  # a notice, as before
    assert owner.in_use == {} and other.in_use == {}
