"""The disk tier's block file: one KV block per file, a 4 KiB header, then the payload.

```
offset  size  field
0       8     magic b"BATONKVB"
8       2     format version (2)
10      2     header length (4096: where the payload starts)
12      4     flags (0)
16      8     cache fingerprint digest (CacheFingerprint.digest, 16 hex chars as 8 bytes)
24      8     block hash (u64, the chained prefix hash)
32      8     payload length (bytes; the tier's block_bytes)
40      8     payload checksum: xxh3_64 of the payload
48      8     zero (reserved)
56      8     header checksum: xxh3_64 of bytes 0..56
64      4032  zero (checked)
4096    ...   payload: the bytes of kv_cache[block_id] (docs/kv-cache-layout.md)
```

All integers little-endian. The header checksum makes a flipped header byte read as a
corrupt file instead of, say, a shorter payload length; the payload checksum (xxh3: ~45
GB/s here, against ~4.5 for zlib.crc32, so checking costs little next to the read itself)
catches a torn or rotted payload. The payload starts on a page so that a block can be read
with O_DIRECT: a read first takes what the page cache holds (``RWF_NOWAIT``: no waiting
for the disk); on a miss it reads the file with O_DIRECT into an aligned buffer, one
request for the whole block instead of readahead's pieces plus a copy out of the page
cache (docs/kv-tiers.md has the measurements).

A file is written under a temporary name and renamed over its final one (``os.replace``),
so a crash leaves either no file, an old complete file, or a temporary file that the
tier's start-up scan removes; never a half block under a block's name. The file is not
fsync'ed: after a power loss a renamed-but-unflushed file can come back empty or with
stale pages, which the length and checksums turn into a miss (losing offloaded blocks on
power loss is a cache miss, not an error of the service).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import mmap
import os
import struct
import threading

import xxhash

MAGIC = b"BATONKVB"
VERSION = 2
HEADER_LEN = 4096  # a page: the payload is aligned for O_DIRECT
_PAGE = 4096
_FIELDS = struct.Struct("<8sHHI8sQQQ8x")  # everything the header checksum covers (56 bytes)
_HEADER_SUM = struct.Struct("<Q")
_USED = _FIELDS.size + _HEADER_SUM.size  # 64 bytes; the rest of the header is zero
_ZERO_PAD = bytes(HEADER_LEN - _USED)
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"


class BadBlock(enum.Enum):
    """Why a block file could not be used (every kind is a miss for the caller)."""

    MISSING = "missing"  # the file is gone (deleted behind the tier's back)
    TRUNCATED = "truncated"  # shorter (or longer) than a header plus the payload
    CORRUPT = "corrupt"  # bad magic, version, header or payload checksum, or another hash
    FOREIGN = "foreign"  # written under another cache fingerprint
    IO_ERROR = "io_error"  # the read itself failed (EIO, ...)


def file_name(block_hash: int) -> str:
    """The file a block lives in: its hash as 16 hex digits (names sort by nothing useful)."""
    return f"{block_hash:016x}{SUFFIX}"


def parse_file_name(name: str) -> int | None:
    """The block hash a file name stands for, None for anything that is not a block file."""
    stem, dot, ext = name.partition(".")
    if dot + ext != SUFFIX or len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def digest_bytes(digest: str) -> bytes:
    """A fingerprint digest (16 hex characters) as the header's 8 bytes."""
    raw = bytes.fromhex(digest)
    if len(raw) != 8:
        raise ValueError(f"a cache fingerprint digest is 16 hex characters, got {digest!r}")
    return raw


def make_header(digest: bytes, block_hash: int, payload: memoryview) -> bytes:
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        HEADER_LEN,
        0,
        digest,
        block_hash,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload),
    )
    header = fields + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return header + bytes(HEADER_LEN - len(header))


def write_block(path: str, header: bytes, payload: memoryview, mtime_ns: int) -> None:
    """Write a block file atomically: a temporary file beside ``path``, then a rename.

    ``mtime_ns`` is stamped on the file (the tier's recency order, read back at start-up).
    Raises OSError (ENOSPC, EIO, ...) with nothing left behind under either name."""
    head, name = os.path.split(path)
    temp = os.path.join(head, f".{name}.{os.getpid()}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, [header, payload])
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _write_all(fd: int, buffers: list) -> None:
    # writev may write less than asked (a signal, a nearly full disk that still had room
    # for part of it); go on from where it stopped. A full disk raises ENOSPC.
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        if written == 0:
            raise OSError(28, "no progress writing a block file")
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def read_block(
    path: str,
    digest: bytes,
    block_hash: int,
    out: memoryview,
    touch_ns: int | None,
    direct: bool = False,
) -> BadBlock | None:
    """Read the block's payload into ``out`` (exactly the payload's size) and verify it.

    None when ``out`` holds the block; otherwise why not (``out`` then holds junk). Stamps
    ``touch_ns`` as the file's mtime on success (its recency, kept across restarts).
    ``direct``: read what the page cache does not hold with O_DIRECT (the directory's
    file system takes it: ``direct_io_works``)."""
    header = bytearray(HEADER_LEN)
    extra = bytearray(1)  # a byte past the payload means the file is too long
    expected = HEADER_LEN + out.nbytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return BadBlock.MISSING
    except OSError:
        return BadBlock.IO_ERROR
    try:
        # One system call reads header and payload, the payload straight into ``out``;
        # with ``direct``, only if the page cache holds all of it.
        num_read = -1
        if direct:
            with contextlib.suppress(BlockingIOError):
                num_read = os.preadv(fd, [header, out, extra], 0, os.RWF_NOWAIT)
            if num_read < expected:  # not (all) cached, or really short: ask the disk
                num_read = _read_direct(path, header, out)
        if num_read < 0:
            num_read = os.preadv(fd, [header, out, extra], 0)
        bad = check_header(header, num_read, digest, block_hash, out.nbytes)
        if bad is None and xxhash.xxh3_64_intdigest(out) != _payload_sum(header):
            bad = BadBlock.CORRUPT
        if bad is None and touch_ns is not None:
            os.utime(fd, ns=(touch_ns, touch_ns))
        return bad
    except FileNotFoundError:
        return BadBlock.MISSING
    except OSError:
        return BadBlock.IO_ERROR
    finally:
        os.close(fd)


_bounce = threading.local()  # per thread: an aligned buffer for O_DIRECT reads


def _read_direct(path: str, header: bytearray, out: memoryview) -> int:
    """Read the file with O_DIRECT into this thread's aligned buffer, then copy header and
    payload out of it; returns the bytes read (one more than the file holds at most)."""
    size = HEADER_LEN + -(-(out.nbytes + 1) // _PAGE) * _PAGE  # room for the extra byte
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        buf = _bounce.buf = mmap.mmap(-1, size)  # anonymous maps are page-aligned
    view = memoryview(buf)[:size]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    try:
        num_read = os.preadv(fd, [view], 0)
    finally:
        os.close(fd)
        view.release()
    header[:] = buf[:HEADER_LEN]
    memoryview(out)[:] = memoryview(buf)[HEADER_LEN : HEADER_LEN + out.nbytes]
    return min(num_read, HEADER_LEN + out.nbytes + 1)


def direct_io_works(directory: str) -> bool:
    """Whether files in ``directory`` can be read with O_DIRECT (tmpfs, for one, refuses)."""
    probe = os.path.join(directory, f".direct-probe.{os.getpid()}{TEMP_SUFFIX}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(_PAGE))
        if not hasattr(os, "RWF_NOWAIT"):
            return False
        fd = os.open(probe, os.O_RDONLY)
        try:  # the cached-only read comes first: it must work on buffered files too
            with contextlib.suppress(BlockingIOError):
                os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        finally:
            os.close(fd)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [mmap.mmap(-1, _PAGE)], 0) == _PAGE
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def check_header(
    header: bytes | bytearray, num_read: int, digest: bytes, block_hash: int, payload_len: int
) -> BadBlock | None:
    """Whether a file of ``num_read`` bytes starting with ``header`` can hold the block."""
    if num_read < HEADER_LEN:
        return BadBlock.TRUNCATED
    magic, version, header_len, _flags, file_digest, file_hash, file_len, _ = _FIELDS.unpack_from(
        header
    )
    (header_sum,) = _HEADER_SUM.unpack_from(header, _FIELDS.size)
    if header[_USED:HEADER_LEN] != _ZERO_PAD:
        return BadBlock.CORRUPT
    if magic != MAGIC or header_sum != xxhash.xxh3_64_intdigest(memoryview(header)[: _FIELDS.size]):
        return BadBlock.CORRUPT
    if version != VERSION or header_len != HEADER_LEN:
        return BadBlock.CORRUPT
    if file_digest != digest:
        return BadBlock.FOREIGN
    if file_hash != block_hash or file_len != payload_len:
        return BadBlock.CORRUPT
    if num_read != HEADER_LEN + payload_len:
        return BadBlock.TRUNCATED
    return None


def _payload_sum(header: bytes | bytearray) -> int:
    return _FIELDS.unpack_from(header)[7]
