"""Multi-device benchmark: data-parallel throughput, gradient aggregation, pipeline bubble.

    python benchmarks/multi_device.py [--quick] [--json out.json]

1. Training throughput (samples/s) of LeNet (1x28x28, batch 128) and a *narrow* ResNet-18
   (width 8 instead of 64, 3x16x16 inputs, batch 32 -- shrunk so the whole script runs in a few
   minutes on 2 cores) on 1 logical device vs 2 (data parallel, ring-allreduce KVStore), with
   the profiler's view of where the 2-device step spends its time (busy share of each
   engine thread, top ops).
2. Gradient aggregation of 160 MB of parameters (the d2l "Parameter Servers" example: 160 MB
   of gradients on k devices), as 40 arrays of 4 MB: reduce on one device and broadcast
   (kvstore 'local') vs ring allreduce (kvstore 'device'), k = 2 and 4, beside the chapter's
   arithmetic with this machine's measured copy bandwidth B:
   one device 2 (k-1) S / B, ring 2 (k-1)/k S / B (per-link bandwidth B for every device).
3. Pipeline bubble: 2 stages of Dense layers (balanced), m = 1, 2, 4, 8 micro-batches, GPipe
   and 1F1B; measured idle fraction (engine op events) vs theory (p-1)/(m+p-1).

Logical CPU devices share the cores, the memory bus and the GIL: these are the honest figures
of one small machine, not of k accelerators with private memories and links.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybridl as hl  # noqa: E402
from hybridl import autograd, nn  # noqa: E402
from hybridl.parallel import split_and_load  # noqa: E402
from hybridl.parallel.pipeline import Pipeline, bubble_theory  # noqa: E402


# ============================================================================ 1. throughput


def _make(model):
    if model == "lenet":
        return hl.models.lenet(10, input_size=28), (1, 28, 28), 128
    return hl.models.resnet18(10, width=8), (3, 16, 16), 32


def throughput(model, k, steps, kvstore="device", profile=False):
    net, shape, batch = _make(model)
    devices = [hl.cpu(i) for i in range(k)]
    net.initialize(device=devices)
    net.hybridize()
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                    kvstore=kvstore if k > 1 else None)
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = rng.integers(0, 10, batch)

    def step():
        xs, ys = split_and_load(x, devices), split_and_load(y, devices)
        with autograd.record():
            losses = [lf(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        tr.step(batch)

    for _ in range(3):                                   # warm-up: traces, buffers
        step()
    hl.waitall()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    hl.waitall()
    dt = time.perf_counter() - t0
    prof_view = None
    if profile and hasattr(hl, "profiler"):
        with hl.profiler.profile() as prof:
            t1 = time.perf_counter()
            for _ in range(3):
                step()
            hl.waitall()
            wall = time.perf_counter() - t1
        busy = {}
        for e in prof.events:
            if e.queue in ("bulk", "frontend"):
                continue
            busy[e.thread] = busy.get(e.thread, 0.0) + e.duration
        top = prof.stats(hardware=None)[:6]
        prof_view = {"wall_s": wall,
                     "busy_share": {t: b / wall for t, b in sorted(busy.items())},
                     "top_ops": [(r["name"], r["count"], r["total"], r["share"]) for r in top]}
    return batch * steps / dt, prof_view


# ============================================================================ 2. aggregation


def copy_bandwidth(nbytes=64 << 20):
    """Measured memcpy bandwidth in bytes/s (read + write counted once, as a link would)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def aggregation(kind, k, total_bytes, n_arrays, reps):
    devices = [hl.cpu(i) for i in range(k)]
    per = total_bytes // n_arrays // 4
    kv = hl.kv.create(kind)
    grads = [[hl.nd.ones((per,), device=d) for d in devices] for _ in range(n_arrays)]
    for i, g in enumerate(grads):
        kv.init(i, g[0])
    hl.waitall()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in reversed(range(n_arrays)):
            kv.pushpull(i, grads[i], out=grads[i], priority=-i)
        hl.waitall()
        times.append(time.perf_counter() - t)
    ok = float(grads[0][-1].asnumpy()[0])            # k ** (1 + reps) after reps pushpulls
    del grads, kv
    return statistics.median(times), ok


# ============================================================================ 3. pipeline


def pipeline_bubble(m, sched, width, batch, reps):
    devices = [hl.cpu(0), hl.cpu(1)]
    stages = []
    for _ in devices:
        s = nn.HybridSequential()
        s.add(nn.Dense(width, activation="relu", in_units=width),
              nn.Dense(width, activation="relu", in_units=width))
        stages.append(s)
    pipe = Pipeline(stages, devices, m, sched)
    pipe.initialize()
    pipe.hybridize()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    lf = hl.loss.L2Loss()
    pipe.forward_backward(x, y, lf, measure=True)               # warm-up (traces)
    meas, spans = [], []
    for _ in range(reps):
        pipe.forward_backward(x, y, lf, measure=True)
        meas.append(pipe.last_stats["bubble_measured"])
        spans.append(pipe.last_stats["makespan_s"])
    return statistics.median(meas), statistics.median(spans), pipe.last_stats


# ============================================================================ main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    q = args.quick
    res = {"cores": os.cpu_count()}
    print(f"hybridl multi-device benchmark: {os.cpu_count()} cores, engine "
          f"{hl.engine.get_engine().name}")

    print("\n1. data-parallel training throughput (samples/s, hybridized, SGD momentum)")
    print(f"{'model':<28}{'1 device':>10}{'2 devices':>11}{'speed-up':>10}")
    res["throughput"] = {}
    views = {}
    for model, steps in (("lenet", 8 if q else 20), ("resnet18", 3 if q else 8)):
        one, _ = throughput(model, 1, steps)
        two, view = throughput(model, 2, steps, profile=True)
        label = ("LeNet (1x28x28, b=128)" if model == "lenet"
                 else "ResNet-18 w=8 (3x16x16, b=32)")
        print(f"{label:<28}{one:>10.0f}{two:>11.0f}{two / one:>9.2f}x")
        res["throughput"][model] = {"1": one, "2": two}
        views[model] = view
    for model, view in views.items():
        if view is None:
            print("   (hl.profiler not available: no per-thread view)")
            continue
        print(f"   profiler, {model} on 2 devices, 3 steps in {view['wall_s'] * 1e3:.0f} ms: "
              + ", ".join(f"{t.replace('hybridl-', '')} busy {s:.0%}"
                          for t, s in view["busy_share"].items()))
        print("     top ops: " + "; ".join(f"{n} x{c} {t * 1e3:.0f} ms ({s:.0f}%)"
                                            for n, c, t, s in view["top_ops"]))
    res["profile"] = views

    total = 160 << 20
    nar = 40
    B = copy_bandwidth()
    S = total
    print(f"\n2. gradient aggregation of {S / 2**20:.0f} MB ({nar} arrays of "
          f"{S / nar / 2**20:.0f} MB), measured copy bandwidth B = {B / 1e9:.1f} GB/s")
    print(f"{'k':>3}{'one device (local)':>20}{'theory 2(k-1)S/B':>18}{'ring (device)':>15}"
          f"{'theory 2(k-1)S/kB':>19}{'ring/one':>10}")
    res["aggregation"] = {"bandwidth_GBs": B / 1e9, "bytes": S}
    reps = 2 if q else 3
    for k in (2, 4):
        t_loc, ok1 = aggregation("local", k, S, nar, reps)
        t_ring, ok2 = aggregation("device", k, S, nar, reps)
        assert ok1 == ok2 == float(k ** reps), (ok1, ok2)
        th_one = 2 * (k - 1) * S / B
        th_ring = 2 * (k - 1) / k * S / B
        print(f"{k:>3}{t_loc * 1e3:>17.0f} ms{th_one * 1e3:>15.0f} ms{t_ring * 1e3:>12.0f} ms"
              f"{th_ring * 1e3:>16.0f} ms{t_ring / t_loc:>9.2f}x")
        res["aggregation"][k] = {"local_s": t_loc, "ring_s": t_ring, "theory_one_s": th_one,
                                 "theory_ring_s": th_ring}
    print("   d2l's figures (S = 160 MB, k = 4, B = 16 GB/s PCIe): one GPU 60 ms, ring 15 ms.")

    print("\n3. pipeline bubble, p = 2 stages (2 x Dense 1024 each), batch 512")
    print(f"{'m':>3}{'theory':>9}{'GPipe':>9}{'1F1B':>9}{'GPipe step':>12}{'1F1B step':>11}")
    res["pipeline"] = {}
    for m in (1, 2, 4, 8):
        g, gs, _ = pipeline_bubble(m, "gpipe", 1024, 512, 2 if q else 4)
        f, fs, st = pipeline_bubble(m, "1f1b", 1024, 512, 2 if q else 4)
        th = bubble_theory(2, m)
        print(f"{m:>3}{th:>9.2f}{g:>9.2f}{f:>9.2f}{gs * 1e3:>9.0f} ms{fs * 1e3:>8.0f} ms")
        res["pipeline"][m] = {"theory": th, "gpipe": g, "1f1b": f, "gpipe_s": gs, "1f1b_s": fs}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
