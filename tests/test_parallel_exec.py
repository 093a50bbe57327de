"""Parallel execution across logical devices: identical results with the threaded (parallel) and
naive (serial) engines, asynchronous copies between devices (reading a pending copy, the copy
queue, overlap with compute), and the error for inputs on different devices.

Overlap is checked from profiler events (intervals recorded inside the ops), never from
wall-clock speedups."""
import contextlib

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, profiler
from hybridl.engine import OpError, ThreadedEngine

DEVS = [hl.cpu(i) for i in range(3)]


@pytest.fixture(autouse=True)
def _clean():
    with contextlib.suppress(OpError):
        hl.waitall()
    assert isinstance(hl.engine.get_engine(), ThreadedEngine)
    yield
    with contextlib.suppress(OpError):
        hl.waitall()
    assert isinstance(hl.engine.get_engine(), ThreadedEngine)


@contextlib.contextmanager
def _one_blas_thread():
    """Same BLAS thread count in both engines, so results can be compared bit for bit."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _multi_device_program(seed):
    """Eager code over three devices: per-device chains, copies both ways, autograd, in-place
    updates, reductions. Returns NumPy results."""
    rng = np.random.default_rng(seed)
    hl.random.seed(seed)
    xs = [hl.nd.array(rng.standard_normal((48, 48)).astype(np.float32), device=d) for d in DEVS]
    ws = [hl.nd.array(rng.standard_normal((48, 48)).astype(np.float32) / 7, device=d) for d in DEVS]
    outs = []
    for x, w in zip(xs, ws):                  # independent chains, one per device
        y = x
        for _ in range(6):
            y = hl.nd.tanh(hl.nd.dot(y, w)) + 0.1 * y
        outs.append(y)
    # gather to cpu(0), combine, scatter back and keep computing
    total = outs[0]
    for y in outs[1:]:
        total = total + y.copyto(DEVS[0])
    back = [total.copyto(d) * (i + 1) for i, d in enumerate(DEVS)]
    for b, w in zip(back, ws):
        b += hl.nd.dot(b, w)
    # autograd on cpu(1) with a random op
    p = xs[1].copyto(DEVS[1])
    p.attach_grad()
    with autograd.record():
        noise = hl.nd.random.normal(0, 1, shape=(48, 48), device=DEVS[1])
        loss = (hl.nd.sigmoid(hl.nd.dot(p, ws[1])) * (1 + 0.01 * noise)).sum()
    loss.backward()
    res = [o.asnumpy() for o in outs] + [b.asnumpy() for b in back]
    res += [total.asnumpy(), loss.asnumpy(), p.grad.asnumpy(),
            back[2].sum(axis=0).copyto(DEVS[1]).asnumpy()]
    return res


@pytest.mark.parametrize("seed", [0, 1])
def test_parallel_and_serial_results_identical(seed):
    with _one_blas_thread():
        par = _multi_device_program(seed)
        with hl.engine.set_engine("naive"):
            ser = _multi_device_program(seed)
    assert len(par) == len(ser)
    for a, b in zip(par, ser):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(a)) for a in par)


def _slow_chain(n=384, steps=12, device=None):
    """A value computed by a chain of matmuls (tens of ms): pending for a while after the push.
    Returns (result, expected NumPy value)."""
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((n, n)).astype(np.float32)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    q = q.astype(np.float32)
    x, w = hl.nd.array(x0, device=device), hl.nd.array(q, device=device)
    hl.waitall()
    for _ in range(steps):
        x = hl.nd.dot(x, w)
    ref = x0
    for _ in range(steps):
        ref = ref @ q
    return x, ref


def test_read_pending_copy_returns_right_data():
    import time
    with profiler.profile() as prof:
        src, ref = _slow_chain(device=hl.cpu(0))
        dst = src.copyto(hl.cpu(1))
        t_read = time.perf_counter()
        got = dst.asnumpy()                   # the copy (and the chain) are still pending here
    assert dst.device == hl.cpu(1) and dst.shape == src.shape and dst.dtype == src.dtype
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got, src.asnumpy())
    copies = [e for e in prof.events if e.name == "copy"]
    assert len(copies) == 1
    assert copies[0].end > t_read, "the copy had finished before the read: not a pending read"
    # the copy ran after the last op of the chain that wrote its source
    last_mm = max(e.end for e in prof.events if e.queue == "compute")
    assert copies[0].start >= last_mm


def test_copy_into_existing_array_and_pending_chain_on_destination():
    src, ref = _slow_chain(steps=6, device=hl.cpu(0))
    dst = hl.nd.zeros(src.shape, device=hl.cpu(2))
    assert src.copyto(dst) is dst
    y = (dst * 2).sum(axis=1)                 # pushed on cpu(2) behind the pending copy
    np.testing.assert_allclose(y.asnumpy(), (ref * 2).sum(axis=1), rtol=1e-3, atol=1e-2)
    with pytest.raises(ValueError, match="shape"):
        src.copyto(hl.nd.zeros((2, 2), device=hl.cpu(1)))


def test_copy_runs_on_copy_queue_thread():
    src, _ = _slow_chain(steps=4, device=hl.cpu(0))
    with profiler.profile() as prof:
        dst = src.copyto(hl.cpu(1))
        back = dst.copyto(hl.cpu(0))
        back.wait_to_read()
    copies = [e for e in prof.events if e.name == "copy"]
    assert [e.key for e in copies] == [("copy", hl.cpu(1)), ("copy", hl.cpu(0))]
    assert [e.queue for e in copies] == ["copy", "copy"]
    assert [e.device for e in copies] == [hl.cpu(1), hl.cpu(0)]
    assert [e.thread for e in copies] == ["hybridl-copy-cpu(1)-w0", "hybridl-copy-cpu(0)-w0"]
    assert copies[0].end <= copies[1].start
    assert copies[0].bytes == 2 * src.size * 4


def test_copy_overlaps_compute():
    """A copy of a ready array runs on the copy worker while the device's compute worker is
    busy: the compute worker is held by an op that waits for a gate, the copies are pushed and
    waited for, and only then is the gate opened. Were copies queued behind compute, they could
    not finish before the gate op gave up (20 s) and the intervals would not overlap. (Before:
    a statistical check with retries, which failed under load.)"""
    import threading
    big = hl.nd.array(np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32))
    big.copyto(hl.cpu(1)).wait_to_read()  # the copy worker exists before anything is timed
    hl.waitall()
    gate, started = threading.Event(), threading.Event()
    held = hl.nd.zeros((1,), device=hl.cpu(1))

    def hold():
        started.set()
        gate.wait(20)

    with profiler.profile() as prof:
        hl.engine.push(hold, [], [held._var], hl.cpu(1), name="gate")
        assert started.wait(20), "the compute worker never started the gate op"
        copies = [big.copyto(hl.cpu(1)) for _ in range(4)]
        for c in copies:
            c.wait_to_read()
        copied_while_held = not gate.is_set()
        gate.set()
        held.wait_to_read()
    assert copied_while_held
    for c in copies:
        np.testing.assert_array_equal(c.asnumpy(), big.asnumpy())
    (g,) = [e for e in prof.events if e.name == "gate"]
    cps = [e for e in prof.events if e.queue == "copy"]
    assert len(cps) == 4 and g.queue == "compute" and g.thread == "hybridl-cpu(1)-w0"
    assert {e.thread for e in cps} == {"hybridl-copy-cpu(1)-w0"}
    assert all(g.start < e.start and e.end < g.end for e in cps)


@pytest.mark.parametrize("make", [
    lambda a, b: a + b,
    lambda a, b: hl.nd.dot(a, b),
    lambda a, b: a * b,
    lambda a, b: hl.nd.concat(a, b, axis=0),
])
def test_inputs_on_different_devices_raise_with_copy_hint(make):
    a = hl.nd.ones((2, 2), device=hl.cpu(0))
    b = hl.nd.ones((2, 2), device=hl.cpu(1))
    with pytest.raises(ValueError, match=r"different devices.*copyto") as ei:
        make(a, b)
    assert "cpu(0)" in str(ei.value) and "cpu(1)" in str(ei.value)
    # after the explicit copy it works
    np.testing.assert_array_equal(make(a, b.copyto(hl.cpu(0))).asnumpy(),
                                  make(a, b.copyto(hl.cpu(0))).asnumpy())


def test_different_devices_error_also_in_naive_engine():
    with hl.engine.set_engine("naive"):
        a = hl.nd.ones((2, 2), device=hl.cpu(0))
        b = hl.nd.ones((2, 2), device=hl.cpu(2))
        with pytest.raises(ValueError, match="copyto"):
            a + b
        with profiler.profile() as prof:
            c = b.copyto(hl.cpu(0)) + a
        np.testing.assert_array_equal(c.asnumpy(), 2 * np.ones((2, 2)))
        assert [e.key for e in prof.events if e.name == "copy"] == [("copy", hl.cpu(0))]
