"""Parameter: a named array (one copy per device) with its gradient and training settings."""
import re
import threading
from collections import OrderedDict

from .. import init as _init
from ..device import Device, current_device
from ..graph import trace as _trace
from ..ops._util import as_dtype

__all__ = ["Parameter", "ParameterDict", "DeferredInitializationError"]


class DeferredInitializationError(RuntimeError):
    """A parameter's shape is not known yet: run one forward pass first."""


# one lock for every deferred initialization (rare: each parameter's first forward)
_DEFERRED_LOCK = threading.RLock()

# bumped whenever a parameter's copies (the NDArray objects of ``_data``) or its grad_req
# change: a hybridized block keeps the arrays of its last call while this stays the same
DATA_VERSION = [0]


class Parameter:
    """A trainable (or state) array of a Block, with one copy per device.

    Args:
        name (str): set by the owning Block (its attribute path, e.g. ``'0.weight'``).
        shape (tuple): may contain 0 for dimensions inferred on the first forward
            (deferred initialization).
        dtype: float32 (default) or float64.
        init: an Initializer (or name) that overrides the one given to ``initialize``.
        grad_req: 'write' (default), 'add' or 'null' (no gradient, e.g. BatchNorm statistics).
        lr_mult, wd_mult (float >= 0): multipliers of the optimizer's learning rate / weight
            decay.

    Raises:
        ValueError: bad grad_req or shape; lr_mult or wd_mult negative, NaN or infinite.
        TypeError: lr_mult or wd_mult not a number.
    """

    def __init__(self, name="param", shape=None, dtype="float32", init=None, grad_req="write",
                 lr_mult=1.0, wd_mult=1.0, allow_deferred_init=True, differentiable=True):
        self.name = name
        self._shape = None if shape is None else tuple(int(s) for s in shape)
        self.dtype = as_dtype(dtype)
        self.init = _init.create(init)
        # the layer's choice when neither the parameter nor initialize() names one (before
        # Xavier): Embedding's uniform, as Gluon's global default, which initialize(init) beats
        self.fallback_init = None
        if grad_req not in ("write", "add", "null"):
            raise ValueError(f"grad_req: expected 'write', 'add' or 'null', got {grad_req!r}")
        self._grad_req = grad_req if differentiable else "null"
        self.lr_mult = lr_mult          # (checked by the properties below)
        self.wd_mult = wd_mult
        self.allow_deferred_init = allow_deferred_init
        self._data = None          # OrderedDict device -> NDArray
        self._deferred = None      # (init, devices) waiting for the shape

    # ------------------------------------------------------------------ shape / status
    @property
    def shape(self):
        return self._shape

    @shape.setter
    def shape(self, new):
        self._shape = self._compatible(new)

    def _compatible(self, new):
        new = tuple(int(s) for s in new)
        if self._shape is not None:
            if len(new) != len(self._shape) or any(a and a != b for a, b in zip(self._shape, new)):
                raise ValueError(f"Parameter {self.name!r}: expected shape compatible with "
                                 f"{self._shape}, got {new}")
        return new

    @property
    def lr_mult(self):
        """Multiplier of the optimizer's learning rate for this parameter (a finite number
        >= 0; 0 freezes it without dropping its gradient)."""
        return self._lr_mult

    @lr_mult.setter
    def lr_mult(self, v):
        self._lr_mult = _multiplier("lr_mult", v, self.name)

    @property
    def wd_mult(self):
        """Multiplier of the optimizer's weight decay for this parameter (a finite number
        >= 0)."""
        return self._wd_mult

    @wd_mult.setter
    def wd_mult(self, v):
        self._wd_mult = _multiplier("wd_mult", v, self.name)

    @property
    def grad_req(self):
        return self._grad_req

    @grad_req.setter
    def grad_req(self, req):
        if req not in ("write", "add", "null"):
            raise ValueError(f"grad_req: expected 'write', 'add' or 'null', got {req!r}")
        if req == self._grad_req:       # unchanged (as Gluon): the gradient buffers, and what
            return                      # grad_req='add' accumulated in them, stay
        self._grad_req = req
        DATA_VERSION[0] += 1
        if self._data is not None:
            for a in self._data.values():
                a.attach_grad(req)

    def _shape_known(self):
        return self._shape is not None and all(s > 0 for s in self._shape)

    # ------------------------------------------------------------------ initialization
    def initialize(self, init=None, device=None, default_init=None, force_reinit=False,
                   _warn=True):
        """Allocate and fill the parameter on ``device`` (a Device or a list of Devices;
        default: the current device, ``cpu(0)`` outside a ``with device:`` block).

        The parameter's own ``init`` wins over ``init``, which wins over ``default_init``.
        When the shape is not yet known the initialization is deferred to the first forward.
        A parameter that already has values keeps them unless ``force_reinit`` (a
        RuntimeWarning says so).
        """
        if self._data is not None and not force_reinit:
            if _warn:
                import warnings
                warnings.warn(f"initialize: parameter {self.name!r} is already initialized and "
                              f"was left as it is; pass force_reinit=True to initialize it "
                              f"again", RuntimeWarning, stacklevel=2)
            return
        devices = _devices(device)
        chosen = (self.init or _init.create(init) or _init.create(default_init)
                  or self.fallback_init or _init.Xavier())
        if not self._shape_known():
            if not self.allow_deferred_init:
                raise ValueError(f"Parameter {self.name!r}: shape {self._shape} is unknown and "
                                 f"deferred initialization is not allowed")
            self._deferred = (chosen, devices)
            self._data = None
            DATA_VERSION[0] += 1
            return
        self._init_now(chosen, devices)

    def _init_now(self, init, devices, shape=None):
        from ..graph import trace as _trace
        # initial values are drawn eagerly, once, even when a traced forward finishes a
        # deferred initialization: they are the parameter's values, not part of the program
        with _trace.tracing(None):
            first = init(self._shape if shape is None else shape, self.dtype, devices[0])
        data = OrderedDict()
        for d in devices:
            arr = first if d == devices[0] else first.copyto(d)
            if self._grad_req != "null":
                arr.attach_grad(self._grad_req)
            data[d] = arr
        self._data = data                   # published complete (other threads read it)
        self._deferred = None
        DATA_VERSION[0] += 1

    def _finish_deferred_init(self, shape):
        """Called by a layer on its first forward once it knows ``shape``. Thread-safe: when
        several threads make the first call at once, one draws the values and the others
        wait for them; the shape becomes known only with the values (a layer that sees the
        shape known reads the data without waiting)."""
        if any(int(d) == 0 for d in shape):     # 0 stands for "not known yet"
            raise ValueError(f"Parameter {self.name!r}: the input gives it shape "
                             f"{tuple(int(d) for d in shape)}, with a size of 0 (an empty axis "
                             f"where the layer infers its size); nothing was initialized")
        with _DEFERRED_LOCK:
            new = self._compatible(shape)
            if self._deferred is not None and self._data is None:
                init, devices = self._deferred
                self._init_now(init, devices, new)
            self._shape = new

    # ------------------------------------------------------------------ access
    def _check_init(self):
        if self._data is None:
            if self._deferred is not None:
                raise DeferredInitializationError(
                    f"Parameter {self.name!r} has shape {self._shape} that will be inferred on the "
                    f"first forward pass; call the network on data before using its parameters")
            raise RuntimeError(f"Parameter {self.name!r} has not been initialized; call "
                               f"net.initialize() (or param.initialize()) first")

    def data(self, device=None):
        """The parameter's value on ``device`` (default: its first device).

        Inside hybridized code this returns the traced input standing for the parameter.

        Raises:
            RuntimeError: not initialized.  ValueError: no copy on ``device``.
        """
        if _trace._tls.__dict__.get("ctx") is not None:
            return _trace.current_param_value(self, device)
        d = self._data
        if d is None:
            self._check_init()
        if device is None:
            return next(iter(d.values()))
        arr = d.get(device)            # fast path: a Device key
        if arr is not None:
            return arr
        dev = Device.parse(device)
        arr = self._data.get(dev)
        if arr is None:
            raise ValueError(f"Parameter {self.name!r} has no copy on {dev!r}; it lives on "
                             f"{list(self._data)} (initialize it with device=[...] to add one)")
        return arr

    def list_data(self):
        """The copies on every device, in device order."""
        self._check_init()
        return list(self._data.values())

    def grad(self, device=None):
        """The gradient buffer on ``device`` (default: first device).

        Raises:
            RuntimeError: grad_req is 'null' or not initialized.
        """
        if self._grad_req == "null":
            raise RuntimeError(f"Parameter {self.name!r} has grad_req='null': no gradient")
        return self.data(device).grad

    def list_grad(self):
        """The gradient buffers on every device."""
        if self._grad_req == "null":
            raise RuntimeError(f"Parameter {self.name!r} has grad_req='null': no gradient")
        return [a.grad for a in self.list_data()]

    def list_device(self):
        """Devices holding a copy."""
        if self._data is None and self._deferred is not None:
            return list(self._deferred[1])
        self._check_init()
        return list(self._data)

    def set_data(self, value):
        """Set every copy to ``value`` (an NDArray or anything ``hl.nd.array`` accepts).

        Raises:
            ValueError: shape mismatch.
        """
        from .. import nd
        if not isinstance(value, nd.NDArray):
            value = nd.array(value, dtype=self.dtype)
        if self._data is None and self._deferred is not None:
            self._finish_deferred_init(value.shape)
        self._check_init()
        if tuple(value.shape) != self._shape:
            raise ValueError(f"Parameter {self.name!r}: set_data expected shape {self._shape}, "
                             f"got {value.shape}")
        for d, arr in self._data.items():
            arr._assign(value if value.device == d else value.copyto(d))

    def zero_grad(self):
        """Set the gradient buffers to zero."""
        if self._data is None or self._grad_req == "null":
            return
        for arr in self._data.values():
            arr.grad[...] = 0

    def reset_device(self, device):
        """Move the parameter to ``device`` (a Device or a list)."""
        devices = _devices(device)
        if self._data is None:
            if self._deferred is not None:
                self._deferred = (self._deferred[0], devices)
            return
        src = next(iter(self._data.values()))
        self._data = OrderedDict()
        for d in devices:
            arr = src.copyto(d)
            if self._grad_req != "null":
                arr.attach_grad(self._grad_req)
            self._data[d] = arr
        DATA_VERSION[0] += 1

    def __repr__(self):
        return f"Parameter {self.name} (shape={self._shape}, dtype={self.dtype})"


def _multiplier(what, v, name):
    """``v`` as a float: a finite number >= 0 (a negative lr_mult would climb the loss, NaN or
    inf would make the weights NaN).

    Raises:
        TypeError: not a number.  ValueError: negative, NaN or infinite."""
    import math
    import numbers
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"Parameter {name!r}: {what} must be a number, got {type(v).__name__} "
                        f"{v!r}")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"Parameter {name!r}: {what} must be a finite number >= 0, got {v!r}")
    return float(v)


def _devices(device):
    if device is None:              # the current device (``with hl.cpu(1):``), as Gluon's
        return [current_device()]   # current context; cpu(0) outside any
    if isinstance(device, (list, tuple)):
        if not device:
            raise ValueError("device: expected at least one device, got an empty list")
        devs = [Device.parse(d) for d in device]
        if len(set(devs)) != len(devs):
            raise ValueError(f"device: each device may appear once, got {devs}")
        return devs
    return [Device.parse(device)]


class ParameterDict(OrderedDict):
    """An ordered ``name -> Parameter`` mapping with bulk helpers."""

    def initialize(self, init=None, device=None, force_reinit=False, _stacklevel=2):
        """Initialize every parameter (see :meth:`Parameter.initialize`). Parameters that
        already have values keep them unless ``force_reinit``; a RuntimeWarning names them (a
        second ``net.initialize(...)`` with another initializer or device otherwise silently
        does nothing, as Gluon warns)."""
        kept = [p.name for p in self.values() if p._data is not None and not force_reinit]
        if kept:
            import warnings
            warnings.warn(f"initialize: {len(kept)} parameter(s) already initialized were left "
                          f"as they are ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''});"
                          f" pass force_reinit=True to initialize them again", RuntimeWarning,
                          stacklevel=_stacklevel)
        for p in self.values():
            p.initialize(None, device, default_init=init, force_reinit=force_reinit, _warn=False)

    def zero_grad(self):
        """Zero every gradient buffer."""
        for p in self.values():
            p.zero_grad()

    def setattr(self, name, value):
        """Set an attribute (e.g. 'grad_req', 'lr_mult') on every parameter."""
        for p in self.values():
            setattr(p, name, value)

    def reset_device(self, device):
        for p in self.values():
            p.reset_device(device)

    def select(self, pattern):
        """The parameters whose names match the regular expression ``pattern``."""
        rx = re.compile(pattern)
        return ParameterDict((k, v) for k, v in self.items() if rx.match(k))
