"""Softmax, log-softmax and softmax cross-entropy in pure NumPy (numerically stable).

Stability: subtract the maximum along the axis before exponentiating (the log-sum-exp trick;
Goodfellow, Bengio & Courville 2016, "Deep Learning", Sec. 4.1). The cross-entropy gradient
``softmax(z) - onehot(label)`` is the classic result (Bridle 1990; Goodfellow et al. Sec. 6.2.2.3).
"""

from __future__ import annotations

import numpy as np

from ._check import check_float, check_ndim, check_out

__all__ = ["softmax", "log_softmax", "softmax_cross_entropy", "softmax_cross_entropy_grad",
           "softmax_cross_entropy_with_grad"]


def _axis(x, axis):
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least 1 dimension, got a 0-D array")
    ax = int(axis)
    if not -x.ndim <= ax < x.ndim:
        raise ValueError(f"axis: expected an axis of the {x.ndim}-D input x, got {axis}")
    return ax


def softmax(x, axis=-1, *, out=None):
    """``softmax(x)_i = exp(x_i - max(x)) / sum_j exp(x_j - max(x))`` along ``axis``.

    Parameters
    ----------
    x : ndarray (any shape, ndim >= 1), float32/float64.  axis : int.
    out : optional ndarray like x.

    Returns
    -------
    ndarray like x, dtype of x; sums to 1 along ``axis``.

    Raises ValueError for a 0-D or non-float x, or an invalid axis.
    """
    x = np.asarray(x)
    ax = _axis(x, axis)
    check_float("x", x)
    check_out(out, x.shape, x.dtype)
    if x.shape[ax] == 0:                    # nothing to normalize (max of nothing is undefined)
        return np.empty_like(x) if out is None else out
    e = np.subtract(x, x.max(axis=ax, keepdims=True), out=out)
    np.exp(e, out=e)
    e /= e.sum(axis=ax, keepdims=True)
    return e


def log_softmax(x, axis=-1, *, out=None):
    """``log_softmax(x) = (x - max) - log(sum(exp(x - max)))`` along ``axis`` (log-sum-exp trick).

    Parameters
    ----------
    x : ndarray (ndim >= 1), float32/float64.  axis : int.  out : optional ndarray like x.

    Returns
    -------
    ndarray like x, dtype of x.

    Raises ValueError for a 0-D or non-float x, or an invalid axis.
    """
    x = np.asarray(x)
    ax = _axis(x, axis)
    check_float("x", x)
    check_out(out, x.shape, x.dtype)
    if x.shape[ax] == 0:
        return np.empty_like(x) if out is None else out
    s = np.subtract(x, x.max(axis=ax, keepdims=True), out=out)
    s -= np.log(np.exp(s).sum(axis=ax, keepdims=True))
    return s


# signed -> unsigned of the same size: viewed so, a negative index is larger than any K
_UNSIGNED = {np.dtype(a): np.dtype(b) for a, b in ((np.int8, np.uint8), (np.int16, np.uint16),
                                                   (np.int32, np.uint32), (np.int64, np.uint64))}


def _ce_check(logits, labels):
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    check_ndim("logits", logits, 2, "(N, K)")
    check_float("logits", logits)
    check_ndim("labels", labels, 1, "(N,) of integer class indices")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"labels: expected an integer dtype, got {labels.dtype}")
    N, K = logits.shape
    if labels.shape[0] != N:
        raise ValueError(f"labels: expected shape ({N},) to match logits.shape[0], got {labels.shape}")
    u = _UNSIGNED.get(labels.dtype)          # one reduction for both bounds (see _UNSIGNED)
    if u is not None:
        as_u = labels.view(u)
    else:                                   # unsigned, or signed in a non-native byte order
        as_u = labels if labels.dtype.kind == "u" else None
    if N and (as_u.max() >= K if as_u is not None else labels.min() < 0 or labels.max() >= K):
        i = int(np.flatnonzero((labels < 0) | (labels >= K))[0])
        raise ValueError(f"labels: expected class indices in [0, {K}), got {labels[i]} at "
                         f"position {i} (min {labels.min()}, max {labels.max()})")
    return logits, labels


def _labelled(a, labels):
    """The positions of the labelled entries ``a[n, labels[n]]`` of an (N, K) array, as an
    index for ``a.reshape(-1)`` (``n * K + labels[n]``: 1-D fancy indexing is about twice as
    fast as the 2-D ``a[arange(N), labels]``) when ``a`` is C-contiguous, else that pair.
    Returns (array to index, index)."""
    N, K = a.shape
    if a.flags.c_contiguous:
        # as intp first: uint64 + int64 is float64 in NumPy (the labels are in [0, K) here)
        return a.reshape(-1), np.add(np.arange(0, N * K, K) if K else np.zeros(N, np.intp),
                                     labels.astype(np.intp, copy=False))
    return a, (np.arange(N), labels)


def softmax_cross_entropy(logits, labels, *, out=None):
    """Per-sample softmax cross-entropy: ``loss_n = logsumexp(logits[n]) - logits[n, labels[n]]``,
    computed as ``log(sum(exp(z[n]))) - z[n, labels[n]]`` with ``z = logits - max(logits[n])``
    (= ``-log_softmax(logits)[n, labels[n]]``; ``torch.nn.functional.cross_entropy(reduction='none')``).

    Parameters
    ----------
    logits : ndarray (N, K), float32/float64.
    labels : ndarray (N,), integer in [0, K).
    out : optional ndarray (N,) of logits' dtype.

    Returns
    -------
    loss : ndarray (N,), dtype of logits.

    Raises ValueError on wrong ndim, non-integer labels, N mismatch or labels out of range.
    """
    logits, labels = _ce_check(logits, labels)
    N = logits.shape[0]
    check_out(out, (N,), logits.dtype)
    # log(sum(exp(z))) - z[label] with z = logits - max: the labelled logit is taken shifted
    # (as log_softmax does), so a large max does not round log(sum) away (1e6 in float32)
    m = logits.max(axis=1)
    z = np.subtract(logits, m[:, None])
    flat, at = _labelled(z, labels)
    zl = flat[at]
    np.exp(z, out=z)
    return np.subtract(np.log(z.sum(axis=1)), zl, out=out)


def softmax_cross_entropy_grad(dloss, logits, labels, *, out=None):
    """Gradient of ``softmax_cross_entropy`` w.r.t. logits:
    ``dlogits[n] = dloss[n] * (softmax(logits[n]) - onehot(labels[n]))``.

    Parameters
    ----------
    dloss : ndarray (N,) (or a scalar, broadcast), float.
    logits : ndarray (N, K), float32/float64.  labels : ndarray (N,), integer.
    out : optional ndarray (N, K) of logits' dtype.

    Returns
    -------
    dlogits : ndarray (N, K), dtype of logits.

    Raises ValueError on wrong shapes/dtypes (as ``softmax_cross_entropy``).
    """
    logits, labels = _ce_check(logits, labels)
    N, K = logits.shape
    dloss = _check_dloss(dloss, N)
    check_out(out, (N, K), logits.dtype)
    p = softmax(logits, axis=1, out=out)
    flat, at = _labelled(p, labels)
    flat[at] -= 1
    return _times_dloss(p, dloss)


def _check_dloss(dloss, n):
    dloss = np.asarray(dloss)
    if dloss.shape not in ((n,), ()):
        raise ValueError(f"dloss: expected shape ({n},) (one per sample), got {dloss.shape}")
    return dloss


def _times_dloss(p, dloss):
    """``p *= dloss`` per row (a scalar dloss: every row), in p's dtype."""
    p *= dloss.astype(p.dtype, copy=False)[..., None] if dloss.ndim else p.dtype.type(dloss)
    return p


def softmax_cross_entropy_with_grad(dloss, logits, labels, *, unit=False):
    """``softmax_cross_entropy(logits, labels)`` and its gradient
    ``softmax_cross_entropy_grad(dloss, logits, labels)`` at once: the labels are checked and
    the softmax computed once (same operations, same results as the two functions).

    Parameters
    ----------
    dloss : ndarray (N,) or scalar, float.  logits : ndarray (N, K), float32/float64.
    labels : ndarray (N,), integer in [0, K).
    unit : bool -- ``dloss`` is known to be all ones (the multiplication is skipped).

    Returns
    -------
    (loss (N,), dlogits (N, K)), dtype of logits.

    Raises ValueError as ``softmax_cross_entropy``.
    """
    logits, labels = _ce_check(logits, labels)
    N = logits.shape[0]
    m = logits.max(axis=1)
    p = np.subtract(logits, m[:, None])
    flat, at = _labelled(p, labels)
    zl = flat[at]                       # the shifted labelled logit (see softmax_cross_entropy)
    np.exp(p, out=p)
    s = p.sum(axis=1)
    loss = np.log(s)
    loss -= zl
    p /= s[:, None]
    flat[at] -= 1
    if not unit:
        _times_dloss(p, _check_dloss(dloss, N))
    return loss, p
