"""Shared argument validation for the NumPy kernels (internal)."""

from __future__ import annotations

import numpy as np

__all__ = ["check_ndim", "check_float", "check_int", "pair", "check_out"]


def check_ndim(name: str, a: np.ndarray, ndim, what: str = "") -> None:
    """Raise ValueError unless ``a.ndim`` is ``ndim`` (an int or a tuple of allowed ints)."""
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if a.ndim not in allowed:
        exp = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(
            f"{name}: expected a {exp} array{(' ' + what) if what else ''}, "
            f"got {a.ndim}-D with shape {a.shape}"
        )


def check_float(name: str, a: np.ndarray) -> None:
    """Raise ValueError unless ``a`` has a floating dtype."""
    if a.dtype.kind != "f":
        raise ValueError(f"{name}: expected a floating-point array (float32/float64), got dtype {a.dtype}")


def is_int(v) -> bool:
    """An integer, Python or NumPy (``y.max() + 1``), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))



def check_int(name: str, v) -> int:
    """``v`` as an int; ValueError naming ``name`` unless it is an integer (not a bool, not a
    float such as 1.5, which ``int()`` would silently truncate)."""
    if not is_int(v):
        raise ValueError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    return int(v)


def pair(name: str, v) -> tuple[int, int]:
    """Normalise an int or a 2-sequence of ints to ``(int, int)``; ValueError naming ``name``
    otherwise (bools, floats and strings are refused rather than converted)."""
    if is_int(v):
        return int(v), int(v)
    try:
        a, b = v
    except (TypeError, ValueError):
        a = b = None
    if not (is_int(a) and is_int(b)):
        raise ValueError(f"{name}: expected an int or a pair (int, int), got {v!r}")
    return int(a), int(b)


def check_out(out, shape, dtype) -> None:
    """Raise ValueError if a caller-provided ``out`` buffer does not match ``shape``/``dtype``."""
    if out is None:
        return
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"out: expected shape {tuple(shape)} and dtype {np.dtype(dtype)}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )
    if not out.flags.writeable:
        raise ValueError("out: expected a writeable array, got a read-only one "
                         "(a broadcast view or an array with writeable=False)")
