"""Neural-network operators: softmax family, convolution, pooling, normalization, dropout,
embedding. Kernels live in :mod:`hybridl.kernels` (im2col/GEMM convolution, strided pooling);
gradients are ops too, so a backward pass is asynchronous and traceable.
"""
import numpy as np

from .. import autograd as _ag
from .. import kernels as K
from ..kernels._check import check_int, pair
from . import _blas
from ._util import check_float, norm_axis, numel
from .dispatch import apply
from .math import add, cast, exp, multiply, relu_grad, subtract, sum, take, take_grad
from .registry import register

# ============================================================================ softmax family


def _sm_infer(x, axis):
    check_float("softmax", x)
    return [(x.shape, x.dtype)]


def _g_softmax(c, g):
    y = c.outputs[0]
    ax = c.attrs["axis"]
    return (multiply(y, subtract(g, sum(multiply(g, y), axis=ax, keepdims=True))),)


def _g_log_softmax(c, g):
    y = c.outputs[0]
    ax = c.attrs["axis"]
    return (subtract(g, multiply(exp(y), sum(g, axis=ax, keepdims=True))),)


SOFTMAX = register("softmax", lambda x, axis, out=None: K.softmax(x, axis, out=out), _sm_infer, _g_softmax)
LOG_SOFTMAX = register("log_softmax", lambda x, axis, out=None: K.log_softmax(x, axis, out=out), _sm_infer,
                       _g_log_softmax)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x), axis), computed stably (max subtracted). Same shape as x."""
    return apply(SOFTMAX, x, axis=norm_axis(axis, len(x.shape), "softmax"))


def log_softmax(x, axis=-1):
    """x - logsumexp(x, axis), computed stably. Same shape as x."""
    return apply(LOG_SOFTMAX, x, axis=norm_axis(axis, len(x.shape), "log_softmax"))


def _sce_infer(logits, labels):
    name = "softmax_cross_entropy"
    if len(logits.shape) != 2:
        raise ValueError(f"{name}: logits must be 2-D (batch, classes), got shape {logits.shape}")
    check_float(name, logits, "logits")
    if labels.dtype.kind not in "iu":
        raise TypeError(f"{name}: labels must be integer class indices, got dtype {labels.dtype}")
    if tuple(labels.shape) != (logits.shape[0],):
        hint = ("; for one-hot or probability labels use "
                "SoftmaxCrossEntropyLoss(sparse_label=False)"
                if tuple(labels.shape) == tuple(logits.shape) else "")
        raise ValueError(f"{name}: labels must have shape ({logits.shape[0]},) to match logits "
                         f"{logits.shape}, got {labels.shape}{hint}")
    return [((logits.shape[0],), logits.dtype)]


def _g_sce(c, g):
    logits, labels = c.inputs
    return apply(SCE_GRAD, g, logits, labels), None


SCE = register("softmax_cross_entropy", lambda lg, lb, out=None: K.softmax_cross_entropy(lg, lb, out=out),
               _sce_infer, _g_sce,
               cost=lambda i, o, s, **a: (5.0 * numel(i[0]), float(numel(i[0]) * s)), fresh=True)
SCE_GRAD = register("softmax_cross_entropy_grad",
                    lambda g, lg, lb, out=None: K.softmax_cross_entropy_grad(g, lg, lb, out=out),
                    lambda g, lg, lb: [(lg.shape, lg.dtype)], fresh=True)


SCE_WITH_GRAD = register(
    "softmax_cross_entropy_with_grad",
    lambda g, lg, lb, unit=False: K.softmax_cross_entropy_with_grad(g, lg, lb, unit=unit),
    lambda g, lg, lb, unit=False: [((lg.shape[0],), lg.dtype), (lg.shape, lg.dtype)],
    n_out=2, differentiable=False, fresh=True,
    cost=lambda i, o, s, **a: (7.0 * numel(i[1]), float(2 * numel(i[1]) * s)))


def _class_indices_kernel(labels, num_classes=None, out=None):
    idx = np.empty(labels.shape, np.int64) if out is None else out
    with np.errstate(invalid="ignore"):         # NaN / inf: reported below, not warned about
        np.copyto(idx, labels, casting="unsafe")
    if labels.dtype.kind == "f":
        bad = idx != labels                     # a fraction, NaN, inf, or beyond int64
        if bad.any():
            _bad_label(labels, bad, "class indices (whole numbers within int64)")
    if num_classes is not None and idx.size:
        bad = (idx < 0) | (idx >= num_classes)
        if labels.dtype.kind == "u":            # a uint64 above 2**63 wrapped to negative
            bad |= labels >= num_classes
        if bad.any():
            _bad_label(labels, bad, f"class indices in [0, {num_classes})")
    return idx


def _bad_label(labels, bad, expected, name="label", what="labels"):
    i = int(np.argmax(bad.reshape(-1)))
    at = np.unravel_index(i, labels.shape) if labels.ndim else ()
    v = labels.reshape(-1)[i]
    v = float(v) if labels.dtype.kind == "f" else int(v)
    raise ValueError(f"{name}: expected {expected}, got {v} at position "
                     f"{tuple(int(k) for k in at)} of the {labels.dtype} {what}")


def _class_indices_infer(labels, num_classes=None):
    if labels.dtype.kind not in "iuf":
        raise TypeError(f"label: expected integer class indices or floats holding them, got "
                        f"dtype {labels.dtype}")
    return [(tuple(labels.shape), np.dtype(np.int64))]


CLASS_INDICES = register("class_indices", _class_indices_kernel, _class_indices_infer,
                         differentiable=False, fresh=True,
                         cost=lambda i, o, s, **a: (0.0, float(numel(i[0]) * (s + 8))))


def class_indices(labels, num_classes=None):
    """Labels as int64 class indices: integer labels cast, float labels (MXNet's convention)
    checked to hold whole numbers -- a fraction, NaN, inf or a value beyond int64 raises (at
    the next sync point) instead of being truncated to some class; with ``num_classes`` also
    checked to lie in ``[0, num_classes)``.

    Shapes: any; returns the same shape, int64.

    Raises:
        TypeError: labels neither integer nor float.
        ValueError: ``num_classes`` not an integer >= 1.
        OpError (at the next sync point): a float label that is not a whole number, or a label
            outside ``[0, num_classes)``; the message names the value and its position.
    """
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
                or num_classes < 1:
            raise ValueError(f"num_classes: expected an integer >= 1, got {num_classes!r}")
        return apply(CLASS_INDICES, labels, num_classes=int(num_classes))
    return apply(CLASS_INDICES, labels)


def softmax_cross_entropy(logits, labels):
    """Per-sample cross-entropy of softmax(logits) against integer labels.

    Shapes: logits (N, K) float, labels (N,) int -> loss (N,). Labels outside [0, K) raise at
    the next sync point.

    Raises:
        ValueError/TypeError: wrong shapes or non-integer labels.
    """
    return apply(SCE, logits, labels)


# ============================================================================ convolution


def _pair(v, name, arg, check=pair):
    """``check(arg, v)`` (the kernels' argument check) with the op ``name`` in its error."""
    return _named(name, check, arg, v)


def _conv_infer(x, w, *b, stride, padding, dilation, groups, act=None):
    if act not in (None, "relu"):
        raise ValueError(f"conv2d: act must be None or 'relu', got {act!r}")
    check_float("conv2d", x)
    for n, p in (("weight", w),) + ((("bias", b[0]),) if b else ()):
        if p.dtype != x.dtype:
            raise TypeError(f"conv2d: {n} dtype {p.dtype} differs from data dtype {x.dtype}; "
                            f"cast one with .astype()")
    out = _named("conv2d", K.conv2d_output_shape, x.shape, w.shape, stride, padding, dilation,
                 groups)
    if b and tuple(b[0].shape) != (w.shape[0],):
        raise ValueError(f"conv2d: bias must have shape ({w.shape[0]},), got {b[0].shape}")
    return [(tuple(out), x.dtype)]


def _conv_kernel(x, w, b=None, *, stride, padding, dilation, groups, act=None, out=None):
    _blas.for_gemm()
    # fused ReLU: applied per batch block in cache, one op and one array less
    return K.conv2d(x, w, b, stride, padding, dilation, groups, act=act, out=out)


def _conv_gx_kernel(g, w, x_shape, stride, padding, dilation, groups, out=None):
    _blas.for_gemm()
    return K.conv2d_grad_input(g, w, x_shape, stride, padding, dilation, groups, out=out)


def _conv_gw_kernel(g, x, w_shape, stride, padding, dilation, groups, bias=False, out=None):
    _blas.for_gemm()
    return K.conv2d_grad_weight(g, x, w_shape, stride, padding, dilation, groups, bias=bias, out=out)


def _conv_gw_infer(g, x, w_shape, bias=False, **a):
    return [(w_shape, g.dtype)] + ([((w_shape[0],), g.dtype)] if bias else [])


def _g_conv(c, g):
    x, w = c.inputs[0], c.inputs[1]
    a = c.attrs
    if a.get("act") == "relu":
        g = relu_grad(g, c.outputs[0])
        a = {k: v for k, v in a.items() if k != "act"}
    gx = apply(CONV_GX, g, w, x_shape=tuple(x.shape), **a) if c.needs[0] else None
    if len(c.inputs) == 3 and c.needs[1] and not _ag._state.recording:
        # the bias gradient from the weight gradient's GEMMs (no second pass over g); not when
        # a higher-order graph is being recorded (create_graph=True): the sum below is
        # differentiable, conv2d_grad_weight is not
        gw, gb = apply(CONV_GW, g, x, w_shape=tuple(w.shape), bias=True, **a)
        return gx, gw, gb
    gw = apply(CONV_GW, g, x, w_shape=tuple(w.shape), **a) if c.needs[1] else None
    if len(c.inputs) == 3:
        return gx, gw, sum(g, axis=(0, 2, 3))
    return gx, gw


def _conv_cost(in_shapes, out_shapes, itemsize, **a):
    N, O, OH, OW = out_shapes[0]
    _, Cg, KH, KW = in_shapes[1]
    return (2.0 * N * O * OH * OW * Cg * KH * KW,
            float((numel(in_shapes[0]) + numel(in_shapes[1]) + numel(out_shapes[0])) * itemsize))


CONV = register("conv2d", _conv_kernel, _conv_infer, _g_conv, _conv_cost)
CONV_GX = register("conv2d_grad_input", _conv_gx_kernel,
                   lambda g, w, x_shape, **a: [(x_shape, g.dtype)],
                   cost=lambda i, o, s, **a: _conv_cost([o[0], i[1]], [i[0]], s))
# (dw, db) are new arrays: the memory planner may reuse dy's buffer after this op
CONV_GW = register("conv2d_grad_weight", _conv_gw_kernel, _conv_gw_infer,
                   cost=lambda i, o, s, **a: _conv_cost([i[1], o[0]], [i[0]], s), fresh=True)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, act=None):
    """2-D convolution (cross-correlation), NCHW, via im2col + GEMM (Chellapilla et al. 2006).

    Shapes: x (N, C, H, W); weight (O, C // groups, KH, KW); bias (O,) -> (N, O, OH, OW) with
    OH = (H + 2 ph - dh (KH - 1) - 1) // sh + 1. ``act``: None or 'relu' (applied in place in
    the same kernel: one op instead of two).

    Raises:
        ValueError: wrong ndim, channel/group mismatch, kernel larger than the padded input,
            unknown act.
    """
    attrs = dict(stride=_pair(stride, "conv2d", "stride"), padding=_pair(padding, "conv2d", "padding"),
                 dilation=_pair(dilation, "conv2d", "dilation"), groups=_pair(groups, "conv2d", "groups", check_int))
    if act is not None:
        attrs["act"] = act
    if bias is None:
        return apply(CONV, x, weight, **attrs)
    return apply(CONV, x, weight, bias, **attrs)


# ============================================================================ pooling


def _pool_infer(name):
    def infer(x, kernel, stride, padding, **a):
        check_float(name, x)
        return [(tuple(_named(name, K.pool2d_output_shape, x.shape, kernel, stride, padding)),
                 x.dtype)]
    return infer


_FRONT_NAMES = (("x:", "data:"), ("w:", "weight:"))     # the kernels' argument names -> the ops'


def _named(op, fn, *args):
    """``fn(*args)`` (a kernel's shape check); its ValueError names the op and the op's own
    arguments (``data``, ``weight``) instead of the kernel's (``x``, ``w``)."""
    try:
        return fn(*args)
    except ValueError as e:
        msg = str(e)
        for k, f in _FRONT_NAMES:
            if msg.startswith(k):
                msg = f + msg[len(k):]
        raise ValueError(f"{op}: {msg}") from None


def _g_maxpool(c, g):
    return (apply(MAXPOOL_GRAD, g, c.inputs[0], c.outputs[0], **c.attrs),)


def _g_avgpool(c, g):
    return (apply(AVGPOOL_GRAD, g, x_shape=tuple(c.inputs[0].shape), **c.attrs),)


def _pool_cost(in_shapes, out_shapes, itemsize, kernel, **a):
    return (float(numel(out_shapes[0]) * kernel[0] * kernel[1]),
            float((numel(in_shapes[0]) + numel(out_shapes[0])) * itemsize))


MAXPOOL = register("max_pool2d", lambda x, kernel, stride, padding, out=None: K.max_pool2d(x, kernel, stride, padding, out=out),
                   _pool_infer("max_pool2d"), _g_maxpool, _pool_cost)
MAXPOOL_GRAD = register("max_pool2d_grad",
                        lambda g, x, y, kernel, stride, padding, out=None: K.max_pool2d_grad(g, x, y, kernel, stride, padding, out=out),
                        lambda g, x, y, **a: [(x.shape, x.dtype)])
AVGPOOL = register("avg_pool2d",
                   lambda x, kernel, stride, padding, count_include_pad, out=None:
                   K.avg_pool2d(x, kernel, stride, padding, count_include_pad, out=out),
                   _pool_infer("avg_pool2d"), _g_avgpool, _pool_cost)
AVGPOOL_GRAD = register("avg_pool2d_grad",
                        lambda g, x_shape, kernel, stride, padding, count_include_pad, out=None:
                        K.avg_pool2d_grad(g, x_shape, kernel, stride, padding, count_include_pad, out=out),
                        lambda g, x_shape, **a: [(x_shape, g.dtype)])


def max_pool2d(x, kernel, stride=None, padding=0):
    """2-D max pooling, NCHW (gradient to the first maximum of each window).

    Shapes: (N, C, H, W) -> (N, C, (H + 2p - k) // s + 1, ...); stride defaults to kernel.

    Raises:
        ValueError: x not 4-D or not float, kernel/stride not ints >= 1, padding not in
            [0, kernel // 2], or a kernel larger than the padded input.
    """
    k = _pair(kernel, "max_pool2d", "kernel")
    return apply(MAXPOOL, x, kernel=k, stride=_pair(stride if stride is not None else k, "max_pool2d", "stride"),
                 padding=_pair(padding, "max_pool2d", "padding"))


def avg_pool2d(x, kernel, stride=None, padding=0, count_include_pad=True):
    """2-D average pooling, NCHW; stride defaults to kernel (shapes as :func:`max_pool2d`);
    ``count_include_pad``: padded zeros count in each window's divisor.

    Raises:
        ValueError: as :func:`max_pool2d`.
    """
    k = _pair(kernel, "avg_pool2d", "kernel")
    return apply(AVGPOOL, x, kernel=k, stride=_pair(stride if stride is not None else k, "avg_pool2d", "stride"),
                 padding=_pair(padding, "avg_pool2d", "padding"), count_include_pad=bool(count_include_pad))


def global_avg_pool2d(x):
    """Mean over H and W keeping them as size 1: (N, C, H, W) -> (N, C, 1, 1)."""
    if len(x.shape) != 4:
        raise ValueError(f"global_avg_pool2d: expected a 4-D array (N, C, H, W), got shape {x.shape}")
    from .math import mean
    return mean(x, axis=(2, 3), keepdims=True)


# ============================================================================ normalization


def _bn_check(x, gamma, beta, axis):
    """Shapes of batch norm's inputs (both modes); returns C."""
    check_float("batch_norm", x)
    if not 2 <= len(x.shape) <= 5:      # the kernels' range (checked there only when they ran)
        raise ValueError(f"batch_norm: data must be 2-D to 5-D (N, C, ...), got "
                         f"{len(x.shape)}-D with shape {tuple(x.shape)}")
    C = x.shape[axis]
    for n, p in (("gamma", gamma), ("beta", beta)):
        if tuple(p.shape) != (C,):
            raise ValueError(f"batch_norm: {n} must have shape ({C},) (channels on axis {axis} of "
                             f"{x.shape}), got {p.shape}")
    return C


def _bn_infer(x, gamma, beta, eps, axis):
    C = _bn_check(x, gamma, beta, axis)
    if numel(x.shape) // max(C, 1) < 2:
        raise ValueError(f"batch_norm: training needs more than one value per channel to compute "
                         f"batch statistics, got input shape {x.shape} (use predict mode, a larger "
                         f"batch, or LayerNorm)")
    return [(x.shape, x.dtype), ((C,), x.dtype), ((C,), x.dtype)]


def _g_bn(c, gy, gm=None, gv=None):
    x, gamma, _ = c.inputs
    _, mean, var = c.outputs
    dx, dg, db = apply(BN_GRAD, gy, x, gamma, mean, var, **c.attrs)
    return dx, dg, db


BN_TRAIN = register("batch_norm_train",
                    lambda x, g, b, eps, axis: K.batch_norm_train(x, g, b, eps, axis),
                    _bn_infer, _g_bn, n_out=3,
                    cost=lambda i, o, s, **a: (8.0 * numel(i[0]), 3.0 * numel(i[0]) * s))
BN_GRAD = register("batch_norm_grad",
                   lambda gy, x, g, m, v, eps, axis: K.batch_norm_grad(gy, x, g, m, v, eps, axis),
                   lambda gy, x, g, m, v, **a: [(x.shape, x.dtype), (g.shape, g.dtype), (g.shape, g.dtype)],
                   n_out=3)


def _bn_infer_infer(x, gamma, beta, rm, rv, eps, axis):
    # predict mode uses the running statistics: any batch size (1, or 0) is fine
    C = _bn_check(x, gamma, beta, axis)
    for n, p in (("running_mean", rm), ("running_var", rv)):
        if tuple(p.shape) != (C,):
            raise ValueError(f"batch_norm: {n} must have shape ({C},) (channels on axis {axis} of "
                             f"{x.shape}), got {p.shape}")
    return [(x.shape, x.dtype)]


def _g_bn_infer(c, g):
    x, gamma, beta, rm, rv = c.inputs
    from .math import reshape, sqrt
    ax, eps = c.attrs["axis"], c.attrs["eps"]
    shp = [1] * len(x.shape)
    shp[ax] = x.shape[ax]
    shp = tuple(shp)
    red = tuple(i for i in range(len(x.shape)) if i != ax)
    inv = reshape(1.0 / sqrt(add(rv, eps)), shp)
    xhat = multiply(subtract(x, reshape(rm, shp)), inv)
    return (multiply(g, multiply(reshape(gamma, shp), inv)), sum(multiply(g, xhat), axis=red),
            sum(g, axis=red), None, None)


BN_INFER = register("batch_norm_infer",
                    lambda x, g, b, rm, rv, eps, axis, out=None: K.batch_norm_infer(x, g, b, rm, rv, eps, axis, out=out),
                    _bn_infer_infer, _g_bn_infer)


def batch_norm(x, gamma, beta, running_mean, running_var, eps=1e-5, momentum=0.9, training=True,
               axis=1):
    """Batch normalization (Ioffe & Szegedy 2015).

    Training: normalize with the batch mean and biased variance over every axis but ``axis``,
    and update the running statistics (written Vars): ``running = momentum * running +
    (1 - momentum) * batch`` (the variance term uses the unbiased batch variance, as PyTorch).
    Inference: normalize with the running statistics.

    Shapes: x (N, C, ...) with C = x.shape[axis]; gamma, beta, running_* (C,). Returns y like x.

    Raises:
        ValueError: x not 2-D to 5-D or not float, axis out of range, parameters not of shape
            (C,), or (training) only one value per channel.
        TracingError: training while tracing (``hl.sym``, ``@hl.jit``) with running statistics
            that are not parameters (there is nothing to update).
    """
    axis = norm_axis(axis, len(x.shape), "batch_norm")
    if not training:
        return apply(BN_INFER, x, gamma, beta, running_mean, running_var, eps=float(eps), axis=axis)
    y, mean, var = apply(BN_TRAIN, x, gamma, beta, eps=float(eps), axis=axis)
    from .. import autograd
    n = numel(x.shape) // max(x.shape[axis], 1)
    from ..graph.ir import TracingError
    with autograd.pause(autograd.is_training()):    # a failed batch leaves them as they were
        try:
            running_mean._assign(add(multiply(running_mean, momentum),
                                     multiply(mean, 1.0 - momentum)), skip_clean=True)
            unbiased = multiply(var, n / max(n - 1, 1))
            running_var._assign(add(multiply(running_var, momentum),
                                    multiply(unbiased, 1.0 - momentum)), skip_clean=True)
        except TracingError as e:       # e.g. hl.sym.var statistics: nothing to write into
            raise TracingError(
                f"batch_norm(training=True) updates running_mean and running_var in place, so "
                f"in a traced or symbolic program they must be parameters (nn.BatchNorm in a "
                f"hybridized block); these are plain inputs ({e}). Pass training=False to "
                f"normalize with them, or hybridize an nn.BatchNorm block") from None
    return y


def _ln_infer(x, gamma, beta, eps):
    check_float("layer_norm", x)
    D = x.shape[-1]
    for n, p in (("gamma", gamma), ("beta", beta)):
        if tuple(p.shape) != (D,):
            raise ValueError(f"layer_norm: {n} must have shape ({D},) (last axis of {x.shape}), got {p.shape}")
    return [(x.shape, x.dtype), (x.shape[:-1], x.dtype), (x.shape[:-1], x.dtype)]


def _g_ln(c, gy, gm=None, gv=None):
    x, gamma, _ = c.inputs
    _, mean, var = c.outputs
    return apply(LN_GRAD, gy, x, gamma, mean, var, **c.attrs)


LN = register("layer_norm", lambda x, g, b, eps: K.layer_norm(x, g, b, eps), _ln_infer, _g_ln, n_out=3)
LN_GRAD = register("layer_norm_grad",
                   lambda gy, x, g, m, v, eps: K.layer_norm_grad(gy, x, g, m, v, eps),
                   lambda gy, x, g, m, v, **a: [(x.shape, x.dtype), (g.shape, g.dtype), (g.shape, g.dtype)],
                   n_out=3)


def layer_norm(x, gamma, beta, eps=1e-5):
    """Layer normalization over the last axis (Ba, Kiros & Hinton 2016). gamma, beta (D,)."""
    return apply(LN, x, gamma, beta, eps=float(eps))[0]


# ============================================================================ dropout / embedding


def _dropout_kernel(x, p, _rng):
    keep = _rng.random(x.shape, dtype=np.float64 if x.dtype == np.float64 else np.float32) >= p
    mask = keep.astype(x.dtype)
    mask *= x.dtype.type(1.0 / (1.0 - p))
    return x * mask, mask


DROPOUT = register("dropout", _dropout_kernel,
                   lambda x, p: [(x.shape, x.dtype), (x.shape, x.dtype)],
                   lambda c, g, gm=None: (multiply(g, c.outputs[1]),), n_out=2, random=True)


def dropout(x, p=0.5, training=None):
    """Inverted dropout (Srivastava et al. 2014): in training, zero each element with
    probability ``p`` and scale the rest by 1 / (1 - p); identity otherwise. The mask comes from
    the engine RNG (reproducible under ``hl.random.seed``).

    Raises:
        ValueError: p outside [0, 1).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if training is None:
        from .. import autograd
        training = autograd.is_training()
    if not training or p == 0.0:
        from .math import identity
        return identity(x)      # a new handle, like every op: later writes of x do not show
    return apply(DROPOUT, x, p=float(p))[0]


def _emb_indices_kernel(x, rows, out=None):
    idx = np.empty(x.shape, np.int64) if out is None else out
    if np.isnan(x).any():
        _bad_label(x, np.isnan(x), "numbers", "embedding", "indices")
    # clipped while still floats: +inf or a value beyond int64 cast to INT64_MIN (row 0)
    np.copyto(idx, np.clip(x, -1, rows), casting="unsafe")
    return idx


EMB_INDICES = register("embedding_indices", _emb_indices_kernel,
                       lambda x, rows: [(tuple(x.shape), np.dtype(np.int64))],
                       differentiable=False, fresh=True,
                       cost=lambda i, o, s, **a: (0.0, float(numel(i[0]) * (s + 8))))


def embedding(indices, weight):
    """Row lookup: weight (V, D), indices (...) -> (..., D). Indices are clipped to [0, V)
    (as MXNet's Embedding); float indices (labels loaded as float32) are truncated to
    integers, as MXNet does (an index of inf or beyond int64 is clipped like any other).

    Raises:
        ValueError: weight not 2-D.  TypeError: indices neither integers nor floats.
        OpError (at the next sync point): a NaN float index."""
    if len(weight.shape) != 2:
        raise ValueError(f"embedding: weight must be 2-D (vocab, dim), got shape {weight.shape}")
    if not hasattr(indices, "dtype") or not hasattr(indices, "shape"):
        raise TypeError(f"embedding: indices: expected an NDArray or a NumPy array, got "
                        f"{type(indices).__name__}")
    kind = np.dtype(indices.dtype).kind
    if kind == "f":
        indices = apply(EMB_INDICES, indices, rows=int(weight.shape[0]))
    elif kind not in "iu":
        raise TypeError(f"embedding: indices must be integers (or floats holding them), got "
                        f"dtype {indices.dtype}")
    return take(weight, indices, axis=0, mode="clip")


# ============================================================================ second order
# Gradient ops are themselves differentiated when autograd.grad(..., create_graph=True) is
# followed by another backward. Linear ones get their adjoint; the others raise a clear error at
# that backward (before, they had no rule and their paths were silently dropped: wrong values).


def _second_order_missing(name):
    def rule(c, *gs):
        raise NotImplementedError(
            f"second-order gradient through {name!r} is not implemented: a backward through "
            f"gradients computed with create_graph=True reached it (first-order gradients of "
            f"this op are fine)")
    return rule


def _g_avgpool_grad(c, gg):                   # linear in g: the adjoint is the pooling itself
    a = {k: v for k, v in c.attrs.items() if k != "x_shape"}
    return (apply(AVGPOOL, gg, **a),)


for _op in (SCE_GRAD, CONV_GX, CONV_GW, MAXPOOL_GRAD, BN_GRAD, LN_GRAD):
    _op.grad = _second_order_missing(_op.name)
    _op.differentiable = True
AVGPOOL_GRAD.grad = _g_avgpool_grad
AVGPOOL_GRAD.differentiable = True

__all__ = ["softmax", "log_softmax", "softmax_cross_entropy", "class_indices", "conv2d",
           "max_pool2d", "avg_pool2d", "global_avg_pool2d", "batch_norm", "layer_norm", "dropout",
           "embedding", "take_grad"]
