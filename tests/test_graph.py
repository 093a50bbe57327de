"""The graph IR, hl.compile and the symbolic interpreter; the symbolic gradient pass against
float64 finite differences; the forward/backward split."""
import numpy as np
import pytest

import hybridl as hl
from hybridl import nd


def fancy_func(a, b, c, d):
    e = a + b
    f = c + d
    return e + f


# ---------------------------------------------------------------------------- hl.compile


def test_compile_folds_the_chapter_example_to_one_constant():
    consts = [hl.sym.const(np.float32(v)) for v in (1, 2, 3, 4)]
    prog = hl.compile(fancy_func(*consts))
    g = prog.graph
    assert g.op_nodes() == [] and g.count() == 0
    assert len(g.outputs) == 1
    out = g.outputs[0]
    assert out.node.kind == "const" and out.shape == () and out.dtype == np.float32
    assert out.node.value == 10
    assert [n.kind for n in g.nodes] == ["const"]
    # readable Python with no op call: just the folded constant returned
    src = prog.source
    assert src.startswith("def program(")
    assert "return (" in src and "k0(" not in src and "out=" not in src
    compile(src, "<check>", "exec")
    assert len([ln for ln in src.splitlines() if ln.strip()]) == 2
    r = prog()
    assert isinstance(r, hl.NDArray) and r.shape == () and r.item() == 10.0
    # Python numbers in the chain fold the same way
    prog = hl.compile(fancy_func(hl.sym.const(np.float32(1)), 2, 3, 4))
    assert prog.graph.count() == 0 and prog().item() == 10.0
    # the unoptimized program still computes 10, with three adds
    raw = hl.compile(fancy_func(*consts), passes=[])
    assert raw.graph.count("add") == 3 and raw().item() == 10.0


def test_compile_with_symbolic_vars_computes():
    a, b, c, d = [hl.sym.var(n, shape=(2, 3)) for n in "abcd"]
    prog = hl.compile(fancy_func(a, b, c, d))
    assert prog.graph.count("add") == 3
    assert prog.input_names == ["a", "b", "c", "d"]
    rng = np.random.default_rng(0)
    vals = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(4)]
    r = prog(*vals)
    assert r.shape == (2, 3) and r.dtype == np.float32
    np.testing.assert_allclose(r.asnumpy(), (vals[0] + vals[1]) + (vals[2] + vals[3]), rtol=1e-6)
    # NDArrays work too, and the source names the kernels' ops
    r2 = prog(*[nd.array(v) for v in vals])
    np.testing.assert_array_equal(r2.asnumpy(), r.asnumpy())
    assert prog.source.count("# add") == 3
    # explicit input order
    prog2 = hl.compile(fancy_func(a, b, c, d), inputs=[d, c, b, a])
    np.testing.assert_array_equal(prog2(*vals[::-1]).asnumpy(), r.asnumpy())


def test_compile_mixed_constants_and_vars_folds_the_constant_half():
    a = hl.sym.var("a", shape=(3,))
    prog = hl.compile(fancy_func(a, 2.0, hl.sym.const(np.float32(3)), 4.0))
    # (a + 2) + 7: two adds, the constant half folded
    assert prog.graph.count("add") == 2
    np.testing.assert_allclose(prog(np.array([1, 2, 3], np.float32)).asnumpy(), [10, 11, 12])


def test_compile_errors():
    x = hl.sym.var("x", shape=(2, 3))
    prog = hl.compile(x * 2.0)
    with pytest.raises(ValueError, match="input 0 .x. must have shape"):
        prog(np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="expected 1 inputs"):
        prog(nd.ones((2, 3)), nd.ones((2, 3)))
    with pytest.raises(ValueError, match="shape is required"):
        hl.sym.var("x")
    with pytest.raises(ValueError, match=">= 0"):
        hl.sym.var("x", shape=(-1, 2))
    with pytest.raises(ValueError):               # shape errors at the building line
        x + hl.sym.var("y", shape=(4,))


def test_graph_structure_and_printing():
    x = hl.sym.var("x", shape=(2, 3))
    w = hl.sym.var("w", shape=(3, 4))
    y = nd.relu(nd.matmul(x, w) + 1.0)
    assert isinstance(y, hl.graph.Symbol)
    assert y.shape == (2, 4) and y.dtype == np.float32 and y.ndim == 2 and y.size == 8
    g = hl.graph.Graph([x, w], [y])
    kinds = [n.kind for n in g.nodes]
    assert kinds.count("input") == 2 and kinds.count("const") == 1 and kinds.count("op") == 3
    # topological: every node's inputs come before it
    pos = {n.id: i for i, n in enumerate(g.nodes)}
    for n in g.nodes:
        for s in n.inputs:
            assert pos[s.node.id] < pos[n.id]
    s = str(g)
    assert "matmul(" in s and "relu(" in s and "const 1.0" in s and "return" in s
    assert g.count("matmul") == 1 and g.count() == 3
    with pytest.raises(ValueError, match="not a leaf"):
        hl.graph.Graph([y], [y])


def test_symbol_has_no_value():
    x = hl.sym.var("x", shape=(2,))
    for f in (bool, float, int):
        with pytest.raises(hl.TracingError, match="hl.nd.where"):
            f(x.sum())
    with pytest.raises(hl.TracingError):
        x.asnumpy()
    with pytest.raises(hl.TracingError):
        x.item()
    with pytest.raises(hl.TracingError):
        np.asarray(x)
    assert hl.TracingError is hl.graph.TracingError and issubclass(hl.TracingError, RuntimeError)


def test_multi_output_and_integer_programs():
    x = hl.sym.var("x", shape=(4,))
    i = hl.sym.var("i", shape=(4,), dtype="int64")
    prog = hl.compile([x * 2.0, nd.argmax(x), i + 1, x > 0])
    xv = np.array([3, -1, 5, 0], np.float32)
    iv = np.arange(4)
    a, b, c, d = prog(xv, iv)
    np.testing.assert_array_equal(a.asnumpy(), xv * 2)
    assert b.dtype == np.int64 and b.item() == 2
    assert c.dtype == np.int64 and list(c.asnumpy()) == [1, 2, 3, 4]
    assert d.dtype == np.bool_ and list(d.asnumpy()) == [True, False, True, False]


# ---------------------------------------------------------------------------- gradient pass


def _fd_grad(f, xs, i, h=1e-6):
    """Central differences of scalar f(*xs) w.r.t. xs[i] (float64)."""
    g = np.zeros_like(xs[i])
    for k in np.ndindex(xs[i].shape):
        p = [x.copy() for x in xs]
        m = [x.copy() for x in xs]
        p[i][k] += h
        m[i][k] -= h
        g[k] = (f(*p) - f(*m)) / (2 * h)
    return g


def _graph_fn():
    x = hl.sym.var("x", shape=(3, 4), dtype="float64")
    w = hl.sym.var("w", shape=(4, 2), dtype="float64")
    b = hl.sym.var("b", shape=(2,), dtype="float64")
    h = nd.tanh(nd.matmul(x, w) + b)
    y1 = nd.sum(h * h, axis=1) + nd.mean(nd.exp(x * 0.5), axis=1) * 2.0
    y2 = nd.sigmoid(nd.transpose(h)) * nd.reshape(b, (2, 1)) + nd.max(x, axis=1)
    return [x, w, b], [y1, y2]


def test_gradient_matches_finite_differences_float64():
    inputs, outs = _graph_fn()
    graph = hl.graph.Graph(inputs, outs)
    joint, cots, wrt = hl.graph.gradient(graph)
    assert wrt == [0, 1, 2] and all(c is not None for c in cots)
    assert len(joint.inputs) == 3 + 2 and len(joint.outputs) == 2 + 3
    rng = np.random.default_rng(1)
    xs = [rng.uniform(-1, 1, s.shape) for s in inputs]
    xs[0] = (rng.permutation(12).reshape(3, 4) - 6) * 0.15 + rng.uniform(0, 0.01, (3, 4))  # no max ties
    cv = [rng.standard_normal(o.shape) for o in outs]
    prog = hl.compile(joint.outputs, inputs=joint.inputs)
    res = [r.asnumpy() for r in prog(*xs, *cv)]
    fwd = hl.compile(outs, inputs=inputs, passes=[])

    def loss(*v):
        ys = [r.asnumpy() for r in fwd(*v)]
        return sum(float(np.sum(c * y)) for c, y in zip(cv, ys))
    for i in range(3):
        assert res[2 + i].shape == xs[i].shape and res[2 + i].dtype == np.float64
        np.testing.assert_allclose(res[2 + i], _fd_grad(loss, xs, i), rtol=1e-5, atol=1e-7)
    # the forward half of the joint program equals the forward program
    for r, y in zip(res[:2], fwd(*xs)):
        np.testing.assert_allclose(r, y.asnumpy(), rtol=1e-12)
    # and the same gradient as eager autograd
    arrs = [nd.array(v) for v in xs]
    for a in arrs:
        a.attach_grad()
    with hl.autograd.record():
        x, w, b = arrs
        h = nd.tanh(nd.matmul(x, w) + b)
        y1 = nd.sum(h * h, axis=1) + nd.mean(nd.exp(x * 0.5), axis=1) * 2.0
        y2 = nd.sigmoid(nd.transpose(h)) * nd.reshape(b, (2, 1)) + nd.max(x, axis=1)
        L = nd.sum(y1 * nd.array(cv[0])) + nd.sum(y2 * nd.array(cv[1]))
    L.backward()
    for a, r in zip(arrs, res[2:]):
        np.testing.assert_allclose(a.grad.asnumpy(), r, rtol=1e-10, atol=1e-12)


def test_gradient_wrt_subset_unused_input_and_int_output():
    x = hl.sym.var("x", shape=(3,), dtype="float64")
    y = hl.sym.var("y", shape=(3,), dtype="float64")
    z = hl.sym.var("z", shape=(3,), dtype="float64")     # unused: zero gradient
    outs = [nd.sum(nd.sin(x) * y), nd.argmax(x)]
    joint, cots, wrt = hl.graph.gradient(hl.graph.Graph([x, y, z], outs), wrt=[0, 2])
    assert cots[1] is None and wrt == [0, 2]
    prog = hl.compile(joint.outputs, inputs=joint.inputs)
    xv, yv = np.array([0.1, 0.5, -0.3]), np.array([1.0, 2.0, 3.0])
    res = prog(xv, yv, np.zeros(3), np.float64(1.5))
    np.testing.assert_allclose(res[2].asnumpy(), 1.5 * np.cos(xv) * yv, rtol=1e-12)
    np.testing.assert_array_equal(res[3].asnumpy(), np.zeros(3))


def test_split_forward_backward_matches_joint():
    inputs, outs = _graph_fn()
    joint, cots, wrt = hl.graph.gradient(hl.graph.Graph(inputs, outs))
    fwd, bwd, res_spec = hl.graph.split_forward_backward(joint, 3, 2)
    assert len(fwd.inputs) == 3 and len(fwd.outputs) >= 2
    assert len(bwd.outputs) == 3
    # the backward graph reads no primal input node directly (only residuals + cotangents)
    prim_ids = {s.node.id for s in inputs}
    assert not any(s.node.id in prim_ids for n in bwd.nodes for s in n.inputs)
    rng = np.random.default_rng(2)
    xs = [rng.uniform(-1, 1, s.shape) for s in inputs]
    cv = [rng.standard_normal(o.shape) for o in outs]
    pf = hl.compile(fwd.outputs, inputs=fwd.inputs)
    pb = hl.compile(bwd.outputs, inputs=bwd.inputs)
    fo = [r.asnumpy() for r in pf(*xs)]
    resid = [xs[i] if kind == "input" else fo[i] for kind, i in res_spec]
    grads = [r.asnumpy() for r in pb(*resid, *cv)]
    full = [r.asnumpy() for r in hl.compile(joint.outputs, inputs=joint.inputs)(*xs, *cv)]
    for a, b in zip(grads, full[2:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(fo[:2], full[:2]):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_symbolic_batch_norm_in_training_needs_parameter_statistics():
    """It raised 'assignment to a traced value that is not a parameter': now it says which
    values, why, and the way out; training=False compiles and matches NumPy."""
    x, g, b, m, v = (hl.sym.var(n, shape=s) for n, s in
                     [("x", (4, 3)), ("g", (3,)), ("b", (3,)), ("m", (3,)), ("v", (3,))])
    with pytest.raises(hl.TracingError, match=r"batch_norm\(training=True\) updates running_mean "
                       r"and running_var in place.*Pass training=False"):
        hl.sym.batch_norm(x, g, b, m, v, training=True)
    f = hl.compile(hl.sym.batch_norm(x, g, b, m, v, training=False))
    rng = np.random.default_rng(0)
    xs, gs, bs, ms = (rng.standard_normal(s).astype(np.float32) for s in [(4, 3), 3, 3, 3])
    vs = rng.uniform(0.5, 2, 3).astype(np.float32)
    out = f(x=xs, g=gs, b=bs, m=ms, v=vs)
    want = (xs - ms) / np.sqrt(vs + 1e-5) * gs + bs
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6)
