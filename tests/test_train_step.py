"""hl.TrainStep: forward + loss + backward + optimizer update compiled into one program must
give the Gluon loop's results (losses, parameters, optimizer state, BatchNorm statistics,
Dropout masks), on both engines."""
import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd, models, nd, nn


def _params(net):
    return {n: p.data().asnumpy().copy() for n, p in net.collect_params().items()}


def _set(net, values):
    for n, p in net.collect_params().items():
        p.set_data(nd.array(values[n]))


def _batches(n, shape, classes=10, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch,) + shape).astype(np.float32),
             rng.integers(0, classes, batch)) for _ in range(n)]


def _run(net, init, optimizer, opt_params, batches, compiled, loss_fn=None, seed=3,
         lr_schedule=None):
    """Train from ``init`` on ``batches``; returns (losses, params, trainer)."""
    _set(net, init)
    loss_fn = loss_fn or hl.loss.SoftmaxCrossEntropyLoss()
    trainer = hl.Trainer(net.collect_params(), optimizer, dict(opt_params))
    step = hl.TrainStep(net, loss_fn, trainer) if compiled else None
    hl.random.seed(seed)
    losses = []
    for i, (x, y) in enumerate(batches):
        if lr_schedule:
            trainer.set_learning_rate(lr_schedule[i])
        x, y = nd.array(x), nd.array(y)
        if compiled:
            loss = step(x, y)
        else:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
        losses.append(loss.asnumpy())
    return np.array(losses), _params(net), trainer


def _new_step(net, init, **kw):
    """A TrainStep (SGD, lr 0.1, softmax cross-entropy) of ``net`` reset to ``init``."""
    _set(net, init)
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    return hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer, **kw)


def _init(net, x):
    net(nd.array(x))                      # finish deferred shapes
    return _params(net)


@pytest.mark.parametrize("optimizer,opt_params", [
    ("sgd", {"learning_rate": 0.1}),
    ("sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}),
    ("sgd", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True, "clip_gradient": 0.01}),
    ("adam", {"learning_rate": 1e-3, "wd": 1e-4}),
    ("adamw", {"learning_rate": 1e-3, "wd": 1e-2}),
])
@pytest.mark.parametrize("engine", ["threaded", "naive"])
def test_train_step_equals_the_loop(optimizer, opt_params, engine):
    prev = hl.engine.get_engine()
    hl.engine.set_engine(engine)
    try:
        net = models.mlp(hidden=(16, 12))
        net.initialize()
        batches = _batches(5, (6,))
        init = _init(net, batches[0][0])
        ref = _run(net, init, optimizer, opt_params, batches, False)
        got = _run(net, init, optimizer, opt_params, batches, True)
    finally:
        hl.engine.set_engine(prev)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-7)
    for n in ref[1]:
        assert not np.allclose(ref[1][n], init[n]), n          # training changed every weight
        np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-5, atol=1e-7, err_msg=n)
    # the optimizer state is the trainer's: same update counts and moments
    for key, st in ref[2]._states.items():
        st2 = got[2]._states[key]
        assert st2["t"] == st["t"] == 5
        for name, a in st["arrays"].items():
            np.testing.assert_allclose(st2["arrays"][name], a, rtol=1e-5, atol=1e-7)


def test_train_step_lenet_learning_rate_schedule_and_lr_mult():
    net = models.lenet(10, input_size=12)
    net.initialize()
    batches = _batches(3, (1, 12, 12), batch=4)
    init = _init(net, batches[0][0])
    list(net.collect_params().values())[0].lr_mult = 0.5
    sched = [0.1, 0.02, 0.3]
    ref = _run(net, init, "sgd", {"learning_rate": 0.1, "momentum": 0.5}, batches, False,
               lr_schedule=sched)
    got = _run(net, init, "sgd", {"learning_rate": 0.1, "momentum": 0.5}, batches, True,
               lr_schedule=sched)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for n in ref[1]:
        np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_train_step_batchnorm_statistics_and_dropout_masks():
    net = nn.HybridSequential()
    net.add(nn.Dense(16), nn.BatchNorm(), nn.Activation("relu"), nn.Dropout(0.5), nn.Dense(4))
    net.initialize()
    batches = _batches(4, (5,), classes=4)
    init = _init(net, batches[0][0])
    ref = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, False)
    got = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, True)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for n in ref[1]:
        np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-5, atol=1e-6, err_msg=n)
    stats = [n for n in ref[1] if "running" in n]
    assert stats and all(not np.allclose(ref[1][n], init[n]) for n in stats)
    # another seed draws other masks: the losses differ, so the masks were really used
    other = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, True, seed=4)
    assert not np.allclose(other[0], got[0])


def test_train_step_compiles_one_program_with_updates_inside():
    net = models.mlp(hidden=(32, 16))
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer)
    x, y = nd.array(np.ones((4, 20), np.float32)), nd.array(np.arange(4))
    step(x, y)                    # the first call also finishes the deferred initialization
    hl.waitall()
    with hl.profiler.profile() as prof:
        step(x, y)
        hl.waitall()
    names = [e.name for e in prof.events]
    assert names.count("train_step") == 1 and len(names) == 1, names
    prog = step.last_program
    # plain SGD: each weight's gradient and its update are one GEMM with accumulation; the
    # loss and its gradient one node
    assert prog.graph.count("gemm_update") == 3 and prog.graph.count("optimizer_update") == 3
    assert prog.graph.count("softmax_cross_entropy_with_grad") == 1
    assert prog.graph.count("matmul") == 2          # only the data gradients of layers 2, 3
    plan = prog.memory_plan
    assert plan.planned_bytes < plan.naive_bytes
    # each update runs right after its gradient: the last layer's weights are updated before
    # the first layer's gradient is computed (so gradient buffers are reused)
    order = [n.name for n in prog.graph.op_nodes()]
    first_update = min(i for i, n in enumerate(order) if n.startswith("update"))
    assert order[-1].startswith("update")
    assert first_update < len(order) - 6
    # a second shape: a second program, with its reason; same shape again: a hit
    step(nd.array(np.ones((2, 20), np.float32)), nd.array(np.arange(2)))
    step(x, y)
    info = step.cache_info()
    assert (info.misses, info.hits, info.programs) == (2, 2, 2)
    assert info.reasons[0] == "first call" and "(4, 20)" in info.reasons[1]


def test_train_step_keeps_earlier_views_and_copies():
    net = models.mlp(hidden=(8,))
    net.initialize()
    x, y = nd.array(np.ones((4, 5), np.float32)), nd.array(np.arange(4))
    net(x)
    w = net.collect_params()[list(net.collect_params())[0]]
    view = w.data().reshape((-1,))            # an NDArray that may share the weight's buffer
    before = view.asnumpy().copy()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer)
    step(x, y)
    step(x, y)
    np.testing.assert_array_equal(view.asnumpy(), before)
    assert not np.allclose(w.data().asnumpy().reshape(-1), before)


def test_train_step_bad_input():
    net = models.mlp(hidden=(8,))
    net.initialize()
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    with pytest.raises(TypeError, match="trainer"):
        hl.TrainStep(net, lf, "sgd")
    with pytest.raises(ValueError, match="kvstore"):
        hl.TrainStep(net, lf, hl.Trainer(net.collect_params(), "sgd", kvstore="local"))
    trainer = hl.Trainer(net.collect_params(), "sgd")
    with pytest.raises(ValueError, match="unknown pass"):
        hl.TrainStep(net, lf, trainer, passes=["nope"])
    step = hl.TrainStep(net, lf, trainer)
    x, y = nd.array(np.ones((4, 5), np.float32)), nd.array(np.arange(4))
    with pytest.raises(TypeError, match="data, label"):
        step(np.ones((4, 5)), y)
    with pytest.raises(ValueError, match="batch_size"):
        step(x, y, batch_size=0)
    with pytest.raises(ValueError, match="label"):
        step(x, y.copyto(hl.cpu(1)))
    for p in net.collect_params().values():
        p.grad_req = "add"
    with pytest.raises(ValueError, match="grad_req='add'"):
        step(x, y)


def test_train_step_return_outputs_and_dropout_before_batchnorm():
    # the side effect (running statistics) and the returned outputs come from the same
    # forward as the loss: one dropout mask, not one per use
    net = nn.HybridSequential()
    net.add(nn.Dense(16), nn.Dropout(0.5), nn.BatchNorm(), nn.Dense(4))
    net.initialize()
    batches = _batches(3, (5,), classes=4)
    init = _init(net, batches[0][0])
    ref = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, False)
    step = _new_step(net, init, return_outputs=True)
    hl.random.seed(3)
    for x, y in batches:
        loss, out = step(nd.array(x), nd.array(y))
        assert out.shape == (8, 4)
    got = _params(net)
    for n in ref[1]:
        np.testing.assert_allclose(got[n], ref[1][n], rtol=1e-5, atol=1e-6, err_msg=n)
    # the outputs are the logits the loss was computed from
    z = out.asnumpy().astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    np.testing.assert_allclose(loss.asnumpy(), lse - z[np.arange(8), batches[-1][1]], rtol=1e-5)
    assert step.last_program.graph.count("dropout") == 1


# ---------------------------------------------------------------------------- regressions
# (found by trying to break it: weights read through views by other layers or by the update's
# own GEMM, concurrent calls on one memory arena, outputs that are views of a weight, a
# parameter frozen after the Trainer was made, unclear errors)


class _WeightAsInput(nn.HybridBlock):
    """Layer b reads a weight (a's, or its own) as data: the in-place updates must not let any
    reader see a new value."""

    def __init__(self, own):
        super().__init__()
        self.own = own
        self.a = nn.Dense(8, in_units=8)
        self.b = nn.Dense(8, in_units=8)
        self.o = nn.Dense(10, in_units=8)

    def forward(self, x):
        src = self.b if self.own else self.a
        h = self.b(nd.stop_gradient(src.weight.data()))
        return self.o(self.a(x) @ h)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("opt_params", [{"learning_rate": 0.5},
                                        {"learning_rate": 0.5, "wd": 0.1},
                                        {"learning_rate": 0.2, "momentum": 0.9}])
def test_train_step_weight_read_as_data_by_a_layer(own, opt_params):
    net = _WeightAsInput(own)
    net.initialize(hl.init.Normal(0.3))
    batches = _batches(3, (8,), batch=8)
    init = _init(net, batches[0][0])
    ref = _run(net, init, "sgd", opt_params, batches, False)
    got = _run(net, init, "sgd", opt_params, batches, True)
    for n in ref[1]:
        np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_train_step_concurrent_calls_of_a_frozen_net():
    # nothing is trained: the calls write no common array and may run at once on several
    # workers, on one program (one memory arena)
    prev = hl.engine.get_engine().num_workers
    hl.engine.set_num_workers(4)
    try:
        net = models.mlp(hidden=(64, 64))
        net.initialize()
        data = _batches(12, (30,), batch=32)
        net(nd.array(data[0][0]))
        for p in net.collect_params().values():
            p.grad_req = "null"
        lf = hl.loss.SoftmaxCrossEntropyLoss()
        with pytest.warns(UserWarning, match="no parameter to train"):
            tr = hl.Trainer(net.collect_params(), "sgd")
        step = hl.TrainStep(net, lf, tr)
        ref = [lf(net(nd.array(x)), nd.array(y)).asnumpy() for x, y in data]
        with pytest.warns(RuntimeWarning, match="trains nothing"):
            got = [step(nd.array(x), nd.array(y)) for x, y in data]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g.asnumpy(), r, rtol=1e-5)
    finally:
        hl.engine.set_num_workers(prev)


def test_train_step_returned_outputs_keep_the_value_before_the_update():
    class Prior(nn.HybridBlock):            # logits = a learned table: a view of the weight
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter("w", shape=(4, 10))

        def forward(self, x):
            return self.w.data().reshape((4, 10))

    net = Prior()
    net.initialize()
    w0 = net.w.data().asnumpy().copy()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer, return_outputs=True)
    loss, out = step(nd.array(np.zeros((4, 6), np.float32)), nd.array(np.array([1, 2, 3, 4])))
    np.testing.assert_array_equal(out.asnumpy(), w0)
    assert not np.allclose(net.w.data().asnumpy(), w0)


@pytest.mark.parametrize("compiled", [False, True])
def test_parameter_frozen_after_the_trainer_is_made_is_not_updated(compiled):
    net = models.mlp(hidden=(8,))
    net.initialize()
    batches = _batches(2, (5,))
    _init(net, batches[0][0])
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    step = hl.TrainStep(net, lf, trainer)
    first = list(net.collect_params().values())[0]
    for i, (x, y) in enumerate(batches):
        if i == 1:
            first.grad_req = "null"
            frozen = first.data().asnumpy().copy()
        x, y = nd.array(x), nd.array(y)
        if compiled:
            step(x, y)
        else:
            with autograd.record():
                loss = lf(net(x), y)
            loss.backward()
            trainer.step(8)
    np.testing.assert_array_equal(first.data().asnumpy(), frozen)


def test_train_step_errors_name_the_argument():
    net = models.mlp(hidden=(8,))
    net.initialize()
    lf = hl.loss.SoftmaxCrossEntropyLoss()
    trainer = hl.Trainer(net.collect_params(), "sgd")
    with pytest.raises(TypeError, match="passes: expected a list"):
        hl.TrainStep(net, lf, trainer, passes="plan_memory")
    with pytest.raises(TypeError, match="passes: expected pass names"):
        hl.TrainStep(net, lf, trainer, passes=[123])
    with pytest.raises(ValueError, match="'gradient' extends the program's inputs"):
        hl.TrainStep(net, lf, trainer, passes=["gradient"])   # at once, not at the first call
    x, y = nd.array(np.ones((4, 5), np.float32)), nd.array(np.arange(4))
    with pytest.raises(ValueError, match="batch_size: expected a positive finite number, got '8'"):
        hl.TrainStep(net, lf, trainer)(x, y, batch_size="8")
    with pytest.raises(ValueError, match="batch_size: expected a positive finite number, got '8'"):
        trainer.step("8")
    with pytest.raises(ValueError, match="loss_fn: expected one array"):
        hl.TrainStep(net, lambda out, lab: 1.0, trainer)(x, y)

    class Two(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.d = nn.Dense(3, in_units=5)

        def forward(self, x):
            return self.d(x), x

    two = Two()
    two.initialize()
    step = hl.TrainStep(two, lambda o, lab: lf(o[0], lab),
                        hl.Trainer(two.collect_params(), "sgd"), return_outputs=True)
    with pytest.raises(ValueError, match="return_outputs: the net returned tuple"):
        step(x, y)

    class Branchy(nn.Block):
        def __init__(self):
            super().__init__()
            self.d = nn.Dense(3, in_units=5)

        def forward(self, x):
            return self.d(x) if float(x.sum().item()) > 0 else self.d(-x)

    b = Branchy()
    b.initialize()
    with pytest.raises(hl.TracingError, match="record/backward/step loop"):
        hl.TrainStep(b, lf, hl.Trainer(b.collect_params(), "sgd"))(x, y)


def test_detach_inside_a_traced_forward():
    class Detached(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.d = nn.Dense(3, in_units=5)

        def forward(self, x):
            return self.d(x) * self.d(x).detach()

    net = Detached()
    net.initialize()
    batches = _batches(2, (5,), classes=3, batch=4)
    init = _init(net, batches[0][0])
    ref = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, False)
    got = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, True)
    for n in ref[1]:
        np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_train_step_without_fused_updates_is_bit_identical_to_the_loop():
    net = models.mlp(hidden=(16, 12))
    net.initialize()
    batches = _batches(4, (6,))
    init = _init(net, batches[0][0])
    ref = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, False)
    step = _new_step(net, init, fuse_updates=False)
    losses = [step(nd.array(x), nd.array(y)).asnumpy() for x, y in batches]
    np.testing.assert_array_equal(np.array(losses), ref[0])
    for n, v in _params(net).items():
        np.testing.assert_array_equal(v, ref[1][n], err_msg=n)
    assert step.last_program.graph.count("gemm_update") == 0


def _mlp_784(batch):
    net = models.mlp(hidden=(256, 128))
    net.initialize()
    batches = _batches(3, (784,), batch=batch, seed=5)
    return net, batches, _init(net, batches[0][0])


@pytest.mark.parametrize("fuse", [True, False])
def test_relu_outputs_die_at_their_weight_gradient(monkeypatch, fuse):
    """MLP 784-256-128-10 at batch 256: each hidden ReLU output is compared with 0 right after
    the next layer's weight gradient (a bool mask) instead of being kept for its own
    relu_grad, so it is not alive while the input gradient of its size is computed. The peak
    of the step's memory plan goes down (0.625 -> 0.5625 MiB), the values do not change: with
    fuse_updates=False the loop's bits, with fused updates the loop to float rounding."""
    from hybridl.graph import step as step_mod
    net, batches, init = _mlp_784(256)
    ref = _run(net, init, "sgd", {"learning_rate": 0.1}, batches, False)
    got = {}
    for release in (True, False):
        if not release:             # every activation below the size: the rewrite is off
            monkeypatch.setattr(step_mod, "MASK_MIN_BYTES", 1 << 40)
        if fuse is False and release:   # unfused, the peak is elsewhere: the rewrite is not
            monkeypatch.setattr(step_mod, "_lower_peak",   # kept (see below); forced
                                lambda plain, released: released)
        st = _new_step(net, init, fuse_updates=fuse)
        losses = np.array([st(nd.array(x), nd.array(y)).asnumpy() for x, y in batches])
        got[release] = (losses, _params(net), st.last_program)
    on, off = got[True][2], got[False][2]
    # the largest ReLU output (the first hidden layer's, 256 KiB) only, the other kept
    assert on.graph.count("relu_mask") == 1 and off.graph.count("relu_mask") == 0
    assert on.graph.count("relu_grad") == 1 and on.graph.count("relu_grad_masked") == 1
    # fused: 64 KiB less at once, the 256 KiB activation gone, its 64 KiB mask and the 128
    # KiB weight gradient alive instead: 0.5625 MiB against 0.625 (+ small values). Unfused,
    # the peak is the first layer's 784 KiB weight gradient, which the rewrite leaves alone
    saved = off.memory_plan.live_peak_bytes - on.memory_plan.live_peak_bytes
    if fuse:
        assert 60 * 1024 <= saved <= 68 * 1024, saved
        assert on.memory_plan.live_peak_bytes == 576 * 1024
    else:
        assert saved >= 0
    for release in (True, False):
        losses, params = got[release][:2]
        if fuse:
            np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
            for n, v in params.items():
                np.testing.assert_allclose(v, ref[1][n], rtol=1e-5, atol=1e-7, err_msg=n)
        else:
            np.testing.assert_array_equal(losses, ref[0])
            for n, v in params.items():
                np.testing.assert_array_equal(v, ref[1][n], err_msg=n)


def test_a_release_that_does_not_lower_the_peak_is_not_kept():
    """Unfused updates (fuse_updates=False): the step's peak is the first layer's 784 KiB
    weight gradient, which releasing a ReLU output does not lower: the plain program stays."""
    net, batches, init = _mlp_784(256)
    st = _new_step(net, init, fuse_updates=False)
    st(nd.array(batches[0][0]), nd.array(batches[0][1]))
    g = st.last_program.graph
    assert g.count("relu_mask") == 0 and g.count("relu_grad") == 2


def test_small_relu_outputs_keep_relu_grad():
    """Below MASK_MIN_BYTES (64 KiB) the mask would cost an op and save little: no rewrite
    (batch 8 of the same MLP)."""
    net, batches, init = _mlp_784(8)
    st = _new_step(net, init)
    st(nd.array(batches[0][0]), nd.array(batches[0][1]))
    g = st.last_program.graph
    assert g.count("relu_mask") == 0 and g.count("gemm_update") == 3


class _TwoHeads(nn.HybridBlock):
    """A main head the loss uses, an auxiliary one it leaves out, a layer behind
    stop_gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Dense(5, in_units=4)
        self.main = nn.Dense(3, in_units=5)
        self.aux = nn.Dense(2, in_units=4)

    def forward(self, x):
        return self.main(nd.stop_gradient(self.body(x))), self.aux(x)


@pytest.mark.parametrize("mode", ["hybridized", "compiled"])
def test_parameters_without_a_gradient_are_not_updated_as_in_eager(mode):
    """An auxiliary head the loss leaves out, and a layer behind stop_gradient: eager
    backward gives them no gradient and the Trainer skips them (with its warning); the
    hybridized loop and TrainStep gave them zeros, and weight decay / momentum moved them."""
    import warnings

    def run(how):
        hl.random.seed(0)
        net = _TwoHeads()
        net.initialize()
        if how == "hybridized":
            net.hybridize()
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9,
                                                      "wd": 0.1})
        lf = hl.loss.SoftmaxCrossEntropyLoss()
        step = hl.TrainStep(net, lambda out, y: lf(out[0], y), tr, fuse_updates=False) \
            if how == "compiled" else None
        x = nd.array(np.arange(8, dtype=np.float32).reshape(2, 4) / 8)
        y = nd.array(np.array([0.0, 2.0], np.float32))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                if step is not None:
                    step(x, y).asnumpy()
                    continue
                with autograd.record():
                    loss = lf(net(x)[0], y)
                loss.backward()
                tr.step(2)
        return {k: p.data().asnumpy() for k, p in net.collect_params().items()}, w
    want, _ = run("eager")
    got, w = run(mode)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    hl.random.seed(0)
    fresh = _TwoHeads()
    fresh.initialize()
    for k in ("body.weight", "aux.weight", "aux.bias"):
        np.testing.assert_array_equal(got[k], fresh.collect_params()[k].data().asnumpy())
    assert any("aux.weight" in str(m.message) and "body.weight" in str(m.message) for m in w)


def test_threads_making_their_first_train_step_share_one_optimizer_state():
    # Trainer._state checked, then created: two threads' first steps could each make one and
    # lose the other's update count and moments
    import threading
    import time
    net = nn.Dense(4, in_units=3)
    net.initialize()
    tr = hl.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), tr)
    make = tr.optimizer.create_state
    tr.optimizer.create_state = lambda w: (time.sleep(0.05), make(w))[1]     # a slow allocation
    x, y = nd.ones((2, 3)), nd.array(np.array([0.0, 1.0], np.float32))
    bar = threading.Barrier(2)

    def work():
        bar.wait()
        step(x, y).asnumpy()
    ts = [threading.Thread(target=work) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    hl.waitall()
    assert [s["t"] for s in tr._states.values()] == [2, 2]


def test_float64_data_through_a_float32_batchnorm_keeps_float32_statistics(tmp_path):
    """The statistics stay in their parameters' dtype, rounded as the loop's assignment rounds
    them (TrainStep stored the float64 values it computed: the parameter said float32, its
    array was float64, and saved or exported files no longer loaded)."""
    def net_():
        net = nn.HybridSequential()
        net.add(nn.Dense(4, in_units=3, dtype="float64"), nn.BatchNorm(in_channels=4))
        net.initialize()
        return net
    rng = np.random.default_rng(0)
    batches = [(rng.random((5, 3)), np.zeros((5, 4))) for _ in range(3)]
    stats = {}
    init = _params(net_())
    for compiled in (False, True):
        net = net_()
        _run(net, init, "sgd", {"learning_rate": 0.1}, batches, compiled, hl.loss.L2Loss())
        bn = net[1]
        for p in (bn.running_mean, bn.running_var):
            assert p.data().asnumpy().dtype == np.float32 == p.dtype
        stats[compiled] = [p.data().asnumpy() for p in (bn.running_mean, bn.running_var)]
        path = tmp_path / f"net{compiled}.safetensors"
        net.save_parameters(str(path))
        net_().load_parameters(str(path))       # loads without cast_dtype
    for a, b in zip(stats[False], stats[True]):
        np.testing.assert_array_equal(a, b)
