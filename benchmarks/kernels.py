"""Benchmark hybridl.kernels at the LeNet shapes (batch 128, float32), forward + backward,
side by side with torch.nn.functional on the CPU (torch.set_num_threads(2)) when torch is
importable.

    python benchmarks/kernels.py [--reps 30] [--batch 128] [--threads 2]

Each row is the median wall time (ms) over ``--reps`` repetitions (after one warm-up) of one
kernel call; "fwd+bwd" rows time the forward plus every backward the LeNet training step needs
(conv1's input is the data, so no grad w.r.t. it). torch backward is timed through
autograd.grad on a fresh graph, so its column includes building that graph. TOTAL sums the
conv1/pool1/conv2/pool2 fwd+bwd rows (max pooling); the avgpool rows (the pooling of the LeNet in
train_step.py) are reported separately.

On a shared 2-core machine whose other core is busy, any 2-thread library call (OpenBLAS GEMM,
torch's OpenMP regions) waits for a scheduler slice for its second thread and can run 4-10x
slower than with 1 thread; use ``--threads 1`` for a stable comparison in that situation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybridl import kernels as K  # noqa: E402

try:
    import torch
    import torch.nn.functional as F

except Exception:  # pragma: no cover - torch optional
    torch = None


def samples_ms(fn, reps):
    """``reps`` wall times (ms) of fn(), after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return [t * 1e3 for t in ts]


def run_table(cases, reps, have_t, rounds=2):
    """Median times (ms) per case for hybridl and torch.

    Both OpenBLAS (NumPy) and OpenMP (torch) keep their worker threads spinning for a while
    after a call (OpenBLAS ~2^28 cycles); alternating the two libraries call by call on 2 cores
    lets one's idle spinners steal the cores from the other and inflates both columns many
    times. So the whole hybridl column is timed, then (after a pause that lets the spinners
    sleep) the whole torch column, and this is repeated ``rounds`` times so that the slowly
    varying load of a shared machine hits both columns alike.
    """
    per = max(10, -(-reps // rounds))
    hs = [[] for _ in cases]
    ts = [[] for _ in cases]
    for _ in range(rounds):
        for k, (_, hf, _, _) in enumerate(cases):
            hs[k] += samples_ms(hf, per)
        if have_t:
            time.sleep(0.5)
            for k, (_, _, tf, _) in enumerate(cases):
                if tf is not None:
                    ts[k] += samples_ms(tf, per)
            time.sleep(0.5)
    return [(float(np.median(h)), float(np.median(t)) if t else None) for h, t in zip(hs, ts)]


def build_cases(N, rng):
    f32 = np.float32
    x1 = rng.standard_normal((N, 1, 28, 28), dtype=f32)
    w1 = rng.standard_normal((6, 1, 5, 5), dtype=f32) * 0.2
    b1 = np.zeros(6, f32)
    y1 = K.conv2d(x1, w1, b1, (1, 1), (2, 2))
    dy1 = rng.standard_normal(y1.shape, dtype=f32)
    p1 = K.max_pool2d(y1, (2, 2), (2, 2), (0, 0))
    dp1 = rng.standard_normal(p1.shape, dtype=f32)
    w2 = rng.standard_normal((16, 6, 5, 5), dtype=f32) * 0.1
    b2 = np.zeros(16, f32)
    y2 = K.conv2d(p1, w2, b2, (1, 1), (0, 0))
    dy2 = rng.standard_normal(y2.shape, dtype=f32)
    p2 = K.max_pool2d(y2, (2, 2), (2, 2), (0, 0))
    dp2 = rng.standard_normal(p2.shape, dtype=f32)
    logits = rng.standard_normal((N, 10), dtype=f32)
    labels = rng.integers(0, 10, N)
    h = rng.standard_normal((N, 120), dtype=f32)
    g120, b120 = np.ones(120, f32), np.zeros(120, f32)
    dh = rng.standard_normal((N, 120), dtype=f32)
    s1, p0, d1 = (1, 1), (0, 0), (1, 1)

    cases = []  # (name, hybridl fn, torch fn or None, is_conv_pool)

    def tt(a, grad=False):
        return torch.tensor(a, requires_grad=grad)

    # conv1: 1->6, 5x5, pad 2, 28x28
    cases.append(("conv1 fwd", lambda: K.conv2d(x1, w1, b1, s1, (2, 2)),
                  (lambda: F.conv2d(T["x1"], T["w1"], T["b1"], 1, 2)) if torch else None, False))
    cases.append(("conv1 grad_w", lambda: K.conv2d_grad_weight(dy1, x1, w1.shape, s1, (2, 2), d1, 1), None, False))
    cases.append(("conv1 grad_x", lambda: K.conv2d_grad_input(dy1, w1, x1.shape, s1, (2, 2), d1, 1), None, False))

    def h_conv1():
        K.conv2d(x1, w1, b1, s1, (2, 2))
        K.conv2d_grad_weight(dy1, x1, w1.shape, s1, (2, 2), d1, 1, bias=True)  # (dw, db), as the op

    def t_conv1():
        y = F.conv2d(T["x1"], T["w1g"], T["b1g"], 1, 2)
        torch.autograd.grad(y, (T["w1g"], T["b1g"]), T["dy1"])

    cases.append(("conv1 fwd+bwd (w,b)", h_conv1, t_conv1 if torch else None, True))

    # pool1: 2x2 on (N,6,28,28)
    def h_pool1():
        p = K.max_pool2d(y1, (2, 2), (2, 2), p0)
        K.max_pool2d_grad(dp1, y1, p, (2, 2), (2, 2), p0)

    def t_pool1():
        p = F.max_pool2d(T["y1g"], 2, 2)
        torch.autograd.grad(p, (T["y1g"],), T["dp1"])

    cases.append(("pool1 fwd", lambda: K.max_pool2d(y1, (2, 2), (2, 2), p0),
                  (lambda: F.max_pool2d(T["y1"], 2, 2)) if torch else None, False))
    cases.append(("pool1 fwd+bwd", h_pool1, t_pool1 if torch else None, True))

    # conv2: 6->16, 5x5, 14x14
    cases.append(("conv2 fwd", lambda: K.conv2d(p1, w2, b2, s1, p0),
                  (lambda: F.conv2d(T["p1"], T["w2"], T["b2"])) if torch else None, False))
    cases.append(("conv2 grad_w", lambda: K.conv2d_grad_weight(dy2, p1, w2.shape, s1, p0, d1, 1), None, False))
    cases.append(("conv2 grad_x", lambda: K.conv2d_grad_input(dy2, w2, p1.shape, s1, p0, d1, 1), None, False))

    def h_conv2():
        K.conv2d(p1, w2, b2, s1, p0)
        K.conv2d_grad_weight(dy2, p1, w2.shape, s1, p0, d1, 1, bias=True)
        K.conv2d_grad_input(dy2, w2, p1.shape, s1, p0, d1, 1)

    def t_conv2():
        y = F.conv2d(T["p1g"], T["w2g"], T["b2g"])
        torch.autograd.grad(y, (T["p1g"], T["w2g"], T["b2g"]), T["dy2"])

    cases.append(("conv2 fwd+bwd (x,w,b)", h_conv2, t_conv2 if torch else None, True))

    # pool2: 2x2 on (N,16,10,10)
    def h_pool2():
        p = K.max_pool2d(y2, (2, 2), (2, 2), p0)
        K.max_pool2d_grad(dp2, y2, p, (2, 2), (2, 2), p0)

    def t_pool2():
        p = F.max_pool2d(T["y2g"], 2, 2)
        torch.autograd.grad(p, (T["y2g"],), T["dp2"])

    cases.append(("pool2 fwd+bwd", h_pool2, t_pool2 if torch else None, True))

    # average pooling, as in the LeNet of benchmarks/train_step.py (AvgPool2D(2)); not in TOTAL
    def h_apool(y, dp):
        def f():
            K.avg_pool2d(y, (2, 2), (2, 2), p0)
            K.avg_pool2d_grad(dp, y.shape, (2, 2), (2, 2), p0)
        return f

    def t_apool(yk, dpk):
        def f():
            p = F.avg_pool2d(T[yk], 2, 2)
            torch.autograd.grad(p, (T[yk],), T[dpk])
        return f

    cases.append(("avgpool1 fwd", lambda: K.avg_pool2d(y1, (2, 2), (2, 2), p0),
                  (lambda: F.avg_pool2d(T["y1"], 2, 2)) if torch else None, False))
    cases.append(("avgpool1 fwd+bwd", h_apool(y1, dp1), t_apool("y1g", "dp1") if torch else None, False))
    cases.append(("avgpool2 fwd+bwd", h_apool(y2, dp2), t_apool("y2g", "dp2") if torch else None, False))

    # softmax cross-entropy on (N,10)
    def h_ce():
        K.softmax_cross_entropy(logits, labels)
        K.softmax_cross_entropy_grad(np.full(N, 1.0 / N, f32), logits, labels)

    def t_ce():
        loss = F.cross_entropy(T["logitsg"], T["labels"])
        torch.autograd.grad(loss, (T["logitsg"],))

    cases.append(("softmax CE fwd+bwd", h_ce, t_ce if torch else None, False))

    # batch norm on (N,6,28,28) and layer norm on (N,120)
    def h_bn():
        y, m, v = K.batch_norm_train(y1, b1 + 1, b1, 1e-5)
        K.batch_norm_grad(dy1, y1, b1 + 1, m, v, 1e-5)

    def t_bn():
        y = F.batch_norm(T["y1g"], None, None, T["g6"], T["b6"], training=True, eps=1e-5)
        torch.autograd.grad(y, (T["y1g"], T["g6"], T["b6"]), T["dy1"])

    cases.append(("batch_norm (N,6,28,28) fwd+bwd", h_bn, t_bn if torch else None, False))

    def h_ln():
        y, m, v = K.layer_norm(h, g120, b120, 1e-5)
        K.layer_norm_grad(dh, h, g120, m, v, 1e-5)

    def t_ln():
        y = F.layer_norm(T["hg"], (120,), T["g120"], T["b120"], 1e-5)
        torch.autograd.grad(y, (T["hg"], T["g120"], T["b120"]), T["dh"])

    cases.append(("layer_norm (N,120) fwd+bwd", h_ln, t_ln if torch else None, False))

    T = {}
    if torch is not None:
        T.update(x1=tt(x1), w1=tt(w1), b1=tt(b1), w1g=tt(w1, True), b1g=tt(b1, True), dy1=tt(dy1),
                 y1=tt(y1), y1g=tt(y1, True), dp1=tt(dp1), p1=tt(p1), p1g=tt(p1, True), w2=tt(w2),
                 b2=tt(b2), w2g=tt(w2, True), b2g=tt(b2, True), dy2=tt(dy2), y2g=tt(y2, True),
                 dp2=tt(dp2), logitsg=tt(logits, True), labels=torch.tensor(labels),
                 g6=tt(b1 + 1, True), b6=tt(b1, True), hg=tt(h, True), g120=tt(g120, True),
                 b120=tt(b120, True), dh=tt(dh))
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2,
                    help="threads for torch (set_num_threads) and for NumPy's BLAS (threadpoolctl)")
    args = ap.parse_args(argv)
    if torch is not None:
        torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads, user_api="blas")
    except ImportError:  # pragma: no cover
        pass
    reps = max(20, args.reps)
    cases = build_cases(args.batch, np.random.default_rng(0))
    have_t = torch is not None
    print(f"hybridl.kernels vs torch.nn.functional, LeNet shapes, batch {args.batch}, float32, "
          f"median of {reps}+ reps in 2 alternating rounds (ms); torch: {torch.__version__ if have_t else 'not installed'}; {args.threads} thread(s) each")
    print(f"{'kernel':34s} {'hybridl':>9s} {'torch':>9s} {'ratio':>7s}")
    results = run_table(cases, reps, have_t)
    tot_h = tot_t = 0.0
    for (name, _, _, in_total), (th, tt_) in zip(cases, results):
        if in_total:
            tot_h += th
            tot_t += tt_ if tt_ is not None else 0.0
        ts = f"{tt_:9.3f}" if tt_ is not None else f"{'-':>9s}"
        rs = f"{th / tt_:7.2f}" if tt_ else f"{'-':>7s}"
        print(f"{name:34s} {th:9.3f} {ts} {rs}")
    ts = f"{tot_t:9.3f}" if have_t else f"{'-':>9s}"
    rs = f"{tot_h / tot_t:7.2f}" if have_t and tot_t else f"{'-':>7s}"
    print(f"{'TOTAL LeNet conv+pool fwd+bwd':34s} {tot_h:9.3f} {ts} {rs}")


if __name__ == "__main__":
    main()
