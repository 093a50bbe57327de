"""Shared timing helpers for the benchmark scripts.

``bench`` times several candidates side by side: every candidate is warmed up, then the
samples are taken in interleaved rounds (A, B, C, A, B, C, ...) so that the load of a shared
machine hits all candidates alike; the figure reported is the median of >= 20 samples. A
sample is the wall time of ``inner`` consecutive calls divided by ``inner``.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

__all__ = ["bench", "print_table", "fmt_time", "machine_line"]


def bench(cands, reps=30, inner=1, warmup=3, rounds=5):
    """Median seconds per call of each candidate.

    Args:
        cands: dict name -> callable with no arguments, or (callable, setup) where ``setup()``
            runs untimed before each group of samples (e.g. to select an engine); ``None``
            values are skipped.
        reps (int): samples per candidate (>= 20 for reported figures).
        inner (int): calls per sample (raise it for calls of a few microseconds).
        warmup (int): untimed samples per candidate before the first round.
        rounds (int): interleaved rounds the samples are split into.

    Returns:
        dict name -> {"median": s, "q1": s, "q3": s, "n": samples} (seconds per call).
    """
    cands = {k: (f if isinstance(f, tuple) else (f, None)) for k, f in cands.items()
             if f is not None}
    samples = {k: [] for k in cands}
    for f, setup in cands.values():
        if setup is not None:
            setup()
        for _ in range(warmup * inner):
            f()
    per = max(1, -(-reps // rounds))
    for _ in range(rounds):
        for k, (f, setup) in cands.items():
            if setup is not None:
                setup()
            s = samples[k]
            for _ in range(per):
                t0 = time.perf_counter()
                for _ in range(inner):
                    f()
                s.append((time.perf_counter() - t0) / inner)
    out = {}
    for k, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
        out[k] = {"median": statistics.median(s), "q1": q[0], "q3": q[2], "n": len(s)}
    return out


def fmt_time(s):
    """Seconds as a short string in us / ms / s."""
    if s < 1e-3:
        return f"{s * 1e6:8.2f} us"
    if s < 1.0:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.3f} s "


def print_table(title, res, baseline=None, note=None):
    """Print ``res`` (from :func:`bench`) as a table: median, interquartile range, and the ratio
    to ``baseline`` (a key of ``res``; default the first row)."""
    if not res:
        return
    base = res[baseline if baseline is not None else next(iter(res))]["median"]
    bname = baseline if baseline is not None else next(iter(res))
    w = max(len(k) for k in res) + 2
    print(f"\n== {title}")
    if note:
        print(f"   {note}")
    print(f"   {'':{w}}{'median':>12} {'q1..q3':>23} {'ratio vs ' + bname:>20}  (n)")
    for k, r in res.items():
        iqr = f"{fmt_time(r['q1']).strip()}..{fmt_time(r['q3']).strip()}"
        print(f"   {k:{w}}{fmt_time(r['median']):>12} {iqr:>23} {r['median'] / base:>19.2f}x  ({r['n']})")


def machine_line():
    """One line describing the machine and the process settings that matter for timings."""
    try:
        load = ", load avg %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = ""
    return (f"{platform.python_implementation()} {platform.python_version()}, "
            f"{os.cpu_count()} logical CPUs{load}")
