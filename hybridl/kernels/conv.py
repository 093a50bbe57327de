"""2-D convolution kernels (NCHW) in pure NumPy: im2col on strided views + one batched GEMM.

Algorithm
---------
Convolution is lowered to a matrix product ("im2col"), the formulation of
Chellapilla, Puri & Simard (2006), "High Performance Convolutional Neural Networks for
Document Processing", as used by Caffe (Jia et al. 2014) and by cuDNN's IMPLICIT/EXPLICIT
GEMM algorithms (Chetlur et al. 2014, "cuDNN: Efficient Primitives for Deep Learning").

Internal layout (the one the GEMMs see)
---------------------------------------
The column matrix is built as ``(G, Cg*KH*KW, N*L)`` — channels and kernel offsets on the rows,
batch *and* output pixels on the columns — so each group is ONE large GEMM
(``w (Og, Cg*KH*KW) @ cols``) instead of N small ones; small per-sample GEMMs with 6 or 16 output
rows are far slower in OpenBLAS. The GEMM result ``(O, N, L)`` is transposed back to NCHW by the
single copy that also adds the bias (or crops, see below).

Stride-1 fast path ("wide" columns): when stride is 1 every kernel offset ``(i, j)`` of the
padded image, flattened row-major, is ONE contiguous slice of length ``OH*Wp`` starting at
``i*dh*Wp + j*dw``. Building columns from those slices copies long contiguous runs (memcpy
speed) instead of ``OW``-long pieces; the price is ``Wp - OW`` junk columns per output row, which
are computed and dropped (the factor ``Wp/OW`` is at most 2 when this path is taken). In the
backward pass the junk columns of ``dy`` are zero, so they contribute nothing.

col2im (gradient w.r.t. the input) loops only over the ``KH*KW`` kernel offsets, each adding one
strided slice (no Python loop over pixels or over the batch).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._check import check_float, check_ndim, check_out, pair

__all__ = ["conv2d", "conv2d_grad_input", "conv2d_grad_weight", "im2col", "conv2d_output_shape",
           "set_cols_cache_bytes"]


# --------------------------------------------------------------------------------------------
# column cache: conv2d (forward) -> conv2d_grad_weight (backward)
# --------------------------------------------------------------------------------------------
# In training, conv2d_grad_weight needs exactly the column matrix the forward pass built
# (same x, same geometry). Rebuilding it is the single most expensive step of the weight
# gradient (a ~25x expansion of x), so the forward keeps its last few column matrices together
# with a private copy of x; the backward reuses one only if the geometry matches AND x still
# compares equal to that copy (np.array_equal, ~1/25 of the im2col cost), so a mutated or reused
# buffer can never give a stale result. An entry is dropped once used. Bounded by bytes.

_CACHE_LOCK = threading.Lock()
_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_MAX_BYTES = [64 << 20]


def set_cols_cache_bytes(nbytes: int) -> int:
    """Set the byte budget of the forward->backward im2col cache (0 disables it); returns the
    previous budget. Default 64 MiB. Entries are validated against a copy of x before reuse."""
    with _CACHE_LOCK:
        prev = _CACHE_MAX_BYTES[0]
        _CACHE_MAX_BYTES[0] = max(0, int(nbytes))
        _evict(0)
    return prev


def _evict(incoming):
    total = sum(v[1].nbytes + v[0].nbytes for v in _CACHE.values())
    while _CACHE and total + incoming > _CACHE_MAX_BYTES[0]:
        _, v = _CACHE.popitem(last=False)
        total -= v[1].nbytes + v[0].nbytes


def _cache_key(x, KH, KW, stride, padding, dilation):
    return (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str, KH, KW, stride, padding, dilation)


def _cache_put(x, key, entry):
    nbytes = entry[0].nbytes + x.nbytes
    if nbytes > _CACHE_MAX_BYTES[0]:
        return
    xc = x.copy()
    with _CACHE_LOCK:
        _CACHE.pop(key, None)
        _evict(nbytes)
        _CACHE[key] = (xc, entry[0], entry[1], entry[2])


def _cache_take(x, key):
    with _CACHE_LOCK:
        v = _CACHE.pop(key, None)
    if v is None or not np.array_equal(v[0], x):
        return None
    return v[1], v[2], v[3]


# --------------------------------------------------------------------------------------------
# geometry and validation
# --------------------------------------------------------------------------------------------

def conv2d_output_shape(x_shape, w_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """Validate a 2-D convolution's arguments and return the output shape ``(N, O, OH, OW)``.

    ``OH = (H + 2*ph - dh*(KH-1) - 1) // sh + 1`` (same for W), as in PyTorch's ``Conv2d`` docs.

    Raises ValueError naming the argument when: x or w is not 4-D, ``groups`` < 1 or does not
    divide C and O, ``w.shape[1] != C // groups``, stride/dilation < 1, padding < 0, or the
    dilated kernel is larger than the padded input.
    """
    if len(x_shape) != 4:
        raise ValueError(f"x: expected a 4-D array (N, C, H, W), got {len(x_shape)}-D with shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(
            f"w: expected a 4-D array (O, C//groups, KH, KW), got {len(w_shape)}-D with shape {tuple(w_shape)}"
        )
    N, C, H, W = (int(s) for s in x_shape)
    O, Cg, KH, KW = (int(s) for s in w_shape)
    if KH < 1 or KW < 1 or O < 1:
        raise ValueError(f"w: expected kernel sizes and output channels >= 1, got shape {tuple(w_shape)}")
    sh, sw = pair("stride", stride)
    ph, pw = pair("padding", padding)
    dh, dw = pair("dilation", dilation)
    groups = int(groups)
    if groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups}")
    if sh < 1 or sw < 1:
        raise ValueError(f"stride: expected positive ints, got {(sh, sw)}")
    if dh < 1 or dw < 1:
        raise ValueError(f"dilation: expected positive ints, got {(dh, dw)}")
    if ph < 0 or pw < 0:
        raise ValueError(f"padding: expected non-negative ints, got {(ph, pw)}")
    if C % groups:
        raise ValueError(f"groups: input channels C={C} (x.shape[1]) are not divisible by groups={groups}")
    if O % groups:
        raise ValueError(f"groups: output channels O={O} (w.shape[0]) are not divisible by groups={groups}")
    if Cg != C // groups:
        raise ValueError(
            f"w: expected w.shape[1] == C // groups = {C} // {groups} = {C // groups} "
            f"(x has C={C} channels), got w.shape[1] = {Cg} (w.shape {tuple(w_shape)})"
        )
    ekh, ekw = dh * (KH - 1) + 1, dw * (KW - 1) + 1
    if ekh > H + 2 * ph or ekw > W + 2 * pw:
        raise ValueError(
            f"w: dilated kernel ({ekh}, {ekw}) (KH, KW = {KH}, {KW}, dilation {(dh, dw)}) is larger than "
            f"the padded input ({H + 2 * ph}, {W + 2 * pw}) (H, W = {H}, {W}, padding {(ph, pw)})"
        )
    OH = (H + 2 * ph - ekh) // sh + 1
    OW = (W + 2 * pw - ekw) // sw + 1
    return N, O, OH, OW


def _use_wide(sh, sw, Wp, OW):
    return sh == 1 and sw == 1 and Wp <= 2 * OW


def _padded(x, ph, pw, extra_row):
    """Zero-padded copy (N, C, Hp + extra_row, Wp) of x; x itself when nothing to add."""
    N, C, H, W = x.shape
    if ph == 0 and pw == 0 and not extra_row and x.flags.c_contiguous:
        return x
    xp = np.zeros((N, C, H + 2 * ph + extra_row, W + 2 * pw), dtype=x.dtype)
    xp[:, :, ph:ph + H, pw:pw + W] = x
    return xp


def _cols(x, KH, KW, stride, padding, dilation, OH, OW):
    """Column matrix in the internal layout.

    Returns ``(cols, wide, Wrow)``: cols is C-contiguous of shape ``(C, KH, KW, N, OH, Wrow)``
    where ``Wrow == Wp`` for the stride-1 wide path (columns ``ow >= OW`` are junk) and
    ``Wrow == OW`` otherwise. Element ``cols[c, i, j, n, oh, ow] =
    xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]``.
    """
    N, C, H, W = x.shape
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    Hp, Wp = H + 2 * ph, W + 2 * pw
    wide = _use_wide(sh, sw, Wp, OW)
    if wide:
        # one extra zero row so the junk tail of the last slice stays inside the buffer
        extra = 1 if KW > 1 else 0
        xp = _padded(x, ph, pw, extra)
        it = xp.itemsize
        P = xp.shape[2] * Wp
        view = as_strided(xp, (C, KH, KW, N, OH * Wp),
                          (P * it, dh * Wp * it, dw * it, C * P * it, it), writeable=False)
        cols = np.empty((C, KH, KW, N, OH * Wp), dtype=x.dtype)
        np.copyto(cols, view)
        return cols.reshape(C, KH, KW, N, OH, Wp), True, Wp
    xp = _padded(x, ph, pw, 0)
    s = xp.strides
    view = as_strided(xp, (C, KH, KW, N, OH, OW),
                      (s[1], s[2] * dh, s[3] * dw, s[0], s[2] * sh, s[3] * sw), writeable=False)
    cols = np.empty((C, KH, KW, N, OH, OW), dtype=x.dtype)
    np.copyto(cols, view)
    return cols, False, OW


def im2col(x, kernel, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """Unfold image patches into columns (Chellapilla et al. 2006; Caffe's ``im2col_cpu``).

    Parameters
    ----------
    x : ndarray (N, C, H, W), float32 or float64.
    kernel, stride, padding, dilation : (int, int).

    Returns
    -------
    cols : ndarray (N, C*KH*KW, OH*OW), same dtype as x, C-contiguous (the layout of
        ``torch.nn.functional.unfold``). Row ``r = (c*KH + i)*KW + j``, column ``l = oh*OW + ow``:
        ``cols[n, r, l] = xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]`` where ``xpad`` is x zero-padded
        by ``padding``. A convolution is then ``w.reshape(O, -1) @ cols`` (for groups=1).

    (conv2d itself uses a different internal layout, ``(C*KH*KW, N*OH*OW)``, so that the whole
    batch is one GEMM; see the module docstring.)

    Raises ValueError if x is not 4-D or the dilated kernel exceeds the padded input.
    """
    x = np.asarray(x)
    check_ndim("x", x, 4, "(N, C, H, W)")
    KH, KW = pair("kernel", kernel)
    N, C, H, W = x.shape
    _, _, OH, OW = conv2d_output_shape(x.shape, (1, C, KH, KW), stride, padding, dilation, 1)
    sh, sw = pair("stride", stride)
    ph, pw = pair("padding", padding)
    dh, dw = pair("dilation", dilation)
    xp = _padded(x, ph, pw, 0)
    s = xp.strides
    view = as_strided(xp, (N, C, KH, KW, OH, OW),
                      (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw), writeable=False)
    return np.ascontiguousarray(view).reshape(N, C * KH * KW, OH * OW)


def _check_arrays(x_name, x, w_name, w):
    check_float(x_name, x)
    check_float(w_name, w)
    if x.dtype != w.dtype:
        raise ValueError(f"{w_name}: dtype {w.dtype} does not match {x_name} dtype {x.dtype}")


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------

def conv2d(x, w, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *, out=None):
    """2-D cross-correlation (what deep-learning libraries call convolution), NCHW.

    ``y[n, o, oh, ow] = b[o] + sum_{c in group(o), i, j} w[o, c, i, j] *
    xpad[n, g*Cg + c, oh*sh + i*dh, ow*sw + j*dw]`` — the definition of
    ``torch.nn.functional.conv2d``; computed by im2col + one GEMM per group
    (Chellapilla et al. 2006; Caffe / cuDNN explicit-GEMM convolution).

    Parameters
    ----------
    x : ndarray (N, C, H, W), float32 or float64.
    w : ndarray (O, C // groups, KH, KW), same dtype as x.
    b : ndarray (O,) or None.
    stride, padding, dilation : (int, int) (an int is accepted for both).
    groups : int, divides C and O.
    out : optional ndarray (N, O, OH, OW) of x's dtype to write the result into.

    Returns
    -------
    y : ndarray (N, O, OH, OW), dtype of x.

    Raises ValueError on wrong ndim, channel/group mismatch, non-float or mismatched dtypes,
    kernel larger than the padded input, or a wrong bias shape.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    N, O, OH, OW = conv2d_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    _check_arrays("x", x, "w", w)
    if b is not None:
        b = np.asarray(b)
        if b.shape != (O,):
            raise ValueError(f"b: expected shape ({O},) (one bias per output channel), got {b.shape}")
    check_out(out, (N, O, OH, OW), x.dtype)
    stride, padding, dilation = pair("stride", stride), pair("padding", padding), pair("dilation", dilation)
    _, C, H, W = x.shape
    _, Cg, KH, KW = w.shape
    G = int(groups)
    Og = O // G
    cols, wide, Wrow = _cols(x, KH, KW, stride, padding, dilation, OH, OW)
    if _CACHE_MAX_BYTES[0]:
        _cache_put(x, _cache_key(x, KH, KW, stride, padding, dilation), (cols, wide, Wrow))
    K = Cg * KH * KW
    # (G, Og, K) @ (G, K, N*OH*Wrow) -> (G, Og, N*OH*Wrow) == (O, N, OH, Wrow)
    ybig = np.matmul(w.reshape(G, Og, K), cols.reshape(G, K, N * OH * Wrow))
    ybig = ybig.reshape(O, N, OH, Wrow)
    if wide:
        ybig = ybig[..., :OW]
    y = out if out is not None else np.empty((N, O, OH, OW), dtype=x.dtype)
    yT = y.transpose(1, 0, 2, 3)
    if b is not None:
        np.add(ybig, b.astype(x.dtype, copy=False)[:, None, None, None], out=yT)
    else:
        np.copyto(yT, ybig)
    return y


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------

def _dy_big(dy, OH, OW, Wrow, wide):
    """dy (N, O, OH, OW) -> C-contiguous (O, N, OH, Wrow), zero in the junk columns if wide."""
    N, O = dy.shape[:2]
    if wide and Wrow != OW:
        d = np.empty((O, N, OH, Wrow), dtype=dy.dtype)
        d[..., OW:] = 0
        np.copyto(d[..., :OW], dy.transpose(1, 0, 2, 3))
        return d
    d = np.empty((O, N, OH, OW), dtype=dy.dtype)
    np.copyto(d, dy.transpose(1, 0, 2, 3))
    return d


def _check_dy(dy, N, O, OH, OW, x_dtype):
    check_ndim("dy", dy, 4, "(N, O, OH, OW)")
    if dy.shape != (N, O, OH, OW):
        raise ValueError(f"dy: expected shape {(N, O, OH, OW)} (the conv2d output shape), got {dy.shape}")
    check_float("dy", dy)


def conv2d_grad_input(dy, w, x_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *, out=None):
    """Gradient of ``conv2d`` w.r.t. its input x (a transposed convolution of dy).

    ``dcols = w^T @ dy`` per group (one GEMM), then col2im: ``dx`` accumulates the columns back
    onto the padded image, looping only over the KH*KW kernel offsets (Caffe's ``col2im_cpu``
    without its per-pixel loops; Chellapilla et al. 2006). Padding is cropped off at the end.

    Parameters
    ----------
    dy : ndarray (N, O, OH, OW), float32/float64 — gradient of the loss w.r.t. conv2d's output.
    w : ndarray (O, C // groups, KH, KW), same dtype as dy.
    x_shape : (N, C, H, W), the shape of the forward input.
    stride, padding, dilation, groups : as in ``conv2d``.
    out : optional ndarray x_shape of dy's dtype to write into.

    Returns
    -------
    dx : ndarray x_shape, dtype of dy.

    Raises ValueError on wrong ndim/shapes/dtypes (as ``conv2d``), or dy not of the output shape.
    """
    dy = np.asarray(dy)
    w = np.asarray(w)
    x_shape = tuple(int(s) for s in x_shape)
    N, O, OH, OW = conv2d_output_shape(x_shape, w.shape, stride, padding, dilation, groups)
    _check_dy(dy, N, O, OH, OW, w.dtype)
    _check_arrays("dy", dy, "w", w)
    check_out(out, x_shape, dy.dtype)
    sh, sw = pair("stride", stride)
    ph, pw = pair("padding", padding)
    dh, dw = pair("dilation", dilation)
    _, C, H, W = x_shape
    _, Cg, KH, KW = w.shape
    G = int(groups)
    Og = O // G
    K = Cg * KH * KW
    Hp, Wp = H + 2 * ph, W + 2 * pw
    wide = _use_wide(sh, sw, Wp, OW)
    Wrow = Wp if wide else OW
    dyb = _dy_big(dy, OH, OW, Wrow, wide)
    # (G, K, Og) @ (G, Og, N*OH*Wrow) -> (G, K, M) == (C, KH, KW, N, OH, Wrow)
    dcols = np.matmul(w.reshape(G, Og, K).transpose(0, 2, 1), dyb.reshape(G, Og, N * OH * Wrow))
    dcols = dcols.reshape(C, KH, KW, N, OH * Wrow)
    if wide:
        L = OH * Wp
        Hrows = Hp + (1 if KW > 1 else 0)
        dxp = np.zeros((C, N, Hrows * Wp), dtype=dy.dtype)
        for i in range(KH):
            for j in range(KW):
                off = i * dh * Wp + j * dw
                dxp[:, :, off:off + L] += dcols[:, i, j]
        dxp = dxp.reshape(C, N, Hrows, Wp)
    else:
        dcols = dcols.reshape(C, KH, KW, N, OH, OW)
        dxp = np.zeros((C, N, Hp, Wp), dtype=dy.dtype)
        hspan, wspan = sh * (OH - 1) + 1, sw * (OW - 1) + 1
        for i in range(KH):
            for j in range(KW):
                h0, w0 = i * dh, j * dw
                dxp[:, :, h0:h0 + hspan:sh, w0:w0 + wspan:sw] += dcols[:, i, j]
    dx = out if out is not None else np.empty(x_shape, dtype=dy.dtype)
    np.copyto(dx.transpose(1, 0, 2, 3), dxp[:, :, ph:ph + H, pw:pw + W])
    return dx


def conv2d_grad_weight(dy, x, w_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *, out=None):
    """Gradient of ``conv2d`` w.r.t. its weight: ``dw = dy @ im2col(x)^T`` per group, one GEMM
    over batch and pixels together (Chellapilla et al. 2006; Caffe ``weight_cpu_gemm``).

    ``dw[o, c, i, j] = sum_{n, oh, ow} dy[n, o, oh, ow] * xpad[n, g*Cg + c, oh*sh + i*dh, ow*sw + j*dw]``.

    Parameters
    ----------
    dy : ndarray (N, O, OH, OW), float32/float64.
    x : ndarray (N, C, H, W), the forward input, same dtype.
    w_shape : (O, C // groups, KH, KW).
    stride, padding, dilation, groups : as in ``conv2d``.
    out : optional ndarray w_shape of x's dtype to write into.

    Returns
    -------
    dw : ndarray w_shape, dtype of x. (The bias gradient is ``dy.sum((0, 2, 3))``.)

    Raises ValueError on wrong ndim/shapes/dtypes (as ``conv2d``), or dy not of the output shape.
    """
    dy = np.asarray(dy)
    x = np.asarray(x)
    w_shape = tuple(int(s) for s in w_shape)
    N, O, OH, OW = conv2d_output_shape(x.shape, w_shape, stride, padding, dilation, groups)
    _check_dy(dy, N, O, OH, OW, x.dtype)
    _check_arrays("x", x, "dy", dy)
    check_out(out, w_shape, x.dtype)
    stride, padding, dilation = pair("stride", stride), pair("padding", padding), pair("dilation", dilation)
    _, Cg, KH, KW = w_shape
    G = int(groups)
    Og = O // G
    K = Cg * KH * KW
    hit = _cache_take(x, _cache_key(x, KH, KW, stride, padding, dilation)) if _CACHE else None
    cols, wide, Wrow = hit if hit is not None else _cols(x, KH, KW, stride, padding, dilation, OH, OW)
    dyb = _dy_big(dy, OH, OW, Wrow, wide)
    M = N * OH * Wrow
    # (G, Og, M) @ (G, M, K) -> (G, Og, K)
    res = np.matmul(dyb.reshape(G, Og, M), cols.reshape(G, K, M).transpose(0, 2, 1))
    if out is None:
        return res.reshape(w_shape)
    np.copyto(out, res.reshape(w_shape))
    return out
