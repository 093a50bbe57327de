"""NDArray: an asynchronous handle on an n-dimensional array.

An NDArray is (engine Var, shape, dtype, device, backend array once computed). Every operation
infers the result's shape and dtype in the caller's thread (so a mismatch raises at the user's
line), allocates the output handles, pushes the kernel to the engine and returns at once. Reading
values (``asnumpy()``, ``item()``, ``repr``, ``wait_to_read()``) waits for the writes that
produce them.

Storage is never mutated in place: a write (``x += y``, ``x[1:3] = v``, an optimizer update)
computes a new backend array and re-binds it, ordered by the engine as a write of ``x``'s Var.
Kernels may therefore return views of their inputs (reshape, transpose, slicing are free).
"""
import numbers
import operator
import sys

import numpy as np

from . import autograd as _ag
from . import engine as _engine
from .device import Device, cpu, current_device
from .engine import Var
from .engine.base import _DATA
from .ops import math as M
from .ops._util import F32, I64, as_dtype
from .ops.dispatch import register_interpreter
from .ops.registry import Op

__all__ = ["NDArray", "array", "zeros", "ones", "full", "empty", "arange", "zeros_like",
           "ones_like", "full_like", "empty_like", "waitall", "from_numpy"]


class NDArray:
    """An n-dimensional array whose computation runs asynchronously on the engine.

    Attributes:
        shape (tuple of int), dtype (numpy.dtype), device (Device), ndim, size.

    Create with :func:`array`, :func:`zeros`, ... rather than by calling the class.
    """

    __slots__ = ("_var", "_data", "shape", "dtype", "device", "_ag", "_grad", "_grad_req",
                 "_fresh", "_version", "_status", "__weakref__")
    # (_status, set on an accumulating gradient buffer only: a Var that takes the error of a
    # micro-batch whose gradient failed, see autograd.backward and Trainer.step)
    __array_priority__ = 1000.0       # numpy_scalar + NDArray -> NDArray.__radd__

    def __init__(self, shape, dtype, device, data=None):
        self._var = Var()
        self._data = data
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self._ag = None
        self._grad = None
        self._grad_req = "null"
        self._fresh = False        # a gradient buffer: written by backward since the last step
        self._version = 0          # bumped by every write pushed to this array (autograd checks it)

    # ------------------------------------------------------------------ sync points
    def wait_to_read(self):
        """Block until the value is computed.

        Raises:
            OpError: the op computing this array (or one it depends on) failed.
        """
        _engine._current.wait_for(self._var)     # (engine.wait_for, one frame less)
        return self

    def asnumpy(self):
        """A NumPy copy of the value (a sync point). Shape ``self.shape``, dtype ``self.dtype``."""
        _engine.wait_for(self._var)
        return np.array(self._data, copy=True)

    def numpy(self):
        """The same as :meth:`asnumpy` (PyTorch's name): a NumPy copy, a sync point."""
        return self.asnumpy()

    def item(self):
        """The value of a one-element array as a Python scalar (a sync point).

        Raises:
            ValueError: the array has more than one element.
        """
        if self.size != 1:
            raise ValueError(f"item: only one-element arrays can be converted, shape is {self.shape}")
        _engine.wait_for(self._var)
        return self._data.reshape(()).item()

    def tolist(self):
        """The values as (nested) Python lists of Python scalars (a sync point), as
        ``numpy.ndarray.tolist``."""
        return self.asnumpy().tolist()

    def __reduce__(self):
        """Pickled (within a program, e.g. to a multiprocessing worker) as its value, dtype
        and device: waits for pending writes; the engine's state is not part of it. Raises
        OpError when the value failed. (Files users exchange: save_parameters, safetensors.)"""
        return (_unpickle, (self.asnumpy(), str(self.device)))

    def copy(self):
        """A new array with the same values on the same device (asynchronous)."""
        return self.copyto(self.device)

    def __array__(self, dtype=None, copy=None):
        a = self.asnumpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self):
        try:
            vals = np.array2string(self.asnumpy(), separator=", ", threshold=200)
        except Exception as e:  # noqa: BLE001 - repr must not hide the failure nor raise
            vals = f"<error: {type(e).__name__}: {str(e).splitlines()[0]}>"
        return f"NDArray({vals}, shape={self.shape}, dtype={self.dtype}, device={self.device!r})"

    __str__ = __repr__

    def __bool__(self):
        if self.size != 1:          # NumPy's wording and advice
            raise ValueError(f"the truth value of an array with more than one element (shape "
                             f"{self.shape}) is ambiguous; use a.any() or a.all()"
                             if self.size else
                             "the truth value of an empty array is ambiguous; use a.size > 0")
        return bool(self.item())

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.kind not in "iu":
            raise TypeError(f"only integer arrays can be used as an index, dtype is {self.dtype}")
        return int(self.item())

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    __hash__ = object.__hash__

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def T(self):
        return M.transpose(self)

    @property
    def grad(self):
        """The gradient buffer attached by :meth:`attach_grad` (None otherwise)."""
        return self._grad

    @property
    def grad_req(self):
        return self._grad_req

    # ------------------------------------------------------------------ autograd
    def attach_grad(self, grad_req="write"):
        """Allocate a gradient buffer (zeros, same shape and dtype) and mark this array as a
        variable for autograd. ``grad_req``: 'write' (overwrite on backward), 'add'
        (accumulate) or 'null' (no gradient).

        Raises:
            ValueError: unknown grad_req.
        """
        if grad_req not in ("write", "add", "null"):
            raise ValueError(f"grad_req: expected 'write', 'add' or 'null', got {grad_req!r}")
        if grad_req != "null" and self.dtype.kind != "f":
            raise TypeError(f"attach_grad: only float arrays have gradients, this one is {self.dtype}")
        self._grad_req = grad_req
        self._ag = None
        self._grad = None if grad_req == "null" else zeros(self.shape, self.dtype, self.device)
        return self

    def __deepcopy__(self, memo):
        """A new array (new engine variable) holding a copy of the value (waits for it), the
        same ``grad_req`` and a copy of the gradient; a leaf for autograd. (The default deep
        copy duplicated the engine's bookkeeping, and waiting on the copy hung.)"""
        new = NDArray(self.shape, self.dtype, self.device, self.asnumpy())
        memo[id(self)] = new
        if self._grad_req != "null":
            new.attach_grad(self._grad_req)
            if self._grad is not None:
                new._grad._data = self._grad.asnumpy()
        return new

    def __copy__(self):
        """A shallow copy is the same array (NDArrays are handles, as in MXNet)."""
        return self

    def backward(self, out_grad=None, retain_graph=False):
        """Compute gradients of this array w.r.t. the variables it depends on (asynchronously)."""
        _ag.backward(self, out_grad, retain_graph=retain_graph)

    def detach(self):
        """The same value, cut from the autograd graph (shares storage)."""
        out = NDArray(self.shape, self.dtype, self.device)
        _assign_data(out, self)
        return out

    # ------------------------------------------------------------------ conversion / movement
    def astype(self, dtype, copy=True):
        """Convert to ``dtype`` (float32, float64, int32, int64, bool)."""
        d = as_dtype(dtype)
        if d == self.dtype and not copy:
            return self
        if d == self.dtype:
            return M.identity(self)
        return M.cast(self, d)

    def copyto(self, other):
        """Asynchronous copy to a Device (returns the new array) or into an NDArray (returns it).

        The copy is an engine op on the copy queue of the destination, so it overlaps with
        compute; reading the destination waits for it. Into an NDArray of another dtype the
        values are cast to it, as MXNet's ``copyto`` and PyTorch's ``copy_`` do (NumPy's
        ``astype`` rules: a float copied into an int array is truncated, one out of its range
        is undefined, every nonzero becomes True in a bool array).

        Raises:
            ValueError: ``other`` is an NDArray of a different shape.
            TypeError: ``other`` is neither a Device nor an NDArray.
        """
        if isinstance(other, (Device, str)):
            dev = Device.parse(other)
            out = NDArray(self.shape, self.dtype, dev)
        elif isinstance(other, NDArray):
            if other.shape != self.shape:
                raise ValueError(f"copyto: destination shape {other.shape} differs from source "
                                 f"shape {self.shape}")
            out = other
            out._version += 1
        else:
            raise TypeError(f"copyto: other must be a Device or an NDArray, got {type(other).__name__}")
        src = self
        dt = out.dtype

        def copy():
            out._data = np.array(src._data, dtype=dt, copy=True)

        _engine.push(copy, [src._var], [out._var], ("copy", out.device), name="copy",
                     meta=_copy_meta(src) if _engine.get_engine().profiler else None)
        if _ag.is_recording() and _tracked(self) and out is not self:
            _ag.record_op(_COPY, (self,), [out], {})
        return out

    def to(self, device):
        """``copyto(device)``; returns ``self`` when it is already there."""
        dev = Device.parse(device)
        return self if dev == self.device else self.copyto(dev)

    as_in_device = to

    def _assign(self, src, priority=0, skip_clean=False):
        """Write ``src``'s value into this array (an engine write of this Var, at ``priority``;
        ``skip_clean``: when ``src`` failed, this array keeps its value, see Engine.push)."""
        if isinstance(src, NDArray):
            if src.shape != self.shape:
                raise ValueError(f"assign: value of shape {src.shape} does not match destination "
                                 f"shape {self.shape}")
            _assign_data(self, src, priority, skip_clean)
        else:
            self[...] = src

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, key):
        if isinstance(key, NDArray) or _is_symbol(key):     # a traced index: in traced code
            if key.dtype.kind == "b":
                raise TypeError("boolean-mask indexing is not supported (data-dependent shape); "
                                "use hl.nd.where")
            return M.take(self, key, axis=0, mode="raise")
        if isinstance(key, (list, np.ndarray)):
            k = np.asarray(key)
            if k.dtype == bool:
                raise TypeError("boolean-mask indexing is not supported (data-dependent shape); "
                                "use hl.nd.where")
            if k.size == 0:
                k = k.astype(np.int64)
            return M.take(self, array(k, device=self.device), axis=0, mode="raise")
        return M.slice_(self, key)

    def __setitem__(self, key, value):
        unrecorded = False
        if _ag.is_recording():
            if _tracked(self) and not _ag._is_unrecorded(self):
                raise RuntimeError("in-place assignment to an array recorded by autograd would "
                                   "corrupt the gradient; assign outside autograd.record() or "
                                   "use a new array")
            # a recorded value written into an array is not recorded: the array is marked, so
            # that a backward whose gradient would have to pass through it raises (instead of
            # silently missing that path); logging a loss into a buffer stays fine
            unrecorded = isinstance(value, NDArray) and _tracked(value)
        self._setitem(key, value)
        if unrecorded:
            _ag._mark_unrecorded(self)

    def _setitem(self, key, value):
        ek = M.encode_key(key)
        sl = M._slice_infer(self, ek)[0][0]
        if isinstance(value, NDArray):
            M.broadcast_shape_to("__setitem__", value.shape, sl)
            v = value
        else:
            # a copy: the op runs later, and the caller may reuse its array meanwhile
            vv = np.array(value, dtype=self.dtype, copy=True)
            try:
                np.broadcast_to(vv, sl)
            except ValueError:
                raise ValueError(f"__setitem__: value of shape {vv.shape} cannot be broadcast to "
                                 f"the selected shape {sl}") from None
            v = _const(vv, self.device)
        if isinstance(value, NDArray) and value.device != self.device:
            raise ValueError(f"__setitem__: value is on {value.device!r}, the array on "
                             f"{self.device!r}; copy it with value.copyto({self.device!r})")
        dst = self
        self._version += 1
        pykey = M.decode_key(ek)
        if tuple(sl) == self.shape and all(k in (("e",), ("s", None, None, None)) for k in ek):
            dt = self.dtype              # the whole array is overwritten: its old value (or

            def fill():                  # an error stored on it) is not read
                dst._data = np.array(np.broadcast_to(v._data, sl), dtype=dt, copy=True)

            _engine.push(fill, [v._var], [dst._var], dst.device, name="setitem")
            return

        def setitem():
            new = np.array(dst._data, copy=True)    # (a 0-d result may be a NumPy scalar)
            new[pykey] = v._data
            dst._data = new

        _engine.push(setitem, [v._var, dst._var], [dst._var], dst.device, name="setitem")

    # ------------------------------------------------------------------ methods mirroring ops
    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return M.reshape(self, shape)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return M.transpose(self, axes or None)

    def flatten(self):
        return M.flatten(self)

    def expand_dims(self, axis):
        return M.expand_dims(self, axis)

    def squeeze(self, axis=None):
        return M.squeeze(self, axis)

    def broadcast_to(self, shape):
        return M.broadcast_to(self, shape)

    # dtype= and out= (keyword-only) are what NumPy passes when np.sum(x), np.mean(x), ...
    # are called on an NDArray: the result is the NDArray's reduction, as for a tensor
    def sum(self, axis=None, keepdims=False, *, dtype=None, out=None):
        """Sum over ``axis`` (None: all). ``dtype``: accumulate in that dtype; ``out``: only
        None (NumPy's protocol).

        Raises:
            TypeError: an ``out`` array."""
        return M.sum(_reduce_in(self, dtype, out, "sum"), axis, keepdims)

    def mean(self, axis=None, keepdims=False, *, dtype=None, out=None):
        """Mean over ``axis`` (see :meth:`sum` for ``dtype`` and ``out``)."""
        return M.mean(_reduce_in(self, dtype, out, "mean"), axis, keepdims)

    def max(self, axis=None, keepdims=False, *, out=None):
        """Maximum over ``axis`` (``out``: only None)."""
        return M.max(_reduce_in(self, None, out, "max"), axis, keepdims)

    def min(self, axis=None, keepdims=False, *, out=None):
        """Minimum over ``axis`` (``out``: only None)."""
        return M.min(_reduce_in(self, None, out, "min"), axis, keepdims)

    def prod(self, axis=None, keepdims=False, *, dtype=None, out=None):
        """Product over ``axis`` (see :meth:`sum` for ``dtype`` and ``out``)."""
        return M.prod(_reduce_in(self, dtype, out, "prod"), axis, keepdims)

    def argmax(self, axis=None, keepdims=False, *, out=None):
        """Index of the maximum along ``axis`` (``out``: only None)."""
        return M.argmax(_reduce_in(self, None, out, "argmax"), axis, keepdims)

    def argmin(self, axis=None, keepdims=False, *, out=None):
        """Index of the minimum along ``axis`` (``out``: only None)."""
        return M.argmin(_reduce_in(self, None, out, "argmin"), axis, keepdims)

    def exp(self):
        return M.exp(self)

    def log(self):
        return M.log(self)

    def sqrt(self):
        return M.sqrt(self)

    def square(self):
        return M.square(self)

    def tanh(self):
        return M.tanh(self)

    def sigmoid(self):
        return M.sigmoid(self)

    def relu(self):
        return M.relu(self)

    def abs(self):
        return M.abs(self)

    def sign(self):
        return M.sign(self)

    def clip(self, a_min=None, a_max=None):
        return M.clip(self, a_min, a_max)

    def dot(self, other):
        return M.dot(self, other)

    def take(self, indices, axis=0, mode="clip"):
        return M.take(self, indices, axis, mode)

    def one_hot(self, depth, dtype="float32"):
        return M.one_hot(self, depth, dtype)

    def split(self, indices_or_sections, axis=0):
        return M.split(self, indices_or_sections, axis)

    def zeros_like(self):
        return zeros_like(self)

    def ones_like(self):
        return ones_like(self)

    # ------------------------------------------------------------------ operators
    def __add__(self, o): return M.add(self, o)
    def __radd__(self, o): return M.add(o, self)
    def __sub__(self, o): return M.subtract(self, o)
    def __rsub__(self, o): return M.subtract(o, self)
    def __mul__(self, o): return M.multiply(self, o)
    def __rmul__(self, o): return M.multiply(o, self)
    def __truediv__(self, o): return M.divide(self, o)
    def __rtruediv__(self, o): return M.divide(o, self)
    def __pow__(self, o): return M.power(self, o)
    def __rpow__(self, o): return M.power(o, self)
    def __matmul__(self, o): return M.matmul(self, o)
    def __rmatmul__(self, o): return M.matmul(o, self)
    def __neg__(self): return M.negative(self)
    def __pos__(self): return M.identity(self)
    def __abs__(self): return M.abs(self)
    def __eq__(self, o): return M.equal(self, o)
    def __ne__(self, o): return M.not_equal(self, o)
    def __gt__(self, o): return M.greater(self, o)
    def __ge__(self, o): return M.greater_equal(self, o)
    def __lt__(self, o): return M.less(self, o)
    def __le__(self, o): return M.less_equal(self, o)
    # ~ & | ^ on bool arrays (masks); on integers NumPy's are bitwise, which hybridl does not
    # provide: an error, not a logical result in its place
    def __invert__(self): return M.logical_not(_bool_operand(self, "~"))
    def __and__(self, o): return M.logical_and(_bool_operand(self, "&"), _bool_operand(o, "&"))
    def __or__(self, o): return M.logical_or(_bool_operand(self, "|"), _bool_operand(o, "|"))
    def __xor__(self, o): return M.logical_xor(_bool_operand(self, "^"), _bool_operand(o, "^"))
    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def _inplace(self, fn, other, priority=0, skip_clean=False):
        """``self op= other`` as ONE engine op that reads and writes ``self`` (two ops would let
        another thread's update slip in between and be lost). ``priority``/``skip_clean``: as
        for :meth:`Engine.push`."""
        if _is_symbol(other):
            from .graph.ir import TracingError, _user_site
            raise TracingError(
                f"in-place update of an array made outside the traced values (e.g. acc = "
                f"nd.zeros(...)) with a traced value while hybridizing, at {_user_site()}: a "
                f"compiled program cannot write into it; start from a traced value instead "
                f"(acc = nd.zeros_like(x)), or write acc = acc + ...")
        if _ag.is_recording() and (_tracked(self) or (isinstance(other, NDArray) and _tracked(other))):
            raise RuntimeError("in-place update inside autograd.record() would not be recorded "
                               "(or would corrupt the gradient); write y = x + v instead of x += v")
        op = _INPLACE_OPS[fn]
        o = other
        if not isinstance(o, NDArray):
            o = _const(np.array(o, _scalar_dtype(o, self.dtype), copy=True), self.device)
        elif o.device != self.device:
            raise ValueError(f"{op.name}: inputs are on different devices, {self.device!r} and "
                             f"{o.device!r}; copy one with x.copyto({self.device!r})")
        (shape, dt), = op.infer(self, o)
        if tuple(shape) != self.shape:
            raise ValueError(f"in-place {op.name}: result shape {tuple(shape)} differs from the "
                             f"array's shape {self.shape}")
        if not np.can_cast(dt, self.dtype, "same_kind"):
            raise TypeError(f"in-place {op.name}: result dtype {dt} cannot be stored in this "
                            f"{self.dtype} array (NumPy's same_kind rule); use x = x {op.name} v")
        kernel, dst, mydt = op.kernel, self, self.dtype
        self._version += 1

        def run():
            r = kernel(dst._data, o._data)
            dst._data = r if r.dtype == mydt else r.astype(mydt)

        _engine.push(run, [o._var, dst._var], [dst._var], dst.device, priority,
                     f"{op.name}_inplace", skip_clean=skip_clean)
        return self

    def __iadd__(self, o): return self._inplace(M.add, o)
    def __isub__(self, o): return self._inplace(M.subtract, o)
    def __imul__(self, o): return self._inplace(M.multiply, o)
    def __itruediv__(self, o): return self._inplace(M.divide, o)


# Docstrings of the methods that mirror hl.nd functions: the function's own documentation.
_MIRRORS = {
    "reshape": M.reshape, "transpose": M.transpose, "flatten": M.flatten,
    "expand_dims": M.expand_dims, "squeeze": M.squeeze, "broadcast_to": M.broadcast_to,
    "sum": M.sum, "mean": M.mean, "max": M.max, "min": M.min, "prod": M.prod,
    "argmax": M.argmax, "argmin": M.argmin, "exp": M.exp, "log": M.log, "sqrt": M.sqrt,
    "square": M.square, "tanh": M.tanh, "sigmoid": M.sigmoid, "relu": M.relu, "abs": M.abs,
    "sign": M.sign, "clip": M.clip, "dot": M.dot, "take": M.take, "one_hot": M.one_hot,
    "split": M.split,
}
for _n, _f in _MIRRORS.items():
    getattr(NDArray, _n).__doc__ = f"Method form of ``hl.nd.{_f.__name__}(self, ...)``.\n\n{_f.__doc__}"
_OPERATORS = {
    "__add__": ("x + y", M.add), "__radd__": ("y + x", M.add), "__sub__": ("x - y", M.subtract),
    "__rsub__": ("y - x", M.subtract), "__mul__": ("x * y", M.multiply),
    "__rmul__": ("y * x", M.multiply), "__truediv__": ("x / y", M.divide),
    "__rtruediv__": ("y / x", M.divide), "__pow__": ("x ** y", M.power),
    "__rpow__": ("y ** x", M.power), "__matmul__": ("x @ y", M.matmul),
    "__rmatmul__": ("y @ x", M.matmul), "__neg__": ("-x", M.negative), "__abs__": ("abs(x)", M.abs),
    "__eq__": ("x == y", M.equal), "__ne__": ("x != y", M.not_equal), "__gt__": ("x > y", M.greater),
    "__ge__": ("x >= y", M.greater_equal), "__lt__": ("x < y", M.less),
    "__le__": ("x <= y", M.less_equal), "__invert__": ("~x", M.logical_not),
    "__and__": ("x & y", M.logical_and), "__or__": ("x | y", M.logical_or),
    "__xor__": ("x ^ y", M.logical_xor),
    "__iadd__": ("x += y (one engine op writing x)", M.add),
    "__isub__": ("x -= y (one engine op writing x)", M.subtract),
    "__imul__": ("x *= y (one engine op writing x)", M.multiply),
    "__itruediv__": ("x /= y (one engine op writing x)", M.divide),
}
for _n, (_expr, _f) in _OPERATORS.items():
    getattr(NDArray, _n).__doc__ = f"``{_expr}``: see ``hl.nd.{_f.__name__}``."
NDArray.__getitem__.__doc__ = ("``x[key]``: basic indexing (ints, slices, None, Ellipsis) returns a new "
                               "array that shares memory with ``x`` without copying; arrays are never "
                               "written in place, so writing to the result (``y[:] = 5``) changes "
                               "``y`` only, never ``x`` (as in JAX, unlike NumPy views); an "
                               "integer list / array gathers rows like NumPy (out-of-range raises at "
                               "the next sync point); boolean masks are not supported (use "
                               "``hl.nd.where``).")
NDArray.__setitem__.__doc__ = ("``x[key] = value``: an engine write of ``x`` (ordered after earlier "
                               "readers); ``value`` is a number, a NumPy array or an NDArray on the "
                               "same device, broadcast to the selected shape.")


# ============================================================================ internals

_INPLACE_OPS = {M.add: M.ADD, M.subtract: M.SUB, M.multiply: M.MUL, M.divide: M.DIV}


def _g_copy(c, g):
    src = c.inputs[0]
    return (g.to(src.device) if isinstance(g, NDArray) else g,)


# the autograd record of a copy between devices: its gradient is copied back to the source
_COPY = Op("copy", lambda x: x, lambda x: [(x.shape, x.dtype)], _g_copy)


def _copy_meta(src):
    nbytes = src.size * src.dtype.itemsize
    return {"flops": 0.0, "bytes": 2.0 * nbytes}


def _reduce_in(x, dtype, out, name):
    """``x`` in the dtype a reduction accumulates in (None: its own); ``out`` must be None."""
    if out is not None:
        raise TypeError(f"{name}: out= is not supported (NDArrays are not written in place by "
                        f"reductions); use the returned array")
    return x if dtype is None or as_dtype(dtype) == x.dtype else x.astype(dtype)


def _assign_data(dst, src, priority=0, skip_clean=False):
    """Engine op: dst's storage becomes src's value (cast to dst.dtype when they differ)."""
    dt = dst.dtype
    dst._version += 1

    def assign():
        d = src._data
        dst._data = d if d.dtype == dt else d.astype(dt)

    _engine.push(assign, [src._var], [dst._var], dst.device, priority, name="assign", pure=True,
                 skip_clean=skip_clean)


def assign_many(pairs, priority=0):
    """One engine op writing each ``src``'s value into its ``dst`` (pairs of NDArrays on one
    device, same shapes): e.g. every parameter gradient produced by one compiled backward op."""
    dsts = [d for d, _ in pairs]
    srcs = [s for _, s in pairs]
    for d in dsts:
        d._version += 1

    def assign():
        for d, s in zip(dsts, srcs):
            v = s._data
            d._data = v if v.dtype == d.dtype else v.astype(d.dtype)

    # fresh lists of Vars: the engine need not copy or check them
    _engine.get_engine().push_trusted(assign, [s._var for s in srcs], [d._var for d in dsts],
                                      dsts[0].device, priority, f"assign[{len(pairs)}]", None, True)


_tracked = _ag._tracked


def _const(value, device):
    """A ready NDArray holding ``value`` (a NumPy array, not copied)."""
    return NDArray(value.shape, value.dtype, device, value)


def _operand_like(inputs, array_types, like):
    """The dtype a scalar operand takes (the eager and the tracing interpreters share it):
    the first array's, or when that is a bool condition/mask, the first non-bool array's."""
    if like is not None and like.kind == "b":
        like = next((a.dtype for a in inputs
                     if isinstance(a, array_types) and a.dtype.kind != "b"), like)
    return like


# comparisons of an integer (or bool) array with a float scalar compare in float64, as NumPy:
# the result is bool, so no float32 result type is at stake, and a float32 scalar compared
# 3 < 3.0000001 as False and 16777217 == 16777217.0 as False
_COMPARE = frozenset({"equal", "not_equal", "greater", "greater_equal", "less", "less_equal"})


def _scalar_value(x, like, name):
    """Scalar operand ``x`` of op ``name`` as a 0-d NumPy array of its dtype (see
    :func:`_scalar_dtype`; float64 for a float compared with an integer array); TypeError for a
    complex number."""
    if isinstance(x, numbers.Complex) and not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: complex numbers are not supported, got {x!r}")
    dt = _scalar_dtype(x, like)
    if name in _COMPARE and like.kind in "biu" and dt.kind == "f":
        dt = np.dtype(np.float64)
    return np.asarray(x, dt)


def _bool_operand(x, sym):
    """``x`` when it is a bool array or scalar (an operand of ``~ & | ^``).

    Raises:
        TypeError: another dtype (NumPy's operators are bitwise on integers)."""
    dt = getattr(x, "dtype", None)
    if isinstance(x, (bool, np.bool_)) or (dt is not None and np.dtype(dt).kind == "b"):
        return x
    what = f"dtype {dt}" if dt is not None else type(x).__name__
    raise TypeError(f"operator {sym}: expected bool operands (masks), got {what}; bitwise "
                    f"integer operators are not supported (use hl.nd.logical_and/or/xor/not for "
                    f"truth values)")


def _scalar_dtype(value, like):
    if isinstance(value, (bool, np.bool_)):
        return like if like.kind != "b" else np.dtype(bool)
    if isinstance(value, numbers.Integral):
        dt = I64 if like.kind == "b" else like
        if dt.kind in "iu":
            # as NumPy does for a Python int: a NumPy integer scalar (np.int64(2**32 + 1) with
            # an int32 array) must not wrap around silently in the C cast
            info = np.iinfo(dt)
            if not info.min <= int(value) <= info.max:
                hint = ("a wider array (x.astype('int64')) or a float" if dt.itemsize < 8
                        else "a float (x.astype('float64')): int64 is the widest integer dtype")
                raise OverflowError(f"integer {int(value)} does not fit the array's dtype {dt} "
                                    f"(range [{info.min}, {info.max}]); use {hint}")
        return dt
    if like.kind == "f":
        return like
    return F32


def _eager(op, inputs, attrs):
    """The eager interpreter: infer now, push the kernel, record for autograd."""
    dev = None
    like = None
    arrs = []
    mixed = False
    for x in inputs:                       # fast path: all NDArrays on one device
        if type(x) is NDArray or isinstance(x, NDArray):
            if dev is None:
                dev, like = x.device, x.dtype
            elif x.device is not dev and x.device != dev:
                raise ValueError(f"{op.name}: inputs are on different devices, {dev!r} and "
                                 f"{x.device!r}; copy one with x.copyto({dev!r}) or x.to(...)")
            arrs.append(x)
        else:
            mixed = True
            arrs.append(x)
    if mixed:                              # scalars / NumPy arrays become constants
        if like is not None and like.kind == "b":
            like = _operand_like(arrs, NDArray, like)
        for i, x in enumerate(arrs):
            if isinstance(x, NDArray):
                continue
            if isinstance(x, (numbers.Number, np.number, np.bool_)):
                if (type(x) is float or type(x) is int) and not (   # (the common case, inline)
                        op.name in _COMPARE and like.kind in "biu"):
                    arrs[i] = _const(np.asarray(x, _scalar_dtype(x, like)), dev)
                else:
                    arrs[i] = _const(_scalar_value(x, like, op.name), dev)
            elif isinstance(x, np.ndarray):        # in a supported dtype, as nd.array makes it
                arrs[i] = _const(_supported(np.array(x, copy=True), f"{op.name}: input {i}",
                                            small_ints_32=True), dev)
            else:
                raise TypeError(f"{op.name}: unsupported input type {type(x).__name__}; expected "
                                f"NDArray, a number or a NumPy array")
    specs = op.infer(*arrs, **attrs)
    if len(specs) == 1:                    # (no list comprehension: a frame of its own)
        outs = [NDArray(tuple(specs[0][0]), specs[0][1], dev)]
    else:
        outs = [NDArray(tuple(s), d, dev) for s, d in specs]
    _eager_exec(op, arrs, outs, specs, attrs, dev, (op, arrs[0].shape, outs[0].shape))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _eager_exec(op, arrs, outs, specs, attrs, dev, ckey):
    """Run ``outs = op(*arrs)`` (shapes already inferred): at once when the engine allows it,
    else pushed; then record it for autograd. ``ckey``: the engine's cost key."""
    kernel = op.kernel
    eng = _engine.get_engine()
    if op.random or not eng.run_ready(kernel, arrs, outs, attrs, dev, ckey, op.name):
        _push_eager(eng, op, kernel, arrs, outs, specs, attrs, dev, ckey)
    if _ag._state.recording and op.differentiable:
        for a in arrs:
            if a._ag is not None or a._grad_req != "null":
                _ag.record_op(op, tuple(arrs), outs, attrs)
                break


def _push_eager(eng, op, kernel, arrs, outs, specs, attrs, dev, ckey):
    """Push ``outs = op(*arrs)`` as an engine op (when it could not run at once)."""
    meta = None
    if eng.profiler is not None:
        meta = _op_meta(op, arrs, specs, attrs)
    reads = [a._var for a in arrs]
    writes = [o._var for o in outs]
    if op.random:
        from . import random as _random
        rs = _random._ops
        reads.append(rs.var)
        writes.append(rs.var)

        def run():
            res = kernel(*map(_DATA, arrs), _rng=rs.gen, **attrs)
            for o, r in zip(outs, res):
                o._data = r
    elif len(outs) == 1:
        out = outs[0]

        def run():
            out._data = kernel(*map(_DATA, arrs), **attrs)
    else:
        def run():
            res = kernel(*map(_DATA, arrs), **attrs)
            for o, r in zip(outs, res):
                o._data = r
    # pure kernel: the threaded engine may run it inline when tiny; cost key (op, shapes)
    eng.push_trusted(run, reads, writes, dev, op.priority, op.name, meta, ckey)


def _op_meta(op, arrs, specs, attrs):
    flops, nbytes = op.estimate([a.shape for a in arrs], specs, attrs)
    return {"flops": flops, "bytes": nbytes}


register_interpreter(NDArray, _eager)


# ============================================================================ creation


def _dev(device):
    return current_device() if device is None else Device.parse(device)


def _check_shape(shape, name="shape"):
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        # operator.index: ints and NumPy integers, not 2.5 (int() truncated it silently)
        shape = tuple(operator.index(s) for s in shape)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected an int or a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{name}: sizes must be >= 0, got {shape}")
    return shape


def array(obj, dtype=None, device=None):
    """Create an NDArray from a NumPy array, a nested list, a scalar or another NDArray (copied).

    dtype: default float32 for Python floats, int64 for Python ints, bool for bools; a NumPy
    array keeps its dtype when supported (float32, float64, int32, int64, bool), other integer
    and float types are converted to int64 / float32.

    Raises:
        TypeError: unsupported dtype.
    """
    dev = _dev(device)
    if isinstance(obj, NDArray):
        out = obj.copyto(dev)
        return out if dtype is None else out.astype(dtype)
    if dtype is not None and not isinstance(obj, np.ndarray):
        # Python numbers straight into the dtype: NumPy refuses what does not fit (2**40 or NaN
        # as int32) instead of wrapping around in a later cast
        a = np.array(obj, dtype=as_dtype(dtype), copy=True)
    else:
        a = np.array(obj, copy=True)
        if dtype is not None:
            a = a.astype(as_dtype(dtype), copy=False)
        elif a.dtype.kind == "f" and not isinstance(obj, np.ndarray):
            a = a.astype(F32)
        else:
            a = _supported(a, "obj")
    return NDArray(a.shape, a.dtype, dev, a)


def _supported(a, what, small_ints_32=False):
    """NumPy array ``a`` in a dtype NDArrays support: float32/float64/int32/int64/bool kept,
    other floats as float32, other integers as int64 (as int32 with ``small_ints_32`` when
    they fit it: an op's operand then promotes with an int32 array as in NumPy).

    Raises:
        OverflowError: uint64 values beyond int64. TypeError: not numbers (complex, str, ...)."""
    if a.dtype.kind == "f" and a.dtype not in (F32, np.float64):
        return a.astype(F32)
    if small_ints_32 and a.dtype.kind in "iu" and a.dtype.itemsize < 4:
        return a.astype(np.int32)       # an operand: int32 holds it and promotes as NumPy
    if a.dtype.kind in "iu" and a.dtype not in (np.int32, np.int64):
        if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise OverflowError(f"{what}: uint64 values up to {int(a.max())} do not fit int64 "
                                f"(the widest integer dtype of NDArrays); convert to float64")
        return a.astype(I64)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{what}: expected numbers, got an array of dtype {a.dtype}")
    return a


def _unpickle(value, device):
    return array(value, dtype=value.dtype, device=device)


def snapshot(arrays):
    """Copies (C-contiguous NumPy arrays) of ``arrays``' values at one point of the program
    order: ONE engine op reads them all, after every write pushed before it and before any
    pushed after it. Reading them one by one (``asnumpy()`` each) while another thread trains
    mixes values of different steps (a checkpoint or an export half old, half new).

    Raises:
        TypeError: ``arrays`` is not an iterable of NDArrays.
        OpError: a value failed (as ``asnumpy()`` would)."""
    try:
        arrays = list(arrays)
    except TypeError:
        raise TypeError(f"arrays: expected an iterable of NDArrays, got "
                        f"{type(arrays).__name__}") from None
    bad = [type(a).__name__ for a in arrays if not isinstance(a, NDArray)]
    if bad:
        raise TypeError(f"arrays: expected NDArrays, got {bad[0]} (wrap NumPy data with "
                        f"hl.nd.array)")
    out = [None] * len(arrays)
    if not arrays:
        return out
    done = _engine.Var("snapshot")

    def run():
        for i, a in enumerate(arrays):
            out[i] = np.array(a._data, order="C", copy=True)
    _engine.push(run, [a._var for a in arrays], [done], arrays[0].device, name="snapshot")
    _engine.wait_for(done)
    return out


def from_numpy(a, device=None):
    """Wrap a NumPy array without copying it (the caller must not modify it afterwards)."""
    a = np.asarray(a)
    as_dtype(a.dtype, "a.dtype")
    return NDArray(a.shape, a.dtype, _dev(device), a)


def full(shape, fill_value, dtype=None, device=None):
    """Array of ``shape`` filled with ``fill_value`` (dtype default float32)."""
    shape = _check_shape(shape)
    d = as_dtype(dtype or F32)
    # the value converted first: NaN or an out-of-range number for an integer dtype raises
    # (np.full would cast it unchecked)
    v = np.array(fill_value, dtype=d) if not isinstance(fill_value, np.ndarray) else fill_value
    return NDArray(shape, d, _dev(device), np.full(shape, v, d))


def zeros(shape, dtype=None, device=None):
    """Array of zeros (dtype default float32).

    Raises:
        ValueError: a negative size.
    """
    shape = _check_shape(shape)
    d = as_dtype(dtype or F32)
    return NDArray(shape, d, _dev(device), np.zeros(shape, d))


def ones(shape, dtype=None, device=None):
    """Array of ones (dtype default float32)."""
    return full(shape, 1, dtype, device)


def empty(shape, dtype=None, device=None):
    """Array with unspecified contents (zeros here: reading uninitialised memory helps nobody)."""
    return zeros(shape, dtype, device)


def arange(start, stop=None, step=1, dtype=None, device=None):
    """Evenly spaced values in [start, stop) (NumPy's arange; dtype default float32).

    Raises:
        ValueError: step == 0.
    """
    if step == 0:
        raise ValueError("arange: step must not be 0")
    if stop is None:
        start, stop = 0, start
    d = as_dtype(dtype or F32)
    a = np.arange(start, stop, step, dtype=d)
    return NDArray(a.shape, a.dtype, _dev(device), a)


def zeros_like(x, dtype=None):
    """Zeros with ``x``'s shape, device and (unless given) dtype. Of a traced array (inside
    hybridized code) a traced value of the program.

    Raises:
        TypeError: ``x`` is neither an NDArray nor a NumPy array."""
    return _filled_like("zeros_like", M.zeros_like_op, zeros, x, dtype)


def ones_like(x, dtype=None):
    """Ones with ``x``'s shape, device and (unless given) dtype. Of a traced array (inside
    hybridized code) a traced value of the program.

    Raises:
        TypeError: ``x`` is neither an NDArray nor a NumPy array."""
    return _filled_like("ones_like", M.ones_like_op, ones, x, dtype)


def _filled_like(name, traced_op, create, x, dtype):
    if _is_symbol(x):
        y = traced_op(x)
        return y if dtype is None else M.cast(y, dtype)
    _check_like(name, x)
    return create(x.shape, dtype or x.dtype, x.device if isinstance(x, NDArray) else None)


def _check_like(name, x):
    if not isinstance(x, (NDArray, np.ndarray)):
        raise TypeError(f"{name}: expected an NDArray or a NumPy array, got {type(x).__name__}")


def _is_symbol(x):
    """Whether ``x`` is a traced value (a Symbol of hybridl.graph, which may not be loaded)."""
    ir = sys.modules.get("hybridl.graph.ir")
    return ir is not None and isinstance(x, ir.Symbol)


def full_like(x, fill_value, dtype=None):
    """``fill_value`` everywhere, with ``x``'s shape and device."""
    return full(x.shape, fill_value, dtype or x.dtype, x.device)


def empty_like(x, dtype=None):
    """Like :func:`empty` with ``x``'s shape and device."""
    return zeros_like(x, dtype)


def waitall():
    """Wait for all pushed work (see :func:`hybridl.engine.waitall`)."""
    _engine.waitall()
