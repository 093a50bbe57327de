"""HybridBlock.hybridize and @hl.jit: eager vs hybridized equivalence for every model in
hl.models (outputs, parameter gradients, BatchNorm running statistics, Dropout under a seed),
the signature cache and its retrace reasons, TracingError on value-dependent Python, no
aliasing across calls, parameter updates seen by the compiled program, jit static arguments."""
import re
import threading
import warnings

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, nd
from hybridl import nn

M = hl.models


def _params(net):
    return {n: p.data().asnumpy() for n, p in net.collect_params().items()}


def _set(net, values):
    for n, p in net.collect_params().items():
        p.set_data(values[n])


def _randomize(net, x, seed=0):
    """Finish deferred init with one forward, then give every parameter a random value
    (running_var positive) so that the comparison is not between zeros."""
    with autograd.pause():
        net(nd.array(x))
    rng = np.random.default_rng(seed)
    for n, p in sorted(net.collect_params().items()):
        if n.endswith("running_var"):
            v = rng.uniform(0.5, 1.5, p.shape)
        elif n.endswith("running_mean"):
            v = rng.uniform(-0.2, 0.2, p.shape)
        else:
            v = rng.standard_normal(p.shape) * (0.3 if p.data().ndim > 1 else 0.1)
        p.set_data(v.astype(np.float32))
    return _params(net)


def _step(net, x, train):
    """One forward (+ backward of sum(y * w) when ``train``): output, grads, parameter values."""
    X = nd.array(x)
    if train:
        with autograd.record():
            y = net(X)
            w = nd.array(np.linspace(-1, 1, y.size, dtype=np.float32).reshape(y.shape))
            loss = nd.sum(y * w)
        loss.backward()
        grads = {n: p.grad().asnumpy() for n, p in net.collect_params().items()
                 if p.grad_req != "null"}
    else:
        y = net(X)
        grads = {}
    return y.asnumpy(), grads, _params(net)


def _compare_eager_hybrid(net, x, train, rtol=1e-5, atol=1e-6):
    init = _randomize(net, x)
    hl.random.seed(11)
    ye, ge, pe = _step(net, x, train)
    _set(net, init)
    net.hybridize()
    hl.random.seed(11)
    yh, gh, ph = _step(net, x, train)
    net.hybridize(False)
    assert yh.shape == ye.shape and yh.dtype == ye.dtype == np.float32
    np.testing.assert_allclose(yh, ye, rtol=rtol, atol=atol)
    assert set(gh) == set(ge)
    for n in ge:
        scale = max(1.0, float(np.abs(ge[n]).max()))
        np.testing.assert_allclose(gh[n], ge[n], rtol=rtol, atol=atol * scale, err_msg=n)
    for n in pe:                       # running statistics updated identically (or not at all)
        np.testing.assert_allclose(ph[n], pe[n], rtol=rtol, atol=atol, err_msg=n)
    return ye, ge, pe, init


MODELS = {
    "mlp": (lambda: M.mlp((16, 12)), (3, 20)),
    "lenet28": (lambda: M.lenet(), (2, 1, 28, 28)),
    "lenet8": (lambda: M.lenet(input_size=8), (3, 1, 8, 8)),
    "resnet18": (lambda: M.resnet18(width=8), (2, 3, 16, 16)),
    "inception": (lambda: M.inception_net(width=4), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "predict"])
@pytest.mark.parametrize("name", list(MODELS))
def test_models_eager_equals_hybridized(name, train):
    make, shape = MODELS[name]
    net = make()
    net.initialize()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ye, ge, pe, init = _compare_eager_hybrid(net, x, train)
    assert np.abs(ye).max() > 1e-3
    if train:
        assert all(np.abs(g).max() > 0 for n, g in ge.items() if "running" not in n) or name == "resnet18"
    if name == "resnet18":
        bn_stats = [n for n in pe if "running_mean" in n]
        assert bn_stats
        changed = [n for n in bn_stats if not np.allclose(pe[n], init[n])]
        assert (len(changed) == len(bn_stats)) if train else not changed


def test_batchnorm_running_stats_after_training_steps():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(3))
    net.initialize()
    x = np.random.default_rng(0).standard_normal((4, 2, 6, 6)).astype(np.float32)
    init = _randomize(net, x)
    results = []
    for hyb in (False, True):
        _set(net, init)
        net.hybridize(hyb)
        trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        for _ in range(3):
            with autograd.record():
                loss = nd.sum(nd.square(net(nd.array(x))))
            loss.backward()
            trainer.step(4)
        results.append(_params(net))
    eager, hyb = results
    for n in eager:
        np.testing.assert_allclose(hyb[n], eager[n], rtol=1e-5, atol=1e-6, err_msg=n)
    rm = [n for n in eager if n.endswith("running_mean")][0]
    assert not np.allclose(eager[rm], init[rm])


def test_dropout_same_seed_same_masks_and_grads():
    net = nn.HybridSequential()
    net.add(nn.Dense(32, activation="relu"), nn.Dropout(0.5), nn.Dense(4))
    net.initialize()
    x = np.random.default_rng(0).standard_normal((8, 10)).astype(np.float32)
    ye, ge, _, init = _compare_eager_hybrid(net, x, True)
    # dropout really dropped something: a different seed gives a different output
    _set(net, init)
    net.hybridize()
    hl.random.seed(12)
    y2, _, _ = _step(net, x, True)
    assert not np.allclose(y2, ye)
    # predict mode: no dropout, deterministic
    _set(net, init)
    a = net(nd.array(x)).asnumpy()
    b = net(nd.array(x)).asnumpy()
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------- cache / retrace


def _mlp():
    net = nn.HybridSequential()
    net.add(nn.Dense(8, activation="relu"), nn.Dense(3))
    net.initialize()
    return net


def test_cache_info_reasons():
    net = _mlp()
    net.hybridize()
    x2 = nd.ones((2, 5))
    assert net.cache_info() == {"hits": 0, "misses": 0, "reasons": [], "programs": 0}
    net(x2)
    ci = net.cache_info()
    assert (ci.hits, ci.misses, ci.programs) == (0, 1, 1) and ci.reasons == ["first call"]
    net(x2)
    net(nd.zeros((2, 5)))
    ci = net.cache_info()
    assert (ci.hits, ci.misses, ci.programs) == (2, 1, 1)
    net(nd.ones((3, 5)))
    ci = net.cache_info()
    assert ci.misses == 2 and ci.programs == 2
    assert ci.reasons[-1] == "input 0 shape (2, 5) -> (3, 5)"
    with autograd.train_mode():
        net(x2)
    assert net.cache_info().reasons[-1] == "training mode False -> True"
    with autograd.record():
        net(x2)
    assert "autograd recording False -> True" in net.cache_info().reasons[-1]
    ci = net.cache_info()
    assert ci.misses == 4 and ci.programs == 4 and ci.hits == 2
    net(nd.ones((3, 5)))                    # an earlier signature: a hit
    assert net.cache_info().hits == 3 and net.cache_info().programs == 4
    assert hl.graph.cache_info(net) == net.cache_info()


def test_hybridize_again_clears_the_cache():
    net = _mlp()
    net.hybridize()
    x = nd.ones((2, 5))
    y0 = net(x).asnumpy()
    assert net.cache_info().programs == 1
    net.hybridize()
    assert net.cache_info().programs == 0
    np.testing.assert_array_equal(net(x).asnumpy(), y0)
    ci = net.cache_info()
    assert ci.programs == 1 and ci.reasons[-1] == "cache cleared: hybridize() called again"


def test_adding_a_child_clears_the_cache():
    net = _mlp()
    net.hybridize()
    x = nd.array(np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32))
    y0 = net(x).asnumpy()
    assert y0.shape == (2, 3)
    extra = nn.Dense(4)
    extra.initialize()
    net.add(extra)
    assert net.cache_info().programs == 0
    y1 = net(x)
    assert y1.shape == (2, 4)
    assert net.cache_info().reasons[-1] == "cache cleared: a block's children or parameters changed"
    net.hybridize(False)
    np.testing.assert_allclose(y1.asnumpy(), net(x).asnumpy(), rtol=1e-6)
    net.hybridize()
    net(x)
    act = nn.Activation("tanh")
    net.register_child(act)
    assert net.cache_info().programs == 0
    np.testing.assert_allclose(net(x).asnumpy(), np.tanh(y1.asnumpy()), rtol=1e-6)


def test_adding_a_grandchild_clears_the_parents_cache():
    inner = nn.HybridSequential()
    inner.add(nn.Dense(6, activation="relu"))
    net = nn.HybridSequential()
    net.add(inner, nn.Dense(3))
    net.initialize()
    net.hybridize()
    x = nd.array(np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32))
    net(x)
    act = nn.Activation("sigmoid")
    inner.add(act)                  # the compiled program of `net` is now stale
    y = net(x).asnumpy()
    net.hybridize(False)
    np.testing.assert_allclose(y, net(x).asnumpy(), rtol=1e-6)


def test_repeated_retracing_warns():
    net = _mlp()
    net.hybridize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in range(1, 9):            # 8 signatures: no warning yet
            net(nd.ones((b, 5)))
    with pytest.warns(RuntimeWarning, match="retraced 9 times") as rec:
        net(nd.ones((9, 5)))
    assert rec[0].filename == __file__          # points at the caller's line
    with warnings.catch_warnings():      # warned once only
        warnings.simplefilter("error")
        net(nd.ones((10, 5)))
    assert net.cache_info().misses == 10


def test_one_program_per_device_is_no_retracing_to_warn_about():
    # 5 devices x (training, predict) x 2 batch sizes = 20 programs, 4 kinds: no warning
    devices = [hl.cpu(i) for i in range(5)]
    net = _mlp()
    net.initialize(device=devices, force_reinit=True)
    net.hybridize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in (4, 3):
            for d in devices:
                with autograd.train_mode():
                    net(nd.ones((b, 5), device=d))
                net(nd.ones((b, 5), device=d))
    assert net.cache_info().misses == 20 and net.cache_info().programs == 20


def test_jit_repeated_retracing_warns():
    @hl.jit
    def f(x):
        return x * 2.0
    for n in range(1, 9):
        f(nd.ones((n,)))
    with pytest.warns(RuntimeWarning, match="f was retraced 9 times") as rec:
        f(nd.ones((9,)))
    assert rec[0].filename == __file__
    assert re.fullmatch(r"input 0 shape \(\d,\) -> \(9,\)", f.cache_info().reasons[-1])


# ---------------------------------------------------------------------------- TracingError

_LINES = {}


def _mark(tag):
    import inspect
    _LINES[tag] = inspect.currentframe().f_back.f_lineno + 1
    return True


class Branchy(nn.HybridBlock):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Dense(4)

    def forward(self, x):
        y = self.fc(x)
        if self.how == "if" and _mark("if"):
            if y.sum() > 0:
                return y * 2.0
            return y
        if self.how == "float" and _mark("float"):
            return y * float(y.mean())
        if self.how == "int" and _mark("int"):
            return y * int(y.max())
        if self.how == "asnumpy" and _mark("asnumpy"):
            return y * y.asnumpy().mean()
        if self.how == "item" and _mark("item"):
            return y + y.sum().item()
        return y


@pytest.mark.parametrize("how", ["if", "float", "int", "asnumpy", "item"])
def test_value_dependent_python_raises_tracing_error(how):
    net = Branchy(how)
    net.initialize()
    x = nd.array(np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32))
    eager = net(x).asnumpy()                     # imperatively it just works
    assert eager.shape == (2, 4)
    net.hybridize()
    with pytest.raises(hl.TracingError) as ei:
        net(x)
    assert isinstance(ei.value, hl.graph.TracingError)
    msg = str(ei.value)
    assert f"{__file__}:{_LINES[how]}" in msg
    assert "hl.nd.where" in msg and "hybridize(False)" in msg
    # the failed trace leaves nothing behind: imperative again works and gives the same value
    net.hybridize(False)
    np.testing.assert_array_equal(net(x).asnumpy(), eager)
    assert not hl.graph.trace.is_tracing()


def test_tracing_error_in_jit():
    @hl.jit
    def f(x):
        if x.sum() > 0:
            return x
        return -x
    with pytest.raises(hl.TracingError, match="test_hybridize.py"):
        f(nd.ones((2,)))


def test_device_copies_in_traced_code_are_a_tracing_error():
    # x.copyto(dev) / x.to(dev) / hl.parallel.transfer and tensor-parallel layers inside a
    # hybridized block used to fail with "'Symbol' object has no attribute 'copyto'"
    from hybridl.parallel import ColumnParallelDense
    for move in (lambda x: x.to(hl.cpu(1)), lambda x: x.copyto(hl.cpu(1)),
                 lambda x: hl.parallel.transfer(x, hl.cpu(1))):
        f = hl.jit(lambda x, move=move: move(x) * 2)
        with pytest.raises(hl.TracingError, match="copy between devices while hybridizing"):
            f(nd.ones((2,)))
    net = nn.HybridSequential()
    net.add(nn.Dense(6, in_units=8), ColumnParallelDense(4, [hl.cpu(0), hl.cpu(1)]))
    net.initialize()
    eager = net(nd.ones((2, 8))).asnumpy()
    net.hybridize()
    with pytest.raises(hl.TracingError, match="test_hybridize.py.*leave the block that moves"):
        net(nd.ones((2, 8)))
    net.hybridize(False)
    np.testing.assert_array_equal(net(nd.ones((2, 8))).asnumpy(), eager)


def test_failed_traces_do_not_count_towards_the_retrace_warning():
    import warnings

    @hl.jit
    def f(a, b):
        return a + b                    # (3,) + (4,): a broadcasting error while tracing
    for _ in range(hl.graph.hybrid.RETRACE_WARN + 3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no "retraced" warning
            with pytest.raises(ValueError):
                f(nd.ones((3,)), nd.ones((4,)))
    info = f.cache_info()
    assert info.programs == 0 and all(r.endswith("(the trace failed)") for r in info.reasons)
    assert f(nd.ones((3,)), nd.ones((3,))).tolist() == [2.0, 2.0, 2.0]
    assert f.cache_info().programs == 1


# ---------------------------------------------------------------------------- aliasing, updates


def test_no_aliasing_across_calls():
    net = _mlp()
    net.hybridize()
    rng = np.random.default_rng(0)
    x1, x2 = (nd.array(rng.standard_normal((4, 5)).astype(np.float32)) for _ in range(2))
    y1 = net(x1)
    keep = y1.asnumpy()
    y2 = net(x2)
    y2.wait_to_read()
    np.testing.assert_array_equal(y1.asnumpy(), keep)
    assert not np.allclose(y2.asnumpy(), keep)
    assert not np.shares_memory(y1._data, y2._data)
    net.hybridize(False)
    np.testing.assert_allclose(net(x1).asnumpy(), keep, rtol=1e-6)
    # same with a program that has planned buffers, recording, several outputs

    class Two(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(16)

        def forward(self, x):
            h = nd.tanh(self.fc(x)) * 2.0 + 1.0
            return nd.relu(h - 1.5), nd.sum(h * h, axis=1)
    two = Two()
    two.initialize()
    two.hybridize()
    a1, b1 = two(x1)
    ka, kb = a1.asnumpy(), b1.asnumpy()
    with autograd.record():
        a2, b2 = two(x2)
    a3, b3 = two(x2)
    for v in (a2, b2, a3, b3):
        v.wait_to_read()
    np.testing.assert_array_equal(a1.asnumpy(), ka)
    np.testing.assert_array_equal(b1.asnumpy(), kb)
    for u in (a1, b1):
        for v in (a2, b2, a3, b3):
            assert not np.shares_memory(u._data, v._data)
    np.testing.assert_allclose(a2.asnumpy(), a3.asnumpy(), rtol=1e-6, atol=1e-7)  # two programs


def test_set_data_and_trainer_updates_are_seen():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    nets = [_mlp(), _mlp()]
    init = _randomize(nets[0], x)
    _randomize(nets[1], x)
    _set(nets[1], init)
    eager, hyb = nets
    hyb.hybridize()
    np.testing.assert_allclose(hyb(nd.array(x)).asnumpy(), eager(nd.array(x)).asnumpy(), rtol=1e-6)
    # set_data
    w = rng.standard_normal((8, 5)).astype(np.float32)
    for n in nets:
        n[0].weight.set_data(w)
    ye, yh = eager(nd.array(x)).asnumpy(), hyb(nd.array(x)).asnumpy()
    np.testing.assert_allclose(yh, ye, rtol=1e-6)
    assert hyb.cache_info().programs == 1          # no retrace for new values
    # trainer steps
    trainers = [hl.Trainer(n.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9})
                for n in nets]
    for _ in range(2):
        for n, t in zip(nets, trainers):
            with autograd.record():
                loss = nd.sum(nd.square(n(nd.array(x))))
            loss.backward()
            t.step(4)
    ye2, yh2 = eager(nd.array(x)).asnumpy(), hyb(nd.array(x)).asnumpy()
    assert not np.allclose(ye2, ye)
    np.testing.assert_allclose(yh2, ye2, rtol=1e-5, atol=1e-6)


def test_repeat_calls_through_the_engines_inline_lane():
    """A repeated inference call (one output, nothing recorded) runs the program through the
    threaded engine's inline lane (ThreadedEngine.inline_lane): each call a fresh array equal
    to the eager result; an input still being computed or an engine switch takes the general
    path; a kernel failing on the lane is stored on the output, not raised at the call, and
    the block is fine after."""
    from hybridl.engine import ThreadedEngine

    class Pick(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(3, in_units=4)

        def forward(self, x, idx):
            return nd.take(self.fc(x), idx, axis=1, mode="raise")
    rng = np.random.default_rng(5)
    x = nd.array(rng.standard_normal((2, 4)).astype(np.float32))
    ok, bad = nd.array(np.array([2, 0])), nd.array(np.array([1, 9]))
    net = Pick()
    net.initialize()
    w, b = net.fc.weight.data().asnumpy(), net.fc.bias.data().asnumpy()
    want = (x.asnumpy() @ w.T + b)[:, [2, 0]]
    net.hybridize()
    e = ThreadedEngine(inline_s=1.0)
    try:
        with hl.engine.set_engine(e):
            outs = [net(x, ok).wait_to_read() for _ in range(3)]   # the cost learned
            cell = e._cost[net.last_program._ckey]
            runs = cell[1]
            general = []                                # calls of the general fast path
            e.run_ready = lambda *a, f=e.run_ready: general.append(a) or f(*a)
            outs.append(net(x, ok))
            assert cell[1] == runs + 1 and not general  # it ran inline, on the lane
            assert len({id(o) for o in outs}) == len(outs)
            for o in outs:
                np.testing.assert_allclose(o.asnumpy(), want, rtol=1e-6)
            y = net(x, bad)                             # IndexError on the lane: stored
            assert cell[1] == runs + 2 and not general
            with pytest.raises(hl.OpError) as ei:
                y.wait_to_read()
            assert isinstance(ei.value.__cause__, IndexError)
            with pytest.raises(hl.OpError):
                hl.waitall()
            np.testing.assert_allclose(net(x, ok).asnumpy(), want, rtol=1e-6)
            # an input written by a pushed op not yet run: the general path waits for it
            slow = nd.array(np.zeros((2, 4), np.float32))
            gate = threading.Event()
            e.push(gate.wait, [], [slow._var], slow.device, 0, "gate")
            z = net(slow, ok)
            assert len(general) == 1                    # not ready: the general path
            gate.set()
            np.testing.assert_allclose(z.asnumpy(), np.broadcast_to(b[[2, 0]], (2, 2)), rtol=1e-6)
        with hl.engine.set_engine("naive"):                # another engine: its own path
            np.testing.assert_allclose(net(x, ok).asnumpy(), want, rtol=1e-6)
            with pytest.raises(hl.OpError):
                net(x, bad)                             # the naive engine raises at the line
        with hl.engine.set_engine(e):
            np.testing.assert_allclose(net(x, ok).asnumpy(), want, rtol=1e-6)
    finally:
        e.shutdown()


@pytest.mark.filterwarnings("ignore:.*retraced")
def test_repeat_calls_see_every_change_that_the_full_lookup_sees():
    """A repeated call with the last call's signature skips the cache lookup (the block's
    fast path); each change below must still reach it: the result always equals the eager
    network's, and programs/hits are counted as by the full lookup."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    eager, hyb = _mlp(), _mlp()
    _set(hyb, _randomize(eager, x))
    hyb.hybridize()

    def same(X, record=False):
        outs, grads = [], []
        for net in (eager, hyb):
            if record:
                X.attach_grad()
                with autograd.record():
                    y = net(X)
                    loss = nd.sum(y * y)
                loss.backward()
                grads.append(X.grad.asnumpy().copy())
            else:
                y = net(X)
            outs.append(y.asnumpy())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        if record:
            np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-6)

    X = nd.array(x)
    for _ in range(3):
        same(X)
    assert hyb.cache_info().hits == 2 and hyb.cache_info().programs == 1
    # new arrays for a parameter (initialize again), then a new grad_req
    for net in (eager, hyb):
        net[0].weight.initialize(hl.init.Constant(0.25), force_reinit=True)
    same(X)
    same(X, record=True)
    for net in (eager, hyb):
        net[0].weight.grad_req = "null"
    same(nd.array(x), record=True)
    assert hyb[0].weight.grad_req == "null"
    # another batch size, then back: both programs reused, each call correct
    x2 = rng.standard_normal((2, 5)).astype(np.float32)
    for a in (x2, x, x2, x):
        same(nd.array(a))
    # training mode (no Dropout: the same values, another program); float64 data
    with autograd.train_mode():
        same(X)
    same(X)
    with pytest.raises(TypeError, match="dtype"):           # float64 data, float32 weights
        hyb(nd.array(x.astype(np.float64)))
    same(X)
    # a child added: the cache is cleared, and the new layer is used
    for net in (eager, hyb):
        net.add(nn.Dense(2, in_units=3))
        net[-1].initialize(hl.init.Constant(0.5))
    n_before = hyb.cache_info().misses
    same(X)
    same(X)
    assert hyb.cache_info().misses == n_before + 1
    # hybridize() again: a new program, still equal
    hyb.hybridize()
    same(X)
    same(X)
    assert hyb.cache_info().programs == 1


# ---------------------------------------------------------------------------- jit


def test_jit_static_argnames_and_cache_info():
    calls = []

    @hl.jit(static_argnames=("n", "mode"))
    def f(x, y, n=1, mode="add"):
        calls.append((n, mode))
        z = x + y if mode == "add" else x * y
        for _ in range(n):
            z = nd.tanh(z)
        return z, nd.sum(z)

    xv = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    yv = np.full((2, 3), 0.5, np.float32)
    x, y = nd.array(xv), nd.array(yv)

    def ref(n, mode):
        z = xv + yv if mode == "add" else xv * yv
        for _ in range(n):
            z = np.tanh(z)
        return z

    for n, mode in [(1, "add"), (2, "add"), (1, "add"), (3, "mul"), (2, "add")]:
        z, s = f(x, y, n=n, mode=mode)
        np.testing.assert_allclose(z.asnumpy(), ref(n, mode), rtol=1e-6)
        np.testing.assert_allclose(s.item(), ref(n, mode).sum(), rtol=1e-5)
    assert calls == [(1, "add"), (2, "add"), (3, "mul")]        # one trace per static value
    ci = f.cache_info()
    assert (ci.hits, ci.misses, ci.programs) == (2, 3, 3)
    assert ci.reasons[0] == "first call"
    assert "static arguments" in ci.reasons[1]
    f(nd.ones((4, 3)), nd.ones((4, 3)), n=1, mode="add")
    assert f.cache_info().reasons[-1] == "input 0 shape (2, 3) -> (4, 3); input 1 shape (2, 3) -> (4, 3)"
    assert f.__name__ == "f"
    with pytest.raises(TypeError, match="static_argnames"):
        f(x, y, n=1, other=2)
    assert "tanh" in f.last_program.source


def test_jit_gradients_match_eager():
    @hl.jit
    def f(x, w):
        return nd.sum(nd.tanh(nd.matmul(x, w)) ** 2)

    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    grads = []
    for fn in (f, f._fn):
        x, w = nd.array(xv), nd.array(wv)
        x.attach_grad()
        w.attach_grad()
        with autograd.record():
            y = fn(x, w)
        y.backward()
        grads.append((y.item(), x.grad.asnumpy(), w.grad.asnumpy()))
    (a0, gx0, gw0), (a1, gx1, gw1) = grads
    assert a0 == pytest.approx(a1, rel=1e-12)
    np.testing.assert_allclose(gx0, gx1, rtol=1e-12)
    np.testing.assert_allclose(gw0, gw1, rtol=1e-12)
    assert f.last_program.backward is not None


def test_create_graph_through_a_hybridized_block_raises_instead_of_dropping_terms():
    # the compiled backward has no gradient of its own: a gradient penalty built on it used to
    # be treated as a constant (weight.grad equal with and without the penalty), silently
    from hybridl import autograd, nd, nn
    xv = np.random.default_rng(0).standard_normal((2, 4))
    net = nn.HybridSequential()
    net.add(nn.Dense(3, activation="tanh", in_units=4, dtype="float64"))
    net.initialize()
    net.hybridize()
    x = nd.array(xv)
    with autograd.record():
        loss = nd.sum(net(x) ** 2)
        with pytest.raises(NotImplementedError, match=r"create_graph=True.*hybridize\(False\)"):
            autograd.grad(loss, net[0].weight.data(), create_graph=True)
    net.hybridize(False)                      # the way out named in the message: eager works
    grads = []
    for penalty in (False, True):
        with autograd.record():
            loss = nd.sum(net(x) ** 2)
            g = autograd.grad(loss, net[0].weight.data(), create_graph=True)
            tot = loss + nd.sum(g * g) if penalty else loss
        tot.backward()
        grads.append(net[0].weight.grad().asnumpy().copy())
    assert not np.allclose(grads[0], grads[1])


def test_building_unrelated_layers_does_not_retrace_hybridized_nets():
    """Constructing a layer (nn.Dense, a model, a slice net[:1]) bumped the global structure
    version, so every hybridized network retraced on its next call with the reason 'first
    call' (and warned of retracing after 9). Only blocks that ran in a traced program count."""
    net = _mlp()
    net.hybridize()
    x = nd.ones((2, 5))
    y0 = net(x).asnumpy()
    for _ in range(10):
        nn.Dense(4)
        hl.models.lenet(10)
        net[:1]
        nn.HybridSequential().add(nn.Dense(2), nn.BatchNorm())
    np.testing.assert_array_equal(net(x).asnumpy(), y0)
    ci = net.cache_info()
    assert (ci.misses, ci.programs) == (1, 1) and ci.hits == 1


def test_freezing_and_unfreezing_switches_programs_without_retracing():
    """A GAN-style loop flips grad_req between 'null' and 'write' every step: a signature keeps
    one program per set of trainable parameters, so after the first two traces nothing is
    traced again; the gradients equal the eager network's in both states."""
    eager, hyb = _mlp(), _mlp()
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    _set(hyb, _randomize(eager, x))
    hyb.hybridize()
    for step in range(6):
        req = "null" if step % 2 else "write"
        grads = []
        for net in (eager, hyb):
            net[0].weight.grad_req = req
            X = nd.array(x)
            X.attach_grad()
            with autograd.record():
                loss = nd.sum(nd.square(net(X)))
            loss.backward()
            grads.append((X.grad.asnumpy(), net[1].weight.grad().asnumpy(),
                          None if req == "null" else net[0].weight.grad().asnumpy()))
        for a, b in zip(*grads):
            if a is not None:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    ci = hyb.cache_info()
    assert (ci.misses, ci.programs) == (2, 2) and "grad_req" in ci.reasons[1]


def test_jit_sees_a_structure_change_of_a_block_it_calls():
    """An @hl.jit function calling a network kept its old program after net.add(...): it
    returned the old layers' result. Now the change clears its cache, as a hybridized block's."""
    net = nn.HybridSequential()
    net.add(nn.Dense(3, in_units=4))
    net.initialize()
    f = hl.jit(lambda v: net(v) * 2)
    x = nd.ones((2, 4))
    assert f(x).shape == (2, 3)
    net.add(nn.Dense(5, in_units=3))
    net[1].initialize()
    y = f(x)
    assert y.shape == (2, 5)
    np.testing.assert_allclose(y.asnumpy(), net(x).asnumpy() * 2, rtol=1e-6)
    assert f.cache_info().reasons[-1] == "cache cleared: a block's children or parameters changed"


def test_an_unknown_pass_name_is_an_error_at_hybridize_and_jit():
    net = _mlp()
    with pytest.raises(ValueError, match="unknown pass 'no_such_pass'"):
        net.hybridize(passes=["no_such_pass"])
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        hl.jit(lambda v: v + 1, passes=["nope"])
    with pytest.raises(ValueError, match="expected a list of pass names"):
        net.hybridize(passes="fold_constants")
