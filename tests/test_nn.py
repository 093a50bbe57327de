"""hl.nn layers vs NumPy references, parameters, initializers, losses, save/load, hl.models."""
import glob
import os
import re

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nd, nn

RNG = np.random.default_rng(1234)


def _arr(a, dtype="float64"):
    return nd.array(np.asarray(a), dtype=dtype)


def _conv_ref(x, w, b, stride=1, pad=0):
    N, C, H, W = x.shape
    O, _, KH, KW = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    OH = (H + 2 * pad - KH) // stride + 1
    OW = (W + 2 * pad - KW) // stride + 1
    y = np.zeros((N, O, OH, OW))
    for i in range(OH):
        for j in range(OW):
            patch = xp[:, :, i * stride:i * stride + KH, j * stride:j * stride + KW]
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    if b is not None:
        y += b[None, :, None, None]
    return y


def _pool_ref(x, k, s, pad, mode):
    N, C, H, W = x.shape
    fill = -np.inf if mode == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    OH = (H + 2 * pad - k) // s + 1
    OW = (W + 2 * pad - k) // s + 1
    y = np.zeros((N, C, OH, OW))
    for i in range(OH):
        for j in range(OW):
            win = xp[:, :, i * s:i * s + k, j * s:j * s + k]
            y[:, :, i, j] = win.max(axis=(2, 3)) if mode == "max" else win.mean(axis=(2, 3))
    return y


# ============================================================================ layers


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("act", [None, "relu", "tanh", "sigmoid"])
def test_dense_matches_numpy(flatten, act):
    x = RNG.standard_normal((4, 3, 5))
    layer = nn.Dense(6, activation=act, flatten=flatten, dtype="float64")
    layer.initialize()
    y = layer(_arr(x)).asnumpy()
    w = layer.weight.data().asnumpy()
    b = layer.bias.data().asnumpy()
    if flatten:
        assert w.shape == (6, 15)
        ref = x.reshape(4, -1) @ w.T + b
    else:
        assert w.shape == (6, 5)
        ref = x @ w.T + b
    ref = {None: lambda v: v, "relu": lambda v: np.maximum(v, 0), "tanh": np.tanh,
           "sigmoid": lambda v: 1 / (1 + np.exp(-v))}[act](ref)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)


def test_dense_no_bias_and_bad_args():
    layer = nn.Dense(3, use_bias=False, in_units=4, dtype="float64")
    assert layer.bias is None
    layer.initialize()
    assert layer.weight.shape == (3, 4)
    x = RNG.standard_normal((2, 4))
    np.testing.assert_allclose(layer(_arr(x)).asnumpy(), x @ layer.weight.data().asnumpy().T,
                               rtol=1e-12)
    with pytest.raises(ValueError, match="units"):
        nn.Dense(0)
    with pytest.raises(ValueError, match="activation"):
        nn.Dense(3, activation="swishy")


@pytest.mark.parametrize("stride,pad", [(1, 0), (2, 1)])
def test_conv2d_matches_numpy(stride, pad):
    x = RNG.standard_normal((2, 3, 7, 6))
    layer = nn.Conv2D(4, 3, strides=stride, padding=pad, dtype="float64",
                      bias_initializer=hl.init.Normal(1.0))
    layer.initialize()
    y = layer(_arr(x)).asnumpy()
    w, b = layer.weight.data().asnumpy(), layer.bias.data().asnumpy()
    assert w.shape == (4, 3, 3, 3)
    assert np.abs(b).sum() > 0
    ref = _conv_ref(x, w, b, stride, pad)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)


def test_conv2d_activation_relu():
    x = RNG.standard_normal((1, 2, 5, 5))
    layer = nn.Conv2D(3, 2, activation="relu", dtype="float64", use_bias=False)
    layer.initialize()
    y = layer(_arr(x)).asnumpy()
    ref = np.maximum(_conv_ref(x, layer.weight.data().asnumpy(), None), 0)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    assert (y == 0).any() and (y > 0).any()


@pytest.mark.parametrize("k,s,pad", [(2, None, 0), (3, 2, 1), (3, 1, 0)])
def test_max_pool_matches_numpy(k, s, pad):
    x = RNG.standard_normal((2, 3, 7, 7))
    y = nn.MaxPool2D(k, s, pad)(_arr(x)).asnumpy()
    ref = _pool_ref(x, k, s or k, pad, "max")
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12)


@pytest.mark.parametrize("k,s", [(2, None), (3, 2)])
def test_avg_pool_matches_numpy(k, s):
    x = RNG.standard_normal((2, 3, 7, 7))
    y = nn.AvgPool2D(k, s)(_arr(x)).asnumpy()
    ref = _pool_ref(x, k, s or k, 0, "avg")
    np.testing.assert_allclose(y, ref, rtol=1e-12)


def test_avg_pool_padding_count_include_pad():
    x = RNG.standard_normal((1, 2, 4, 4))
    y = nn.AvgPool2D(3, 1, 1, count_include_pad=True)(_arr(x)).asnumpy()
    np.testing.assert_allclose(y, _pool_ref(x, 3, 1, 1, "avg"), rtol=1e-12)
    # corner window of count_include_pad=False averages only the 4 real values
    y2 = nn.AvgPool2D(3, 1, 1, count_include_pad=False)(_arr(x)).asnumpy()
    np.testing.assert_allclose(y2[:, :, 0, 0], x[:, :, :2, :2].mean(axis=(2, 3)), rtol=1e-12)


def test_global_avg_pool_flatten_activation():
    x = RNG.standard_normal((2, 3, 4, 5))
    y = nn.GlobalAvgPool2D()(_arr(x)).asnumpy()
    assert y.shape == (2, 3, 1, 1)
    np.testing.assert_allclose(y[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-12)
    f = nn.Flatten()(_arr(x)).asnumpy()
    np.testing.assert_array_equal(f, x.reshape(2, -1))
    for name, fn in (("relu", lambda v: np.maximum(v, 0)), ("sigmoid", lambda v: 1 / (1 + np.exp(-v))),
                     ("tanh", np.tanh), ("softrelu", lambda v: np.log1p(np.exp(v)))):
        np.testing.assert_allclose(nn.Activation(name)(_arr(x)).asnumpy(), fn(x), rtol=1e-10,
                                   atol=1e-12)
    with pytest.raises(ValueError, match="activation"):
        nn.Activation("nope")


def test_batchnorm_train_predict_and_running_stats():
    x = RNG.standard_normal((8, 3, 4, 4)) * 2 + 5
    bn = nn.BatchNorm(momentum=0.8, epsilon=1e-5, dtype="float64")
    bn.initialize()
    bn.gamma.set_data(np.array([1.0, 2.0, 0.5]))
    bn.beta.set_data(np.array([0.0, -1.0, 3.0]))
    g = np.array([1.0, 2.0, 0.5])[None, :, None, None]
    b = np.array([0.0, -1.0, 3.0])[None, :, None, None]
    with autograd.record():
        y = bn(_arr(x))
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    ref = g * (x - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5) + b
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-10, atol=1e-10)
    n = x.size // 3
    rm = 0.8 * 0 + 0.2 * mean
    rv = 0.8 * 1 + 0.2 * var * n / (n - 1)
    np.testing.assert_allclose(bn.running_mean.data().asnumpy(), rm, rtol=1e-10)
    np.testing.assert_allclose(bn.running_var.data().asnumpy(), rv, rtol=1e-10)
    # second training step: the rule compounds
    x2 = RNG.standard_normal((8, 3, 4, 4))
    with autograd.train_mode():
        bn(_arr(x2)).wait_to_read()
    rm = 0.8 * rm + 0.2 * x2.mean(axis=(0, 2, 3))
    rv = 0.8 * rv + 0.2 * x2.var(axis=(0, 2, 3)) * n / (n - 1)
    np.testing.assert_allclose(bn.running_mean.data().asnumpy(), rm, rtol=1e-10)
    np.testing.assert_allclose(bn.running_var.data().asnumpy(), rv, rtol=1e-10)
    # predict mode uses the running statistics and leaves them alone
    yp = bn(_arr(x)).asnumpy()
    refp = g * (x - rm[None, :, None, None]) / np.sqrt(rv[None, :, None, None] + 1e-5) + b
    np.testing.assert_allclose(yp, refp, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(bn.running_mean.data().asnumpy(), rm, rtol=1e-10)
    # statistics are not trained
    assert bn.running_mean.grad_req == "null" and bn.running_var.grad_req == "null"


def test_batchnorm_dense_input_axis1():
    x = RNG.standard_normal((16, 5))
    bn = nn.BatchNorm(dtype="float64")
    bn.initialize()
    with autograd.train_mode():
        y = bn(_arr(x)).asnumpy()
    np.testing.assert_allclose(y, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-9, atol=1e-10)
    assert bn.gamma.shape == (5,)


def test_dropout_train_vs_predict():
    hl.random.seed(3)
    x = np.ones((200, 100))
    d = nn.Dropout(0.3)
    np.testing.assert_array_equal(d(_arr(x)).asnumpy(), x)          # predict: identity
    with autograd.train_mode():
        y = d(_arr(x)).asnumpy()
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-12)
    assert abs(kept.mean() - 0.7) < 0.01
    with autograd.record():
        xa = _arr(x)
        xa.attach_grad()
        z = d(xa)
    z.backward()
    zz = z.asnumpy()
    np.testing.assert_allclose(xa.grad.asnumpy(), np.where(zz != 0, 1 / 0.7, 0.0), rtol=1e-12)
    with pytest.raises(ValueError, match="rate"):
        nn.Dropout(1.0)


def test_embedding_and_layernorm():
    emb = nn.Embedding(10, 4, dtype="float64")
    emb.initialize()
    idx = np.array([[1, 2, 9], [0, 0, 3]])
    y = emb(nd.array(idx, dtype="int64")).asnumpy()
    W = emb.weight.data().asnumpy()
    assert y.shape == (2, 3, 4)
    np.testing.assert_array_equal(y, W[idx])
    # default Embedding init is Uniform(0.07)
    assert np.abs(W).max() <= 0.07

    x = RNG.standard_normal((3, 4, 6)) * 3 + 1
    ln = nn.LayerNorm(dtype="float64")
    ln.initialize()
    g, b = RNG.standard_normal(6), RNG.standard_normal(6)
    ln(_arr(x))
    ln.gamma.set_data(g)
    ln.beta.set_data(b)
    out = ln(_arr(x)).asnumpy()
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-10)


def test_dense_gradient_matches_numpy():
    x = RNG.standard_normal((5, 4))
    layer = nn.Dense(3, dtype="float64")
    layer.initialize()
    layer(_arr(x))
    gy = RNG.standard_normal((5, 3))
    with autograd.record():
        y = layer(_arr(x))
    y.backward(_arr(gy))
    np.testing.assert_allclose(layer.weight.grad().asnumpy(), gy.T @ x, rtol=1e-10)
    np.testing.assert_allclose(layer.bias.grad().asnumpy(), gy.sum(0), rtol=1e-10)


# ============================================================================ parameters / blocks


def test_deferred_shape_inference():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(5, 3), nn.Flatten(), nn.Dense(7), nn.BatchNorm(), nn.Dense(2))
    net.initialize()
    params = net.collect_params()
    assert params["0.weight"].shape == (5, 0, 3, 3)
    with pytest.raises(nn.DeferredInitializationError):
        params["0.weight"].data()
    y = net(nd.ones((2, 4, 6, 6)))
    assert y.shape == (2, 2)
    assert params["0.weight"].shape == (5, 4, 3, 3)
    assert params["2.weight"].shape == (7, 5 * 4 * 4)
    assert params["3.gamma"].shape == (7,)
    assert params["4.weight"].shape == (2, 7)
    for p in params.values():
        assert p.data().shape == p.shape


def test_uninitialized_parameter_error():
    layer = nn.Dense(3, in_units=2)
    with pytest.raises(RuntimeError, match="initialize"):
        layer.weight.data()


def test_collect_params_regex_and_names():
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3), nn.BatchNorm(in_channels=4), nn.Dense(2, in_units=4))
    names = list(net.collect_params())
    assert names == ["0.weight", "0.bias", "1.gamma", "1.beta", "1.running_mean",
                     "1.running_var", "2.weight", "2.bias"]
    assert list(net.collect_params(".*weight")) == ["0.weight", "2.weight"]
    assert list(net.collect_params("1\\..*")) == ["1.gamma", "1.beta", "1.running_mean",
                                                   "1.running_var"]
    assert list(net.collect_params(".*running_(mean|var)")) == ["1.running_mean", "1.running_var"]
    with pytest.warns(UserWarning, match="matched none"):
        assert len(net.collect_params("nothing")) == 0


def test_initialize_force_reinit():
    hl.random.seed(0)
    layer = nn.Dense(8, in_units=8, dtype="float64")
    layer.initialize()
    w0 = layer.weight.data().asnumpy().copy()
    with pytest.warns(RuntimeWarning, match="force_reinit=True"):
        layer.initialize(hl.init.Constant(2.0))        # already initialized: no-op
    np.testing.assert_array_equal(layer.weight.data().asnumpy(), w0)
    layer.initialize(hl.init.Constant(2.0), force_reinit=True)
    np.testing.assert_array_equal(layer.weight.data().asnumpy(), np.full((8, 8), 2.0))
    # the bias keeps its own initializer ('zeros') over the one given to initialize
    np.testing.assert_array_equal(layer.bias.data().asnumpy(), np.zeros(8))


def test_parameter_set_data_zero_grad_and_grad_req():
    p = nn.Parameter("w", (2, 3), dtype="float64")
    p.initialize(hl.init.One())
    np.testing.assert_array_equal(p.data().asnumpy(), np.ones((2, 3)))
    with pytest.raises(ValueError, match="shape"):
        p.set_data(np.zeros((3, 2)))
    p.set_data(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(p.data().asnumpy(), np.arange(6.0).reshape(2, 3))
    with autograd.record():
        loss = (p.data() * p.data()).sum()
    loss.backward()
    np.testing.assert_allclose(p.grad().asnumpy(), 2 * np.arange(6.0).reshape(2, 3))
    p.zero_grad()
    np.testing.assert_array_equal(p.grad().asnumpy(), np.zeros((2, 3)))
    p.grad_req = "null"
    with pytest.raises(RuntimeError, match="null"):
        p.grad()
    with pytest.raises(ValueError, match="grad_req"):
        nn.Parameter("x", (1,), grad_req="sometimes")
    q = nn.Parameter("q", (2,), lr_mult=0.5, wd_mult=0.0)
    assert q.lr_mult == 0.5 and q.wd_mult == 0.0


# ============================================================================ initializers


def _init_values(init, shape, dtype="float64"):
    return init(shape, np.dtype(dtype), hl.cpu(0)).asnumpy()


def test_xavier_uniform_statistics():
    hl.random.seed(11)
    shape = (300, 200, 3, 3)
    fan_in, fan_out = 200 * 9, 300 * 9
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    v = _init_values(hl.init.Xavier(), shape)
    assert v.shape == shape
    assert v.min() >= -bound and v.max() <= bound
    assert v.min() < -0.99 * bound and v.max() > 0.99 * bound
    assert abs(v.mean()) < 0.01 * bound
    np.testing.assert_allclose(v.std(), bound / np.sqrt(3), rtol=0.01)


def test_xavier_gaussian_and_factor_types():
    hl.random.seed(11)
    shape = (400, 500)
    v = _init_values(hl.init.Xavier("gaussian", "in", 2.0), shape)
    np.testing.assert_allclose(v.std(), np.sqrt(2.0 / 500), rtol=0.01)
    assert abs(v.mean()) < 0.01 * v.std()
    v = _init_values(hl.init.Xavier("uniform", "out", 3.0), shape)
    bound = np.sqrt(3.0 / 400)
    assert v.max() <= bound and v.max() > 0.99 * bound
    with pytest.raises(ValueError, match="rnd_type"):
        hl.init.Xavier("cauchy")


def test_normal_uniform_constant_statistics():
    hl.random.seed(11)
    shape = (500, 400)
    v = _init_values(hl.init.Normal(0.5), shape)
    np.testing.assert_allclose(v.std(), 0.5, rtol=0.01)
    assert abs(v.mean()) < 0.005
    # fraction within one sigma of a Gaussian: 0.6827
    assert abs(np.mean(np.abs(v) < 0.5) - 0.6827) < 0.005
    v = _init_values(hl.init.Uniform(0.2), shape)
    assert v.min() >= -0.2 and v.max() <= 0.2 and v.max() > 0.199 and v.min() < -0.199
    np.testing.assert_allclose(v.std(), 0.2 / np.sqrt(3), rtol=0.01)
    assert abs(v.mean()) < 0.002
    v = _init_values(hl.init.Uniform(), (1000,))
    assert np.abs(v).max() <= 0.07
    np.testing.assert_array_equal(_init_values(hl.init.Zero(), (3, 4)), np.zeros((3, 4)))
    np.testing.assert_array_equal(_init_values(hl.init.One(), (3, 4)), np.ones((3, 4)))
    np.testing.assert_array_equal(_init_values(hl.init.Constant(-1.5), (2,)), [-1.5, -1.5])
    v32 = _init_values(hl.init.Normal(1.0), (10,), "float32")
    assert v32.dtype == np.float32
    assert isinstance(hl.init.create("xavier"), hl.init.Xavier)
    with pytest.raises(ValueError, match="init"):
        hl.init.create("bogus")


def test_initialization_reproducible_under_seed():
    def build():
        net = nn.HybridSequential()
        net.add(nn.Dense(16, in_units=10), nn.Dense(4, in_units=16))
        net.initialize()
        return [p.data().asnumpy() for p in net.collect_params().values()]

    hl.random.seed(42)
    a = build()
    hl.random.seed(42)
    b = build()
    hl.random.seed(43)
    c = build()
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])


# ============================================================================ losses


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_softmax_cross_entropy_value_and_gradient():
    z = RNG.standard_normal((6, 5)) * 3
    lab = np.array([0, 4, 2, 2, 1, 3])
    p = _softmax(z)
    ref = -np.log(p[np.arange(6), lab])
    zz = _arr(z)
    zz.attach_grad()
    with autograd.record():
        loss = hl.loss.SoftmaxCrossEntropyLoss()(zz, nd.array(lab, dtype="int64"))
    np.testing.assert_allclose(loss.asnumpy(), ref, rtol=1e-10)
    loss.backward()
    np.testing.assert_allclose(zz.grad.asnumpy(), p - np.eye(5)[lab], rtol=1e-9, atol=1e-12)
    # float labels holding integers, and dense (non-sparse) labels
    l2 = hl.loss.SoftmaxCrossEntropyLoss()(_arr(z), _arr(lab.astype(float))).asnumpy()
    np.testing.assert_allclose(l2, ref, rtol=1e-10)
    soft = _softmax(RNG.standard_normal((6, 5)))
    l3 = hl.loss.SoftmaxCrossEntropyLoss(sparse_label=False)(_arr(z), _arr(soft)).asnumpy()
    np.testing.assert_allclose(l3, -(soft * np.log(p)).sum(-1), rtol=1e-10)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("bad", [1.5, np.nan, np.inf, -0.25])
def test_softmax_cross_entropy_float_labels_must_be_whole_numbers(bad, hybridize):
    """A float label that is not a class index (a fraction, NaN, inf) raises, naming the value
    and its position, instead of being truncated to some class (1.5 -> 1, NaN -> an int64
    garbage index)."""
    class Net(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.loss = hl.loss.SoftmaxCrossEntropyLoss()

        def forward(self, z, y):
            return self.loss(z, y)
    net = Net()
    if hybridize:
        net.hybridize()
    z = _arr(RNG.standard_normal((4, 3)))
    lab = np.array([0.0, 2.0, bad, 1.0])
    msg = r"class indices \(whole numbers within int64\), got .* at position \(2,\)"
    with pytest.raises(hl.OpError, match=msg) as e:
        net(z, _arr(lab)).asnumpy()
    assert str(float(bad)) in str(e.value)
    with pytest.raises(hl.OpError, match="whole numbers"):    # and once at the next waitall
        hl.waitall()
    lab[2] = 2.0                          # whole numbers, the last one 2.0: fine again
    zv = z.asnumpy()
    ref = -np.log(_softmax(zv)[np.arange(4), lab.astype(int)])
    np.testing.assert_allclose(net(z, _arr(lab)).asnumpy(), ref, rtol=1e-10)


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_softmax_cross_entropy_from_logits_checks_labels(dtype):
    """from_logits=True: -pred[n, label[n]]; a label outside [0, K) raises (one_hot alone
    would give an all-zero row, a loss of 0) and a label shape that is not pred's batch shape
    is refused at the call (it broadcast)."""
    loss = hl.loss.SoftmaxCrossEntropyLoss(from_logits=True)
    lp = np.log(_softmax(RNG.standard_normal((4, 3))))
    lab = np.array([0, 2, 1, 2])
    np.testing.assert_allclose(loss(_arr(lp), nd.array(lab, dtype=dtype)).asnumpy(),
                               -lp[np.arange(4), lab], rtol=1e-12)
    for bad in (3, -1):
        lab_bad = lab.copy()
        lab_bad[1] = bad
        got = re.escape(str(float(bad) if dtype == "float32" else bad))
        with pytest.raises(hl.OpError, match=rf"in \[0, 3\), got {got} at position \(1,\)"):
            loss(_arr(lp), nd.array(lab_bad, dtype=dtype)).asnumpy()
        with pytest.raises(hl.OpError):
            hl.waitall()
    with pytest.raises(ValueError, match=r"label must have shape \(4,\).* got \(\)"):
        loss(_arr(lp), nd.array(np.array(1), dtype=dtype))
    with pytest.raises(ValueError, match=r"label must have shape \(4,\).* got \(3,\)"):
        loss(_arr(lp), nd.array(lab[:3], dtype=dtype))


def test_l2_l1_losses():
    a = RNG.standard_normal((4, 3, 2))
    b = RNG.standard_normal((4, 3, 2))
    l2 = hl.loss.L2Loss()(_arr(a), _arr(b)).asnumpy()
    np.testing.assert_allclose(l2, (0.5 * (a - b) ** 2).mean(axis=(1, 2)), rtol=1e-12)
    l1 = hl.loss.L1Loss()(_arr(a), _arr(b)).asnumpy()
    np.testing.assert_allclose(l1, np.abs(a - b).mean(axis=(1, 2)), rtol=1e-12)
    lw = hl.loss.L2Loss(weight=2.0)(_arr(a), _arr(b)).asnumpy()
    np.testing.assert_allclose(lw, ((a - b) ** 2).mean(axis=(1, 2)), rtol=1e-12)
    # gradient of L2: (pred - label) / (elements per sample)
    pa = _arr(a)
    pa.attach_grad()
    with autograd.record():
        loss = hl.loss.L2Loss()(pa, _arr(b))
    loss.backward()
    np.testing.assert_allclose(pa.grad.asnumpy(), (a - b) / 6, rtol=1e-12)
    with pytest.raises(ValueError, match="shape"):
        hl.loss.L1Loss()(_arr(a), _arr(b[:, :2]))


def test_sigmoid_bce_loss_value_and_gradient():
    x = RNG.standard_normal((5, 4)) * 4
    z = (RNG.random((5, 4)) > 0.5).astype(float)
    s = 1 / (1 + np.exp(-x))
    ref = (-(z * np.log(s) + (1 - z) * np.log(1 - s))).mean(-1)
    xa = _arr(x)
    xa.attach_grad()
    with autograd.record():
        loss = hl.loss.SigmoidBinaryCrossEntropyLoss()(xa, _arr(z))
    np.testing.assert_allclose(loss.asnumpy(), ref, rtol=1e-9)
    loss.backward()
    np.testing.assert_allclose(xa.grad.asnumpy(), (s - z) / 4, rtol=1e-9, atol=1e-12)
    lf = hl.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=True)(_arr(s), _arr(z)).asnumpy()
    np.testing.assert_allclose(lf, ref, rtol=1e-6)
    # stable for large logits
    big = hl.loss.SigmoidBinaryCrossEntropyLoss()(_arr([[800.0, -800.0]]), _arr([[0.0, 1.0]]))
    np.testing.assert_allclose(big.asnumpy(), [800.0], rtol=1e-12)


# ============================================================================ save / load


def _small_net():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1, activation="relu"), nn.BatchNorm(), nn.MaxPool2D(2),
            nn.Flatten(), nn.Dense(5))
    return net


def test_save_load_round_trip_predictions(tmp_path):
    hl.random.seed(1)
    x = nd.array(RNG.standard_normal((3, 2, 6, 6)), dtype="float32")
    net = _small_net()
    net.initialize()
    with autograd.train_mode():       # move BatchNorm's running stats away from 0/1
        net(x).wait_to_read()
    y = net(x).asnumpy()
    path = tmp_path / "net.safetensors"
    net.save_parameters(str(path))
    assert os.listdir(tmp_path) == ["net.safetensors"]
    hl.random.seed(99)
    fresh = _small_net()
    fresh.initialize()
    assert not np.allclose(fresh(x).asnumpy(), y)
    fresh.load_parameters(str(path))
    np.testing.assert_array_equal(fresh(x).asnumpy(), y)
    # a never-run (deferred) model loads too: shapes come from the file
    other = _small_net()
    other.initialize()
    other.load_parameters(str(path))
    np.testing.assert_array_equal(other(x).asnumpy(), y)
    # hybridized model gives the same predictions
    other.hybridize()
    np.testing.assert_allclose(other(x).asnumpy(), y, rtol=1e-6, atol=1e-6)
    # loading into a model already hybridized and run: the cached program sees the new values
    hyb = _small_net()
    hyb.initialize()
    hyb.hybridize()
    assert not np.allclose(hyb(x).asnumpy(), y)
    hyb.load_parameters(str(path))
    np.testing.assert_allclose(hyb(x).asnumpy(), y, rtol=1e-6, atol=1e-6)


def test_parameters_on_two_devices_save_load(tmp_path):
    layer = nn.Dense(3, in_units=4)
    layer.initialize(device=[hl.cpu(0), hl.cpu(1)])
    a, b = layer.weight.list_data()
    assert (a.device, b.device) == (hl.cpu(0), hl.cpu(1))
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    w = RNG.standard_normal((3, 4)).astype("float32")
    layer.weight.set_data(w)
    for c in layer.weight.list_data():
        np.testing.assert_array_equal(c.asnumpy(), w)
    y = layer(nd.ones((2, 4), device=hl.cpu(1)))
    assert y.device == hl.cpu(1)
    np.testing.assert_allclose(y.asnumpy()[0], w.sum(1), rtol=1e-6)
    path = str(tmp_path / "d.safetensors")
    layer.save_parameters(path)
    fresh = nn.Dense(3)
    fresh.initialize(device=[hl.cpu(0), hl.cpu(1)])
    fresh.load_parameters(path)
    assert fresh.weight.list_device() == [hl.cpu(0), hl.cpu(1)]
    for c in fresh.weight.list_data():
        np.testing.assert_array_equal(c.asnumpy(), w)


def _mlp(units=(4, 3), in_units=5):
    net = nn.HybridSequential()
    prev = in_units
    for u in units:
        net.add(nn.Dense(u, in_units=prev))
        prev = u
    net.initialize()
    return net


def test_load_missing_extra_and_misshaped_names(tmp_path):
    path = str(tmp_path / "p.safetensors")
    _mlp((4, 3)).save_parameters(path)
    bigger = _mlp((4, 3, 2))
    with pytest.raises(ValueError, match=r"2\.weight.*2\.bias|2\.bias.*2\.weight") as e:
        bigger.load_parameters(path)
    assert "allow_missing" in str(e.value)
    w_before = bigger.collect_params()["2.weight"].data().asnumpy().copy()
    bigger.load_parameters(path, allow_missing=True)
    np.testing.assert_array_equal(bigger.collect_params()["2.weight"].data().asnumpy(), w_before)
    ref = _mlp((4, 3))
    ref.load_parameters(path)
    np.testing.assert_array_equal(bigger.collect_params()["1.weight"].data().asnumpy(),
                                  ref.collect_params()["1.weight"].data().asnumpy())

    smaller = _mlp((4,))
    with pytest.raises(ValueError, match=r"1\.weight") as e:
        smaller.load_parameters(path)
    assert "ignore_extra" in str(e.value)
    smaller.load_parameters(path, ignore_extra=True)
    np.testing.assert_array_equal(smaller.collect_params()["0.weight"].data().asnumpy(),
                                  ref.collect_params()["0.weight"].data().asnumpy())

    wrong = _mlp((4, 6))
    with pytest.raises(ValueError, match=r"1\.weight.*\(6, 4\).*\(3, 4\)"):
        wrong.load_parameters(path)

    # a deferred (never run) layer checks the dimensions it already knows
    conv = nn.Conv2D(4, 3, in_channels=2, use_bias=False)
    conv.initialize()
    cpath = str(tmp_path / "c.safetensors")
    conv.save_parameters(cpath)
    other = nn.Conv2D(8, 3, use_bias=False)
    other.initialize()
    with pytest.raises(ValueError, match=r"weight.*\(8, 0, 3, 3\).*\(4, 2, 3, 3\)"):
        other.load_parameters(cpath)
    same = nn.Conv2D(4, 3, use_bias=False)
    same.initialize()
    same.load_parameters(cpath)
    assert same.weight.shape == (4, 2, 3, 3)
    np.testing.assert_array_equal(same.weight.data().asnumpy(), conv.weight.data().asnumpy())


def test_load_corrupt_files(tmp_path):
    net = _mlp()
    path = tmp_path / "good.safetensors"
    net.save_parameters(str(path))
    raw = path.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(raw[: len(raw) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    huge_header = tmp_path / "hh.safetensors"
    huge_header.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    for p in (trunc, garbage, empty, huge_header):
        with pytest.raises(ValueError, match="not a valid safetensors"):
            _mlp().load_parameters(str(p))
    with pytest.raises(FileNotFoundError, match="no such file"):
        net.load_parameters(str(tmp_path / "missing.safetensors"))


def test_failed_save_leaves_nothing(tmp_path):
    net = nn.HybridSequential()
    net.add(nn.Dense(3), nn.Dense(2))
    path = tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError):
        net.save_parameters(str(path))               # never initialized
    net.initialize()
    with pytest.raises(RuntimeError):                 # deferred: shapes unknown yet
        net.save_parameters(str(path))
    assert os.listdir(tmp_path) == []
    # a failure while writing removes the temporary file and keeps an older file intact
    good = _mlp()
    good.save_parameters(str(path))
    before = path.read_bytes()
    import hybridl.nn.block as block_mod

    def failing_write(path_, write):
        def boom(tmp):
            write(tmp)
            raise OSError("disk full")
        return orig(path_, boom)

    orig = block_mod._atomic_write
    block_mod._atomic_write = failing_write
    try:
        with pytest.raises(OSError, match="disk full"):
            good.save_parameters(str(path))
    finally:
        block_mod._atomic_write = orig
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]
    assert path.read_bytes() == before
    with pytest.raises(FileNotFoundError):
        good.save_parameters(str(tmp_path / "no_dir" / "x.safetensors"))
    assert not glob.glob(str(tmp_path / ".*tmp*"))


# ============================================================================ models


def test_model_output_shapes():
    m = hl.models
    with autograd.predict_mode():
        net = m.mlp((32, 16), 7)
        net.initialize()
        assert net(nd.ones((3, 1, 8, 8))).shape == (3, 7)
        net = m.lenet(10, input_size=28)
        net.initialize()
        assert net(nd.ones((2, 1, 28, 28))).shape == (2, 10)
        assert net.collect_params()["5.weight"].shape == (120, 16 * 5 * 5)
        net = m.lenet(10, input_size=8)
        net.initialize()
        assert net(nd.ones((2, 1, 8, 8))).shape == (2, 10)
        net = m.lenet(10, input_size=4)         # the smallest size two poolings take
        net.initialize()
        assert net(nd.ones((2, 1, 4, 4))).shape == (2, 10)
        for bad in (3, 0, 8.0):                 # (3 built, then failed at the first call)
            with pytest.raises(ValueError, match="lenet: input_size: expected an int >= 4"):
                m.lenet(10, input_size=bad)
        net = m.resnet18(4, width=4)
        net.initialize()
        assert net(nd.ones((2, 3, 8, 8))).shape == (2, 4)
        assert sum(1 for k in net.collect_params() if k.endswith("gamma")) == 1 + 16 + 3
        net = m.inception_net(5, width=4)
        net.initialize()
        assert net(nd.ones((2, 1, 8, 8))).shape == (2, 5)
    assert isinstance(m.get_model("lenet"), nn.HybridBlock)
    with pytest.raises(ValueError, match="model"):
        m.get_model("nope")


def test_load_parameters_names_missing_and_extra_at_once(tmp_path):
    """A file of another model usually both lacks and adds names: both are reported in one
    error (following the first hint alone only led to the second error)."""
    from safetensors.numpy import save_file
    net = _mlp((4, 3))
    path = str(tmp_path / "other.safetensors")
    vals = {k: p.data().asnumpy() for k, p in net.collect_params().items() if k != "1.bias"}
    vals["head.bias"] = np.zeros(3, np.float32)
    save_file(vals, path)
    with pytest.raises(ValueError) as e:
        net.load_parameters(path)
    msg = str(e.value)
    assert "lacks parameters ['1.bias']" in msg and "allow_missing=True" in msg
    assert "has parameters ['head.bias']" in msg and "ignore_extra=True" in msg
    net.load_parameters(path, allow_missing=True, ignore_extra=True)


def test_gluon1_hybrid_forward_gets_a_message_that_says_what_to_do():
    class Net(nn.HybridBlock):
        def hybrid_forward(self, F, x):
            return x
    with pytest.raises(NotImplementedError, match="rename it to forward and drop the F"):
        Net()(hl.nd.ones((1, 2)))


def test_initialize_twice_warns_and_keeps_values():
    net = _mlp((4, 3))
    w = net.collect_params()["0.weight"].data().asnumpy().copy()
    with pytest.warns(RuntimeWarning, match="already initialized were left as they are"):
        net.initialize(hl.init.Constant(5.0))
    np.testing.assert_array_equal(net.collect_params()["0.weight"].data().asnumpy(), w)
    net.initialize(hl.init.Constant(5.0), force_reinit=True)
    assert (net.collect_params()["0.weight"].data().asnumpy() == 5.0).all()


def test_initialize_warning_points_at_the_callers_line_for_every_entry_point():
    import warnings
    net = _mlp((4,))
    for call in (lambda: net.initialize(), lambda: net.collect_params().initialize(),
                 lambda: net.collect_params()["0.weight"].initialize()):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            call()
        assert len(w) == 1 and w[0].category is RuntimeWarning
        assert w[0].filename == __file__, w[0].filename


def test_load_parameters_reports_shapes_with_missing_names(tmp_path):
    """Missing names and shape mismatches in one error (they came one at a time)."""
    from safetensors.numpy import save_file
    net = _mlp((4, 3))
    path = str(tmp_path / "p.safetensors")
    save_file({"0.weight": np.zeros((5, 5), np.float32), "0.bias": np.zeros(4, np.float32)}, path)
    with pytest.raises(ValueError) as e:
        net.load_parameters(path)
    msg = str(e.value)
    assert "it lacks parameters ['1.weight', '1.bias']" in msg
    assert "parameter '0.weight' has shape (4, 5) in the network but (5, 5) in the file" in msg


@pytest.mark.parametrize("name, block, ref", [
    ("silu", lambda: nn.Activation("silu"), lambda x: x / (1 + np.exp(-x))),
    ("swish", lambda: nn.Activation("swish"), lambda x: x / (1 + np.exp(-x))),
    ("softsign", lambda: nn.Activation("softsign"), lambda x: x / (1 + np.abs(x))),
    ("leaky", lambda: nn.LeakyReLU(0.1), lambda x: np.where(x > 0, x, 0.1 * x)),
    ("elu", lambda: nn.ELU(0.7), lambda x: np.where(x > 0, x, 0.7 * np.expm1(np.minimum(x, 0)))),
])
def test_more_activations_values_gradients_and_hybridized(name, block, ref):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5)) * 3
    x[0, :3] = [0.0, 200.0, -200.0]         # the kink and large values (no inf, no NaN)
    b = block()
    b.initialize()
    np.testing.assert_allclose(b(hl.nd.array(x)).asnumpy(), ref(x), rtol=1e-12, atol=1e-12)
    # float64 finite differences of sum(f(x) * w) (away from the kink at 0)
    w = rng.standard_normal(x.shape)
    xx = hl.nd.array(x)
    xx.attach_grad()
    with autograd.record():
        y = (b(xx) * hl.nd.array(w)).sum()
    y.backward()
    g = xx.grad.asnumpy()
    eps = 1e-6
    num = (ref(x + eps) - ref(x - eps)) / (2 * eps) * w
    away = np.abs(x) > 1e-3
    np.testing.assert_allclose(g[away], num[away], rtol=1e-5, atol=1e-8)
    assert np.all(np.isfinite(g))
    if name == "leaky":
        assert g[0, 0] == pytest.approx(0.1 * w[0, 0])     # PyTorch's gradient at 0
    if name == "elu":
        assert g[0, 0] == pytest.approx(0.7 * w[0, 0])     # alpha, PyTorch's (not alpha / 2)
    x32 = hl.nd.array(x.astype(np.float32))
    eager = b(x32).asnumpy()
    b.hybridize()
    np.testing.assert_array_equal(b(x32).asnumpy(), eager)


def test_activation_arguments_are_checked():
    with pytest.raises(ValueError, match="silu"):
        nn.Activation("gelu")
    with pytest.raises(ValueError, match="alpha"):
        nn.LeakyReLU(-1)
    with pytest.raises(ValueError, match="alpha"):
        nn.ELU("1")


def test_checkpoint_paths_are_checked_and_write_errors_are_oserrors(tmp_path):
    """save/load_parameters and save/load_states took None or a number as a path and failed
    with Python's own messages; a directory gave "not a valid safetensors file (No such
    device)"; a write that failed (disk full, file too large) raised safetensors'
    SafetensorError, which `except OSError` does not catch. The old file stays whole."""
    net = hl.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    for fn, arg in ((net.save_parameters, "save_parameters: path"),
                    (net.load_parameters, "load_parameters: path"),
                    (trainer.save_states, "save_states: path"),
                    (trainer.load_states, "load_states: path")):
        for bad in (None, 3.5, 0):
            with pytest.raises(TypeError, match=f"{arg}: expected a file path"):
                fn(bad)
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(IsADirectoryError, match="load_parameters: path: .* is a directory"):
        net.load_parameters(str(d))
    with pytest.raises(IsADirectoryError, match="load_states: path: .* is a directory"):
        trainer.load_states(str(d))
    from hybridl._io import atomic_write
    target = tmp_path / "p.safetensors"
    net.save_parameters(str(target))
    before = target.read_bytes()

    class SafetensorError(Exception):         # what safetensors raises for a failed write
        pass

    def fails(tmp):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    with pytest.raises(OSError, match="writing .*p.safetensors' failed: .*File too large"):
        atomic_write(str(target), fails)
    assert target.read_bytes() == before                 # whole, and no temporary file left
    assert sorted(os.listdir(tmp_path)) == ["adir", "p.safetensors"]
