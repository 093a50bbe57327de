"""Automatic parallelism: two independent chains of matmuls on cpu(0) and cpu(1).

Reproduces the experiment of d2l.ai, "Automatic Parallelism" (section 13.3): run a chain of
matrix products on one device, then on the other, then on both at once. Because the two chains
share no data, the dependency engine runs them at the same time on the two devices' worker
threads (NumPy's BLAS releases the GIL), so "both" takes about as long as the slower chain alone,
not the sum. The serial baseline runs both chains on cpu(0) one after the other.

BLAS threads: two workers computing at once each get 1 BLAS thread (the engine's thread budget,
``cores // workers``). The serial run is shown with 1 BLAS thread (like for like) and with all
cores (the best a single queue can do), so the speedup is not an artefact of oversubscription.

    python examples/two_chains.py [--n 512] [--steps 12] [--repeat 5] [--trace two_chains.json]

Prints the median time of each configuration (seconds) and the speedups.
"""
import argparse
import os
import statistics
import time

import numpy as np

import hybridl as hl


def make_inputs(n, device, seed):
    """An (n, n) float32 start matrix and an orthogonal (n, n) weight on ``device`` (so the chain
    neither overflows nor vanishes)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    x = rng.standard_normal((n, n)).astype(np.float32)
    return hl.nd.array(x, device=device), hl.nd.array(q.astype(np.float32), device=device)


def chain(x, w, steps):
    """``steps`` dependent matmuls ``x <- x @ w``; pushed asynchronously, returns the last."""
    for _ in range(steps):
        x = hl.nd.dot(x, w)
    return x


def timed(fn, repeat):
    """Median wall time (seconds) of ``fn()`` over ``repeat`` runs (after one warm-up run)."""
    fn()
    ts = []
    for _ in range(repeat):
        hl.waitall()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)






def run(n=512, steps=12, repeat=5, trace=None, log=print):
    """Run the experiment; returns a dict of median seconds and speedups (and writes ``trace``,
    the Chrome trace of one parallel run, if given)."""
    cores = os.cpu_count() or 1
    d0, d1 = hl.cpu(0), hl.cpu(1)
    hl.engine.start_workers([d0, d1])
    x0, w0 = make_inputs(n, d0, 0)
    x1, w1 = make_inputs(n, d1, 1)
    x1_on0, w1_on0 = x1.copyto(d0), w1.copyto(d0)
    hl.waitall()

    def only0():
        chain(x0, w0, steps).wait_to_read()

    def only1():
        chain(x1, w1, steps).wait_to_read()

    def both():
        a, b = chain(x0, w0, steps), chain(x1, w1, steps)   # pushed at once, run at once
        a.wait_to_read()
        b.wait_to_read()

    def serial():
        a = chain(x0, w0, steps)
        b = chain(x1_on0, w1_on0, steps)                     # same queue: one after the other
        a.wait_to_read()
        b.wait_to_read()

    flops = 2.0 * n ** 3 * steps
    res = {}
    with hl.engine.blas_threads(1):
        res["cpu0"] = timed(only0, repeat)
        res["cpu1"] = timed(only1, repeat)
        res["parallel"] = timed(both, repeat)
        res["serial_1thread"] = timed(serial, repeat)
    with hl.engine.blas_threads(cores):
        res["serial_all_threads"] = timed(serial, repeat)
    res["serial_best"] = min(res["serial_1thread"], res["serial_all_threads"])
    res["speedup_vs_1thread"] = res["serial_1thread"] / res["parallel"]
    res["speedup_vs_best"] = res["serial_best"] / res["parallel"]
    log(f"two chains of {steps} matmuls ({n}x{n} float32, {flops / 1e9:.2f} GFLOP each), "
        f"{cores} cores, median of {repeat}:")
    log(f"  chain on cpu(0) alone          {res['cpu0']:.4f} s")
    log(f"  chain on cpu(1) alone          {res['cpu1']:.4f} s")
    log(f"  both at once (cpu0 || cpu1)     {res['parallel']:.4f} s   "
        f"(sum of the two alone {res['cpu0'] + res['cpu1']:.4f} s)")
    log(f"  one after the other on cpu(0)  {res['serial_1thread']:.4f} s with 1 BLAS thread, "
        f"{res['serial_all_threads']:.4f} s with {cores}")
    log(f"  speedup of parallel: {res['speedup_vs_1thread']:.2f}x vs serial (1 thread), "
        f"{res['speedup_vs_best']:.2f}x vs the best serial")
    if trace:
        with hl.engine.blas_threads(1), hl.profiler.profile() as prof:
            both()
        prof.export_chrome_trace(trace)
        threads = sorted({e.thread for e in prof.events})
        log(f"  trace of one parallel run: {trace} ({len(prof.events)} ops on {', '.join(threads)})")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512, help="matrix size (default 512)")
    p.add_argument("--steps", type=int, default=12, help="matmuls per chain (default 12)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (median; default 5)")
    p.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace")
    a = p.parse_args(argv)
    run(a.n, a.steps, a.repeat, a.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
