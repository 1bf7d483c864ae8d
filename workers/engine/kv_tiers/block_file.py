"""The disk tier's block file: one KV block per file, a 64-byte header, then the payload.

```
offset  size  field
0       8     magic b"BATONKVB"
8       2     format version (1)
10      2     header length (64)
12      4     flags: 0, or 1 (KEYED: a MAC below instead of a checksum)
16      8     cache fingerprint digest (CacheFingerprint.digest, 16 hex chars as 8 bytes)
24      8     block hash (u64, the chained prefix hash)
32      8     payload length (bytes; the tier's block_bytes)
40      16    flags 0: payload checksum xxh3_64 (8 bytes), then 8 zero bytes;
              flags 1: HMAC-SHA256 (truncated to 16 bytes) of bytes 0..40 and the payload
56      8     header checksum: xxh3_64 of bytes 0..56
64      ...   payload: the bytes of kv_cache[block_id] (docs/kv-cache-layout.md)
```

A checksum catches a torn or rotted file; it does not stop a forged one: anyone who can
write the directory can compute xxh3, and the header's fingerprint is the directory's
name. With a per-deployment secret (``kv_cache.disk_tier_secret_file``) every block is
written with a keyed MAC (flags 1) and read only if its MAC verifies under the same secret:
a planted or a copied file (another deployment's, or this one's under another block's
name: the hash is inside the MAC) is refused (``UNAUTHENTICATED``) and counted. SHA-256
runs ~2 GB/s here (xxh3 ~100 GB/s): the MAC costs ~0.4 ms per MiB read or written, which
is why it comes with the secret, not always.

Files are created ``0600`` with ``O_EXCL | O_NOFOLLOW`` (a planted symlink is not followed,
a planted file not reused), read with ``O_NOFOLLOW | O_NONBLOCK`` and used only if they are
regular files (a FIFO planted under a block's name does not block the reader: it is
``UNSAFE``), in directories made ``0700`` (``disk_tier.py``).

All integers little-endian. The header checksum makes a flipped header byte read as a
corrupt file instead of, say, a shorter payload length; the payload checksum (xxh3: ~45
GB/s here, against ~4.5 for zlib.crc32, so checking costs little next to the read itself)
catches a torn or rotted payload. A file is written under a temporary name and renamed
over its final one (``os.replace``), so a crash leaves either no file, an old complete
file, or a temporary file that the tier's start-up scan removes; never a half block under
a block's name. The file is not fsync'ed: after a power loss a renamed-but-unflushed file
can come back empty or with stale pages, which the length and checksums turn into a miss
(losing offloaded blocks on power loss is a cache miss, not an error of the service).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import hmac
import os
import stat
import struct

import xxhash

MAGIC = b"BATONKVB"
VERSION = 1
HEADER_LEN = 64
_FIELDS = struct.Struct("<8sHHI8sQQ16s")  # everything the header checksum covers (56 bytes)
_HEADER_SUM = struct.Struct("<Q")
assert _FIELDS.size + _HEADER_SUM.size == HEADER_LEN
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
KEYED = 1  # flags: the payload's integrity is a keyed MAC
_MAC_COVERS = 40  # header bytes under the MAC (magic .. payload length), then the payload
_MAC_LEN = 16
FILE_MODE = 0o600
DIR_MODE = 0o700


class BadBlock(enum.Enum):
    """Why a block file could not be used (every kind is a miss for the caller)."""

    MISSING = "missing"  # the file is gone (deleted behind the tier's back)
    TRUNCATED = "truncated"  # shorter (or longer) than a header plus the payload
    CORRUPT = "corrupt"  # bad magic, version, header or payload checksum, or another hash
    FOREIGN = "foreign"  # written under another cache fingerprint
    UNAUTHENTICATED = "unauthenticated"  # no MAC, or one the tier's secret does not verify
    UNSAFE = "unsafe"  # a symlink, FIFO or other non-regular file where a block belongs
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


def make_header(
    digest: bytes, block_hash: int, payload: memoryview, key: bytes | None = None
) -> bytes:
    """A block's header; with ``key`` (the deployment's secret) its payload is MAC'd."""
    flags = KEYED if key is not None else 0
    fields = bytearray(
        _FIELDS.pack(MAGIC, VERSION, HEADER_LEN, flags, digest, block_hash, payload.nbytes, b"")
    )
    if key is not None:
        fields[_MAC_COVERS:56] = _mac(key, fields, payload)
    else:
        fields[_MAC_COVERS : _MAC_COVERS + 8] = xxhash.xxh3_64_digest(payload)[::-1]
    return bytes(fields) + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))


def _mac(key: bytes, header: bytes | bytearray, payload: memoryview) -> bytes:
    mac = hmac.new(key, memoryview(header)[:_MAC_COVERS], hashlib.sha256)
    mac.update(payload)
    return mac.digest()[:_MAC_LEN]


def write_block(path: str, header: bytes, payload: memoryview, mtime_ns: int) -> None:
    """Write a block file atomically: a temporary file beside ``path``, then a rename.

    ``mtime_ns`` is stamped on the file (the tier's recency order, read back at start-up).
    Raises OSError (ENOSPC, EIO, ...) with nothing left behind under either name."""
    head, name = os.path.split(path)
    temp = os.path.join(head, f".{name}.{os.getpid()}{TEMP_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temp, flags, FILE_MODE)
    except FileExistsError:  # a dead write of a process with this pid, or a planted file
        os.unlink(temp)
        fd = os.open(temp, flags, FILE_MODE)
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
    key: bytes | None = None,
) -> BadBlock | None:
    """Read the block's payload into ``out`` (exactly the payload's size) and verify it.

    None when ``out`` holds the block; otherwise why not (``out`` then holds junk). Stamps
    ``touch_ns`` as the file's mtime on success (its recency, kept across restarts).
    With ``key`` only a file MAC'd under it is used."""
    header = bytearray(HEADER_LEN)
    extra = bytearray(1)  # a byte past the payload means the file is too long
    try:
        # Not a symlink's target; and a FIFO opens at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return BadBlock.MISSING
    except OSError as exc:
        return BadBlock.UNSAFE if exc.errno == errno.ELOOP else BadBlock.IO_ERROR
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return BadBlock.UNSAFE
        # One system call reads header and payload, the payload straight into ``out``.
        num_read = os.preadv(fd, [header, out, extra], 0)
        bad = check_header(header, num_read, digest, block_hash, out.nbytes)
        if bad is None:
            bad = _check_payload(header, out, key)
        if bad is None and touch_ns is not None:
            os.utime(fd, ns=(touch_ns, touch_ns))
        return bad
    except OSError:
        return BadBlock.IO_ERROR
    finally:
        os.close(fd)


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


def _check_payload(header: bytearray, payload: memoryview, key: bytes | None) -> BadBlock | None:
    flags = _FIELDS.unpack_from(header)[3]
    stored = bytes(header[_MAC_COVERS:56])
    if key is not None:  # only this deployment's MAC will do
        if flags != KEYED or not hmac.compare_digest(stored, _mac(key, header, payload)):
            return BadBlock.UNAUTHENTICATED
        return None
    if flags == KEYED:  # a keyed block, and no key here to check it
        return BadBlock.UNAUTHENTICATED
    if flags != 0 or stored != xxhash.xxh3_64_digest(payload)[::-1] + bytes(8):
        return BadBlock.CORRUPT
    return None


class RangeReader:
    """A block file read in ranges of its payload, in order (the layer-wise onboarding:
    ``kv_tiers/layer_onboard.py`` reads layer group after layer group of every block).

    ``open`` checks the header and the file's length; each ``read`` verifies nothing but
    the length it got, and feeds the payload's checksum (or MAC): only ``finish``, after the
    last range, says whether the bytes were the block's. So a bad payload is found after
    its bytes were used: the caller must be able to undo that (the onboarding recomputes)."""

    def __init__(self, fd: int, flags: int, header: bytearray, key: bytes | None) -> None:
        self._fd = fd
        self._header = header
        self._stored = bytes(header[_MAC_COVERS:56])
        self._keyed = key is not None
        self._ok = (flags == KEYED) == self._keyed and flags in (0, KEYED)
        self._sum = (
            hmac.new(key, memoryview(header)[:_MAC_COVERS], hashlib.sha256)
            if key is not None
            else xxhash.xxh3_64()
        )
        self._pos = 0

    @classmethod
    def open(
        cls, path: str, digest: bytes, block_hash: int, payload_len: int, key: bytes | None
    ) -> RangeReader | BadBlock:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return BadBlock.MISSING
        except OSError as exc:
            return BadBlock.UNSAFE if exc.errno == errno.ELOOP else BadBlock.IO_ERROR
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                return BadBlock.UNSAFE
            header = bytearray(HEADER_LEN)
            num_read = os.preadv(fd, [header], 0)
            if num_read == HEADER_LEN:  # the length read_block's one read would see
                num_read = min(info.st_size, HEADER_LEN + payload_len + 1)
            bad = check_header(header, num_read, digest, block_hash, payload_len)
        except OSError:
            bad = BadBlock.IO_ERROR
        if bad is not None:
            os.close(fd)
            return bad
        # The job opens every file before its first range: their reads start together.
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return cls(fd, _FIELDS.unpack_from(header)[3], header, key)

    def read(self, start: int, out: memoryview) -> BadBlock | None:
        """Payload bytes ``[start, start + len(out))`` into ``out``; ranges come in order."""
        if start != self._pos:
            raise ValueError(f"ranges must be read in order: {start} after {self._pos}")
        try:
            num_read = os.preadv(self._fd, [out], HEADER_LEN + start)
        except OSError:
            return BadBlock.IO_ERROR
        if num_read != out.nbytes:  # truncated since it was opened
            return BadBlock.TRUNCATED
        self._sum.update(out)
        self._pos += out.nbytes
        return None

    def finish(self, touch_ns: int | None) -> BadBlock | None:
        """After the last range: whether the payload was the block's (and stamp its
        recency, as ``read_block``)."""
        if not self._ok:
            return BadBlock.UNAUTHENTICATED
        if self._keyed:
            if not hmac.compare_digest(self._stored, self._sum.digest()[:_MAC_LEN]):
                return BadBlock.UNAUTHENTICATED
        elif self._stored != self._sum.digest()[::-1] + bytes(8):
            return BadBlock.CORRUPT
        if touch_ns is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd, ns=(touch_ns, touch_ns))
        return None

    def close(self) -> None:
        os.close(self._fd)
