"""Optimizers vs NumPy references of the formulas in hybridl/optim/optimizer.py; the Trainer."""
import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nd, nn, optim

SHAPE = (3, 4)
STEPS = 6


def _grads(seed=0, n=STEPS, shape=SHAPE):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) * (1 + i) for i in range(n)]


def _param(w0, name="w", dtype="float64", **kw):
    p = nn.Parameter(name, w0.shape, dtype=dtype, **kw)
    p.initialize(hl.init.Zero())
    p.set_data(w0)
    return p


def _set_grad(params, grads):
    """Backward of sum(w * G): each parameter's gradient becomes G exactly."""
    with autograd.record():
        loss = None
        for p, g in zip(params, grads):
            t = (p.data() * nd.array(g, dtype="float64")).sum()
            loss = t if loss is None else loss + t
    loss.backward()


# ----------------------------------------------------------------------------- references


def ref_sgd(w, grads, lr, momentum=0.0, wd=0.0, nesterov=False, rescale=1.0, clip=None):
    w = w.copy()
    buf = None
    for g in grads:
        g = g * rescale
        if clip is not None:
            g = np.clip(g, -clip, clip)
        g = g + wd * w
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + g
            step = g + momentum * buf if nesterov else buf
        else:
            step = g
        w = w - lr * step
    return w


def ref_adam(w, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False, rescale=1.0,
             clip=None):
    w = w.copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g * rescale
        if clip is not None:
            g = np.clip(g, -clip, clip)
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - b1 ** t)
        vhat = v / (1 - b2 ** t)
        w = w - lr * mhat / (np.sqrt(vhat) + eps)
    return w


def _run(opt_name, opt_params, grads, w0, batch_size=1, **pkw):
    p = _param(w0, **pkw)
    tr = optim.Trainer([p], opt_name, opt_params)
    for g in grads:
        _set_grad([p], [g])
        tr.step(batch_size)
    return p.data().asnumpy()


W0 = np.random.default_rng(7).standard_normal(SHAPE)

SGD_CASES = [
    dict(learning_rate=0.1),
    dict(learning_rate=0.05, momentum=0.9),
    dict(learning_rate=0.05, momentum=0.9, nesterov=True),
    dict(learning_rate=0.1, wd=0.01),
    dict(learning_rate=0.05, momentum=0.8, wd=0.02, nesterov=True),
    dict(learning_rate=0.1, momentum=0.5, clip_gradient=0.7),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(kw))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_sgd_matches_reference(kw, batch_size):
    got = _run("sgd", kw, _grads(1), W0, batch_size)
    ref = ref_sgd(W0, _grads(1), kw["learning_rate"], kw.get("momentum", 0.0), kw.get("wd", 0.0),
                  kw.get("nesterov", False), 1.0 / batch_size, kw.get("clip_gradient"))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-12)
    assert not np.allclose(got, W0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("wd", [0.0, 0.02])
def test_sgd_momentum_blas_path_matches_reference(dtype, wd):
    # weights of >= 4096 elements take the BLAS momentum step (axpby + axpy, no temporaries):
    # same values as the reference up to rounding, over several steps; the first step (no
    # momentum yet) and a non-contiguous gradient take the NumPy path and must agree with it
    shape = (64, 80)
    w0 = np.random.default_rng(3).standard_normal(shape)
    grads = [np.random.default_rng(10 + i).standard_normal(shape) for i in range(4)]
    kw = dict(learning_rate=0.05, momentum=0.9, wd=wd)
    got = _run("sgd", kw, grads, w0.astype(dtype), batch_size=4, dtype=dtype)
    ref = ref_sgd(w0, grads, 0.05, 0.9, wd, False, 0.25)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    assert optim.SGD(momentum=0.9)._momentum_blas(
        np.zeros(shape, dtype), np.zeros((80, 64), dtype).T, np.zeros(shape, dtype), 0.1, 0.0,
        1.0, None) is None                       # a strided gradient: not taken, nothing written


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,wd", [("adam", 0.0), ("adam", 0.02), ("adamw", 0.02)])
def test_adam_blas_path_matches_reference(name, wd, dtype):
    # weights of >= 4096 elements take the in-place Adam step (axpby moments, one temporary,
    # bias corrections folded into the axpy coefficient): the reference's values up to rounding
    shape = (64, 80)
    w0 = np.random.default_rng(4).standard_normal(shape)
    grads = [np.random.default_rng(20 + i).standard_normal(shape) for i in range(4)]
    kw = dict(learning_rate=0.01, wd=wd)
    got = _run(name, kw, grads, w0.astype(dtype), batch_size=2, dtype=dtype)
    ref = ref_adam(w0, grads, 0.01, 0.9, 0.999, 1e-8, wd, name == "adamw", 0.5)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    st = {"mean": np.zeros(shape, dtype), "var": np.zeros((80, 64), dtype).T}
    assert optim.Adam()._adam_blas(np.zeros(shape, dtype), np.ones(shape, dtype), st, 0.1, 0.0,
                                   1, 1.0, None) is None         # strided state: not taken ...
    assert not st["mean"].any()                                  # ... and nothing written


@pytest.mark.parametrize("name,kw", [("sgd", dict(learning_rate=0.1)),
                                     ("sgd", dict(learning_rate=0.1, momentum=0.9)),
                                     ("adam", dict(learning_rate=0.1)),
                                     ("adamw", dict(learning_rate=0.1))])
def test_blas_fast_paths_show_non_finite_gradients_like_numpy(name, kw):
    # lr 0 (a warm-up's first steps): BLAS skips alpha * x when alpha is 0, which would hide an
    # inf gradient; the BLAS paths are not taken then, and every size gives NumPy's NaN
    for n in (8, 8192):                                  # NumPy path, BLAS path
        opt = optim.create(name, **kw)
        w = np.ones(n, np.float32)
        st = {k: np.zeros(n, np.float32) for k in opt.state_names}
        w = opt.step_kernel(w, np.ones(n, np.float32), st, 0.1, 0.0, 1, 1.0, None, out=w)
        g = np.ones(n, np.float32)
        g[0] = np.inf
        with np.errstate(invalid="ignore"):
            w = opt.step_kernel(w, g, st, 0.0, 0.0, 2, 1.0, None, out=w)
        assert np.isnan(w[0]) and np.isfinite(w[1:]).all(), (name, n, w[:2])


def test_adam_blas_path_squares_the_rescaled_gradient():
    # a raw float32 gradient of 1e20 squared overflows; rescaled (1e-3) it is 1e17, whose
    # square fits: the fast path must square after rescaling, as the NumPy path does
    n = 8192
    res = []
    for clip in (None, 1e30):                            # BLAS path, NumPy path
        opt = optim.Adam(0.01)
        st = {"mean": np.zeros(n, np.float32), "var": np.zeros(n, np.float32)}
        w = opt.step_kernel(np.zeros(n, np.float32), np.full(n, 1e20, np.float32), st, 0.01,
                            0.0, 1, 1e-3, clip)
        assert np.isfinite(st["var"]).all()
        res.append(w)
    np.testing.assert_allclose(res[0], res[1], rtol=1e-6)
    np.testing.assert_allclose(res[0], -0.01, rtol=1e-5)


def test_blas_helpers_refuse_non_native_byte_order():
    from hybridl.ops import _blas
    x, y = np.ones(8192, ">f4"), np.ones(8192, ">f4")
    assert not _blas.ready((x, y), (y,), ("axpy",))
    assert not _blas.axpy(2.0, x, y) and not _blas.axpby(2.0, x, 3.0, y)
    assert (y == 1).all()


def test_sgd_momentum_read_only_state_is_replaced():
    # a read-only momentum buffer (set by the user) cannot be updated in place: the NumPy
    # path replaces it instead of failing
    opt = optim.SGD(0.1, momentum=0.9)
    buf = np.ones(8, np.float32)
    buf.flags.writeable = False
    st = {"momentum": buf}
    w = opt.step_kernel(np.ones(8, np.float32), np.ones(8, np.float32), st, 0.1, 0.0, 2, 1.0, None)
    np.testing.assert_allclose(st["momentum"], 1.9)
    np.testing.assert_allclose(w, 1 - 0.19, rtol=1e-6)


ADAM_CASES = [
    dict(learning_rate=0.01),
    dict(learning_rate=0.02, beta1=0.8, beta2=0.99, epsilon=1e-6),
    dict(learning_rate=0.01, wd=0.05),
    dict(learning_rate=0.01, clip_gradient=1.5),
]


@pytest.mark.parametrize("kw", ADAM_CASES, ids=lambda kw: ",".join(kw))
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_adamw_match_reference(kw, name):
    got = _run(name, kw, _grads(2), W0, batch_size=2)
    wd = kw.get("wd", 0.01 if name == "adamw" else 0.0)
    ref = ref_adam(W0, _grads(2), kw["learning_rate"], kw.get("beta1", 0.9), kw.get("beta2", 0.999),
                   kw.get("epsilon", 1e-8), wd, name == "adamw", 0.5, kw.get("clip_gradient"))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-12)


def test_adamw_default_wd_differs_from_adam_l2():
    kw = dict(learning_rate=0.01, wd=0.1)
    a = _run("adam", kw, _grads(3), W0)
    b = _run("adamw", kw, _grads(3), W0)
    assert not np.allclose(a, b)
    assert optim.AdamW().wd == 0.01


def test_lr_mult_wd_mult():
    grads = _grads(4)
    kw = dict(learning_rate=0.1, momentum=0.9, wd=0.05)
    p1 = _param(W0, "a", lr_mult=0.5, wd_mult=2.0)
    p2 = _param(W0 + 1, "b", lr_mult=1.0, wd_mult=0.0)
    tr = optim.Trainer([p1, p2], "sgd", kw)
    for g in grads:
        _set_grad([p1, p2], [g, -g])
        tr.step(1)
    np.testing.assert_allclose(p1.data().asnumpy(), ref_sgd(W0, grads, 0.05, 0.9, 0.1), rtol=1e-6)
    np.testing.assert_allclose(p2.data().asnumpy(),
                               ref_sgd(W0 + 1, [-g for g in grads], 0.1, 0.9, 0.0), rtol=1e-6)
    # Adam honours the multipliers too
    p3 = _param(W0, "c", lr_mult=3.0, wd_mult=0.5)
    tr = optim.Trainer([p3], "adam", dict(learning_rate=0.01, wd=0.2))
    for g in grads:
        _set_grad([p3], [g])
        tr.step(1)
    np.testing.assert_allclose(p3.data().asnumpy(), ref_adam(W0, grads, 0.03, wd=0.1), rtol=1e-6)


def test_step_rescales_by_batch_size():
    g = np.full(SHAPE, 8.0)
    p = _param(np.zeros(SHAPE))
    tr = optim.Trainer([p], "sgd", dict(learning_rate=1.0))
    _set_grad([p], [g])
    tr.step(8)
    np.testing.assert_allclose(p.data().asnumpy(), -np.ones(SHAPE), rtol=1e-12)
    _set_grad([p], [g])
    tr.step(2)
    np.testing.assert_allclose(p.data().asnumpy(), -5 * np.ones(SHAPE), rtol=1e-12)
    for bad in (0, -3, None):
        with pytest.raises(ValueError, match="batch_size"):
            tr.step(bad)


def test_set_learning_rate():
    grads = _grads(5)
    p = _param(W0)
    tr = optim.Trainer([p], "sgd", dict(learning_rate=0.1, momentum=0.9))
    assert tr.learning_rate == 0.1
    w = W0.copy()
    buf = None
    for i, g in enumerate(grads):
        lr = 0.1 / (1 + i)
        tr.set_learning_rate(lr)
        assert tr.learning_rate == lr
        _set_grad([p], [g])
        tr.step(1)
        buf = g.copy() if buf is None else 0.9 * buf + g
        w = w - lr * buf
    np.testing.assert_allclose(p.data().asnumpy(), w, rtol=1e-6)
    with pytest.raises(ValueError, match="learning_rate"):
        tr.set_learning_rate(-1.0)


def test_grad_req_null_not_updated():
    p = _param(W0, "trained")
    frozen = _param(W0, "frozen", grad_req="null")
    tr = optim.Trainer([p, frozen], "sgd", dict(learning_rate=0.1, wd=0.5))
    for g in _grads(6, 3):
        _set_grad([p], [g])
        tr.step(1)
    np.testing.assert_array_equal(frozen.data().asnumpy(), W0)
    assert not np.allclose(p.data().asnumpy(), W0)
    # BatchNorm running statistics (grad_req 'null') are left to the layer
    bn = nn.BatchNorm(in_channels=2)
    bn.initialize()
    tr = optim.Trainer(bn.collect_params(), "sgd", dict(learning_rate=1.0, wd=0.5))
    with autograd.record():
        y = bn(nd.array(np.random.default_rng(0).standard_normal((4, 2))))
    y.backward()
    rm, rv = bn.running_mean.data().asnumpy().copy(), bn.running_var.data().asnumpy().copy()
    tr.step(1)
    np.testing.assert_array_equal(bn.running_mean.data().asnumpy(), rm)
    np.testing.assert_array_equal(bn.running_var.data().asnumpy(), rv)
    assert not np.allclose(bn.gamma.data().asnumpy(), 1.0)     # weight decay moved gamma
    hl.waitall()


@pytest.mark.parametrize("name,kw", [("sgd", dict(learning_rate=0.05, momentum=0.9, wd=0.01)),
                                     ("adam", dict(learning_rate=0.01)),
                                     ("adamw", dict(learning_rate=0.01, wd=0.1))])
def test_save_load_states_continues_identically(tmp_path, name, kw):
    grads = _grads(8, 8)
    # uninterrupted
    p = _param(W0)
    tr = optim.Trainer([p], name, kw)
    for g in grads:
        _set_grad([p], [g])
        tr.step(2)
    full = p.data().asnumpy()
    # interrupted after 4 steps: save, rebuild, load, continue
    p = _param(W0)
    tr = optim.Trainer([p], name, kw)
    for g in grads[:4]:
        _set_grad([p], [g])
        tr.step(2)
    tr.set_learning_rate(kw["learning_rate"])
    path = str(tmp_path / "trainer.states")
    tr.save_states(path)
    w_mid = p.data().asnumpy().copy()
    p2 = _param(w_mid)
    tr2 = optim.Trainer([p2], name, dict(kw, learning_rate=123.0))
    tr2.load_states(path)
    assert tr2.learning_rate == kw["learning_rate"]
    for g in grads[4:]:
        _set_grad([p2], [g])
        tr2.step(2)
    np.testing.assert_allclose(p2.data().asnumpy(), full, rtol=1e-12, atol=1e-15)
    # without the states, the continuation differs (the test would catch a no-op load)
    p3 = _param(w_mid)
    tr3 = optim.Trainer([p3], name, kw)
    for g in grads[4:]:
        _set_grad([p3], [g])
        tr3.step(2)
    assert not np.allclose(p3.data().asnumpy(), full, rtol=1e-9)


def test_load_states_errors(tmp_path):
    p = _param(W0)
    tr = optim.Trainer([p], "sgd", dict(learning_rate=0.1, momentum=0.9))
    _set_grad([p], [_grads()[0]])
    tr.step(1)
    path = tmp_path / "s.states"
    tr.save_states(str(path))
    tra = optim.Trainer([_param(W0)], "adam")
    with pytest.raises(ValueError, match="SGD"):
        tra.load_states(str(path))
    bad = tmp_path / "bad.states"
    bad.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match="not a valid"):
        tr.load_states(str(bad))
    with pytest.raises(FileNotFoundError):
        tr.load_states(str(tmp_path / "nope"))


def test_optimizer_argument_errors():
    with pytest.raises(ValueError, match="learning_rate"):
        optim.SGD(learning_rate=-0.1)
    with pytest.raises(ValueError, match="wd"):
        optim.Adam(wd=-1)
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD(nesterov=True)
    with pytest.raises(ValueError, match="beta1"):
        optim.Adam(beta1=1.0)
    with pytest.raises(ValueError, match="optimizer"):
        optim.Trainer([_param(W0)], "rmsprop")
    with pytest.raises(TypeError, match="params"):
        optim.Trainer(_param(W0), "sgd")


def test_trainer_checks_update_on_kvstore_and_refuses_a_shared_store():
    with pytest.raises(ValueError, match="update_on_kvstore=True: needs kvstore='dist'"):
        optim.Trainer([_param(W0)], "sgd", update_on_kvstore=True)
    with pytest.raises(ValueError, match="update_on_kvstore=True: needs kvstore='dist'"):
        optim.Trainer([_param(W0)], "sgd", kvstore="device", update_on_kvstore=True)
    with pytest.raises(ValueError, match="update_on_kvstore: expected None, False or True"):
        optim.Trainer([_param(W0)], "sgd", update_on_kvstore="yes")

    class Global(optim.SGD):        # an update that is not marked elementwise
        elementwise = False
    with pytest.raises(ValueError, match="Global is not marked elementwise"):
        optim.Trainer([_param(W0)], Global(), kvstore="dist", update_on_kvstore=True)
    assert optim.SGD.elementwise and optim.Adam.elementwise and optim.AdamW.elementwise
    # one process (no launcher): the default path, the same values as without the option
    w1, w2 = _param(W0), _param(W0)
    for w, uok in ((w1, True), (w2, None)):
        tr = optim.Trainer([w], "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="dist",
                           update_on_kvstore=uok)
        for _ in range(3):
            with hl.autograd.record():
                loss = (w.data() * w.data()).sum()
            loss.backward()
            tr.step(1)
    np.testing.assert_array_equal(w1.data().asnumpy(), w2.data().asnumpy())
    optim.Trainer([_param(W0)], "sgd", update_on_kvstore=False)
    store = hl.kv.create("device")
    a, b = _param(W0), _param(W0)
    optim.Trainer([a], "sgd", kvstore=store).step(1, ignore_stale_grad=True)
    with pytest.raises(ValueError, match="this KVStore object already holds keys"):
        optim.Trainer([b], "sgd", kvstore=store).step(1, ignore_stale_grad=True)


def test_learning_rate_alias_lr():
    # lr is an alias of learning_rate: either gives the rate; both with different values are
    # refused (lr used to win silently); the defaults stay the class's
    assert optim.SGD(lr=0.5).learning_rate == 0.5
    assert optim.Adam(learning_rate=0.2, lr=0.2).learning_rate == 0.2
    assert optim.SGD().learning_rate == 0.01
    assert optim.Adam().learning_rate == 0.001 and optim.AdamW().learning_rate == 0.001
    with pytest.raises(ValueError, match="learning_rate=0.1 and its alias lr=0.5"):
        optim.Trainer([_param(W0)], "sgd", {"learning_rate": 0.1, "lr": 0.5})
    with pytest.raises(ValueError, match="alias lr"):
        optim.AdamW(learning_rate=0.1, lr=0.01)


# ----------------------------------------------------------------------------- async race


def _async_run(engine_kind, batch_sizes, seed=0):
    with hl.engine.set_engine(engine_kind):
        hl.random.seed(seed)
        net = nn.HybridSequential()
        net.add(nn.Dense(256, activation="relu", in_units=128, dtype="float64"),
                nn.Dense(256, activation="relu", in_units=256, dtype="float64"),
                nn.Dense(10, in_units=256, dtype="float64"))
        net.initialize()
        tr = optim.Trainer(net.collect_params(), "sgd", dict(learning_rate=0.1, momentum=0.9))
        loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
        rng = np.random.default_rng(seed)
        data = [(nd.array(rng.standard_normal((bs, 128)), dtype="float64"),
                 nd.array(rng.integers(0, 10, bs), dtype="int64")) for bs in batch_sizes]
        for x, y in data:                   # no sync point inside the loop
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            tr.step(x.shape[0])
        out = [p.data().asnumpy() for p in net.collect_params().values()]
    return out


def test_last_batch_of_other_size_async_equals_naive():
    sizes = [64, 64, 64, 3, 64, 64, 5, 64]
    naive = _async_run("naive", sizes)
    for _ in range(2):
        threaded = _async_run("threaded", sizes)
        for a, b in zip(naive, threaded):
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


def test_clip_gradient_rescale_captured_at_push():
    # the optimizer's attributes may change after update() is pushed: the queued op must use
    # the values of push time
    with hl.engine.set_engine("threaded"):
        p = _param(np.zeros(SHAPE))
        opt = optim.SGD(learning_rate=1.0, clip_gradient=0.5)
        tr = optim.Trainer([p], opt)
        _set_grad([p], [np.full(SHAPE, 10.0)])
        tr.step(4)                       # g = 10 / 4 = 2.5, clipped to 0.5
        opt.clip_gradient = 100.0
        opt.rescale_grad = 1.0
        np.testing.assert_allclose(p.data().asnumpy(), -0.5 * np.ones(SHAPE), rtol=1e-12)


def test_save_load_states_with_repeated_parameter_names(tmp_path):
    # Parameters of layers never collected into one block all carry the name 'weight'
    grads = _grads(9, 4)
    kw = dict(learning_rate=0.05, momentum=0.9)
    a, b = _param(W0, "weight"), _param(W0, "weight")
    tr = optim.Trainer([a, b], "sgd", kw)
    for g in grads[:2]:
        _set_grad([a, b], [g, 3 * g])
        tr.step(1)
    path = str(tmp_path / "dup.states")
    tr.save_states(path)
    a2, b2 = _param(a.data().asnumpy(), "weight"), _param(b.data().asnumpy(), "weight")
    tr2 = optim.Trainer([a2, b2], "sgd", kw)
    tr2.load_states(path)
    for g in grads[2:]:
        for (p, q, tr_) in ((a, b, tr), (a2, b2, tr2)):
            _set_grad([p, q], [g, 3 * g])
            tr_.step(1)
    np.testing.assert_allclose(a2.data().asnumpy(), a.data().asnumpy(), rtol=1e-12)
    np.testing.assert_allclose(b2.data().asnumpy(), b.data().asnumpy(), rtol=1e-12)
    np.testing.assert_allclose(a.data().asnumpy(), ref_sgd(W0, grads, 0.05, 0.9), rtol=1e-6)


@pytest.mark.parametrize("name,kw", [("sgd", dict(learning_rate=0.1)),
                                     ("sgd", dict(learning_rate=0.1, momentum=0.9)),
                                     ("adam", dict(learning_rate=0.1)),
                                     ("adamw", dict(learning_rate=0.1))])
def test_update_in_place_never_changes_what_others_see(name, kw):
    """Updates write into the weight's buffer only when nobody else refers to it: arrays made
    from the weight before the step (a reshape or transpose that may share its buffer in the
    kernel, an asnumpy copy) keep their values, the gradient buffer is never written, and the
    weight itself gets the reference update either way."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(SHAPE)
    p = _param(w0)
    tr = hl.Trainer([p], name, kw)
    g = rng.standard_normal(SHAPE)
    expected = []
    for shared in (False, True):                # first an unshared buffer, then a shared one
        before = p.data().asnumpy()
        view = p.data().reshape((12,)) if shared else None
        trans = p.data().T if shared else None
        _set_grad([p], [g])
        g_before = p.grad().asnumpy()
        tr.step(1)
        hl.waitall()
        np.testing.assert_array_equal(p.grad().asnumpy(), g_before)
        if shared:
            np.testing.assert_array_equal(view.asnumpy(), before.reshape(12))
            np.testing.assert_array_equal(trans.asnumpy(), before.T)
        expected.append(p.data().asnumpy())
    ref = {"sgd": ref_sgd, "adam": ref_adam, "adamw": ref_adam}[name]
    extra = dict(decoupled=True, wd=0.01) if name == "adamw" else {}
    if name == "sgd" and "momentum" in kw:
        extra = dict(momentum=kw["momentum"])
    want = ref(w0, [g, g], kw["learning_rate"], **extra)
    np.testing.assert_allclose(expected[-1], want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_plain_sgd_large_weights_one_pass(dtype):
    """Plain SGD on a weight of >= _AXPY_MIN elements takes the one-pass BLAS axpy path: it
    matches the NumPy reference, and a weight whose buffer is shared (updated into a copy)
    gets exactly the same values as one updated in place."""
    from hybridl.optim import optimizer as O
    shape = (80, 64)
    assert np.prod(shape) >= O._AXPY_MIN
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    results = []
    for shared in (False, True):
        p = nn.Parameter("w", shape, dtype=dtype)
        p.initialize(hl.init.Zero())
        p.set_data(w0)
        tr = hl.Trainer([p], "sgd", {"learning_rate": 0.1})
        keep = []
        for g in grads:
            if shared:
                keep.append(p.data().reshape((-1,)))      # another view: no in-place update
            _set_grad([p], [g.astype("float64")])
            tr.step(4)
        results.append(p.data().asnumpy())
        if shared:
            np.testing.assert_array_equal(keep[0].asnumpy(), w0.reshape(-1))
    np.testing.assert_array_equal(results[0], results[1])
    ref = ref_sgd(w0.astype("float64"), grads, 0.1, rescale=0.25)
    np.testing.assert_allclose(results[0], ref, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")     # inf * 0 in the inf case
def test_clip_global_norm_against_numpy():
    rng = np.random.default_rng(0)
    vals = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    want = np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in vals))
    arrays = [hl.nd.array(vals[0]), hl.nd.array(vals[1], device=hl.cpu(1))]
    norm = hl.optim.clip_global_norm(arrays, 1.0)
    assert norm == pytest.approx(want, rel=1e-12)
    for a, v in zip(arrays, vals):                    # scaled by max_norm / norm
        np.testing.assert_allclose(a.asnumpy(), v * (1.0 / (want + 1e-8)), rtol=1e-6)
    kept = [hl.nd.array(v) for v in vals]
    assert hl.optim.clip_global_norm(kept, 10.0) == pytest.approx(want, rel=1e-12)
    for a, v in zip(kept, vals):                      # below the bound: untouched
        np.testing.assert_array_equal(a.asnumpy(), v)
    scaled = hl.nd.array([np.inf, 1.0])
    with pytest.warns(RuntimeWarning, match="inf or NaN"):
        hl.optim.clip_global_norm([scaled], 1.0)
    scaled.wait_to_read()       # its scaling (inf * 0) runs under this test's warning filter
    for bad, err in (([], ValueError), (hl.nd.ones(2), TypeError), ([np.ones(2)], TypeError),
                     ([hl.nd.array([1, 2])], TypeError)):
        with pytest.raises(err, match="arrays"):
            hl.optim.clip_global_norm(bad, 1.0)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="max_norm"):
            hl.optim.clip_global_norm([hl.nd.ones(2)], bad)


def test_clip_global_norm_in_a_training_step():
    net = hl.nn.Dense(2, in_units=3)
    net.initialize()
    w0 = net.weight.data().asnumpy().copy()
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0})
    x = hl.nd.array(np.full((4, 3), 10.0, np.float32))
    with hl.autograd.record():
        loss = net(x).sum()
    loss.backward()
    grads = [p.grad() for p in net.collect_params().values()]
    norm = hl.optim.clip_global_norm(grads, 0.5)
    assert norm > 0.5
    tr.step(1)
    g = np.concatenate([(w0 - net.weight.data().asnumpy()).ravel()])
    gb = -net.bias.data().asnumpy()
    np.testing.assert_allclose(np.sqrt((g.astype(np.float64) ** 2).sum() + (gb ** 2).sum()), 0.5,
                               rtol=1e-5)


def test_rescale_grad_is_a_factor_and_hyper_parameters_are_checked():
    """rescale_grad in optimizer_params was accepted (even -1, NaN, 0) and then overwritten by
    1 / batch_size; as in MXNet's Trainer it now multiplies it. lr_mult / wd_mult, wd,
    nesterov, optimizer_params and initializer arguments are checked where they are given."""
    import hybridl as hl
    for scale in (1.0, 2.0):
        net = hl.nn.Dense(1, in_units=1, use_bias=False)
        net.initialize(hl.init.One())
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0, "rescale_grad": scale})
        x = hl.nd.array(np.ones((4, 1), np.float32))
        with hl.autograd.record():
            loss = net(x).sum()                          # d loss / d w = 4
        loss.backward()
        tr.step(4)                                       # w = 1 - 1 * scale * 4 / 4
        np.testing.assert_allclose(net.weight.data().asnumpy(), [[1.0 - scale]], rtol=1e-6)
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="rescale_grad"):
            hl.optim.SGD(rescale_grad=bad)
    with pytest.raises(ValueError, match="wd: expected a finite number"):
        hl.optim.SGD(wd=float("inf"))
    with pytest.raises(TypeError, match="nesterov"):
        hl.optim.SGD(momentum=0.9, nesterov="no")
    with pytest.raises(ValueError, match="learning_rate"):
        hl.optim.SGD().set_learning_rate(np.array([0.1, 0.2]))
    p = hl.nn.Dense(1, in_units=1)
    p.initialize()
    with pytest.raises(TypeError, match="optimizer_params: expected a dict"):
        hl.Trainer(p.collect_params(), "sgd", [("learning_rate", 0.1)])
    with pytest.raises(ValueError, match="batch_size: expected a positive finite number"):
        hl.Trainer(p.collect_params(), "sgd").step(float("inf"))
    w = p.weight
    for attr in ("lr_mult", "wd_mult"):
        for bad, err in ((-1, ValueError), (float("nan"), ValueError), ("0.5", TypeError),
                         (None, TypeError)):
            with pytest.raises(err, match=attr):
                setattr(w, attr, bad)
    w.lr_mult = 0.5
    assert w.lr_mult == 0.5
    for make in (lambda: hl.init.Normal(float("nan")), lambda: hl.init.Constant(float("inf")),
                 lambda: hl.init.Xavier(magnitude=float("nan")), lambda: hl.init.Uniform(None),
                 lambda: hl.init.Normal("1")):
        with pytest.raises((TypeError, ValueError), match="expected a"):
            make()


def test_loss_batch_axis_counts_from_the_end_and_is_checked():
    """batch_axis=-1 gave a scalar for L2/L1/sigmoid BCE losses (compared with the positive
    index only); out-of-range or non-int values were accepted or failed obscurely."""
    import hybridl as hl
    pred = hl.nd.array(np.random.default_rng(0).random((2, 3, 4)).astype(np.float32))
    label = hl.nd.array(np.random.default_rng(1).random((2, 3, 4)).astype(np.float32))
    for cls in (hl.loss.L2Loss, hl.loss.L1Loss, hl.loss.SigmoidBinaryCrossEntropyLoss):
        a = cls(batch_axis=-1)(pred, label).asnumpy()
        b = cls(batch_axis=2)(pred, label).asnumpy()
        assert a.shape == (4,)
        np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="batch_axis 3 is out of range"):
            cls(batch_axis=3)(pred, label)
        for bad in ("0", None, 1.0):
            with pytest.raises(TypeError, match="batch_axis must be an int"):
                cls(batch_axis=bad)
    logits = hl.nd.array(np.random.default_rng(2).random((4, 5)).astype(np.float32))
    y = hl.nd.array(np.array([0, 1, 2, 3], np.float32))
    with pytest.raises(ValueError, match="batch_axis 4 is out of range"):
        hl.loss.SoftmaxCrossEntropyLoss(batch_axis=4)(logits, y)


def test_load_states_refuses_a_file_of_a_trainer_over_fewer_parameters(tmp_path):
    """A file saved by a trainer over the first layer, loaded by one over the whole net,
    silently dropped the second layer's momentum. A parameter the saving trainer had but
    had not updated yet (no state) is still reset, as in the saved run."""
    net = nn.Sequential()
    net.add(nn.Dense(4, in_units=3), nn.Dense(2, in_units=4))
    net.initialize()
    x = hl.nd.array(np.ones((2, 3), np.float32))

    def step(tr, loss_of=lambda y: y.sum()):
        with autograd.record():
            loss = loss_of(net(x))
        loss.backward()
        tr.step(2, ignore_stale_grad=True)
    kw = {"learning_rate": 0.1, "momentum": 0.9}
    first = optim.Trainer(net.collect_params("0\\."), "sgd", kw)
    step(first)
    first.save_states(str(tmp_path / "first.states"))
    full = optim.Trainer(net.collect_params(), "sgd", kw)
    step(full)
    with pytest.raises(ValueError, match=r"saved by a trainer without the parameters "
                                         r"\['1.weight', '1.bias'\]"):
        full.load_states(str(tmp_path / "first.states"))
    assert len(full._states) == 4                   # nothing changed
    # the whole net's trainer, saved before any update: every state reset on load
    fresh = optim.Trainer(net.collect_params(), "sgd", kw)
    fresh.save_states(str(tmp_path / "fresh.states"))
    full.load_states(str(tmp_path / "fresh.states"))
    assert full._states == {}


def test_trainer_warns_when_an_mpi_job_trains_without_a_dist_store(monkeypatch):
    """From a new-user pass: under mpiexec, a Trainer without kvstore='dist' trained every rank
    alone, silently (hybridl train refuses that without --distributed)."""
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.warns(UserWarning, match=r"one of 2 started by an MPI launcher \(PMI_SIZE=2\)"):
        optim.Trainer([_param(W0)], "sgd")
    monkeypatch.delenv("PMI_RANK")          # a size left over, no launcher: one process
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.Trainer([_param(W0)], "sgd")
