"""Memory microbenchmarks: STREAM bandwidth and pointer-chasing latency (with cache knees)."""
from __future__ import annotations

import math
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _chase
from ._records import Measurement, check_positive_float, check_positive_int, median

__all__ = ["measure_memory_bandwidth", "measure_memory_latency", "detect_cache_levels",
           "compare_cache_levels"]

_KiB, _MiB, _GiB = 1024, 1024**2, 1024**3
_DEFAULT_LLC = 32 * _MiB  # assumed when the probe does not know the last-level cache
_TRIAD_CHUNK = 32768      # elements; the triad's temporary stays in L2
_SWEEP_MAX = 64 * _MiB    # larger working sets are swept once (they are DRAM-bound anyway)
_HUGE = 2 * 1024 * 1024
_WINDOW_S = 0.001         # latency: length of one timed window, seconds   # transparent huge page size on x86-64 / most arm64


def _llc_bytes(probe_info) -> int | None:
    if probe_info is None:
        try:
            from .probe import probe
            probe_info = probe(gpus=False)
        except Exception:
            return None
    llc = probe_info.last_level_cache
    return llc.size_bytes if llc else None


# ----------------------------------------------------------------------------- bandwidth

# STREAM kernels (McCalpin) and the bytes STREAM counts per element (8-byte doubles):
#   copy:  c = a          2 x 8   (read a, write c)
#   scale: b = q*c        2 x 8
#   add:   c = a + b      3 x 8
#   triad: a = b + q*c    3 x 8
_STREAM_WORDS = {"copy": 2, "scale": 2, "add": 3, "triad": 3}


def _stream_kernel(name, a, b, c, q, tmp):
    if name == "copy":
        np.copyto(c, a)
    elif name == "scale":
        np.multiply(c, q, out=b)
    elif name == "add":
        np.add(a, b, out=c)
    else:  # triad, chunked so that q*c lives in a cache-resident temporary
        n = a.shape[0]
        for i in range(0, n, _TRIAD_CHUNK):
            j = min(i + _TRIAD_CHUNK, n)
            t = tmp[: j - i]
            np.multiply(c[i:j], q, out=t)
            np.add(b[i:j], t, out=a[i:j])


def measure_memory_bandwidth(array_bytes: int | None = None, threads: int = 1, repeats: int = 5,
                             kernels=("copy", "scale", "add", "triad"),
                             probe_info=None) -> dict:
    """Sustained memory bandwidth with the four STREAM kernels, in GB/s (10**9 bytes/s).

    Method (McCalpin 1995, "Memory Bandwidth and Machine Balance in Current High Performance
    Computers", IEEE TCCA Newsletter; https://www.cs.virginia.edu/stream/): three float64 arrays
    a, b, c of ``array_bytes`` each; copy ``c=a``, scale ``b=q*c``, add ``c=a+b``, triad
    ``a=b+q*c``. Bytes are counted the STREAM way: 16 bytes per element for copy/scale, 24 for
    add/triad; write-allocate traffic is not counted (as in STREAM). Copy/scale/add are one
    NumPy call each; triad runs in cache-sized chunks so the product ``q*c`` stays in cache
    and main-memory traffic is the STREAM 24 bytes/element. With ``threads > 1`` every thread
    runs the kernel on its own contiguous slice (NumPy releases the GIL inside ufuncs) and the
    wall time of all slices is timed. As in STREAM the reported value is the best rate over
    ``repeats`` (the first, cold pass is discarded); ``samples`` holds every rate and
    ``details["median"]`` the median.

    Args:
        array_bytes: size of EACH array in bytes; default max(4 x last-level cache, 32 MiB)
            (STREAM's rule: each array at least 4x the LLC). Must be >= 1 MiB.
        threads: worker threads (>= 1).
        repeats: timed repetitions per kernel (>= 1).
        kernels: subset of ("copy", "scale", "add", "triad").
        probe_info: a :class:`HardwareInfo` (to size arrays); probed if None.

    Returns:
        dict kernel name -> :class:`Measurement` named ``"stream_<kernel>"``, unit ``"GB/s"``.

    Raises:
        ValueError: array_bytes < 1 MiB, threads/repeats < 1, or an unknown kernel name.
    """
    kernels = tuple(kernels)
    for k in kernels:
        if k not in _STREAM_WORDS:
            raise ValueError(f"kernels must be among {tuple(_STREAM_WORDS)}, got {k!r}")
    threads = check_positive_int("threads", threads)
    repeats = check_positive_int("repeats", repeats)
    llc = _llc_bytes(probe_info)
    if array_bytes is None:
        array_bytes = max(4 * (llc or _DEFAULT_LLC), 32 * _MiB)
    array_bytes = check_positive_int("array_bytes", array_bytes, minimum=_MiB)
    n = array_bytes // 8
    a = np.full(n, 1.0)
    b = np.full(n, 2.0)
    c = np.zeros(n)
    q = 3.0
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    slices = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(threads)]
    tmps = [np.empty(_TRIAD_CHUNK) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    rates = {k: [] for k in kernels}
    try:
        for rep in range(repeats + 1):
            for k in kernels:
                t0 = time.perf_counter()
                if pool is None:
                    _stream_kernel(k, a, b, c, q, tmps[0])
                else:
                    futs = [pool.submit(_stream_kernel, k, a[s], b[s], c[s], q, tmps[i])
                            for i, s in enumerate(slices)]
                    for f in futs:
                        f.result()
                dt = time.perf_counter() - t0
                if rep > 0:  # STREAM skips the first iteration
                    rates[k].append(_STREAM_WORDS[k] * 8 * n / dt / 1e9)
    finally:
        if pool is not None:
            pool.shutdown()
    out = {}
    for k in kernels:
        out[k] = Measurement(
            name=f"stream_{k}", value=max(rates[k]), unit="GB/s",
            method=("STREAM (McCalpin 1995) byte counting, NumPy kernels, best of repeats; "
                    + ("triad chunked through a cache-resident temporary" if k == "triad"
                       else "one ufunc call")),
            settings={"array_bytes": n * 8, "elements": n, "dtype": "float64",
                      "threads": threads, "repeats": repeats,
                      "bytes_per_element": _STREAM_WORDS[k] * 8, "llc_bytes": llc},
            samples=rates[k], details={"median": median(rates[k])})
    return out


# ----------------------------------------------------------------------------- latency

def _alloc(nbytes: int, huge_pages: bool):
    """Anonymous mmap of nbytes (page-rounded), optionally advised to use huge pages."""
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    mm = mmap.mmap(-1, size + _HUGE)
    advised = False
    if huge_pages and hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError:
            pass
    whole = np.frombuffer(mm, dtype=np.uint64)
    # start on a 2 MiB boundary: small working sets then lie in one (physically contiguous)
    # huge page, so cache sets are used evenly instead of by the luck of 4 KiB page colours
    skip = (-whole.ctypes.data) % _HUGE
    arr = whole[skip // 8: (skip + size) // 8]
    del whole
    arr[:: mmap.PAGESIZE // 8] = 0  # touch every page
    return mm, arr, advised


def _build_chain(arr, nbytes, stride, order, rng, absolute):
    """Write a single cycle over nbytes//stride nodes (one per ``stride`` bytes) into arr.
    Returns the start (address if ``absolute`` else element index) and the node count."""
    n = nbytes // stride
    if order == "random":
        p = rng.permutation(n)          # visiting order; one cycle through every node
    else:
        p = np.arange(n)
    step = stride // 8
    nxt = np.roll(p, -1).astype(np.uint64) * np.uint64(step)
    target = np.empty(n, dtype=np.uint64)
    target[p] = nxt                     # node p[i] points at node p[i+1]
    if absolute:
        target *= np.uint64(8)
        target += np.uint64(arr.ctypes.data)
        start = int(arr.ctypes.data)
    else:
        start = 0
    arr[: n * step: step] = target
    return start, n


def _time_chase(fn, mv, start, steps):
    """Follow ``steps`` pointers from ``start``; returns (seconds, position reached). The
    caller continues from the returned position, so that every load's reuse distance is the
    whole cycle (restarting at ``start`` would re-read the same, now cached, prefix)."""
    if fn is not None:
        t0 = time.perf_counter()
        p = fn(start, steps)
        return time.perf_counter() - t0, p
    i = start
    t0 = time.perf_counter()
    for _ in range(steps):
        i = mv[i]
    return time.perf_counter() - t0, i


def _default_sizes(min_bytes, max_bytes, points_per_octave):
    sizes = []
    k = 0
    while True:
        s = int(round(min_bytes * 2 ** (k / points_per_octave)))
        s = max(256, s // 256 * 256)
        if s > max_bytes:
            break
        if s > _SWEEP_MAX and k % points_per_octave:
            k += 1
            continue
        if not sizes or s != sizes[-1]:
            sizes.append(s)
        k += 1
    return sizes


def measure_memory_latency(max_bytes: int | None = None, min_bytes: int = 4 * _KiB,
                           points_per_octave: int = 2, sizes=None,
                           orders=("random", "sequential"), stride: int | None = None,
                           target_seconds: float = 0.02, repeats: int = 3,
                           huge_pages: bool = True, method: str | None = None, seed: int = 0,
                           probe_info=None, progress=None) -> Measurement:
    """Load-to-use memory latency by pointer chasing, in nanoseconds per dependent load.

    Method (lmbench ``lat_mem_rd``, McVoy & Staelin 1996; Drepper, "What Every Programmer
    Should Know About Memory", 2007): for each working-set size W the buffer holds W/stride
    nodes (one per cache line), linked into ONE cycle, visited either in a random order (a
    random cyclic permutation: every load misses unless the whole set fits in a cache, and the
    hardware prefetcher cannot guess the next address) or in sequential order (node i -> i+1,
    the prefetcher's best case: the "burst" figure). Each load's address is the value of the
    previous load, so loads cannot overlap: time/steps is the latency. The chase runs in native
    code (see :mod:`hybridl.hardware._chase`): 12 bytes of x86-64 machine code in an executable
    mmap page called through ctypes, else a C compiler, else a Python loop with its own cost
    subtracted (then only latencies well above ~30 ns are meaningful). Huge pages are requested
    (MADV_HUGEPAGE) so that TLB misses do not masquerade as cache levels; under a hypervisor,
    nested page walks still add to the largest sizes. The whole curve is swept ``repeats``
    times (a fresh random cycle each sweep) and each point is the minimum over sweeps, and
    over ~1 ms windows within ``target_seconds`` per sweep: interference from other processes only adds time, and spreading
    a point's samples in time keeps one burst of it from spoiling the point (sizes above
    64 MiB, far beyond the caches, are measured in the first sweep only, and by default at one
    size per octave: building a random cycle over 1 GiB takes seconds).

    Limits: includes ~1 cycle of loop overhead per step; the random chase also pays TLB misses
    for sets larger than the TLB reach; a cache shared with other tenants (VMs) has a smaller
    effective size than the probe reports.

    Args:
        max_bytes: largest working set in bytes (default 1 GiB); min_bytes: smallest (4 KiB).
        points_per_octave: sizes per doubling (>= 1) between min_bytes and max_bytes.
        sizes: explicit working-set sizes in bytes (overrides the three above).
        orders: subset of ("random", "sequential").
        stride: bytes between nodes; default the probed cache line size (64 if unknown).
        target_seconds: time per timed run (> 0). repeats: sweeps over the curve (>= 1).
        huge_pages: request transparent huge pages. method: force a chase kernel
            ("x86_64-machine-code", "c-compiler", "python-loop"). seed: RNG seed.
        probe_info: :class:`HardwareInfo` (line size, cache sizes to compare with).
        progress: optional callable(fraction_done) for progress bars.

    Returns:
        :class:`Measurement` ``"memory_latency"`` (unit ``"ns"``), value = random-order
        latency at the largest working set; ``details`` holds ``sizes_bytes``, ``random_ns``,
        ``sequential_ns`` (lists aligned with sizes), ``cache_levels`` (knees detected by
        :func:`detect_cache_levels`) and ``compared_with_probe`` (see
        :func:`compare_cache_levels`).

    Raises:
        ValueError: non-positive or no sizes, min_bytes > max_bytes, stride not a multiple of 8,
            unknown order or method.
    """
    orders = tuple(orders)
    for o in orders:
        if o not in ("random", "sequential"):
            raise ValueError(f"orders must be among ('random', 'sequential'), got {o!r}")
    if method not in (None, "x86_64-machine-code", "c-compiler", "python-loop"):
        raise ValueError("method must be None, 'x86_64-machine-code', 'c-compiler' or "
                         f"'python-loop', got {method!r}")
    repeats = check_positive_int("repeats", repeats)
    target_seconds = check_positive_float("target_seconds", target_seconds)
    if probe_info is None:
        try:
            from .probe import probe
            probe_info = probe(gpus=False)
        except Exception:
            probe_info = None
    if stride is None:
        l1 = probe_info.cache(1) if probe_info else None
        stride = (l1.line_size_bytes if l1 and l1.line_size_bytes else 64)
    stride = check_positive_int("stride", stride, minimum=8)
    if stride % 8:
        raise ValueError(f"stride must be a multiple of 8 bytes, got {stride!r}")
    if sizes is None:
        max_bytes = check_positive_int("max_bytes", _GiB if max_bytes is None else max_bytes)
        min_bytes = check_positive_int("min_bytes", min_bytes)
        points_per_octave = check_positive_int("points_per_octave", points_per_octave)
        if min_bytes > max_bytes:
            raise ValueError(f"min_bytes must be <= max_bytes, got {min_bytes} > {max_bytes}")
        sizes = _default_sizes(min_bytes, max_bytes, points_per_octave)
    else:
        sizes = sorted(check_positive_int("sizes[i]", s) for s in sizes)
        if not sizes:
            raise ValueError("sizes: expected at least one working-set size (bytes), got none")
    sizes = [max(s // stride, 2) * stride for s in sizes]

    if method == "python-loop":
        fn, used = None, "python-loop"
    else:
        fn, used = _chase.get_kernel(method)
    rng = np.random.default_rng(seed)
    mm, arr, advised = _alloc(max(sizes), huge_pages)
    mv = memoryview(mm).cast("Q") if fn is None else None
    samples = {o: [[] for _ in sizes] for o in orders}
    overhead = {}
    big = sum(1 for ws in sizes if ws > _SWEEP_MAX)
    total = (len(sizes) * repeats - big * (repeats - 1)) * len(orders)
    done = 0
    try:
        if fn is None:  # cost of the Python loop itself, on an L1-resident chain
            for order in orders:
                start, n = _build_chain(arr, min(sizes[0], 4 * _KiB), stride, order, rng, False)
                overhead[order] = min(_time_chase(None, mv, start, 200_000)[0]
                                      for _ in range(3)) / 200_000
        # `repeats` sweeps over all sizes: the samples of one size are spread in time, so a
        # burst of activity from other processes spoils one sample, not all of them
        for sweep in range(repeats):
            for order in orders:
                for k, ws in enumerate(sizes):
                    if sweep > 0 and ws > _SWEEP_MAX:
                        continue  # far beyond any cache: one sample suffices
                    start, n = _build_chain(arr, ws, stride, order, rng, fn is not None)
                    _, pos = _time_chase(fn, mv, start, min(n, 200_000 if fn else 100_000))
                    t, pos = _time_chase(fn, mv, pos, 2000)
                    est = max(t / 2000, 1e-10)
                    # several short windows, keep the fastest: a window in which this
                    # process was preempted or its caches were flushed by a neighbour is slow
                    window = min(target_seconds, _WINDOW_S)
                    steps = int(min(max(window / est, 1000), 5e8 if fn else 2e6))
                    nwin = max(1, int(round(target_seconds / window)))
                    t = math.inf
                    for _ in range(nwin):
                        dt, pos = _time_chase(fn, mv, pos, steps)
                        t = min(t, dt / steps)
                    if fn is None:
                        t = max(t - overhead[order], 0.0)
                    samples[order][k].append(t * 1e9)
                    done += 1
                    if progress is not None:
                        progress(done / total)
        results = {o: [min(v) for v in samples[o]] for o in orders}
    finally:
        del arr
        if mv is not None:
            mv.release()
        try:
            mm.close()
        except BufferError:
            pass
    details = {"sizes_bytes": sizes,
               "random_ns": results.get("random"), "sequential_ns": results.get("sequential")}
    curve = results.get("random") or results.get("sequential")
    levels = detect_cache_levels(sizes, curve)
    details["cache_levels"] = levels
    details["compared_with_probe"] = compare_cache_levels(levels, probe_info)
    if fn is None:
        details["overhead_subtracted_ns"] = {k: v * 1e9 for k, v in overhead.items()}
    main = "random" if "random" in results else orders[0]
    return Measurement(
        name="memory_latency", value=results[main][-1], unit="ns",
        method=(f"pointer chasing, one {main}-order cycle of dependent loads, chase kernel: "
                f"{used}; minimum over sweeps"),
        settings={"min_bytes": sizes[0], "max_bytes": sizes[-1], "stride_bytes": stride,
                  "orders": list(orders), "target_seconds": target_seconds,
                  "repeats": repeats, "huge_pages_requested": advised, "seed": seed,
                  "kernel": used},
        samples=list(results[main]), details=details)


def _isotonic(y):
    """Pool-adjacent-violators: the non-decreasing sequence closest to y (least squares)."""
    blocks = []  # [sum, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out = []
    for s, c in blocks:
        out += [s / c] * c
    return out


def _segments(y, penalty):
    """Optimal piecewise-constant fit of y (segmented least squares, Bellman 1961): minimize
    sum of squared errors + penalty x number of segments. Returns [(start, stop), ...]."""
    n = len(y)
    pre = np.concatenate([[0.0], np.cumsum(y)])
    pre2 = np.concatenate([[0.0], np.cumsum(np.square(y))])

    def sse(i, j):  # points i..j-1
        m = j - i
        s1 = pre[j] - pre[i]
        return (pre2[j] - pre2[i]) - s1 * s1 / m

    best = [0.0] + [math.inf] * n
    back = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + sse(i, j) + penalty
            if c < best[j]:
                best[j], back[j] = c, i
    segs, j = [], n
    while j > 0:
        segs.append((back[j], j))
        j = back[j]
    return segs[::-1]


def detect_cache_levels(sizes, latencies_ns, min_jump: float = 1.5, min_points: int = 3,
                        penalty: float = 0.05, cache_latency_limit_ns: float = 60.0) -> list:
    """Find the knees of a latency-vs-working-set curve; each knee is a cache capacity.

    Algorithm: (1) smooth log(latency) with isotonic regression (latency cannot fall as the
    working set grows; this removes isolated spikes from interference); (2) fit a
    piecewise-constant function to it by segmented least squares (Bellman 1961) with
    ``penalty`` per segment (in squared log units); segments of at least ``min_points``
    points are plateaus (cache levels), shorter ones are points in a transition; (3) between
    consecutive plateaus whose mean latencies differ by >= ``min_jump`` x, the knee is the
    working set at which the smoothed curve crosses the arithmetic mean of the two plateau
    latencies, i.e. where about half of the loads miss the smaller level (log-log
    interpolation between measured points; cf. Saavedra & Smith 1995, lmbench). A knee whose lower plateau is already slower than
    ``cache_latency_limit_ns`` is labelled ``"tlb_or_dram"`` (page walks, NUMA), otherwise
    ``"cache"``.

    Args:
        sizes: working sets in bytes, increasing. latencies_ns: latency per size (ns).

    Returns:
        list of dicts ``{"size_bytes", "latency_before_ns", "latency_after_ns", "kind"}``,
        smallest first.

    Raises:
        ValueError: lengths differ, or sizes are not increasing and positive.
    """
    if latencies_ns is None:
        return []
    sizes = [int(s) for s in sizes]
    lat = [float(v) for v in latencies_ns]
    if len(sizes) != len(lat):
        raise ValueError(f"sizes and latencies_ns must have the same length, got "
                         f"{len(sizes)} and {len(lat)}")
    if any(s <= 0 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError("sizes must be positive and strictly increasing")
    if len(sizes) < 2:
        return []
    y = _isotonic([math.log(max(v, 1e-3)) for v in lat])
    plateaus = [(i, j) for i, j in _segments(y, penalty) if j - i >= min_points]
    levels = []
    for (i0, j0), (i1, j1) in zip(plateaus, plateaus[1:]):
        a = float(np.mean(y[i0:j0]))
        b = float(np.mean(y[i1:j1]))
        if b - a < math.log(min_jump):
            continue
        mid = math.log((math.exp(a) + math.exp(b)) / 2)  # half the loads miss
        knee = None
        for i in range(j0 - 1, i1 + 1):
            if y[i] >= mid:
                j = i - 1
                if j < 0 or y[i] == y[j]:
                    knee = sizes[i]
                else:
                    f = (mid - y[j]) / (y[i] - y[j])
                    knee = math.exp(math.log(sizes[j]) + f * (math.log(sizes[i]) -
                                                              math.log(sizes[j])))
                break
        if knee is None:
            continue
        la, lb = math.exp(a), math.exp(b)
        levels.append({"size_bytes": int(knee), "latency_before_ns": la,
                       "latency_after_ns": lb,
                       "kind": "cache" if la < cache_latency_limit_ns else "tlb_or_dram"})
    return levels


def compare_cache_levels(levels, probe_info) -> list:
    """Pair each probed data/unified cache with a detected ``"cache"`` knee: in order of
    level when there are as many knees as levels, else the nearest knee (in log size).

    Returns a list of ``{"level", "probed_bytes", "detected_bytes", "ratio"}`` (ratio =
    detected / probed; None when nothing was detected or the probe does not know the size).
    """
    if probe_info is None:
        return []
    knees = sorted(lv["size_bytes"] for lv in levels if lv.get("kind") == "cache")
    caches = sorted((c for c in probe_info.caches
                     if c.type in ("Data", "Unified") and c.size_bytes and c.level),
                    key=lambda c: c.level)
    out = []
    for i, c in enumerate(caches):
        if len(knees) == len(caches):  # one knee per level: pair them in order
            det = knees[i]
        else:
            det = min(knees, key=lambda k: abs(math.log(k / c.size_bytes))) if knees else None
        out.append({"level": c.level, "probed_bytes": c.size_bytes, "detected_bytes": det,
                    "ratio": (det / c.size_bytes) if det else None,
                    "shared_by_cpus": c.shared_by_cpus})
    return out
