"""Losses: each returns one value per sample, shape (batch,) (mean over the other axes).

``SoftmaxCrossEntropyLoss``, ``L2Loss``, ``L1Loss``, ``SigmoidBinaryCrossEntropyLoss`` (MXNet
Gluon's definitions).
"""
import functools
import inspect
import math
import numbers

import numpy as np

from . import nd as F
from .nn.block import HybridBlock

__all__ = ["Loss", "SoftmaxCrossEntropyLoss", "L2Loss", "L1Loss", "SigmoidBinaryCrossEntropyLoss"]


def _weights(sw, dtype):
    """``sample_weight`` given as numbers (a number, list or NumPy array) as an array.

    Raises:
        TypeError: not numbers."""
    try:
        a = np.asarray(sw)
    except (TypeError, ValueError):
        a = None
    if a is None or a.dtype.kind not in "biuf":
        raise TypeError(f"sample_weight: expected an NDArray, a NumPy array or numbers, got "
                        f"{type(sw).__name__}")
    return a.astype(dtype)


@functools.lru_cache(maxsize=None)
def _standard_forward(cls):
    """Whether ``cls.forward`` is ``(self, pred, label, sample_weight=None)``."""
    try:
        return list(inspect.signature(cls.forward).parameters) == ["self", "pred", "label",
                                                                   "sample_weight"]
    except (TypeError, ValueError):
        return False


class Loss(HybridBlock):
    """Base class: ``weight`` scales the loss; ``batch_axis`` is kept, other axes averaged.

    Every loss is called as ``loss(pred, label, sample_weight=None)``: ``sample_weight`` (an
    NDArray, a NumPy array or a number) multiplies the per-element loss before the average,
    broadcast by NumPy's rules as in MXNet Gluon: one weight per sample is (N, 1) for an
    (N, C) loss, (N,) or (N, 1) for an (N,) loss (softmax cross-entropy).

    Raises:
        ValueError: pred and label shapes differ (where they must match), or sample_weight
            does not broadcast to the loss's shape.
    """

    def __init__(self, weight=None, batch_axis=0):
        super().__init__()
        if isinstance(batch_axis, bool) or not isinstance(batch_axis, (int, np.integer)):
            raise TypeError(f"{type(self).__name__}: batch_axis must be an int (an axis of pred), "
                            f"got {type(batch_axis).__name__} {batch_axis!r}")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, numbers.Real)):
            raise TypeError(f"{type(self).__name__}: weight must be a number or None, got "
                            f"{type(weight).__name__} {weight!r}")
        self._weight, self._batch_axis = weight, int(batch_axis)

    def __call__(self, *args, **kwargs):
        # pred and label given as NumPy arrays (as layers take them): made NDArrays, on
        # pred's device when it is one (an op with no NDArray operand would refuse them)
        if len(args) >= 2 and any(isinstance(a, (np.ndarray, np.generic)) for a in args[:2]):
            dev = getattr(args[0], "device", None)
            args = tuple(F.array(a, device=dev) if isinstance(a, (np.ndarray, np.generic)) else a
                         for a in args[:2]) + tuple(args[2:])
        # the standard signature forward(pred, label, sample_weight=None): sample_weight
        # passed positionally (a hybridized call takes arrays only), dropped when None, and a
        # number or NumPy array made an NDArray; other signatures (subclasses) as they are
        if _standard_forward(type(self)) and len(args) + len(kwargs) == 3 and len(args) >= 2 \
                and set(kwargs) <= {"sample_weight"}:
            pred, label = args[:2]
            sw = args[2] if len(args) == 3 else kwargs["sample_weight"]
            if sw is None:
                return super().__call__(pred, label)
            if isinstance(sw, (numbers.Number, np.ndarray, np.generic, list, tuple)):
                sw = F.array(_weights(sw, pred.dtype), device=pred.device)
            return super().__call__(pred, label, sw)
        return super().__call__(*args, **kwargs)

    def _finish(self, loss, sample_weight=None, batch_axis=None):
        if sample_weight is not None:
            if not hasattr(sample_weight, "shape"):
                sample_weight = F.array(_weights(sample_weight, loss.dtype))
            sw = sample_weight
            if len(sw.shape) == len(loss.shape) + 1 and sw.shape[-1] == 1:
                sw = F.reshape(sw, tuple(sw.shape[:-1]))    # (N, 1) weights of (N,) losses
            try:
                ok = np.broadcast_shapes(tuple(loss.shape), tuple(sw.shape)) == tuple(loss.shape)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{type(self).__name__}: sample_weight of shape "
                                 f"{tuple(sample_weight.shape)} does not broadcast to the loss's "
                                 f"shape {tuple(loss.shape)} (NumPy broadcasting: one weight "
                                 f"per sample of an (N, C) loss has shape (N, 1))")
            loss = loss * sw
        if self._weight is not None:
            loss = loss * self._weight
        if batch_axis is None:
            batch_axis = self._batch_axis_of(len(loss.shape))
        axes = tuple(i for i in range(len(loss.shape)) if i != batch_axis)
        return F.mean(loss, axis=axes) if axes else loss

    def _batch_axis_of(self, ndim):
        """``batch_axis`` as an axis in [0, ndim) of an ``ndim``-d array (negative counts from
        the end, as NumPy).

        Raises:
            ValueError: out of range (names the shape's rank)."""
        b = self._batch_axis
        if ndim == 0:
            return 0
        if not -ndim <= b < ndim:
            raise ValueError(f"{type(self).__name__}: batch_axis {b} is out of range for "
                             f"{ndim}-d data")
        return b % ndim

    @staticmethod
    def _check(pred, label, name):
        """label, reshaped to pred's shape when it has as many elements (as Gluon's
        reshape_like: a (N,) label for (N, 1) predictions)."""
        if tuple(pred.shape) == tuple(label.shape):
            return label
        if math.prod(pred.shape) != math.prod(label.shape):
            raise ValueError(f"{name}: pred shape {tuple(pred.shape)} and label shape "
                             f"{tuple(label.shape)} differ (and have different sizes)")
        return F.reshape(label, tuple(pred.shape))


class SoftmaxCrossEntropyLoss(Loss):
    """-log softmax(pred)[label] per sample, softmax taken along ``axis`` (the class axis).

    Shapes: pred (N, K) logits, or (N, ..., K, ...) with the K classes on ``axis`` (default
    the last); label, when ``sparse_label`` (default), the class indices (any int dtype, or
    float holding integers) with pred's shape less the class axis (an (N, 1) label of (N, K)
    logits is taken as (N,)); else probabilities of pred's shape. ``from_logits``: pred are
    log-probabilities already. Returns (N,): the per-position losses averaged over every axis
    but ``batch_axis`` (MXNet Gluon's definition).

    Raises:
        ValueError: ``axis`` not an integer, out of range for pred, or the batch axis; label
            of the wrong shape.
        OpError (at the next sync point): a label outside [0, K), or a float label that is not
            a whole number (a fraction, NaN, inf), naming the value and its position.
    """

    def __init__(self, axis=-1, sparse_label=True, from_logits=False, weight=None, batch_axis=0):
        super().__init__(weight, batch_axis)
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise ValueError(f"SoftmaxCrossEntropyLoss: axis must be an integer (the class "
                             f"axis of pred), got {axis!r}")
        self._axis = int(axis)
        self._sparse, self._from_logits = sparse_label, from_logits

    def _class_last(self, pred):
        """pred with its class axis moved to the end (NumPy's moveaxis)."""
        nd_ = len(pred.shape)
        if not -nd_ <= self._axis < nd_:
            raise ValueError(f"SoftmaxCrossEntropyLoss: axis {self._axis} is out of range for "
                             f"pred of shape {tuple(pred.shape)}")
        ax = self._axis % nd_
        if ax == self._batch_axis_of(nd_):
            raise ValueError(f"SoftmaxCrossEntropyLoss: axis {self._axis} is the batch axis of "
                             f"pred {tuple(pred.shape)}; it must be the class axis")
        if ax == nd_ - 1:
            return pred
        return F.transpose(pred, tuple(i for i in range(nd_) if i != ax) + (ax,))

    def forward(self, pred, label, sample_weight=None):
        shape = tuple(pred.shape)
        pred = self._class_last(pred)
        if self._sparse:
            rows = tuple(pred.shape[:-1])
            if len(label.shape) == len(rows) + 1 and label.shape[-1] == 1:
                label = F.reshape(label, tuple(label.shape[:-1]))
            if tuple(label.shape) != rows:
                hint = ("; labels of pred's shape (one-hot or probabilities) need "
                        "SoftmaxCrossEntropyLoss(sparse_label=False)"
                        if tuple(label.shape) == shape else "")
                raise ValueError(f"SoftmaxCrossEntropyLoss: label must have shape {rows} (one "
                                 f"class index per position of pred {shape} less its class "
                                 f"axis {self._axis}), got {tuple(label.shape)}{hint}")
            if self._from_logits:        # pred are log-probabilities already
                # range checked here: one_hot would make an out-of-range label all zeros
                label = F.class_indices(label, pred.shape[-1])
                loss = -F.sum(pred * F.one_hot(label, pred.shape[-1], pred.dtype.name), axis=-1)
            else:
                if label.dtype.kind == "f":  # MXNet's float labels: whole numbers checked
                    label = F.class_indices(label)
                if len(rows) == 1:
                    loss = F.softmax_cross_entropy(pred, label)     # checks the range itself
                else:                    # one row per position: (N, T, K) -> (N*T, K)
                    k = pred.shape[-1]
                    loss = F.reshape(F.softmax_cross_entropy(F.reshape(pred, (-1, k)),
                                                             F.reshape(label, (-1,))), rows)
        else:
            if tuple(label.shape) != shape and math.prod(label.shape) == math.prod(shape):
                label = F.reshape(label, shape)     # Gluon's reshape_like, in pred's layout
            if tuple(label.shape) == shape:
                label = self._class_last(label)
            label = self._check(pred, label, "SoftmaxCrossEntropyLoss")
            lp = pred if self._from_logits else F.log_softmax(pred, -1)
            loss = -F.sum(lp * label, axis=-1)
        # the batch axis of the loss (pred less its class axis)
        nd_ = len(shape)
        b = self._batch_axis_of(nd_)
        return self._finish(loss, sample_weight, b - (b > self._axis % nd_))


class L2Loss(Loss):
    """0.5 * (pred - label)**2 averaged over non-batch axes.

    Shapes: pred (N, ...); label pred's shape, or as many elements (reshaped to it, as
    Gluon's reshape_like) -> (N,).

    Raises:
        ValueError: label of another size than pred.
    """

    def forward(self, pred, label, sample_weight=None):
        label = self._check(pred, label, "L2Loss")
        return self._finish(F.square(pred - label) * 0.5, sample_weight)


class L1Loss(Loss):
    """|pred - label| averaged over non-batch axes (shapes and errors as :class:`L2Loss`)."""

    def forward(self, pred, label, sample_weight=None):
        label = self._check(pred, label, "L1Loss")
        return self._finish(F.abs(pred - label), sample_weight)


class SigmoidBinaryCrossEntropyLoss(Loss):
    """Binary cross-entropy; with ``from_sigmoid=False`` (default) pred are logits x and
    ``(1 - z) softplus(x) + z softplus(-x)`` (equal to ``softplus(x) - x z``) is used: each
    term is exact where it dominates (no cancellation for confident predictions), and its
    gradient is ``sigmoid(x) - z`` everywhere, also at ``x = 0`` (the form
    ``max(x, 0) - x z + log(1 + exp(-|x|))`` differentiates max and |.| at their kinks).
    With ``from_sigmoid=True`` pred are probabilities p and ``-(z log(p + 1e-12) + (1 - z)
    log(1 - p + 1e-12))`` is used.

    Shapes: pred (N, ...); label z in [0, 1], pred's shape or as many elements -> (N,).

    Raises:
        ValueError: label of another size than pred.
    """

    def __init__(self, from_sigmoid=False, weight=None, batch_axis=0):
        super().__init__(weight, batch_axis)
        self._from_sigmoid = from_sigmoid

    def forward(self, pred, label, sample_weight=None):
        label = self._check(pred, label, "SigmoidBinaryCrossEntropyLoss")
        if not self._from_sigmoid:
            loss = F.softplus(pred) * (1.0 - label) + F.softplus(-pred) * label
        else:
            eps = 1e-12
            loss = -(F.log(pred + eps) * label + F.log(1.0 - pred + eps) * (1.0 - label))
        return self._finish(loss, sample_weight)
