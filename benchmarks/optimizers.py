"""Optimizer updates: hybridl vs NumPy by hand vs torch.optim, interleaved, ratios printed.

One update of every parameter of a model; torch.optim (CPU) only when torch is installed.

    python benchmarks/optimizers.py [--rounds 15] [--models mlp,resnet18] [--threads 1]

Parameter shapes: the MLP 784-512-256-10 of benchmarks/distributed.py (6 arrays, 0.54 M
values, 2.1 MB) and ResNet-18 for CIFAR (``hl.models.resnet18``: its 62 trainable arrays,
11.17 M values, 44.7 MB; the 40 BatchNorm running-statistics arrays are not updated by any
optimizer), float32, random gradients. Optimizers: SGD with momentum 0.9 and weight decay 5e-4,
Adam, AdamW (lr 1e-3, default betas). Per update (all arrays once) the median over
``--rounds`` interleaved rounds:

* hybridl: the optimizer's ``step_kernel`` over every array, in place (what the Trainer's one
  ``sgd_update[n]`` / ``adam_update[n]`` engine op runs);
* NumPy by hand: the textbook formulas, one NumPy expression per line (new arrays for the
  temporaries), states updated in place;
* torch.optim: ``opt.step()`` with ``.grad`` set (its default CPU implementation).

BLAS threads (hybridl, NumPy) and torch threads are set to ``--threads`` (default 1: an update
is memory-bound, and the comparison is per core).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybridl as hl  # noqa: E402
from hybridl.optim import optimizer as _opt  # noqa: E402

LR, MOM, WD = 1e-3, 0.9, 5e-4
B1, B2, EPS = 0.9, 0.999, 1e-8


def shapes(model):
    if model == "mlp":
        return [(512, 784), (512,), (256, 512), (256,), (10, 256), (10,)]
    net = hl.models.resnet18(10)
    net.initialize()
    with hl.autograd.predict_mode():
        net(hl.nd.array(np.zeros((1, 3, 32, 32), np.float32))).wait_to_read()
    # the trainable arrays (a Trainer updates no BatchNorm running statistics)
    return [tuple(p.shape) for p in net.collect_params().values() if p.grad_req != "null"]


def hybridl_update(name, ws, gs):
    opt = {"sgd": lambda: _opt.SGD(LR, momentum=MOM, wd=WD), "adam": lambda: _opt.Adam(LR),
           "adamw": lambda: _opt.AdamW(LR, wd=WD)}[name]()
    wd = WD if name != "adam" else 0.0
    states = [{k: np.zeros_like(w) for k in opt.state_names} for w in ws]
    t = [0]

    def step():
        t[0] += 1
        for w, g, st in zip(ws, gs, states):
            opt.step_kernel(w, g, st, LR, wd, t[0], 1.0, None, out=w)
    return step


def numpy_update(name, ws, gs):
    states = [[np.zeros_like(w), np.zeros_like(w)] for w in ws]
    t = [0]

    def step():
        t[0] += 1
        for w, g, st in zip(ws, gs, states):
            if name == "sgd":
                d = g + WD * w
                st[0] *= MOM
                st[0] += d
                w -= LR * st[0]
                continue
            if name == "adamw":
                w *= 1 - LR * WD
            st[0] *= B1
            st[0] += (1 - B1) * g
            st[1] *= B2
            st[1] += (1 - B2) * g * g
            mhat = st[0] / (1 - B1 ** t[0])
            vhat = st[1] / (1 - B2 ** t[0])
            w -= LR * mhat / (np.sqrt(vhat) + EPS)
    return step


def torch_update(name, ws, gs):
    import torch
    ps = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in ws]
    for p, g in zip(ps, gs):
        p.grad = torch.from_numpy(g.copy())
    opt = {"sgd": lambda: torch.optim.SGD(ps, lr=LR, momentum=MOM, weight_decay=WD),
           "adam": lambda: torch.optim.Adam(ps, lr=LR),
           "adamw": lambda: torch.optim.AdamW(ps, lr=LR, weight_decay=WD)}[name]()
    return opt.step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--models", default="mlp,resnet18")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        ap.error(f"--rounds and --threads: expected integers >= 1, got {args.rounds} and "
                 f"{args.threads}")
    models = args.models.split(",")
    bad = [m for m in models if m not in ("mlp", "resnet18")]
    if bad:
        ap.error(f"--models: expected names from mlp,resnet18, got {','.join(bad)}")
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
        print("torch is not installed: no torch.optim column (pip install -e '.[bench]')")
    rng = np.random.default_rng(0)
    with hl.engine.blas_threads(args.threads):
        for model in models:
            shp = shapes(model)
            n = sum(int(np.prod(s)) for s in shp)
            print(f"\n== {model}: {len(shp)} arrays, {n / 1e6:.2f} M float32 values; one update "
                  f"of all, median of {args.rounds} interleaved rounds, {args.threads} thread(s) ==")
            for name in ("sgd", "adam", "adamw"):
                gs = [rng.standard_normal(s).astype(np.float32) for s in shp]
                steps = {}
                for label, make in (("hybridl", hybridl_update), ("numpy by hand", numpy_update)) + (
                        (("torch.optim", torch_update),) if torch is not None else ()):
                    ws = [rng.standard_normal(s).astype(np.float32) for s in shp]
                    steps[label] = make(name, ws, gs)
                times = {k: [] for k in steps}
                for f in steps.values():
                    f()
                    f()
                for _ in range(args.rounds):
                    for k, f in steps.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
                label = {"sgd": f"SGD momentum {MOM} wd {WD}", "adam": "Adam",
                         "adamw": f"AdamW wd {WD}"}[name]
                cells = "  ".join(f"{k} {v:8.3f} ms" for k, v in med.items())
                ratios = "  ".join(f"hybridl/{k} {med['hybridl'] / v:.2f}x" for k, v in med.items()
                                   if k != "hybridl")
                print(f"  {label:26s} {cells}   {ratios}")


if __name__ == "__main__":
    main()
