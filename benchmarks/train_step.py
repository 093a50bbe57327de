"""Per-step training time: hybridl (eager and hybridized) vs NumPy by hand vs PyTorch eager /
torch.compile vs jax.jit, on the workloads of ../shared/bench/peers.py:

* MLP 784-256-128-10, softmax cross-entropy, SGD lr 0.1, batch 32 and 256;
* LeNet (conv 6@5x5 pad 2, avg-pool 2, conv 16@5x5, avg-pool 2, dense 120-84-10, ReLU) on
  1x28x28, batch 128, SGD lr 0.1.

Same initial weights (the peers' init) and the same batches for every framework. hybridl runs
three ways: eager (the Gluon loop: record, backward, ``trainer.step``), hybridized (the same loop
on a hybridized net: forward and backward are compiled programs) and ``hl.TrainStep`` (forward,
loss, backward and SGD update compiled into ONE program, as ``jax.jit`` of a train step).
Targets (issue 3, eager): MLP b256 <= 1.15x NumPy by hand; LeNet <= 1.0x PyTorch eager. (issue
4, hybridized): MLP b32 <= 1.0x jax.jit; MLP b256 <= best peer; LeNet <= torch.compile.

    python benchmarks/train_step.py [--no-peers] [--only mlp32,mlp256,lenet]
    taskset -c 0 python benchmarks/train_step.py --only mlp32   # all on one core, as jax_jit_t1

With JAX installed the MLP rows also time the peers' jax.jit step in this process, interleaved
(a ratio free of the machine's drift); pinned to one core that is the issue's "jax.jit (1 core)".
The MLP rows also time the step's matrix products alone ("GEMMs alone", hybridl's layouts):
the BLAS floor of any NumPy-based step, against which hybridl's overhead and the peers that
bring their own GEMM kernels (XLA, oneDNN) can be read.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import run_peer, table  # noqa: E402

import hybridl as hl  # noqa: E402
from hybridl import autograd, nn  # noqa: E402

SEED, LR, NPOOL = 0, 0.1, 16


def _init_linear(rng, fi, fo):
    b = 1.0 / np.sqrt(fi)
    return rng.uniform(-b, b, (fo, fi)).astype(np.float32), rng.uniform(-b, b, (fo,)).astype(np.float32)


def _init_conv(rng, ci, co, k):
    b = 1.0 / np.sqrt(ci * k * k)
    return rng.uniform(-b, b, (co, ci, k, k)).astype(np.float32), rng.uniform(-b, b, (co,)).astype(np.float32)


def mlp_net():
    rng = np.random.default_rng(SEED)
    net = nn.HybridSequential()
    net.add(nn.Dense(256, activation="relu", in_units=784), nn.Dense(128, activation="relu", in_units=256),
            nn.Dense(10, in_units=128))
    net.initialize()
    for layer, (fi, fo) in zip(net, [(784, 256), (256, 128), (128, 10)]):
        w, b = _init_linear(rng, fi, fo)
        layer.weight.set_data(w)
        layer.bias.set_data(b)
    return net


def lenet_net():
    rng = np.random.default_rng(SEED)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(6, 5, padding=2, activation="relu", in_channels=1), nn.AvgPool2D(2),
            nn.Conv2D(16, 5, activation="relu", in_channels=6), nn.AvgPool2D(2), nn.Flatten(),
            nn.Dense(120, activation="relu", in_units=400), nn.Dense(84, activation="relu", in_units=120),
            nn.Dense(10, in_units=84))
    net.initialize()
    vals = [_init_conv(rng, 1, 6, 5), _init_conv(rng, 6, 16, 5), _init_linear(rng, 400, 120),
            _init_linear(rng, 120, 84), _init_linear(rng, 84, 10)]
    layers = [net[0], net[2], net[5], net[6], net[7]]
    for layer, (w, b) in zip(layers, vals):
        layer.weight.set_data(w)
        layer.bias.set_data(b)
    return net


def data(batch, shape):
    rng = np.random.default_rng(SEED + 1)
    xs = [hl.nd.array(rng.random((batch,) + shape, dtype=np.float32)) for _ in range(NPOOL)]
    ys = [hl.nd.array(rng.integers(0, 10, size=batch).astype(np.int64)) for _ in range(NPOOL)]
    return xs, ys


def numpy_mlp_step(batch):
    """The peers' "NumPy by hand" MLP step (../shared/bench/peers.py, same algorithm and init),
    built here so that it runs in this process, interleaved with hybridl."""
    rng = np.random.default_rng(SEED)
    params = [_init_linear(rng, fi, fo) for fi, fo in [(784, 256), (256, 128), (128, 10)]]
    W = [np.ascontiguousarray(w.T) for w, _ in params]
    B = [b.copy() for _, b in params]
    drng = np.random.default_rng(SEED + 1)
    xs = [drng.random((batch, 784), dtype=np.float32) for _ in range(NPOOL)]
    ys = [drng.integers(0, 10, size=batch).astype(np.int64) for _ in range(NPOOL)]
    lr = np.float32(LR)
    st = {"i": 0}

    def step():
        i = st["i"]
        st["i"] = (i + 1) % NPOOL
        x, y = xs[i], ys[i]
        n = x.shape[0]
        h1 = x @ W[0]; h1 += B[0]; a1 = np.maximum(h1, 0)          # noqa: E702
        h2 = a1 @ W[1]; h2 += B[1]; a2 = np.maximum(h2, 0)         # noqa: E702
        z = a2 @ W[2]; z += B[2]                                   # noqa: E702
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z); s = e.sum(axis=1, keepdims=True)            # noqa: E702
        ar = np.arange(n)
        loss = -(z[ar, y] - np.log(s[:, 0])).mean()
        dz = e / s; dz[ar, y] -= 1; dz /= n                        # noqa: E702
        gW2 = a2.T @ dz; gB2 = dz.sum(0)                           # noqa: E702
        da2 = dz @ W[2].T; da2 *= (h2 > 0)                         # noqa: E702
        gW1 = a1.T @ da2; gB1 = da2.sum(0)                         # noqa: E702
        da1 = da2 @ W[1].T; da1 *= (h1 > 0)                        # noqa: E702
        gW0 = x.T @ da1; gB0 = da1.sum(0)                          # noqa: E702
        for p, g in ((W[0], gW0), (W[1], gW1), (W[2], gW2), (B[0], gB0), (B[1], gB1), (B[2], gB2)):
            g *= lr; p -= g                                        # noqa: E702
        return loss
    return step


def jax_mlp_step(batch):
    """The peers' jax.jit MLP step (../shared/bench/peers.py: value_and_grad + SGD in one jitted
    function, blocked on every step), built here so that it runs in this process, interleaved
    with hybridl; None when JAX is not installed. Pin the process to one core (``taskset -c 0``)
    for the peers' "jax.jit (1 core)" conditions: then hybridl and NumPy get that core too."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    rng = np.random.default_rng(SEED)
    params = [_init_linear(rng, fi, fo) for fi, fo in [(784, 256), (256, 128), (128, 10)]]
    jp = [(jnp.asarray(np.ascontiguousarray(w.T)), jnp.asarray(b)) for w, b in params]
    drng = np.random.default_rng(SEED + 1)
    xs = [jnp.asarray(drng.random((batch, 784), dtype=np.float32)) for _ in range(NPOOL)]
    ys = [jnp.asarray(drng.integers(0, 10, size=batch).astype(np.int32)) for _ in range(NPOOL)]

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p[0][0] + p[0][1])
        h = jax.nn.relu(h @ p[1][0] + p[1][1])
        z = h @ p[2][0] + p[2][1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))

    @jax.jit
    def train(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - LR * b, p, g), loss
    st = {"p": jp, "i": 0}

    def step():
        i = st["i"]
        st["i"] = (i + 1) % NPOOL
        p, loss = train(st["p"], xs[i], ys[i])
        jax.block_until_ready((p, loss))
        st["p"] = p
        return loss
    return step


def gemm_floor_step(batch):
    """The matrix products of one MLP training step and nothing else, as hybridl's compiled
    step makes them (NumPy/OpenBLAS, weights (out, in): forward ``x @ w.T``, weight gradients
    ``g.T @ a``, input gradients ``g @ w`` for the two upper layers; outputs in preallocated
    buffers): a floor for any NumPy-based step, which shows how much of a step is BLAS time
    (and how far a peer with its own GEMMs is below it)."""
    rng = np.random.default_rng(SEED)
    dims = [(784, 256), (256, 128), (128, 10)]
    ws = [rng.standard_normal((fo, fi)).astype(np.float32) for fi, fo in dims]
    acts = [rng.random((batch, fi), dtype=np.float32) for fi, _ in dims]
    gs = [rng.random((batch, fo), dtype=np.float32) for _, fo in dims]
    ys = [np.empty((batch, fo), np.float32) for _, fo in dims]
    gws = [np.empty_like(w) for w in ws]
    gxs = [np.empty((batch, fi), np.float32) for fi, _ in dims]

    def step():
        for a, w, y in zip(acts, ws, ys):
            np.dot(a, w.T, out=y)
        for i in (2, 1, 0):
            np.dot(gs[i].T, acts[i], out=gws[i])
            if i:
                np.dot(gs[i], ws[i], out=gxs[i])
    return step


def interleaved(steps, inner, rounds=9):
    """Median ms per call of each of ``steps`` (name -> fn), timed in alternation (``rounds``
    rounds of ``inner`` calls each): the machine's speed drifts, so configurations compared
    by a ratio are timed side by side."""
    times = {k: [] for k in steps}
    for f in steps.values():
        for _ in range(3):
            f()
    for _ in range(rounds):
        for k, f in steps.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t0) / inner * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def hybridl_step(make_net, batch, shape, mode):
    """(step function that syncs, first losses) of a hybridl training step; ``mode``:
    'eager', 'hybridized' (the Gluon loop on a hybridized net) or 'compiled' (``hl.TrainStep``:
    forward, loss, backward and update in one program)."""
    net = make_net()
    if mode == "hybridized":
        net.hybridize()
    xs, ys = data(batch, shape)
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": LR})
    st = {"i": 0}
    compiled = hl.TrainStep(net, loss_fn, trainer) if mode == "compiled" else None

    def step():
        i = st["i"]
        st["i"] = (i + 1) % NPOOL
        if compiled is not None:
            return compiled(xs[i], ys[i])
        with autograd.record():
            loss = loss_fn(net(xs[i]), ys[i])
        loss.backward()
        trainer.step(batch)
        return loss

    def step_sync():
        step().wait_to_read()
        hl.waitall()
    losses = [float(step().mean().item()) for _ in range(3)]
    return step_sync, losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", default="mlp32,mlp256,lenet")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    peers = not args.no_peers
    print(f"hybridl {hl.__version__}, engine {hl.engine.get_engine().name}, cores {os.cpu_count()}")
    for key, batch in (("mlp32", 32), ("mlp256", 256)):
        if key not in only:
            continue
        inner = 20 if batch <= 32 else 5
        e, le = hybridl_step(mlp_net, batch, (784,), "eager")
        h, lh = hybridl_step(mlp_net, batch, (784,), "hybridized")
        c, lc = hybridl_step(mlp_net, batch, (784,), "compiled")
        steps = {"hybridl eager": e, "hybridl hybridized": h, "hybridl TrainStep": c,
                 "numpy by hand, this process": numpy_mlp_step(batch)}
        steps["GEMMs alone (hybridl's layouts)"] = gemm_floor_step(batch)
        jx = jax_mlp_step(batch) if peers else None
        if jx is not None:
            steps["jax.jit, this process"] = jx
        med = interleaved(steps, inner)
        rows = list(med.items())
        if peers:
            for fw in ("numpy", "torch_eager", "torch_compile", "jax_jit_t1", "jax_jit"):
                rows.append((fw, run_peer("mlp_train", f"{fw}@{batch}")))
        table(f"MLP 784-256-128-10 training step, batch {batch} (first losses eager {le[0]:.4f}, "
              f"hybridized {lh[0]:.4f}, TrainStep {lc[0]:.4f}; hybridl and NumPy by hand interleaved in this process, "
              f"peers in their own)", rows, ref="numpy by hand, this process")
        _ratios(rows, "jax_jit_t1" if batch == 32 else None)
    if "lenet" in only:
        e, le = hybridl_step(lenet_net, 128, (1, 28, 28), "eager")
        h, lh = hybridl_step(lenet_net, 128, (1, 28, 28), "hybridized")
        c, lc = hybridl_step(lenet_net, 128, (1, 28, 28), "compiled")
        rows = list(interleaved({"hybridl eager": e, "hybridl hybridized": h,
                                 "hybridl TrainStep": c}, 2, rounds=7).items())
        if peers:
            for fw in ("numpy_im2col", "torch_eager", "torch_compile", "jax_jit"):
                rows.append((fw, run_peer("cnn_train", fw)))
        table(f"LeNet training step, batch 128 (first losses eager {le[0]:.4f}, hybridized "
              f"{lh[0]:.4f}, TrainStep {lc[0]:.4f})", rows, ref="torch_eager")
        _ratios(rows, "torch_compile")


def _ratios(rows, target_peer=None):
    d = {k: v for k, v in rows if v is not None}
    here = d.get("numpy by hand, this process")
    floor = d.get("GEMMs alone (hybridl's layouts)")
    peers = {k: v for k, v in d.items() if not k.startswith(("hybridl", "GEMMs"))
             and k != "numpy by hand, this process"}
    mine = [k for k in ("hybridl eager", "hybridl hybridized", "hybridl TrainStep") if k in d]
    if here is not None:
        for k in mine:
            print(f"  {k} / NumPy by hand (same process, interleaved): {d[k] / here:.2f}x")
    jx = d.get("jax.jit, this process")
    if jx is not None:
        pinned = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        for k in mine:
            print(f"  {k} / jax.jit (same process, interleaved, {pinned} core(s)): {d[k] / jx:.2f}x")
        if floor is not None:
            print(f"  GEMMs alone / jax.jit (same process): {floor / jx:.2f}x (above 1: no step "
                  f"made of these NumPy/OpenBLAS products can match jax.jit here)")
    if floor is not None:
        for k in mine:
            print(f"  {k} / GEMMs alone: {d[k] / floor:.2f}x (the rest of the step: "
                  f"{(d[k] - floor) * 1e3:.0f} us)")
    peers = {k: v for k, v in peers.items() if k != "jax.jit, this process"}
    named = [(f"best peer ({min(peers, key=peers.get)})", min(peers, key=peers.get))] if peers else []
    if target_peer in peers:
        named.append((target_peer, target_peer))
    for label, peer in named:
        if floor is not None and here is not None and d.get("numpy"):
            print(f"  GEMMs alone / {label}: {floor / peers[peer]:.2f}x; drift-corrected by the "
                  f"two NumPy runs: {floor / here * d['numpy'] / peers[peer]:.2f}x (above 1: the "
                  f"peer's whole step is faster than these BLAS calls alone)")
        for k in mine:
            line = f"  {k} / {label}: {d[k] / peers[peer]:.2f}x"
            if here is not None and d.get("numpy"):
                # the peers ran in other processes, at other moments: rescale by the NumPy
                # step measured in both places (same code) to cancel the machine's drift
                line += f"; drift-corrected by the two NumPy runs: {d[k] / here * d['numpy'] / peers[peer]:.2f}x"
            print(line)


if __name__ == "__main__":
    main()
