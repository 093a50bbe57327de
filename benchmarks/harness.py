"""Shared benchmark helpers: the timing protocol of ../shared/bench/peers.py (warm-up, >= 20
repetitions of `inner` calls, median), running the peers' jobs (PyTorch, JAX, NumPy by hand)
from that script in subprocesses, and printing side-by-side tables with ratios.

The machine is shared and noisy: run each benchmark twice and quote medians.
"""
import os
import statistics
import subprocess
import sys
import time

REPS = int(os.environ.get("BENCH_REPS", "20"))
HERE = os.path.dirname(os.path.abspath(__file__))


def bench(fn, inner=1, reps=REPS, warmup=3, max_s=40.0):
    """Median seconds per call of ``fn`` (each repetition times ``inner`` calls)."""
    for _ in range(warmup):
        for _ in range(inner):
            fn()
    ts = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t0) / inner)
        if time.perf_counter() - start > max_s and len(ts) >= 5:
            break
    return statistics.median(ts)


def peers_script():
    """Path of the peers' benchmark script (../shared/bench/peers.py), or None."""
    cands = [os.environ.get("HYBRIDL_PEERS", ""),
             os.path.join(HERE, "..", "..", "shared", "bench", "peers.py"),
             os.path.join(HERE, "..", "shared", "bench", "peers.py")]
    for c in cands:
        if c and os.path.exists(c):
            return os.path.abspath(c)
    return None


def run_peer(job, arg, timeout=600):
    """Median milliseconds of a peers.py job (e.g. ('mlp_infer', 'torch_eager')), or None when
    the script or the framework is not available. Runs in a subprocess, as peers.py does."""
    script = peers_script()
    if script is None:
        return None
    base = arg.split("@")[0]
    if base.startswith("torch") and not _has("torch"):
        return None
    if base.startswith("jax") and not _has("jax"):
        return None
    import importlib.util
    spec = importlib.util.spec_from_file_location("_peers", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.run_job(job, arg, timeout=timeout)
    if "timing" in r:
        return r["timing"]["median_ms"]
    if "median_ms" in r:
        return r["median_ms"]
    return None


def _has(mod):
    import importlib.util
    return importlib.util.find_spec(mod) is not None


def table(title, rows, ref=None):
    """Print rows of (name, ms) with each time's ratio to ``ref`` (a name) when given."""
    print(f"\n== {title} ==")
    refv = dict(rows).get(ref) if ref else None
    for name, ms in rows:
        if ms is None:
            print(f"  {name:34s} {'n/a':>10s}")
            continue
        ratio = f"  {ms / refv:6.2f}x {ref}" if refv else ""
        print(f"  {name:34s} {ms:10.4f} ms{ratio}")
