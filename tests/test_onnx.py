"""hl.onnx.export: the exported models run in onnxruntime and match hybridl's predict-mode
outputs; files pass onnx.checker and are written atomically; bad arguments fail clearly."""
import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import hybridl as hl  # noqa: E402
from hybridl import autograd  # noqa: E402
from hybridl import nd as F  # noqa: E402
from hybridl.ops.dispatch import apply  # noqa: E402
from hybridl.ops.registry import OPS  # noqa: E402

TOL = 1e-4


class Fn(hl.nn.HybridBlock):
    """A parameter-free HybridBlock around a function of its inputs."""

    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def forward(self, *xs):
        return self._fn(*xs)


def _run_onnx(path, arrays):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {f"data{i}": a for i, a in enumerate(arrays)})


def _as_list(y):
    return [r.asnumpy() for r in (y if isinstance(y, (tuple, list)) else (y,))]


def _check_model(net, shape, tmp_path, bn_warmup=False, opset=17, seed=0):
    hl.random.seed(seed)
    net.initialize()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if bn_warmup:       # non-trivial running statistics
        for _ in range(2):
            with autograd.record(train_mode=True):
                net(hl.nd.array(rng.standard_normal(shape).astype(np.float32) * 2 + 0.5))
    path = tmp_path / "model.onnx"
    out = hl.onnx.export(net, hl.nd.array(x), path, opset=opset)
    assert out == str(path.resolve())
    onnx.checker.check_model(str(path), full_check=True)
    assert os.listdir(tmp_path) == ["model.onnx"]          # no temp file left behind
    got = _run_onnx(path, [x])
    with autograd.predict_mode():
        ref = _as_list(net(hl.nd.array(x)))
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL)
    return path


# ---------------------------------------------------------------------------- reference models


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "softrelu"])
def test_mlp(tmp_path, activation):
    _check_model(hl.models.mlp(hidden=(32, 16), activation=activation), (4, 1, 28, 28), tmp_path)


def test_mlp_hybridized(tmp_path):
    net = hl.models.mlp()
    net.hybridize()
    _check_model(net, (3, 784), tmp_path)


@pytest.mark.parametrize("size", [28, 8])
def test_lenet(tmp_path, size):
    _check_model(hl.models.lenet(input_size=size), (3, 1, size, size), tmp_path)


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_resnet18_small(tmp_path, opset):
    net = hl.models.resnet18(width=8)
    _check_model(net, (2, 3, 16, 16), tmp_path, bn_warmup=True, opset=opset)
    # the running statistics that were exported are not the initial ones
    rm = [p.data().asnumpy() for k, p in net.collect_params().items() if k.endswith("running_mean")]
    assert any(np.abs(r).max() > 1e-3 for r in rm)


def test_resnet18_default_width(tmp_path):
    path = _check_model(hl.models.resnet18(), (2, 3, 32, 32), tmp_path, bn_warmup=True)
    m = onnx.load(str(path))
    ops = {n.op_type for n in m.graph.node}
    assert {"Conv", "BatchNormalization", "Relu", "Add", "ReduceMean", "Gemm"} <= ops
    assert [i.name for i in m.graph.input] == ["data0"]
    assert [o.name for o in m.graph.output] == ["output0"]


def test_inception(tmp_path):
    _check_model(hl.models.inception_net(width=4), (2, 3, 12, 12), tmp_path)


# ---------------------------------------------------------------------------- single ops


def _check_fn(fn, arrays, tmp_path, opset=17, tol=1e-5):
    net = Fn(fn)
    xs = [hl.nd.array(a) for a in arrays]
    path = tmp_path / f"fn{opset}.onnx"
    hl.onnx.export(net, tuple(xs), path, opset=opset)
    got = _run_onnx(path, arrays)
    ref = _as_list(net(*xs))
    assert len(got) == len(ref)
    for k, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, (k, g.shape, r.shape, g.dtype, r.dtype)
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol, err_msg=f"output {k}")


RNG = np.random.default_rng(1)
A = RNG.standard_normal((2, 3, 4)).astype(np.float32)
B = RNG.standard_normal((3, 4)).astype(np.float32)
POS = (np.abs(A) + 0.5).astype(np.float32)
INTS = RNG.integers(-5, 5, (2, 3)).astype(np.int64)
IMG = RNG.standard_normal((2, 4, 9, 9)).astype(np.float32)
W = RNG.standard_normal((6, 2, 3, 3)).astype(np.float32)
BIAS = RNG.standard_normal((6,)).astype(np.float32)
CH = [RNG.standard_normal(4).astype(np.float32) for _ in range(3)] + \
     [(np.abs(RNG.standard_normal(4)) + 0.1).astype(np.float32)]

CASES = {
    "binary_broadcast": (lambda x, y: (x + y, x - y, x * y, x / y, F.maximum(x, y),
                                       F.minimum(x, y), x ** 2.0), [A, B]),
    "unary": (lambda x: (x * 2.0 + 1, 3 - x, F.exp(x), F.sqrt(F.abs(x)), -x, F.sin(x), F.cos(x),
                         F.square(x), F.tanh(x), F.sigmoid(x), F.softplus(x), F.relu(x),
                         F.floor(x), F.sign(x)), [A]),
    "unary_pos": (lambda x: (F.log(x), F.log1p(x), F.expm1(x), F.reciprocal(x)), [POS]),
    "reductions": (lambda x: (F.sum(x, axis=1), F.mean(x, axis=(0, 2), keepdims=True),
                              F.max(x, axis=-1), F.min(x), F.prod(x, axis=2),
                              F.argmax(x, axis=1), F.sum(x)), [A]),
    "shape_softmax": (lambda x: (F.softmax(x, axis=1), F.log_softmax(x), F.transpose(x, (2, 0, 1)),
                                 F.reshape(x, (6, 4)), F.concat(x, x, axis=2),
                                 F.cast(x, "float64"), F.clip(x, -0.5, 0.5),
                                 F.clip(x, a_min=0.1), F.stack(x, x, axis=1)), [A]),
    "indexing": (lambda x: (x[0], x[:, 1:3], x[..., ::-1], x[:, None, -1, ::2], x[1, :, 2],
                            *F.split(x, 2, axis=2), F.broadcast_to(x[:, :1], (2, 3, 4))), [A]),
    "compare_where": (lambda x, y: (F.where(x > y, x, y), x >= y, x == y, x != y, x < y,
                                    x <= y), [A, B]),
    # int64 against float32 compares in float64, as NumPy does: in float32 16777217 rounds to
    # 16777216 and > gave False
    "compare_int_float": (lambda i, f: (i > f, i == f, i <= f),
                          [np.array([16777217, 3, -2 ** 40], np.int64),
                           np.array([16777216.0, 3.0, -2.0 ** 40], np.float32)]),
    # bool + - max min: ONNX's Add/Mul/Max/Min take no bool (exported as Or/And, NumPy's meaning)
    "bool_arithmetic": (lambda x, y: ((x > 0) + (y > 0), (x > 0) * (y < 0.5),
                                      F.maximum(x > 0, y > 0), F.minimum(x > 0, y > 0),
                                      (x > 0) + 1.5), [A, B]),
    # bool ** bool (a bool in hybridl): ONNX's Pow takes no bool; exported as a or not b
    "bool_power": (lambda x, y: ((x > 0) ** (y > 0), (x > 0) ** 2.0), [A, B]),
    # (k,) on the right: onnxruntime's optimizer got Transpose -> MatMul(2-D, 1-D) wrong
    "matmul_vector": (lambda m, v: (F.matmul(m.T, v), F.matmul(m, v[:3]), F.matmul(v, m)),
                      [RNG.standard_normal((4, 3)).astype(np.float32),
                       RNG.standard_normal(4).astype(np.float32)]),
    "integers": (lambda i: (i + 1, i * i, i / 2, F.sum(i, axis=0), F.mean(i, axis=1),
                            F.one_hot(i, 4), F.cast(i, "float32")), [INTS]),
    "take": (lambda x, i: (F.take(x, i, axis=1), F.take(x, i, axis=2, mode="wrap")), [A, INTS]),
    "embedding": (lambda f, w: (F.embedding(f, w),),
                  [np.array([[0.0, 2.9, -3.0], [1e30, np.inf, -np.inf]], np.float32),
                   RNG.standard_normal((4, 3)).astype(np.float32)]),
    "internal_ops": (lambda x: (apply(OPS["zeros_like"], x), apply(OPS["ones_like"], x),
                                apply(OPS["sum_to"], x, shape=(3, 1))), [A]),
    "outputs_alias": (lambda x: (x, x, F.identity(x)), [A]),
    "dense": (lambda x, w, b: (F.fully_connected(x, w, b, flatten=False),
                               F.fully_connected(x, w, flatten=False),
                               F.fully_connected(x, F.concat(w, w, w, axis=1)),
                               F.fully_connected(x[0], w), F.matmul(x, w.transpose())),
              [A, RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal(5).astype(np.float32)]),
    "conv": (lambda x, w, b: (F.conv2d(x, w, b, stride=2, padding=1, groups=2),
                              F.conv2d(x, w, None, stride=(1, 2), padding=(2, 0), dilation=2,
                                       groups=2)), [IMG, W, BIAS]),
    "pool": (lambda x: (F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 2, 1),
                        F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                        F.avg_pool2d(x, (2, 3), (1, 2)), F.global_avg_pool2d(x)), [IMG]),
    "batch_norm": (lambda x, g, b, m, v: (
        F.batch_norm(x, g, b, m, v, training=False),
        F.batch_norm(x.transpose((0, 2, 3, 1)), g, b, m, v, training=False, axis=-1)), [IMG, *CH]),
}


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ops(tmp_path, case, opset):
    fn, arrays = CASES[case]
    _check_fn(fn, arrays, tmp_path, opset=opset, tol=1e-4 if case == "conv" else 1e-5)


@pytest.mark.parametrize("opset", [17, 18])
def test_layer_norm(tmp_path, opset):
    x = RNG.standard_normal((2, 5, 4)).astype(np.float32)
    _check_fn(lambda x, g, b: apply(OPS["layer_norm"], x, g, b, eps=1e-5), [x, *CH[:2]], tmp_path, opset)
    _check_fn(lambda x, g, b: F.layer_norm(x, g, b), [x, *CH[:2]], tmp_path, opset)
    with pytest.raises(NotImplementedError, match="layer_norm.*opset >= 17"):
        hl.onnx.export(Fn(lambda x, g, b: F.layer_norm(x, g, b)),
                       tuple(hl.nd.array(a) for a in [x, *CH[:2]]), tmp_path / "ln.onnx", opset=16)


def test_numpy_sample_input_and_overwrite(tmp_path):
    net = hl.models.mlp(hidden=(8,))
    net.initialize()
    x = RNG.standard_normal((2, 5)).astype(np.float32)
    path = tmp_path / "m.onnx"
    path.write_bytes(b"old contents")
    hl.onnx.export(net, x, str(path))
    onnx.checker.check_model(str(path))
    np.testing.assert_allclose(_run_onnx(path, [x])[0], net(hl.nd.array(x)).asnumpy(), atol=TOL)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


# ---------------------------------------------------------------------------- errors


def test_unsupported_op(tmp_path):
    net = Fn(lambda a, b: F.softmax_cross_entropy(a, b))
    x = hl.nd.array(np.zeros((2, 3), np.float32))
    y = hl.nd.array(np.zeros((2,), np.int64))
    path = tmp_path / "bad.onnx"
    with pytest.raises(NotImplementedError, match="softmax_cross_entropy") as e:
        hl.onnx.export(net, (x, y), path)
    assert "conv2d" in str(e.value) and "fully_connected" in str(e.value)   # lists supported
    assert os.listdir(tmp_path) == []
    assert "conv2d" in hl.onnx.supported_ops()


def test_bad_arguments(tmp_path):
    net = Fn(lambda a: a)
    x = hl.nd.array(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="net"):
        hl.onnx.export(lambda a: a, x, tmp_path / "a.onnx")
    with pytest.raises(ValueError, match="opset"):
        hl.onnx.export(net, x, tmp_path / "a.onnx", opset=12)
    with pytest.raises(ValueError, match="opset"):
        hl.onnx.export(net, x, tmp_path / "a.onnx", opset=1000)
    with pytest.raises(TypeError, match="opset"):
        hl.onnx.export(net, x, tmp_path / "a.onnx", opset="17")
    with pytest.raises(TypeError, match="sample_input"):
        hl.onnx.export(net, [1, 2], tmp_path / "a.onnx")
    with pytest.raises(TypeError, match="path"):
        hl.onnx.export(net, x, 3)
    with pytest.raises(FileNotFoundError, match="path"):
        hl.onnx.export(net, x, tmp_path / "missing" / "a.onnx")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="path"):
        hl.onnx.export(net, x, tmp_path / "file" / "a.onnx")
    with pytest.raises(IsADirectoryError, match="path"):
        hl.onnx.export(net, x, tmp_path)
    assert os.listdir(tmp_path) == ["file"]


def test_uninitialized_params(tmp_path):
    with pytest.raises(RuntimeError, match="initialize"):
        hl.onnx.export(hl.models.mlp(), hl.nd.zeros((2, 4)), tmp_path / "a.onnx")


def test_zero_dim_constants_inputs_and_parameters_keep_their_rank(tmp_path):
    # np.ascontiguousarray turned 0-d constants (a Python scalar next to a 0-d result) and
    # 0-d parameters into shape (1,): onnx shape inference refused the model
    class Scale(hl.nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.s = hl.nn.Parameter("s", (), init="ones")

        def forward(self, x):
            return x.mean() * self.s.data() + 1, x.sum() * 0.5

    for net, x in ((Scale(), np.ones((2, 3), np.float32)),
                   (Fn(lambda x: x * 2 + 1), np.array(3.0, np.float32))):
        net.initialize()
        path = tmp_path / "zero_d.onnx"
        hl.onnx.export(net, hl.nd.array(x), path)
        got = _run_onnx(path, [x])
        ref = _as_list(net(hl.nd.array(x)))
        for g, r in zip(got, ref):
            assert g.shape == r.shape == ()
            np.testing.assert_allclose(g, r, rtol=1e-6)


def test_activation_layers(tmp_path):
    net = hl.nn.HybridSequential()
    net.add(hl.nn.Dense(8, in_units=5), hl.nn.LeakyReLU(0.2), hl.nn.Dense(8, in_units=8),
            hl.nn.ELU(), hl.nn.Activation("silu"), hl.nn.Activation("softsign"))
    _check_model(net, (3, 5), tmp_path)


def test_integer_clip_and_reshape_to_a_zero_size_shape(tmp_path):
    """Integer clip bounds were truncated in the export (hybridl rounds them inward: ceil of
    the lower, floor of the upper) and an infinite or out-of-range bound crashed it; a
    reshape to a shape with a 0 was read by ONNX as "copy this dimension" (no allowzero)."""
    ints = np.array([-3, -1, 0, 1, 2, 3], np.int64)
    _check_fn(lambda x: (F.clip(x, 0.5, 2.5), F.clip(x, -2.5, -0.5), F.clip(x, 0, float("inf")),
                         F.clip(x, -1e12, 5)), [ints], tmp_path)
    _check_fn(lambda x: x.reshape((3, 0)), [np.zeros((0, 3), np.float32)], tmp_path)
    with pytest.raises(ValueError, match="needs opset >= 14"):
        hl.onnx.export(Fn(lambda x: x.reshape((3, 0))), hl.nd.zeros((0, 3)),
                       tmp_path / "z.onnx", opset=13)
