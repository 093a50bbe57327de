"""Storage microbenchmark: sequential read/write MB/s and random 4 KiB read IOPS."""
from __future__ import annotations

import mmap
import os
import tempfile
import time

import numpy as np

from ._records import Measurement, check_positive_float, check_positive_int, median

__all__ = ["measure_storage"]

_MiB = 1024**2


def _open_direct(path, flags):
    """Open with O_DIRECT if the OS and file system allow it; returns (fd, direct?)."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def _drop_cache(fd) -> bool:
    """Ask the kernel to drop the file's (clean) pages: posix_fadvise(POSIX_FADV_DONTNEED)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return True
        except OSError:
            return False
    return False


def measure_storage(directory: str | None = None, file_bytes: int = 256 * _MiB,
                    block_bytes: int = 4 * _MiB, random_seconds: float = 1.0,
                    io_bytes: int = 4096, seed: int = 0) -> dict:
    """Sequential write/read bandwidth (MB/s, 10**6 bytes/s) and random-read IOPS of the disk
    behind ``directory``.

    Method: a temporary file of ``file_bytes`` is written in ``block_bytes`` blocks and
    fsync'ed (the fsync is timed); then read back sequentially; then read at random
    ``io_bytes``-aligned offsets for ``random_seconds`` with one request in flight (queue
    depth 1, like fio ``--iodepth=1``; from Python the per-call cost caps the figure at
    ~100k-300k IOPS). The page cache is bypassed with O_DIRECT (page-aligned mmap buffers)
    where the file system accepts it; otherwise the file's pages are dropped with
    posix_fadvise(POSIX_FADV_DONTNEED) after writing; otherwise reads may come from the page
    cache — ``method`` / ``settings["cache_bypass"]`` say which. The file is deleted afterwards.
    A virtual disk may still be cached by the hypervisor.

    Args:
        directory: an existing directory on the device to test (default: the temp dir).
        file_bytes: test file size in bytes (>= block_bytes). block_bytes: sequential I/O
            size (multiple of io_bytes). random_seconds: duration of the random test (> 0).
        io_bytes: random read size, bytes (multiple of 512). seed: RNG seed.

    Returns:
        dict with :class:`Measurement` s ``"seq_write"`` (MB/s), ``"seq_read"`` (MB/s),
        ``"rand_read"`` (IOPS).

    Raises:
        ValueError: directory missing / not a directory / not writable, bad sizes, or a
            file_bytes above half the directory's free space.
    """
    if directory is None:
        directory = tempfile.gettempdir()
    if not isinstance(directory, (str, os.PathLike)) or not os.path.isdir(directory):
        raise ValueError(f"directory must be an existing directory, got {directory!r}")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"directory must be writable, got {directory!r}")
    io_bytes = check_positive_int("io_bytes", io_bytes, minimum=512)
    if io_bytes % 512:
        raise ValueError(f"io_bytes must be a multiple of 512, got {io_bytes}")
    block_bytes = check_positive_int("block_bytes", block_bytes, minimum=io_bytes)
    if block_bytes % io_bytes:
        raise ValueError(f"block_bytes must be a multiple of io_bytes={io_bytes}, "
                         f"got {block_bytes}")
    file_bytes = check_positive_int("file_bytes", file_bytes, minimum=block_bytes)
    random_seconds = check_positive_float("random_seconds", random_seconds)
    nblocks = file_bytes // block_bytes
    file_bytes = nblocks * block_bytes
    import shutil
    free = shutil.disk_usage(directory).free
    if file_bytes > free // 2:          # never fill the disk (other programs write there too)
        raise ValueError(f"file_bytes={file_bytes} is more than half the free space of "
                         f"{directory!r} ({free} bytes free); pass a smaller file_bytes")

    buf = mmap.mmap(-1, block_bytes)           # page-aligned, as O_DIRECT requires
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(
        0, 256, block_bytes, dtype=np.uint8)   # incompressible data
    small = mmap.mmap(-1, max(io_bytes, mmap.PAGESIZE))
    fd_dir = tempfile.mkstemp(prefix="hybridl_io_", dir=directory)
    os.close(fd_dir[0])
    path = fd_dir[1]
    results = {}
    try:
        fd, direct_w = _open_direct(path, os.O_WRONLY | os.O_TRUNC)
        try:
            t0 = time.perf_counter()
            for _ in range(nblocks):
                os.write(fd, buf)
            os.fsync(fd)
            tw = time.perf_counter() - t0
            dropped = _drop_cache(fd)
        finally:
            os.close(fd)
        fd, direct_r = _open_direct(path, os.O_RDONLY)
        if not direct_r:
            dropped = _drop_cache(fd) or dropped
        bypass = ("O_DIRECT" if direct_r else
                  "posix_fadvise(DONTNEED)" if dropped else "none (page cache may serve reads)")
        try:
            t0 = time.perf_counter()
            for i in range(nblocks):
                os.preadv(fd, [buf], i * block_bytes)
            tr = time.perf_counter() - t0
            if not direct_r:
                _drop_cache(fd)
            rng = np.random.default_rng(seed)
            offs = (rng.integers(0, file_bytes // io_bytes, 1 << 16) * io_bytes).tolist()
            view = memoryview(small)[:io_bytes]
            ios, lat = 0, []
            t0 = time.perf_counter()
            deadline = t0 + random_seconds
            while True:
                off = offs[ios % len(offs)]
                os.preadv(fd, [view], off)
                ios += 1
                if ios % 256 == 0:
                    now = time.perf_counter()
                    lat.append(now)
                    if now >= deadline:
                        break
            trand = time.perf_counter() - t0
            view.release()
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        buf.close()
        small.close()
    settings = {"directory": os.path.abspath(directory), "file_bytes": file_bytes,
                "block_bytes": block_bytes, "cache_bypass": bypass,
                "o_direct_write": direct_w, "o_direct_read": direct_r}
    # per-chunk IOPS (256 I/Os per chunk) for a spread
    chunks = [256 / (b - a) for a, b in zip(lat, lat[1:]) if b > a]
    results["seq_write"] = Measurement(
        "seq_write", file_bytes / tw / 1e6, "MB/s",
        f"sequential {block_bytes // _MiB} MiB writes + fsync, "
        f"{'O_DIRECT' if direct_w else 'buffered'}", dict(settings, seconds=tw))
    results["seq_read"] = Measurement(
        "seq_read", file_bytes / tr / 1e6, "MB/s",
        f"sequential {block_bytes // _MiB} MiB reads, cache bypass: {bypass}",
        dict(settings, seconds=tr))
    results["rand_read"] = Measurement(
        "rand_read", ios / trand, "IOPS",
        f"random {io_bytes // 1024} KiB preadv, queue depth 1, cache bypass: {bypass}",
        dict(settings, io_bytes=io_bytes, ios=ios, seconds=trand, queue_depth=1),
        samples=chunks,
        details={"mean_latency_us": trand / ios * 1e6,
                 "median_chunk_iops": median(chunks) if chunks else None})
    return results
