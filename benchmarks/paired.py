"""LeNet training step, hybridl vs PyTorch taking turns: drift-free ratios across processes.

The peers of ``benchmarks/train_step.py`` each run in their own process at another moment, and
this machine's speed drifts (the same hybridl LeNet step took 15 to 34 ms within one hour), so
a ratio between two such runs mostly measures the drift. Here PyTorch runs in a helper process
that stays alive, and the two frameworks take turns: a round times ``--inner`` steps of every
configuration back to back (hybridl in this process while the helper waits on its pipe, then
each PyTorch configuration in the helper while this process waits), and the ratios are the
medians over ``--rounds`` rounds of the per-round ratios. Separate processes keep each
framework's threads and allocator to itself, as in its own benchmark; taking turns makes both
see the same machine. Between turns both processes pause ``--pause`` seconds: idle BLAS and
OpenMP threads spin for a while after their last parallel region (OpenBLAS up to about 0.1 s),
and a spinning thread of the waiting process would slow the other's turn.

Workload (../shared/bench/peers.py, its init and data): LeNet (conv 6@5x5 pad 2, avg-pool 2,
conv 16@5x5, avg-pool 2, dense 120-84-10, ReLU) on 1x28x28, batch 128, softmax cross-entropy,
SGD lr 0.1. Targets: hybridl eager <= 1.0x PyTorch eager (issue 3); hybridl hybridized
(``hl.TrainStep``) <= 1.0x torch.compile (issue 4).

    python benchmarks/paired.py [--rounds 9] [--inner 3] [--no-compile]

Needs PyTorch (``pip install torch==2.13.0``, a CPU build); prints a note and exits 0 without it.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import _has, peers_script  # noqa: E402


# ============================================================================ helper (PyTorch)

def _serve(use_compile):
    """The PyTorch side: build the steps, then answer ``name n`` lines with the seconds that
    n steps took (one float per line); ``quit`` ends it."""
    import importlib.util

    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    spec = importlib.util.spec_from_file_location("_peers", peers_script())
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    peers.set_torch_threads(2)
    torch.manual_seed(peers.SEED)
    (c1W, c1b), (c2W, c2b), (d1W, d1b), (d2W, d2b), (d3W, d3b) = peers.lenet_params()
    xs, ys = peers.train_data(128, (1, 28, 28))
    m = tnn.Sequential(tnn.Conv2d(1, 6, 5, padding=2), tnn.ReLU(), tnn.AvgPool2d(2),
                       tnn.Conv2d(6, 16, 5), tnn.ReLU(), tnn.AvgPool2d(2), tnn.Flatten(),
                       tnn.Linear(400, 120), tnn.ReLU(), tnn.Linear(120, 84), tnn.ReLU(),
                       tnn.Linear(84, 10))
    with torch.no_grad():
        for layer, (w, b) in zip([m[0], m[3], m[7], m[9], m[11]],
                                 [(c1W, c1b), (c2W, c2b), (d1W, d1b), (d2W, d2b), (d3W, d3b)]):
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
    txs = [torch.from_numpy(x) for x in xs]
    tys = [torch.from_numpy(y) for y in ys]
    opt = torch.optim.SGD(m.parameters(), lr=peers.LR)
    state = {"i": 0}

    def make(fwd_loss):
        def step():
            i = state["i"]
            state["i"] = (i + 1) % len(txs)
            opt.zero_grad(set_to_none=True)
            loss = fwd_loss(txs[i], tys[i])
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    steps = {"torch eager": make(lambda x, y: F.cross_entropy(m(x), y))}
    if use_compile:
        steps["torch.compile"] = make(torch.compile(lambda x, y: F.cross_entropy(m(x), y)))
    for f in steps.values():                # warm-up (and compilation)
        for _ in range(3):
            f()
    print(" ".join(s.replace(" ", "_") for s in steps), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            break
        f, n = steps[parts[0].replace("_", " ")], int(parts[1])
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        print(time.perf_counter() - t0, flush=True)


# ============================================================================ driver (hybridl)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds of quiet between turns (default 0.3)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.inner < 1 or not args.pause >= 0:
        ap.error(f"--rounds, --inner: expected integers >= 1, --pause seconds >= 0; got "
                 f"{args.rounds}, {args.inner}, {args.pause}")
    if args.serve:
        _serve(not args.no_compile)
        return
    if not _has("torch") or peers_script() is None:
        print("paired.py: needs PyTorch and ../shared/bench/peers.py; skipped")
        return
    import hybridl as hl
    from train_step import hybridl_step, lenet_net
    cmd = [sys.executable, os.path.abspath(__file__), "--serve"] + (["--no-compile"] if args.no_compile else [])
    helper = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        names = helper.stdout.readline().split()
        if not names:
            raise RuntimeError("the PyTorch helper process failed to start (see its error above)")
        mine = {"hybridl eager": hybridl_step(lenet_net, 128, (1, 28, 28), "eager")[0],
                "hybridl hybridized loop": hybridl_step(lenet_net, 128, (1, 28, 28), "hybridized")[0],
                "hybridl TrainStep": hybridl_step(lenet_net, 128, (1, 28, 28), "compiled")[0]}
        for f in mine.values():
            for _ in range(2):
                f()

        def theirs(name):
            helper.stdin.write(f"{name} {args.inner}\n")
            helper.stdin.flush()
            return float(helper.stdout.readline())
        times = {k: [] for k in list(mine) + [n.replace("_", " ") for n in names]}
        for _ in range(args.rounds):
            for k, f in mine.items():
                time.sleep(args.pause)
                t0 = time.perf_counter()
                for _ in range(args.inner):
                    f()
                times[k].append((time.perf_counter() - t0) / args.inner)
            for n in names:
                time.sleep(args.pause)
                times[n.replace("_", " ")].append(theirs(n) / args.inner)
        helper.stdin.write("quit\n")
        helper.stdin.flush()
    finally:
        helper.stdin.close()
        helper.wait(timeout=60)
    print(f"hybridl {hl.__version__}, cores {os.cpu_count()}: LeNet training step, batch 128, "
          f"hybridl and PyTorch in turns ({args.rounds} rounds x {args.inner} steps each)")
    for k, v in times.items():
        print(f"  {k:26s} {statistics.median(v) * 1e3:8.2f} ms  (rounds {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})")
    for peer, target in (("torch eager", "hybridl eager"), ("torch.compile", "hybridl TrainStep"),
                         ("torch.compile", "hybridl hybridized loop")):
        if peer in times:
            r = [a / b for a, b in zip(times[target], times[peer])]
            print(f"  {target} / {peer}: {statistics.median(r):.2f}x "
                  f"(per-round ratios {min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
