"""Shape/dtype helpers shared by op definitions (all run in the caller's thread)."""
import functools
import math

import numpy as np

SUPPORTED_DTYPES = (np.dtype("float32"), np.dtype("float64"), np.dtype("int32"),
                    np.dtype("int64"), np.dtype("bool"))
F32 = np.dtype("float32")
I64 = np.dtype("int64")
BOOL = np.dtype("bool")


def as_dtype(dtype, arg="dtype"):
    """Normalize a dtype spec (``'float32'``, ``np.float64``, ...) to a supported np.dtype.

    Raises:
        TypeError: not one of float32, float64, int32, int64, bool.
    """
    try:
        d = np.dtype(dtype)
    except (TypeError, ValueError):
        d = None
    # (``d is None`` first: NumPy compares None equal to float64, so a misspelled name
    # would otherwise pass the membership test)
    if d is None or d not in SUPPORTED_DTYPES:
        raise TypeError(f"{arg}: expected one of float32, float64, int32, int64, bool, "
                        f"got {dtype!r}")
    return d


@functools.lru_cache(maxsize=4096)
def promote(a, b):
    """Result dtype of a binary op: a float beats an int or bool (as in PyTorch); otherwise the
    wider of the two (NumPy's promotion)."""
    if a == b:
        return a
    fa, fb = a.kind == "f", b.kind == "f"
    if fa and not fb:
        return a
    if fb and not fa:
        return b
    return np.promote_types(a, b)


@functools.lru_cache(maxsize=4096)
def _bcast(sa, sb):
    return tuple(np.broadcast_shapes(sa, sb))


def broadcast_shape(name, sa, sb):
    """NumPy broadcasting of two shapes; ValueError naming the op and both shapes."""
    try:
        return _bcast(sa, sb)
    except ValueError:
        raise ValueError(f"{name}: shapes {sa} and {sb} cannot be broadcast together "
                         f"(NumPy broadcasting rules: trailing dimensions must be equal or 1)"
                         ) from None


def norm_axis(axis, ndim, name, arg="axis"):
    """Normalize one axis to ``0 <= axis < ndim``; ValueError when out of range."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: {arg} must be an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {arg}={axis} is out of range for an array of {ndim} "
                         f"dimension(s) (expected {-ndim} <= {arg} < {ndim})")
    return int(axis) % ndim


def norm_axes(axis, ndim, name):
    """Normalize ``None | int | tuple`` of axes to a sorted tuple (None -> all axes)."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        axes = tuple(sorted(norm_axis(a, ndim, name) for a in axis))
        if len(set(axes)) != len(axes):
            raise ValueError(f"{name}: repeated axis in {axis}")
        return axes
    return (norm_axis(axis, ndim, name),)


def reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def numel(shape):
    return math.prod(shape)


def check_float(name, x, arg="data"):
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {arg} must be float32 or float64, got {x.dtype}")
