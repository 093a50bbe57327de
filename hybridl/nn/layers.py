"""Layers: Dense, Conv2D, pooling, BatchNorm, Dropout, Flatten, Activation, Embedding, LayerNorm.

Each layer is a HybridBlock whose ``forward`` calls ``hl.nd`` ops on ``param.data(x.device)``,
so the same code runs eagerly, traced (hybridized) and on several devices. Input-dependent
dimensions (``in_units``, ``in_channels``) may be 0: they are inferred on the first forward
(deferred initialization).
"""
import numbers

import numpy as np

from .. import autograd
from .. import init as _init
from .. import nd as F
from ..kernels._check import is_int as _is_int
from ..kernels._check import pair
from .block import HybridBlock
from .parameter import Parameter

__all__ = ["Dense", "Conv2D", "MaxPool2D", "AvgPool2D", "GlobalAvgPool2D", "BatchNorm",
           "Dropout", "Flatten", "Activation", "LeakyReLU", "ELU", "Embedding", "LayerNorm"]


def _silu(x):
    """x * sigmoid(x) (SiLU / Swish-1; Elfwing et al. 2018, Ramachandran et al. 2017)."""
    return x * F.sigmoid(x)


def _softsign(x):
    """x / (1 + |x|)."""
    return x / (F.abs(x) + 1.0)


_ACTS = {"relu": F.relu, "sigmoid": F.sigmoid, "tanh": F.tanh, "softrelu": F.softplus,
         "softplus": F.softplus, "silu": _silu, "swish": _silu, "softsign": _softsign}


def _act(name):
    if name is None:
        return None
    if name not in _ACTS:
        raise ValueError(f"activation: expected one of {sorted(_ACTS)} or None, got {name!r}")
    return _ACTS[name]


def _data(p, x):
    return p.data(getattr(x, "device", None))


def _is_real(v):
    """A real number (Python or NumPy), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _pos_int(v, arg, layer, allow0=False):
    if not _is_int(v) or v < (0 if allow0 else 1):
        raise ValueError(f"{layer}: {arg} must be an integer >= {0 if allow0 else 1}, got {v!r}")
    return int(v)


class Dense(HybridBlock):
    """Fully connected layer: ``y = activation(x @ weight.T + bias)``.

    Shapes: x (N, ...) -> (N, units) when ``flatten`` (default) else (..., in) -> (..., units).
    weight (units, in_units), bias (units,).

    Raises:
        ValueError: units < 1 or an unknown activation.
    """

    def __init__(self, units, activation=None, use_bias=True, flatten=True, dtype="float32",
                 weight_initializer=None, bias_initializer="zeros", in_units=0):
        super().__init__()
        self._units = _pos_int(units, "units", "Dense")
        _pos_int(in_units, "in_units", "Dense", allow0=True)
        self._flatten = flatten
        self._act_name = activation
        self._act = _act(activation)
        self.weight = Parameter("weight", (units, in_units), dtype, weight_initializer)
        self.bias = Parameter("bias", (units,), dtype, bias_initializer) if use_bias else None
        object.__setattr__(self, "_known", False)

    def forward(self, x):
        if len(x.shape) < (2 if self._flatten else 1):
            raise ValueError(f"Dense: expected input of shape (N, ...) with at least 2 "
                             f"dimensions, got shape {tuple(x.shape)} (flatten=False "
                             f"takes (..., in_units))")
        if not (self._known or self._check_known()):
            in_units = 1
            for s in (x.shape[1:] if self._flatten else x.shape[-1:]):
                in_units *= s
            if in_units == 0:
                raise ValueError(f"Dense: cannot infer in_units from input shape "
                                 f"{tuple(x.shape)}: it has 0 features")
            self.weight._finish_deferred_init((self._units, in_units))
        if self._act_name == "relu":         # fused into the dense kernel
            return F.fully_connected(x, _data(self.weight, x),
                                     None if self.bias is None else _data(self.bias, x),
                                     self._flatten, act="relu")
        y = F.fully_connected(x, _data(self.weight, x),
                              None if self.bias is None else _data(self.bias, x), self._flatten)
        return self._act(y) if self._act else y

    def _check_known(self):
        # in_units known (given, or inferred by an earlier forward): then never looked up again
        object.__setattr__(self, "_known", self.weight._shape_known())
        return self._known

    def _extra_repr(self):
        return f"{self.weight.shape[1] or None} -> {self._units}, {self._act_name or 'linear'}"


class Conv2D(HybridBlock):
    """2-D convolution over NCHW input (im2col + GEMM).

    Shapes: x (N, in_channels, H, W) -> (N, channels, OH, OW); weight
    (channels, in_channels // groups, KH, KW); bias (channels,).

    Raises:
        ValueError: at construction, channels/kernel_size/strides/dilation/groups not integers
            >= 1 (an int or a pair), padding not integers >= 0, channels or in_channels not
            divisible by groups, a layout other than NCHW; at the call, input that is not 4-D
            or whose channels differ from in_channels.
    """

    def __init__(self, channels, kernel_size, strides=1, padding=0, dilation=1, groups=1,
                 activation=None, use_bias=True, in_channels=0, dtype="float32",
                 weight_initializer=None, bias_initializer="zeros", layout="NCHW"):
        super().__init__()
        if layout != "NCHW":
            raise ValueError(f"Conv2D: layout must be 'NCHW', got {layout!r}")
        self._channels = _pos_int(channels, "channels", "Conv2D")
        try:
            ks = (kernel_size, kernel_size) if _is_int(kernel_size) else tuple(kernel_size)
        except TypeError:
            ks = ()
        if len(ks) != 2 or not all(_is_int(k) and k >= 1 for k in ks):
            raise ValueError(f"Conv2D: kernel_size must be an int >= 1 or a pair of them, got "
                             f"{kernel_size!r}")
        for arg, v, low in (("strides", strides, 1), ("padding", padding, 0),
                            ("dilation", dilation, 1)):
            try:                    # refused here, not at the first call
                vals = pair(arg, v)
            except ValueError as e:
                raise ValueError(f"Conv2D: {e}") from None
            if min(vals) < low:
                raise ValueError(f"Conv2D: {arg} must be integers >= {low}, got {v!r}")
        self._kernel, self._strides, self._padding = tuple(int(k) for k in ks), strides, padding
        self._dilation, self._groups = dilation, _pos_int(groups, "groups", "Conv2D")
        if channels % groups:
            raise ValueError(f"Conv2D: channels={channels} must be divisible by groups={groups}")
        _pos_int(in_channels, "in_channels", "Conv2D", allow0=True)
        if in_channels % groups:
            raise ValueError(f"Conv2D: in_channels={in_channels} must be divisible by "
                             f"groups={groups}")
        self._act_name, self._act = activation, _act(activation)
        self.weight = Parameter("weight", (channels, in_channels // groups if in_channels else 0) + ks,
                                dtype, weight_initializer)
        self.bias = Parameter("bias", (channels,), dtype, bias_initializer) if use_bias else None

    def forward(self, x):
        if not self.weight._shape_known():
            if len(x.shape) != 4:
                raise ValueError(f"Conv2D: expected 4-D input (N, C, H, W), got shape {x.shape}")
            if x.shape[1] == 0 or x.shape[1] % self._groups:
                raise ValueError(f"Conv2D: the input's channels C={x.shape[1]} (shape "
                                 f"{tuple(x.shape)}) must be a positive multiple of "
                                 f"groups={self._groups}")
            self.weight._finish_deferred_init((self._channels, x.shape[1] // self._groups) + self._kernel)
        fused = self._act_name == "relu"      # fused into the convolution kernel
        y = F.conv2d(x, _data(self.weight, x), None if self.bias is None else _data(self.bias, x),
                     self._strides, self._padding, self._dilation, self._groups,
                     act="relu" if fused else None)
        return self._act(y) if self._act and not fused else y

    def _extra_repr(self):
        return f"{self.weight.shape[1] * self._groups or None} -> {self._channels}, kernel_size={self._kernel}, stride={self._strides}, padding={self._padding}"


class MaxPool2D(HybridBlock):
    """2-D max pooling (stride defaults to pool_size)."""

    def __init__(self, pool_size=2, strides=None, padding=0):
        super().__init__()
        _check_pool("MaxPool2D", pool_size, strides, padding)
        self._args = (pool_size, strides, padding)

    def forward(self, x):
        return F.max_pool2d(x, *self._args)

    def _extra_repr(self):
        return f"pool_size={self._args[0]}, strides={self._args[1]}, padding={self._args[2]}"


def _check_pool(layer, pool_size, strides, padding):
    """The pooling arguments' checks (kernel and stride ints >= 1, padding in [0, kernel // 2])
    at construction, as Conv2D does, instead of at the first call; on an input large enough
    for any window, so only the arguments can fail.

    Raises:
        ValueError / TypeError: naming the layer and the argument."""
    from ..kernels.pool import pool2d_output_shape
    try:
        pool2d_output_shape((1, 1, 1 << 30, 1 << 30), pool_size,
                            pool_size if strides is None else strides, padding)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("kernel:", "pool_size:", 1).replace("stride:", "strides:", 1)
        raise type(e)(f"{layer}: {msg}") from None


class AvgPool2D(HybridBlock):
    """2-D average pooling (stride defaults to pool_size)."""

    def __init__(self, pool_size=2, strides=None, padding=0, count_include_pad=True):
        super().__init__()
        _check_pool("AvgPool2D", pool_size, strides, padding)
        self._args = (pool_size, strides, padding, count_include_pad)

    def forward(self, x):
        return F.avg_pool2d(x, *self._args)


class GlobalAvgPool2D(HybridBlock):
    """Average over H, W: (N, C, H, W) -> (N, C, 1, 1)."""

    def forward(self, x):
        return F.global_avg_pool2d(x)


class Flatten(HybridBlock):
    """(N, ...) -> (N, prod(...))."""

    def forward(self, x):
        return F.flatten(x)


class Activation(HybridBlock):
    """Elementwise activation by name: 'relu', 'sigmoid', 'tanh', 'softrelu' (= 'softplus',
    log(1 + e^x)), 'silu' (= 'swish', x sigmoid(x)) or 'softsign' (x / (1 + |x|)). For
    leaky ReLU and ELU, which take a parameter, see :class:`LeakyReLU` and :class:`ELU`.

    Raises:
        ValueError: an unknown name.
    """

    def __init__(self, activation):
        super().__init__()
        if activation is None:
            raise ValueError(f"Activation: activation must be one of {sorted(_ACTS)}, got None")
        self._name = activation
        self._fn = _act(activation)

    def forward(self, x):
        return self._fn(x)

    def _extra_repr(self):
        return self._name


class _AlphaActivation(HybridBlock):
    """An activation with one parameter ``alpha`` >= 0 (the slope or scale of its negative
    side)."""

    def __init__(self, alpha):
        super().__init__()
        if not _is_real(alpha) or not alpha >= 0:
            raise ValueError(f"{type(self).__name__}: alpha must be a number >= 0, got {alpha!r}")
        self._alpha = float(alpha)

    def _extra_repr(self):
        return f"alpha={self._alpha}"


class LeakyReLU(_AlphaActivation):
    """``x if x > 0 else alpha * x`` (Maas et al. 2013); the gradient at 0 is ``alpha``, as
    PyTorch's. Shapes: any -> same.

    Raises:
        ValueError: ``alpha`` not a number >= 0.
    """

    def __init__(self, alpha=0.01):
        super().__init__(alpha)

    def forward(self, x):
        return F.where(x > 0, x, x * self._alpha)


class ELU(_AlphaActivation):
    """``x if x > 0 else alpha * (exp(x) - 1)`` (Clevert et al. 2016). Shapes: any -> same.
    The exponential is taken of 0 where x > 0, so large inputs give no inf (nor a NaN
    gradient through the branch not taken); the gradient at 0 is ``alpha``, as PyTorch's.

    Raises:
        ValueError: ``alpha`` not a number >= 0.
    """

    def __init__(self, alpha=1.0):
        super().__init__(alpha)

    def forward(self, x):
        pos = x > 0
        # exp of 0 where x > 0 (no inf); where, not minimum: the gradient at x = 0 is alpha
        # (PyTorch's), minimum would split it at the tie
        return F.where(pos, x, F.expm1(F.where(pos, F.zeros_like(x), x)) * self._alpha)


class Dropout(HybridBlock):
    """Inverted dropout with probability ``rate`` (active only in training mode).

    Raises:
        ValueError: rate outside [0, 1).
    """

    def __init__(self, rate):
        super().__init__()
        if not _is_real(rate) or not 0.0 <= rate < 1.0:
            raise ValueError(f"Dropout: rate must be a number in [0, 1), got {rate!r}")
        self._rate = float(rate)

    def forward(self, x):
        return F.dropout(x, self._rate, autograd.is_training())

    def _extra_repr(self):
        return f"p={self._rate}"


class BatchNorm(HybridBlock):
    """Batch normalization (Ioffe & Szegedy 2015) over axis ``axis`` (channels).

    Training mode (``autograd.record()`` or ``train_mode()``) uses batch statistics and updates
    ``running_mean``/``running_var`` (grad_req 'null', saved with the parameters):
    running = momentum * running + (1 - momentum) * batch. Predict mode uses the running ones.

    Shapes: x (N, C, ...) (2-D to 5-D) with C = x.shape[axis]; parameters (C,).

    Raises:
        ValueError: at construction, axis not an int, momentum not in [0, 1], epsilon not > 0;
            at the call, as :func:`hybridl.nd.batch_norm`.
    """

    def __init__(self, axis=1, momentum=0.9, epsilon=1e-5, center=True, scale=True,
                 in_channels=0, dtype="float32"):
        super().__init__()
        if not _is_int(axis):
            raise ValueError(f"BatchNorm: axis must be an int, got {axis!r}")
        if not _is_real(momentum) or not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm: momentum must be a number in [0, 1], got {momentum!r}")
        if not _is_real(epsilon) or not epsilon > 0:
            raise ValueError(f"BatchNorm: epsilon must be a number > 0, got {epsilon!r}")
        self._axis, self._momentum, self._eps = int(axis), float(momentum), float(epsilon)
        self.gamma = Parameter("gamma", (in_channels,), dtype, "ones",
                               grad_req="write" if scale else "null")
        self.beta = Parameter("beta", (in_channels,), dtype, "zeros",
                              grad_req="write" if center else "null")
        self.running_mean = Parameter("running_mean", (in_channels,), dtype, "zeros", grad_req="null")
        self.running_var = Parameter("running_var", (in_channels,), dtype, "ones", grad_req="null")

    def _params(self):
        return (self.gamma, self.beta, self.running_mean, self.running_var)

    def forward(self, x):
        if not -len(x.shape) <= self._axis < len(x.shape) or len(x.shape) < 2:
            raise ValueError(f"BatchNorm: axis={self._axis} is not a channel axis of input "
                             f"shape {tuple(x.shape)} (at least 2-D)")
        if not self.gamma._shape_known() or not self.running_var._shape_known():
            c = x.shape[self._axis]
            for p in self._params():        # each one: gamma.set_data() may have finished
                if not p._shape_known():    # only gamma's deferred shape
                    p._finish_deferred_init((c,))
        g, b, rm, rv = (_data(p, x) for p in self._params())
        return F.batch_norm(x, g, b, rm, rv, self._eps, self._momentum, autograd.is_training(),
                            self._axis)


class LayerNorm(HybridBlock):
    """Layer normalization over the last axis (Ba et al. 2016); gamma, beta (D,)."""

    def __init__(self, axis=-1, epsilon=1e-5, center=True, scale=True, in_channels=0,
                 dtype="float32"):
        super().__init__()
        if axis != -1:
            raise ValueError(f"LayerNorm: only axis=-1 is supported, got {axis}")
        if not _is_real(epsilon) or not epsilon > 0:
            raise ValueError(f"LayerNorm: epsilon must be a number > 0, got {epsilon!r}")
        self._eps = float(epsilon)
        self.gamma = Parameter("gamma", (in_channels,), dtype, "ones",
                               grad_req="write" if scale else "null")
        self.beta = Parameter("beta", (in_channels,), dtype, "zeros",
                              grad_req="write" if center else "null")

    def forward(self, x):
        if not x.shape:
            raise ValueError("LayerNorm: expected input with at least 1 dimension (normalized "
                             "over the last), got a 0-d array")
        if not self.gamma._shape_known() or not self.beta._shape_known():
            for p in (self.gamma, self.beta):
                if not p._shape_known():
                    p._finish_deferred_init((x.shape[-1],))
        return F.layer_norm(x, _data(self.gamma, x), _data(self.beta, x), self._eps)


class Embedding(HybridBlock):
    """Lookup table: indices (...) -> (..., output_dim); weight (input_dim, output_dim).

    Indices are integers, or floats holding them as MXNet's data iterators give (a float
    index is truncated toward zero, as MXNet's ``Embedding`` casts it: 1.7 reads row 1).
    Indices outside [0, input_dim) are clipped into it (MXNet's ``Embedding``; PyTorch raises
    instead): -1 reads row 0, input_dim reads the last row, and their gradients go there.
    The weight's initializer: ``weight_initializer``, else the one given to ``initialize()``,
    else uniform in [-0.07, 0.07] (Gluon's).

    Raises:
        ValueError: input_dim or output_dim not an integer >= 1."""

    def __init__(self, input_dim, output_dim, dtype="float32", weight_initializer=None):
        super().__init__()
        _pos_int(input_dim, "input_dim", "Embedding")
        _pos_int(output_dim, "output_dim", "Embedding")
        # weight_initializer, else initialize()'s init, else uniform (Gluon's Embedding)
        self.weight = Parameter("weight", (input_dim, output_dim), dtype, weight_initializer)
        self.weight.fallback_init = _init.create("uniform")

    def forward(self, x):
        return F.embedding(x, _data(self.weight, x))
