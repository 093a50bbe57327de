"""Multi-device training: split_and_load, data parallel == single device, SyncBatchNorm ==
BatchNorm on the whole batch, pipeline and tensor-parallel gradients == the unsplit model."""
import threading

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nn
from hybridl.parallel import (
    ChannelParallelConv2D,
    ColumnParallelDense,
    Pipeline,
    RowParallelDense,
    split_and_load,
    transfer,
)
from hybridl.parallel.pipeline import bubble_theory, schedule, split_stages

threaded_only = pytest.mark.skipif(
    hl.engine.get_engine().name == "naive",
    reason="SyncBatchNorm's devices meet between calls: needs the threaded engine")


def devs(k):
    return [hl.cpu(i) for i in range(k)]


# ============================================================================ split_and_load


def test_split_and_load_numpy_and_ndarray():
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    for src in (x, hl.nd.array(x)):
        parts = split_and_load(src, devs(3))
        assert [p.device for p in parts] == devs(3)
        np.testing.assert_array_equal(np.concatenate([p.asnumpy() for p in parts]), x)
    parts = split_and_load(hl.nd.array(x), ["cpu:1", "cpu:0"], batch_axis=1)
    assert [p.shape for p in parts] == [(6, 2), (6, 2)] and parts[0].device == hl.cpu(1)
    np.testing.assert_array_equal(parts[1].asnumpy(), x[:, 2:])
    parts = split_and_load(x[:5], devs(2), even_split=False)
    assert [p.shape[0] for p in parts] == [3, 2]
    assert split_and_load(x, [hl.cpu(2)])[0].device == hl.cpu(2)


def test_split_and_load_errors():
    x = np.zeros((5, 2))
    with pytest.raises(ValueError, match="5 samples.*not split evenly over 2 devices"):
        split_and_load(x, devs(2))
    with pytest.raises(ValueError, match="5 samples.*not split evenly"):
        split_and_load(hl.nd.array(x), devs(2))
    with pytest.raises(ValueError, match="fewer than the 8 devices"):
        split_and_load(x, devs(8), even_split=False)
    with pytest.raises(ValueError, match="batch_axis"):
        split_and_load(x, devs(1), batch_axis=2)
    with pytest.raises(ValueError, match="at least one device"):
        split_and_load(x, [])


def test_transfer_gradient_comes_back_to_the_source_device():
    x = hl.nd.array(np.arange(4.0, dtype=np.float32))
    x.attach_grad()
    with autograd.record():
        a = (transfer(x, hl.cpu(1)) * 3).sum()
        b = (transfer(x, hl.cpu(2)) * 2).sum()
    autograd.backward([a, b])
    assert x.grad.device == hl.cpu(0)
    np.testing.assert_array_equal(x.grad.asnumpy(), [5, 5, 5, 5])


# ============================================================================ data parallel


def _mlp(devices, seed=0):
    net = hl.models.mlp((32, 16), 5)
    net.initialize(device=devices)
    for d in devices:
        net(hl.nd.zeros((2, 12), device=d))
    rng = np.random.default_rng(seed)
    for p in net.collect_params().values():
        p.set_data(rng.standard_normal(p.shape).astype(np.float32) * 0.3)
    return net


def _train(devices, kvstore, steps=5, hybridize=False, wrapper=False):
    net = _mlp(devices)
    if hybridize:
        net.hybridize()
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                    kvstore=kvstore)
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(1)
    dp = hl.parallel.DataParallel(net, devices)
    for _ in range(steps):
        x = rng.standard_normal((16, 12)).astype(np.float32)
        y = rng.integers(0, 5, 16)
        if wrapper:
            with autograd.record():
                loss = lf(dp(hl.nd.array(x)), hl.nd.array(y))
            loss.backward()
        else:
            xs, ys = split_and_load(x, devices), split_and_load(y, devices)
            with autograd.record():
                losses = [lf(net(a), b) for a, b in zip(xs, ys)]
            autograd.backward(losses)
        tr.step(16)
    return net


@pytest.fixture(scope="module")
def single_device_reference():
    net = _train([hl.cpu(0)], None)
    return [p.data().asnumpy() for p in net.collect_params().values()]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kvstore", ["device", "local"])
def test_data_parallel_equals_single_device(k, kvstore, single_device_reference):
    net = _train(devs(k), kvstore, hybridize=(k == 2))
    for p, ref in zip(net.collect_params().values(), single_device_reference):
        copies = p.list_data()
        assert [c.device for c in copies] == devs(k)
        for c in copies:
            np.testing.assert_allclose(c.asnumpy(), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(copies[0].asnumpy(), copies[-1].asnumpy())


def test_data_parallel_wrapper_equals_single_device(single_device_reference):
    net = _train(devs(2), "device", wrapper=True)
    for p, ref in zip(net.collect_params().values(), single_device_reference):
        for c in p.list_data():
            np.testing.assert_allclose(c.asnumpy(), ref, rtol=1e-5, atol=1e-6)


def test_trainer_defaults_to_device_kvstore():
    net = _mlp(devs(2))
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with autograd.record():
        losses = [net(hl.nd.ones((2, 12), device=d)).sum() for d in devs(2)]
    autograd.backward(losses)
    tr.step(4)
    assert isinstance(tr._kv, hl.kv.KVStore) and tr._kv.type == "device"


# ============================================================================ SyncBatchNorm


def _bn_run(layer, devices, x, w):
    layer.initialize(device=devices)
    xs, ws = split_and_load(x, devices), split_and_load(w, devices)
    for a in xs:
        a.attach_grad()
    with autograd.record():
        ys = [layer(a) for a in xs]                       # one device after another
        losses = [(y * c).sum() for y, c in zip(ys, ws)]
    autograd.backward(losses)
    y = np.concatenate([a.asnumpy() for a in ys])
    dx = np.concatenate([a.grad.asnumpy() for a in xs])
    dg = sum(g.asnumpy() for g in layer.gamma.list_grad())
    db = sum(g.asnumpy() for g in layer.beta.list_grad())
    rm = [a.asnumpy() for a in layer.running_mean.list_data()]
    rv = [a.asnumpy() for a in layer.running_var.list_data()]
    return y, dx, dg, db, rm, rv


@threaded_only
@pytest.mark.parametrize("k,shape", [(2, (8, 3, 4, 4)), (3, (6, 4, 3, 3)), (4, (8, 5))])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(k, shape):
    rng = np.random.default_rng(k)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    x[: shape[0] // k] += 3.0                 # device 0's slice has other statistics
    w = rng.standard_normal(shape).astype(np.float32)
    ref = _bn_run(nn.BatchNorm(), [hl.cpu(0)], x, w)
    sync = _bn_run(nn.SyncBatchNorm(), devs(k), x, w)
    plain = _bn_run(nn.BatchNorm(), devs(k), x, w)
    names = ["output", "input grad", "gamma grad", "beta grad"]
    for name, r, s in zip(names, ref[:4], sync[:4]):
        np.testing.assert_allclose(s, r, rtol=1e-4, atol=2e-5, err_msg=name)
    for r_stat, s_stat in ((ref[4], sync[4]), (ref[5], sync[5])):
        for copy in s_stat:                   # running statistics: every copy = the whole batch
            np.testing.assert_allclose(copy, r_stat[0], rtol=1e-5, atol=1e-6)
    # per-device BatchNorm differs (statistics of batch / k samples)
    assert np.abs(plain[0] - ref[0]).max() > 1e-2
    assert np.abs(plain[1] - ref[1]).max() > 1e-3
    assert np.abs(plain[2] - ref[2]).max() > 1e-3


@threaded_only
def test_sync_batch_norm_in_a_network_over_steps():
    """Two SyncBatchNorm layers, three training steps, replicas called in a frontend loop:
    no deadlock, and the same parameters as BatchNorm on one device over the whole batch."""
    def make(bn, devices):
        net = nn.Sequential()
        net.add(nn.Conv2D(4, 3, padding=1, in_channels=2), bn(), nn.Activation("relu"),
                nn.Conv2D(3, 3, padding=1, in_channels=4), bn(), nn.Flatten(), nn.Dense(3))
        net.initialize(hl.init.Xavier(), device=devices)
        for d in devices:
            with autograd.predict_mode():
                net(hl.nd.zeros((1, 2, 4, 4), device=d))
        rng = np.random.default_rng(0)
        for p in net.collect_params().values():
            if p.grad_req != "null":
                p.set_data(rng.standard_normal(p.shape).astype(np.float32) * 0.5 + (
                    1.0 if p.name.endswith("gamma") else 0.0))
        return net

    def train(bn, devices):
        net = make(bn, devices)
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9})
        lf = hl.loss.SoftmaxCrossEntropyLoss()
        rng = np.random.default_rng(3)
        for _ in range(3):
            x = rng.standard_normal((8, 2, 4, 4)).astype(np.float32)
            y = rng.integers(0, 3, 8)
            xs, ys = split_and_load(x, devices), split_and_load(y, devices)
            with autograd.record():
                losses = []
                for a, b in zip(xs, ys):
                    losses.append(lf(net(a), b))
            autograd.backward(losses)
            tr.step(8)
        return [p.data(devices[-1]).asnumpy() for p in net.collect_params().values()]

    ref = train(nn.BatchNorm, [hl.cpu(0)])
    got = train(nn.SyncBatchNorm, devs(2))
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@threaded_only
def test_sync_batch_norm_errors():
    bn = nn.SyncBatchNorm()
    bn.initialize(device=devs(2))
    x0 = hl.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3), device=hl.cpu(0))
    with autograd.record():
        dropped = bn(x0)
        # device 0 again before device 1 came: the first step is dropped (its result fails at
        # once, not after the timeout) and this call starts the next step
        y0 = bn(x0)
        y1 = bn(hl.nd.array(np.arange(6, 12, dtype=np.float32).reshape(2, 3), device=hl.cpu(1)))
    with pytest.raises(hl.OpError, match="ran the layer again"):
        dropped.asnumpy()
    want = nn.BatchNorm()
    want.initialize()
    with autograd.record():
        ref = want(hl.nd.array(np.arange(12, dtype=np.float32).reshape(4, 3))).asnumpy()
    np.testing.assert_allclose(np.concatenate([y0.asnumpy(), y1.asnumpy()]), ref, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(hl.OpError, match="ran the layer again"):
        hl.waitall()                                        # reported once more, as any error
    with autograd.predict_mode():                           # predict mode: running statistics
        y = bn(hl.nd.ones((2, 3), device=hl.cpu(1)))
    assert y.shape == (2, 3)
    with hl.engine.set_engine("naive"):
        with autograd.record(), pytest.raises(RuntimeError, match="threaded engine"):
            bn(hl.nd.ones((2, 3)))
        one = nn.SyncBatchNorm()            # one device (one per MPI rank): waited 120 s
        one.initialize()
        with autograd.record(), pytest.raises(RuntimeError, match="threaded engine"):
            one(hl.nd.ones((2, 3)))


@threaded_only
def test_sync_batch_norm_wait_between_replica_calls_fails_soon(monkeypatch):
    """Reading device 0's result before calling device 1's replica can never end (the gate
    needs device 1, which this waiting thread would push): a clear error after a few
    seconds, not SYNC_TIMEOUT_S (120 s) naming the wrong cause; replicas called from two
    threads, one reading its result while the other is still on its way, still meet."""
    import time
    from hybridl.parallel import sync_bn
    monkeypatch.setattr(sync_bn, "SYNC_TIMEOUT_S", 60.0)
    monkeypatch.setattr(sync_bn, "_STUCK_S", 0.5)
    bn = nn.SyncBatchNorm()
    bn.initialize(device=devs(2))
    xs = split_and_load(np.arange(12, dtype=np.float32).reshape(4, 3), devs(2))
    t0 = time.perf_counter()
    with autograd.record():
        y0 = bn(xs[0])
        with pytest.raises(hl.OpError, match="waits for a result .* before those of the other 1 of 2"):
            y0.sum().item()
    assert time.perf_counter() - t0 < 10
    with pytest.raises(hl.OpError):
        hl.waitall()
    out = [None, None]

    def run(i):
        if i == 1:
            time.sleep(0.3)         # device 0's thread is already waiting for its result
        with autograd.record():
            out[i] = bn(xs[i]).asnumpy()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    want = nn.BatchNorm()
    want.initialize()
    with autograd.record():
        ref = want(hl.nd.array(np.arange(12, dtype=np.float32).reshape(4, 3))).asnumpy()
    np.testing.assert_allclose(np.concatenate(out), ref, rtol=1e-5, atol=1e-6)


def test_data_parallel_gathers_each_output_of_a_tuple():
    # a network returning (logits, features) crashed in transfer ('tuple' has no 'device')
    class Two(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dense(3, in_units=4), nn.Dense(2, in_units=4)

        def forward(self, x):
            return self.a(x), self.b(x)
    net = Two()
    net.initialize(device=devs(2))
    x = np.arange(20, dtype=np.float32).reshape(5, 4) / 10
    got = hl.parallel.DataParallel(net, devs(2))(hl.nd.array(x))
    want = net(hl.nd.array(x))
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        assert g.device == hl.cpu(0)
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6)


def _sync_bn_net(devices):
    hl.random.seed(7)
    net = nn.Sequential()
    net.add(nn.Dense(4, in_units=3), nn.SyncBatchNorm(in_channels=4), nn.Dense(2, in_units=4))
    net.initialize(hl.init.Xavier(), device=devices)
    return net


def _sync_bn_step(net, xs, call):
    with autograd.record():
        losses = call(lambda a: net(a).sum(), xs)
    autograd.backward(losses)
    return [[g.asnumpy() for g in p.list_grad()] for p in net.collect_params().values()
            if p.grad_req != "null"]


@threaded_only
def test_sync_batch_norm_replicas_from_threads_and_inside_bulk(monkeypatch):
    """Replicas called from one thread per device (the layer's group chosen and joined under
    a lock: two threads made a group each and both waited for the other's device), and
    inside hl.engine.bulk (a bulked group of ops waited for its own gate): the gradients of
    the frontend loop, step after step."""
    from hybridl.parallel import sync_bn
    monkeypatch.setattr(sync_bn, "SYNC_TIMEOUT_S", 10.0)     # a regression fails, not hangs
    devices = devs(2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3)).astype(np.float32)
    xs = split_and_load(x, devices)

    def loop(f, arrays):
        return [f(a) for a in arrays]

    def threads(f, arrays):
        out = [None] * len(arrays)
        gate = threading.Barrier(len(arrays))

        def run(i):
            gate.wait()
            with autograd.record():
                out[i] = f(arrays[i])
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(arrays))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    def bulked(f, arrays):
        with hl.engine.bulk(8):
            return [f(a) for a in arrays]

    want = _sync_bn_step(_sync_bn_net(devices), xs, loop)
    for call in (threads, bulked, threads):
        net = _sync_bn_net(devices)
        for _ in range(3):
            got = _sync_bn_step(net, xs, call)
        ref_net = _sync_bn_net(devices)
        for _ in range(3):
            ref = _sync_bn_step(ref_net, xs, loop)
        for g, r in zip(got, ref):
            for a, b in zip(g, r):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert want  # the first reference ran too


@threaded_only
def test_sync_batch_norm_recovers_after_a_timed_out_step(monkeypatch):
    """A step where one device never came fails after the timeout; the next full step works
    (the failed group stayed the layer's current group: every later step raised)."""
    from hybridl.parallel import sync_bn
    monkeypatch.setattr(sync_bn, "SYNC_TIMEOUT_S", 0.3)
    devices = devs(2)
    net = _sync_bn_net(devices)
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    with autograd.record():
        lonely = net(hl.nd.array(x[:2], device=devices[0]))
    with pytest.raises(hl.OpError, match="only 1 of 2 devices"):
        lonely.asnumpy()
    xs = split_and_load(x, devices)
    got = _sync_bn_step(net, xs, lambda f, a: [f(v) for v in a])
    assert all(np.isfinite(g).all() for gs in got for g in gs)
    with autograd.record():
        again = [net(a) for a in xs]
    np.testing.assert_array_equal(again[0].asnumpy().shape, (2, 2))
    with pytest.raises(hl.OpError, match="only 1 of 2 devices"):
        hl.waitall()                          # the timed-out step, reported once more


# ============================================================================ pipeline


def _layers():
    return [nn.Dense(16, activation="relu", in_units=10), nn.Dense(12, activation="tanh", in_units=16),
            nn.Dense(8, activation="relu", in_units=12), nn.Dense(5, in_units=8)]


@pytest.fixture(scope="module")
def unsplit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 10)).astype(np.float32)
    y = rng.integers(0, 5, 12)
    net = nn.HybridSequential()
    net.add(*_layers())
    net.initialize()
    vals = [p.data().asnumpy() for p in net.collect_params().values()]
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = lf(net(hl.nd.array(x)), hl.nd.array(y))
    loss.backward()
    grads = [p.grad().asnumpy() for p in net.collect_params().values()]
    return x, y, vals, grads, loss.asnumpy()


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5)])
def test_pipeline_gradients_equal_unsplit(sched, p, m, unsplit):
    x, y, vals, grads, ref_loss = unsplit
    groups = split_stages(_layers(), p, weights=[1, 1, 1, 1])
    stages = []
    for g in groups:
        s = nn.HybridSequential()
        s.add(*g)
        stages.append(s)
    pipe = Pipeline(stages, devs(p), m, sched)
    pipe.initialize()
    for prm, v in zip(pipe.collect_params().values(), vals):
        prm.set_data(v)
    pipe.hybridize()
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    for _ in range(2):                       # gradients are zeroed per call, not accumulated
        loss, out = pipe.forward_backward(x, y, lf, measure=True)
    assert out.shape == (12, 5) and out.device == hl.cpu(p - 1)
    np.testing.assert_allclose(loss.asnumpy(), ref_loss, rtol=1e-5, atol=1e-6)
    for prm, g in zip(pipe.collect_params().values(), grads):
        np.testing.assert_allclose(prm.grad(prm.list_device()[0]).asnumpy(), g, rtol=1e-5,
                                   atol=1e-6)
    st = pipe.last_stats
    assert st["bubble_theory"] == pytest.approx((p - 1) / (m + p - 1))
    assert 0.0 <= st["bubble_measured"] < 1.0
    if sched == "1f1b":                      # activation memory bounded by p, not m
        assert max(st["max_in_flight"]) <= min(p, m)
    else:
        assert max(st["max_in_flight"]) == m
    np.testing.assert_allclose(pipe(x).asnumpy(), out.asnumpy(), rtol=1e-5, atol=1e-6)


def test_schedules_and_theory():
    g = schedule(2, 3, "gpipe")
    assert g[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    f = schedule(3, 4, "1f1b")
    assert f[0][:3] == [("F", 0), ("F", 1), ("F", 2)] and f[2][:2] == [("F", 0), ("B", 0)]
    for seq in f:
        assert sorted(seq) == sorted([("F", j) for j in range(4)] + [("B", j) for j in range(4)])
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="schedule"):
        Pipeline([nn.Dense(2)], devs(1), 2, "zigzag")
    with pytest.raises(ValueError, match="2 stages need 2 devices"):
        Pipeline([nn.Dense(2), nn.Dense(2)], devs(1), 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        Pipeline([nn.Dense(2)], devs(1), 0)


# ============================================================================ tensor parallel


def _compare(ref, par, x, load, shard_grads, k_out=None):
    ref.initialize()
    xr = hl.nd.array(x)
    xr.attach_grad()
    with autograd.record():
        yr = ref(xr)
        (yr * yr).sum().backward()
    par.initialize()
    load(par, ref)
    xp = hl.nd.array(x)
    xp.attach_grad()
    with autograd.record():
        yp = par(xp)
        (yp * yp).sum().backward()
    assert yp.device == hl.cpu(0)
    np.testing.assert_allclose(yp.asnumpy(), yr.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xp.grad.asnumpy(), xr.grad.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shard_grads(par), ref.weight.grad().asnumpy(), rtol=1e-5, atol=1e-5)
    return par


def _full(par, axis):
    for w in par._w:
        assert w.list_device() == [w.home]
    return np.concatenate([w.grad(w.home).asnumpy() for w in par._w], axis)


def _load(par, ref):
    par.load_full(ref.weight.data().asnumpy(), ref.bias.data().asnumpy())


@pytest.mark.parametrize("k", [2, 3])
def test_column_parallel_dense(k):
    x = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
    par = _compare(nn.Dense(7, activation="tanh", in_units=10),
                   ColumnParallelDense(7, devs(k), activation="tanh"), x, _load,
                   lambda p: _full(p, 0))
    assert [w.shape[0] for w in par._w] == [len(a) for a in np.array_split(range(7), k)]
    # the bias gradients are shards of the unsplit one
    assert sum(b.shape[0] for b in par._b) == 7


@pytest.mark.parametrize("k", [2, 3])
def test_row_parallel_dense(k):
    x = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    _compare(nn.Dense(7, activation="relu", in_units=10), RowParallelDense(7, devs(k), activation="relu"),
             x, _load, lambda p: _full(p, 1))


def test_channel_parallel_conv2d():
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)
    _compare(nn.Conv2D(5, 3, padding=1, activation="relu", in_channels=3),
             ChannelParallelConv2D(5, 3, devs(2), padding=1, activation="relu"), x, _load,
             lambda p: _full(p, 0))


def test_megatron_mlp_block_equals_unsplit():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    d1, d2 = nn.Dense(8, activation="relu", in_units=6), nn.Dense(3, in_units=8)
    d1.initialize()
    d2.initialize()
    col = ColumnParallelDense(8, devs(2), activation="relu", gather_output=False, in_units=6)
    row = RowParallelDense(3, devs(2), input_is_parallel=True, in_units=8)
    col.initialize()
    row.initialize()
    _load(col, d1)
    _load(row, d2)
    xr, xp = hl.nd.array(x), hl.nd.array(x)
    xr.attach_grad()
    xp.attach_grad()
    with autograd.record():
        yr = d2(d1(xr))
        yr.sum().backward()
        shards = col(xp)
        yp = row(shards)
        yp.sum().backward()
    assert [s.device for s in shards] == devs(2)
    np.testing.assert_allclose(yp.asnumpy(), yr.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xp.grad.asnumpy(), xr.grad.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_full(row, 1), d2.weight.grad().asnumpy(), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_errors():
    with pytest.raises(ValueError, match="units=1 cannot be split over 2 devices"):
        ColumnParallelDense(1, devs(2))
    with pytest.raises(ValueError, match="list of 2 shards"):
        r = RowParallelDense(3, devs(2), input_is_parallel=True, in_units=4)
        r.initialize()
        r(hl.nd.ones((2, 4)))


# ============================================================================ hybridl train


def test_train_cli_uneven_batch_refused_only_for_data_parallel(capsys):
    """Pipeline micro-batches and tensor parallelism do not split the batch over the
    devices: a batch that 3 devices cannot share evenly is fine there."""
    from hybridl.train_cli import main_train
    common = ["--model", "mlp", "--devices", "cpu:0,cpu:1,cpu:2", "--epochs", "1", "--quiet",
              "--batch-size", "32"]
    assert main_train(common + ["--strategy", "pipeline", "--microbatches", "4"]) == 0
    assert main_train(common + ["--strategy", "tensor"]) == 0
    assert main_train(common) == 2
    assert "does not split evenly over 3 devices" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["data", "pipeline", "tensor"])
def test_train_cli_multi_device(strategy, capsys):
    from hybridl.train_cli import main_train
    extra = ["--microbatches", "2"] if strategy == "pipeline" else []
    rc = main_train(["--model", "mlp", "--devices", "cpu:0,cpu:1", "--strategy", strategy,
                     "--epochs", "1", "--quiet", *extra])
    out = capsys.readouterr().out
    assert rc == 0
    assert "epoch   1  loss" in out and "test acc" in out and "samples/s" in out
    assert f"on 2 devices ({strategy})" in out


@pytest.mark.parametrize("engine", ["threaded", "naive"])
def test_ring_allreduce_passes_a_failed_gradient_on_without_a_second_error(engine):
    """kvstore='device', 2 devices, one device's batch fails (a label 1.5): the ring's ops on
    the other device pass that error on instead of failing on a buffer never loaded (a
    spurious 'NoneType is not subscriptable' at the next waitall, or raised by the naive
    engine); the skipped update leaves every copy of the weights as it was."""
    devs = [hl.cpu(0), hl.cpu(1)]
    with hl.engine.set_engine(engine):
        hl.random.seed(0)
        net = nn.Dense(3, in_units=6)
        net.initialize(device=devs)
        trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                             kvstore="device")
        loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
        before = [p.data(d).asnumpy() for p in net.collect_params().values() for d in devs]
        x = np.random.default_rng(1).random((8, 6)).astype("float32")
        y = np.array([0, 1, 2, 0, 1, 2, 0, 1.5], "float32")
        xs, ys = split_and_load(x, devs), split_and_load(y, devs)
        errors = []
        try:
            with autograd.record():
                losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
            for loss in losses:
                loss.backward()
            for loss in losses:
                loss.asnumpy()
        except hl.OpError as e:
            errors.append(str(e))
        try:
            hl.waitall()
        except hl.OpError as e:
            errors.append(str(e))
        assert errors and all("whole numbers" in e for e in errors), errors
        trainer.step(8, ignore_stale_grad=True)   # the error was handled: the step is skipped
        hl.waitall()                        # ... and reports nothing new
        after = [p.data(d).asnumpy() for p in net.collect_params().values() for d in devs]
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def _dp_run(devs, grad_req="write", zero=True, steps=4, batch=1, data_devs=None):
    import hybridl as hl
    from hybridl import autograd
    rng = np.random.RandomState(0)
    X = rng.rand(steps, batch, 1, 8, 8).astype("float32")
    Y = rng.randint(0, 10, (steps, batch)).astype("float32")
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    hl.random.seed(0)
    net = hl.models.mlp(hidden=(32, 16))
    net.initialize(hl.init.Xavier(), device=devs)
    if grad_req != "write":
        for p in net.collect_params().values():
            p.grad_req = grad_req
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                    kvstore="device" if len(devs) > 1 else None)
    dp = hl.parallel.DataParallel(net, data_devs or devs)
    for s in range(steps):
        with autograd.record():
            loss = lf(dp(hl.nd.array(X[s])), hl.nd.array(Y[s]))
        loss.backward()
        tr.step(batch)
        if zero and grad_req == "add":
            tr.zero_grad()
    return {n: [a.asnumpy() for a in p.list_data()] for n, p in net.collect_params().items()}


@pytest.mark.parametrize("case", ["batch_smaller_than_devices", "data_on_fewer_devices",
                                  "add_without_zero_grad", "add_idle_without_zero_grad"])
def test_data_parallel_equals_one_device_when_devices_idle_or_gradients_accumulate(case):
    import warnings

    import hybridl as hl
    devs = [hl.cpu(0), hl.cpu(1), hl.cpu(2)]
    kw = {"batch_smaller_than_devices": dict(batch=2),
          "data_on_fewer_devices": dict(batch=2, data_devs=[hl.cpu(0)]),
          "add_without_zero_grad": dict(batch=3, grad_req="add", zero=False),
          "add_idle_without_zero_grad": dict(batch=2, grad_req="add", zero=False)}[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = _dp_run([hl.cpu(0)], **{k: v for k, v in kw.items() if k != "data_devs"})
        many = _dp_run(devs, **kw)
    for n in one:
        for copy in many[n]:               # every replica equals the one-device weights
            np.testing.assert_allclose(copy, one[n][0], rtol=1e-5, atol=1e-6)


def test_split_and_load_of_data_that_needs_a_gradient_passes_it_back():
    x = hl.nd.array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))
    w = hl.nd.array(np.arange(3, dtype=np.float32))
    grads = []
    for devs in ([hl.cpu(0)], [hl.cpu(0), hl.cpu(1)]):
        x.attach_grad()
        with autograd.record():
            parts = hl.parallel.split_and_load(x, devs)
            losses = [(p * w.copyto(p.device)).sum() for p in parts]
        autograd.backward(losses)
        grads.append(x.grad.asnumpy())
    np.testing.assert_array_equal(grads[0], np.tile(np.arange(3, dtype=np.float32), (4, 1)))
    np.testing.assert_array_equal(grads[1], grads[0])


@pytest.mark.parametrize("kvstore", ["device", None, "instance"])
@pytest.mark.parametrize("target", ["both", "other"])
def test_reset_device_during_training_replans_and_moves_optimizer_state(kvstore, target):
    rng = np.random.RandomState(0)
    B = 12
    X = rng.rand(3, B, 1, 8, 8).astype("float32")
    Y = rng.randint(0, 10, (3, B)).astype("float32")
    lf = hl.loss.SoftmaxCrossEntropyLoss()

    def run(reset_to):
        hl.random.seed(0)
        net = hl.models.mlp(hidden=(32, 16))
        net.initialize(hl.init.Xavier(), device=hl.cpu(0))
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                        kvstore=hl.kv.create("device") if kvstore == "instance" else kvstore)
        for s in range(3):
            if s == 1 and reset_to is not None:
                net.collect_params().reset_device(reset_to)
            devs = net.collect_params()["0.weight"].list_device()
            xs = hl.parallel.split_and_load(X[s], devs)
            ys = hl.parallel.split_and_load(Y[s], devs)
            with autograd.record():
                losses = [lf(net(a), b) for a, b in zip(xs, ys)]
            autograd.backward(losses)
            tr.step(B)
        return {n: [a.asnumpy() for a in p.list_data()] for n, p in net.collect_params().items()}
    one = run(None)
    moved = run([hl.cpu(0), hl.cpu(1)] if target == "both" else [hl.cpu(1)])
    for n in one:
        for copy in moved[n]:
            np.testing.assert_allclose(copy, one[n][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 3])
def test_tensor_parallel_layers_start_as_the_unsplit_layer(k):
    devs = [hl.cpu(i) for i in range(k)]
    hl.random.seed(3)
    dense = nn.Dense(7, in_units=5)
    conv = nn.Conv2D(6, 3, in_channels=2)
    dense.initialize(hl.init.Xavier())
    conv.initialize(hl.init.Xavier())
    hl.random.seed(3)
    cd = ColumnParallelDense(7, devs, in_units=5)
    cc = ChannelParallelConv2D(6, 3, devs, in_channels=2)
    rd = hl.parallel.RowParallelDense(7, devs)        # in_units deferred: split on first call
    cd.initialize(hl.init.Xavier())
    cc.initialize(hl.init.Xavier())
    np.testing.assert_array_equal(np.concatenate([w.data().asnumpy() for w, _ in cd.shard_params()]),
                                  dense.weight.data().asnumpy())
    np.testing.assert_array_equal(np.concatenate([w.data().asnumpy() for w, _ in cc.shard_params()]),
                                  conv.weight.data().asnumpy())
    hl.random.seed(5)
    ref = nn.Dense(7, in_units=8)
    ref.initialize(hl.init.Xavier())
    hl.random.seed(5)
    rd.initialize(hl.init.Xavier())
    rd(hl.nd.ones((2, 8)))
    np.testing.assert_array_equal(np.concatenate([w.data().asnumpy() for w in rd._w], axis=1),
                                  ref.weight.data().asnumpy())


def test_pipeline_with_a_frozen_first_stage_trains_the_rest():
    x = np.random.default_rng(0).random((4, 5)).astype("float32")
    y = np.array([0, 1, 2, 3], np.float32)
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    grads = []
    for piped in (False, True):
        hl.random.seed(0)
        s = [nn.Dense(8, in_units=5), nn.Dense(10, in_units=8)]
        if piped:
            p = Pipeline(s, [hl.cpu(0), hl.cpu(1)], 2)
            p.initialize()
        else:
            for b in s:
                b.initialize()
        s[0].collect_params().setattr("grad_req", "null")
        if piped:
            p.forward_backward(x, y, lf)
        else:
            with autograd.record():
                loss = lf(s[1](s[0](hl.nd.array(x))), hl.nd.array(y))
            loss.backward()
        grads.append(s[1].weight.grad(s[1].weight.list_device()[0]).asnumpy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_pipeline_refuses_a_loss_that_is_not_per_sample_before_any_backward():
    # a mean loss failed in concat only after every backward had accumulated gradients
    x = np.random.default_rng(0).random((4, 5)).astype("float32")
    y = np.array([0, 1, 2, 3], np.float32)
    s = [nn.Dense(8, in_units=5), nn.Dense(10, in_units=8)]
    p = Pipeline(s, [hl.cpu(0), hl.cpu(1)], 2)
    p.initialize()
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    with pytest.raises(ValueError, match=r"per-sample losses \(shape \(2,\).*got shape \(\)"):
        p.forward_backward(x, y, lambda o, t: lf(o, t).mean())
    hl.waitall()
    for b in s:
        for q in b.collect_params().values():
            assert not q.grad(q.list_device()[0]).asnumpy().any()     # no backward ran
    losses, _ = p.forward_backward(x, y, lf)
    assert losses.shape == (4,)


def test_data_parallel_refuses_an_idle_device_when_sync_batch_norm_waits_for_all():
    devs = [hl.cpu(0), hl.cpu(1)]
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3), hl.parallel.SyncBatchNorm(in_channels=4))
    net.initialize(device=devs)
    dp = hl.parallel.DataParallel(net, devs)
    with autograd.record():
        with pytest.raises(ValueError, match="batch of 1 sample.*SyncBatchNorm"):
            dp(hl.nd.ones((1, 3)))
    assert dp(hl.nd.ones((1, 3))).shape == (1, 4)       # predict mode: running statistics
