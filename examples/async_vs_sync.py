"""Asynchronous computation: the frontend keeps working while the engine computes.

Reproduces the experiment of d2l.ai, "Asynchronous Computation" (section 13.2): a loop of N
iterations, each pushing two ops (``tanh(dot(x, w))``) *and* doing some Python work of its own in the
frontend (here: a pure-Python loop). Three times are measured:

* t1 — the frontend's own Python work (the loop with the ops left out);
* t2 — the compute (the ops alone, run synchronously);
* t3 — the final wait (``waitall()`` after the loop) — what is still left to compute when the
  frontend is done.

With the threaded engine the ops run on the device's worker thread while the frontend does its
Python work (BLAS releases the GIL), so the total approaches ``t1 + t3`` (and ``max(t1, t2)``);
with the naive engine (``HYBRIDL_ENGINE=naive``, synchronous) every op runs at its line and the
total is ``t1 + t2 + t3`` (t3 is then ~0: nothing is left to wait for).

BLAS is limited to 1 thread so that the worker and the frontend each have a core (2 cores).

    python examples/async_vs_sync.py [--iters 60] [--n 384] [--work 40000] [--repeat 3]
"""
import argparse
import contextlib
import os
import statistics
import time

import numpy as np

import hybridl as hl


def python_work(k):
    """Frontend work that holds the GIL: a pure-Python loop of ``k`` additions."""
    s = 0
    for i in range(k):
        s += i
    return s


def loop(x, w, iters, work, ops=True):
    """The measured program: ``iters`` times (push ``x <- tanh(x @ w)``, then Python work).
    Returns the last array (not waited for)."""
    for _ in range(iters):
        if ops:
            x = hl.nd.tanh(hl.nd.dot(x, w))
        if work:
            python_work(work)
    return x


def measure(engine, x, w, iters, work):
    """One run with ``engine``: (loop seconds, final wait seconds)."""
    cur = hl.engine.get_engine()
    scope = contextlib.nullcontext() if cur.name == engine else hl.engine.set_engine(engine)
    with scope:
        hl.waitall()
        t0 = time.perf_counter()
        y = loop(x, w, iters, work)
        t_loop = time.perf_counter() - t0
        y.wait_to_read()
        hl.waitall()
        t_total = time.perf_counter() - t0
    return t_loop, t_total - t_loop






def run(iters=60, n=384, work=40_000, repeat=3, log=print):
    """Run the experiment; returns a dict of median seconds."""
    rng = np.random.default_rng(0)
    x = hl.nd.array(rng.standard_normal((n, n)).astype(np.float32) / n ** 0.5)
    w = hl.nd.array(rng.standard_normal((n, n)).astype(np.float32) / n ** 0.5)
    hl.engine.start_workers([hl.cpu(0)])
    with hl.engine.blas_threads(1):
        loop(x, w, 3, 0).wait_to_read()                 # warm up the worker and BLAS
        t1s, t2s, res = [], [], {"threaded": [], "naive": []}
        for _ in range(repeat):
            t0 = time.perf_counter()
            loop(x, w, iters, work, ops=False)
            t1s.append(time.perf_counter() - t0)
            with hl.engine.set_engine("naive"):
                t0 = time.perf_counter()
                loop(x, w, iters, 0).wait_to_read()
                t2s.append(time.perf_counter() - t0)
            for eng in ("threaded", "naive"):
                res[eng].append(measure(eng, x, w, iters, work))
    t1, t2 = statistics.median(t1s), statistics.median(t2s)
    out = {"t1": t1, "t2": t2}
    log(f"{iters} iterations of (matmul {n}x{n} + tanh) + Python work; median of {repeat}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}:")
    log(f"  t1 frontend Python work alone   {t1:.4f} s")
    log(f"  t2 compute alone (synchronous)  {t2:.4f} s")
    for eng in ("threaded", "naive"):
        loop_t = statistics.median(r[0] for r in res[eng])
        t3 = statistics.median(r[1] for r in res[eng])
        total = statistics.median(r[0] + r[1] for r in res[eng])
        out[eng] = {"loop": loop_t, "t3": t3, "total": total}
        log(f"  {eng:<8} engine: loop {loop_t:.4f} s + t3 final wait {t3:.4f} s = total "
            f"{total:.4f} s   | t1 + t3 = {t1 + t3:.4f} s, t1 + t2 + t3 = {t1 + t2 + t3:.4f} s")
    log(f"  async speedup {out['naive']['total'] / out['threaded']['total']:.2f}x "
        f"(ideal: (t1 + t2) / max(t1, t2) = {(t1 + t2) / max(t1, t2):.2f}x)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=60, help="loop iterations (default 60)")
    p.add_argument("--n", type=int, default=384, help="matrix size (default 384)")
    p.add_argument("--work", type=int, default=40_000,
                   help="Python additions per iteration (default 40000)")
    p.add_argument("--repeat", type=int, default=3, help="runs (median; default 3)")
    a = p.parse_args(argv)
    run(a.iters, a.n, a.work, a.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
