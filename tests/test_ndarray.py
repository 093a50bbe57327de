"""NDArray: creation, conversion, sync points, devices, asynchrony, value semantics of writes,
and identical results under the naive and threaded engines."""
import threading

import numpy as np
import pytest

import hybridl as hl
from hybridl import nd


def A(x):
    v = x.asnumpy()
    assert v.shape == tuple(x.shape) and v.dtype == x.dtype
    return v


def test_array_creation_dtypes_and_copies():
    assert nd.array([1.0, 2.0]).dtype == np.float32
    assert nd.array([1, 2]).dtype == np.int64
    assert nd.array([[True], [False]]).dtype == np.bool_
    assert nd.array(np.zeros(2, np.int32)).dtype == np.int32
    assert nd.array(np.zeros(2, np.uint8)).dtype == np.int64
    assert nd.array(np.zeros(2)).dtype == np.float64
    assert nd.array([1, 2], dtype="float64").dtype == np.float64
    src = np.arange(6.0).reshape(2, 3)
    x = nd.array(src)
    src[0, 0] = 100.0                       # array() copies
    assert A(x)[0, 0] == 0.0
    v = x.asnumpy()
    v[0, 1] = -5.0                          # asnumpy() returns a copy
    assert A(x)[0, 1] == 1.0
    y = nd.array(x, dtype="int32")          # from an NDArray: a copy, converted
    assert y.dtype == np.int32
    np.testing.assert_array_equal(A(y), np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="obj"):
        nd.array(["a", "b"])
    with pytest.raises(TypeError):
        nd.array([1 + 2j])
    with pytest.raises(TypeError, match="dtype"):
        nd.array([1.0], dtype="float16")


def test_from_numpy_is_not_mutated_by_writes():
    buf = np.arange(4.0)
    x = nd.from_numpy(buf)
    assert x.dtype == np.float64
    x[1:3] = 9.0
    x += 1
    np.testing.assert_array_equal(A(x), [1.0, 10.0, 10.0, 4.0])
    np.testing.assert_array_equal(buf, np.arange(4.0))     # storage never mutated in place


def test_properties_and_python_protocols():
    a = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    x = nd.array(a)
    assert x.shape == (2, 3) and x.ndim == 2 and x.size == 6 and len(x) == 2
    assert x.device == hl.cpu(0)
    np.testing.assert_array_equal(A(x.T), a.T)
    rows = list(x)
    assert len(rows) == 2
    np.testing.assert_array_equal(A(rows[1]), a[1])
    np.testing.assert_array_equal(np.asarray(x), a)
    assert np.asarray(x, dtype=np.int32).dtype == np.int32
    assert bool(nd.array([1.0])) and not bool(nd.array(0.0))
    assert float(nd.array([2.5])) == 2.5
    assert int(nd.array([3])) == 3
    assert [10, 20, 30][nd.array(2)] == 30
    assert nd.array(7).item() == 7 and isinstance(nd.array(7).item(), int)
    assert isinstance(nd.array(1.5).item(), float)
    with pytest.raises(ValueError, match="one-element"):
        x.item()
    with pytest.raises(ValueError, match="more than one element.*ambiguous"):
        bool(x)
    with pytest.raises(TypeError, match="integer"):
        [1, 2][nd.array(1.0)]
    with pytest.raises(TypeError, match="0-d"):
        len(nd.array(1.0))
    r = repr(x)
    assert "NDArray" in r and "shape=(2, 3)" in r and "float32" in r and "5." in r
    assert str(x) == r
    s = nd.array([1, 2]).sum()
    assert s.shape == () and s.item() == 3


def test_numpy_values_on_the_left():
    x = nd.array([1.0, 2.0])
    r = np.float32(2.0) * x
    assert isinstance(r, hl.NDArray) and r.dtype == np.float32
    np.testing.assert_array_equal(A(r), [2.0, 4.0])
    r = np.array([1.0, 1.0], np.float32) + x
    assert isinstance(r, hl.NDArray)
    np.testing.assert_array_equal(A(r), [2.0, 3.0])
    r = x - np.array([[1.0], [2.0]], np.float32)
    np.testing.assert_array_equal(A(r), [[0.0, 1.0], [-1.0, 0.0]])


def test_astype_copy_semantics():
    x = nd.array([1.5, -2.5])
    assert x.astype("float32", copy=False) is x
    y = x.astype("float32")
    assert y is not x
    x += 1
    np.testing.assert_array_equal(A(y), [1.5, -2.5])
    np.testing.assert_array_equal(A(x.astype("int32")), [2, -1])


def test_devices_and_copies():
    a = np.arange(4.0, dtype=np.float32)
    x = nd.array(a)
    with hl.cpu(1):
        z = nd.zeros(3)
        assert z.device == hl.cpu(1)
        assert hl.current_device() == hl.cpu(1)
    assert hl.current_device() == hl.cpu(0)
    assert nd.ones(2, device="cpu:2").device == hl.cpu(2)
    y = x.copyto(hl.cpu(1))
    assert y.device == hl.cpu(1)
    np.testing.assert_array_equal(A(y * 2), a * 2)
    assert (y * 2).device == hl.cpu(1)
    w = x.to("cpu(3)")
    assert w.device == hl.cpu(3)
    np.testing.assert_array_equal(A(w.to(hl.cpu(0)) + x), 2 * a)
    dst = nd.zeros(4, dtype="int64")
    assert x.copyto(dst) is dst
    np.testing.assert_array_equal(A(dst), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="shape"):
        x.copyto(nd.zeros(3))
    with pytest.raises(TypeError, match="Device"):
        x.copyto(3)
    with pytest.raises(ValueError, match="copyto"):
        nd.ones(2, device=hl.cpu(1)) * nd.ones(2)


def test_copy_is_recorded_by_autograd():
    x = nd.array(np.array([1.0, 2.0]))
    x.attach_grad()
    with hl.autograd.record():
        y = x.copyto(hl.cpu(1)) * 3.0
    y.backward()
    assert y.device == hl.cpu(1)
    np.testing.assert_array_equal(A(x.grad), [3.0, 3.0])


def test_ops_return_before_inputs_are_ready():
    x = nd.zeros(3)
    gate = threading.Event()

    def slow():
        assert gate.wait(30)
        x._data = np.array([1.0, 2.0, 3.0], np.float32)

    hl.engine.push(slow, [], [x._var], hl.cpu(0), name="slow")
    y = (x + 1).reshape(3, 1).sum(axis=1)        # all pushed while x is still being written
    assert y.shape == (3,) and y.dtype == np.float32
    x2 = x * 1
    gate.set()
    np.testing.assert_array_equal(A(y), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(A(x2), [1.0, 2.0, 3.0])
    hl.waitall()


def _program():
    hl.random.seed(3)
    x = nd.random.normal(shape=(4, 5))
    w = nd.random.uniform(-1, 1, shape=(3, 5))
    y = nd.fully_connected(x, w).relu()
    z = nd.softmax(y) + nd.take(y, nd.array([0, 0, 2]), axis=1).mean()
    z[1:3] = 0.0
    z += x[:, :3]
    return [A(v) for v in (x, w, y, z, nd.argmax(z, axis=1))]


def test_naive_and_threaded_engines_agree():
    r1 = _program()
    with hl.engine.set_engine("naive") as eng:
        assert type(eng).__name__ == "NaiveEngine"
        r2 = _program()
    prev = hl.engine.set_engine("naive")
    try:
        r3 = _program()
    finally:
        hl.engine.set_engine(prev.prev)
    assert type(hl.engine.get_engine()).__name__ == "ThreadedEngine"
    for a, b, c in zip(r1, r2, r3):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_concurrent_frontend_threads():
    errs = []

    def work(k):
        try:
            x = nd.full((50,), float(k))
            for _ in range(30):
                x = x + 1
            x += k
            assert A(x)[0] == 2 * k + 30
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs


def test_writes_after_reads_keep_old_values_under_both_engines():
    for eng in ("threaded", "naive"):
        with hl.engine.set_engine(eng):
            a = np.arange(12.0, dtype=np.float32).reshape(3, 4)
            x = nd.array(a)
            views = [x.reshape(4, 3), x.T, x[1], x[:, ::2], nd.expand_dims(x, 0), x.flatten(),
                     nd.broadcast_to(x, (2, 3, 4)), nd.swapaxes(x, 0, 1), x.astype("float64"),
                     nd.split(x, 2, axis=1)[0], x[...], nd.squeeze(nd.expand_dims(x, 2)),
                     # no-op shape/dtype changes are new handles too
                     x.reshape(3, 4), x.reshape(-1, 4), nd.squeeze(x), nd.transpose(x, (0, 1)),
                     nd.broadcast_to(x, (3, 4)), nd.cast(x, "float32"), x.astype("float32"), +x,
                     nd.dropout(x, 0.5, training=False), nd.dropout(x, 0.0, training=True),
                     nd.sum(x, axis=()), nd.stack(x)[0], nd.concat(x)]
            refs = [a.reshape(4, 3), a.T, a[1], a[:, ::2], a[None], a.reshape(3, 4),
                    np.broadcast_to(a, (2, 3, 4)), a.T, a, a[:, :2], a, a] + [a] * 13
            x += 1
            x[0] = -1.0
            x[1:3] = nd.array(np.full((2, 4), 7.0, np.float32))
            x[...] = x * 2
            want = np.full((3, 4), 14.0, np.float32)
            want[0] = -2.0
            np.testing.assert_array_equal(A(x), want)
            for v, r in zip(views, refs):
                np.testing.assert_array_equal(A(v), r)


def test_setitem_dtype_and_broadcast():
    x = nd.zeros((2, 3), dtype="int32")
    x[0] = 2.7                         # cast to the destination dtype, as NumPy
    x[1, ::2] = nd.array([5, 6])
    assert x.dtype == np.int32
    np.testing.assert_array_equal(A(x), [[2, 2, 2], [5, 0, 6]])
    y = nd.zeros((2, 3))
    y[:, 1:] = nd.array([[1.0], [2.0]])
    np.testing.assert_array_equal(A(y), [[0, 1, 1], [0, 2, 2]])
    y[None, 0, None] = 4.0
    np.testing.assert_array_equal(A(y), [[4, 4, 4], [0, 2, 2]])
    with pytest.raises(ValueError, match="broadcast"):
        y[0] = nd.zeros(2)
    with pytest.raises(IndexError):
        y[3] = 1.0


def test_waitall_and_wait_to_read():
    x = nd.ones((100, 100))
    ys = [x * i for i in range(10)]
    hl.waitall()
    nd.waitall()
    assert ys[3].wait_to_read() is ys[3]
    assert A(ys[9])[5, 5] == 9.0
