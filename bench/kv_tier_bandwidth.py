"""Onboarding bandwidth of the KV tiers against their references, in one run (issue 21).

- **G2** (``HostTier.get``) against a plain memcpy of the same bytes: ``out.copy_(block)``
  into the same preallocated tensor, over the same blocks in the same order.
- **G3** (``DiskTier.get``) against the disk's own sequential read of the same number of
  bytes, measured with ``dd`` in the same run, both with a **cold** page cache and a
  **warm** one:
  - cold: the reference is ``dd iflag=direct`` (O_DIRECT bypasses the page cache; no root
    needed) of one file as large as all the blocks together; the tier's block files are
    dropped from the page cache first with ``posix_fadvise(DONTNEED)`` (works without root
    on files we own, once they are written back: each is fsync'ed first); the tier is
    measured plain (one get after the other) and after ``DiskTier.prefetch`` of all the
    blocks (which keeps the disk reading 32 MiB ahead of the gets);
  - warm: the reference is a buffered ``dd`` of the same file just read (it is in the
    page cache), the tier reads its files right after reading them once.

Both dd block sizes are reported: the tier's block size (the same request size as a
get) and 64 MiB (the disk's best sequential figure). Blocks are onboarded in the order
they were offloaded (a prefix's blocks). Runs alternate reference and tier so that the
machine's noise hits both alike; the figures are medians. Goal (issue 21): each tier at
least 50% of its reference.

    python -m bench.kv_tier_bandwidth                       # 2 MiB and 64 KiB blocks
    python -m bench.kv_tier_bandwidth --dir /mnt/nvme --runs 7 --json bench/kv_tier_bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from workers.engine.kv_tiers.disk_tier import DiskTier
from workers.engine.kv_tiers.keys import CacheFingerprint

# Llama-3-8B in bf16, 16-token blocks: 32 layers x K/V x 8 kv heads x 16 x 128 x 2 bytes.
LLAMA_8B = CacheFingerprint(
    model="llama-3-8b", dtype="bfloat16", kv_cache_dtype="auto", num_layers=32,
    num_kv_heads=8, head_dim=128, block_size=16,
)  # fmt: skip
# A small model's block: 4 layers x K/V x 2 kv heads x 16 x 64 x 4 bytes (fp32) = 64 KiB.
SMALL = CacheFingerprint(
    model="small", dtype="float32", kv_cache_dtype="auto", num_layers=4, num_kv_heads=2,
    head_dim=64, block_size=16,
)  # fmt: skip
DD_BIG_BS = 64 << 20


def block_bytes(fp: CacheFingerprint) -> int:
    elem = torch.empty((), dtype=getattr(torch, fp.dtype)).element_size()
    return fp.num_layers * 2 * fp.num_kv_heads * fp.block_size * fp.head_dim * elem


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


# -- G2 -------------------------------------------------------------------------------


def host_run(fp: CacheFingerprint, blocks: torch.Tensor, runs: int) -> dict:
    """HostTier.get of every block vs out.copy_(block) of the same blocks, alternated."""
    from workers.engine.kv_tiers.host_tier import HostTier

    num_blocks, size = blocks.shape
    tier = HostTier(fp, size, num_blocks * size * 2, pin_memory=False)
    for i in range(num_blocks):
        assert tier.put(i, blocks[i]), "HostTier refused a block"
    out = torch.empty(size, dtype=torch.uint8)
    memcpy, host = [], []
    for _ in range(runs):
        start = time.perf_counter()
        for i in range(num_blocks):
            out.copy_(blocks[i])
        memcpy.append(gbps(blocks.numel(), time.perf_counter() - start))
        start = time.perf_counter()
        for i in range(num_blocks):
            tier.get(i, out)
        host.append(gbps(blocks.numel(), time.perf_counter() - start))
    assert tier.get(num_blocks - 1, out) and torch.equal(out, blocks[-1])
    tier.close()
    return _pair("memcpy", memcpy, "host_get", host)


# -- G3 -------------------------------------------------------------------------------


def dd_read(path: Path, bs: int, direct: bool) -> float:
    """GB/s of ``dd`` reading ``path`` sequentially (its own figure: bytes / seconds)."""
    cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={bs}"]
    if direct:
        cmd.append("iflag=direct")
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env={"LC_ALL": "C"})
    match = re.search(r"^(\d+) bytes .* copied, ([\d.e+-]+) s", done.stderr, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"cannot read dd's output: {done.stderr!r}")
    return gbps(int(match.group(1)), float(match.group(2)))


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped: write them back first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_run(fp: CacheFingerprint, blocks: torch.Tensor, runs: int, directory: Path) -> dict:
    num_blocks, size = blocks.shape
    big = directory / "sequential.bin"
    with big.open("wb") as f:
        f.write(memoryview(blocks.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    try:
        dd_read(big, size, direct=True)
        direct_ok = True
    except subprocess.CalledProcessError:  # O_DIRECT refused (tmpfs, ...): cold buffered
        direct_ok = False

    root = directory / "tier"
    tier = DiskTier(root, fp, size, num_blocks * (size + 4096))
    start = time.perf_counter()
    for i in range(num_blocks):
        assert tier.put(i, blocks[i]), "DiskTier refused a block"
    put_gbps = gbps(blocks.numel(), time.perf_counter() - start)
    files = sorted(tier.directory.iterdir())
    tier.close()
    start = time.perf_counter()
    tier = DiskTier(root, fp, size, num_blocks * (size + 4096))  # the restart's scan
    scan_s = time.perf_counter() - start
    assert len(tier.hashes()) == num_blocks

    out = torch.empty(size, dtype=torch.uint8)
    figures: dict[str, list[float]] = {
        k: [] for k in ("dd_cold", "dd_cold_big", "get_cold", "get_cold_prefetch")
    }
    figures |= {k: [] for k in ("dd_warm", "dd_warm_big", "get_warm")}

    def read_all(prefetch: bool = False) -> float:
        start = time.perf_counter()
        if prefetch:  # as the engine's onboarding does: all of them, the tier keeps a window
            tier.prefetch(range(num_blocks))
        for i in range(num_blocks):
            if not tier.get(i, out):
                raise RuntimeError(f"block {i} missed")
        return gbps(blocks.numel(), time.perf_counter() - start)

    for _ in range(runs):
        for bs, key in ((size, "dd_cold"), (DD_BIG_BS, "dd_cold_big")):
            if not direct_ok:
                drop_cache(big)
            figures[key].append(dd_read(big, bs, direct=direct_ok))
        for path in files:
            drop_cache(path)
        figures["get_cold"].append(read_all())
        for path in files:
            drop_cache(path)
        figures["get_cold_prefetch"].append(read_all(prefetch=True))
        dd_read(big, DD_BIG_BS, direct=False)  # into the page cache
        figures["dd_warm"].append(dd_read(big, size, direct=False))
        figures["dd_warm_big"].append(dd_read(big, DD_BIG_BS, direct=False))
        figures["get_warm"].append(read_all())
    assert tier.get(num_blocks - 1, out) and torch.equal(out, blocks[-1])
    stats = tier.stats()
    assert stats.errors == 0
    tier.close()
    result = {k: statistics.median(v) for k, v in figures.items()}
    result |= {f"{k}_runs": v for k, v in figures.items()}
    result |= {
        "cold_reference": "dd iflag=direct" if direct_ok else "dd after fadvise(DONTNEED)",
        "put_gbps": put_gbps,
        "scan_ms_per_1000_files": scan_s / num_blocks * 1e6,
    }
    for kind in ("cold", "warm", "cold_prefetch"):
        ref = kind.removesuffix("_prefetch")
        result[f"ratio_{kind}"] = result[f"get_{kind}"] / result[f"dd_{ref}"]
        result[f"ratio_{kind}_big"] = result[f"get_{kind}"] / result[f"dd_{ref}_big"]
    return result


def _pair(ref_name: str, ref: list[float], name: str, got: list[float]) -> dict:
    return {
        ref_name: statistics.median(ref),
        name: statistics.median(got),
        "ratio": statistics.median(got) / statistics.median(ref),
        f"{ref_name}_runs": ref,
        f"{name}_runs": got,
    }


def filesystem_of(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _dev, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes")
    parser.add_argument("--mib", type=int, default=512, help="bytes onboarded per run, MiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-host", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "runs": args.runs,
        "sizes": {},
    }
    work = Path(tempfile.mkdtemp(prefix="kv_tier_bw_", dir=args.dir))
    report["filesystem"] = filesystem_of(work)
    try:
        for label, fp in (("llama8b_2MiB", LLAMA_8B), ("small_64KiB", SMALL)):
            size = block_bytes(fp)
            num_blocks = (args.mib << 20) // size
            gen = torch.Generator().manual_seed(0)
            blocks = torch.randint(0, 256, (num_blocks, size), dtype=torch.uint8, generator=gen)
            entry: dict = {"block_bytes": size, "num_blocks": num_blocks}
            if not args.skip_host:
                try:
                    entry["host"] = host_run(fp, blocks, args.runs)
                except ImportError as exc:  # HostTier not there yet (another branch)
                    entry["host"] = {"skipped": str(exc)}
            directory = work / label
            directory.mkdir()
            entry["disk"] = disk_run(fp, blocks, args.runs, directory)
            shutil.rmtree(directory)
            report["sizes"][label] = entry
            _print(label, entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def _print(label: str, entry: dict) -> None:
    print(f"== {label}: {entry['num_blocks']} blocks of {entry['block_bytes']} bytes")
    host = entry.get("host", {})
    if "ratio" in host:
        print(
            f"  G2 host get {host['host_get']:.2f} GB/s vs memcpy {host['memcpy']:.2f} "
            f"-> {host['ratio']:.0%}"
        )
    elif host:
        print(f"  G2 skipped: {host['skipped']}")
    disk = entry["disk"]
    for kind in ("cold", "cold_prefetch", "warm"):
        ref = kind.removesuffix("_prefetch")
        print(
            f"  G3 {kind}: disk get {disk[f'get_{kind}']:.2f} GB/s vs dd bs=block "
            f"{disk[f'dd_{ref}']:.2f} ({disk[f'ratio_{kind}']:.0%}), dd bs=64M "
            f"{disk[f'dd_{ref}_big']:.2f} ({disk[f'ratio_{kind}_big']:.0%})"
        )
    print(
        f"  put {disk['put_gbps']:.2f} GB/s, restart scan "
        f"{disk['scan_ms_per_1000_files']:.1f} ms per 1000 files"
    )


if __name__ == "__main__":
    main()
