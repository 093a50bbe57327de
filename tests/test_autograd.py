"""Gradients of every differentiable op against float64 central finite differences, and the
semantics of autograd (grad_req, reuse, retain_graph, higher order, modes, asynchrony).

``check_grad`` draws random float64 inputs and a random output cotangent ``w``, sets
``L(x) = sum(w * f(x))`` and compares the autograd gradient (``backward(w)`` and
``hl.autograd.grad``) with ``(L(x + h e_i) - L(x - h e_i)) / 2h`` for every element ``i``.
"""
import threading

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nd

H = 1e-6


class U:
    """A random float64 input: uniform in [lo, hi), optionally kept at least ``gap`` from 0
    (``away0``) or made of distinct well-separated values (``distinct``, no ties for max/pool)."""

    def __init__(self, *shape, lo=-2.0, hi=2.0, away0=False, distinct=False):
        self.shape, self.lo, self.hi, self.away0, self.distinct = shape, lo, hi, away0, distinct

    def draw(self, rng):
        if self.distinct:
            n = int(np.prod(self.shape))
            return (rng.permutation(n) * 0.1 - 0.05 * n + rng.uniform(0, 0.01, n)).reshape(self.shape)
        v = np.asarray(rng.uniform(self.lo, self.hi, self.shape))
        if self.away0:
            v = np.asarray(np.where(v < 0, -1.0, 1.0) * (0.2 + np.abs(v)))
        return v


def check_grad(f, *specs, seed=0, rtol=1e-5, atol=1e-6):
    """Compare autograd with central differences for every float64 input of ``f``.

    ``specs``: ``U`` (random float64 input, differentiated) or a NumPy array / scalar
    (a constant input, e.g. integer indices).
    """
    rng = np.random.default_rng(seed)
    xs = [s.draw(rng) if isinstance(s, U) else np.asarray(s) for s in specs]
    diff = [i for i, s in enumerate(specs) if isinstance(s, U)]

    def variables():
        vs = [nd.array(x) for x in xs]
        for i in diff:
            vs[i].attach_grad()
        return vs

    vs = variables()
    with hl.autograd.record():
        y = f(*vs)
    assert y.dtype == np.float64, f"float64 inputs should give float64, got {y.dtype}"
    w = rng.standard_normal(y.shape)
    y.backward(nd.array(w))
    got = [vs[i].grad.asnumpy() for i in diff]

    vs2 = variables()                       # the functional API gives the same, .grad untouched
    with hl.autograd.record():
        y2 = f(*vs2)
    got2 = hl.autograd.grad(y2, [vs2[i] for i in diff], head_grads=nd.array(w))

    def L():
        return float(np.sum(w * f(*[nd.array(x) for x in xs]).asnumpy()))

    for k, i in enumerate(diff):
        x = xs[i].reshape(-1)          # a view: edits go into xs[i]
        num = np.zeros(x.size)
        for j in range(x.size):
            old = x[j]
            x[j] = old + H
            lp = L()
            x[j] = old - H
            lm = L()
            x[j] = old
            num[j] = (lp - lm) / (2 * H)
        num = num.reshape(xs[i].shape)
        assert got[k].shape == xs[i].shape and got[k].dtype == np.float64
        np.testing.assert_allclose(got[k], num, rtol=rtol, atol=atol, err_msg=f"d/d(input {i})")
        np.testing.assert_allclose(got2[k].asnumpy(), got[k], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(vs2[i].grad.asnumpy(), np.zeros(xs[i].shape))


# ============================================================================ elementwise

BIN_SHAPES = [((2, 3), (2, 3)), ((2, 3), (3,)), ((2, 1), (1, 3)), ((1,), (2, 3)), ((2, 3), ()),
              ((3, 1, 2), (1, 4, 1))]


@pytest.mark.parametrize("sa,sb", BIN_SHAPES, ids=str)
@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide", "power", "maximum",
                                  "minimum"])
def test_grad_binary(name, sa, sb):
    f = getattr(nd, name)
    if name == "power":
        check_grad(f, U(*sa, lo=0.5, hi=2.0), U(*sb, lo=-1.5, hi=1.5))
    elif name == "divide":
        check_grad(f, U(*sa), U(*sb, away0=True))
    else:
        check_grad(f, U(*sa), U(*sb))


def test_grad_binary_with_scalars_and_operators():
    check_grad(lambda x: 3.0 * x - x / 2.0 + 1.5 ** x - 2.0 / (x + 3.0), U(2, 3))
    check_grad(lambda x: x ** 3 + (-x) * x, U(4))
    check_grad(lambda x, y: (x @ y) * x.sum(), U(2, 3), U(3, 2))


UNARY = {
    "exp": (nd.exp, {}), "log": (nd.log, dict(lo=0.2, hi=3)), "log1p": (nd.log1p, dict(lo=-0.8, hi=3)),
    "expm1": (nd.expm1, {}), "sqrt": (nd.sqrt, dict(lo=0.2, hi=3)), "square": (nd.square, {}),
    "tanh": (nd.tanh, {}), "sigmoid": (nd.sigmoid, dict(lo=-5, hi=5)),
    "relu": (nd.relu, dict(away0=True)), "softplus": (nd.softplus, dict(lo=-5, hi=5)),
    "abs": (nd.abs, dict(away0=True)), "sign": (nd.sign, dict(away0=True)),
    "sin": (nd.sin, dict(lo=-4, hi=4)), "cos": (nd.cos, dict(lo=-4, hi=4)),
    "reciprocal": (nd.reciprocal, dict(away0=True)), "floor": (nd.floor, dict(lo=0.1, hi=0.9)),
    "negative": (nd.negative, {}), "identity": (nd.identity, {}),
    "clip": (lambda x: nd.clip(x, -1.0, 0.8), {}), "clip_lo": (lambda x: nd.clip(x, a_min=0.3), {}),
    "clip_hi": (lambda x: nd.clip(x, a_max=-0.2), {}),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_grad_unary(name):
    f, kw = UNARY[name]
    check_grad(f, U(3, 4, **kw))


def test_grad_where():
    cond = np.array([[True, False, True], [False, False, True]])
    check_grad(lambda x, y: nd.where(nd.array(cond), x, y), U(2, 3), U(2, 3))
    check_grad(lambda x, y: nd.where(nd.array(cond[:, :1]), x, y), U(1, 3), U(2, 1))
    check_grad(lambda x: nd.where(x > 0, x, 0.1 * x), U(3, 3, away0=True))


def test_grad_composite_reuse():
    check_grad(lambda x: x * x + nd.sin(x) * x - nd.exp(x).sum() * x, U(2, 3))
    check_grad(lambda x, y: nd.tanh(x @ y) @ nd.transpose(y) + x, U(3, 2), U(2, 4))


# ============================================================================ reductions

RED_AXES = [None, 0, -1, (0, 2), (1,), ()]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", RED_AXES, ids=str)
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod"])
def test_grad_reductions(name, axis, keepdims):
    f = getattr(nd, name)
    spec = (U(2, 3, 2, lo=0.5, hi=1.5) if name == "prod" else
            U(2, 3, 2, distinct=True) if name in ("max", "min") else U(2, 3, 2))
    check_grad(lambda x: f(x, axis=axis, keepdims=keepdims), spec)


def test_grad_max_ties_split_evenly():
    x = nd.array(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, -1.0]]))
    x.attach_grad()
    with hl.autograd.record():
        y = nd.max(x, axis=1)
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [[0, 0.5, 0.5], [1, 0, 0]])


# ============================================================================ linear algebra

MM = [((3, 4), (4, 2)), ((2, 3, 4), (4, 2)), ((2, 1, 3, 2), (3, 2, 2)), ((4,), (4, 3)),
      ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (4,)), ((3,), (2, 3, 2)), ((1, 2, 3), (2, 3, 1))]


@pytest.mark.parametrize("sa,sb", MM, ids=str)
def test_grad_matmul(sa, sb):
    check_grad(nd.matmul, U(*sa), U(*sb))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 2)), ((4,), (4,)), ((2, 3, 4), (4, 2)), ((2, 3), (3, 2, 2))])
def test_grad_dot(sa, sb):
    check_grad(nd.dot, U(*sa), U(*sb))


@pytest.mark.parametrize("xs,ws,flatten", [((3, 4), (2, 4), True), ((2, 2, 3), (3, 6), True),
                                           ((2, 2, 3), (4, 3), False), ((3,), (2, 3), False)])
def test_grad_fully_connected(xs, ws, flatten):
    check_grad(lambda x, w, b: nd.fully_connected(x, w, b, flatten=flatten), U(*xs), U(*ws), U(ws[0]))
    check_grad(lambda x, w: nd.fully_connected(x, w, flatten=flatten), U(*xs), U(*ws))
    # fused relu: gradient and value equal the unfused pair
    check_grad(lambda x, w, b: nd.fully_connected(x, w, b, flatten=flatten, act="relu"),
               U(*xs), U(*ws), U(ws[0]))


# ============================================================================ shape ops

SHAPE_FNS = {
    "reshape": (lambda x: x.reshape(-1, 2), (2, 3, 2)),
    "reshape_m1": (lambda x: nd.reshape(x, (3, -1)), (2, 3, 2)),
    "transpose": (lambda x: x.T, (2, 3, 2)),
    "transpose_axes": (lambda x: nd.transpose(x, (1, 2, 0)), (2, 3, 2)),
    "swapaxes": (lambda x: nd.swapaxes(x, 0, -1), (2, 3, 2)),
    "expand_dims": (lambda x: nd.expand_dims(x, 1) * nd.expand_dims(x, -1), (2, 3)),
    "squeeze": (lambda x: nd.squeeze(x), (1, 3, 1, 2)),
    "squeeze_axis": (lambda x: nd.squeeze(x, axis=2), (1, 3, 1, 2)),
    "flatten": (lambda x: nd.flatten(x), (2, 3, 2)),
    "broadcast_to": (lambda x: nd.broadcast_to(x, (2, 3, 4)), (3, 1)),
    "broadcast_to_size1": (lambda x: nd.broadcast_to(x, (2, 3, 4)), (1, 1, 4)),
    "sum_to": (lambda x: nd.sum_to(x, (3, 1)) * 2.0, (2, 3, 4)),
    "concat": (lambda x: nd.concat(x, nd.sin(x), x[:, :1], axis=1), (2, 3)),
    "stack": (lambda x: nd.stack(x, x * x, axis=1), (2, 3)),
    "split_sections": (lambda x: nd.split(x, 3, axis=0)[1] * 2.0, (6, 2)),
    "split_indices": (lambda x: nd.concat(*reversed(nd.split(x, [1, 3], axis=1)), axis=1), (2, 5)),
    "split_unused": (lambda x: nd.split(x, [2], axis=-1)[0], (3, 4)),
}


@pytest.mark.parametrize("name", sorted(SHAPE_FNS))
def test_grad_shape_ops(name):
    f, shape = SHAPE_FNS[name]
    check_grad(f, U(*shape))


KEYS = [1, -1, (slice(None), 1), slice(None, None, 2), slice(None, None, -1), slice(-3, None),
        (Ellipsis, slice(1, None, 2)), (None, 1, Ellipsis), (slice(3, 0, -2), None, -1),
        (slice(1, 3), slice(None), 0)]


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_grad_slice(key):
    check_grad(lambda x: x[key], U(4, 3, 2))


@pytest.mark.parametrize("axis,idx,mode", [
    (0, np.array([0, 2, 2, 3]), "clip"), (1, np.array([[1, 0], [1, 1]]), "clip"),
    (0, np.array([5, -1, 1]), "clip"), (1, np.array([4, -1, 0]), "wrap"),
    (-1, np.array([1, -2, 0]), "raise"), (0, np.array(2), "clip"),
])
def test_grad_take(axis, idx, mode):
    check_grad(lambda a: nd.take(a, nd.array(idx), axis=axis, mode=mode), U(4, 3, 2))


def test_grad_embedding_and_indexing():
    idx = np.array([[1, 4], [0, 1], [9, -2]])
    check_grad(lambda w: nd.embedding(nd.array(idx), w), U(5, 3))
    check_grad(lambda a: a[nd.array([2, 2, 0])] + a[[1]], U(3, 2))


def test_grad_cast():
    x = nd.array(np.array([1.0, 2.0, 3.0], np.float32))
    x.attach_grad()
    with hl.autograd.record():
        y = x.astype("float64") * nd.array(np.array([1.0, 2.0, 3.0]))
    y.backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad.asnumpy(), [1.0, 2.0, 3.0])
    check_grad(lambda x: nd.cast(x, "float64") * 2.0, U(3))


def test_grad_stop_gradient_and_ints():
    x = nd.array(np.array([1.0, 2.0]))
    x.attach_grad()
    with hl.autograd.record():
        y = x * nd.stop_gradient(x * 3.0) + x.detach() * x
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [3.0 + 1.0, 6.0 + 2.0])
    check_grad(lambda x: x * nd.array(np.array([1, 2, 3])), U(3))


# ============================================================================ NN ops


@pytest.mark.parametrize("axis", [0, -1])
def test_grad_softmax(axis):
    check_grad(lambda x: nd.softmax(x, axis=axis), U(3, 4))
    check_grad(lambda x: nd.log_softmax(x, axis=axis), U(3, 4))


def test_grad_softmax_cross_entropy():
    check_grad(lambda x: nd.softmax_cross_entropy(x, nd.array(np.array([2, 0, 3]))), U(3, 4, lo=-3, hi=3))


@pytest.mark.parametrize("xs,ws,s,p,d,g", [
    ((2, 2, 5, 4), (3, 2, 3, 3), 1, 0, 1, 1),
    ((1, 2, 6, 5), (2, 2, 3, 2), 2, 1, 1, 1),
    ((1, 4, 5, 5), (4, 2, 2, 2), (1, 2), (1, 0), 1, 2),
    ((1, 2, 7, 6), (2, 1, 3, 3), 1, 2, 2, 2),
])
def test_grad_conv2d(xs, ws, s, p, d, g):
    kw = dict(stride=s, padding=p, dilation=d, groups=g)
    check_grad(lambda x, w, b: nd.conv2d(x, w, b, **kw), U(*xs), U(*ws), U(ws[0]))
    check_grad(lambda x, w: nd.conv2d(x, w, **kw), U(*xs), U(*ws), seed=1)
    # fused relu (Conv2D(activation='relu')): gradient through the in-place max
    check_grad(lambda x, w, b: nd.conv2d(x, w, b, act="relu", **kw), U(*xs), U(*ws), U(ws[0]),
               seed=2)


@pytest.mark.parametrize("xs,k,s,p", [((1, 2, 4, 4), 2, None, 0), ((1, 2, 5, 5), 3, 2, 1),
                                      ((2, 1, 5, 6), (2, 3), 1, (1, 1))])
def test_grad_pooling(xs, k, s, p):
    check_grad(lambda x: nd.max_pool2d(x, k, s, p), U(*xs, distinct=True))
    check_grad(lambda x: nd.avg_pool2d(x, k, s, p), U(*xs))
    check_grad(lambda x: nd.avg_pool2d(x, k, s, p, count_include_pad=False), U(*xs))


def test_grad_global_avg_pool():
    check_grad(nd.global_avg_pool2d, U(2, 3, 3, 2))


@pytest.mark.parametrize("xs,axis", [((4, 3), 1), ((3, 2, 2, 3), 1), ((3, 2, 4), -1)])
def test_grad_batch_norm(xs, axis):
    C = xs[axis]

    def train(x, g, b):
        rm, rv = nd.zeros(C, dtype="float64"), nd.ones(C, dtype="float64")
        return nd.batch_norm(x, g, b, rm, rv, eps=1e-3, training=True, axis=axis)

    def infer(x, g, b):
        rm, rv = nd.array(np.linspace(-1, 1, C)), nd.array(np.linspace(0.5, 2, C))
        return nd.batch_norm(x, g, b, rm, rv, eps=1e-3, training=False, axis=axis)

    check_grad(train, U(*xs), U(C, lo=0.5, hi=2), U(C))
    check_grad(infer, U(*xs), U(C, lo=0.5, hi=2), U(C))


def test_grad_layer_norm():
    check_grad(lambda x, g, b: nd.layer_norm(x, g, b, eps=1e-3), U(3, 2, 5), U(5, lo=0.5, hi=2), U(5))


def test_grad_dropout_same_mask_under_same_seed():
    def f(x):
        hl.random.seed(11)
        return nd.dropout(x, 0.4, training=True)
    check_grad(f, U(6, 5))
    x = nd.array(np.ones((6, 5)))
    x.attach_grad()
    with hl.autograd.record():
        y = f(x)
    y.backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), y.asnumpy())     # mask / (1 - p) both


# ============================================================================ autograd semantics


def test_grad_req_add_accumulates():
    x = nd.array(np.array([1.0, 2.0, 3.0]))
    x.attach_grad(grad_req="add")
    for _ in range(2):
        with hl.autograd.record():
            y = x * x
        y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), 2 * 2 * np.array([1.0, 2.0, 3.0]))
    x.attach_grad()                       # write: overwritten
    for _ in range(2):
        with hl.autograd.record():
            y = x * x
        y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [2.0, 4.0, 6.0])
    z = nd.array(np.array([1.0]))
    z.attach_grad(grad_req="null")
    assert z.grad is None
    with pytest.raises(ValueError, match="grad_req"):
        z.attach_grad("sum")


def test_value_used_twice_sums_gradients():
    x = nd.array(np.array([0.5, -1.0]))
    x.attach_grad()
    with hl.autograd.record():
        a = x * 3.0
        y = a * a + a + nd.exp(x)
    y.backward()
    v = np.array([0.5, -1.0])
    np.testing.assert_allclose(x.grad.asnumpy(), 18 * v + 3 + np.exp(v))


def test_retain_graph():
    x = nd.array(np.array([1.0, 2.0]))
    x.attach_grad(grad_req="add")
    with hl.autograd.record():
        y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [4.0, 8.0])
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_second_derivative_create_graph():
    xv = np.array([-1.5, 0.5, 2.0])
    x = nd.array(xv)
    x.attach_grad()
    with hl.autograd.record():
        y = x ** 3
        dy = hl.autograd.grad(y, x, create_graph=True)
    np.testing.assert_allclose(dy.asnumpy(), 3 * xv ** 2)
    dy.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), 6 * xv)
    with hl.autograd.record():
        y = nd.sin(x) * x
        (g1,) = hl.autograd.grad(y, [x], create_graph=True)
        g2 = hl.autograd.grad(g1, x)
    np.testing.assert_allclose(g1.asnumpy(), np.cos(xv) * xv + np.sin(xv))
    np.testing.assert_allclose(g2.asnumpy(), -np.sin(xv) * xv + 2 * np.cos(xv))


def test_modes():
    ag = hl.autograd
    assert not ag.is_recording() and not ag.is_training()
    with ag.record():
        assert ag.is_recording() and ag.is_training()
        with ag.pause():
            assert not ag.is_recording() and not ag.is_training()
        with ag.pause(train_mode=True):
            assert not ag.is_recording() and ag.is_training()
        with ag.predict_mode():
            assert ag.is_recording() and not ag.is_training()
        assert ag.is_recording() and ag.is_training()
    with ag.record(train_mode=False):
        assert ag.is_recording() and not ag.is_training()
        with ag.train_mode():
            assert ag.is_recording() and ag.is_training()
    with ag.train_mode():
        assert not ag.is_recording() and ag.is_training()
    with pytest.raises(KeyError):
        with ag.record():
            raise KeyError
    assert not ag.is_recording() and not ag.is_training()


def test_other_threads_do_not_see_recording():
    seen = []
    with hl.autograd.record():
        t = threading.Thread(target=lambda: seen.append(hl.autograd.is_recording()))
        t.start()
        t.join()
    assert seen == [False]


def test_pause_stops_recording():
    x = nd.array(np.array([1.0, 2.0]))
    x.attach_grad()
    with hl.autograd.record():
        y = x * 2.0
        with hl.autograd.pause():
            z = x * 3.0
        out = y + z
    out.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [2.0, 2.0])
    with hl.autograd.record():
        with hl.autograd.pause():
            z = x * 3.0
    with pytest.raises(ValueError, match="record"):
        z.backward()


def test_backward_is_asynchronous():
    x = nd.array(np.array([1.0, 2.0, 3.0]))
    x.attach_grad()
    with hl.autograd.record():
        y = x * x
    w = nd.zeros(3, dtype="float64")
    gate = threading.Event()

    def slow_write():                     # the head gradient is produced by a blocked op
        assert gate.wait(30)
        w._data = np.array([1.0, 10.0, 100.0])

    hl.engine.push(slow_write, [], [w._var], hl.cpu(0), name="slow_write")
    y.backward(w)                         # must return while the head gradient is pending
    g = x.grad
    assert isinstance(g, hl.NDArray)
    gate.set()
    np.testing.assert_allclose(g.wait_to_read().asnumpy(), [2.0, 40.0, 600.0])
    gl = hl.autograd.grad
    with hl.autograd.record():
        y = nd.exp(x)
    (r,) = gl(y, [x])
    np.testing.assert_allclose(r.asnumpy(), np.exp([1.0, 2.0, 3.0]))


def test_autograd_errors():
    x = nd.array(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="record"):
        (x * 2).backward()
    x.attach_grad()
    with hl.autograd.record():
        y = x * 2
        with pytest.raises(RuntimeError, match="in-place"):
            x += 1
        with pytest.raises(RuntimeError, match="in-place"):
            x[0] = 5.0
    with pytest.raises(ValueError, match="shape"):
        y.backward(nd.ones(3, dtype="float64"))
    y.backward(nd.ones(2, dtype="float64"))
    np.testing.assert_allclose(x.grad.asnumpy(), [2.0, 2.0])


def test_head_is_variable_and_unused_variable():
    x = nd.array(np.array([1.0, 2.0]))
    u = nd.array(np.array([5.0]))
    x.attach_grad()
    u.attach_grad()
    x.backward(nd.array(np.array([3.0, 4.0])))
    np.testing.assert_allclose(x.grad.asnumpy(), [3.0, 4.0])
    with hl.autograd.record():
        y = x * 2.0
    gx, gu = hl.autograd.grad(y, [x, u])
    np.testing.assert_allclose(gx.asnumpy(), [2.0, 2.0])
    np.testing.assert_allclose(gu.asnumpy(), [0.0])


def test_grad_under_naive_engine():
    with hl.engine.set_engine("naive"):
        check_grad(lambda x, y: nd.tanh(x @ y).sum(axis=0), U(3, 2), U(2, 4))


def check_second_order(f, *specs, seed=0, rtol=1e-5, atol=1e-6):
    """d/dx [v . grad_x sum(w * f(x))] via create_graph=True against central differences of the
    first derivative (itself computed by autograd)."""
    rng = np.random.default_rng(seed)
    xs = [s.draw(rng) for s in specs]
    y0 = f(*[nd.array(x) for x in xs])
    w = nd.array(rng.standard_normal(y0.shape))
    vs_np = [rng.standard_normal(x.shape) for x in xs]

    def first(xs_, create_graph):
        vs = [nd.array(x) for x in xs_]
        for v in vs:
            v.attach_grad()
        with hl.autograd.record():
            gs = hl.autograd.grad(f(*vs), vs, head_grads=w, create_graph=create_graph)
            s = None
            for g, v in zip(gs, vs_np):
                t = (g * nd.array(v)).sum()
                s = t if s is None else s + t
        return vs, s

    vs, s = first(xs, True)
    s.backward()
    for i, x in enumerate(xs):
        flat = x.reshape(-1)
        num = np.zeros(flat.size)
        for j in range(flat.size):
            old = flat[j]
            flat[j] = old + H
            lp = first(xs, False)[1].item()
            flat[j] = old - H
            lm = first(xs, False)[1].item()
            flat[j] = old
            num[j] = (lp - lm) / (2 * H)
        np.testing.assert_allclose(vs[i].grad.asnumpy(), num.reshape(x.shape), rtol=rtol,
                                   atol=atol, err_msg=f"second derivative, input {i}")


SECOND = {
    "cube": (lambda x: x ** 3, [U(3)]), "tanh": (nd.tanh, [U(2, 3)]), "sigmoid": (nd.sigmoid, [U(4)]),
    "exp_log": (lambda x: nd.exp(x) + nd.log(x), [U(3, lo=0.5, hi=2)]),
    "sin_cos": (lambda x: nd.sin(x) * nd.cos(x), [U(3)]), "sqrt": (nd.sqrt, [U(3, lo=0.5, hi=2)]),
    "softplus": (nd.softplus, [U(3)]), "reciprocal": (nd.reciprocal, [U(3, away0=True)]),
    "mul_div_bcast": (lambda x, y: x * y / (y * y + 1.0), [U(2, 3), U(3)]),
    "power": (nd.power, [U(2, 2, lo=0.5, hi=2), U(2, 2, lo=-1, hi=2)]),
    "matmul": (lambda x, y: nd.tanh(x @ y), [U(2, 3), U(3, 2)]),
    "log_softmax": (lambda x: nd.log_softmax(x, axis=-1), [U(2, 3)]),
    "softmax": (lambda x: nd.softmax(x, axis=0), [U(3, 2)]),
    "reductions": (lambda x: nd.exp(x).sum(axis=1) * nd.max(x, axis=1) + nd.mean(x * x, axis=0).sum(),
                   [U(2, 3, distinct=True)]),
    "shape_ops": (lambda x: nd.sin(nd.concat(x.T, x[1:], axis=0)).reshape(-1), [U(2, 2)]),
    "fully_connected": (lambda x, w: nd.tanh(nd.fully_connected(x, w)), [U(2, 3), U(2, 3)]),
}


@pytest.mark.parametrize("name", sorted(SECOND))
def test_second_order_finite_differences(name):
    f, specs = SECOND[name]
    check_second_order(f, *specs)


def test_grad_maximum_ties_split_and_size0():
    x = nd.array(np.array([1.0, 2.0]))
    z = nd.array(np.array([1.0, 3.0]))
    x.attach_grad()
    z.attach_grad()
    with hl.autograd.record():
        y = nd.maximum(x, z)
    y.backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [0.5, 0.0])
    np.testing.assert_array_equal(z.grad.asnumpy(), [0.5, 1.0])
    a = nd.array(np.ones((0, 3)))
    b = nd.array(np.array([[1.0, 2.0, 3.0]]))
    a.attach_grad()
    b.attach_grad()
    with hl.autograd.record():
        y = (a * b).sum(axis=0) + b.sum()
    y.backward()
    assert a.grad.shape == (0, 3)
    np.testing.assert_array_equal(b.grad.asnumpy(), [[3.0, 3.0, 3.0]])


def test_fully_connected_fused_relu_equals_relu_of_fc():
    rng = np.random.default_rng(3)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((5, 7), (4, 7), (4,)))
    got = nd.fully_connected(nd.array(x), nd.array(w), nd.array(b), act="relu").asnumpy()
    np.testing.assert_allclose(got, np.maximum(x @ w.T + b, 0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="act"):
        nd.fully_connected(nd.array(x), nd.array(w), act="gelu")


def test_conv2d_fused_relu_equals_relu_of_conv_eager_and_hybridized():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    plain = nd.relu(nd.conv2d(nd.array(x), nd.array(w), nd.array(b), padding=1)).asnumpy()
    fused = nd.conv2d(nd.array(x), nd.array(w), nd.array(b), padding=1, act="relu").asnumpy()
    np.testing.assert_array_equal(fused, plain)
    with pytest.raises(ValueError, match="act"):
        nd.conv2d(nd.array(x), nd.array(w), act="tanh")
    net = hl.nn.Conv2D(4, 3, padding=1, activation="relu", in_channels=3)
    net.initialize()
    net.weight.set_data(w)
    net.bias.set_data(b)
    eager = net(nd.array(x)).asnumpy()
    net.hybridize()
    np.testing.assert_array_equal(net(nd.array(x)).asnumpy(), eager)
    np.testing.assert_array_equal(eager, plain)


def test_second_order_through_gradient_ops_is_right_or_a_clear_error():
    """create_graph=True then backward: relu_grad and take_grad (linear in g) have rules; the
    other gradient ops raise NotImplementedError instead of silently dropping their paths."""
    x = nd.array(np.array([-1.0, 0.5, 2.0]))
    x.attach_grad()
    with autograd.record():
        g = autograd.grad((nd.relu(x) ** 2 + x ** 3).sum(), x, create_graph=True)
        h = g.sum()
    h.backward()
    # d/dx [2 relu(x) + 3x^2] = 2 [x > 0] + 6x
    np.testing.assert_allclose(x.grad.asnumpy(), [-6.0, 5.0, 14.0])
    a = nd.array(np.array([1.0, 2.0, 3.0]))
    a.attach_grad()
    with autograd.record():
        g = autograd.grad((nd.take(a, nd.array(np.array([0, 2, 2]))) ** 2).sum(), a,
                          create_graph=True)
        h = (g * g).sum()
    h.backward()
    np.testing.assert_allclose(a.grad.asnumpy(), [8.0, 0.0, 96.0])     # d/da (4a0^2 + 16a2^2)
    xc = nd.array(np.random.default_rng(0).random((1, 1, 4, 4)))
    w = nd.array(np.random.default_rng(1).random((2, 1, 3, 3)))
    w.attach_grad()
    with pytest.raises(NotImplementedError, match="conv2d_grad_weight"):
        with autograd.record():
            gw = autograd.grad((nd.conv2d(xc, w) ** 2).sum(), w, create_graph=True)
            hw = gw.sum()
        hw.backward()


@pytest.mark.parametrize("xshape,flatten,act,bias,x_grad", [
    ((5, 7), True, "relu", True, True),
    ((3, 2, 2, 2), True, None, False, True),        # flattened 4-D input
    ((2, 3, 7), False, "relu", True, False),        # no gradient for x: gw, gb only
    ((0, 7), True, "relu", True, True),             # empty batch
])
def test_fully_connected_fused_eager_gradient_equals_composed(xshape, flatten, act, bias, x_grad):
    # eager backward runs one fully_connected_grad op; with create_graph the composed,
    # differentiable ops run instead: the same NumPy calls, so the same bits
    rng = np.random.default_rng(3)
    k = int(np.prod(xshape[1:])) if flatten else xshape[-1]
    xv = rng.standard_normal(xshape).astype(np.float32)
    wv = rng.standard_normal((4, k)).astype(np.float32)
    bv = rng.standard_normal(4).astype(np.float32)
    cv = rng.standard_normal(xshape[:1] + (4,) if flatten else xshape[:-1] + (4,)).astype(np.float32)
    res = []
    for create in (False, True):
        x, w, b = hl.nd.array(xv), hl.nd.array(wv), hl.nd.array(bv)
        vs = ([x] if x_grad else []) + [w] + ([b] if bias else [])
        for v in vs:
            v.attach_grad()
        with autograd.record():
            y = hl.nd.fully_connected(x, w, b if bias else None, flatten=flatten, act=act)
            loss = (y * hl.nd.array(cv)).sum()
        res.append([g.asnumpy() for g in autograd.grad(loss, vs, create_graph=create)])
    for a, c in zip(*res):
        np.testing.assert_array_equal(a, c)


def test_second_order_through_a_conv_bias_gradient_with_the_weight_trained():
    # create_graph=True keeps the bias gradient a differentiable sum (the eager backward
    # otherwise takes it from conv2d_grad_weight, which has no second-order rule)
    from hybridl import nd
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, 2, 4, 4))
    w0 = rng.standard_normal((3, 2, 3, 3))
    b0 = rng.standard_normal(3)

    def penalty(xv):                       # s = sum_o (dL/db_o)^2, L = sum(conv(x)^2)
        y = hl.kernels.conv2d(xv, w0, b0, (1, 1), (1, 1))
        return float(np.sum((2 * y.sum(axis=(0, 2, 3))) ** 2))

    x, w, b = nd.array(x0), nd.array(w0), nd.array(b0)
    for a in (x, w, b):
        a.attach_grad()
    with autograd.record():
        y = nd.conv2d(x, w, b, padding=1)
        gb = autograd.grad(nd.sum(y * y), b, create_graph=True)
        s = nd.sum(gb * gb)
    s.backward()
    np.testing.assert_allclose(gb.asnumpy(), 2 * y.asnumpy().sum(axis=(0, 2, 3)), rtol=1e-10)
    eps, gx = 1e-6, x.grad.asnumpy()
    for idx in [(0, 0, 0, 0), (1, 1, 2, 3), (0, 1, 3, 1)]:
        d = np.zeros_like(x0)
        d[idx] = eps
        fd = (penalty(x0 + d) - penalty(x0 - d)) / (2 * eps)
        np.testing.assert_allclose(gx[idx], fd, rtol=1e-5)
