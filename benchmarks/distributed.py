"""Multi-process (MPI) benchmark: data-parallel weak scaling, allreduce latency and bandwidth.

    python benchmarks/distributed.py [--quick] [--bind core|none] [--batch 256 ...] [--json out.json]

Needs mpi4py and mpiexec (``pip install 'hybridl[mpi]'``). The script is a driver: it runs
itself under ``mpiexec -n 1`` and ``-n 2`` (worker mode) and prints the figures.

1. Training throughput, weak scaling: every rank trains on its own batch of 64 synthetic
   samples per step (MLP 784-512-256-10 and LeNet on 1x28x28, hybridized, SGD with momentum,
   kvstore 'dist' with 2 ranks), ONE BLAS thread per rank (``OPENBLAS_NUM_THREADS=1`` and
   ``hybridl.ops._blas.set_budget(1)``) and, by default, every rank pinned to its own core
   (``--bind core``: ``mpiexec -bind-to core``) so that N ranks use N cores. Weak-scaling
   efficiency = throughput(N ranks) / (N x throughput(1 rank)) = time per step of 1 rank /
   time per step of N ranks; 100% means communication is free (hidden behind compute or
   negligible).

   The figure (section 1) is measured *interleaved*, in one 2-rank job that alternates ~0.1 s
   phases: one rank trains alone (its own model, no kvstore; the other rank sleeps, so its
   core is idle as in a 1-rank job; the ranks take turns), then both train together with
   kvstore 'dist'. Efficiency = median over ``--cycles`` of (alone / together) time per step.
   Row "no comm (floor)": both ranks train at once, each its own model with no kvstore (the
   slower rank's time): what running two processes side by side costs without any
   communication (shared memory bandwidth and caches, the VM's neighbours), the most the
   other rows could reach.
   This VM's speed drifts by up to 2x within seconds; separate 1-rank and 2-rank jobs do not
   share that drift, a cycle's two phases mostly do (separate jobs gave 47-92% for the same
   code; interleaved cycles agree to a few percent). Section 1b (``--separate``, and always
   without ``--quick``) times separate 1-rank and 2-rank jobs in ``--rounds`` back-to-back
   pairs, as before, and reports samples/s. ``--batch B ...`` ALSO reports the MLP at other
   per-rank batch sizes there (labelled ``mlp@B``): the allreduce per step is the same 2 MB
   whatever the batch, so a larger batch shows how much of the loss is that fixed cost.
2. Allreduce (sum, float32) over 2 ranks vs message size: latency (median time of one call)
   and bus bandwidth ``2 (n-1)/n x bytes / time`` (the traffic each rank sends in a ring
   allreduce; NCCL-tests' definition), for mpi4py's ``Allreduce`` on NumPy arrays (the MPI
   library alone), for the kvstore's shared-window path (``hybridl.distributed._shm``: the
   write of this rank's row, the busy-flag exchange, the two barriers and the blocked sum), and
   for ``hl.distributed.allreduce`` (an engine op on the communication queue, waited for: adds
   the push, the worker hand-over and the copies into a fresh buffer).

Every measurement is repeated (median reported; the spread is printed too). Figures are of one small machine where ranks share memory: the
"network" is shared-memory copies, so bandwidth is memcpy-bound, not link-bound.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PER_RANK_BATCH = 64


# ============================================================================ worker side


def _worker_train(args):
    from hybridl.ops import _blas
    import hybridl as hl
    from hybridl import autograd, distributed as dist
    rank, size = dist.init()
    _blas.set_budget(1)
    net = _build(args)
    rng = np.random.default_rng(rank)
    B = args.batch_size
    xs = [hl.nd.array(rng.standard_normal((B, 1, 28, 28)).astype(np.float32)) for _ in range(4)]
    ys = [hl.nd.array(rng.integers(0, 10, B).astype(np.float32)) for _ in range(4)]
    with autograd.predict_mode():
        net(xs[0]).wait_to_read()        # deferred shapes, before the Trainer broadcasts
    net.hybridize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                         kvstore="dist" if size > 1 else None)
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()

    def step(i):
        x, y = xs[i % 4], ys[i % 4]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(B)
        return loss

    for i in range(args.warmup):
        step(i)
    hl.waitall()
    dist.barrier()
    times = []
    for _ in range(args.trials):
        t0 = time.perf_counter()
        for i in range(args.steps):
            last = step(i)
        last.wait_to_read()
        hl.waitall()
        dist.barrier()                  # the slowest rank sets the pace
        times.append(time.perf_counter() - t0)
    if rank == 0:
        sps = [size * B * args.steps / t for t in times]
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "ranks": size, "samples_per_s": sps}, f)


def _build(args):
    import hybridl as hl
    from hybridl import models, nn
    hl.random.seed(0)
    if args.model == "mlp":
        net = nn.HybridSequential()
        net.add(nn.Flatten(), nn.Dense(512, in_units=784, activation="relu"),
                nn.Dense(256, in_units=512, activation="relu"), nn.Dense(10, in_units=256))
    else:
        net = models.lenet(10, input_size=28)
    net.initialize()
    return net


def _worker_interleaved(args):
    """One 2-rank job that alternates phases: one rank trains alone (no kvstore: the 1-rank
    figure) while the other sleeps (its core idle, as in a 1-rank job), then both train together
    (kvstore 'dist'). Phases last ~0.1 s, so the VM's speed drift, which separate jobs seconds
    apart do not share, cancels in each cycle's ratio."""
    from hybridl.ops import _blas
    import hybridl as hl
    from hybridl import autograd, distributed as dist
    from hybridl.distributed._backend import state
    rank, size = dist.init()
    assert size == 2, "interleaved mode runs with 2 ranks"
    _blas.set_budget(1)
    comm = state.mpi.COMM_WORLD
    B = args.batch_size
    rng = np.random.default_rng(rank)
    xs = [hl.nd.array(rng.standard_normal((B, 1, 28, 28)).astype(np.float32)) for _ in range(4)]
    ys = [hl.nd.array(rng.integers(0, 10, B).astype(np.float32)) for _ in range(4)]
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    steps = {}
    modes = ("alone", "together", "sharded")
    for mode in modes:
        net = _build(args)
        with autograd.predict_mode():
            net(xs[0]).wait_to_read()
        net.hybridize()
        trainer = hl.Trainer(net.collect_params(), "sgd",
                             {"learning_rate": 0.01, "momentum": 0.9},
                             kvstore=None if mode == "alone" else "dist",
                             update_on_kvstore=True if mode == "sharded" else None)

        def step(i, net=net, trainer=trainer):
            with autograd.record():
                loss = loss_fn(net(xs[i % 4]), ys[i % 4])
            loss.backward()
            trainer.step(B)
            return loss
        steps[mode] = step

    def phase(mode, n):
        t0 = time.perf_counter()
        for i in range(n):
            last = steps[mode](i)
        last.wait_to_read()
        hl.waitall()
        return (time.perf_counter() - t0) / n

    def idle_until_partner_done():     # sleep, do not spin: this core must be idle
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    for mode in modes * 2:          # warm-up
        phase(mode, args.warmup)
    comm.Barrier()
    alone, together, sharded, both = [], [], [], []
    for c in range(args.cycles):
        solo = c % 2                # the ranks take turns, so both cores are measured alone
        comm.Barrier()
        if rank == solo:
            alone.append(phase("alone", args.steps))
            comm.Ibarrier().Wait()
        else:
            idle_until_partner_done()
        comm.Barrier()                      # both ranks, each alone: no communication at all
        both.append(comm.allreduce(phase("alone", args.steps), op=state.mpi.MAX))
        for mode, got in (("together", together), ("sharded", sharded)):
            comm.Barrier()
            t = phase(mode, args.steps)
            got.append(comm.allreduce(t, op=state.mpi.MAX))
    alone = comm.gather(alone, root=0)
    if rank == 0:
        a = [alone[c % 2][c // 2] for c in range(args.cycles)]     # cycle c's lone rank
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "alone_s": a, "together_s": together, "both_s": both,
                       "sharded_s": sharded}, f)


def _worker_allreduce(args):
    import hybridl as hl
    from hybridl import distributed as dist
    from hybridl.distributed._backend import state
    from hybridl.distributed._shm import SharedBuckets
    rank, size = dist.init()
    MPI, comm = state.mpi, state.comm
    res = []
    for nbytes in args.sizes:
        n = max(1, nbytes // 4)
        a = np.ones(n, dtype=np.float32)
        x = hl.nd.array(a)
        reps = max(5, min(2000, int(2e8 / max(nbytes, 1) / 50)))
        if args.quick:
            reps = max(3, reps // 4)
        out = {}
        shared = SharedBuckets(state.node, MPI, n, np.float32)
        for name in ("mpi4py", "shared", "hybridl"):
            def call(name=name):
                if name == "mpi4py":
                    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                elif name == "shared":
                    rows = shared.acquire()
                    rows[rank] = a
                    shared.allreduce(rows)
                    del rows
                else:
                    dist.allreduce(x, check=False).wait_to_read()
            for _ in range(3):
                call()
            samples = []
            for _ in range(args.trials):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    call()
                samples.append((time.perf_counter() - t0) / reps)
            # every rank's time: the job's time is the slowest rank's
            worst = comm.allreduce(statistics.median(samples), op=MPI.MAX)
            out[name] = worst
        res.append({"bytes": n * 4, **out})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": size, "allreduce": res}, f)


# ============================================================================ driver side


# mpiexec options per --bind mode (MPICH hydra / Open MPI both spell it "-bind-to core")
_BIND = {"core": ["-bind-to", "core"], "none": []}
_bind_mode = "core"


def _run(mpiexec, n, argv, timeout=600):
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [mpiexec, *_BIND[_bind_mode], "-n", str(n), sys.executable, os.path.abspath(__file__),
           "--worker", *argv, "--out", out]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def _fmt_bytes(b):
    for unit, s in (("MB", 2 ** 20), ("KB", 2 ** 10)):
        if b >= s:
            return f"{b / s:g} {unit}"
    return f"{b} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and sizes")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, choices=("train", "interleaved", "allreduce"),
                   help=argparse.SUPPRESS)
    p.add_argument("--cycles", type=int, default=20,
                   help="alone/together cycles of the interleaved measurement (default 20)")
    p.add_argument("--separate", action="store_true",
                   help="also time 1-rank and 2-rank jobs run separately, back to back (on "
                        "always without --quick)")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="(1 rank, 2 ranks) pairs (default 3)")
    p.add_argument("--sizes", type=int, nargs="*", default=None,
                   help="message sizes in bytes of the allreduce table (default 4 B to 64 MB)")
    p.add_argument("--batch", type=int, nargs="*", default=[],
                   help="also report the MLP at these per-rank batch sizes (extra rows 'mlp@B'; "
                        f"the default figures stay at {PER_RANK_BATCH} per rank)")
    p.add_argument("--batch-size", type=int, default=PER_RANK_BATCH, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--bind", default="core", choices=("core", "none"),
                   help="core (default): every rank pinned to its own core (mpiexec -bind-to "
                        "core), so 1 rank uses 1 core and N ranks N cores -- the usual weak-"
                        "scaling set-up; none: the OS places the threads (a single rank then "
                        "also uses the other core for its frontend/engine threads)")
    args = p.parse_args()
    global _bind_mode
    _bind_mode = args.bind
    if args.worker == "train":
        return _worker_train(args)
    if args.worker == "interleaved":
        return _worker_interleaved(args)
    if args.worker == "allreduce":
        return _worker_allreduce(args)

    from hybridl.distributed.launch import find_mpiexec
    import importlib.util
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        print("benchmarks/distributed.py: needs mpi4py and mpiexec (pip install 'hybridl[mpi]')")
        return 1
    from _common import machine_line
    print(machine_line())
    print(f"mpiexec: {mpiexec}; cores: {os.cpu_count()}; BLAS threads per rank: 1; "
          f"binding: {'one core per rank' if args.bind == 'core' else 'none'}")
    steps = 15 if args.quick else args.steps
    trials = 3 if args.quick else args.trials
    report = {"training": [], "allreduce": None}

    cycles = max(2, args.cycles // 2 if args.quick else args.cycles)
    print(f"\n1. Weak scaling, interleaved in one 2-rank job: {PER_RANK_BATCH} samples per rank "
          f"per step; {cycles} cycles of (one rank trains alone for the 1-rank figure while the "
          f"other sleeps, then both train with no kvstore, then with kvstore 'dist', then with kvstore 'dist' "
          f"and update_on_kvstore=True), ~0.1 s each phase, so the VM's drift cancels in each "
          f"cycle; efficiency = time per step alone / together, median of the cycles "
          f"[quartiles]. 'no comm (floor)': both ranks train at once with no kvstore (the slower "
          f"one's time). 'allreduce': the gradients summed on every rank, each rank updates "
          f"every parameter; 'sharded update': each rank sums and updates half of the "
          f"parameters, in one shared copy (Trainer(..., update_on_kvstore=True))")
    print(f"{'model':<9}{'path':<17}{'alone ms':>10}{'2 ranks ms':>12}{'efficiency':>12}"
          f"{'quartiles':>14}")
    report["interleaved"] = []
    for model in ("mlp", "lenet"):
        n_steps = 30 if model == "mlp" else 12
        d = _run(mpiexec, 2, ["interleaved", "--model", model, "--steps", str(n_steps),
                              "--cycles", str(cycles), "--batch-size", str(PER_RANK_BATCH)])
        a_ms = statistics.median(d["alone_s"]) * 1e3
        for path, key in (("no comm (floor)", "both_s"), ("allreduce", "together_s"),
                          ("sharded update", "sharded_s")):
            effs = sorted(a / t for a, t in zip(d["alone_s"], d[key]))
            q = statistics.quantiles(effs, n=4) if len(effs) >= 2 else [effs[0]] * 3
            t_ms = statistics.median(d[key]) * 1e3
            report["interleaved"].append({"model": model, "path": path, "alone_ms": a_ms,
                                          "together_ms": t_ms, "efficiency": q[1],
                                          "efficiency_per_cycle": effs})
            print(f"{model:<9}{path:<17}{a_ms:>10.2f}{t_ms:>12.2f}{q[1] * 100:>11.0f}%"
                  f"{f'[{q[0] * 100:.0f}-{q[2] * 100:.0f}%]':>14}")

    rounds = 2 if args.quick else args.rounds
    runs = [] if args.quick and not args.separate else [("mlp", PER_RANK_BATCH),
                                                        ("lenet", PER_RANK_BATCH)]
    runs += [("mlp", b) for b in args.batch if b != PER_RANK_BATCH]
    if runs:
        print(f"\n1b. Weak scaling, separate jobs: {PER_RANK_BATCH} samples per rank per step, "
              f"{steps} steps x {trials} trials per process, {rounds} rounds of (1 rank, 2 ranks) back to back; "
              f"samples/s: median over rounds [min-max]; efficiency: median of the rounds' "
              f"paired ratios (the VM's speed drifts; a pair measured together cancels most of it)")
        print(f"{'model':<9}{'ranks':>4}{'samples/s':>12}{'range':>20}{'efficiency':>12}  per round")
        for model, batch in runs:
            meds = {1: [], 2: []}
            label = model if batch == PER_RANK_BATCH else f"{model}@{batch}"
            for _ in range(rounds):
                for n in (1, 2):
                    d = _run(mpiexec, n, ["train", "--model", model, "--steps", str(steps),
                                          "--trials", str(trials), "--batch-size", str(batch)])
                    meds[n].append(statistics.median(d["samples_per_s"]))
            effs = [b / (2 * a) for a, b in zip(meds[1], meds[2])]
            for n in (1, 2):
                med = statistics.median(meds[n])
                eff = 1.0 if n == 1 else statistics.median(effs)
                report["training"].append({"model": model, "batch_per_rank": batch, "ranks": n,
                                           "samples_per_s": med,
                                           "min": min(meds[n]), "max": max(meds[n]), "efficiency": eff,
                                           **({"efficiency_per_round": effs} if n == 2 else {})})
                per = "" if n == 1 else "  " + " ".join(f"{e * 100:.0f}%" for e in effs)
                print(f"{label:<9}{n:>4}{med:>12.0f}{f'[{min(meds[n]):.0f}-{max(meds[n]):.0f}]':>20}"
                      f"{eff * 100:>11.0f}%{per}")

    sizes = [4 * 4 ** i for i in range(0, 13)]          # 4 B .. 64 MB
    if args.quick:
        sizes = sizes[::2]
    if args.sizes:
        sizes = args.sizes
    d = _run(mpiexec, 2, ["allreduce", "--trials", str(3 if args.quick else 5), "--sizes",
                          *map(str, sizes)] + (["--quick"] if args.quick else []))
    report["allreduce"] = d["allreduce"]
    n = d["ranks"]
    print(f"\n2. Allreduce (sum, float32) over {n} ranks: latency and bus bandwidth "
          f"2(n-1)/n x bytes / time")
    names = ("mpi4py", "shared", "hybridl")
    print(f"{'size':>10}" + "".join(f"{k:>12}" for k in names)
          + "".join(f"{k + ' GB/s':>14}" for k in names))
    for r in d["allreduce"]:
        bw = [2 * (n - 1) / n * r["bytes"] / r[k] / 1e9 for k in names]
        print(f"{_fmt_bytes(r['bytes']):>10}" + "".join(f"{r[k] * 1e6:>10.1f}us" for k in names)
              + "".join(f"{b:>14.2f}" for b in bw))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main() or 0)
