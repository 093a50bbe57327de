"""Batch normalization and layer normalization kernels in pure NumPy, forward and backward.

Batch norm: Ioffe & Szegedy (2015), "Batch Normalization: Accelerating Deep Network Training by
Reducing Internal Covariate Shift", Algorithm 1 (forward) and its backward in closed form.
Layer norm: Ba, Kiros & Hinton (2016), "Layer Normalization".

``var`` is always the *biased* variance (divide by the number of reduced elements), as in both
papers and in ``torch.nn.functional.batch_norm`` / ``layer_norm`` during training. Computation
is done in the input dtype (float32 stays float32).
"""

from __future__ import annotations

import numpy as np

from ._check import check_float, check_ndim, check_out

__all__ = ["batch_norm_train", "batch_norm_infer", "batch_norm_grad", "layer_norm", "layer_norm_grad"]


def _bn_axes(x, axis):
    check_ndim("x", x, (2, 3, 4, 5), "(N, C, ...)")
    check_float("x", x)
    ax = int(axis)
    if not -x.ndim <= ax < x.ndim:
        raise ValueError(f"axis: expected an axis of the {x.ndim}-D input x, got {axis}")
    ax %= x.ndim
    red = tuple(a for a in range(x.ndim) if a != ax)
    bshape = [1] * x.ndim
    bshape[ax] = x.shape[ax]
    return ax, red, tuple(bshape)


_SUM_CHUNK = 4096      # values per (sample, channel) summed in one run (see _channel_sum)


def _channel_sum(a, ax, red, b=None):
    """Per-channel ``sum(a)`` (or ``sum(a * b)``, no temporary) over the axes ``red``, in the
    accumulation dtype (float32 for float16 input, as NumPy's mean).

    For the channel axis 1 of a non-empty C-contiguous float32/float64 array: ``einsum`` over
    the (N, C, rest) view, per sample and channel and in runs of at most _SUM_CHUNK values
    (einsum adds a run in SIMD lanes, sequentially: longer runs lose float32 accuracy, e.g.
    4.7e-4 relative over 2048x2048 values), then the (chunks x N) partial sums per channel
    pairwise (np.sum along a contiguous axis): 2-3x faster than NumPy's multi-axis reduction
    with the same accuracy. Otherwise ``np.sum`` over ``red``."""
    fast = a.dtype in (np.float32, np.float64)
    if (fast and ax == 1 and a.ndim > 2 and a.size and a.flags.c_contiguous
            and (b is None or (b.flags.c_contiguous and b.dtype == a.dtype))):
        N, C = a.shape[:2]
        a3 = a.reshape(N, C, -1)
        b3 = None if b is None else b.reshape(N, C, -1)
        K = a3.shape[2]
        parts = []
        for k0 in range(0, K, _SUM_CHUNK):
            s = slice(k0, k0 + _SUM_CHUNK)
            parts.append(np.einsum("nck->cn", a3[:, :, s]) if b3 is None
                         else np.einsum("nck,nck->cn", a3[:, :, s], b3[:, :, s]))
        p = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return np.ascontiguousarray(p).sum(axis=1)
    return np.sum(a if b is None else a * b, axis=red, dtype=None if fast else np.float32)


def _param(name, p, C, dtype, what):
    p = np.asarray(p)
    if p.shape != (C,):
        raise ValueError(f"{name}: expected shape ({C},) ({what}), got {p.shape}")
    return p.astype(dtype, copy=False)


def batch_norm_train(x, gamma, beta, eps, axis=1):
    """Training-mode batch normalization (Ioffe & Szegedy 2015, Algorithm 1).

    ``mean = x.mean(red)``, ``var = x.var(red)`` (biased), ``y = gamma * (x - mean) / sqrt(var + eps) + beta``
    where ``red`` is every axis but ``axis``.

    Parameters
    ----------
    x : ndarray (N, C) or (N, C, H, W) (any ndim 2..5), float32/float64.
    gamma, beta : ndarray (C,) where C = x.shape[axis].
    eps : float.
    axis : the channel axis (default 1).

    Returns
    -------
    (y, mean, var) : y like x; mean and var of shape (C,), dtype of x.

    Raises ValueError on wrong ndim, non-float x, or gamma/beta not of shape (C,).
    """
    x = np.asarray(x)
    ax, red, bshape = _bn_axes(x, axis)
    C = x.shape[ax]
    gamma = _param("gamma", gamma, C, x.dtype, "one scale per channel x.shape[axis]")
    beta = _param("beta", beta, C, x.dtype, "one shift per channel x.shape[axis]")
    m = x.size // C if C else 1
    mean = (_channel_sum(x, ax, red) / m).astype(x.dtype, copy=False)
    xc = x - mean.reshape(bshape)
    var = (_channel_sum(xc, ax, red, xc) / m).astype(x.dtype, copy=False)
    scale = gamma / np.sqrt(var + x.dtype.type(eps))
    xc *= scale.reshape(bshape)
    xc += beta.reshape(bshape)
    return xc, mean, var


def batch_norm_infer(x, gamma, beta, running_mean, running_var, eps, axis=1, *, out=None):
    """Inference-mode batch normalization with running statistics (Ioffe & Szegedy 2015, Alg. 2):
    ``y = (x - running_mean) * gamma / sqrt(running_var + eps) + beta``, folded into one
    scale and one shift per channel.

    Parameters
    ----------
    x : ndarray (N, C, ...), float32/float64.
    gamma, beta, running_mean, running_var : ndarray (C,).
    eps : float.  axis : channel axis (default 1).
    out : optional ndarray like x.

    Returns
    -------
    y : ndarray like x, dtype of x.

    Raises ValueError on wrong ndim, non-float x, or parameters not of shape (C,).
    """
    x = np.asarray(x)
    ax, red, bshape = _bn_axes(x, axis)
    C = x.shape[ax]
    dt = x.dtype
    gamma = _param("gamma", gamma, C, dt, "one scale per channel")
    beta = _param("beta", beta, C, dt, "one shift per channel")
    rm = _param("running_mean", running_mean, C, dt, "one mean per channel")
    rv = _param("running_var", running_var, C, dt, "one variance per channel")
    check_out(out, x.shape, dt)
    scale = gamma / np.sqrt(rv + dt.type(eps))
    shift = beta - rm * scale
    y = np.multiply(x, scale.reshape(bshape), out=out)
    y += shift.reshape(bshape)
    return y


def batch_norm_grad(dy, x, gamma, mean, var, eps, axis=1):
    """Training-mode batch-norm backward (Ioffe & Szegedy 2015, Sec. 3, closed form):

    with ``m`` = elements per channel, ``xhat = (x - mean) * rstd``, ``rstd = 1/sqrt(var + eps)``:
    ``dbeta = sum(dy)``, ``dgamma = sum(dy * xhat)``,
    ``dx = gamma * rstd / m * (m * dy - dbeta - xhat * dgamma)``.

    Parameters
    ----------
    dy, x : ndarray of the same shape (N, C, ...), float32/float64.
    gamma, mean, var : ndarray (C,) — mean/var as returned by ``batch_norm_train``.
    eps : float.  axis : channel axis.

    Returns
    -------
    (dx, dgamma, dbeta) : dx like x; dgamma, dbeta (C,), dtype of x.

    Raises ValueError on shape/ndim/dtype mismatch.
    """
    dy = np.asarray(dy)
    x = np.asarray(x)
    ax, red, bshape = _bn_axes(x, axis)
    if dy.shape != x.shape:
        raise ValueError(f"dy: expected the shape of x {x.shape}, got {dy.shape}")
    check_float("dy", dy)
    C = x.shape[ax]
    dt = x.dtype
    gamma = _param("gamma", gamma, C, dt, "one scale per channel")
    mean = _param("mean", mean, C, dt, "batch mean per channel")
    var = _param("var", var, C, dt, "batch variance per channel")
    if not x.size:          # an empty batch: no gradient to propagate (sums of nothing are 0)
        return np.zeros(x.shape, dt), np.zeros(C, dt), np.zeros(C, dt)
    m = x.size // C
    rstd = (1.0 / np.sqrt(var + dt.type(eps))).astype(dt, copy=False)
    xc = x - mean.reshape(bshape)                       # xhat = xc * rstd, never stored
    dbeta = _channel_sum(dy, ax, red).astype(dt, copy=False)
    dgamma = (_channel_sum(dy, ax, red, xc) * rstd).astype(dt, copy=False)
    # dx = gamma*rstd/m * (m*dy - dbeta - xhat*dgamma)
    #    = gamma*rstd * (dy - xc * (rstd*dgamma/m) - dbeta/m): four passes over the temporary
    xc *= (rstd * dgamma / m).reshape(bshape)
    np.subtract(dy, xc, out=xc)
    xc -= (dbeta / m).reshape(bshape)
    xc *= (gamma * rstd).reshape(bshape)
    return xc, dgamma, dbeta


def _ln_check(x, axis):
    x = np.asarray(x)
    check_ndim("x", x, tuple(range(1, 9)), "(..., D)")
    check_float("x", x)
    if int(axis) not in (-1, x.ndim - 1):
        raise ValueError(f"axis: layer_norm normalizes over the last axis only (-1 or {x.ndim - 1}), got {axis}")
    return x


def layer_norm(x, gamma, beta, eps, axis=-1):
    """Layer normalization over the last axis (Ba, Kiros & Hinton 2016):
    ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` with mean/var (biased) over axis -1.

    Parameters
    ----------
    x : ndarray (..., D), float32/float64.
    gamma, beta : ndarray (D,).
    eps : float.  axis : must be the last axis (-1).

    Returns
    -------
    (y, mean, var) : y like x; mean and var of shape x.shape[:-1], dtype of x.

    Raises ValueError for non-float x, another axis, or gamma/beta not of shape (D,).
    """
    x = _ln_check(x, axis)
    D = x.shape[-1]
    gamma = _param("gamma", gamma, D, x.dtype, "x.shape[-1:]")
    beta = _param("beta", beta, D, x.dtype, "x.shape[-1:]")
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = np.mean(np.square(xc), axis=-1, keepdims=True)
    xc *= 1.0 / np.sqrt(var + x.dtype.type(eps))
    xc *= gamma
    xc += beta
    return xc, mean[..., 0], var[..., 0]


def layer_norm_grad(dy, x, gamma, mean, var, eps, axis=-1):
    """Layer-norm backward (Ba et al. 2016; the same closed form as batch norm, per row):

    ``xhat = (x - mean) * rstd``, ``g = dy * gamma``,
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (means over the last axis),
    ``dgamma = sum(dy * xhat)``, ``dbeta = sum(dy)`` over all leading axes.

    Parameters
    ----------
    dy, x : ndarray (..., D), float32/float64, same shape.
    gamma : ndarray (D,).  mean, var : ndarray x.shape[:-1] (as returned by ``layer_norm``).
    eps : float.  axis : must be -1.

    Returns
    -------
    (dx, dgamma, dbeta) : dx like x; dgamma, dbeta (D,).

    Raises ValueError on shape/ndim/dtype mismatch.
    """
    x = _ln_check(x, axis)
    dy = np.asarray(dy)
    if dy.shape != x.shape:
        raise ValueError(f"dy: expected the shape of x {x.shape}, got {dy.shape}")
    check_float("dy", dy)
    D = x.shape[-1]
    dt = x.dtype
    gamma = _param("gamma", gamma, D, dt, "x.shape[-1:]")
    mean = np.asarray(mean, dtype=dt)
    var = np.asarray(var, dtype=dt)
    if mean.shape != x.shape[:-1] or var.shape != x.shape[:-1]:
        raise ValueError(
            f"mean/var: expected shape {x.shape[:-1]} (x.shape[:-1]), got {mean.shape} and {var.shape}"
        )
    rstd = (1.0 / np.sqrt(var + dt.type(eps)))[..., None].astype(dt, copy=False)
    xhat = (x - mean[..., None]) * rstd
    lead = tuple(range(x.ndim - 1))
    dbeta = dy.sum(axis=lead)
    dgamma = np.sum(dy * xhat, axis=lead)
    g = dy * gamma
    dx = g - g.mean(axis=-1, keepdims=True)
    dx -= xhat * np.mean(g * xhat, axis=-1, keepdims=True)
    dx *= rstd
    return dx, dgamma.astype(dt, copy=False), dbeta.astype(dt, copy=False)
