"""Hybridization benchmarks, one run, ratios printed; run twice and quote medians.

1. The classic: MLP 512-256-128-2, batch 1, forward calls: hybridl eager vs hybridized vs
   NumPy by hand vs PyTorch eager, torch.jit.script, jax.jit (peers via ../shared/bench).
   Targets: hybridized <= 1.2x NumPy by hand and <= 0.5x torch.jit.script.
2. Training steps hybridized: see benchmarks/train_step.py (same workloads).
3. Memory: planned peak / naive bytes of the joint forward+backward (training) programs of the
   MLP and LeNet and of their whole training step (``hl.TrainStep``: with the SGD update, the
   gradients are internal values) (target <= 0.5), and peak Python-heap memory (tracemalloc)
   of one training step eager vs hybridized vs TrainStep.
4. Compile time per model (target < 1 s for LeNet).

    python benchmarks/hybridize.py [--no-peers]
"""
import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bench, run_peer, table  # noqa: E402
from train_step import lenet_net, mlp_net  # noqa: E402

import hybridl as hl  # noqa: E402
from hybridl import autograd, nn  # noqa: E402
from hybridl.graph import Graph, gradient  # noqa: E402
from hybridl.graph.hybrid import trace_graph  # noqa: E402
from hybridl.graph.program import Program  # noqa: E402


def classic_net():
    rng = np.random.default_rng(0)
    net = nn.HybridSequential()
    net.add(nn.Dense(256, activation="relu", in_units=512), nn.Dense(128, activation="relu", in_units=256),
            nn.Dense(2, in_units=128))
    net.initialize()
    for layer, (fi, fo) in zip(net, [(512, 256), (256, 128), (128, 2)]):
        b = 1.0 / np.sqrt(fi)
        layer.weight.set_data(rng.uniform(-b, b, (fo, fi)).astype(np.float32))
        layer.bias.set_data(rng.uniform(-b, b, (fo,)).astype(np.float32))
    return net


def classic(peers, rounds=9, inner=300):
    net = classic_net()
    xn = np.random.default_rng(2).standard_normal((1, 512), dtype=np.float32)
    x = hl.nd.array(xn)
    hyb = classic_net()
    hyb.hybridize()
    W = [(lay.weight.data().asnumpy(), lay.bias.data().asnumpy()) for lay in net]

    def by_hand():          # the peers' "NumPy by hand" (../shared/bench/peers.py), this process
        h = np.maximum(xn @ W[0][0].T + W[0][1], 0)
        h = np.maximum(h @ W[1][0].T + W[1][1], 0)
        return h @ W[2][0].T + W[2][1]

    def run_naive():
        with hl.engine.set_engine("naive"):
            for _ in range(inner):
                hyb(x).wait_to_read()
    calls = {"hybridl eager": lambda: [net(x).wait_to_read() for _ in range(inner)],
             "hybridl hybridized": lambda: [hyb(x).wait_to_read() for _ in range(inner)],
             "hybridl hybridized, naive engine": run_naive,
             "numpy by hand, this process": lambda: [by_hand() for _ in range(inner)]}
    times = {k: [] for k in calls}
    for f in calls.values():
        f()                                  # warm-up (and the first, tracing call)
    for _ in range(rounds):                  # interleaved: the machine's speed drifts
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) / inner * 1e3)
    rows = [(k, float(np.median(v))) for k, v in times.items()]
    if peers:
        for fw in ("numpy", "torch_eager", "torch_jit_script", "jax_jit_t1"):
            rows.append((fw, run_peer("mlp_infer", fw)))
    table(f"MLP 512-256-128-2 forward, batch 1, per call (hybridl and NumPy by hand: "
          f"interleaved, median of {rounds} x {inner} calls; peers: own processes)", rows,
          ref="numpy by hand, this process")
    d = dict(rows)
    h = d["hybridl hybridized"]
    print(f"  hybridized / NumPy by hand (same process): {h / d['numpy by hand, this process']:.2f}x "
          f"(target <= 1.2)")
    if d.get("torch_jit_script"):
        print(f"  hybridized / torch.jit.script: {h / d['torch_jit_script']:.2f}x (target <= 0.5); "
              f"scaled by the NumPy runs of both processes: "
              f"{h / d['numpy by hand, this process'] * d['numpy'] / d['torch_jit_script']:.2f}x")


def joint_program(net, x, y):
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    with autograd.train_mode():
        inputs, outs, _, ctx = trace_graph(lambda a, b: loss_fn(net(a), b), [x, y])
    n = 2
    joint, _, _ = gradient(Graph(inputs, outs), list(range(n, len(inputs))))
    t0 = time.perf_counter()
    prog = Program(joint, None, "train")
    return prog, time.perf_counter() - t0


def _bound(p):
    """Print how close the plan's arena is to the most bytes live at once (a lower bound for
    any placement in this op order) and the ratio that bound allows."""
    arena = sum(p.buffers)
    best = (p.planned_bytes - arena + p.live_peak_bytes) / p.naive_bytes if p.naive_bytes else 1.0
    print(f"  {'':20s}   arena {arena / 2**20:.3f} MiB, most bytes live at once "
          f"{p.live_peak_bytes / 2**20:.3f} MiB: no placement in this op order goes below "
          f"ratio {best:.3f}")


def _plain_step_plan(mk, x, y):
    """The memory plan of the TrainStep program of ``mk()`` compiled without the release of
    ReLU outputs (every activation below its size threshold)."""
    from hybridl.graph import step as step_mod
    saved = step_mod.MASK_MIN_BYTES
    step_mod.MASK_MIN_BYTES = 1 << 62
    try:
        net = mk()
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        st = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), tr)
        st(x, y)
        hl.waitall()
        return st.last_program.memory_plan
    finally:
        step_mod.MASK_MIN_BYTES = saved


def memory():
    print("\n== Memory: joint forward+backward training programs ==")
    for name, mk, shape, b in (("MLP 784-256-128-10", mlp_net, (784,), 256),
                               ("LeNet", lenet_net, (1, 28, 28), 128)):
        net = mk()
        x = hl.nd.array(np.random.rand(b, *shape).astype(np.float32))
        y = hl.nd.array(np.random.randint(0, 10, b))
        prog, secs = joint_program(net, x, y)
        p = prog.memory_plan
        print(f"  {name:20s} batch {b}: naive {p.naive_bytes / 2**20:7.2f} MiB, planned "
              f"{p.planned_bytes / 2**20:7.2f} MiB, ratio {p.ratio:.2f} (target <= 0.5); "
              f"intermediates only (gradients/loss excluded): ratio {p.internal_ratio:.2f}; "
              f"{len(p.inplace)} in-place, compile {secs * 1e3:.0f} ms")
        _bound(p)
        peaks = {}
        for mode in ("eager", "hybridized", "TrainStep"):
            net2 = mk()
            if mode == "hybridized":
                net2.hybridize()
            tr = hl.Trainer(net2.collect_params(), "sgd", {"learning_rate": 0.1})
            lf = hl.loss.SoftmaxCrossEntropyLoss()
            compiled = hl.TrainStep(net2, lf, tr) if mode == "TrainStep" else None

            def step():
                if compiled is not None:
                    compiled(x, y)
                else:
                    with autograd.record():
                        loss = lf(net2(x), y)
                    loss.backward()
                    tr.step(b)
                hl.waitall()
            step()
            tracemalloc.start()
            step()
            peaks[mode] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            if compiled is not None:
                p = compiled.last_program.memory_plan
                print(f"  {'':20s} whole step (hl.TrainStep: + SGD update, gradients inside): "
                      f"naive {p.naive_bytes / 2**20:.2f} MiB, planned {p.planned_bytes / 2**20:.2f} "
                      f"MiB, ratio {p.ratio:.2f} (target <= 0.5)")
                _bound(p)
                q = _plain_step_plan(mk, x, y)
                if q.live_peak_bytes != p.live_peak_bytes:
                    print(f"  {'':20s}   without releasing a ReLU output at its weight gradient "
                          f"(hybridl.graph.step._release_relu_inputs): naive "
                          f"{q.naive_bytes / 2**20:.2f} MiB, most bytes live at once "
                          f"{q.live_peak_bytes / 2**20:.3f} MiB; the release's peak / that "
                          f"program's naive bytes: {p.live_peak_bytes / q.naive_bytes:.2f}")
        print(f"  {'':20s} tracemalloc peak per step: eager {peaks['eager'] / 2**20:.2f} MiB, "
              f"hybridized {peaks['hybridized'] / 2**20:.2f} MiB "
              f"({peaks['hybridized'] / peaks['eager']:.2f}x), TrainStep "
              f"{peaks['TrainStep'] / 2**20:.2f} MiB ({peaks['TrainStep'] / peaks['eager']:.2f}x)")


def compile_times():
    print("\n== Compile time (trace + passes + codegen, training signature: fwd + bwd) ==")
    for name, mk, shape in (("mlp", lambda: hl.models.mlp(), (32, 784)),
                            ("lenet", lambda: hl.models.lenet(10, 28), (128, 1, 28, 28)),
                            ("resnet18", lambda: hl.models.resnet18(10), (8, 3, 32, 32))):
        net = mk()
        net.initialize()
        x = hl.nd.array(np.random.rand(*shape).astype(np.float32))
        net(x)
        net.hybridize()
        t0 = time.perf_counter()
        with autograd.record():
            out = net(x)
        t = time.perf_counter() - t0
        out.wait_to_read()
        print(f"  {name:10s} {t * 1e3:8.1f} ms" + ("  (target < 1 s)" if name == "lenet" else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args(argv)
    classic(not args.no_peers)
    memory()
    compile_times()
    print("\nTraining steps hybridized: run benchmarks/train_step.py")


if __name__ == "__main__":
    main()
