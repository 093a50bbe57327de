"""Benchmark the dependency engine: per-op overhead, asynchrony, and eager MLP latency.

    python benchmarks/engine.py [--reps 30] [--quick]

Sections (every figure is the median of >= 20 samples taken in interleaved rounds after a
warm-up; ratios are printed side by side):

1. tiny ops: ``a + b`` on 1-element float32 arrays. "push" is the time for the frontend to push
   one op of a chain of 1000 (no wait), "end-to-end" is push + wait of the whole chain, per op.
   Threaded engine vs naive engine vs raw NumPy.
2. asynchrony: push a chain of 20 matmuls of 1024x1024 float32 (``y = x @ y * s``) and wait.
   Target: pushing takes < 5 % of the time until ``waitall()`` returns.
3. eager MLP 512-256-128-2 forward on a batch of 1 (fully_connected + relu, then ``asnumpy``):
   hybridl threaded / naive vs NumPy by hand vs PyTorch eager (no_grad) when importable. All run
   with one BLAS thread (threadpoolctl) and ``torch.set_num_threads(1)``; target: hybridl eager
   <= PyTorch eager.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybridl as hl  # noqa: E402
from hybridl.engine import NaiveEngine, ThreadedEngine  # noqa: E402

from _common import bench, fmt_time, machine_line, print_table  # noqa: E402

try:
    import torch
except Exception:  # pragma: no cover - torch optional
    torch = None


def use(engine):
    hl.engine.set_engine(engine)


# ---------------------------------------------------------------------------- 1. tiny ops
def tiny_ops(threaded, naive, reps, n=1000):
    a_np = np.ones(1, np.float32)
    b_np = np.full(1, 1e-3, np.float32)
    a, b = hl.nd.array(a_np), hl.nd.array(b_np)

    def chain_np():
        y = a_np
        for _ in range(n):
            y = y + b_np
        return y

    def hl_chain(engine, wait):
        def run():
            y = a
            for _ in range(n):
                y = y + b
            if wait:
                y.wait_to_read()
            return y
        return run

    push = {}
    for name, eng in (("threaded", threaded), ("naive", naive)):
        # push only: time the pushes, then wait outside the timed region
        samples = []
        run = hl_chain(eng, wait=False)
        use(eng)
        run()
        eng.waitall()
        for _ in range(reps):
            use(eng)
            t0 = time.perf_counter()
            run()
            samples.append((time.perf_counter() - t0) / n)
            eng.waitall()
        push[name] = {"median": float(np.median(samples)), "q1": float(np.percentile(samples, 25)),
                      "q3": float(np.percentile(samples, 75)), "n": len(samples)}
    res = bench({"numpy (a + b)": chain_np,
                 "hybridl threaded": (hl_chain(threaded, True), lambda: use(threaded)),
                 "hybridl naive": (hl_chain(naive, True), lambda: use(naive))}, reps=reps)
    per_op = {k: {kk: (vv / n if kk != "n" else vv) for kk, vv in v.items()} for k, v in res.items()}
    use(threaded)
    print_table(f"tiny ops: push of one op of a chain of {n} (a + b, 1 element)", push,
                baseline="naive")
    print_table(f"tiny ops: end-to-end per op, chain of {n} + wait", per_op,
                baseline="numpy (a + b)")
    return push, per_op


# ---------------------------------------------------------------------------- 2. asynchrony
def asynchrony(threaded, reps, n=20, size=1024):
    use(threaded)
    rng = np.random.default_rng(0)
    x = hl.nd.array(rng.standard_normal((size, size), dtype=np.float32) / np.sqrt(size))
    push_t, total_t = [], []
    for i in range(reps + 2):
        hl.waitall()
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = hl.nd.dot(x, y) * 1.0
        t1 = time.perf_counter()
        hl.waitall()
        t2 = time.perf_counter()
        if i >= 2:                          # warm-up
            push_t.append(t1 - t0)
            total_t.append(t2 - t0)
    push_m, total_m = float(np.median(push_t)), float(np.median(total_t))
    frac = float(np.median(np.array(push_t) / np.array(total_t)))
    print(f"\n== asynchrony: chain of {n} x (matmul {size}x{size} + scale), threaded engine")
    print(f"   push (frontend returns)   {fmt_time(push_m)}")
    print(f"   until waitall() returns   {fmt_time(total_m)}")
    print(f"   push / total              {100 * frac:8.2f} %   (target < 5 %: "
          f"{'met' if frac < 0.05 else 'MISSED'})  (n={len(push_t)})")
    return push_m, total_m, frac


# ---------------------------------------------------------------------------- 3. eager MLP
def mlp(threaded, naive, reps):
    rng = np.random.default_rng(0)
    dims = [(512, 256), (256, 128), (128, 2)]
    W = [(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32) for i, o in dims]
    B = [(rng.standard_normal(o) * 0.1).astype(np.float32) for _, o in dims]
    x = rng.standard_normal((1, 512)).astype(np.float32)
    hw, hb, hx = [hl.nd.array(w) for w in W], [hl.nd.array(b) for b in B], hl.nd.array(x)

    def np_forward():
        y = x
        for i in range(3):
            y = y @ W[i].T + B[i]
            if i < 2:
                y = np.maximum(y, 0)
        return y

    def hl_forward(engine):
        def run():
            y = hx
            for i in range(3):
                y = hl.nd.fully_connected(y, hw[i], hb[i])
                if i < 2:
                    y = hl.nd.relu(y)
            return y.asnumpy()
        return run

    t_forward = None
    if torch is not None:
        tw, tb, tx = ([torch.from_numpy(w) for w in W], [torch.from_numpy(b) for b in B],
                      torch.from_numpy(x))

        def t_forward():
            with torch.no_grad():
                y = tx
                for i in range(3):
                    y = torch.nn.functional.linear(y, tw[i], tb[i])
                    if i < 2:
                        y = torch.relu(y)
                return y.numpy()

    # the model as users (and ../shared/bench/peers.py) write it: a sequential container of
    # dense layers with ReLU (hybridl: Dense(activation='relu'), one fused op per layer;
    # PyTorch: nn.Sequential of Linear and ReLU under no_grad)
    net = hl.nn.HybridSequential()
    net.add(hl.nn.Dense(256, activation="relu", in_units=512),
            hl.nn.Dense(128, activation="relu", in_units=256), hl.nn.Dense(2, in_units=128))
    net.initialize()
    for lay, w, b in zip(net, W, B):
        lay.weight.set_data(w)
        lay.bias.set_data(b)

    def hl_model():
        return net(hx).asnumpy()
    t_model = None
    if torch is not None:
        tm = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                 torch.nn.ReLU(), torch.nn.Linear(128, 2))
        with torch.no_grad():
            for lin, w, b in zip((tm[0], tm[2], tm[4]), W, B):
                lin.weight.copy_(torch.from_numpy(w))
                lin.bias.copy_(torch.from_numpy(b))

        def t_model():
            with torch.no_grad():
                return tm(tx).numpy()

    ref = np_forward()
    for eng in (threaded, naive):
        use(eng)
        np.testing.assert_allclose(hl_forward(eng)(), ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(hl_model(), ref, rtol=1e-4, atol=1e-5)
    if t_forward is not None:
        np.testing.assert_allclose(t_forward(), ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t_model(), ref, rtol=1e-4, atol=1e-5)

    res = bench({"numpy by hand": np_forward,
                 "pytorch eager (nn.Sequential)": t_model,
                 "hybridl threaded (HybridSequential)": (hl_model, lambda: use(threaded)),
                 "hybridl naive (HybridSequential)": (hl_model, lambda: use(naive)),
                 "pytorch eager (F.linear, relu)": t_forward,
                 "hybridl threaded (ops)": (hl_forward(threaded), lambda: use(threaded)),
                 "hybridl naive (ops)": (hl_forward(naive), lambda: use(naive))},
                reps=reps, inner=50)
    use(threaded)
    note = "threads: BLAS 1 (threadpoolctl)" + (
        f", torch.set_num_threads(1) -> {torch.get_num_threads()}" if torch is not None
        else ", PyTorch not importable")
    base = "pytorch eager (nn.Sequential)"
    print_table("eager MLP 512-256-128-2, batch 1, forward + asnumpy (per call); models, then the "
                "same with functional ops (6 ops: linear, relu, ...)", res,
                baseline=base if torch is not None else "numpy by hand", note=note)
    if torch is not None:
        r = res["hybridl threaded (HybridSequential)"]["median"] / res[base]["median"]
        print(f"   target hybridl eager <= pytorch eager (the model, as ../shared/bench/peers.py "
              f"measures it): {'met' if r <= 1.0 else 'MISSED'} ({r:.2f}x)")
        r2 = res["hybridl threaded (ops)"]["median"] / res["pytorch eager (F.linear, relu)"]["median"]
        print(f"   functional ops, per-op cost: hybridl / pytorch {r2:.2f}x")
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30, help="samples per figure (>= 20)")
    p.add_argument("--quick", action="store_true", help="smaller asynchrony chain (4 x 512)")
    a = p.parse_args()
    if a.reps < 20:
        p.error("--reps: at least 20 samples per figure")
    from threadpoolctl import threadpool_info, threadpool_limits
    blas = ", ".join(f"{d['internal_api']} {d['num_threads']} threads" for d in threadpool_info())
    print(f"# engine benchmark: {machine_line()}")
    print(f"# numpy {np.__version__} ({blas}); torch "
          f"{torch.__version__ if torch is not None else 'not installed'}; "
          f"sys.getswitchinterval() = {sys.getswitchinterval() * 1e3:g} ms")
    threaded, naive = ThreadedEngine(), NaiveEngine()
    print(f"# threaded engine: {threaded.num_workers} worker(s) per device, "
          f"inline_s = {getattr(threaded, 'inline_s', 0) * 1e6:g} us")
    prev = hl.engine.get_engine()
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            if torch is not None:
                torch.set_num_threads(1)
            tiny_ops(threaded, naive, a.reps)
            mlp(threaded, naive, a.reps)
        if torch is not None:
            torch.set_num_threads(os.cpu_count() or 1)
        if a.quick:
            asynchrony(threaded, a.reps, n=4, size=512)
        else:
            asynchrony(threaded, a.reps)
    finally:
        hl.engine.set_engine(prev)
        threaded.shutdown()


if __name__ == "__main__":
    main()
