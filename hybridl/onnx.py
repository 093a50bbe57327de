"""``hl.onnx``: export a HybridBlock to an ONNX model (needs the ``[onnx]`` extra: ``onnx``).

    import hybridl as hl
    net = hl.models.lenet(); net.initialize()
    hl.onnx.export(net, hl.nd.zeros((1, 1, 28, 28)), "lenet.onnx")      # opset 17
    # onnxruntime.InferenceSession("lenet.onnx").run(None, {"data0": x})

The block is traced in predict mode (DESIGN §4) at the shapes of ``sample_input``, the same
export passes as :func:`hybridl.graph.export.export` run (constant folding, algebraic
simplification, CSE, dead-code elimination), and every node of the resulting graph is mapped to
ONNX operators (https://onnx.ai/onnx/operators/). Parameters and constants become initializers.
Shapes are static: the model runs at exactly the exported input shapes (reshape targets are
baked in, as in the hybridl graph). Inputs are named ``data0, data1, ...``, outputs ``output0,
output1, ...``; initializers keep the parameter names (``0.weight``, ...).

Supported hybridl ops: see :data:`SUPPORTED_OPS` (``supported_ops()``). The main mappings:
fully_connected -> Gemm(transB=1) (Flatten first for >2-D data; MatMul + Add for
flatten=False on >2-D data), conv2d -> Conv, max/avg_pool2d -> MaxPool / AveragePool
(count_include_pad), batch_norm_infer -> BatchNormalization (axis 1; other axes are decomposed),
mean/max/min/prod -> Reduce* (axes an attribute below opset 18, an input from 18), sum ->
ReduceSum (axes an input), softmax/log_softmax -> Softmax/LogSoftmax, reshape -> Reshape with a
constant shape, slice -> Slice/Squeeze/Unsqueeze, binary ops -> Add/Sub/Mul/Div/... with ONNX
(NumPy) broadcasting (on bool tensors add/maximum -> Or, multiply/minimum -> And, NumPy's
meaning; ONNX's arithmetic takes no bool). Where hybridl promotes dtypes (int / int -> float32, mixed inputs), Cast
nodes make the ONNX types match hybridl's.
"""
import numbers
import os

import numpy as np

__all__ = ["export", "supported_ops", "SUPPORTED_OPS", "MIN_OPSET"]

MIN_OPSET = 13          # Softmax over one axis, ReduceSum with axes as an input, Clip with inputs


def _onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("hl.onnx needs the 'onnx' package: pip install -e \".[onnx]\" in a "
                          "source checkout (or pip install onnx onnxruntime)") from None
    return onnx


# ============================================================================ conversion context


class _Ctx:
    """Collects ONNX nodes and initializers while the hybridl graph is walked in order."""

    def __init__(self, onnx, opset):
        self.onnx = onnx
        self.h = onnx.helper
        self.opset = opset
        self.nodes = []
        self.inits = []
        self._n = 0
        self._names = set()
        self.used = set()

    def fresh(self, base):
        self._n += 1
        name = f"{base}__{self._n}"
        while name in self._names:
            self._n += 1
            name = f"{base}__{self._n}"
        self._names.add(name)
        return name

    def node(self, op_type, inputs, outputs=None, base=None, **attrs):
        """Append one ONNX node; returns its output names (a fresh one if ``outputs`` is None)."""
        if outputs is None:
            outputs = [self.fresh(base or op_type)]
        self.nodes.append(self.h.make_node(op_type, list(inputs), list(outputs),
                                           name=self.fresh(f"n_{op_type}"), **attrs))
        return outputs

    def one(self, op_type, inputs, out=None, **attrs):
        return self.node(op_type, inputs, None if out is None else [out], **attrs)[0]

    def const(self, value, base="const"):
        """An initializer holding ``value``; returns its name."""
        from onnx import numpy_helper
        name = self.fresh(base)
        a = np.asarray(value)                   # (ascontiguousarray makes a 0-d array 1-d)
        self.inits.append(numpy_helper.from_array(a if a.flags.c_contiguous else a.copy(order="C"), name))
        return name

    def i64(self, values, base="shape"):
        return self.const(np.asarray(values, dtype=np.int64).reshape(-1), base)

    def cast(self, name, have, want):
        """``name`` cast from dtype ``have`` to ``want`` (no node when equal)."""
        have, want = np.dtype(have), np.dtype(want)
        if have == want:
            return name
        return self.one("Cast", [name], to=_tdtype(want))


def _np_helper():
    from onnx import numpy_helper
    return numpy_helper


def _tdtype(dt):
    from onnx import helper
    return helper.np_dtype_to_tensor_dtype(np.dtype(dt))


# ============================================================================ op converters
# Each converter: fn(ctx, node, ins, outs) where ins are the ONNX names of node.inputs and outs
# the names its outputs must get; node.inputs[i].dtype / .shape and node.specs give types.


def _in_dt(node, i):
    return node.inputs[i].dtype


def _out_dt(node, i=0):
    return node.specs[i][1]


def _cast_ins(c, node, ins, dt):
    return [c.cast(n, _in_dt(node, i), dt) for i, n in enumerate(ins)]


def _unary(op_type):
    def conv(c, node, ins, outs):
        x = c.cast(ins[0], _in_dt(node, 0), _out_dt(node))
        c.node(op_type, [x], outs)
    return conv


def _binary(op_type, bool_op=None):
    """ONNX ``op_type`` in the output dtype; on bool outputs ``bool_op`` (ONNX's Add, Mul,
    Max and Min take no bool tensors; NumPy's bool ``+``/``max`` is a logical or, ``*``/``min``
    a logical and)."""
    def conv(c, node, ins, outs):
        dt = _out_dt(node)
        op = bool_op if bool_op is not None and dt == np.bool_ else op_type
        c.node(op, _cast_ins(c, node, ins, dt), outs)
    return conv


def _conv_power(c, node, ins, outs):
    """``Pow`` in the output dtype; on bools (ONNX's Pow takes none) ``a ** b`` is 0 only for
    ``0 ** 1``, i.e. ``a or not b``."""
    dt = _out_dt(node)
    xs = _cast_ins(c, node, ins, dt)
    if dt == np.bool_:
        c.node("Or", [xs[0], c.one("Not", [xs[1]])], outs)
    else:
        c.node("Pow", xs, outs)


def _compare(op_type, negate=False):
    def conv(c, node, ins, outs):
        # NumPy's promotion, as the kernels compare: int32/int64 against float32 in float64
        # (in float32, 16777217 > 16777216.0 is False: hybridl's arithmetic promotion would
        # round the int)
        xs = _cast_ins(c, node, ins, np.promote_types(_in_dt(node, 0), _in_dt(node, 1)))
        if negate:
            c.node("Not", [c.one(op_type, xs)], outs)
        else:
            c.node(op_type, xs, outs)
    return conv


def _logical(op_type):
    def conv(c, node, ins, outs):
        c.node(op_type, _cast_ins(c, node, ins, np.bool_), outs)
    return conv


def _conv_square(c, node, ins, outs):
    x = c.cast(ins[0], _in_dt(node, 0), _out_dt(node))
    c.node("Mul", [x, x], outs)


def _conv_log1p(c, node, ins, outs):
    dt = _out_dt(node)
    x = c.cast(ins[0], _in_dt(node, 0), dt)
    c.node("Log", [c.one("Add", [x, c.const(np.asarray(1, dt))])], outs)


def _conv_expm1(c, node, ins, outs):
    dt = _out_dt(node)
    x = c.cast(ins[0], _in_dt(node, 0), dt)
    c.node("Sub", [c.one("Exp", [x]), c.const(np.asarray(1, dt))], outs)


def _conv_where(c, node, ins, outs):
    dt = _out_dt(node)
    cond = c.cast(ins[0], _in_dt(node, 0), np.bool_)
    c.node("Where", [cond, c.cast(ins[1], _in_dt(node, 1), dt), c.cast(ins[2], _in_dt(node, 2), dt)],
           outs)


def _conv_clip(c, node, ins, outs):
    dt = _out_dt(node)
    lo, hi = node.attrs.get("a_min"), node.attrs.get("a_max")
    if np.dtype(dt).kind in "iub":      # hybridl's integer bounds: ceil / floor, in range
        from .ops.math import int_clip_bounds
        lo, hi = int_clip_bounds(dt, lo, hi)
    args = [ins[0], "" if lo is None else c.const(np.asarray(lo, dt), "clip_min"),
            "" if hi is None else c.const(np.asarray(hi, dt), "clip_max")]
    while args[-1] == "":
        args.pop()
    c.node("Clip", args, outs)


def _conv_cast(c, node, ins, outs):
    c.node("Cast", ins, outs, to=_tdtype(node.attrs["dtype"]))


def _conv_emb_indices(c, node, ins, outs):
    # float embedding indices: clipped to [-1, rows] as floats, then truncated to int64 (a NaN
    # index, an error in hybridl, is whatever the runtime's Cast makes of it)
    dt = node.inputs[0].dtype
    tmp = c.fresh("emb_idx")
    c.node("Clip", [ins[0], c.const(np.asarray(-1, dt), "clip_min"),
                    c.const(np.asarray(node.attrs["rows"], dt), "clip_max")], [tmp])
    c.node("Cast", [tmp], outs, to=_tdtype("int64"))


def _conv_identity(c, node, ins, outs):
    c.node("Identity", ins, outs)


def _conv_fc(c, node, ins, outs):
    x_sym = node.inputs[0]
    dt = _out_dt(node)
    xs = _cast_ins(c, node, ins, dt)
    x, w, b = xs[0], xs[1], (xs[2] if len(xs) > 2 else None)
    flatten = node.attrs.get("flatten", True)
    if node.attrs.get("act") == "relu":         # fused activation: FC into a temp, then Relu
        tmp = [c.fresh("fc")]
        _conv_fc_plain(c, node, x_sym, dt, x, w, b, flatten, tmp)
        c.node("Relu", tmp, outs)
        return
    _conv_fc_plain(c, node, x_sym, dt, x, w, b, flatten, outs)


def _conv_fc_plain(c, node, x_sym, dt, x, w, b, flatten, outs):
    if flatten and len(x_sym.shape) != 2:
        x = c.one("Flatten", [x], axis=1)
    if flatten or len(x_sym.shape) == 2:
        # Gemm: Y = X @ W^T + b (transB=1), the layout of hybridl's (units, in_units) weight
        c.node("Gemm", [x, w] + ([b] if b is not None else []), outs, transB=1)
        return
    wt = c.one("Transpose", [w], perm=[1, 0])
    if b is None:
        c.node("MatMul", [x, wt], outs)
    else:
        c.node("Add", [c.one("MatMul", [x, wt]), b], outs)


def _conv_matmul(c, node, ins, outs):
    xs = _cast_ins(c, node, ins, _out_dt(node))
    ra, rb = len(node.inputs[0].shape), len(node.inputs[1].shape)
    if ra >= 2 and rb == 1:
        # (..., m, k) @ (k,) as (..., m, k) @ (k, 1), then drop the 1: onnxruntime 1.32's
        # optimized graph computes Transpose -> MatMul(2-D, 1-D) wrongly (off by ~1 for a
        # (3, 4) @ (4,) product; right with its optimizations off)
        col = c.one("Unsqueeze", [xs[1], c.const(np.asarray([1], np.int64))])
        c.node("Squeeze", [c.one("MatMul", [xs[0], col]), c.const(np.asarray([-1], np.int64))],
               outs)
        return
    c.node("MatMul", xs, outs)


def _conv_conv2d(c, node, ins, outs):
    a = node.attrs
    ph, pw = a["padding"]
    kh, kw = node.inputs[1].shape[2:]
    relu = a.get("act") == "relu"               # fused activation: Conv into a temp, then Relu
    conv_outs = [c.fresh("conv")] if relu else outs
    c.node("Conv", ins, conv_outs, kernel_shape=[int(kh), int(kw)], strides=list(a["stride"]),
           pads=[ph, pw, ph, pw], dilations=list(a["dilation"]), group=int(a["groups"]))
    if relu:
        c.node("Relu", conv_outs, outs)


def _pool_attrs(a):
    ph, pw = a["padding"]
    return dict(kernel_shape=list(a["kernel"]), strides=list(a["stride"]), pads=[ph, pw, ph, pw])


def _conv_maxpool(c, node, ins, outs):
    c.node("MaxPool", ins, outs, **_pool_attrs(node.attrs))


def _conv_avgpool(c, node, ins, outs):
    c.node("AveragePool", ins, outs, count_include_pad=int(bool(node.attrs["count_include_pad"])),
           **_pool_attrs(node.attrs))


# reductions: (ONNX op, opset from which ``axes`` is an input instead of an attribute)
_REDUCE = {"sum": ("ReduceSum", 13), "mean": ("ReduceMean", 18), "max": ("ReduceMax", 18),
           "min": ("ReduceMin", 18), "prod": ("ReduceProd", 18)}


def _reduce(name):
    op_type, axes_input_from = _REDUCE[name]

    def conv(c, node, ins, outs):
        axes = [int(a) for a in node.attrs["axis"]]
        keep = int(bool(node.attrs["keepdims"]))
        x = c.cast(ins[0], _in_dt(node, 0), _out_dt(node))
        if not axes:                    # NumPy: axis=() reduces nothing
            c.node("Identity", [x], outs)
        elif c.opset >= axes_input_from:
            c.node(op_type, [x, c.i64(axes, "axes")], outs, keepdims=keep)
        else:
            c.node(op_type, [x], outs, axes=axes, keepdims=keep)
    return conv


def _arg(op_type):
    def conv(c, node, ins, outs):
        c.node(op_type, ins, outs, axis=int(node.attrs["axis"][0]),
               keepdims=int(bool(node.attrs["keepdims"])))
    return conv


def _conv_bn(c, node, ins, outs):
    x_sym = node.inputs[0]
    axis, eps = int(node.attrs["axis"]), float(node.attrs["eps"])
    dt = _out_dt(node)
    ps = [c.cast(n, _in_dt(node, i + 1), dt) for i, n in enumerate(ins[1:])]
    if axis == 1 and len(x_sym.shape) >= 2:
        c.node("BatchNormalization", [ins[0]] + ps, outs, epsilon=eps)
        return
    # channels elsewhere: y = (x - mean) * gamma / sqrt(var + eps) + beta, per-channel broadcast
    bshape = [1] * len(x_sym.shape)
    bshape[axis] = x_sym.shape[axis]
    shp = c.i64(bshape)
    gamma, beta, rm, rv = (c.one("Reshape", [p, shp]) for p in ps)
    inv = c.one("Div", [gamma, c.one("Sqrt", [c.one("Add", [rv, c.const(np.asarray(eps, dt))])])])
    c.node("Add", [c.one("Mul", [c.one("Sub", [ins[0], rm]), inv]), beta], outs)


def _conv_reshape(c, node, ins, outs):
    shape = [int(d) for d in node.attrs["shape"]]
    # a 0 in the target shape means "copy the input's dimension" in ONNX unless allowzero
    # (opset 14+); hybridl's shape is literal
    kw = {"allowzero": 1} if 0 in shape else {}
    if kw and c.opset < 14:
        raise ValueError(f"onnx.export: a reshape to {tuple(shape)} (a zero-size dimension) "
                         f"needs opset >= 14 (Reshape's allowzero), got opset {c.opset}")
    c.node("Reshape", [ins[0], c.i64(shape)], outs, **kw)


def _conv_transpose(c, node, ins, outs):
    c.node("Transpose", ins, outs, perm=[int(a) for a in node.attrs["axes"]])


def _conv_broadcast_to(c, node, ins, outs):
    c.node("Expand", [ins[0], c.i64(node.attrs["shape"])], outs)


def _conv_concat(c, node, ins, outs):
    c.node("Concat", _cast_ins(c, node, ins, _out_dt(node)), outs, axis=int(node.attrs["axis"]))


def _softmax(op_type):
    def conv(c, node, ins, outs):
        c.node(op_type, ins, outs, axis=int(node.attrs["axis"]))
    return conv


_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _conv_slice(c, node, ins, outs):
    """Basic indexing (ints, slices, None, Ellipsis) as Slice + Squeeze + Unsqueeze."""
    from .ops.math import decode_key
    key = list(decode_key(node.attrs["key"]))
    shape = node.inputs[0].shape
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key[i:i + 1] = [slice(None)] * (len(shape) - n_real)
    else:
        key += [slice(None)] * (len(shape) - n_real)
    starts, ends, axes, steps, squeeze, new_axes = [], [], [], [], [], []
    dim, out_dim = 0, 0
    for k in key:
        if k is None:
            new_axes.append(out_dim)
            out_dim += 1
            continue
        n = shape[dim]
        if isinstance(k, slice):
            s, e, st = k.indices(n)
            if (s, e, st) != (0, n, 1):
                if st < 0 and e < 0:
                    e = _INT64_MIN          # "through index 0" for a negative step
                starts.append(s), ends.append(e), axes.append(dim), steps.append(st)
            out_dim += 1
        else:
            i = int(k) + (n if int(k) < 0 else 0)
            starts.append(i), ends.append(i + 1), axes.append(dim), steps.append(1)
            squeeze.append(dim)
        dim += 1
    x = ins[0]
    if starts:
        x = c.one("Slice", [x, c.i64(starts, "starts"), c.i64(ends, "ends"), c.i64(axes, "axes"),
                            c.i64(steps, "steps")])
    if squeeze:
        x = c.one("Squeeze", [x, c.i64(squeeze, "axes")])
    if new_axes:
        x = c.one("Unsqueeze", [x, c.i64(new_axes, "axes")])
    c.node("Identity", [x], outs)


def _conv_layer_norm(c, node, ins, outs):
    # hybridl's layer_norm: over the last axis, outputs (y, mean, biased var) with the last axis
    # dropped; ONNX's Mean / InvStdDev keep it as 1, so the statistics are computed separately
    # (only when the graph reads them)
    xs = _cast_ins(c, node, ins, _out_dt(node))
    c.node("LayerNormalization", xs, outs[:1], axis=-1, epsilon=float(node.attrs["eps"]))
    if (node.id, 1) in c.used or (node.id, 2) in c.used:
        ax = c.i64([-1], "axes")
        if c.opset >= 18:
            m = c.one("ReduceMean", [xs[0], ax], keepdims=1)
        else:
            m = c.one("ReduceMean", [xs[0]], axes=[-1], keepdims=1)
        c.node("Squeeze", [m, ax], [outs[1]])
        d = c.one("Sub", [xs[0], m])
        sq = c.one("Mul", [d, d])
        if c.opset >= 18:
            c.node("ReduceMean", [sq, ax], [outs[2]], keepdims=0)
        else:
            c.node("ReduceMean", [sq], [outs[2]], axes=[-1], keepdims=0)


def _conv_take(c, node, ins, outs):
    axis, mode = int(node.attrs["axis"]), node.attrs["mode"]
    n = int(node.inputs[0].shape[axis])
    idx = c.cast(ins[1], _in_dt(node, 1), np.int64)
    if mode == "clip":          # NumPy's clip mode: negatives go to 0, too-large to n - 1
        idx = c.one("Clip", [idx, c.const(np.asarray(0, np.int64)),
                             c.const(np.asarray(max(n - 1, 0), np.int64))])
    else:                       # 'wrap' (and 'raise', which hybridl evaluates as wrap)
        idx = c.one("Mod", [idx, c.const(np.asarray(n, np.int64))], fmod=0)
    c.node("Gather", [ins[0], idx], outs, axis=axis)


def _conv_one_hot(c, node, ins, outs):
    # out[..., k] = (idx == k); out-of-range and negative indices give all zeros, as in hybridl
    depth = int(node.attrs["depth"])
    idx = c.cast(ins[0], _in_dt(node, 0), np.int64)
    idx = c.one("Unsqueeze", [idx, c.i64([-1], "axes")])
    eq = c.one("Equal", [idx, c.const(np.arange(depth, dtype=np.int64), "range")])
    c.node("Cast", [eq], outs, to=_tdtype(node.attrs["dtype"]))


def _fill_like(v):
    def conv(c, node, ins, outs):
        shape, dt = node.specs[0]
        c.node("ConstantOfShape", [c.i64(list(shape))], outs,
               value=_np_helper().from_array(np.full((1,), v, dt)))
    return conv


def _conv_sum_to(c, node, ins, outs):
    from .ops.math import _sum_to_axes
    src, dst = node.inputs[0].shape, node.specs[0][0]
    axes = list(_sum_to_axes(src, dst))
    x = c.one("ReduceSum", [ins[0], c.i64(axes, "axes")], keepdims=1) if axes else ins[0]
    c.node("Reshape", [x, c.i64(list(dst))], outs)


def _conv_split(c, node, ins, outs):
    axis = int(node.attrs["axis"])
    for (lo, hi), o in zip(node.attrs["bounds"], outs):
        c.node("Slice", [ins[0], c.i64([lo], "starts"), c.i64([hi], "ends"), c.i64([axis], "axes")],
               [o])


_CONVERTERS = {
    "fully_connected": _conv_fc, "matmul": _conv_matmul,
    "conv2d": _conv_conv2d, "max_pool2d": _conv_maxpool, "avg_pool2d": _conv_avgpool,
    "batch_norm_infer": _conv_bn,
    "relu": _unary("Relu"), "sigmoid": _unary("Sigmoid"), "tanh": _unary("Tanh"),
    "softplus": _unary("Softplus"), "exp": _unary("Exp"), "log": _unary("Log"),
    "sqrt": _unary("Sqrt"), "abs": _unary("Abs"), "negative": _unary("Neg"),
    "sin": _unary("Sin"), "cos": _unary("Cos"), "reciprocal": _unary("Reciprocal"),
    "floor": _unary("Floor"), "sign": _unary("Sign"), "square": _conv_square,
    "log1p": _conv_log1p, "expm1": _conv_expm1, "logical_not": _unary("Not"),
    "add": _binary("Add", "Or"), "subtract": _binary("Sub"), "multiply": _binary("Mul", "And"),
    "divide": _binary("Div"), "power": _conv_power, "maximum": _binary("Max", "Or"),
    "minimum": _binary("Min", "And"),
    "equal": _compare("Equal"), "not_equal": _compare("Equal", negate=True),
    "greater": _compare("Greater"), "greater_equal": _compare("GreaterOrEqual"),
    "less": _compare("Less"), "less_equal": _compare("LessOrEqual"),
    "logical_and": _logical("And"), "logical_or": _logical("Or"), "logical_xor": _logical("Xor"),
    "where": _conv_where, "clip": _conv_clip, "cast": _conv_cast,
    "embedding_indices": _conv_emb_indices,
    "sum": _reduce("sum"), "mean": _reduce("mean"), "max": _reduce("max"), "min": _reduce("min"),
    "prod": _reduce("prod"), "argmax": _arg("ArgMax"), "argmin": _arg("ArgMin"),
    "reshape": _conv_reshape, "transpose": _conv_transpose, "broadcast_to": _conv_broadcast_to,
    "concat": _conv_concat, "slice": _conv_slice, "split": _conv_split, "sum_to": _conv_sum_to,
    "take": _conv_take, "one_hot": _conv_one_hot,
    "zeros_like": _fill_like(0), "ones_like": _fill_like(1),
    "identity": _conv_identity, "stop_gradient": _conv_identity,
    "softmax": _softmax("Softmax"), "log_softmax": _softmax("LogSoftmax"),
    "layer_norm": _conv_layer_norm,
}
_MIN_OPSET_OF = {"layer_norm": 17}     # LayerNormalization; the others exist from opset 13

SUPPORTED_OPS = tuple(sorted(_CONVERTERS))


def supported_ops():
    """The hybridl op names (``hybridl.ops.registry.OPS`` keys) that :func:`export` converts
    (``split`` stands for every ``split<k>``)."""
    return SUPPORTED_OPS


def _converter(name):
    conv = _CONVERTERS.get(name)
    if conv is None and name.startswith("split") and name[5:].isdigit():
        conv = _CONVERTERS["split"]
    return conv


# ============================================================================ export


def _check_args(net, sample_input, path, opset):
    from .nn.block import HybridBlock
    from .ndarray import NDArray
    from . import nd
    if not isinstance(net, HybridBlock):
        raise TypeError(f"net: expected a HybridBlock (e.g. hl.models.mlp()), got "
                        f"{type(net).__name__}")
    if isinstance(opset, bool) or not isinstance(opset, numbers.Integral):
        raise TypeError(f"opset: expected an int >= {MIN_OPSET}, got {opset!r}")
    onnx = _onnx()
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= int(opset) <= newest:
        raise ValueError(f"opset: expected {MIN_OPSET} <= opset <= {newest} (the newest the "
                         f"installed onnx {onnx.__version__} knows), got {opset}")
    items = list(sample_input) if isinstance(sample_input, (tuple, list)) else [sample_input]
    if not items:
        raise ValueError("sample_input: expected an NDArray, a NumPy array or a tuple of them, "
                         "got an empty sequence")
    args = []
    for i, a in enumerate(items):
        if isinstance(a, NDArray):
            args.append(a)
        elif isinstance(a, np.ndarray):
            args.append(nd.array(a))
        else:
            where = "sample_input" if len(items) == 1 else f"sample_input[{i}]"
            raise TypeError(f"{where}: expected an NDArray or a NumPy array, got "
                            f"{type(a).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path (str or os.PathLike), got "
                        f"{type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    d = os.path.dirname(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory; give a file name such as "
                                f"'model.onnx'")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"path: directory {d!r} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise PermissionError(f"path: directory {d!r} is not writable")
    return args, path, onnx


def _trace(net, args):
    from . import autograd
    from .graph.export import _EXPORT_PASSES
    from .graph.hybrid import trace_graph
    from .graph.ir import Graph
    from .graph.passes import run_passes
    with autograd.predict_mode():
        inputs, outs, single, ctx = trace_graph(net.forward, args)
    from .graph.export import _flat_outputs_only
    _flat_outputs_only(ctx, "hl.onnx.export")
    g = run_passes(Graph(inputs, outs), _EXPORT_PASSES)
    pvals = {s.node.id: p for p, s in zip(ctx.params, inputs[len(args):])}
    return g, inputs[:len(args)], pvals


def _value_info(h, name, shape, dt):
    return h.make_tensor_value_info(name, _tdtype(dt), [int(s) for s in shape])


def _build_model(g, data_inputs, pvals, opset, onnx, graph_name):
    from onnx import numpy_helper
    h = onnx.helper
    c = _Ctx(onnx, opset)
    names = {}                      # (node id, output index) -> ONNX value name
    inputs_vi = []
    for i, s in enumerate(data_inputs):
        names[s.key()] = f"data{i}"
        c._names.add(f"data{i}")
        inputs_vi.append(_value_info(h, f"data{i}", s.shape, s.dtype))
    # outputs get their final names up front; a value returned twice (or a leaf) gets Identity
    out_names, out_alias = {}, []
    for i, s in enumerate(g.outputs):
        nm = f"output{i}"
        c._names.add(nm)
        if s.key() in out_names or s.node.kind != "op":
            out_alias.append((s, nm))
        else:
            out_names[s.key()] = nm
    used = set()
    for n in g.nodes:
        for s in n.inputs:
            used.add(s.key())
    for s in g.outputs:
        used.add(s.key())
    c.used = used
    value_info = []
    for n in g.nodes:
        key = (n.id, 0)
        if n.kind == "input":
            if key not in names:
                raise ValueError(f"internal: graph input {n.name!r} is not a data input")
            continue
        if n.kind == "param":
            if key not in used:
                continue
            p = pvals[n.id]
            nm = n.name if n.name not in c._names else c.fresh(n.name)
            c._names.add(nm)
            arr = np.array(p.data().asnumpy(), order="C").astype(n.specs[0][1], copy=False)
            c.inits.append(numpy_helper.from_array(arr, nm))
            names[key] = nm
            continue
        if n.kind == "const":
            if key not in used:
                continue
            arr = np.asarray(n.value).astype(n.specs[0][1], copy=False).reshape(n.specs[0][0])
            names[key] = c.const(arr, f"const{n.id}")
            continue
        conv = _converter(n.op.name)
        if conv is None:
            raise NotImplementedError(
                f"hl.onnx.export: op {n.op.name!r} (graph node %{n.id}) has no ONNX conversion; "
                f"supported ops: {', '.join(SUPPORTED_OPS)}")
        need = _MIN_OPSET_OF.get(n.op.name, MIN_OPSET)
        if opset < need:
            raise NotImplementedError(f"hl.onnx.export: op {n.op.name!r} needs opset >= {need}, "
                                      f"got opset={opset}")
        ins = [names[s.key()] for s in n.inputs]
        outs = []
        for j, (shape, dt) in enumerate(n.specs):
            k = (n.id, j)
            nm = out_names.get(k) or c.fresh(f"{n.op.name}{n.id}" + (f"_{j}" if j else ""))
            names[k] = nm
            outs.append(nm)
            if k not in out_names:
                value_info.append(_value_info(h, nm, shape, dt))
        conv(c, n, ins, outs)
    produced = {o for nd_ in c.nodes for o in nd_.output}
    value_info = [v for v in value_info if v.name in produced]
    for s, nm in out_alias:
        c.node("Identity", [names[s.key()]], [nm])
    outputs_vi = [_value_info(h, f"output{i}", s.shape, s.dtype) for i, s in enumerate(g.outputs)]
    graph = h.make_graph(c.nodes, graph_name, inputs_vi, outputs_vi, initializer=c.inits,
                         value_info=value_info)
    opsets = [h.make_opsetid("", opset)]
    model = h.make_model(graph, opset_imports=opsets, producer_name="hybridl",
                         ir_version=h.find_min_ir_version_for(opsets))
    return model


def export(net, sample_input, path, opset=17):
    """Export ``net`` as an ONNX model file at ``path``; returns ``path`` (absolute, str).

    The block is traced in predict mode (BatchNorm uses its running statistics, dropout is the
    identity) at the shapes and dtypes of ``sample_input`` and the model has exactly those input
    shapes. Inputs are named ``data0, ...``, outputs ``output0, ...``.

    Args:
        net: an initialized HybridBlock (hybridized or not).
        sample_input: an NDArray or NumPy array (N, ...) — or a tuple/list of them for a block
            with several inputs. Only its shape and dtype are used.
        path: the file to write (str or os.PathLike). Written to a temporary file in the same
            directory, checked, then renamed, so ``path`` is either the old file or the
            complete new one.
        opset: the ONNX opset (default 17, >= 13). From 18 on, ReduceMean/Max/Min/Prod take
            their axes as an input (ReduceSum does from 13).

    Returns:
        str: the absolute path written.

    Raises:
        TypeError: ``net`` is not a HybridBlock, ``sample_input`` is not arrays, ``opset`` not
            an int, ``path`` not a path.
        ValueError: ``opset`` < 13 or newer than the installed onnx knows.
        FileNotFoundError / PermissionError / IsADirectoryError: ``path``'s directory is
            missing or not writable, or ``path`` is a directory.
        NotImplementedError: the traced graph has an op without an ONNX conversion (the message
            names it and lists :data:`SUPPORTED_OPS`).
        RuntimeError: parameters not initialized (from the trace).
        onnx.checker.ValidationError: the produced model fails ``onnx.checker.check_model``
            (onnx's shape inference also refuses some integer and bool uses of float ops,
            e.g. ``floor`` of an int array or ``max`` over bools: cast them first).
        ImportError: the ``onnx`` package is missing.

    Models of 2 GB and more (the protobuf limit) are not supported (no external data).

    Where onnxruntime differs from hybridl (NumPy) on edge cases, the exported model does too:

    - NaN: hybridl's ``max``/``min``/``argmax``/``argmin`` reductions and ``max_pool2d``
      follow NumPy (a NaN wins); onnxruntime's ReduceMax/ReduceMin/ArgMax/MaxPool skip NaN.
      Elementwise ops agree.
    - ``mean`` over a zero-size axis: NaN in hybridl, 0 in onnxruntime.
    - integer overflow (``power`` of int32): hybridl wraps around as NumPy does; onnxruntime's
      result differs.
    - ``relu`` of an integer array exports, but onnxruntime (1.2x) has no integer Relu kernel
      and refuses to load the model: cast to float first.
    - ``x ** 0.5`` (Pow): ``(-inf) ** 0.5`` is NaN and ``(-0.) ** 0.5`` is ``-0.`` in hybridl
      (NumPy's ``sqrt`` rules); onnxruntime gives ``inf`` and ``+0.``.
    """
    args, path, onnx = _check_args(net, sample_input, path, opset)
    g, data_inputs, pvals = _trace(net, args)
    model = _build_model(g, data_inputs, pvals, int(opset), onnx, type(net).__name__)
    data = model.SerializeToString()
    onnx.checker.check_model(data, full_check=True)
    from ._io import atomic_write

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
    try:                        # (the common writer: a link's target replaced, mode kept)
        atomic_write(path, write)
    except OSError as e:
        raise type(e)(e.errno, f"path: cannot write {path!r} ({e.strerror or e})") from e
    return path
