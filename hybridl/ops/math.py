"""Elementwise, reduction, linear-algebra and shape operators.

Each op is a few lines: infer, kernel, grad (written with the frontend functions defined here,
so backward is asynchronous and traceable), cost. The lowercase functions at the bottom of each
group are the frontend: they accept NDArrays or traced values (and Python scalars for binary
ops) and go through :func:`hybridl.ops.dispatch.apply`.
"""
import builtins
import math
import numbers
import operator

import numpy as np

from ._util import (BOOL, F32, I64, as_dtype, broadcast_shape, norm_axes, norm_axis, numel,
                    promote, reduced_shape)
from .. import autograd as _ag
from ..kernels._check import is_int
from . import _blas
from .dispatch import _BASE, apply
from .registry import NO_VALUES, register

# ============================================================================ elementwise binary


def _ew2_infer(name, out_dtype=None):
    def infer(a, b):
        shape = broadcast_shape(name, a.shape, b.shape)
        return [(shape, out_dtype or promote(a.dtype, b.dtype))]
    return infer


def _ew2_kernel(uf):
    def kernel(a, b, out=None):
        if a.dtype != b.dtype:
            return uf(a, b, dtype=promote(a.dtype, b.dtype), out=out)
        return uf(a, b, out=out)
    return kernel


def _sum_to(g, shape):
    return g if tuple(g.shape) == tuple(shape) else sum_to(g, shape)


def _rs(x, shape):
    """reshape() for gradient rules: no identity op when the shape is unchanged."""
    shape = _resolve_shape("reshape", tuple(x.shape), (shape,) if isinstance(shape, int) else shape)
    return x if shape == tuple(x.shape) else apply(RESHAPE, x, shape=shape)


def _g_add(c, g):
    a, b = c.inputs
    return _sum_to(g, a.shape), _sum_to(g, b.shape)


def _g_sub(c, g):
    a, b = c.inputs
    return _sum_to(g, a.shape), _sum_to(negative(g), b.shape)


def _g_mul(c, g):
    a, b = c.inputs
    return _sum_to(multiply(g, b), a.shape), _sum_to(multiply(g, a), b.shape)


def _g_div(c, g):
    a, b = c.inputs
    ga = divide(g, b)
    return _sum_to(ga, a.shape), _sum_to(negative(multiply(ga, c.outputs[0])), b.shape)


def _g_pow(c, g):
    a, b = c.inputs
    y = c.outputs[0]
    # b * a**(b - 1), with the base taken as 1 where b == 0 (x**0 is constant; at a == 0 the
    # formula would be 0 * inf = NaN): b == 0 then gives exactly 0
    base = where(equal(b, 0.0), 1.0, a)
    ga = multiply(g, multiply(b, power(base, subtract(b, 1.0))))
    gb = multiply(g, multiply(y, log(where(greater(a, 0.0), a, 1.0))))
    return _sum_to(ga, a.shape), _sum_to(gb, b.shape)


def _g_maxmin(c, g):
    a, b = c.inputs
    y = c.outputs[0]
    # the input(s) the output came from: equal to it, or NaN where it is NaN (NaN != NaN: the
    # gradient would be 0/0 = NaN for both inputs, also the one that did not matter)
    ma = logical_or(equal(a, y), not_equal(a, a)).astype(g.dtype)
    mb = logical_or(equal(b, y), not_equal(b, b)).astype(g.dtype)
    tot = add(ma, mb)          # ties (and two NaNs) split the gradient evenly
    return _sum_to(multiply(g, divide(ma, tot)), a.shape), _sum_to(multiply(g, divide(mb, tot)), b.shape)


ADD = register("add", _ew2_kernel(np.add), _ew2_infer("add"), _g_add, ew="({0} + {1})")
def _no_bool(name, infer, what):
    """``infer`` that first refuses bool operands (NumPy has no bool loop for ``name``: the
    error would otherwise come from the kernel, at the next sync point)."""
    def checked(*xs, **attrs):
        if all(x.dtype.kind == "b" for x in xs):
            raise TypeError(f"{name}: {what} of bool arrays is not defined (as in NumPy); use "
                            f"logical_xor / logical_not, or cast with .astype('int32')")
        return infer(*xs, **attrs)
    return checked


SUB = register("subtract", _ew2_kernel(np.subtract), _no_bool("subtract", _ew2_infer("subtract"),
                                                              "subtraction"),
               _g_sub, ew="({0} - {1})")
MUL = register("multiply", _ew2_kernel(np.multiply), _ew2_infer("multiply"), _g_mul, ew="({0} * {1})")


def _div_infer(a, b):
    shape = broadcast_shape("divide", a.shape, b.shape)
    d = promote(a.dtype, b.dtype)
    return [(shape, d if d.kind == "f" else F32)]


def _div_kernel(a, b, out=None):
    d = promote(a.dtype, b.dtype)
    d = d if d.kind == "f" else F32
    return np.true_divide(a, b, dtype=d, out=out)


DIV = register("divide", _div_kernel, _div_infer, _g_div, ew="({0} / {1})")
_pow_numbers = _ew2_kernel(np.power)


def _pow_kernel(a, b, out=None):
    if a.dtype.kind == "b" and b.dtype.kind == "b":     # NumPy has no bool loop (gives int8):
        return np.logical_or(a, np.logical_not(b), out=out)     # a ** b == a or not b
    return _pow_numbers(a, b, out=out)


POW = register("power", _pow_kernel, _ew2_infer("power"), _g_pow, ew="({0} ** {1})")
# The numexpr templates (Op.ew, used by fuse_elementwise) of maximum, minimum, relu and
# relu_grad give the kernels' values bit for bit, NaN, inf and signed zeros included (those of
# transcendental functions may differ in the last bit: numexpr's exp is not NumPy's):
# np.maximum(a, b) is a when a > b or a is NaN, else b (a NaN in either operand propagates,
# and maximum(0.0, -0.0) is -0.0)
MAXIMUM = register("maximum", _ew2_kernel(np.maximum), _ew2_infer("maximum"), _g_maxmin,
                   ew="where(({0} > {1}) | ({0} != {0}), {0}, {1})")
MINIMUM = register("minimum", _ew2_kernel(np.minimum), _ew2_infer("minimum"), _g_maxmin,
                   ew="where(({0} < {1}) | ({0} != {0}), {0}, {1})")

_CMP = {}
for _n, _uf, _e in [("equal", np.equal, "=="), ("not_equal", np.not_equal, "!="),
                    ("greater", np.greater, ">"), ("greater_equal", np.greater_equal, ">="),
                    ("less", np.less, "<"), ("less_equal", np.less_equal, "<=")]:
    _CMP[_n] = register(_n, (lambda uf: lambda a, b, out=None: uf(a, b, out=out))(_uf),
                        _ew2_infer(_n, BOOL), ew="({0} %s {1})" % _e)
for _n, _uf, _e in [("logical_and", np.logical_and, "&"), ("logical_or", np.logical_or, "|"),
                    ("logical_xor", np.logical_xor, "^")]:
    _CMP[_n] = register(_n, (lambda uf: lambda a, b, out=None: uf(a, b, out=out))(_uf),
                        _ew2_infer(_n, BOOL))


def add(a, b):
    """Elementwise ``a + b`` with NumPy broadcasting. Shapes (..., broadcastable)."""
    return apply(ADD, a, b)


def subtract(a, b):
    """Elementwise ``a - b`` with broadcasting."""
    return apply(SUB, a, b)


def multiply(a, b):
    """Elementwise ``a * b`` with broadcasting."""
    return apply(MUL, a, b)


def divide(a, b):
    """Elementwise true division ``a / b`` with broadcasting (ints give float32; a Python
    integer outside an integer array's range divides as a float, as in NumPy 2)."""
    if type(b) is int or type(a) is int or is_int(a) or is_int(b):   # (cheap tests first)
        ka = getattr(getattr(a, "dtype", None), "kind", None)
        kb = getattr(getattr(b, "dtype", None), "kind", None)
        if ka in ("i", "u") or kb in ("i", "u"):
            a, b = _wide_int_as_float(a, b), _wide_int_as_float(b, a)
    return apply(DIV, a, b)


def _wide_int_as_float(v, other):
    """``v`` as a float when it is an integer scalar outside the range of ``other``'s integer
    dtype (the quotient is a float anyway; as the array's dtype it would overflow)."""
    if is_int(v):
        dt = getattr(other, "dtype", None)
        if getattr(dt, "kind", None) in ("i", "u"):
            lo, hi = _INT_RANGE.get(dt) or _INT_RANGE.setdefault(
                dt, (int(np.iinfo(dt).min), int(np.iinfo(dt).max)))
            if not lo <= int(v) <= hi:
                return float(v)
    return v


_INT_RANGE = {}     # integer dtype -> (min, max): np.iinfo costs ~2 us a call


def power(a, b):
    """Elementwise ``a ** b`` with broadcasting.

    Raises:
        ValueError: an integer array to a negative integer (scalar) power, as NumPy (the
            result is not an integer); use a float array."""
    if is_int(b) and b < 0 and getattr(getattr(a, "dtype", None), "kind", None) in ("i", "u"):
        raise ValueError(f"power: integers to negative integer powers are not allowed (as in "
                         f"NumPy), got {a.dtype} ** {b}; use a float array (x.astype('float32'))")
    return apply(POW, a, b)


def maximum(a, b):
    """Elementwise maximum with broadcasting (gradient split evenly on ties)."""
    return apply(MAXIMUM, a, b)


def minimum(a, b):
    """Elementwise minimum with broadcasting (gradient split evenly on ties)."""
    return apply(MINIMUM, a, b)


# x OP v for an integer v outside the range of x's integer dtype has the same answer for every
# element; it is computed as x OP' bound with the dtype's own bound (NumPy 2 compares such
# Python integers exactly; converting v to x's dtype would overflow)
_ABOVE = {"less": "less_equal", "less_equal": "less_equal", "not_equal": "less_equal",
          "greater": "greater", "greater_equal": "greater", "equal": "greater"}
_BELOW = {"greater": "greater_equal", "greater_equal": "greater_equal",
          "not_equal": "greater_equal", "less": "less", "less_equal": "less", "equal": "less"}
_FLIP = {"less": "greater", "greater": "less", "less_equal": "greater_equal",
         "greater_equal": "less_equal", "equal": "equal", "not_equal": "not_equal"}




def _compare(name, a, b):
    if is_int(a) and not is_int(b):
        a, b, name = b, a, _FLIP[name]
    if is_int(b) and getattr(getattr(a, "dtype", None), "kind", None) in ("i", "u"):
        info = np.iinfo(a.dtype)
        if int(b) > info.max:
            name, b = _ABOVE[name], int(info.max)
        elif int(b) < info.min:
            name, b = _BELOW[name], int(info.min)
    return apply(_CMP[name], a, b)


def equal(a, b):
    """Elementwise ``a == b`` -> bool. An integer scalar outside an integer array's range
    compares exactly, as in NumPy 2 (``int32_array == 2**40`` is all False)."""
    return _compare("equal", a, b)


def not_equal(a, b):
    """Elementwise ``a != b`` -> bool (integer scalars out of range: see :func:`equal`)."""
    return _compare("not_equal", a, b)


def greater(a, b):
    """Elementwise ``a > b`` -> bool (integer scalars out of range: see :func:`equal`)."""
    return _compare("greater", a, b)


def greater_equal(a, b):
    """Elementwise ``a >= b`` -> bool (integer scalars out of range: see :func:`equal`)."""
    return _compare("greater_equal", a, b)


def less(a, b):
    """Elementwise ``a < b`` -> bool (integer scalars out of range: see :func:`equal`)."""
    return _compare("less", a, b)


def less_equal(a, b):
    """Elementwise ``a <= b`` -> bool (integer scalars out of range: see :func:`equal`)."""
    return _compare("less_equal", a, b)


def logical_and(a, b):
    """Elementwise logical and -> bool."""
    return apply(_CMP["logical_and"], a, b)


def logical_or(a, b):
    """Elementwise logical or -> bool."""
    return apply(_CMP["logical_or"], a, b)


def logical_xor(a, b):
    """Elementwise logical xor -> bool."""
    return apply(_CMP["logical_xor"], a, b)


# ============================================================================ where


def _where_infer(c, a, b):
    s = broadcast_shape("where", broadcast_shape("where", c.shape, a.shape), b.shape)
    return [(s, promote(a.dtype, b.dtype))]


def _where_kernel(c, a, b, out=None):
    r = np.where(c, a, b)
    d = promote(a.dtype, b.dtype)
    return r if r.dtype == d else r.astype(d)


def _g_where(c, g):
    cond, a, b = c.inputs
    z = zeros_like_op(g)
    return None, _sum_to(where(cond, g, z), a.shape), _sum_to(where(cond, z, g), b.shape)


WHERE = register("where", _where_kernel, _where_infer, _g_where, ew="where({0}, {1}, {2})")


def where(condition, x, y):
    """Elementwise ``x if condition else y`` with broadcasting of all three.

    This is also the way out of value-dependent Python branches inside hybridized code.
    """
    return apply(WHERE, condition, x, y)


# ============================================================================ elementwise unary


def _same(x, **attrs):
    return [(x.shape, x.dtype)]


def _float_same(name):
    def infer(x, **attrs):
        return [(x.shape, x.dtype if x.dtype.kind == "f" else F32)]
    return infer


def _u(name, kernel, grad, ew=None, float_out=True, **kw):
    return register(name, kernel, _float_same(name) if float_out else _same, grad, ew=ew, **kw)


def _fk(uf):
    """Kernel for a float-valued ufunc (ints are computed in float32)."""
    def kernel(x, out=None):
        if x.dtype.kind != "f":
            return uf(x, dtype=F32, out=out)
        return uf(x, out=out)
    return kernel


NEG = register("negative", lambda x, out=None: np.negative(x, out=out),
               _no_bool("negative", _same, "negation"),
               lambda c, g: (negative(g),), ew="(-{0})")
EXP = _u("exp", _fk(np.exp), lambda c, g: (multiply(g, c.outputs[0]),), "exp({0})")
LOG = _u("log", _fk(np.log), lambda c, g: (divide(g, c.inputs[0]),), "log({0})")
LOG1P = _u("log1p", _fk(np.log1p), lambda c, g: (divide(g, add(c.inputs[0], 1.0)),), "log1p({0})")
EXPM1 = _u("expm1", _fk(np.expm1), lambda c, g: (multiply(g, add(c.outputs[0], 1.0)),), "expm1({0})")
SQRT = _u("sqrt", _fk(np.sqrt), lambda c, g: (divide(g, multiply(c.outputs[0], 2.0)),), "sqrt({0})")


def _square_kernel(x, out=None):
    if x.dtype.kind == "b":                 # NumPy's square of bool is int8; x * x == x
        return np.logical_and(x, x, out=out)
    return np.square(x, out=out)


SQUARE = register("square", _square_kernel, _same,
                  lambda c, g: (multiply(g, multiply(c.inputs[0], 2.0)),), ew="({0} * {0})")
TANH = _u("tanh", _fk(np.tanh),
          lambda c, g: (multiply(g, subtract(1.0, square(c.outputs[0]))),), "tanh({0})")
SIN = _u("sin", _fk(np.sin), lambda c, g: (multiply(g, cos(c.inputs[0])),), "sin({0})")
COS = _u("cos", _fk(np.cos), lambda c, g: (negative(multiply(g, sin(c.inputs[0]))),), "cos({0})")
RECIP = _u("reciprocal", _fk(np.reciprocal),
           lambda c, g: (negative(multiply(g, square(c.outputs[0]))),), "(1 / {0})")


def _sigmoid_kernel(x, out=None):
    # 1 / (1 + exp(-x)), the fusion template's formula: accurate to a few ulps everywhere
    # (0.5 * (1 + tanh(x / 2)), used before, cancels for x << 0: sigmoid(-17) was 44% off in
    # float32, sigmoid(-20) 0). exp(-x) overflows to inf only where sigmoid is below the
    # smallest normal number (x < -88 in float32), and 1 / inf is the 0 it rounds to.
    y = np.negative(x, out=out, dtype=x.dtype if x.dtype.kind == "f" else F32)
    if not isinstance(y, np.ndarray):          # 0-d input: NumPy returned a scalar
        y = np.array(y)
    with np.errstate(over="ignore"):
        np.exp(y, out=y)
    y += 1.0
    np.reciprocal(y, out=y)
    return y


SIGMOID = _u("sigmoid", _sigmoid_kernel,
             lambda c, g: (multiply(g, multiply(c.outputs[0], subtract(1.0, c.outputs[0]))),),
             "(1 / (1 + exp(-{0})))")


def _relu_kernel(x, out=None):
    return np.maximum(x, 0, out=out, dtype=x.dtype)


def _g_relu(c, g):
    return (relu_grad(g, c.outputs[0]),)


def _relu_infer(x):
    if x.dtype.kind == "b":
        raise TypeError("relu: expected a numeric array, got dtype bool (cast it first, "
                        "e.g. x.astype('float32'))")
    return [(x.shape, x.dtype)]


# ew: relu(NaN) is NaN, as np.maximum (and torch.relu) give
RELU = register("relu", _relu_kernel, _relu_infer, _g_relu, ew="where({0} <= 0, 0, {0})")


def _relu_grad_kernel(g, y, out=None):
    # no dtype=: NumPy then casts the mask inside its float loop, not through a buffered
    # cast (same values; 1.2x faster at 256x256, 1.7x at 128x6x24x24)
    return np.multiply(g, y > 0, out=out)


RELU_GRAD = register("relu_grad", _relu_grad_kernel, lambda g, y: [(g.shape, g.dtype)],
                     lambda c, gg: (relu_grad(gg, c.inputs[1]), None),   # linear in g; 0 in y
                     # ew: g * 1 or g * 0 as the kernel's product (a NaN or inf g gives NaN
                     # where y <= 0, a negative g -0.0, a signaling NaN is quieted)
                     ew="where({1} > 0, {0} * 1, {0} * 0)")


def _softplus_kernel(x, out=None):
    return np.logaddexp(x, 0, dtype=x.dtype if x.dtype.kind == "f" else F32, out=out)


SOFTPLUS = _u("softplus", _softplus_kernel, lambda c, g: (multiply(g, sigmoid(c.inputs[0])),))
ABS = register("abs", lambda x, out=None: np.abs(x, out=out), _same,
               lambda c, g: (multiply(g, sign(c.inputs[0])),), ew="abs({0})")
SIGN = register("sign", lambda x, out=None: np.sign(x, out=out), _no_bool("sign", _same, "the sign"),
                lambda c, g: (zeros_like_op(g),))
FLOOR = register("floor", lambda x, out=None: np.floor(x, out=out), _same,
                 lambda c, g: (zeros_like_op(g),))
LOGICAL_NOT = register("logical_not", lambda x, out=None: np.logical_not(x, out=out),
                       lambda x: [(x.shape, BOOL)])
ZEROS_LIKE = register("zeros_like", lambda x: np.zeros(x.shape, x.dtype), _same,
                      lambda c, g: (None,))
ONES_LIKE = register("ones_like", lambda x: np.ones(x.shape, x.dtype), _same,
                     lambda c, g: (None,))


def negative(x):
    """Elementwise ``-x``."""
    return apply(NEG, x)


def exp(x):
    """Elementwise e**x."""
    return apply(EXP, x)


def log(x):
    """Elementwise natural logarithm."""
    return apply(LOG, x)


def log1p(x):
    """Elementwise log(1 + x)."""
    return apply(LOG1P, x)


def expm1(x):
    """Elementwise exp(x) - 1."""
    return apply(EXPM1, x)


def sqrt(x):
    """Elementwise square root."""
    return apply(SQRT, x)


def square(x):
    """Elementwise x**2."""
    return apply(SQUARE, x)


def tanh(x):
    """Elementwise hyperbolic tangent."""
    return apply(TANH, x)


def sin(x):
    """Elementwise sine (radians)."""
    return apply(SIN, x)


def cos(x):
    """Elementwise cosine (radians)."""
    return apply(COS, x)


def reciprocal(x):
    """Elementwise 1 / x."""
    return apply(RECIP, x)


def sigmoid(x):
    """Elementwise logistic function 1 / (1 + exp(-x)), computed as 0.5 (1 + tanh(x / 2))."""
    return apply(SIGMOID, x)


def relu(x):
    """Elementwise max(x, 0)."""
    return apply(RELU, x)


def relu_grad(g, y):
    """Gradient of relu given its output ``y``: ``g * (y > 0)``."""
    return apply(RELU_GRAD, g, y)


def softplus(x):
    """Elementwise log(1 + exp(x)) (numerically stable)."""
    return apply(SOFTPLUS, x)


def abs(x):  # noqa: A001 - the field's name
    """Elementwise absolute value."""
    return apply(ABS, x)


def sign(x):
    """Elementwise sign (-1, 0, 1)."""
    return apply(SIGN, x)


def floor(x):
    """Elementwise floor."""
    return apply(FLOOR, x)


def logical_not(x):
    """Elementwise logical not -> bool."""
    return apply(LOGICAL_NOT, x)


def zeros_like_op(x):
    """Zeros of ``x``'s shape and dtype (an op, so it works on traced values too)."""
    return apply(ZEROS_LIKE, x)


def ones_like_op(x):
    """Ones of ``x``'s shape and dtype."""
    return apply(ONES_LIKE, x)


# clip


def int_clip_bounds(dtype, a_min, a_max):
    """The bounds clip uses for an integer (or bool) ``dtype``: ``ceil(a_min)`` and
    ``floor(a_max)`` as values of that dtype, held inside its range (a bound beyond it clips
    nothing on that side; an infinite one too). None stays None. The ONNX exporter writes
    the same bounds."""
    dtype = np.dtype(dtype)
    info = np.iinfo(dtype) if dtype.kind != "b" else None
    lo, hi = (info.min, info.max) if info is not None else (0, 1)
    # an infinite bound is beyond every integer (math.ceil(inf) would overflow)
    if a_min is not None and math.isinf(a_min):
        a_min = lo if a_min < 0 else hi
    if a_max is not None and math.isinf(a_max):
        a_max = hi if a_max > 0 else lo
    a_min = None if a_min is None else dtype.type(builtins.min(builtins.max(math.ceil(a_min), lo), hi))
    a_max = None if a_max is None else dtype.type(builtins.max(builtins.min(math.floor(a_max), hi), lo))
    return a_min, a_max


def _clip_kernel(x, a_min=None, a_max=None, out=None):
    if x.dtype.kind in "iub":   # keep the dtype (see int_clip_bounds)
        a_min, a_max = int_clip_bounds(x.dtype, a_min, a_max)
    return np.clip(x, a_min, a_max, out=out)


def _g_clip(c, g):
    x = c.inputs[0]
    lo, hi = c.attrs.get("a_min"), c.attrs.get("a_max")
    m = None
    if lo is not None:
        m = greater_equal(x, lo)
    if hi is not None:
        m2 = less_equal(x, hi)
        m = m2 if m is None else logical_and(m, m2)
    return (g if m is None else multiply(g, m.astype(g.dtype)),)


CLIP = register("clip", _clip_kernel, _same, _g_clip)


def _bound(name, v):
    """A clip bound as a Python int (an integer: exact, 2**62 + 1 stays itself) or float (None
    stays None): numbers, and one-element arrays (a 0-d NDArray is a sync point); TypeError
    otherwise."""
    if v is None or type(v) is float or type(v) is int:
        return v
    if not isinstance(v, bool):
        try:
            if getattr(v, "size", 1) == 1:
                a = v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v)
                return int(a) if a.dtype.kind in "iu" else float(a)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"clip: {name} must be a number or None (array bounds are not supported; "
                    f"use maximum/minimum), got {type(v).__name__}")


def clip(x, a_min=None, a_max=None):
    """Elementwise clip to [a_min, a_max] (either bound may be None).

    Raises:
        ValueError: both bounds are None, or a_min > a_max.
        TypeError: a bound that is not a number (arrays are not supported).
    """
    if a_min is None and a_max is None:
        raise ValueError("clip: at least one of a_min and a_max must be given")
    a_min, a_max = _bound("a_min", a_min), _bound("a_max", a_max)
    if a_min is not None and a_max is not None and a_min > a_max:
        raise ValueError(f"clip: a_min={a_min} must be <= a_max={a_max}")
    return apply(CLIP, x, a_min=a_min if a_min is None or type(a_min) is int else float(a_min),
                 a_max=a_max if a_max is None or type(a_max) is int else float(a_max))


# cast


def _cast_infer(x, dtype):
    return [(x.shape, np.dtype(dtype))]


def _cast_kernel(x, dtype, out=None):
    return x.astype(dtype) if out is None else np.copyto(out, x, casting="unsafe") or out


def _g_cast(c, g):
    x = c.inputs[0]
    return (cast(g, x.dtype.name) if x.dtype.kind == "f" else None,)


CAST = register("cast", _cast_kernel, _cast_infer, _g_cast)


def cast(x, dtype):
    """Convert to ``dtype`` (float32, float64, int32, int64, bool)."""
    d = as_dtype(dtype)
    if d == x.dtype:
        return identity(x)      # a new handle: a later in-place write of x must not show here
    return apply(CAST, x, dtype=d.name)


# ============================================================================ reductions


def _red_infer(kind):
    def infer(x, axis, keepdims):
        shape = reduced_shape(x.shape, axis, keepdims)
        if kind == "sum":
            d = x.dtype if x.dtype.kind == "f" else I64
        elif kind == "mean":
            d = x.dtype if x.dtype.kind == "f" else F32
        elif kind == "arg":
            d = I64
        else:
            d = x.dtype
        return [(shape, d)]
    return infer


def _expand_back(g, shape, axis, keepdims):
    if not keepdims:
        g = _rs(g, reduced_shape(shape, axis, True))
    return g


def _g_sum(c, g):
    x = c.inputs[0]
    g = _expand_back(g, x.shape, c.attrs["axis"], c.attrs["keepdims"])
    return (broadcast_to(g, x.shape),)


def _g_mean(c, g):
    x = c.inputs[0]
    n = numel([x.shape[a] for a in c.attrs["axis"]])
    g = _expand_back(g, x.shape, c.attrs["axis"], c.attrs["keepdims"])
    return (broadcast_to(multiply(g, 1.0 / builtins.max(n, 1)), x.shape),)


def _g_maxred(c, g):
    x, y = c.inputs[0], c.outputs[0]
    ax, kd = c.attrs["axis"], c.attrs["keepdims"]
    y = _expand_back(y, x.shape, ax, kd)
    g = _expand_back(g, x.shape, ax, kd)
    m = equal(x, y).astype(g.dtype)
    cnt = sum(m, axis=ax, keepdims=True)
    return (multiply(m, divide(g, cnt)),)


def _g_prod(c, g):
    x = c.inputs[0]
    ax, kd = c.attrs["axis"], c.attrs["keepdims"]
    g = _expand_back(g, x.shape, ax, kd)
    # d prod / d x_i = product of the other elements: prod / x_i without zeros; with one zero,
    # the product of the rest at that zero and 0 elsewhere; with two or more zeros, 0
    zero = equal(x, 0.0)
    nonzero = where(zero, 1.0, x)
    p = _expand_back(apply(PROD, nonzero, axis=ax, keepdims=kd), x.shape, ax, kd)
    nz = _expand_back(apply(SUM, zero.astype(x.dtype), axis=ax, keepdims=kd), x.shape, ax, kd)
    other = where(equal(nz, 0.0), divide(p, nonzero),
                  where(logical_and(equal(nz, 1.0), zero), p, 0.0))
    return (multiply(g, other),)


def _sum_kernel(x, axis, keepdims, out=None):
    d = x.dtype if x.dtype.kind == "f" else I64
    return np.sum(x, axis=axis, keepdims=keepdims, dtype=d, out=out)


def _mean_kernel(x, axis, keepdims, out=None):
    d = x.dtype if x.dtype.kind == "f" else F32
    r = np.mean(x, axis=axis, keepdims=keepdims, dtype=d, out=out)
    return r if isinstance(r, np.ndarray) else np.asarray(r, d)


def _prod_kernel(x, axis, keepdims, out=None):
    return np.asarray(np.prod(x, axis=axis, keepdims=keepdims, out=out))


def _wrap(fn):
    def k(x, axis, keepdims, out=None):
        return np.asarray(fn(x, axis=axis, keepdims=keepdims, out=out))
    return k


def _arg_kernel(fn):
    def k(x, axis, keepdims, out=None):
        return np.asarray(fn(x, axis=axis[0], keepdims=keepdims)).astype(I64, copy=False)
    return k


def _red_cost(in_shapes, out_shapes, itemsize, **a):
    n = numel(in_shapes[0])
    return float(n), float((n + numel(out_shapes[0])) * itemsize)


SUM = register("sum", lambda x, axis, keepdims, out=None: np.asarray(_sum_kernel(x, axis, keepdims, out)),
               _red_infer("sum"), _g_sum, _red_cost)


def _sum_emit(out, ins, attrs, in_specs, out_spec, buf):
    """Inline ``np.add.reduce`` (what ``np.sum`` calls, without its wrapper) for a float input
    whose result is an array (not a 0-d scalar without a buffer)."""
    if in_specs[0][1].kind != "f" or (not out_spec[0] and not buf):
        return None
    o = f", out={buf}" if buf else ""
    return [f"{out} = np.add.reduce({ins[0]}, axis={attrs['axis']!r}, "
            f"keepdims={attrs['keepdims']!r}{o})"], False


SUM.emit = _sum_emit
MEAN = register("mean", _mean_kernel, _red_infer("mean"), _g_mean, _red_cost)
MAX = register("max", _wrap(np.max), _red_infer("max"), _g_maxred, _red_cost)
MIN = register("min", _wrap(np.min), _red_infer("min"), _g_maxred, _red_cost)
PROD = register("prod", _prod_kernel, _red_infer("sum"), _g_prod, _red_cost)
ARGMAX = register("argmax", _arg_kernel(np.argmax), _red_infer("arg"), cost=_red_cost)
ARGMIN = register("argmin", _arg_kernel(np.argmin), _red_infer("arg"), cost=_red_cost)


def _reduce(op, x, axis, keepdims, name):
    axes = norm_axes(axis, len(x.shape), name)
    if op in (MAX, MIN, ARGMAX, ARGMIN) and any(x.shape[a] == 0 for a in axes):
        raise ValueError(f"{name}: cannot reduce over an axis of size 0 (shape {x.shape})")
    return apply(op, x, axis=axes, keepdims=bool(keepdims))


def sum(x, axis=None, keepdims=False):  # noqa: A001
    """Sum over ``axis`` (None = all, int or tuple). Ints and bools sum to int64.

    Raises:
        ValueError: an axis is out of range.
    """
    return _reduce(SUM, x, axis, keepdims, "sum")


def mean(x, axis=None, keepdims=False):
    """Arithmetic mean over ``axis`` (ints give float32)."""
    return _reduce(MEAN, x, axis, keepdims, "mean")


def max(x, axis=None, keepdims=False):  # noqa: A001
    """Maximum over ``axis`` (gradient split evenly among ties).

    Raises:
        ValueError: reducing an empty axis, or an axis out of range.
    """
    return _reduce(MAX, x, axis, keepdims, "max")


def min(x, axis=None, keepdims=False):  # noqa: A001
    """Minimum over ``axis`` (gradient split evenly among ties)."""
    return _reduce(MIN, x, axis, keepdims, "min")


def prod(x, axis=None, keepdims=False):
    """Product over ``axis``. Its gradient is the product of the other elements (exact where
    x holds zeros, as PyTorch's; not y / x)."""
    return _reduce(PROD, x, axis, keepdims, "prod")


def _argred(op, x, axis, keepdims, name):
    if axis is None:      # index into the flattened array; keepdims keeps every axis as 1
        r = _reduce(op, _rs(x, (-1,)), 0, False, name)
        return reshape(r, (1,) * len(x.shape)) if keepdims else r
    if isinstance(axis, (tuple, list)):
        raise TypeError(f"{name}: axis must be a single integer or None, got {axis!r}")
    return _reduce(op, x, axis, keepdims, name)


def argmax(x, axis=None, keepdims=False):
    """Index (int64) of the first maximum along ``axis`` (None: of the flattened array)."""
    return _argred(ARGMAX, x, axis, keepdims, "argmax")


def argmin(x, axis=None, keepdims=False):
    """Index (int64) of the first minimum along ``axis`` (None: of the flattened array)."""
    return _argred(ARGMIN, x, axis, keepdims, "argmin")


# ============================================================================ linear algebra


def _mm_shapes(name, sa, sb):
    if len(sa) == 0 or len(sb) == 0:
        raise ValueError(f"{name}: operands must have at least 1 dimension, got shapes {sa} and {sb}")
    a2 = (1,) + sa if len(sa) == 1 else sa
    b2 = sb + (1,) if len(sb) == 1 else sb
    if a2[-1] != b2[-2]:
        raise ValueError(f"{name}: contraction dimensions differ: shapes {sa} and {sb} "
                         f"(a.shape[-1]={sa[-1]} must equal b.shape[{-2 if len(sb) > 1 else 0}]="
                         f"{b2[-2]})")
    batch = broadcast_shape(name, a2[:-2], b2[:-2])
    out = batch + (a2[-2], b2[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    return out


def _mm_infer(a, b):
    return [(_mm_shapes("matmul", a.shape, b.shape), promote(a.dtype, b.dtype))]


def _mm_cost(in_shapes, out_shapes, itemsize, **a):
    k = in_shapes[0][-1]
    n = numel(out_shapes[0])
    return 2.0 * n * k, float((numel(in_shapes[0]) + numel(in_shapes[1]) + n) * itemsize)


def _g_matmul(c, g):
    a, b = c.inputs
    a2 = reshape(a, (1,) + a.shape) if len(a.shape) == 1 else a
    b2 = reshape(b, b.shape + (1,)) if len(b.shape) == 1 else b
    # g with the dimensions NumPy dropped for 1-D operands put back: (..., n, m)
    g2 = _rs(g, _mm_shapes("matmul", tuple(a2.shape), tuple(b2.shape)))
    ga = gb = None
    if c.needs[0]:
        ga = _rs(_sum_to(matmul(g2, swapaxes(b2, -1, -2)), a2.shape), a.shape)
    if c.needs[1]:
        gb = _rs(_sum_to(matmul(swapaxes(a2, -1, -2), g2), b2.shape), b.shape)
    return ga, gb


def _mm_kernel(a, b, out=None):
    _blas.for_gemm()
    if a.dtype != b.dtype:
        return np.matmul(a, b, dtype=promote(a.dtype, b.dtype), out=out)
    if a.ndim == 2 and b.ndim == 2:
        return _dot2(a, b, out)
    return np.matmul(a, b, out=out)


def _dot2(a, b, out=None):
    """``a @ b`` for 2-D operands of one dtype: ``np.dot`` makes the same BLAS call as
    ``np.matmul`` for BLAS-able operands (bit-identical results; for a strided vector-shaped
    product np.matmul uses its own loop, np.dot a copy and BLAS: last-bit differences) with
    about 1 µs less dispatch (no ufunc machinery), a fifth of a small GEMM's time. ``np.dot``
    takes only a C-contiguous ``out`` of the result's exact dtype: other outs go to np.matmul."""
    if out is None:
        return np.dot(a, b)
    if out.flags.c_contiguous:
        try:
            return np.dot(a, b, out=out)
        except ValueError:          # out's dtype is not the product's (checked before computing)
            pass
    return np.matmul(a, b, out=out)


MATMUL = register("matmul", _mm_kernel, _mm_infer, _g_matmul, _mm_cost)


def _mm_emit(out, ins, attrs, in_specs, out_spec, buf):
    """Inline code for a compiled program (see graph.codegen): the kernel's own NumPy call for
    two same-dtype float operands of 2 dimensions."""
    (sa, da), (sb, db) = in_specs
    if len(sa) != 2 or len(sb) != 2 or da != db or da.kind != "f":
        return None
    o = f", out={buf}" if buf else ""          # planned buffers are C-contiguous (see _dot2)
    return [f"{out} = np.dot({ins[0]}, {ins[1]}{o})"], True


MATMUL.emit = _mm_emit


def matmul(a, b):
    """Matrix product with NumPy semantics: (..., n, k) @ (..., k, m) -> (..., n, m); batch
    dimensions broadcast; 1-D operands are promoted as in NumPy.

    Raises:
        ValueError: contraction dimensions differ (names both shapes).
    """
    return apply(MATMUL, a, b)


def dot(a, b):
    """``dot`` as in MXNet: for ≤ 2-D operands the matrix product; otherwise contracts the last
    axis of ``a`` with the first axis of ``b`` (shape a.shape[:-1] + b.shape[1:]).

    Raises:
        ValueError: the contracted dimensions differ (for ≤ 2-D operands the message is
            :func:`matmul`'s).
    """
    if len(a.shape) <= 2 and len(b.shape) <= 2:
        return matmul(a, b)
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"dot: contraction dimensions differ: shapes {a.shape} and {b.shape}")
    # explicit sizes: -1 is ambiguous when a contracted or kept size is 0
    a2 = reshape(a, (numel(a.shape[:-1]), a.shape[-1]))
    b2 = reshape(b, (b.shape[0], numel(b.shape[1:])))
    return reshape(matmul(a2, b2), a.shape[:-1] + b.shape[1:])


def _fc_infer(x, w, *b, flatten=True, act=None):
    name = "fully_connected"
    if act not in (None, "relu"):
        raise ValueError(f"{name}: act must be None or 'relu', got {act!r}")
    if x.dtype.kind == "f" and x.dtype != w.dtype:
        # as conv2d (and MXNet, PyTorch): float64 data through a float32 layer would silently
        # compute (and return) float64, at twice the cost; integer data takes w's float type
        raise TypeError(f"{name}: data dtype {x.dtype} differs from weight dtype {w.dtype}; "
                        f"cast the data with .astype('{w.dtype}') (hl.nd.array(x, dtype="
                        f"'{w.dtype}')), or the model's parameters to {x.dtype}")
    if len(w.shape) != 2:
        raise ValueError(f"{name}: weight must be 2-D (units, in_units), got shape {w.shape}")
    k = numel(x.shape[1:]) if flatten else x.shape[-1]
    if len(x.shape) < (2 if flatten else 1) or k != w.shape[1]:
        raise ValueError(f"{name}: data of shape {x.shape} has {k} input features but weight "
                         f"of shape {w.shape} expects {w.shape[1]}")
    if b and tuple(b[0].shape) != (w.shape[0],):
        raise ValueError(f"{name}: bias must have shape ({w.shape[0]},), got {b[0].shape}")
    out = (x.shape[0], w.shape[0]) if flatten else x.shape[:-1] + (w.shape[0],)
    return [(out, promote(x.dtype, w.dtype))]


def _fc_kernel(x, w, b=None, flatten=True, act=None, out=None):
    _blas.for_gemm()
    if x.dtype != w.dtype:                  # the inferred dtype (an int x takes w's float type)
        dt = promote(x.dtype, w.dtype)
        x, w = x.astype(dt, copy=False), w.astype(dt, copy=False)
    if x.ndim == 2:                         # the common case: no reshapes
        y = _dot2(x, w.T, out)
        if b is not None:
            y += b
        if act is not None:                 # fused activation: one pass less, one op less
            np.maximum(y, 0, out=y)
        return y
    k = w.shape[1]                          # explicit: -1 is ambiguous for an empty batch
    x2 = x.reshape(x.shape[0], k) if flatten else x.reshape(-1, k)
    y = np.matmul(x2, w.T, out=None if out is None else out.reshape(x2.shape[0], w.shape[0]))
    if b is not None:
        y += b
    if act is not None:
        np.maximum(y, 0, out=y)
    oshape = (x.shape[0], w.shape[0]) if flatten else x.shape[:-1] + (w.shape[0],)
    return y.reshape(oshape) if out is None else out


def _fc_grad_infer(g, x, w, *y, flatten, act, need_x, need_w, bias):
    specs = [(tuple(x.shape), g.dtype)] if need_x else []
    if need_w:
        specs.append((tuple(w.shape), g.dtype))
    if bias:
        specs.append(((w.shape[0],), g.dtype))
    return specs


def _fc_grad_kernel(g, x, w, y=None, *, flatten, act, need_x, need_w, bias):
    """The NumPy calls of the composed gradient (relu_grad, transpose, matmul, sum: same
    order, same results) in one kernel."""
    if act is not None:
        g = _relu_grad_kernel(g, y)
    k = w.shape[1]
    x2 = x.reshape(x.shape[0], k) if flatten else x.reshape(-1, k)
    g2 = g.reshape(-1, w.shape[0])
    if need_w and x2.dtype != g2.dtype:     # an int x: the weight gradient in g's float type
        x2 = x2.astype(g2.dtype)
    _blas.for_gemm()
    res = []
    gw = _dot2(g2.T, x2) if need_w else None
    if need_x:
        res.append(_dot2(g2, w).reshape(x.shape))
    if need_w:
        res.append(gw)
    if bias:
        res.append(_sum_kernel(g2, (0,), False))
    return res[0] if len(res) == 1 else tuple(res)


def _fc_grad_cost(in_shapes, out_shapes, itemsize, **a):
    n, k = numel(in_shapes[1]) // in_shapes[2][1], in_shapes[2][1]
    u = in_shapes[2][0]
    flops = 2.0 * n * u * k * (int(a["need_x"]) + int(a["need_w"]))
    return flops, float((numel(in_shapes[0]) + numel(in_shapes[1]) + u * k
                         + builtins.sum(numel(s) for s in out_shapes)) * itemsize)


FC_GRAD = register("fully_connected_grad", _fc_grad_kernel, _fc_grad_infer, None, _fc_grad_cost)


def _g_fc(c, g):
    x, w = c.inputs[0], c.inputs[1]
    flatten = c.attrs["flatten"]
    if type(g) is _BASE[0] and not _ag._state.recording and (c.needs[0] or c.needs[1]):
        # eager backward (no higher-order graph being recorded): one op instead of five
        # (relu_grad, transpose, two matmuls, sum), as MXNet's FullyConnected backward; traced
        # programs keep the composed ops, which the memory planner can place one by one
        attrs = {"flatten": flatten, "act": c.attrs.get("act"), "need_x": bool(c.needs[0]),
                 "need_w": bool(c.needs[1]), "bias": len(c.inputs) == 3}
        ins = (g, x, w) + ((c.outputs[0],) if attrs["act"] is not None else ())
        out = apply(FC_GRAD, *ins, **attrs)
        out = list(out) if isinstance(out, tuple) else [out]
        gx = out.pop(0) if attrs["need_x"] else None
        gw = out.pop(0) if attrs["need_w"] else None
        return (gx, gw) + ((out.pop(0),) if attrs["bias"] else ())
    if c.attrs.get("act") == "relu":
        g = relu_grad(g, c.outputs[0])
    k = w.shape[1]
    x2 = _rs(x, (x.shape[0], k) if flatten else (-1, k))
    g2 = _rs(g, (-1, w.shape[0]))
    gw = matmul(transpose(g2), x2) if c.needs[1] else None   # first: x dies before gx is made
    gx = _rs(matmul(g2, w), x.shape) if c.needs[0] else None
    res = (gx, gw)
    if len(c.inputs) == 3:
        res = res + (sum(g2, axis=0),)
    return res


def _fc_cost(in_shapes, out_shapes, itemsize, **a):
    n, u = numel(out_shapes[0][:-1]), out_shapes[0][-1]
    k = in_shapes[1][1]
    return 2.0 * n * u * k, float((numel(in_shapes[0]) + u * k + n * u) * itemsize)


FC = register("fully_connected", _fc_kernel, _fc_infer, _g_fc, _fc_cost)


def _fc_emit(out, ins, attrs, in_specs, out_spec, buf):
    """Inline code for a compiled program: the NumPy calls of ``_fc_kernel`` (same order, same
    results) when x is 2-D and every operand has the output's float dtype."""
    if len(in_specs[0][0]) != 2 or any(d != out_spec[1] for _, d in in_specs) or out_spec[1].kind != "f":
        return None
    o = f", out={buf}" if buf else ""          # planned buffers are C-contiguous (see _dot2)
    lines = [f"{out} = np.dot({ins[0]}, {ins[1]}.T{o})"]
    if len(ins) == 3:
        lines.append(f"{out} += {ins[2]}")
    if attrs.get("act") is not None:
        lines.append(f"np.maximum({out}, 0, out={out})")
    return lines, True


FC.emit = _fc_emit


def fully_connected(x, weight, bias=None, flatten=True, act=None):
    """Dense layer ``y = act(x @ weight.T + bias)`` (MXNet FullyConnected, PyTorch linear).

    Shapes: x (N, ...) flattened to (N, in_units) when ``flatten`` else (..., in_units);
    weight (units, in_units); bias (units,); y (N, units) or (..., units).
    ``act``: None or 'relu' (fused into the same kernel: one op instead of two).

    Raises:
        ValueError: in_units mismatch, wrong bias shape (names the shapes), unknown act.
    """
    attrs = {"flatten": bool(flatten)}
    if act is not None:
        attrs["act"] = act
    if bias is None:
        return apply(FC, x, weight, **attrs)
    return apply(FC, x, weight, bias, **attrs)


# ============================================================================ shape ops


def _int_sizes(name, sizes):
    """``sizes`` as a tuple of ints (ints and NumPy integers: 2.5 or 3.0 is a TypeError, as in
    NumPy; int() truncated them silently)."""
    try:
        return tuple(operator.index(s) for s in sizes)
    except TypeError:
        raise TypeError(f"{name}: the shape must hold integers, got {tuple(sizes)!r}") from None


def _resolve_shape(name, shape, newshape):
    newshape = _int_sizes(name, newshape)
    if newshape.count(-1) > 1:
        raise ValueError(f"{name}: at most one -1 allowed in the new shape, got {newshape}")
    n = numel(shape)
    if -1 in newshape:
        rest = numel([s for s in newshape if s != -1])
        if rest == 0 or n % rest:
            raise ValueError(f"{name}: cannot reshape array of shape {shape} into {newshape}")
        newshape = tuple(n // rest if s == -1 else s for s in newshape)
    if any(s < 0 for s in newshape) or numel(newshape) != n:
        raise ValueError(f"{name}: cannot reshape array of shape {shape} ({n} elements) into "
                         f"{newshape} ({numel(newshape)} elements)")
    return newshape


RESHAPE = register("reshape", lambda x, shape: x.reshape(shape),
                   lambda x, shape: [(shape, x.dtype)],
                   lambda c, g: (reshape(g, c.inputs[0].shape),),
                   cost=lambda i, o, s, **a: (0.0, 0.0))


def reshape(x, shape):
    """View ``x`` with a new shape (one entry may be -1). No data is copied.

    Raises:
        ValueError: the element counts differ.
    """
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = _resolve_shape("reshape", tuple(x.shape), shape)
    if shape == tuple(x.shape):
        return identity(x)      # a new handle: a later in-place write of x must not show here
    return apply(RESHAPE, x, shape=shape)


def _tr_infer(x, axes):
    return [(tuple(x.shape[a] for a in axes), x.dtype)]


def _g_transpose(c, g):
    axes = c.attrs["axes"]
    inv = tuple(int(i) for i in np.argsort(axes))
    return (transpose(g, inv),)


TRANSPOSE = register("transpose", lambda x, axes: np.transpose(x, axes), _tr_infer, _g_transpose,
                     cost=lambda i, o, s, **a: (0.0, 0.0))
TRANSPOSE.emit = lambda out, ins, attrs, in_specs, out_spec, buf: (
    ([f"{out} = {ins[0]}.T"], False) if attrs["axes"] == (1, 0) and not buf else None)


def transpose(x, axes=None):
    """Permute dimensions (default: reverse them). A view: no data is copied.

    Raises:
        ValueError: ``axes`` is not a permutation of range(ndim).
    """
    nd = len(x.shape)
    if axes is None:
        axes = tuple(range(nd - 1, -1, -1))
    axes = tuple(norm_axis(a, nd, "transpose", "axes") for a in axes)
    if sorted(axes) != list(range(nd)):
        raise ValueError(f"transpose: axes must be a permutation of 0..{nd - 1}, got {axes}")
    if axes == tuple(range(nd)):
        return identity(x)
    return apply(TRANSPOSE, x, axes=axes)


def swapaxes(x, a, b):
    """Exchange two axes (a view)."""
    nd = len(x.shape)
    a, b = norm_axis(a, nd, "swapaxes"), norm_axis(b, nd, "swapaxes")
    axes = list(range(nd))
    axes[a], axes[b] = axes[b], axes[a]
    return transpose(x, tuple(axes))


def expand_dims(x, axis):
    """Insert a size-1 axis at ``axis`` (a view)."""
    nd = len(x.shape) + 1
    axis = norm_axis(axis, nd, "expand_dims")
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


def squeeze(x, axis=None):
    """Remove size-1 axes (all of them, or those in ``axis``).

    Raises:
        ValueError: an axis in ``axis`` does not have size 1.
    """
    if axis is None:
        return reshape(x, tuple(s for s in x.shape if s != 1))
    axes = norm_axes(axis, len(x.shape), "squeeze")
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"squeeze: axis {a} has size {x.shape[a]}, expected 1 (shape {x.shape})")
    return reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


def flatten(x):
    """Collapse all but the first axis: (N, ...) -> (N, prod(...))."""
    return reshape(x, (x.shape[0], numel(x.shape[1:])) if len(x.shape) else (1,))


def _bt_infer(x, shape):
    if any(s < 0 for s in shape):
        raise ValueError(f"broadcast_to: shape sizes must be >= 0, got {shape}")
    broadcast_shape_to("broadcast_to", x.shape, shape)
    return [(shape, x.dtype)]


def broadcast_shape_to(name, src, dst):
    if len(src) > len(dst) or any(s not in (1, d) for s, d in zip(src[::-1], dst[::-1])):
        raise ValueError(f"{name}: cannot broadcast shape {src} to {dst}")


BROADCAST_TO = register("broadcast_to", lambda x, shape: np.broadcast_to(x, shape), _bt_infer,
                        lambda c, g: (sum_to(g, c.inputs[0].shape),),
                        cost=lambda i, o, s, **a: (0.0, 0.0))


def broadcast_to(x, shape):
    """Broadcast ``x`` to ``shape`` (NumPy rules; a read-only view)."""
    shape = _int_sizes("broadcast_to", shape)
    if shape == tuple(x.shape):
        return identity(x)
    return apply(BROADCAST_TO, x, shape=shape)


def _sum_to_axes(src, dst):
    lead = len(src) - len(dst)
    axes = tuple(range(lead)) + tuple(i + lead for i, d in enumerate(dst) if d == 1 and src[i + lead] != 1)
    return axes


def _sum_to_kernel(x, shape, out=None):
    axes = _sum_to_axes(x.shape, shape)
    r = np.sum(x, axis=axes, keepdims=True, dtype=x.dtype)
    return r.reshape(shape)


def _sum_to_infer(x, shape):
    broadcast_shape_to("sum_to", shape, x.shape)
    return [(shape, x.dtype)]


SUM_TO = register("sum_to", _sum_to_kernel, _sum_to_infer,
                  lambda c, g: (broadcast_to(g, c.inputs[0].shape),), _red_cost)


def sum_to(x, shape):
    """Sum ``x`` down to ``shape`` (the adjoint of broadcasting: sums leading axes and the axes
    where ``shape`` has 1)."""
    shape = tuple(shape)
    if shape == tuple(x.shape):
        return identity(x)
    return apply(SUM_TO, x, shape=shape)


# -- basic indexing ----------------------------------------------------------------------


def encode_key(key):
    """Turn a basic-indexing key into a hashable tuple (slices are not hashable before 3.12)."""
    if not isinstance(key, tuple):
        key = (key,)
    out = []
    for k in key:
        if isinstance(k, slice):
            out.append(("s", k.start, k.stop, k.step))
        elif k is None:
            out.append(("n",))
        elif k is Ellipsis:
            out.append(("e",))
        elif isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
            out.append(("i", int(k)))
        else:
            raise TypeError(f"index: expected ints, slices, None or Ellipsis (use take() for "
                            f"integer arrays), got {type(k).__name__}")
    return tuple(out)


def decode_key(ek):
    out = []
    for k in ek:
        t = k[0]
        out.append(slice(*k[1:]) if t == "s" else None if t == "n" else Ellipsis if t == "e" else k[1])
    return tuple(out)


def _probe(shape):
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))


def _slice_infer(x, key):
    try:
        shape = _probe(x.shape)[decode_key(key)].shape
    except IndexError as e:
        raise IndexError(f"index: {e} (array shape {x.shape})") from None
    return [(shape, x.dtype)]


def _g_slice(c, g):
    return (slice_grad(g, c.inputs[0].shape, c.attrs["key"]),)


SLICE = register("slice", lambda x, key: x[decode_key(key)], _slice_infer, _g_slice,
                 cost=lambda i, o, s, **a: (0.0, 0.0))


def _slice_grad_kernel(g, shape, key):
    out = np.zeros(shape, g.dtype)
    out[decode_key(key)] = g
    return out


SLICE_GRAD = register("slice_grad", _slice_grad_kernel,
                      lambda g, shape, key: [(shape, g.dtype)],
                      lambda c, g: (apply(SLICE, g, key=c.attrs["key"]),))


def slice_(x, key):
    """Basic indexing ``x[key]`` (ints, slices, None, Ellipsis) without a copy; writes to the
    result never reach ``x`` (arrays are not written in place).

    Raises:
        TypeError: a key element that is not an int, slice, None or Ellipsis (a tuple or list
            of indices is integer-array indexing: use ``take``)."""
    return apply(SLICE, x, key=encode_key(key))


def slice_grad(g, shape, key):
    """Adjoint of ``slice_``: zeros of ``shape`` with ``g`` placed at ``key``."""
    return apply(SLICE_GRAD, g, shape=tuple(shape), key=key)


# -- take / one_hot ----------------------------------------------------------------------


def _take_infer(a, idx, axis, mode):
    if idx.dtype.kind not in "iu":
        raise TypeError(f"take: indices must be an integer array, got dtype {idx.dtype}")
    if a.shape[axis] == 0 and numel(idx.shape):
        raise IndexError(f"take: cannot take {numel(idx.shape)} index(es) from axis {axis} of "
                         f"size 0 (array shape {tuple(a.shape)})")
    return [(a.shape[:axis] + tuple(idx.shape) + a.shape[axis + 1:], a.dtype)]


def _take_kernel(a, idx, axis, mode):
    if mode == "raise":
        n = a.shape[axis]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"take: index out of range for axis {axis} of size {n} "
                             f"(min {idx.min()}, max {idx.max()})")
    return np.take(a, idx, axis=axis, mode="wrap" if mode == "raise" else mode)


def _g_take(c, g):
    a, idx = c.inputs
    return take_grad(g, idx, a.shape, c.attrs["axis"], c.attrs["mode"]), None


TAKE = register("take", _take_kernel, _take_infer, _g_take)


def _take_grad_kernel(g, idx, shape, axis, mode="clip"):
    n = shape[axis]
    if n == 0 or idx.size == 0:
        return np.zeros(shape, g.dtype)
    # the rows the forward read: clip mode clips (negatives to 0), wrap/raise wrap modulo n
    idx = (np.clip(idx, 0, n - 1) if mode == "clip" else np.mod(idx, n)).ravel()
    lead = numel(shape[:axis])
    # bring g to (lead, idx.size, trail) and scatter-add rows along axis with np.add.at
    trail = numel(shape[axis + 1:])
    g3 = np.ascontiguousarray(g).reshape(lead, idx.size, trail)
    out = np.zeros((lead, n, trail), g.dtype)
    for i in range(lead):
        np.add.at(out[i], idx, g3[i])
    return out.reshape(shape)


TAKE_GRAD = register("take_grad", _take_grad_kernel,
                     lambda g, idx, shape, axis, mode="clip": [(shape, g.dtype)],
                     # linear in g: the adjoint of the scatter-add is the gather
                     lambda c, gg: (take(gg, c.inputs[1], axis=c.attrs["axis"],
                                         mode=c.attrs.get("mode", "clip")), None))


def take(a, indices, axis=0, mode="clip"):
    """Gather along ``axis`` with an integer index array: shape
    a.shape[:axis] + indices.shape + a.shape[axis+1:].

    mode: 'clip' (indices clipped to the valid range), 'wrap', or 'raise' (error at the next
    sync point for indices outside ``[-n, n)``, n the axis size; negative ones count from the
    end, as in NumPy's ``take(mode='raise')`` and Python indexing).

    Raises:
        ValueError: an unknown mode, or axis out of range. TypeError: non-integer indices.
        IndexError: indices taken from an empty axis.
    """
    if mode not in ("clip", "wrap", "raise"):
        raise ValueError(f"take: mode must be 'clip', 'wrap' or 'raise', got {mode!r}")
    axis = norm_axis(axis, len(a.shape), "take")
    return apply(TAKE, a, indices, axis=axis, mode=mode)


def take_grad(g, indices, shape, axis, mode="clip"):
    """Adjoint of ``take``: scatter-add ``g`` into zeros of ``shape`` at ``indices`` (resolved
    with the forward's ``mode``: 'clip' clips, 'wrap'/'raise' wrap modulo the axis size)."""
    return apply(TAKE_GRAD, g, indices, shape=tuple(shape), axis=axis, mode=mode)


def _one_hot_infer(idx, depth, dtype):
    if idx.dtype.kind not in "iu":
        raise TypeError(f"one_hot: indices must be integers, got dtype {idx.dtype}")
    return [(tuple(idx.shape) + (depth,), np.dtype(dtype))]


def _one_hot_kernel(idx, depth, dtype):
    out = np.zeros(idx.shape + (depth,), dtype)
    valid = (idx >= 0) & (idx < depth)
    np.put_along_axis(out, np.where(valid, idx, 0)[..., None], valid[..., None].astype(dtype), -1)
    return out


ONE_HOT = register("one_hot", _one_hot_kernel, _one_hot_infer)


def one_hot(indices, depth, dtype="float32"):
    """One-hot encoding: shape indices.shape + (depth,); out-of-range indices give all zeros.

    Raises:
        ValueError: depth < 1.
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
        raise ValueError(f"one_hot: depth must be an integer >= 1, got {depth!r}")
    return apply(ONE_HOT, indices, depth=int(depth), dtype=as_dtype(dtype).name)


# -- concat / stack / split -------------------------------------------------------------


def _concat_infer(*xs, axis):
    first = xs[0].shape
    for i, x in enumerate(xs[1:], 1):
        if len(x.shape) != len(first) or any(a != b for j, (a, b) in enumerate(zip(x.shape, first)) if j != axis):
            raise ValueError(f"concat: input {i} has shape {x.shape}, incompatible with input 0 "
                             f"of shape {first} along axis {axis}")
    d = xs[0].dtype
    for x in xs[1:]:
        d = promote(d, x.dtype)
    n = builtins.sum(x.shape[axis] for x in xs)
    return [(first[:axis] + (n,) + first[axis + 1:], d)]


def _concat_kernel(*xs, axis, out=None):
    d = xs[0].dtype
    for x in xs[1:]:
        d = promote(d, x.dtype)
    return np.concatenate(xs, axis=axis, out=out, dtype=None if out is not None else d)


def _g_concat(c, g):
    axis = c.attrs["axis"]
    idx = np.cumsum([x.shape[axis] for x in c.inputs])[:-1].tolist()
    if len(c.inputs) == 1:
        return (g,)
    return tuple(split(g, idx, axis=axis))


CONCAT = register("concat", _concat_kernel, _concat_infer, _g_concat)


def concat(*arrays, axis=0):
    """Join arrays along an existing axis (shapes must agree elsewhere); a list or tuple of
    arrays may be given as the one argument.

    Raises:
        ValueError: no arrays, an axis out of range, or shapes that differ off the axis.
    """
    if len(arrays) == 1 and isinstance(arrays[0], (list, tuple)):
        arrays = tuple(arrays[0])
    if not arrays:
        raise ValueError("concat: expected at least one array")
    axis = norm_axis(axis, len(arrays[0].shape), "concat")
    return apply(CONCAT, *arrays, axis=axis)


def stack(*arrays, axis=0):
    """Join arrays of equal shape along a new axis."""
    if len(arrays) == 1 and isinstance(arrays[0], (list, tuple)):
        arrays = tuple(arrays[0])
    if not arrays:
        raise ValueError("stack: expected at least one array")
    s = arrays[0].shape
    for i, x in enumerate(arrays):
        if x.shape != s:
            raise ValueError(f"stack: all arrays must have the same shape; input {i} has "
                             f"{x.shape}, input 0 has {s}")
    axis = norm_axis(axis, len(s) + 1, "stack")
    return concat(*[expand_dims(x, axis) for x in arrays], axis=axis)


def _split_infer(x, bounds, axis):
    out = []
    for lo, hi in bounds:
        out.append((x.shape[:axis] + (hi - lo,) + x.shape[axis + 1:], x.dtype))
    return out


def _split_kernel(x, bounds, axis):
    sl = [slice(None)] * x.ndim
    res = []
    for lo, hi in bounds:
        sl[axis] = slice(lo, hi)
        res.append(x[tuple(sl)])
    return tuple(res)


def _g_split(c, *gs):
    gs = [zeros_like_op(o) if g is None else g for g, o in zip(gs, c.outputs)]
    return (concat(*gs, axis=c.attrs["axis"]),)


def split(x, indices_or_sections, axis=0, squeeze_axis=False):
    """Split along ``axis`` into equal sections (an int) or at the given indices (a list).

    Returns a list of arrays (views).

    Raises:
        ValueError: an int number of sections that does not divide the axis.
    """
    axis = norm_axis(axis, len(x.shape), "split")
    n = x.shape[axis]
    if isinstance(indices_or_sections, (int, np.integer)):
        k = int(indices_or_sections)
        if k < 1 or n % k:
            raise ValueError(f"split: axis {axis} of size {n} cannot be split into {k} equal sections")
        cuts = [n // k * i for i in range(1, k)]
    else:
        cuts = [int(i) + n if int(i) < 0 else int(i) for i in indices_or_sections]
    edges = [0] + cuts + [n]
    bounds = []
    for a, b in zip(edges[:-1], edges[1:]):       # NumPy: x[a:b] per piece (empty when b < a)
        a = builtins.min(builtins.max(a, 0), n)
        b = builtins.min(builtins.max(b, 0), n)
        bounds.append((a, builtins.max(a, b)))
    bounds = tuple(bounds)
    op = _split_op(len(bounds))
    outs = apply(op, x, bounds=bounds, axis=axis)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if squeeze_axis:
        outs = [squeeze(o, axis) for o in outs]
    return outs


_SPLIT_OPS = {}


def _split_op(k):
    op = _SPLIT_OPS.get(k)
    if op is None:
        op = _SPLIT_OPS[k] = register(f"split{k}" if k > 1 else "split", _split_kernel if k > 1 else
                                      (lambda x, bounds, axis: _split_kernel(x, bounds, axis)[0]),
                                      _split_infer, _g_split, n_out=k)
        op.grad_reads = NO_VALUES
    return op


def identity(x):
    """Return ``x`` unchanged (an op in graphs: a copy point)."""
    return apply(IDENTITY, x)


IDENTITY = register("identity", lambda x: x, _same, lambda c, g: (g,),
                    cost=lambda i, o, s, **a: (0.0, 0.0))


def stop_gradient(x):
    """Identity whose gradient is zero (``detach`` inside traced code)."""
    return apply(STOP_GRADIENT, x)


STOP_GRADIENT = register("stop_gradient", lambda x: x, _same, lambda c, g: (None,),
                         cost=lambda i, o, s, **a: (0.0, 0.0))

