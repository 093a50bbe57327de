"""Parameter initializers: ``Xavier``, ``Normal``, ``Uniform``, ``Zero``, ``One``, ``Constant``.

An initializer is called as ``init(shape, dtype, device) -> NDArray``; random ones draw from the
engine RNG, so ``hl.random.seed(n)`` makes initialization reproducible.
"""
import math
import numbers

from . import nd
from .ops._util import as_dtype

__all__ = ["Initializer", "Xavier", "Normal", "Uniform", "Zero", "One", "Constant", "create"]


def _finite(name, v):
    """``v`` as a float.

    Raises:
        TypeError: not a real number.  ValueError: NaN or infinite (every weight would be)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v!r}")
    return float(v)


class Initializer:
    """Base class: subclasses implement ``__call__(shape, dtype, device) -> NDArray``."""

    def __call__(self, shape, dtype, device):
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def _fans(shape):
    if len(shape) < 2:
        return float(shape[0] if shape else 1), float(shape[0] if shape else 1)
    rf = math.prod(shape[2:])
    return float(shape[1] * rf), float(shape[0] * rf)


class Xavier(Initializer):
    """Glorot & Bengio (2010) initialization.

    scale = sqrt(magnitude / factor) where factor is fan_in, fan_out or their mean ('avg');
    'uniform' draws U[-scale, scale], 'gaussian' N(0, scale). Defaults (uniform, avg, 3) give
    U[-sqrt(6 / (fan_in + fan_out)), +...], the paper's "normalized initialization".
    fan_in = shape[1] * prod(shape[2:]), fan_out = shape[0] * prod(shape[2:]).

    Raises:
        ValueError: unknown rnd_type / factor_type, or magnitude <= 0.
    """

    def __init__(self, rnd_type="uniform", factor_type="avg", magnitude=3.0):
        if rnd_type not in ("uniform", "gaussian"):
            raise ValueError(f"rnd_type: expected 'uniform' or 'gaussian', got {rnd_type!r}")
        if factor_type not in ("avg", "in", "out"):
            raise ValueError(f"factor_type: expected 'avg', 'in' or 'out', got {factor_type!r}")
        magnitude = _finite("magnitude", magnitude)
        if magnitude <= 0:
            raise ValueError(f"magnitude: expected > 0, got {magnitude}")
        self.rnd_type, self.factor_type, self.magnitude = rnd_type, factor_type, magnitude

    def __call__(self, shape, dtype, device):
        fi, fo = _fans(shape)
        factor = {"avg": (fi + fo) / 2.0, "in": fi, "out": fo}[self.factor_type]
        scale = math.sqrt(self.magnitude / max(factor, 1.0))
        if self.rnd_type == "uniform":
            return _drawn(nd.random.uniform, -scale, scale, shape, dtype, device)
        return _drawn(nd.random.normal, 0.0, scale, shape, dtype, device)


def _drawn(sampler, a, b, shape, dtype, device):
    """Random values for a parameter of ``dtype``: drawn in that float type, or for an integer
    (or bool) parameter drawn in float32 and cast, as before the samplers took float dtypes
    only (such parameters, e.g. counters kept with the model, mostly start at 0)."""
    from .ops._util import as_dtype
    if as_dtype(dtype).kind == "f":
        return sampler(a, b, shape, dtype, device)
    return sampler(a, b, shape, "float32", device).astype(dtype)


class Normal(Initializer):
    """N(0, sigma**2) (default sigma 0.01)."""

    def __init__(self, sigma=0.01):
        sigma = _finite("sigma", sigma)
        if sigma < 0:
            raise ValueError(f"sigma: expected >= 0, got {sigma}")
        self.sigma = sigma

    def __call__(self, shape, dtype, device):
        return _drawn(nd.random.normal, 0.0, self.sigma, shape, dtype, device)


class Uniform(Initializer):
    """U[-scale, scale] (default scale 0.07, MXNet's default)."""

    def __init__(self, scale=0.07):
        scale = _finite("scale", scale)
        if scale < 0:
            raise ValueError(f"scale: expected >= 0, got {scale}")
        self.scale = scale

    def __call__(self, shape, dtype, device):
        return _drawn(nd.random.uniform, -self.scale, self.scale, shape, dtype, device)


class Constant(Initializer):
    """Every element equal to ``value``."""

    def __init__(self, value):
        self.value = _finite("value", value)

    def __call__(self, shape, dtype, device):
        return nd.full(shape, self.value, dtype, device)


class Zero(Constant):
    """All zeros."""

    def __init__(self):
        super().__init__(0.0)


class One(Constant):
    """All ones."""

    def __init__(self):
        super().__init__(1.0)


_NAMES = {"xavier": Xavier, "normal": Normal, "uniform": Uniform, "zeros": Zero, "zero": Zero,
          "ones": One, "one": One}


def create(init):
    """An Initializer from an instance, a name ('xavier', 'zeros', ...) or None (-> None).

    Raises:
        ValueError: unknown name.
    """
    if init is None or isinstance(init, Initializer):
        return init
    if isinstance(init, str) and init.lower() in _NAMES:
        return _NAMES[init.lower()]()
    raise ValueError(f"init: expected an Initializer or one of {sorted(_NAMES)}, got {init!r}")


_ = as_dtype
