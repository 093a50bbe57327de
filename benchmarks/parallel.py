"""Automatic parallelism and engine overhead, side by side in one run (figures are printed, not
asserted).

    python benchmarks/parallel.py [--rounds 11] [--sizes 256,512,1024] [--ops 4000] [--json PATH]

1. Two independent chains of matmuls: *parallel* (chain A on cpu(0), chain B on cpu(1): two
   worker threads) vs *serial* (both chains on cpu(0): one worker, one chain after the other).
   BLAS threads matter on a small machine: two workers computing at once should use
   ``cores // 2`` BLAS threads each (the engine's thread budget), or they oversubscribe the
   cores; the serial run is measured with 1 BLAS thread and with all cores, and the speedup is
   reported against both and against the best serial configuration. Target: >= 1.7x on 2
   cores against the like-for-like serial run.
2. Eager per-op overhead: ``x = x + 1`` on a tiny array, N times, then ``waitall()``: NumPy by
   hand, the threaded engine without and with ``hl.engine.bulk(n)`` (consecutive ops grouped
   into one engine task), with tiny-op inlining turned off (when the engine has it: every op,
   or every group under ``bulk``, handed to the worker thread: there bulking shows what it
   saves), and the naive (synchronous) engine. Microseconds per op
   (total) and microseconds per op spent in the frontend's loop (push).

3. Multi-branch network (hl.models.inception_net) hybridized, inference: one compiled program
   vs the program split into parallel segments (``hybridize(parallel_segments=True)``, two
   workers per device). Target: >= 1.3x at a batch where the branches are compute-heavy.
"cores busy" is the process CPU time over the wall time of a run (median): about 2 when the two
workers really compute at once on 2 free cores; near 1 when other processes hold the cores (then
no speedup is possible and the figures say so). It also counts OpenBLAS threads that spin-wait
for a while after a multi-threaded GEMM, so read it as an upper bound on useful work.

Every figure is the median over ``--rounds`` rounds; within a round the configurations are
run one after the other, so the slowly varying load of a shared machine hits them alike.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybridl as hl  # noqa: E402

CORES = os.cpu_count() or 1






# ============================================================================ 1. two chains

def _inputs(n, device, seed):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))          # orthogonal: no overflow
    x = rng.standard_normal((n, n)).astype(np.float32)
    return hl.nd.array(x, device=device), hl.nd.array(q.astype(np.float32), device=device)


def _chain(x, w, steps):
    for _ in range(steps):
        x = hl.nd.dot(x, w)
    return x


def two_chains(n, steps, rounds):
    """Median seconds per configuration for two chains of ``steps`` (n, n) matmuls."""
    d0, d1 = hl.cpu(0), hl.cpu(1)
    xa, wa = _inputs(n, d0, 0)
    xb, wb = _inputs(n, d1, 1)
    xb0, wb0 = xb.copyto(d0), wb.copyto(d0)
    hl.waitall()

    def parallel():
        a, b = _chain(xa, wa, steps), _chain(xb, wb, steps)
        a.wait_to_read()
        b.wait_to_read()

    def serial():
        a, b = _chain(xa, wa, steps), _chain(xb0, wb0, steps)
        a.wait_to_read()
        b.wait_to_read()

    half = max(1, CORES // 2)
    configs = [("parallel", parallel, half), ("serial", serial, 1), ("serial", serial, CORES)]
    if half != CORES:
        configs.append(("parallel", parallel, CORES))         # oversubscribed, for reference
    times = {(name, th): [] for name, _, th in configs}
    cpu = {(name, th): [] for name, _, th in configs}
    for name, fn, th in configs:                               # warm-up
        with hl.engine.blas_threads(th):
            fn()
    for _ in range(rounds):
        for name, fn, th in configs:
            with hl.engine.blas_threads(th):
                hl.waitall()
                fn()                    # settle: the first run after a thread change is slow
                hl.waitall()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                times[(name, th)].append(dt)
                cpu[(name, th)].append((time.process_time() - c0) / dt)
            if th > 1:
                time.sleep(0.3)         # OpenBLAS pool threads spin for a while after a call:
                #                         let them park before the next configuration runs
    util = {k: statistics.median(v) for k, v in cpu.items()}
    # the speedup of each round (parallel and serial measured back to back): its median moves
    # less with the VM's drift than the ratio of the medians
    paired = [s / p for s, p in zip(times[("serial", 1)], times[("parallel", half)])]
    return {k: statistics.median(v) for k, v in times.items()}, half, util, paired


def report_two_chains(sizes, rounds, log):
    out = []
    log(f"1. two independent matmul chains: parallel (cpu(0) || cpu(1)) vs serial (cpu(0) only); "
        f"median of {rounds}, seconds; speedup vs 1 thread: median of the rounds' paired ratios "
        f"(target >= 1.7x)")
    log(f"   {'n':>5} {'steps':>5} {'GFLOP':>6} | {'parallel':>15} | {'serial 1 thr':>12} "
        f"{'serial ' + str(CORES) + ' thr':>12} | {'par ' + str(CORES) + 'x' + str(CORES):>9} | "
        f"{'speedup vs 1thr':>15} {'vs best serial':>14} | cores busy par/ser")
    for n in sizes:
        steps = max(2, int(round(4e9 / (2.0 * n ** 3) / 2)))  # ~2 GFLOP per chain
        med, half, util, paired = two_chains(n, steps, rounds)
        par = med[("parallel", half)]
        s1, sall = med[("serial", 1)], med[("serial", CORES)]
        over = med.get(("parallel", CORES))
        best = min(s1, sall)
        gf = 2 * 2.0 * n ** 3 * steps / 1e9
        row = {"n": n, "steps": steps, "gflop": gf, "parallel_s": par, "blas_threads_parallel": half,
               "serial_1thread_s": s1, f"serial_{CORES}threads_s": sall,
               "parallel_oversubscribed_s": over, "speedup_vs_serial_1thread": statistics.median(paired),
               "speedup_per_round": paired,
               "speedup_vs_best_serial": best / par,
               "cores_busy_parallel": util[("parallel", half)], "cores_busy_serial_1thread": util[("serial", 1)]}
        out.append(row)
        log(f"   {n:>5} {steps:>5} {gf:>6.2f} | {par:>8.4f} ({half} thr) | {s1:>12.4f} {sall:>12.4f} | "
            f"{(over if over is not None else float('nan')):>9.4f} | {statistics.median(paired):>14.2f}x {best / par:>13.2f}x | "
            f"{util[('parallel', half)]:.2f} / {util[('serial', 1)]:.2f}")
    return out


# ============================================================================ 2. per-op overhead

def per_op_overhead(nops, rounds):
    """Microseconds per tiny op for each configuration (median over rounds)."""
    a0 = np.ones((4, 4), np.float32)

    def numpy_loop():
        a = a0
        for _ in range(nops):
            a = a + 1.0
        return a

    def engine_loop(bulk=None):
        def run():
            x = hl.nd.array(a0)
            hl.waitall()
            scope = hl.engine.bulk(bulk) if bulk else contextlib.nullcontext()
            t0 = time.perf_counter()
            with scope:
                for _ in range(nops):
                    x = x + 1.0
            t_push = time.perf_counter() - t0
            x.wait_to_read()
            assert x.asnumpy()[0, 0] == 1.0 + nops
            return t_push
        return run

    def no_inline_loop(bulk=None):
        def run():
            eng = hl.engine.get_engine()
            old = eng.inline_s
            eng.inline_s = 0.0                 # every op (or group) goes to the device's worker
            try:
                return engine_loop(bulk)()
            finally:
                eng.inline_s = old
        return run

    def naive_loop():
        with hl.engine.set_engine("naive"):
            return engine_loop()()

    configs = [("numpy by hand", numpy_loop), ("threaded", engine_loop()),
               ("threaded, bulk(16)", engine_loop(16)), ("threaded, bulk(64)", engine_loop(64)),
               ("naive (synchronous)", naive_loop)]
    if hasattr(hl.engine.get_engine(), "inline_s"):      # tiny ops may run in the pushing thread
        # bulking matters most where every op would be a hand-over to the worker
        configs[2:2] = [("threaded, no inlining", no_inline_loop()),
                        ("no inlining, bulk(16)", no_inline_loop(16)),
                        ("no inlining, bulk(64)", no_inline_loop(64))]
    total = {name: [] for name, _ in configs}
    push = {name: [] for name, _ in configs}
    for _, fn in configs:
        fn()
    for _ in range(rounds):
        for name, fn in configs:
            hl.waitall()
            t0 = time.perf_counter()
            tp = fn()
            total[name].append(time.perf_counter() - t0)
            push[name].append(tp if isinstance(tp, float) else None)
    res = {}
    for name, _ in configs:
        tp = [p for p in push[name] if p is not None]
        res[name] = {"us_per_op": statistics.median(total[name]) / nops * 1e6,
                     "push_us_per_op": statistics.median(tp) / nops * 1e6 if tp else None}
    return res


def report_overhead(nops, rounds, log):
    res = per_op_overhead(nops, rounds)
    base = res["threaded"]["us_per_op"]
    log(f"2. eager per-op overhead: x = x + 1 on a (4, 4) array, {nops} ops then wait; "
        f"median of {rounds}, microseconds per op")
    log(f"   {'configuration':<22} {'total us/op':>11} {'push us/op':>10} {'vs threaded':>11}")
    for name, r in res.items():
        p = f"{r['push_us_per_op']:.2f}" if r["push_us_per_op"] is not None else "-"
        log(f"   {name:<22} {r['us_per_op']:>11.2f} {p:>10} {base / r['us_per_op']:>10.2f}x")
    return res


# ============================================================================ 3. multi-branch net

_BRANCH_JOB = r"""
import sys, time, json, statistics, numpy as np, hybridl as hl
mode, batch, width, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "segments":
    hl.engine.set_num_workers(2)
hl.random.seed(0)
net = hl.models.inception_net(10, width=width)
net.initialize()
x = hl.nd.array(np.random.default_rng(0).random((batch, 3, 32, 32), dtype=np.float32))
net(x).wait_to_read()
net.hybridize(parallel_segments=(mode == "segments"))
with hl.autograd.predict_mode():
    y = net(x).asnumpy()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); net(x).wait_to_read(); ts.append(time.perf_counter() - t0)
prog = net._last_program.fwd
print(json.dumps({"s": statistics.median(ts), "segments": len(getattr(prog, "segments", [0])),
                  "checksum": float(np.abs(y).sum())}))
"""


def multi_branch(batch, width, reps, rounds):
    """Inference of hl.models.inception_net hybridized: one program (1 worker per device,
    all cores for BLAS) vs parallel segments (2 workers, cores // 2 BLAS threads each).
    Each configuration runs in a fresh process (thread pools are per process); the two run
    back to back in every round, and the speedup is the median of the rounds' ratios (the
    VM's speed drifts between rounds, a paired ratio cancels most of that)."""
    import subprocess
    res = {"one segment": [], "parallel segments": []}
    info = {}
    for _ in range(rounds):
        for mode, key in (("one", "one segment"), ("segments", "parallel segments")):
            out = subprocess.run([sys.executable, "-c", _BRANCH_JOB, mode, str(batch), str(width),
                                  str(reps)], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            res[key].append(r["s"])
            info[key] = r
    ratios = [a / b for a, b in zip(res["one segment"], res["parallel segments"])]
    return {k: statistics.median(v) for k, v in res.items()}, info, ratios


def report_multi_branch(batch, width, reps, rounds, log):
    log(f"\n3. multi-branch network (inception_net width {width}, batch {batch}, 3x32x32, "
        f"inference, hybridized), {rounds} rounds of one process per configuration x {reps} calls")
    med, info, ratios = multi_branch(batch, width, reps, rounds)
    one, seg = med["one segment"], med["parallel segments"]
    speedup = statistics.median(ratios)
    log(f"   one segment (1 worker, {CORES} BLAS threads)      {one * 1e3:9.1f} ms (median)")
    log(f"   parallel segments ({info['parallel segments']['segments']} segments, 2 workers) "
        f"{seg * 1e3:9.1f} ms (median)")
    log(f"   speedup per round: {' '.join(f'{r:.2f}' for r in ratios)}; median {speedup:.2f}x "
        f"(target >= 1.3x)")
    same = abs(info["one segment"]["checksum"] - info["parallel segments"]["checksum"]) < 1e-3 * (
        1 + info["one segment"]["checksum"])
    log(f"   outputs equal: {same}")
    return {"one_segment_s": one, "parallel_segments_s": seg, "speedup": speedup,
            "speedup_per_round": ratios}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11, help="rounds (median; default 11)")
    ap.add_argument("--sizes", default="256,512,1024", help="matrix sizes (default 256,512,1024)")
    ap.add_argument("--ops", type=int, default=4000, help="tiny ops per overhead run (4000)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--branch-batch", type=int, default=64,
                    help="multi-branch batch (64: the branch convolutions dominate; at 32 the "
                         "serial stem weighs more and the speedup is smaller)")
    ap.add_argument("--branch-width", type=int, default=32, help="inception_net width (32)")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    log = print
    eng = hl.engine.get_engine()
    log(f"hybridl parallel benchmark: {CORES} cores, engine {eng.name} "
        f"({getattr(eng, 'num_workers', 1)} worker(s) per device), load average "
        f"{os.getloadavg()[0]:.1f} at start")
    hl.engine.start_workers([hl.cpu(0), hl.cpu(1)])
    chains = report_two_chains(sizes, a.rounds, log)
    overhead = report_overhead(a.ops, a.rounds, log)
    # the two configurations run in separate processes seconds apart: many short rounds give
    # a median of paired ratios that the VM's drift moves less than a few long ones
    branches = report_multi_branch(a.branch_batch, a.branch_width, 7, max(15, a.rounds), log)
    log(f"load average {os.getloadavg()[0]:.1f} at end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cores": CORES, "two_chains": chains, "per_op_overhead": overhead,
                       "multi_branch": branches}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
