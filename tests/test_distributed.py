"""hl.distributed: single-process behaviour (always), and 2-rank jobs under mpiexec (skipped when
mpi4py or mpiexec is missing: ``pip install 'hybridl[mpi]'``).

The MPI tests run small scripts with ``mpiexec -n 2`` in a subprocess and check values (2-rank
training == single-process training on the same global batch), the overlap of gradient
allreduce with backward in rank 0's profiler trace, and that mismatches and dead or hanging
ranks end the job with an error within a bounded time.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nn
from hybridl import distributed as dist
from hybridl.distributed.launch import _mapped_anywhere, find_mpiexec, remove_stale_shm, shm_files
from hybridl.distributed.launch import main as launch_main

# ============================================================================ single process


def test_init_without_launcher_is_single_process():
    env = {k: v for k, v in os.environ.items() if k not in dist._backend.LAUNCHER_VARS}
    code = ("import sys, hybridl.distributed as d; r = d.init(); "
            "print(r, d.rank(), d.size(), 'mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(0,", "1)", "0", "1", "False"]


def test_collectives_single_process_are_copies():
    x = hl.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3))
    for y in (dist.allreduce(x), dist.allreduce(x, "max"), dist.allreduce(x, "mean"),
              dist.broadcast(x, root=0)):
        assert y is not x and y.shape == x.shape and y.dtype == x.dtype
        np.testing.assert_array_equal(y.asnumpy(), x.asnumpy())
    dist.barrier()
    with pytest.raises(ValueError, match="op"):
        dist.allreduce(x, "median")
    with pytest.raises(ValueError, match="root"):
        dist.broadcast(x, root=1)
    with pytest.raises(TypeError, match="NDArray"):
        dist.allreduce(np.ones(3))
    # no MPI reduction for bool: refused at the call (under mpiexec it aborted the job)
    with pytest.raises(TypeError, match=r"integer or float array, got dtype bool.*astype"):
        dist.allreduce(hl.nd.array(np.array([True, False])))


@pytest.mark.parametrize("deferred", [False, True])
def test_dist_kvstore_single_process_matches_plain_training(deferred):
    # (deferred shapes: the first step's comparison of the ranks' values needs no MPI with
    # one process; it called a collective on no communicator, the README's snippet failed)
    def run(kvstore):
        hl.random.seed(3)
        net = nn.Sequential()
        net.add(nn.Dense(8, in_units=0 if deferred else 5, activation="relu"),
                nn.Dense(3, in_units=0 if deferred else 8))
        net.initialize()
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                        kvstore=kvstore)
        rng = np.random.default_rng(0)
        for _ in range(3):
            x = hl.nd.array(rng.standard_normal((6, 5)).astype(np.float32))
            y = hl.nd.array(rng.integers(0, 3, 6).astype(np.float32))
            with autograd.record():
                loss = hl.loss.SoftmaxCrossEntropyLoss()(net(x), y)
            loss.backward()
            tr.step(6)
        return [p.data().asnumpy() for p in net.collect_params().values()]

    for a, b in zip(run(None), run("dist")):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_dist_kvstore_interface():
    kv = hl.kv.create("dist_sync")
    assert kv.rank == 0 and kv.num_workers == 1
    w = [hl.nd.ones((4, 3)), hl.nd.ones((3,))]
    kv.init([0, 1], w)
    with pytest.raises(ValueError, match="already initialized"):
        kv.init(0, w[0])
    g = [hl.nd.full((4, 3), 2.0), hl.nd.full((3,), 5.0)]
    kv.pushpull(1, g[1])
    with pytest.raises(ValueError, match="pushed again"):
        kv.pushpull(1, g[1])
    kv.pushpull(0, g[0])
    with pytest.raises(ValueError, match="shape"):
        kv.pushpull(0, hl.nd.ones((2, 2)))
    with pytest.raises(KeyError):
        kv.pushpull(7, g[0])
    kv.push(0, g[0])
    out = hl.nd.zeros((4, 3))
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.asnumpy(), 2.0)
    assert [b["keys"] for b in kv.buckets] == [[1, 0]]
    with pytest.raises(ValueError, match="dist_async"):
        hl.kv.create("dist_async")
    for bad in (0, float("inf")):           # (inf: an OverflowError traceback)
        with pytest.raises(ValueError, match="bucket_mb"):
            dist.DistKVStore(bucket_mb=bad)


def test_launch_errors(capsys, monkeypatch):
    assert launch_main(["-n", "2", "--mpiexec", "/nonexistent/mpiexec", "--", "true"]) == 127
    assert "--mpiexec: no such program: '/nonexistent/mpiexec'" in capsys.readouterr().err
    monkeypatch.setattr("hybridl.distributed.launch.find_mpiexec", lambda explicit=None: None)
    assert launch_main(["-n", "2", "--", "true"]) == 127
    assert "mpiexec not found" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("HYBRIDL_MPIEXEC", "/nonexistent/mpiexec")   # not "install it"
    assert launch_main(["-n", "2", "--", "true"]) == 127
    err = capsys.readouterr().err
    assert "HYBRIDL_MPIEXEC: no such program: '/nonexistent/mpiexec'" in err
    assert "pip install" not in err
    monkeypatch.delenv("HYBRIDL_MPIEXEC")
    for bad in ("0", "0.05", "inf", "nan"):
        assert launch_main(["-n", "2", "--timeout", bad, "--", "true"]) == 2
        assert "--timeout: expected seconds, a finite number >= 0.1" in capsys.readouterr().err
    # --dry-run prints the environment the run would set too
    assert launch_main(["-n", "2", "--mpiexec", sys.executable, "--timeout", "5", "--dry-run",
                        "--", "python", "x.py"]) == 0
    assert capsys.readouterr().out.split()[0] == "HYBRIDL_DIST_TIMEOUT=5"
    assert launch_main(["-n", "2"]) == 2
    assert "no command" in capsys.readouterr().err
    assert launch_main(["-n", "0", "--", "true"]) == 2
    assert launch_main(["-n", "3", "--mpiexec", sys.executable, "--dry-run", "--", "python",
                        "x.py"]) == 0
    assert capsys.readouterr().out.split()[1:] == ["-n", "3", "python", "x.py"]


def test_shm_setting(monkeypatch):
    for value, want in (("1", True), (" 0 ", False)):
        monkeypatch.setenv("HYBRIDL_DIST_SHM", value)
        assert dist._backend._env_shm() is want
    monkeypatch.setenv("HYBRIDL_DIST_SHM", "yes")
    with pytest.raises(ValueError, match="HYBRIDL_DIST_SHM: expected 0 or 1, got 'yes'"):
        dist._backend._env_shm()


def test_shared_windows_need_room_in_dev_shm(monkeypatch):
    import types
    from hybridl.distributed import _shm
    mib = 2 ** 20

    def fs(free_mib, total_mib):
        return lambda path: types.SimpleNamespace(f_bavail=free_mib, f_frsize=mib,
                                                  f_blocks=total_mib)
    monkeypatch.setattr(os, "statvfs", fs(62, 64))      # Docker's default 64 MB /dev/shm
    assert _shm.has_room(32 * mib)                      # 32 + 16 + 6.4 <= 62
    assert not _shm.has_room(40 * mib)
    monkeypatch.setattr(os, "statvfs", fs(1000, 12000))
    assert not _shm.has_room(1 * mib)                   # the 10% margin: 1200 MiB
    monkeypatch.setattr(os, "statvfs", lambda path: (_ for _ in ()).throw(FileNotFoundError()))
    assert _shm.has_room(10 ** 12)                      # no /dev/shm: nothing to fill


def test_timeout_setting():
    old = dist.get_timeout()
    try:
        dist.set_timeout(5)
        assert dist.get_timeout() == 5.0
        for bad in (0, 1e-300, float("inf"), "x"):
            with pytest.raises(ValueError, match="a finite number >= 0.1"):
                dist.set_timeout(bad)
    finally:
        dist.set_timeout(old)


# ============================================================================ under mpiexec

MPIEXEC = find_mpiexec()
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None and MPIEXEC is not None
mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpi4py and mpiexec (pip install "
                                              "'hybridl[mpi]')")

# each step's global batch, and this rank's rows of it (the training scripts below)
_GLOBAL_BATCH = """
loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
rng = np.random.default_rng(1)
X = rng.standard_normal((steps, gb, dims[0])).astype(np.float32)
Y = rng.integers(0, dims[-1], (steps, gb)).astype(np.float32)
lo, hi = rank * gb // size, (rank + 1) * gb // size
"""

_TRAIN = """
import sys
import numpy as np
import hybridl as hl
from hybridl import distributed as dist, nn, autograd

out, mode = sys.argv[1], sys.argv[2]
rank, size = dist.init()
dist._shm.MIN_BYTES = 0     # this test's tiny buckets through the shared windows too
hl.random.seed(0)
if mode == "eq":
    dims, steps, gb = (20, 32, 16, 10), 5, 32
else:     # overlap: big enough layers that backward takes a while
    dims, steps, gb = (256, 768, 768, 768, 768, 10), 3, 256
net = nn.Sequential()
for i in range(1, len(dims)):
    net.add(nn.Dense(dims[i], in_units=dims[i - 1],
                     activation="relu" if i < len(dims) - 1 else None))
net.initialize()
if rank == 1:        # rank 0's parameters must win (broadcast at the Trainer's init)
    for p in net.collect_params().values():
        p.set_data(hl.nd.ones(p.shape))
kv = dist.DistKVStore(bucket_mb=0.001 if mode == "eq" else 1.0) if size > 1 else None
trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                     kvstore=kv)
""" + _GLOBAL_BATCH + """prof = None
kept, kept_np = [], []
for s in range(steps):
    if mode == "overlap" and s == steps - 1:
        hl.waitall()
        prof = hl.profiler.profile().start()
    x, y = hl.nd.array(X[s, lo:hi]), hl.nd.array(Y[s, lo:hi])
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(hi - lo)
    if s < 4:      # gradients kept by the user must not change when later steps reuse buffers
        # (steps 0-2 hold the 3 shared windows of each bucket; steps 3-4 fall back to MPI)
        kept += [p.grad().reshape(-1) for p in net.collect_params().values()]   # views
        kept_np += [k.asnumpy() for k in kept[len(kept_np):]]
hl.waitall()
for k, v in zip(kept, kept_np):
    assert np.array_equal(k.asnumpy(), v), "a kept gradient changed"
if kv is not None and mode == "eq" and rank == 0:
    print("windows", max((len(b.arrays) for b in kv._shared.values()), default=0))
if prof is not None:
    prof.stop()
if rank == 0:
    if prof is not None:
        prof.export_chrome_trace(out)
        print("buckets", len(kv.buckets))
    else:
        np.savez(out, *[p.data().asnumpy() for p in net.collect_params().values()])
"""

_TRAIN_SHARDED = """
import sys
import numpy as np
import hybridl as hl
from hybridl import distributed as dist, nn, autograd

out, opt = sys.argv[1], sys.argv[2]
rank, size = dist.init()
dist._shm.MIN_BYTES = 0
hl.random.seed(0)
dims, steps, gb = (20, 32, 16, 10), 6, 24
net = nn.Sequential()
for i in range(1, len(dims)):
    net.add(nn.Dense(dims[i], in_units=dims[i - 1], activation="relu" if i < len(dims) - 1 else None))
net.initialize()
params = list(net.collect_params().values())
params[1].lr_mult = 0.5
params[2].wd_mult = 2.0
if rank == 1:
    for p in params:
        p.set_data(hl.nd.ones(p.shape))
hp = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3} if opt == "sgd" else \
     {"learning_rate": 0.01, "wd": 1e-3}
kv = dist.DistKVStore(bucket_mb=float(sys.argv[3])) if size > 1 else None
trainer = hl.Trainer(net.collect_params(), opt, hp, kvstore=kv, update_on_kvstore=True if size > 1 else None)
""" + _GLOBAL_BATCH + """held = None
for s in range(steps):
    x, y = hl.nd.array(X[s, lo:hi]), hl.nd.array(Y[s, lo:hi])
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    grad0 = params[0].grad().asnumpy()
    trainer.step(hi - lo)
    if s == 1:            # a view of a weight, held: later updates must not change it
        held = params[0].data().reshape(-1)
        held_np = held.asnumpy()
    if s == 3:            # weights replaced (same values) on every rank
        for p in params:
            p.set_data(p.data().asnumpy())
hl.waitall()
assert np.array_equal(held.asnumpy(), held_np), "a held weight view changed"
vals = [p.data().asnumpy() for p in params]
if kv is not None:        # every rank ends with the same weights
    allv = dist._backend.state.comm.allgather(vals)
    for r in range(1, size):
        for a, b in zip(allv[0], allv[r]):
            assert np.array_equal(a, b), f"rank {r} differs"
if rank == 0:
    trainer.save_states(out + ".states")
    np.savez(out, *vals)
    if kv is not None:
        print("windows", {k: len(v[0]) for k, v in dist._shm._POOLS.items()})
"""

_SHARDED_EDGES = """
import sys
import numpy as np
import hybridl as hl
from hybridl import distributed as dist, nn, autograd

out, mode = sys.argv[1], sys.argv[2]
rank, size = dist.init()
dist._shm.MIN_BYTES = int(sys.argv[3])
K = 4 if mode == "ensemble" else 1       # 4 models of one shape: 4 parameter windows


def model():
    net = nn.HybridSequential()
    net.add(nn.Dense(64, in_units=20, activation="relu"), nn.Dense(10, in_units=64))
    net.initialize()
    return net


hl.random.seed(0)
nets = [model() for _ in range(K)]
opt = ("adam", {"learning_rate": 0.01}) if mode == "loadstates" else \
      ("sgd", {"learning_rate": 0.1, "momentum": 0.9})
kw = dict(kvstore="dist", update_on_kvstore=True) if size > 1 else {}
trs = [hl.Trainer(n.collect_params(), *opt, **kw) for n in nets]
lf = hl.loss.SoftmaxCrossEntropyLoss()
rngs = [np.random.default_rng(r) for r in range(2)]
held = []
for s in range(6):
    data = [(r.standard_normal((8, 20)).astype("float32"), r.integers(0, 10, 8).astype("float32"))
            for r in rngs]
    x, y = data[rank] if size > 1 else (np.concatenate([d[0] for d in data]),
                                        np.concatenate([d[1] for d in data]))
    for net, tr in zip(nets, trs):
        params = list(net.collect_params().values())
        if mode == "setdata_one" and s == 2 and rank == 1:     # rank 0's values must win
            for p in params:
                p.set_data(p.data().asnumpy() + 1)
        if mode == "loadstates" and s == 1:
            if rank == 0:
                tr.save_states(out + ".states")
            if size > 1:
                dist.barrier()                      # the file is there for rank 1
        if mode == "loadstates" and s == 4 and rank == 1 and size > 1:
            tr.load_states(out + ".states")         # an older file on rank 1 alone
        if mode == "add" and s == 3:                # then the ordinary path
            for p in params:
                p.grad_req = "add"
        for p in params:
            if p.grad_req == "add":
                p.zero_grad()
        with autograd.record():
            loss = lf(net(hl.nd.array(x)), hl.nd.array(y))
        loss.backward()
        if mode == "manual" and s >= 3:             # the ordinary path, by hand
            tr.allreduce_grads()
            tr.update(len(x))
        else:
            tr.step(len(x))
        if mode == "hold":                          # every window held: the fallback path
            held.append(params[0].data().reshape(-1))
hl.waitall()
vals = [p.data().asnumpy() for n in nets for p in n.collect_params().values()]
if size > 1:
    allv = dist._backend.state.comm.allgather(vals)
    for r in range(1, size):
        for a, b in zip(allv[0], allv[r]):
            assert np.array_equal(a, b), f"rank {r} differs"
if rank == 0:
    np.savez(out, *vals)
"""


@mpi
@pytest.mark.parametrize("mode,min_bytes", [
    ("ensemble", "0"), ("hold", "0"), ("add", "0"), ("manual", "0"), ("setdata_one", "0"),
    ("setdata_one", "32768"), ("loadstates", "0")])
def test_update_on_kvstore_edge_cases(tmp_path, mode, min_bytes):
    """From a break-it pass: 4 same-shaped models (the parameter pool held 3 windows) and
    weight views held at every step (no free window) took a fallback that summed rows still
    being written (ranks differed by 1e-2); the ordinary path after sharded steps updated the
    ONE shared momentum once per rank; set_data on rank 1 alone diverged on the private
    (small-bucket) path; load_states on rank 1 alone kept its own update counts (Adam's bias
    correction differed per block). Each now equals one process on the global batch (rank
    0's values win where one rank replaced them), on every rank."""
    script = _script(tmp_path, "edges.py", _SHARDED_EDGES)
    single = _single([script, str(tmp_path / "single.npz"), mode, "0"])
    assert single.returncode == 0, single.stderr
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "dist.npz"), mode, min_bytes],
                     timeout=90)
    assert out.returncode == 0, out.stderr          # (the script checks the ranks agree)
    if mode == "setdata_one":       # rank 1's step-2 gradient came from its own weights
        return
    a, b = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dist.npz")
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


_FAIL = """
import os, sys, time
import numpy as np
import hybridl as hl
from hybridl import distributed as dist, nn, autograd

mode = sys.argv[1]
rank, size = dist.init()
if mode == "shape":
    x = hl.nd.ones((4,) if rank == 0 else (3,))
    print(dist.allreduce(x).asnumpy())
    sys.exit(0)
units = 8 if (mode == "params" and rank == 1) else 16
if mode == "bucket" and rank == 1:
    os.environ["HYBRIDL_DIST_BUCKET_MB"] = "0.0001"
net = nn.Sequential()
net.add(nn.Dense(units, in_units=4, activation="relu"), nn.Dense(2, in_units=units))
net.initialize()
trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist")
loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
for s in range(5):
    if s == 2 and rank == 1:
        if mode == "die":
            os._exit(3)
        if mode == "hang":
            time.sleep(1000)
    x, y = hl.nd.ones((4, 4)), hl.nd.zeros((4,))
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(4)
hl.waitall()
print("rank", rank, "finished")
"""

_SYNC_BN = """
import sys
import numpy as np
import hybridl as hl
from hybridl import distributed as dist, nn, autograd
from hybridl.parallel import SyncBatchNorm
rank, size = dist.init()
rng = np.random.default_rng(0)
X = rng.standard_normal((8, 3, 4, 4)).astype(np.float32)
W = rng.standard_normal((8, 3, 4, 4)).astype(np.float32)
lo, hi = rank * 8 // size, (rank + 1) * 8 // size
bn = SyncBatchNorm(in_channels=3) if size > 1 else nn.BatchNorm(in_channels=3)
bn.initialize()
x = hl.nd.array(X[lo:hi])
x.attach_grad()
with autograd.record():
    y = bn(x)
    loss = (y * hl.nd.array(W[lo:hi])).sum()
loss.backward()
g = dist.allreduce(bn.gamma.grad())
np.savez(sys.argv[1] + f"{rank}.npz", y=y.asnumpy(), dx=x.grad.asnumpy(), dgamma=g.asnumpy(),
         rm=bn.running_mean.data().asnumpy())
"""


def _env(**extra):
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("HYBRIDL_DIST_TIMEOUT", "30")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _script(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def _mpirun(args, n=2, timeout=60, **env):
    """Run a job; shared-memory files that an aborted job (MPI_Abort, a killed rank) leaves
    behind in /dev/shm -- MPICH removes them only at a clean MPI_Finalize, 2 MB per job -- are
    deleted when no running process maps them."""
    before = shm_files()
    t0 = time.perf_counter()
    try:
        out = subprocess.run([MPIEXEC, "-n", str(n), *args], env=_env(**env), capture_output=True,
                             text=True, timeout=timeout)
    finally:
        dt = time.perf_counter() - t0
        remove_stale_shm(before)
    return out, dt


def _single(args, timeout=60):
    env = {k: v for k, v in _env().items() if k not in dist._backend.LAUNCHER_VARS}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_like_one_process_on_the_global_batch(tmp_path, ranks):
    """Through the shared-memory buckets (all ranks on this machine) and through
    MPI_Allreduce (HYBRIDL_DIST_SHM=0); 3 ranks (2 cores, oversubscribed) split each bucket
    into 3 uneven blocks."""
    script = _script(tmp_path, "train.py", _TRAIN)
    single = _single([script, str(tmp_path / "single.npz"), "eq"])
    assert single.returncode == 0, single.stderr
    a = np.load(tmp_path / "single.npz")
    assert len(a.files) == 6
    got = {}
    for shm in ("1", "0"):
        out, _ = _mpirun([sys.executable, script, str(tmp_path / f"dist{shm}.npz"), "eq"],
                         n=ranks, timeout=90, HYBRIDL_DIST_SHM=shm)
        assert out.returncode == 0, out.stderr
        # 3 windows per bucket when shared (then the fallback to MPI), none when not
        assert f"windows {3 if shm == '1' else 0}" in out.stdout, out.stdout
        got[shm] = np.load(tmp_path / f"dist{shm}.npz")
        for k in a.files:
            np.testing.assert_allclose(got[shm][k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    if ranks == 2:                  # a0 + a1 either way: the same bits
        for k in a.files:
            np.testing.assert_array_equal(got["1"][k], got["0"][k], err_msg=k)

@mpi
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("ranks,shm,bucket", [(2, "1", "0.001"), (3, "1", "0.001"),
                                              (2, "0", "0.001"), (2, "1", "25")])
def test_update_on_kvstore_trains_like_one_process(tmp_path, opt, ranks, shm, bucket):
    """Trainer(update_on_kvstore=True): each rank sums and updates its block of every bucket
    (uneven blocks with 3 ranks; several buckets) in one shared copy of the weights and the
    optimizer states. Weights and saved states equal one process's on the global batch
    (rtol 1e-5), on every rank; rank 0's initial values win; a weight view held by the user
    keeps its value; weights replaced mid-training (set_data) are taken into the windows
    again. HYBRIDL_DIST_SHM=0: the default path, same results. One 25 MB bucket: the whole
    model, so a rank's block spans parameters with different lr_mult / wd_mult (one kernel
    call per run of parameters alike)."""
    from safetensors.numpy import load_file
    script = _script(tmp_path, "sharded.py", _TRAIN_SHARDED)
    single = _single([script, str(tmp_path / "single.npz"), opt, bucket])
    assert single.returncode == 0, single.stderr
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "dist.npz"), opt, bucket], n=ranks,
                     timeout=90, HYBRIDL_DIST_SHM=shm)
    assert out.returncode == 0, out.stderr
    a, b = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dist.npz")
    assert len(a.files) == 6
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    sa, sb = load_file(tmp_path / "single.npz.states"), load_file(tmp_path / "dist.npz.states")
    assert sa.keys() == sb.keys() and len(sa) == (6 if opt == "sgd" else 12)
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if shm == "1":      # the windows were used: one parameter window per bucket and more
        assert "'param'" in out.stdout, out.stdout



@mpi
def test_allreduce_of_last_layers_overlaps_backward_of_first_layers(tmp_path):
    script = _script(tmp_path, "train.py", _TRAIN)
    trace = tmp_path / "trace.json"
    out, _ = _mpirun([sys.executable, script, str(trace), "overlap"], timeout=80)
    assert out.returncode == 0, out.stderr
    nb = int(out.stdout.split("buckets")[1].split()[0])
    assert nb >= 3
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    comm = sorted((e for e in ev if e["name"].startswith("kv.allreduce")), key=lambda e: e["ts"])
    assert len(comm) == nb
    assert all("comm" in e["args"]["device"] for e in comm)
    compute = [e for e in ev if not e["name"].startswith(("kv.", "sgd"))
               and "comm" not in e["args"].get("device", "")]
    backward_end = max(e["ts"] + e["dur"] for e in compute)   # last op: first layer's backward
    first = comm[0]
    assert "bucket 0" in first["name"]
    assert first["ts"] < backward_end, (first, backward_end)


@mpi
def test_sync_batch_norm_across_ranks_equals_batch_norm_on_the_global_batch(tmp_path):
    script = _script(tmp_path, "sbn.py", _SYNC_BN)
    single = _single([script, str(tmp_path / "s")])
    assert single.returncode == 0, single.stderr
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "d")])
    assert out.returncode == 0, out.stderr
    s, d0, d1 = (np.load(tmp_path / f) for f in ("s0.npz", "d0.npz", "d1.npz"))
    np.testing.assert_allclose(np.concatenate([d0["y"], d1["y"]]), s["y"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([d0["dx"], d1["dx"]]), s["dx"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d0["dgamma"], s["dgamma"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d1["rm"], s["rm"], rtol=1e-5, atol=1e-6)


_COLLECTIVES = """
import sys
import numpy as np
import hybridl as hl
from hybridl import distributed as dist
rank, size = dist.init()
res = {}
for name, base in (("f32", np.arange(12, dtype=np.float32).reshape(3, 4)),
                   ("f64", np.linspace(-1, 1, 7)), ("i32", np.arange(-3, 3, dtype=np.int32)),
                   ("scalar", np.array(2.5, np.float32))):
    x = hl.nd.array(base * (rank + 1) + rank)
    for op in ("sum", "mean", "max", "min", "prod"):
        if op == "mean" and base.dtype.kind != "f":
            continue
        res[f"{name}_{op}"] = dist.allreduce(x, op).asnumpy()
# a transposed (non-contiguous) input, and big enough for MPI's large-message path
big = hl.nd.array(np.arange(2 * 300000, dtype=np.float32).reshape(2, 300000) * (rank + 1))
res["big_T"] = dist.allreduce(big.T, check=False).asnumpy()
np.savez(sys.argv[1] + f"{rank}.npz", **res)
"""


@mpi
def test_allreduce_values_across_two_ranks(tmp_path):
    script = _script(tmp_path, "coll.py", _COLLECTIVES)
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "r")])
    assert out.returncode == 0, out.stderr
    r0, r1 = np.load(tmp_path / "r0.npz"), np.load(tmp_path / "r1.npz")
    bases = {"f32": np.arange(12, dtype=np.float32).reshape(3, 4), "f64": np.linspace(-1, 1, 7),
             "i32": np.arange(-3, 3, dtype=np.int32), "scalar": np.array(2.5, np.float32)}
    red = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
    for name, base in bases.items():
        a, b = base * 1 + 0, base * 2 + 1             # each rank's input
        for op in ("sum", "mean", "max", "min", "prod"):
            key = f"{name}_{op}"
            if op == "mean" and base.dtype.kind != "f":
                assert key not in r0.files
                continue
            want = (a + b) / 2 if op == "mean" else red[op](a, b)
            for r in (r0, r1):
                assert r[key].dtype == base.dtype and r[key].shape == base.shape, key
                np.testing.assert_allclose(r[key], want, rtol=1e-6, err_msg=key)
    big = np.arange(2 * 300000, dtype=np.float32).reshape(2, 300000)
    for r in (r0, r1):
        np.testing.assert_array_equal(r["big_T"], (big * 3).T)


@mpi
@pytest.mark.parametrize("mode, says, detail", [
    ("params", "the ranks' parameters differ", "shape (16, 4) float32 vs rank 1"),
    # different bucket sizes would pair different gradients (MPI: "Message truncated")
    ("bucket", "the ranks' gradient bucket sizes differ", "bytes, rank 1 104 bytes"),
])
def test_mismatched_parameters_or_buckets_fail_on_every_rank(tmp_path, mode, says, detail):
    script = _script(tmp_path, "fail.py", _FAIL)
    out, dt = _mpirun([sys.executable, script, mode])
    assert out.returncode != 0
    assert out.stderr.count(says) >= 2, out.stderr
    assert detail in out.stderr
    assert dt < 30


@mpi
def test_mismatched_collective_fails_on_every_rank(tmp_path):
    script = _script(tmp_path, "fail.py", _FAIL)
    out, dt = _mpirun([sys.executable, script, "shape"])
    assert out.returncode != 0
    assert out.stderr.count("DistributedError: hl.distributed.allreduce: the ranks called it "
                            "with different arguments") >= 2, out.stderr
    assert dt < 30


_EXIT = """
import sys
import numpy as np
import hybridl as hl
from hybridl import autograd, distributed as dist, nn

mode = sys.argv[1]
rank, size = dist.init()
if mode == "extra":                 # rank 0 issues one collective more than rank 1, then ends
    x = hl.nd.ones((1000,))
    outs = [dist.allreduce(x) for _ in range(2 + (rank == 0))]
    sys.exit(0)
hl.random.seed(0)
net = nn.HybridSequential()
net.add(nn.Dense(512, in_units=784, activation="relu"), nn.Dense(10, in_units=512))
net.initialize()
net.hybridize()
tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                kvstore="dist", update_on_kvstore=mode == "sharded")
rng = np.random.default_rng(rank)
x = hl.nd.array(rng.standard_normal((64, 784)).astype(np.float32))
y = hl.nd.array(rng.integers(0, 10, 64).astype(np.float32))
loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
for i in range(600):                # pushed far ahead of what has run; no waitall at the end
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    tr.step(64)
"""


@mpi
@pytest.mark.parametrize("mode", ["allreduce", "sharded"])
def test_a_script_that_ends_with_collectives_pending_runs_them(tmp_path, mode):
    """The engine's exit cancelled what had not run 2 s after the end; a rank then called
    MPI_Finalize while its communication thread was still inside a collective: a segfault
    or "corrupted double-linked list" in 3 of 4 such jobs. Now every pushed collective runs
    first."""
    script = _script(tmp_path, "exit.py", _EXIT)
    out, _ = _mpirun([sys.executable, script, mode], timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "cancelled" not in out.stderr, out.stderr


@mpi
def test_a_collective_left_unmatched_at_exit_ends_the_job_with_a_message(tmp_path):
    script = _script(tmp_path, "exit.py", _EXIT)
    out, dt = _mpirun([sys.executable, script, "extra"], HYBRIDL_DIST_TIMEOUT=2)
    assert out.returncode != 0
    assert "rank 0/2: collective #2 'dist.allreduce[sum]' (4000 bytes) has not completed " \
        "after" in out.stderr, out.stderr
    assert "Segmentation fault" not in out.stdout + out.stderr
    assert dt < 30


_INIT = """
import sys
import numpy as np
import hybridl as hl
from hybridl import autograd, distributed as dist, nn

mode = sys.argv[1]
rank, size = dist.init()
hl.random.seed(rank if mode != "deferred_seeded" else 0)    # unseeded-like: per-rank values
net = nn.HybridSequential()
if mode == "frozen":
    net.add(nn.Dense(8, in_units=4), nn.BatchNorm(in_channels=8), nn.Dense(2, in_units=8))
    net.initialize()
    net[0].weight.grad_req = "null"                 # a frozen feature extractor
    if rank == 0:                                   # statistics loaded on rank 0 only
        net[1].running_mean.set_data(np.full(8, 5.0, np.float32))
else:
    net.add(nn.Dense(3), nn.Dense(2))               # shapes deferred
    net.initialize()
tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist")
x = hl.nd.array(np.arange(8, dtype=np.float32).reshape(2, 4) / 8)
try:
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    tr.step(2)
except dist.DistributedError as e:
    open(sys.argv[2] + f"{rank}.txt", "w").write(f"error: {e}")   # (printed lines interleave)
    sys.exit(3)
with autograd.predict_mode():
    out = net(x)
same = [bool((p.data() == dist.broadcast(p.data())).asnumpy().all())
        for p in net.collect_params().values()]
open(sys.argv[2] + f"{rank}.txt", "w").write(f"same {all(same)} out {out.asnumpy().sum():.6f}")
"""


@mpi
@pytest.mark.parametrize("mode", ["frozen", "deferred", "deferred_seeded"])
def test_every_value_starts_as_rank_0s_or_the_first_step_says_why_not(tmp_path, mode):
    """kvstore 'dist': frozen parameters and BatchNorm statistics were never broadcast (ranks
    initialized differently kept different frozen layers, a checkpoint loaded on rank 0 only
    kept its statistics there); with deferred shapes the broadcast came after the first
    forward, whose gradients came from each rank's own weights (0.5 off, silently): now an
    error on every rank, unless the ranks' values were equal anyway."""
    script = _script(tmp_path, "init.py", _INIT)
    out, _ = _mpirun([sys.executable, script, mode, str(tmp_path / "rank")])
    res = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    if mode == "deferred":
        assert out.returncode != 0
        assert all("parameter values differ at the first step" in t for t in res), res
        return
    assert out.returncode == 0, out.stderr
    assert all(t.startswith("same True ") for t in res), res
    assert res[0] == res[1]                         # the same predictions


_RETRAIN = """
import sys
import hybridl as hl
from hybridl import distributed as dist, nn, autograd
from hybridl.distributed import _shm
rank, size = dist.init()
net = nn.Sequential()
net.add(nn.Dense(128, in_units=256, activation="relu"), nn.Dense(10, in_units=128))
net.initialize()
x, y = hl.nd.ones((4, 256)), hl.nd.zeros((4,))
loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
for i in range(6):          # a new Trainer (and kvstore) on the same model, again and again
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist")
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(4)
    hl.waitall()
# one line per rank, in a file (two ranks' prints can interleave in mpiexec's stdout)
with open(sys.argv[1] + str(rank), "w") as f:
    f.write(f"windows {sum(len(w) for w, _ in _shm._POOLS.values())} "
            f"buckets {len(trainer._kv.buckets)}")
"""


@mpi
def test_new_trainers_on_the_same_model_reuse_the_shared_windows(tmp_path):
    # each kvstore used to make its own windows, never freed: /dev/shm grew by the
    # gradients' size times the ranks with every Trainer (a bus error once it was full)
    script = _script(tmp_path, "retrain.py", _RETRAIN)
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "rank")])
    assert out.returncode == 0, out.stderr
    for r in (0, 1):
        assert (tmp_path / f"rank{r}").read_text() == "windows 1 buckets 1"


@mpi
@pytest.mark.parametrize("var, value", [("HYBRIDL_DIST_SHM", "2"),
                                        ("HYBRIDL_DIST_TIMEOUT", "abc"),
                                        ("HYBRIDL_DIST_BUCKET_MB", "abc")])
def test_a_bad_setting_on_one_rank_stops_every_rank(tmp_path, var, value):
    # the bad rank used to raise alone, before the others' first collective: they hung
    script = _script(tmp_path, "hello.py", "from hybridl import distributed as dist\n"
                                           "print('rank', dist.init()[0], 'started')\n")
    t0 = time.perf_counter()
    before = shm_files()
    try:
        out = subprocess.run([MPIEXEC, "-n", "1", sys.executable, script, ":", "-n", "1", "env",
                              f"{var}={value}", sys.executable, script], env=_env(),
                             capture_output=True, text=True, timeout=60)
    finally:
        remove_stale_shm(before)
    assert out.returncode != 0
    assert "started" not in out.stdout
    assert f"{var}: expected" in out.stderr and repr(value) in out.stderr, out.stderr
    assert "another rank has an invalid HYBRIDL_DIST_TIMEOUT, HYBRIDL_DIST_SHM or " \
           "HYBRIDL_DIST_BUCKET_MB" in out.stderr
    assert time.perf_counter() - t0 < 30


@mpi
def test_hybridl_train_distributed_names_a_bad_setting_not_the_options(tmp_path):
    hybridl = os.path.join(os.path.dirname(sys.executable), "hybridl")
    out, _ = _mpirun([hybridl, "train", "--distributed"], n=1, HYBRIDL_DIST_BUCKET_MB="-1")
    assert out.returncode == 2
    assert out.stderr.strip() == ("hybridl train: error: HYBRIDL_DIST_BUCKET_MB: expected a "
                                  "positive finite number, got '-1'")


@mpi
def test_dead_rank_ends_the_job(tmp_path):
    script = _script(tmp_path, "fail.py", _FAIL)
    out, dt = _mpirun([sys.executable, script, "die"], HYBRIDL_DIST_TIMEOUT=2)
    assert out.returncode != 0
    assert "rank 0 finished" not in out.stdout
    assert dt < 2 + 20


@mpi
def test_launch_removes_the_shared_memory_an_aborted_job_leaves(tmp_path, monkeypatch):
    # MPI_Abort skips MPICH's clean-up: each aborted job used to leave ~2 MB in /dev/shm
    script = _script(tmp_path, "fail.py", _FAIL)
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    before = shm_files()
    rc = launch_main(["-n", "2", "--mpiexec", MPIEXEC, "--timeout", "2", "--", sys.executable,
                      script, "die"])
    assert rc != 0
    # what is new and unmapped was left behind (jobs of tests running beside this one map theirs)
    left = [f for f in shm_files() - before if not _mapped_anywhere(os.path.join("/dev/shm", f))]
    assert left == []


@mpi
def test_a_rank_that_aborts_the_job_unlinks_its_shared_memory(tmp_path):
    # plain mpiexec (no hybridl launch to clean up): rank 0's watchdog aborts the job when
    # rank 1 hangs, and unlinks the /dev/shm files the ranks share before MPI_Abort
    script = _script(tmp_path, "fail.py", _FAIL)
    before = shm_files()
    try:
        out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script, "hang"],
                             env=_env(HYBRIDL_DIST_TIMEOUT=2), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and "aborting the job" in out.stderr
        left = [f for f in shm_files() - before
                if not _mapped_anywhere(os.path.join("/dev/shm", f))]
        assert left == []
    finally:
        remove_stale_shm(before)


@mpi
def test_hanging_rank_aborts_the_job_after_the_timeout(tmp_path):
    script = _script(tmp_path, "fail.py", _FAIL)
    out, dt = _mpirun([sys.executable, script, "hang"], HYBRIDL_DIST_TIMEOUT=2)
    assert out.returncode != 0
    assert "has not completed after" in out.stderr and "HYBRIDL_DIST_TIMEOUT=2" in out.stderr
    assert "kv.allreduce[bucket" in out.stderr
    assert 2 <= dt < 2 + 20


_DIVERGE = """
import sys
import numpy as np
import hybridl as hl
from hybridl import data, distributed as dist, nn
from hybridl.train_cli import _sum_over_ranks, fit

rank, size = dist.init()
hl.random.seed(0)
X = np.ones((16, 4), np.float32)
if rank == 1:
    X[-1, 0] = np.inf      # rank 1's last batch: its loss is inf, rank 0's stays finite
loader = data.DataLoader(data.ArrayDataset(X, np.zeros(16, np.int64)), 4)
net = nn.Dense(2, in_units=4)
net.initialize()
trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist")
out = sys.argv[1] + f"{rank}.txt"     # one file per rank: printed lines would interleave
try:
    fit(net, trainer, loader, None, 3, log=lambda s: None, progress=False, rank0=rank == 0,
        reduce_stats=_sum_over_ranks(dist))
except FloatingPointError as e:
    open(out, "w").write(f"stopped: {e}")
    sys.exit(1)
open(out, "w").write("finished")
"""


@mpi
def test_divergence_on_one_rank_stops_every_rank_together(tmp_path):
    """Only rank 1's loss is inf (its last batch): the epoch's statistics are summed over the
    ranks, so both stop after epoch 1 with the same message, at once (not rank 0 blocked in
    its next collective until the dead-rank timeout)."""
    script = _script(tmp_path, "diverge.py", _DIVERGE)
    out, dt = _mpirun([sys.executable, script, str(tmp_path / "rank")], HYBRIDL_DIST_TIMEOUT=20)
    assert out.returncode != 0
    for r in (0, 1):
        got = (tmp_path / f"rank{r}.txt").read_text()
        assert got.startswith("stopped: training diverged: the mean loss of epoch 1 is"), \
            (r, got, out.stderr)
    assert dt < 20, dt


@mpi
def test_launch_hybridl_train_distributed(tmp_path):
    save = tmp_path / "lenet.safetensors"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hybridl", "launch", "-n", "2", "--",
                          sys.executable, "-m", "hybridl", "train", "--distributed",
                          "--epochs", "1", "--save", str(save)],
                         env=_env(), capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("hybridl train:") == 1          # only rank 0 prints
    assert out.stdout.count("done:") == 1 and "over 2 processes" in out.stdout
    assert save.exists() and not list(tmp_path.glob(".*tmp*"))
    assert time.perf_counter() - t0 < 80


@mpi
def test_hybridl_train_under_mpiexec_refuses_to_train_alone_and_checks_save_on_rank_0(tmp_path):
    # without --distributed each process trained the whole model alone; --save was probed on
    # every rank (on a cluster its folder may exist on rank 0's node only)
    out, dt = _mpirun([sys.executable, "-m", "hybridl", "train", "--epochs", "1"], timeout=80)
    assert out.returncode == 2 and out.stderr.count("add --distributed") == 2, out.stderr
    out, dt = _mpirun([sys.executable, "-m", "hybridl", "train", "--distributed", "--epochs", "1",
                       "--save", "/proc/x.safetensors"], timeout=80)
    assert out.returncode == 2, out.stderr
    assert "--save: cannot write files into '/proc'" in out.stderr
    assert "--save: rank 0 cannot write '/proc/x.safetensors'" in out.stderr
    assert dt < 30


_FAILED_ON_ONE_RANK = """
import os, sys
import numpy as np
import hybridl as hl
from hybridl import autograd, nn, distributed as dist
rank, size = dist.init()
out = sys.argv[1]
# 1. a collective whose input failed on rank 0 only: every rank fails it, and the next one is
#    still paired with the next one (was: rank 1 got rank 0's next allreduce, data mixed)
x = hl.nd.array(np.ones(2, np.float32))
if rank == 0:
    x = hl.nd.take(x, hl.nd.array([0, 7]), mode="raise")      # fails: index 7
y = dist.allreduce(x)
z = dist.allreduce(hl.nd.array(np.ones(2, np.float32)))
try:
    y.asnumpy()
    y_res = "ok"
except hl.OpError as e:
    y_res = type(e.original).__name__
# 2. kvstore 'dist' training where rank 0's batch of step 1 fails (a bad label): every rank
#    skips that step, so the ranks' weights stay identical
hl.random.seed(0)
net = nn.Sequential()
net.add(nn.Dense(6, in_units=4, activation="relu"), nn.Dense(3, in_units=6))
net.initialize()
tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                kvstore="dist", update_on_kvstore=os.environ.get("UOK") == "1" or None)
rng = np.random.default_rng(rank)
skipped = []
for i in range(4):
    xb = hl.nd.array(rng.standard_normal((5, 4)).astype(np.float32))
    lab = rng.integers(0, 3, 5).astype(np.float32)
    if rank == 0 and i == 1:
        lab[0] = 99
    try:
        with autograd.record():
            loss = hl.loss.SoftmaxCrossEntropyLoss()(net(xb), hl.nd.array(lab))
        loss.backward()
        tr.step(5)
        loss.asnumpy()
    except hl.OpError:
        skipped.append(i)
        try:
            hl.waitall()
        except hl.OpError:
            pass
try:
    hl.waitall()
except hl.OpError:
    pass
w = np.concatenate([p.data().asnumpy().ravel() for p in net.collect_params().values()])
np.savez(out + f"{rank}.npz", y=np.array(y_res), z=z.asnumpy(), w=w)
"""


@mpi
@pytest.mark.parametrize("uok", ["0", "1"])
def test_a_batch_that_fails_on_one_rank_fails_the_step_on_every_rank(tmp_path, uok):
    """A failed input on one rank skipped that rank's collective: the other rank's collective
    was paired with the next one (allreduce results of different calls mixed, then a timeout),
    and in training the ranks' weights diverged. Now every rank takes part, the failure is
    shared in-band, and every rank skips the step."""
    script = _script(tmp_path, "failed.py", _FAILED_ON_ONE_RANK)
    out, dt = _mpirun([sys.executable, script, str(tmp_path / "r")], HYBRIDL_DIST_TIMEOUT=20,
                      UOK=uok)
    assert out.returncode == 0, out.stderr
    r0, r1 = np.load(tmp_path / "r0.npz"), np.load(tmp_path / "r1.npz")
    # rank 0: its own input's error (IndexError from take); rank 1: the shared failure
    assert str(r0["y"]) == "IndexError" and str(r1["y"]) == "DistributedError"
    np.testing.assert_array_equal(r0["z"], [2.0, 2.0])
    np.testing.assert_array_equal(r1["z"], [2.0, 2.0])
    np.testing.assert_array_equal(r0["w"], r1["w"])
    assert dt < 20, dt


_UNUSED_ON_ONE_RANK = """
import os, sys
import numpy as np
import hybridl as hl
from hybridl import autograd, nn, distributed as dist
rank, size = dist.init()


class TwoHeads(nn.Block):
    def __init__(self):
        super().__init__()
        self.a = nn.Dense(3, in_units=4)
        self.b = nn.Dense(3, in_units=4)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0.0)


hl.random.seed(0)
net = TwoHeads()
net.initialize()
tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                kvstore="dist", update_on_kvstore=os.environ.get("UOK") == "1" or None)
rng = np.random.default_rng(rank)
for i in range(3):
    x = hl.nd.array(rng.standard_normal((4, 4)).astype(np.float32))
    with autograd.record():
        loss = net(x, use_b=not (rank == 1 and i == 1)).sum()      # b unused on rank 1, step 1
    loss.backward()
    tr.step(4, ignore_stale_grad=True)
w = np.concatenate([p.data().asnumpy().ravel() for p in net.collect_params().values()])
np.save(sys.argv[1] + f"{rank}.npy", w)
"""


@mpi
@pytest.mark.parametrize("uok", ["0", "1"])
def test_a_parameter_unused_on_one_rank_keeps_the_replicas_identical(tmp_path, uok):
    """kvstore='dist': a parameter one rank's step did not use went into the sum with that
    rank's previous gradient, and that rank then skipped its update: the ranks' weights
    differed (1e-1). Now it adds zero and every rank takes the summed step."""
    script = _script(tmp_path, "unused.py", _UNUSED_ON_ONE_RANK)
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "w")], UOK=uok)
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "w0.npy"), np.load(tmp_path / "w1.npy"))


_UNEVEN = """
import os, sys
import numpy as np
import hybridl as hl
from hybridl import autograd, nn, distributed as dist
rank, size = dist.init()
hl.random.seed(0)
net = nn.Dense(3, in_units=4)
net.initialize()
dist._shm.MIN_BYTES = int(os.environ.get("MIN_BYTES", dist._shm.MIN_BYTES))
tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                kvstore="dist" if size > 1 else None,
                update_on_kvstore=os.environ.get("UOK") == "1" and size > 1 or None)
data = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
parts = [data[:5], data[5:]] if size > 1 else [data]      # rank 0: 5 samples, rank 1: 3
for _ in range(2):
    x = hl.nd.array(parts[rank])
    with autograd.record():
        loss = (net(x) ** 2).sum()
    loss.backward()
    tr.step(x.shape[0])
np.save(sys.argv[1] + f"{rank}.npy", net.weight.data().asnumpy())
"""


@mpi
@pytest.mark.parametrize("uok,min_bytes", [("0", "32768"), ("1", "32768"), ("1", "0")])
def test_uneven_local_batches_give_the_mean_over_the_global_batch(tmp_path, uok, min_bytes):
    """Ranks calling trainer.step with different local batch sizes (an uneven last batch)
    each scaled the summed gradient by its own 1 / (batch * size): the replicas differed
    (5e-2) and neither had the global mean. Now the update is the mean over the global batch
    on every rank, as one process training on the whole batch."""
    script = _script(tmp_path, "uneven.py", _UNEVEN)
    single = _single([script, str(tmp_path / "s")])
    assert single.returncode == 0, single.stderr
    out, _ = _mpirun([sys.executable, script, str(tmp_path / "d")], UOK=uok, MIN_BYTES=min_bytes)
    assert out.returncode == 0, out.stderr
    ref = np.load(tmp_path / "s0.npy")
    for r in (0, 1):
        np.testing.assert_allclose(np.load(tmp_path / f"d{r}.npy"), ref, rtol=1e-5, atol=1e-7)


_UNCAUGHT = """
import numpy as np
import hybridl as hl
from hybridl import distributed as dist
rank, size = dist.init()
x = hl.nd.array(np.ones(4, np.float32))
for i in range(5):
    if i == 2 and rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.allreduce(x).asnumpy()
print("rank", rank, "finished")
"""


@mpi
def test_an_uncaught_exception_on_one_rank_ends_the_job_at_once(tmp_path):
    """From a new-user pass: rank 1's RuntimeError left rank 0 waiting in its next allreduce
    for the whole HYBRIDL_DIST_TIMEOUT (60 s), and the job's exit code was the watchdog's 70.
    Now the exception is printed and the job ends within about a second, exit code 1."""
    script = _script(tmp_path, "uncaught.py", _UNCAUGHT)
    out, dt = _mpirun([sys.executable, script], HYBRIDL_DIST_TIMEOUT=60)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "RuntimeError: boom on rank 1" in out.stderr
    assert "an uncaught RuntimeError ended this rank" in out.stderr
    assert "rank 0 finished" not in out.stdout
    assert dt < 20, dt


def test_pushpull_update_refuses_bad_jobs_and_a_single_process():
    """One process (no launcher): can_update() is False and pushpull_update says so; bad
    jobs are named before anything is pushed (the checks run in that order, so the single
    process case is checked by patching can_update)."""
    from hybridl.distributed.kvstore import DistKVStore
    kv = DistKVStore()
    w = hl.nd.array(np.ones((3, 4), np.float32))
    kv.init([0], [w])
    st = {"t": 0, "arrays": {}, "var": hl.engine.Var("s")}
    kern = hl.optim.SGD().step_kernel
    assert not kv.can_update()
    with pytest.raises(RuntimeError, match="can_update"):
        kv.pushpull_update({0: (w, w, st, 0.1, 0.0)}, kern, 1.0, None)
    kv.can_update = lambda: True
    with pytest.raises(KeyError, match=r"missing \[0\], not initialized \[\]"):
        kv.pushpull_update({}, kern, 1.0, None)
    with pytest.raises(KeyError, match=r"not initialized \[5\]"):
        kv.pushpull_update({0: (w, w, st, 0.1, 0.0), 5: (w, w, st, 0.1, 0.0)}, kern, 1.0, None)
    with pytest.raises(TypeError, match=r"jobs\[0\]: expected \(grad NDArray"):
        kv.pushpull_update({0: "x"}, kern, 1.0, None)
    with pytest.raises(ValueError, match="shape"):
        kv.pushpull_update({0: (hl.nd.zeros((2, 2)), w, st, 0.1, 0.0)}, kern, 1.0, None)
    w64 = hl.nd.array(np.ones((3, 4)), dtype="float64")
    with pytest.raises(ValueError, match="float64"):
        kv.pushpull_update({0: (w64, w, st, 0.1, 0.0)}, kern, 1.0, None)
    hl.waitall()                    # nothing was pushed
    np.testing.assert_array_equal(w.asnumpy(), np.ones((3, 4), np.float32))
