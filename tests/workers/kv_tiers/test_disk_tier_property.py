"""Random schedules of put / get / corrupt / delete / restart against a model of the disk
tier (an LRU dict): the tier holds exactly what the model says, reads back exactly the
bytes that were put, turns every damaged file into a counted miss, and its stored /
removed events replay to what it holds."""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.kv_tiers.block_file import HEADER_LEN
from workers.engine.kv_tiers.disk_tier import DiskTier
from workers.engine.kv_tiers.keys import CacheFingerprint

BLOCK_BYTES = 256
FILE_BYTES = HEADER_LEN + BLOCK_BYTES
CAPACITY_BLOCKS = 4
FP = CacheFingerprint(
    model="m", dtype="float16", kv_cache_dtype="auto", num_layers=1, num_kv_heads=1,
    head_dim=8, block_size=16,
)  # fmt: skip
HASHES = st.integers(min_value=0, max_value=7).map(lambda i: (i * 0x9E3779B97F4A7C15) % 2**64)

OPS = st.one_of(
    st.tuples(st.just("put"), HASHES, st.integers(0, 3)),  # (op, hash, content version)
    st.tuples(st.just("get"), HASHES, st.just(0)),
    st.tuples(st.just("flip"), HASHES, st.integers(0, FILE_BYTES - 1)),  # (op, hash, offset)
    st.tuples(st.just("truncate"), HASHES, st.integers(0, FILE_BYTES - 1)),
    st.tuples(st.just("delete"), HASHES, st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.integers(1, CAPACITY_BLOCKS)),
)


def content(block_hash: int, version: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((block_hash + version) % 2**63)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, max_size=40))
def test_random_schedules_match_an_lru_model(ops: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        capacity = CAPACITY_BLOCKS
        tier = DiskTier(root, FP, BLOCK_BYTES, capacity * FILE_BYTES)
        model: OrderedDict[int, torch.Tensor] = OrderedDict()  # least recent first
        damaged: set[int] = set()  # held, but the file will not read back
        published: set[int] = set()  # what the events told a listener
        num_errors = 0
        for op, block_hash, arg in ops:
            path = root / FP.digest / f"{block_hash:016x}.kvb"
            if op == "put":
                assert tier.put(block_hash, content(block_hash, arg))
                if block_hash in model:
                    model.move_to_end(block_hash)  # immutable: the first bytes stay
                else:
                    model[block_hash] = content(block_hash, arg)
                    while len(model) > capacity:
                        evicted, _ = model.popitem(last=False)
                        damaged.discard(evicted)
            elif op == "get":
                out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
                hit = tier.get(block_hash, out)
                if block_hash in model and block_hash not in damaged:
                    assert hit and torch.equal(out, model[block_hash])
                    model.move_to_end(block_hash)
                else:
                    assert not hit
                    if block_hash in model:
                        num_errors += 1
                        del model[block_hash]
                        damaged.discard(block_hash)
            elif op in ("flip", "truncate", "delete") and block_hash in set(model) - damaged:
                # Damage as bit rot or another program would do it: the file's mtime (the
                # tier's recency order across restarts) stays.
                mtime_ns = path.stat().st_mtime_ns
                if op == "flip":
                    data = bytearray(path.read_bytes())
                    data[arg] ^= 0x80
                    path.write_bytes(bytes(data))
                elif op == "truncate":
                    os.truncate(path, arg)
                else:
                    path.unlink()
                if op != "delete":
                    os.utime(path, ns=(mtime_ns, mtime_ns))
                damaged.add(block_hash)
            elif op == "restart":
                tier.close()
                num_errors = 0  # a new tier counts from zero
                for h in list(model):
                    # A wrong-size file is dropped (an error) at the scan, a missing one
                    # is not found; others fail on read.
                    if h in damaged and _size(root, h) != FILE_BYTES:
                        num_errors += _size(root, h) >= 0
                        del model[h]
                        damaged.discard(h)
                capacity = arg
                while len(model) > capacity:
                    evicted, _ = model.popitem(last=False)
                    damaged.discard(evicted)
                tier = DiskTier(root, FP, BLOCK_BYTES, capacity * FILE_BYTES)
                published = set()  # a restarted worker starts a fresh story

            assert tier.hashes() == set(model)
            events = tier.drain_events()
            assert not set(events.stored) & set(events.removed)
            published = (published - set(events.removed)) | set(events.stored)
            assert published == set(model)

        assert tier.stats().errors == num_errors
        names = {p.name for p in (root / FP.digest).iterdir()}
        assert {f"{h:016x}.kvb" for h in model if h not in damaged} <= names


def _size(root: Path, block_hash: int) -> int:
    """The block file's size, -1 when there is none."""
    try:
        return (root / FP.digest / f"{block_hash:016x}.kvb").stat().st_size
    except FileNotFoundError:
        return -1
