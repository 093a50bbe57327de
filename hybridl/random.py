"""Random numbers whose generator state is an engine Var.

Every random op reads and writes one Var, so random ops run in push order whatever the engine
and however many devices: ``hl.random.seed(n)`` makes a program reproducible with the naive and
the threaded engine alike. The generator is NumPy's PCG64 (``numpy.random.default_rng``).
"""
import numpy as np

from . import engine as _engine
from .device import Device, current_device
from .engine import Var
from .ops._util import F32, I64, as_dtype

__all__ = ["seed", "uniform", "normal", "randint", "shuffle"]


class _RngState:
    def __init__(self, name):
        self.var = Var(name, keep_clean=True)      # one failed random op must not poison it
        self.gen = np.random.default_rng()


# hl.random.* and the initializers draw from _state; the random ops of models (dropout masks,
# eager or in a compiled program) from _ops, a stream of their own: a layer whose shape is
# inferred is initialized at its first forward, which a hybridized block does while tracing,
# before the program draws any mask -- with one stream the masks and the later layers' initial
# weights would differ between the eager and the hybridized run
_state = _RngState("rng")
_ops = _RngState("rng.ops")


def seed(n):
    """Reset the generators: ``hl.random.*`` and the initializers draw from
    ``numpy.random.default_rng(n)``, the random ops of models (Dropout's masks) from
    ``numpy.random.default_rng([n, 1])`` (a stream of their own, so that initialization, which
    may happen at the first forward, never shifts the masks: eager and hybridized runs draw the
    same). Ordered after earlier random ops.

    Raises:
        ValueError: ``n`` is not a non-negative integer.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {n!r}")

    def reseed():
        _state.gen = np.random.default_rng(int(n))
        _ops.gen = np.random.default_rng([int(n), 1])

    # on a queue of its own: a seed is no device's work (pushed on cpu(0), it counted cpu(0)
    # as a device in use and halved the BLAS threads of a program that runs on cpu(1))
    _engine.push(reseed, [], [_state.var, _ops.var], ("rng", "seed"), name="seed")


def _not_traced(name):
    """Random draws inside traced code would be drawn once, at tracing, and frozen into the
    program as a constant (every call would reuse the same numbers): refused instead."""
    from .graph import trace as _trace
    if _trace.current_context() is not None:
        from .graph.ir import TracingError, _user_site
        raise TracingError(
            f"hl.random.{name} inside a hybridized forward / hl.jit function, at {_user_site()}: "
            f"its numbers would be drawn once when tracing and then reused by every call. Draw "
            f"them outside and pass them in as an input, use hl.nd.dropout (a random op of the "
            f"program), or run the block imperatively (hybridize(False))")


def _random_op(name, shape, dtype, device, draw):
    from .ndarray import NDArray, _check_shape
    _not_traced(name)
    shape = _check_shape(shape)
    dev = current_device() if device is None else Device.parse(device)
    out = NDArray(shape, dtype, dev)

    def run():
        out._data = np.asarray(draw(_state.gen, shape), dtype=dtype)

    _engine.push(run, [_state.var], [_state.var, out._var], dev, name=name)
    return out


def uniform(low=0.0, high=1.0, shape=(1,), dtype=None, device=None):
    """Samples from U[low, high); shape ``shape``, dtype default float32 (float64 allowed).

    Drawn in float64 and rounded to ``dtype``; a draw that rounds up to ``high`` is moved to
    the largest value below it, so the interval stays half-open in float32 too.

    Raises:
        ValueError: high < low, or a negative size. TypeError: a non-float dtype (integers:
            :func:`randint`).
    """
    if high < low:
        raise ValueError(f"uniform: high={high} must be >= low={low}")
    d = _float_dtype("uniform", dtype)

    below = None                # the largest value below high in d, when high is one number
    if isinstance(high, (int, float, np.number)) and isinstance(low, (int, float, np.number)) \
            and high > low:
        top = d.type(high)
        below = np.nextafter(top, d.type(-np.inf)) if top > d.type(low) else top

    def draw(g, s):
        r = g.uniform(low, high, s).astype(d, copy=False)
        if below is not None:
            np.minimum(r, below, out=r)
        return r
    return _random_op("uniform", shape, d, device, draw)


def _float_dtype(name, dtype):
    """``dtype`` (default float32) when it is a float dtype; TypeError otherwise."""
    d = as_dtype(dtype or F32)
    if d.kind != "f":
        raise TypeError(f"{name}: dtype must be float32 or float64, got {d.name}"
                        + ("; for integers use hl.nd.random.randint" if d.kind in "iu" else ""))
    return d


def normal(loc=0.0, scale=1.0, shape=(1,), dtype=None, device=None):
    """Samples from N(loc, scale**2); dtype default float32.

    Raises:
        ValueError: scale < 0. TypeError: a non-float dtype.
    """
    if scale < 0:
        raise ValueError(f"normal: scale must be >= 0, got {scale}")
    d = _float_dtype("normal", dtype)
    return _random_op("normal", shape, d, device,
                      lambda g, s: g.normal(loc, scale, s).astype(d, copy=False))


def randint(low, high=None, shape=(1,), dtype=None, device=None):
    """Integers uniform in [low, high) (``randint(n)`` means [0, n)); dtype default int64.

    Raises:
        ValueError: high <= low.
    """
    if high is None:
        low, high = 0, low
    if high <= low:
        raise ValueError(f"randint: high={high} must be > low={low}")
    d = as_dtype(dtype or I64)
    info = np.iinfo(d) if d.kind in "iu" else None
    if info is not None and (low < info.min or high - 1 > info.max):
        raise ValueError(f"randint: [low, high) = [{low}, {high}) does not fit dtype {d.name}")
    return _random_op("randint", shape, d, device, lambda g, s: g.integers(low, high, s))


def shuffle(x):
    """A copy of ``x`` with its first axis randomly permuted.

    Raises:
        ValueError: ``x`` is 0-d.
    """
    from .ndarray import NDArray
    _not_traced("shuffle")
    if not x.shape:
        raise ValueError("shuffle: x must have at least one dimension")
    out = NDArray(x.shape, x.dtype, x.device)

    def run():
        out._data = x._data[_state.gen.permutation(x.shape[0])]

    _engine.push(run, [_state.var, x._var], [_state.var, out._var], x.device, name="shuffle")
    return out
