"""Compute microbenchmarks: GEMM throughput per BLAS thread count, fp32/fp64; scalar Python."""
from __future__ import annotations

import os
import time

import numpy as np

from ._records import Measurement, check_positive_int, median

__all__ = ["measure_gemm", "measure_scalar_gemm", "gemm_flops"]


def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOPs of C = A @ B with A (m, k), B (k, n): 2*m*n*k (one multiply + one add per term;
    the usual LINPACK/BLAS counting)."""
    return 2 * int(m) * int(n) * int(k)


def _blas_limits(threads):
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=threads, user_api="blas")


def measure_gemm(n: int = 1024, dtype="float32", threads=None, repeats: int = 5,
                 min_seconds: float = 0.0) -> list:
    """Matrix-multiply throughput of NumPy's BLAS (``A @ B``, square n x n), in GFLOP/s.

    Method: FLOPs = 2 n^3 (:func:`gemm_flops`); ``out=`` is preallocated so allocation is not
    timed; BLAS threads are set with threadpoolctl for each entry of ``threads``; one untimed
    warm-up call, then ``repeats`` timed calls; value = median rate (``samples`` has all).
    If ``min_seconds`` > 0, each sample repeats the product until that much time has passed.

    Args:
        n: matrix order (>= 1). dtype: "float32" or "float64".
        threads: int or list of ints (BLAS threads); default [1, 2, 4, ... up to usable CPUs].
        repeats: timed samples (>= 1). min_seconds: minimum time per sample, seconds.

    Returns:
        list of :class:`Measurement` named ``"gemm_fp32"`` / ``"gemm_fp64"``, unit
        ``"GFLOP/s"``, one per thread count (``settings["threads"]``).

    Raises:
        ValueError: n or repeats < 1, a thread count < 1 or none, min_seconds < 0, or dtype not
            float32/float64.
    """
    n = check_positive_int("n", n)
    repeats = check_positive_int("repeats", repeats)
    dt = np.dtype(dtype) if dtype in ("float32", "float64", np.float32, np.float64) else None
    if dt is None:
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if threads is None:
        try:
            ncpu = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            ncpu = os.cpu_count() or 1
        threads, t = [], 1
        while t < ncpu:
            threads.append(t)
            t *= 2
        threads.append(ncpu)
    elif isinstance(threads, int):
        threads = [threads]
    threads = [check_positive_int("threads[i]", t) for t in threads]
    if not threads:
        raise ValueError("threads: expected at least one BLAS thread count, got none")
    if isinstance(min_seconds, bool) or not isinstance(min_seconds, (int, float)) \
            or not min_seconds >= 0:
        raise ValueError(f"min_seconds: expected a number of seconds >= 0, got {min_seconds!r}")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dt)
    b = rng.standard_normal((n, n)).astype(dt)
    c = np.empty((n, n), dtype=dt)
    flops = gemm_flops(n, n, n)
    out = []
    for t in threads:
        with _blas_limits(t):
            np.matmul(a, b, out=c)
            rates = []
            for _ in range(repeats):
                count = 0
                t0 = time.perf_counter()
                while True:
                    np.matmul(a, b, out=c)
                    count += 1
                    el = time.perf_counter() - t0
                    if el >= min_seconds:
                        break
                rates.append(flops * count / el / 1e9)
        tag = "fp32" if dt == np.float32 else "fp64"
        out.append(Measurement(
            name=f"gemm_{tag}", value=median(rates), unit="GFLOP/s",
            method="NumPy matmul (BLAS sgemm/dgemm), 2n^3 FLOPs, median of repeats, "
                   "threads set with threadpoolctl",
            settings={"n": n, "dtype": dt.name, "threads": t, "repeats": repeats,
                      "min_seconds": min_seconds},
            samples=rates))
    return out


def measure_scalar_gemm(n: int = 48, repeats: int = 3) -> Measurement:
    """The same matrix product written as a scalar Python triple loop, in GFLOP/s.

    It shows the cost of the interpreter (one bytecode dispatch per multiply-add) against the
    vectorized BLAS figure of :func:`measure_gemm`. FLOPs = 2 n^3; value = median rate.

    Raises:
        ValueError: n or repeats < 1.
    """
    n = check_positive_int("n", n)
    repeats = check_positive_int("repeats", repeats)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).tolist()
    b = rng.standard_normal((n, n)).tolist()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = [[0.0] * n for _ in range(n)]
        for i in range(n):
            ai, ci = a[i], c[i]
            for k in range(n):
                aik, bk = ai[k], b[k]
                for j in range(n):
                    ci[j] += aik * bk[j]
        rates.append(gemm_flops(n, n, n) / (time.perf_counter() - t0) / 1e9)
    return Measurement(name="gemm_scalar_python", value=median(rates), unit="GFLOP/s",
                       method="pure-Python i-k-j triple loop over lists of floats (float64), "
                              "2n^3 FLOPs, median of repeats",
                       settings={"n": n, "dtype": "float64", "threads": 1, "repeats": repeats},
                       samples=rates)
