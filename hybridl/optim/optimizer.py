"""Optimizers. Each parameter update is ONE engine op that reads the gradient and writes the
weight and the optimizer state (as MXNet's fused ``sgd_mom_update``), so updates are
asynchronous and ordered after backward by the engine.

Formulas (per element; ``g = rescale_grad * grad``, clipped to ±clip_gradient if set):

* SGD (PyTorch's ``torch.optim.SGD`` convention): ``g += wd * w``; with momentum
  ``buf = momentum * buf + g`` (``buf = g`` on the first step); nesterov uses
  ``g + momentum * buf``, else ``buf``; ``w -= lr * step``.
* Adam (Kingma & Ba 2015, Algorithm 1, with bias correction): ``g += wd * w`` (L2);
  ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g²``; ``w -= lr * m̂ / (sqrt(v̂) + eps)``.
* AdamW (Loshchilov & Hutter 2019): as Adam without the L2 term, plus decoupled
  ``w -= lr * wd * w`` (applied before the Adam step, as PyTorch).
"""
import math
import numbers
import sys

import numpy as np

from .. import engine as _engine
from ..ops import _blas

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "create"]


def _refs(holder):
    d = holder._data
    return sys.getrefcount(d)


class _Holder:
    __slots__ = ("_data",)


# plain SGD updates of at least this many elements use BLAS axpy (one pass, no temporary);
# smaller ones NumPy's two calls (a ctypes call costs more than it saves there)
_AXPY_MIN = 4096

_h = _Holder()
_h._data = np.empty(1)
_SOLE = _refs(_h)          # the count when ``holder._data`` has no other reference
del _h


def _owned(holder):
    """Whether ``holder._data`` may be updated in place: it owns its memory and nothing else
    refers to it (no NumPy view of it, no other NDArray or cache holding it), so writing into
    it cannot change a value anybody else can see. Otherwise updates build a new array."""
    if _refs(holder) > _SOLE:      # counted first: the local below is one more reference
        return False
    d = holder._data
    return type(d) is np.ndarray and d.base is None and d.flags.writeable


def _number(name, v):
    """``v`` as a float; TypeError naming ``name`` when it is not a real number (a str, None,
    a bool, an array)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    return float(v)


class Optimizer:
    """Base class. ``lr`` (learning rate), ``wd`` (weight decay), ``rescale_grad`` (a factor
    of the gradients, default 1: the Trainer uses ``rescale_grad / batch_size``, as MXNet's
    does), ``clip_gradient`` (None or a positive float).

    Raises:
        TypeError: a hyper-parameter that is not a number.
        ValueError: a learning rate or weight decay that is negative or infinite, both
            ``learning_rate`` and its alias ``lr`` with different values,
            rescale_grad not finite and > 0, clip_gradient <= 0.
    """

    state_names = ()

    default_learning_rate = 0.01

    #: True when :meth:`step_kernel` is elementwise (each element of the new weight and states
    #: depends on the same element of the old ones and of the gradient only): the update can
    #: then run on any split of a flat parameter (``Trainer(update_on_kvstore=True)``).
    elementwise = False

    def __init__(self, learning_rate=None, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr=None):
        if learning_rate is not None and lr is not None and _number("lr", lr) != _number(
                "learning_rate", learning_rate):
            raise ValueError(f"learning_rate={learning_rate!r} and its alias lr={lr!r} were both "
                             f"given, with different values; give one of them")
        if learning_rate is None and lr is None:
            learning_rate = self.default_learning_rate
        lr = _number("learning_rate", learning_rate if lr is None else lr)
        wd = _number("wd", wd)
        rescale_grad = _number("rescale_grad", rescale_grad)
        if clip_gradient is not None:
            clip_gradient = _number("clip_gradient", clip_gradient)
        if not lr >= 0 or lr == float("inf"):
            raise ValueError(f"learning_rate: expected a finite number >= 0, got {lr}")
        if not wd >= 0 or wd == float("inf"):
            raise ValueError(f"wd: expected a finite number >= 0, got {wd}")
        if not 0 < rescale_grad < float("inf"):
            raise ValueError(f"rescale_grad: expected a finite number > 0, got {rescale_grad}")
        if clip_gradient is not None and not clip_gradient > 0:
            raise ValueError(f"clip_gradient: expected None or a number > 0, got {clip_gradient}")
        self.lr, self.wd = float(lr), float(wd)
        self.rescale_grad = float(rescale_grad)
        self.scale = float(rescale_grad)    # the user's factor: rescale_grad = scale / batch
        self.clip_gradient = None if clip_gradient is None else float(clip_gradient)
        self.num_update = 0

    @property
    def learning_rate(self):
        return self.lr

    def set_learning_rate(self, lr):
        """Set the learning rate (e.g. from a schedule).

        Raises:
            ValueError: ``lr`` is not a finite number >= 0 (as the constructor)."""
        try:
            ok = bool(lr >= 0 and lr != float("inf"))
        except (TypeError, ValueError):     # (a string; an array: no single truth value)
            ok = False
        if not ok or isinstance(lr, bool):
            raise ValueError(f"learning_rate: expected a finite number >= 0, got {lr!r}")
        self.lr = float(lr)

    def create_state(self, weight):
        """A dict name -> NumPy array of optimizer state for ``weight`` (an NDArray)."""
        return {n: np.zeros(weight.shape, weight.dtype) for n in self.state_names}

    def _grad(self, g, w, wd, rescale, clip):
        g = g * w.dtype.type(rescale) if rescale != 1.0 else g
        if clip is not None:
            g = np.clip(g, -clip, clip)
        if wd:
            g = g + w.dtype.type(wd) * w
        return g

    def step_kernel(self, w, g, state, lr, wd, t, rescale, clip, out=None, scratch=None):
        """NumPy update: returns the new weight, written into ``out`` when it is given (``out``
        is ``w`` itself when nobody else can see ``w``'s buffer, see :func:`_owned`), else a new
        array; state arrays are the optimizer's own and may be updated in place or replaced in
        ``state``. ``g`` is never written, unless it is also passed as ``scratch`` (an array
        like ``g`` the kernel may overwrite: a compiled step's gradient that dies here). ``t``
        is the 1-based update count of this parameter; ``rescale`` and ``clip`` are the values
        of ``rescale_grad`` / ``clip_gradient`` when the update was pushed (the op runs later:
        reading the attributes then would race with the frontend)."""
        raise NotImplementedError

    def gemm_coefficients(self, lr, wd, rescale, clip):
        """``(alpha, beta)`` when this update is ``w = beta * w + alpha * grad`` with no state
        (then a compiled step computes a weight gradient ``A @ B`` and the update as ONE GEMM
        with accumulation, ``w = alpha A B + beta w``: the gradient is never stored), else
        None. Arguments as :meth:`step_kernel`."""
        return None

    def update(self, weight, grad, state, lr_mult=1.0, wd_mult=1.0, priority=0):
        """Push one engine op: ``weight`` and ``state`` are updated from ``grad``.

        ``state`` is a dict {'t': int, 'arrays': {name: np.ndarray}, 'var': engine Var}; its
        count ``t`` goes up when the update runs (an update skipped because the gradient
        failed does not count, so Adam's bias correction stays that of the updates made).
        """
        lr, wd = self.lr * lr_mult, self.wd * wd_mult
        rescale, clip = self.rescale_grad, self.clip_gradient
        weight._version += 1
        kern = self.step_kernel

        def update():
            t = state["t"] + 1
            out = weight._data if _owned(weight) else None
            weight._data = kern(weight._data, grad._data, state["arrays"], lr, wd, t, rescale, clip,
                                out=out)
            state["t"] = t

        # skipped for a failed gradient (a bad batch): the weight and state stay usable
        _engine.push(update, [grad._var], [weight._var, state["var"]], weight.device,
                     priority, f"{type(self).__name__.lower()}_update", pure=True,
                     skip_clean=True)


    def update_many(self, items, device, priority=0):
        """Push ONE engine op updating several parameters of ``device`` (as MXNet's
        ``multi_sgd_update``): ``items`` are (weight, grad, state, lr_mult, wd_mult) tuples.
        Fewer, larger engine ops: the per-op cost is paid once per step, not per parameter."""
        rescale, clip = self.rescale_grad, self.clip_gradient
        jobs = []
        for weight, grad, state, lr_mult, wd_mult in items:
            weight._version += 1
            jobs.append((weight, grad, state, self.lr * lr_mult, self.wd * wd_mult))
        kern = self.step_kernel

        def update():                       # counts go up as the updates run (see update)
            for w, g, st, lr, wd in jobs:
                t = st["t"] + 1
                out = w._data if _owned(w) else None
                w._data = kern(w._data, g._data, st["arrays"], lr, wd, t, rescale, clip, out=out)
                st["t"] = t

        _engine.push(update, [it[1]._var for it in items],
                     [it[0]._var for it in items] + [it[2]["var"] for it in items], device,
                     priority, f"{type(self).__name__.lower()}_update[{len(items)}]", pure=True,
                     skip_clean=True)


def _fast_ok(w, lr, rescale):
    """Whether an update of ``w`` may take a BLAS fast path: big enough to gain (_AXPY_MIN
    elements), and a nonzero step (BLAS skips ``alpha * x`` when alpha is 0, which would hide
    a NaN or inf gradient that NumPy's ``0 * inf`` shows)."""
    return w.size >= _AXPY_MIN and lr * rescale != 0


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, weight decay and Nesterov momentum.

    Per step, with ``g = rescale_grad * grad`` (clipped to ``[-clip_gradient, clip_gradient]``
    when set) ``+ wd * w``: ``buf = momentum * buf + g`` (``buf = g`` at the first step, as
    PyTorch's SGD), then ``w -= lr * buf``, or ``w -= lr * (g + momentum * buf)`` with
    ``nesterov`` (Sutskever et al. 2013); without momentum ``w -= lr * g``.

    Args:
        learning_rate (float): >= 0, default 0.01 (alias ``lr``; giving both with different
            values is a ValueError). momentum (float): in [0, 1].
        wd (float): L2 weight decay >= 0. nesterov (bool): needs momentum > 0.
        rescale_grad, clip_gradient: see :class:`Optimizer`.

    Raises:
        TypeError: a hyper-parameter that is not a number.
        ValueError: a value out of its range; nesterov without momentum.
    """

    elementwise = True

    def __init__(self, learning_rate=None, momentum=0.0, wd=0.0, nesterov=False, **kw):
        super().__init__(learning_rate, wd, **kw)
        momentum = _number("momentum", momentum)
        if not 0.0 <= momentum < 1.0 + 1e-12:
            raise ValueError(f"momentum: expected in [0, 1], got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov: requires momentum > 0")
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov: expected True or False, got {nesterov!r}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.state_names = ("momentum",) if momentum else ()

    def gemm_coefficients(self, lr, wd, rescale, clip):
        """Plain SGD (no momentum, no clipping): ``w = (1 - lr wd) w - lr rescale grad``."""
        if self.momentum or clip is not None or not lr * rescale:
            return None         # lr 0: BLAS would skip the product (and a NaN gradient's NaN)
        return -lr * rescale, 1.0 - lr * wd

    def step_kernel(self, w, g, st, lr, wd, t, rescale, clip, out=None, scratch=None):
        dt = w.dtype.type
        if not self.momentum and clip is None and not wd:
            if _fast_ok(w, lr, rescale):
                # the common case in ONE pass over w and g: w += (-lr * rescale) * g (BLAS
                # axpy); into a copy of w when w may not be written (same result either way)
                dst = out if out is w else np.array(w)
                if _blas.axpy(-lr * rescale, g, dst):
                    return dst
            # else in two passes, as by hand: step = (lr * rescale) * g; w -= step
            step = np.multiply(g, dt(lr * rescale), out=scratch)
            if out is None:     # a new weight array: never the scratch (its owner reuses it)
                out = step if scratch is None else None
            return np.subtract(w, step, out=out)
        if (self.momentum and not self.nesterov and clip is None and t > 1
                and _fast_ok(w, lr, rescale)):
            res = self._momentum_blas(w, g, st["momentum"], lr, wd, rescale, out)
            if res is not None:
                return res
        g = self._grad(g, w, wd, rescale, clip)
        if self.momentum:
            if t == 1:
                buf = st["momentum"] = g.copy()
            elif st["momentum"].flags.writeable:
                buf = st["momentum"]
                buf *= dt(self.momentum)
                buf += g
            else:                               # a read-only state (set by the user): replaced
                buf = st["momentum"] = st["momentum"] * dt(self.momentum) + g
            g = g + dt(self.momentum) * buf if self.nesterov else buf
        step = np.multiply(g, dt(lr))
        return np.subtract(w, step, out=out if out is not None else step)

    def _momentum_blas(self, w, g, buf, lr, wd, rescale, out):
        """The momentum step without temporaries: ``buf = momentum buf + rescale g`` in one
        pass (BLAS ``?axpby``), ``+ wd w`` in one more (``?axpy``), ``w -= lr buf`` in one
        (``?axpy``), instead of five NumPy passes and two new arrays (3.2x at the MLP's 2 MB
        of weights; the same values up to rounding: BLAS may fuse multiply and add). Returns
        the new weight, or None, having written nothing, when an operand does not qualify."""
        if not _blas.ready((w, g, buf), (buf,)):
            return None
        dst = out if out is w else np.array(w)
        _blas.axpby(rescale, g, self.momentum, buf)
        if wd:
            _blas.axpy(wd, w, buf)
        _blas.axpy(-lr, buf, dst)
        return dst


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015, Algorithm 1) with bias correction; ``wd`` is an L2 term added
    to the gradient (AdamW decouples it).

    Per step t (from 1), with ``g = rescale_grad * grad + wd * w``: ``m = beta1 m + (1 - beta1) g``,
    ``v = beta2 v + (1 - beta2) g^2``, ``w -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t))
    + epsilon)``.

    Args:
        learning_rate (float): >= 0, default 0.001 (alias ``lr``; both with different values:
            ValueError). beta1, beta2 (float): in [0, 1).
        epsilon (float): finite, >= 0 (as PyTorch's ``eps``). wd (float): >= 0.
        rescale_grad, clip_gradient: see :class:`Optimizer`.

    Raises:
        TypeError: a hyper-parameter that is not a number.
        ValueError: a value out of its range.
    """

    state_names = ("mean", "var")
    decoupled = False

    default_learning_rate = 0.001

    elementwise = True

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, **kw):
        super().__init__(learning_rate, wd, **kw)
        beta1, beta2 = _number("beta1", beta1), _number("beta2", beta2)
        epsilon = _number("epsilon", epsilon)
        for n, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{n}: expected in [0, 1), got {b}")
        if not 0.0 <= epsilon < float("inf"):
            raise ValueError(f"epsilon: expected a finite number >= 0, got {epsilon}")
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def step_kernel(self, w, g, st, lr, wd, t, rescale, clip, out=None, scratch=None):
        dt = w.dtype.type
        if clip is None and self.beta1 and self.beta2 and _fast_ok(w, lr, rescale):
            res = self._adam_blas(w, g, st, lr, wd, t, rescale, out)
            if res is not None:
                return res
        if self.decoupled:
            g = self._grad(g, w, 0.0, rescale, clip)
            w = w * dt(1.0 - lr * wd)
        else:
            g = self._grad(g, w, wd, rescale, clip)
        b1, b2 = self.beta1, self.beta2
        m = st["mean"] * dt(b1) + g * dt(1 - b1)
        v = st["var"] * dt(b2) + np.square(g) * dt(1 - b2)
        st["mean"], st["var"] = m, v
        mhat = m / dt(1 - b1 ** t)
        vhat = v / dt(1 - b2 ** t)
        step = np.sqrt(vhat)
        step += dt(self.epsilon)
        np.divide(mhat, step, out=step)
        step *= dt(lr)
        return np.subtract(w, step, out=out if out is not None else step)

    def _adam_blas(self, w, g, st, lr, wd, t, rescale, out):
        """The Adam step with the moments updated in place, one pass each (BLAS ``?axpby``:
        ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``), one temporary (g^2, then the
        step) and the weight update as ``?axpy`` with the bias corrections folded into the
        coefficients: 9 passes instead of about 14 with 8 new arrays (1.7x at 2 MB). Same
        values up to rounding. Returns the new weight, or None, having written nothing, when
        an operand does not qualify."""
        m, v = st["mean"], st["var"]
        if not _blas.ready((w, g, m, v), (m, v)):
            return None
        dt = w.dtype.type
        b1, b2 = self.beta1, self.beta2
        r, tmp = rescale, None
        if wd and not self.decoupled:       # L2 term in the gradient: g' = rescale g + wd w
            g = tmp = np.multiply(g, dt(rescale))
            _blas.axpy(wd, w, g)
            r = 1.0
        _blas.axpby((1 - b1) * r, g, b1, m)
        # the rescaled gradient squared (squaring first would overflow float32 above 1.8e19)
        if tmp is None:
            tmp = np.multiply(g, dt(r))
        np.square(tmp, out=tmp)
        _blas.axpby(1 - b2, tmp, b2, v)
        # lr (m / c1) / (sqrt(v / c2) + eps), c = 1 - beta^t
        np.sqrt(v, out=tmp)
        tmp *= dt(1.0 / math.sqrt(1 - b2 ** t))
        tmp += dt(self.epsilon)
        np.divide(m, tmp, out=tmp)
        dst = out if out is w else np.array(w)
        if wd and self.decoupled:
            dst *= dt(1.0 - lr * wd)
        _blas.axpy(-lr / (1 - b1 ** t), tmp, dst)
        return dst


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2): ``w *= 1 - lr *
    wd`` before the Adam step, whose gradient has no wd term; default wd 0.01. Arguments and
    errors as :class:`Adam`."""

    decoupled = True

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.01, **kw):
        super().__init__(learning_rate, beta1, beta2, epsilon, wd, **kw)


_NAMES = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def create(name, **kwargs):
    """An optimizer from a name ('sgd', 'adam', 'adamw') or an instance.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(name, Optimizer):
        return name
    key = str(name).lower()
    if key not in _NAMES:
        raise ValueError(f"optimizer: expected one of {sorted(_NAMES)} or an Optimizer, got {name!r}")
    cls = _NAMES[key]
    known = set()
    for c in cls.__mro__:                   # the parameters of the class and its bases
        code = getattr(c.__dict__.get("__init__"), "__code__", None)
        if code is not None:
            known.update(code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount])
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TypeError(f"optimizer_params: {cls.__name__} has no parameter(s) {unknown}; "
                        f"its parameters are {sorted(known)}")
    return cls(**kwargs)
