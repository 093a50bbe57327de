"""2-D convolution kernels (NCHW) in pure NumPy: im2col on strided views + GEMM, in batch blocks.

Algorithm
---------
Convolution is lowered to a matrix product ("im2col"), the formulation of
Chellapilla, Puri & Simard (2006), "High Performance Convolutional Neural Networks for
Document Processing", as used by Caffe (Jia et al. 2014) and by cuDNN's IMPLICIT/EXPLICIT
GEMM algorithms (Chetlur et al. 2014, "cuDNN: Efficient Primitives for Deep Learning").

Batch blocks (cache blocking)
-----------------------------
The column matrix of a whole batch is ~KH*KW times the input (11 MiB for LeNet's first layer at
batch 128): building it in memory and streaming it through the GEMM is bound by memory bandwidth.
Every kernel therefore walks the batch in blocks of ``nb`` samples, ``nb`` chosen so that one
block's column matrix and GEMM output stay within ``_BLOCK_BYTES`` (``_BLOCK_BYTES_GRAD`` for
the gradients; 1.5 and 3 MiB, a few times the L2 and far inside the L3): the block's columns
are written, multiplied and dropped while still in cache, in buffers allocated once per call.
This measured 1.5-2x faster than one whole-batch GEMM at LeNet shapes.
(A whole-batch forward->backward column cache was used before; with blocked columns,
re-building a block in cache is cheaper than storing the full matrix and validating it, so the
cache is gone and ``set_cols_cache_bytes`` is kept only as a compatible no-op setting.)

Internal layout (the one the GEMMs see)
---------------------------------------
A block's columns are ``(G, Cg*KH*KW, nb*L)`` — channels and kernel offsets on the rows,
the block's samples *and* output pixels on the columns — so each group is ONE GEMM
(``w (Og, Cg*KH*KW) @ cols``) per block instead of nb small ones; small per-sample GEMMs with 6
or 16 output rows are far slower in OpenBLAS. The GEMM result ``(O, nb, L)`` is transposed into
NCHW by the single copy that also adds the bias (or crops, see below).

Stride-1 fast path ("wide" columns): when stride is 1 every kernel offset ``(i, j)`` of the
padded image, flattened row-major, is ONE contiguous slice of length ``OH*Wp`` starting at
``i*dh*Wp + j*dw``. Building columns from those slices copies long contiguous runs (memcpy
speed) instead of ``OW``-long pieces; the price is ``Wp - OW`` junk columns per output row, which
are computed and dropped (the factor ``Wp/OW`` is at most 2 when this path is taken). In the
weight gradient the junk columns of ``dy`` are zero, so they contribute nothing.

Bias and ReLU (forward): with one group the bias is one more GEMM row: a row of ones under
the block's columns and the bias as one more column of the weights (Caffe's "bias multiplier"),
so the copy into NCHW is a plain copy, not a broadcasting add over short strided runs (at LeNet
shapes that copy was 2-3x slower with the add). ``act='relu'`` is applied to each block's NCHW
output while it is in cache, instead of a second pass over the whole output. Without padding,
the wide view reads x itself (the junk columns of a channel's last run read the next
channel's first elements, and past x's end for the last sample, whose block alone is copied).

Few output channels (O <= 8 at stride 1, e.g. LeNet's first layer): OpenBLAS runs a GEMM with
6 output rows at ~15 GFLOP/s, so each GEMM column computes 2 output rows instead of one (a
12-row GEMM on half the columns, with a 6-row instead of 5-row kernel window; ``_Geometry``).

Gradient w.r.t. the input, stride 1 ("row-Toeplitz" transposed convolution): instead of the
``KH*KW``-row ``dcols = w^T @ dy`` followed by KH*KW scatter-adds (col2im), the sum over the
kernel columns ``j`` is folded into the GEMM: ``dy`` is zero-padded to rows of ``Wp`` elements
(``(KW-1)*dw`` zeros in front of each row), its ``KW`` shifted copies are stacked into a
``(O*KW, nb*OH*Wp)`` matrix (contiguous slices again; a shift that runs past the end of a row
reads the next row's leading zeros, which is exactly the zero padding), and one GEMM with
``A[(c, i), (o, j)] = w[o, c, i, j]`` gives ``Z (C*KH, nb*OH*Wp)``; the remaining sum over the
kernel rows is KH contiguous shifted adds into the padded gradient. Its GEMM output is KW times
smaller than ``dcols`` and it needs KW times fewer scatter-adds. Other strides use the plain
col2im, which loops only over the ``KH*KW`` kernel offsets, each adding one strided slice.

Non-finite values: the row-blocked weights, the junk columns and the zero-padded dy multiply
zeros with real data, and ``0 * inf`` is NaN, which would put NaN where a direct convolution
(PyTorch's) has a finite value. So each kernel first checks the one operand that could leak
(x for the forward with R == 2 and for the weight gradient on the wide layout, w for the input
gradient; one ``np.sum``, finite or not) and, when it holds inf or NaN, uses the exact layout
(plain im2col, col2im), whose zeros meet only zeros.

No path loops in Python over pixels or samples, only over batch blocks and kernel offsets.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._check import check_float, check_int, check_ndim, check_out, pair

__all__ = ["conv2d", "conv2d_grad_input", "conv2d_grad_weight", "im2col", "conv2d_output_shape",
           "set_cols_cache_bytes"]


# --------------------------------------------------------------------------------------------
# tuning: batch block size; the former forward->backward column cache (now a no-op setting)
# --------------------------------------------------------------------------------------------

# Budget (bytes) of one batch block's working set (its column matrix plus GEMM output): a few
# times the L2 and far inside the L3, so a block is written, multiplied and dropped while still
# cached. Measured on the 2-core dev VM (512 KiB L2/core, 32 MiB L3, LeNet shapes, batch 128):
# 1.5-3 MiB blocks 1.5-2x faster than the whole batch at once; 256-768 KiB ones (L2-sized) lose
# to per-block call overhead and smaller GEMMs (re-measured 2026-11-30: conv2 forward 2.5 ms at
# 1.5 MiB, 2.8 ms at 768 KiB, 3.8 ms at 256 KiB). The forward also re-reads its GEMM output
# (the copy into NCHW) and is best at 1.5 MiB; the gradients, whose GEMM outputs are small, at
# 3 MiB (fewer, larger GEMM calls).
_BLOCK_BYTES = 3 << 19
_BLOCK_BYTES_GRAD = 3 << 20
_CACHE_MAX_BYTES = [64 << 20]


def set_cols_cache_bytes(nbytes: int) -> int:
    """Former byte budget of a forward->backward im2col cache; returns the previous value.

    Kept for compatibility only: the kernels now build columns in cache-sized batch blocks,
    and re-building a block is cheaper than storing (and validating) a whole-batch column
    matrix, so no columns are cached and this setting has no effect on results or speed."""
    prev = _CACHE_MAX_BYTES[0]
    _CACHE_MAX_BYTES[0] = max(0, int(nbytes))
    return prev


def _blocks(N, per_sample_bytes, budget=None):
    """Block size nb for a batch of N (>= 1, balanced so the blocks have near-equal sizes)."""
    budget = _BLOCK_BYTES if budget is None else budget
    nb = max(1, min(N, budget // max(1, int(per_sample_bytes))))
    nblk = -(-N // nb) if N else 1
    return max(1, -(-N // nblk))


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
    groups = check_int("groups", groups)
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


def _rows_per_col(O, KH, stride, dilation, wide):
    """Output rows R computed per GEMM column (see ``_Geometry``): 2 for stride-1 layers with
    few output channels (O <= 8) and KH >= 3, else 1. Measured at LeNet conv1 (O=6, 5x5, batch
    128): forward 2.9 -> 2.35 ms, weight gradient 4.0 -> 3.1 ms; no gain at O=16 (conv2)."""
    if wide and stride[0] == 1 and dilation[0] == 1 and O <= 8 and KH >= 3:
        return 2
    return 1


class _Geometry:
    """Column layout of one conv2d (forward / weight gradient), in batch blocks.

    Column rows are ``(c, a, r, j)`` and columns ``(n, ohb, ow)``, read through ONE strided view
    ``V`` of shape ``(C, A, R, KW, N, OHb, Wrow)`` of a padded copy of x:

    * plain (``R == 1``, ``A == KH``): ``V[c, i, 0, j, n, oh, ow] = xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]``.
      Wide (stride 1, ``Wrow == Wp``): for fixed ``(c, i, j, n)`` a contiguous run of ``OH*Wp``
      elements, columns ``ow >= OW`` junk (module docstring). Otherwise ``Wrow == OW``.
    * row-blocked (``R == 2``, wide, ``sh == dh == 1``): each GEMM column computes the R
      output rows ``R*ohb + r``; it needs the ``KH + R - 1`` input rows ``R*ohb + R*a + rho``
      (``a < A``, ``rho < R``), read from the phase-split copy
      ``xq[n, c, rho, hb, :] = xpad[n, c, R*hb + rho, :]`` so that a run is contiguous again.
      The weights become ``w'[(o, r), (c, a, rho, j)] = w[o, c, R*a + rho - r, j]`` (zero outside
      the kernel): a GEMM with R times more rows and about half the columns, which OpenBLAS runs
      far more efficiently when O is small; the columns shrink to ``(KH + R - 1) / (R*KH)``.
      Output rows ``>= OH`` (when R does not divide OH) are junk.
    """

    def __init__(self, x_shape, w_shape, stride, padding, dilation, groups, OH, OW, exact=False):
        N, C, H, W = x_shape
        O, Cg, KH, KW = w_shape
        self.N, self.C, self.H, self.W, self.O, self.Cg, self.KH, self.KW = N, C, H, W, O, Cg, KH, KW
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.G = int(groups)
        self.OH, self.OW = OH, OW
        ph, pw = padding
        self.Hp, self.Wp = H + 2 * ph, W + 2 * pw
        # exact: the plain layout, no junk columns and no zero-padded weights (non-finite data)
        self.wide = not exact and _use_wide(stride[0], stride[1], self.Wp, OW)
        R = self.R = _rows_per_col(O, KH, stride, dilation, self.wide)
        self.A = -(-(KH + R - 1) // R)
        self.OHb = -(-OH // R)
        self.Wrow = self.Wp if self.wide else OW
        self.L = self.OHb * self.Wrow  # columns per sample
        self.Kp = Cg * self.A * R * KW  # GEMM inner dimension per group

    def direct(self, x):
        """True when the wide view can read x itself: stride-1 "wide" layout, R == 1, no
        padding, x C-contiguous. Only the last sample's last run then reads past x's end (by
        ``(KW-1)*dw`` junk elements), so :meth:`block_views` copies just the last block."""
        return (self.wide and self.R == 1 and self.padding == (0, 0) and self.N > 1
                and x.flags.c_contiguous)

    def block_views(self, x, nb):
        """``view(n0, m)`` -> the read-only view V (class docstring) of samples n0 .. n0+m-1,
        for the blocks ``range(0, N, nb)``. Without padding (:meth:`direct`) V is a view of x
        itself for every block but the last, which reads a zero-tailed copy of its m samples;
        otherwise of one padded copy of x."""
        if not self.direct(x):
            V = self.view(x)
            return lambda n0, m: V[:, :, :, :, n0:n0 + m]
        N = self.N
        last = (N - 1) // nb * nb                   # first sample of the last block
        head = self._wide_view(x[:last], np.ravel(x)) if last else None
        tail = self.view(x[last:])
        return lambda n0, m: tail if n0 == last else head[:, :, :, :, n0:n0 + m]

    def view(self, x):
        """The read-only view V (see the class docstring) on a private padded copy of x
        (or on x itself on the plain path when there is no padding and x is C-contiguous)."""
        N, C, H, W = x.shape
        KW = self.KW
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        Hp, Wp, R, A = self.Hp, self.Wp, self.R, self.A
        if self.wide:
            Hq = self.OHb + (A - 1) * dh  # rows per phase image (== Hp when R == 1)
            Pc = R * Hq * Wp
            # + (KW-1)*dw trailing zeros: the last run's junk tail stays inside the buffer
            buf = np.zeros(N * C * Pc + (KW - 1) * dw, dtype=x.dtype)
            q = buf[:N * C * Pc].reshape(N, C, R, Hq, Wp)
            for rho in range(R):
                h0 = (rho - ph) % R  # first x row of this phase
                if h0 < H:
                    rows = x[:, :, h0::R]
                    hb0 = (h0 + ph) // R
                    q[:, :, rho, hb0:hb0 + rows.shape[2], pw:pw + W] = rows
            return self._wide_view(x, buf)
        if ph or pw or not x.flags.c_contiguous:
            xp = np.zeros((N, C, Hp, Wp), dtype=x.dtype)
            xp[:, :, ph:ph + H, pw:pw + W] = x
        else:
            xp = x
        s = xp.strides
        return as_strided(xp, (C, self.KH, 1, KW, N, self.OH, self.OW),
                          (s[1], s[2] * dh, 0, s[3] * dw, s[0], s[2] * sh, s[3] * sw), writeable=False)

    def _wide_view(self, x, buf):
        """V of the wide layout over ``buf``, the flat phase-split padded images of x's samples
        (``x.shape[0]`` of them; buf may be longer)."""
        C, KW, R, A, Wp = self.C, self.KW, self.R, self.A, self.Wp
        dh, dw = self.dilation
        Hq = self.OHb + (A - 1) * dh
        Pc = R * Hq * Wp
        it = buf.itemsize
        return as_strided(buf, (C, A, R, KW, x.shape[0], self.OHb, Wp),
                          (Pc * it, dh * Wp * it, Hq * Wp * it, dw * it, C * Pc * it, Wp * it, it),
                          writeable=False)

    def columns(self, cbuf, view, n0, m, ones):
        """The GEMM operand of samples ``n0 .. n0+m-1``, written into ``cbuf``: (G, Kp [+ 1],
        m*L), the columns of ``view(n0, m)`` (see :meth:`block_views`) and, with ``ones`` (one
        group only), a last row of ones (the bias row of the forward and the weight gradient)."""
        CK, L = self.G * self.Kp, self.L
        cm = cbuf[:(CK + ones) * m * L]
        np.copyto(cm[:CK * m * L].reshape(self.C, self.A, self.R, self.KW, m, self.OHb, self.Wrow),
                  view(n0, m))
        if ones:
            cm[CK * m * L:] = 1
        return cm.reshape(self.G, self.Kp + ones, m * L)

    def weights(self, w):
        """w as the GEMM's left operand, (G, Og*R, Kp)."""
        G, R = self.G, self.R
        O, Cg, KH, KW = w.shape
        if R == 1:
            return w.reshape(G, O // G, Cg * KH * KW)
        wp = np.zeros((O, R, Cg, self.A * R, KW), dtype=w.dtype)
        for r in range(R):
            wp[:, r, :, r:r + KH, :] = w
        return wp.reshape(G, (O // G) * R, self.Kp)

    def fold_weight_grad(self, acc):
        """(G, Kp, Og*R) accumulated ``cols @ dy'^T`` -> dw (O, Cg, KH, KW) (a new array)."""
        G, R, A, KH, KW, Cg = self.G, self.R, self.A, self.KH, self.KW, self.Cg
        Og = self.O // G
        # acc[g, (c, a, rho, j), (o, r)] -> dwp[g, o, r, c, i' = R*a + rho, j]
        dwp = acc.reshape(G, Cg, A * R, KW, Og, R).transpose(0, 4, 5, 1, 2, 3)
        res = np.array(dwp[:, :, 0, :, 0:KH, :], copy=True)
        for r in range(1, R):
            res += dwp[:, :, r, :, r:r + KH, :]
        return res.reshape(self.O, Cg, KH, KW)

    def out_pairs(self, res, dst):
        """Pairs (src, dst) of views that move a block's GEMM result res ``(O, R, m, OHb, Wrow)``
        into dst = y[n0:n0 + m] ``(m, O, OH, OW)``; dst views are in (O, ...) order."""
        R, OH, OW = self.R, self.OH, self.OW
        m, O = dst.shape[:2]
        full = OH // R
        pairs = []
        if full:
            pairs.append((res[:, :, :, :full, :OW],
                          dst[:, :, :full * R].reshape(m, O, full, R, OW).transpose(1, 3, 0, 2, 4)))
        if OH - full * R:
            pairs.append((res[:, :OH - full * R, :, full, :OW], dst[:, :, full * R:].transpose(1, 2, 0, 3)))
        return pairs


def _finite(a):
    """False when ``a`` may hold an inf or NaN (its sum is not finite; a sum that overflows
    also says False, which only costs the exact layout). One pass, no copy."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(a)))


def _padded(x, ph, pw):
    """Zero-padded copy (N, C, Hp, Wp) of x; x itself when nothing to add."""
    N, C, H, W = x.shape
    if ph == 0 and pw == 0 and x.flags.c_contiguous:
        return x
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw), dtype=x.dtype)
    xp[:, :, ph:ph + H, pw:pw + W] = x
    return xp


class _DyBlocks:
    """Batch blocks of dy in the layout of a GEMM's columns: C-contiguous ``(O, R, nb, OHb, Wrow)``
    with ``dy[n, o, R*ohb + r, ow]`` at ``[o, r, n, ohb, lead + ow]`` and zeros elsewhere (junk
    columns and rows), written into one buffer reused for all full blocks. ``lead`` zeros also
    trail the buffer, so reads that run past its last row stay inside it."""

    def __init__(self, dy, nb, R, OHb, Wrow, lead=0):
        self.dy, self.nb, self.R, self.OHb, self.Wrow, self.lead = dy, nb, R, OHb, Wrow, lead
        self.OH, self.OW = dy.shape[2:]
        self.zero = Wrow != self.OW or R * OHb != self.OH
        self.buf = self._new(nb)

    def _new(self, nb):
        n = self.dy.shape[1] * self.R * nb * self.OHb * self.Wrow + self.lead
        return np.zeros(n, dtype=self.dy.dtype) if self.zero else np.empty(n, dtype=self.dy.dtype)

    def get(self, n0, nb):
        """(block array (O, R, nb, OHb, Wrow), its flat buffer)."""
        O, R, OH, OW, c0 = self.dy.shape[1], self.R, self.OH, self.OW, self.lead
        buf = self.buf if nb == self.nb else self._new(nb)
        d = buf[:buf.size - self.lead].reshape(O, R, nb, self.OHb, self.Wrow)
        src = self.dy[n0:n0 + nb]
        full = OH // R
        if full:
            np.copyto(d[:, :, :, :full, c0:c0 + OW],
                      src[:, :, :full * R].reshape(nb, O, full, R, OW).transpose(1, 3, 0, 2, 4))
        if OH - full * R:
            np.copyto(d[:, :OH - full * R, :, full, c0:c0 + OW], src[:, :, full * R:].transpose(1, 2, 0, 3))
        return d, buf


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

    (conv2d itself uses a different internal layout, ``(C*KH*KW, nb*OH*OW)`` per batch block of
    nb samples, so that a block is one GEMM; see the module docstring.)

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
    xp = _padded(x, ph, pw)
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

def conv2d(x, w, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *, act=None,
           out=None):
    """2-D cross-correlation (what deep-learning libraries call convolution), NCHW.

    ``y[n, o, oh, ow] = b[o] + sum_{c in group(o), i, j} w[o, c, i, j] *
    xpad[n, g*Cg + c, oh*sh + i*dh, ow*sw + j*dw]`` — the definition of
    ``torch.nn.functional.conv2d``; computed by im2col + one GEMM per group and batch block
    (Chellapilla et al. 2006; Caffe / cuDNN explicit-GEMM convolution). With one group the bias
    is folded into the GEMM (a row of ones under the columns, Caffe's "bias multiplier"), and
    ``act='relu'`` is applied to each batch block while it is still in cache.

    Parameters
    ----------
    x : ndarray (N, C, H, W), float32 or float64.
    w : ndarray (O, C // groups, KH, KW), same dtype as x.
    b : ndarray (O,) of a float dtype (cast to x's), or None.
    stride, padding, dilation : (int, int) (an int is accepted for both).
    groups : int, divides C and O.
    act : None or ``'relu'``: ``y = max(conv + b, 0)``.
    out : optional ndarray (N, O, OH, OW) of x's dtype to write the result into.

    Returns
    -------
    y : ndarray (N, O, OH, OW), dtype of x.

    Raises ValueError on wrong ndim, channel/group mismatch, non-float or mismatched dtypes,
    kernel larger than the padded input, a wrong bias shape, or an unknown ``act``.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    N, O, OH, OW = conv2d_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    _check_arrays("x", x, "w", w)
    if b is not None:
        b = np.asarray(b)
        check_float("b", b)
        if b.shape != (O,):
            raise ValueError(f"b: expected shape ({O},) (one bias per output channel), got {b.shape}")
    if act not in (None, "relu"):
        raise ValueError(f"act: expected None or 'relu', got {act!r}")
    check_out(out, (N, O, OH, OW), x.dtype)
    stride, padding, dilation = pair("stride", stride), pair("padding", padding), pair("dilation", dilation)
    if w.shape[2:] == (1, 1) and stride == (1, 1) and padding == (0, 0) and groups == 1:
        y = _conv1x1(x, w, b, out)
        if act is not None:
            np.maximum(y, 0, out=y)
        return y
    geo = _Geometry(x.shape, w.shape, stride, padding, dilation, groups, OH, OW)
    if geo.R > 1 and not _finite(x):        # 0 * inf in the zero-padded weights: exact layout
        geo = _Geometry(x.shape, w.shape, stride, padding, dilation, groups, OH, OW, exact=True)
    G, R, L, Kp = geo.G, geo.R, geo.L, geo.Kp
    CK = G * Kp
    wm = geo.weights(w)
    bias = None if b is None else b.astype(x.dtype, copy=False)
    ones = bias is not None and G == 1          # bias as one more GEMM row (inner dim Kp + 1)
    if ones:
        wm = np.concatenate([wm, np.repeat(bias, R).reshape(1, O * R, 1)], axis=2)
    # write into a fresh array if the caller's out may overlap an input still being read
    shared = out is not None and any(np.may_share_memory(out, a) for a in (x, w) + ((b,) if b is not None else ()))
    y = out if out is not None and not shared else np.empty((N, O, OH, OW), dtype=x.dtype)
    nb = _blocks(N, (CK + ones + O * R) * L * x.itemsize)
    view = geo.block_views(x, nb)
    cbuf = np.empty((CK + ones) * nb * L, dtype=x.dtype)
    gbuf = np.empty(O * R * nb * L, dtype=x.dtype)
    for n0 in range(0, N, nb):
        m = min(nb, N - n0)
        # (G, Og*R, Kp[+1]) @ (G, Kp[+1], m*L) -> (G, Og*R, m*L) == (O, R, m, OHb, Wrow)
        res = gbuf[:O * R * m * L].reshape(G, -1, m * L)
        np.matmul(wm, geo.columns(cbuf, view, n0, m, ones), out=res)
        res = res.reshape(O, R, m, geo.OHb, geo.Wrow)
        yb = y[n0:n0 + m]
        for src, dst in geo.out_pairs(res, yb):
            if bias is None or ones:
                np.copyto(dst, src)
            else:
                np.add(src, bias.reshape((O,) + (1,) * (src.ndim - 1)), out=dst)
        if act is not None:
            np.maximum(yb, 0, out=yb)
    if y is not out and out is not None:
        np.copyto(out, y)
        return out
    return y


def _conv1x1(x, w, b, out):
    """1x1 convolution, stride 1, no padding, one group: per sample ``y[n] = w @ x[n]`` on the
    ``(C, H*W)`` view of x, a batched GEMM on the arrays as they are (no column copy, no
    output transpose)."""
    N, C, H, W = x.shape
    O = w.shape[0]
    shared = out is not None and any(np.may_share_memory(out, a) for a in (x, w) + ((b,) if b is not None else ()))
    y = out if out is not None and not shared and out.flags.c_contiguous else np.empty((N, O, H, W), dtype=x.dtype)
    y3 = y.reshape(N, O, H * W)
    np.matmul(w.reshape(O, C), x.reshape(N, C, H * W), out=y3)
    if b is not None:
        y3 += b.astype(x.dtype, copy=False).reshape(O, 1)
    if out is not None and y is not out:
        np.copyto(out, y)
        return out
    return y


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------

def _check_dy(dy, N, O, OH, OW, x_dtype):
    check_ndim("dy", dy, 4, "(N, O, OH, OW)")
    if dy.shape != (N, O, OH, OW):
        raise ValueError(f"dy: expected shape {(N, O, OH, OW)} (the conv2d output shape), got {dy.shape}")
    check_float("dy", dy)


def conv2d_grad_input(dy, w, x_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *, out=None):
    """Gradient of ``conv2d`` w.r.t. its input x (a transposed convolution of dy).

    ``dx[n, g*Cg + c, h, v] = sum_{o in group g, i, j} w[o, c, i, j] * dy[n, o, oh, ow]`` over
    ``h + ph = oh*sh + i*dh``, ``v + pw = ow*sw + j*dw``. Stride 1: the "row-Toeplitz" GEMM of
    the module docstring (sum over kernel columns inside the GEMM, KH shifted adds); otherwise
    ``dcols = w^T @ dy`` per group and block, then col2im, looping only over the KH*KW kernel
    offsets (Caffe's ``col2im_cpu`` without its per-pixel loops; Chellapilla et al. 2006).
    Padding is cropped off at the end.

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
    it = dy.itemsize
    shared = out is not None and (np.may_share_memory(out, dy) or np.may_share_memory(out, w))
    dx = out if out is not None and not shared else np.empty(x_shape, dtype=dy.dtype)
    if _use_wide(sh, sw, Wp, OW) and _finite(w):     # (zero dy padding * inf w: col2im path)
        # row-Toeplitz: dyP (O, m, OH, Wp) holds dy at columns [s0, s0 + OW), zeros elsewhere
        # (Wp == s0 + OW for stride 1); D[o, j, q] = dyP_flat[o, q + (KW-1-j)*dw] (a shift past a
        # row's end reads the next row's leading zeros == the padding);
        # Z[(c, i), q] = sum_{o, j} w[o, c, i, j] D[o, j, q]; dxpad row oh + i*dh += Z[c, i] row oh.
        s0 = (KW - 1) * dw
        L = OH * Wp
        A = np.ascontiguousarray(w.reshape(G, Og, Cg, KH, KW).transpose(0, 2, 3, 1, 4)).reshape(G, Cg * KH, Og * KW)
        nb = _blocks(N, ((O * KW + C * KH + O) * L + C * Hp * Wp) * it, _BLOCK_BYTES_GRAD)
        dys = _DyBlocks(dy, nb, 1, OH, Wp, lead=s0)
        Dbuf = np.empty(O * KW * nb * L, dtype=dy.dtype)
        Zbuf = np.empty(C * KH * nb * L, dtype=dy.dtype)
        Pbuf = np.empty(C * nb * Hp * Wp, dtype=dy.dtype)
        for n0 in range(0, N, nb):
            m = min(nb, N - n0)
            _, flat = dys.get(n0, m)
            D = Dbuf[:O * KW * m * L].reshape(O, KW, m * L)
            np.copyto(D, as_strided(flat[s0:], (O, KW, m * L), (m * L * it, -dw * it, it), writeable=False))
            Z = Zbuf[:C * KH * m * L].reshape(G, Cg * KH, m * L)
            np.matmul(A, D.reshape(G, Og * KW, m * L), out=Z)
            Z = Z.reshape(C, KH, m, L)
            dxp = Pbuf[:C * m * Hp * Wp].reshape(C, m, Hp * Wp)
            np.copyto(dxp[:, :, :L], Z[:, 0])
            dxp[:, :, L:] = 0
            for i in range(1, KH):
                off = i * dh * Wp
                dxp[:, :, off:off + L] += Z[:, i]
            np.copyto(dx[n0:n0 + m].transpose(1, 0, 2, 3), dxp.reshape(C, m, Hp, Wp)[:, :, ph:ph + H, pw:pw + W])
    else:
        L = OH * OW
        wT = w.reshape(G, Og, K).transpose(0, 2, 1)
        nb = _blocks(N, (C * KH * KW * L + O * L + C * Hp * Wp) * it, _BLOCK_BYTES_GRAD)
        dys = _DyBlocks(dy, nb, 1, OH, OW)
        Dbuf = np.empty(C * KH * KW * nb * L, dtype=dy.dtype)
        Pbuf = np.empty(C * nb * Hp * Wp, dtype=dy.dtype)
        hspan, wspan = sh * (OH - 1) + 1, sw * (OW - 1) + 1
        for n0 in range(0, N, nb):
            m = min(nb, N - n0)
            d, _ = dys.get(n0, m)
            # (G, K, Og) @ (G, Og, m*L) -> (G, K, m*L) == (C, KH, KW, m, OH, OW)
            dcols = Dbuf[:C * KH * KW * m * L].reshape(G, K, m * L)
            np.matmul(wT, d.reshape(G, Og, m * L), out=dcols)
            dcols = dcols.reshape(C, KH, KW, m, OH, OW)
            dxp = Pbuf[:C * m * Hp * Wp].reshape(C, m, Hp, Wp)
            dxp.fill(0)
            for i in range(KH):
                for j in range(KW):
                    h0, w0 = i * dh, j * dw
                    dxp[:, :, h0:h0 + hspan:sh, w0:w0 + wspan:sw] += dcols[:, i, j]
            np.copyto(dx[n0:n0 + m].transpose(1, 0, 2, 3), dxp[:, :, ph:ph + H, pw:pw + W])
    if dx is not out and out is not None:
        np.copyto(out, dx)
        return out
    return dx


def conv2d_grad_weight(dy, x, w_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, *,
                       bias=False, out=None):
    """Gradient of ``conv2d`` w.r.t. its weight: ``dw = dy @ im2col(x)^T`` per group, one GEMM
    over the samples and pixels of each batch block, summed over the blocks
    (Chellapilla et al. 2006; Caffe ``weight_cpu_gemm``).

    ``dw[o, c, i, j] = sum_{n, oh, ow} dy[n, o, oh, ow] * xpad[n, g*Cg + c, oh*sh + i*dh, ow*sw + j*dw]``.

    Parameters
    ----------
    dy : ndarray (N, O, OH, OW), float32/float64.
    x : ndarray (N, C, H, W), the forward input, same dtype.
    w_shape : (O, C // groups, KH, KW).
    stride, padding, dilation, groups : as in ``conv2d``.
    bias : bool; also return the bias gradient ``db[o] = sum_{n, oh, ow} dy[n, o, oh, ow]``.
        With one group it comes out of the same GEMMs (a row of ones under the columns,
        Caffe's bias multiplier) instead of another pass over dy.
    out : optional ndarray w_shape of x's dtype to write dw into.

    Returns
    -------
    dw : ndarray w_shape, dtype of x, C-contiguous (``out`` when given); ``(dw, db)`` with db
    (O,) when ``bias``.

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
    geo = _Geometry(x.shape, w_shape, stride, padding, dilation, groups, OH, OW)
    if geo.wide and not _finite(x):         # junk columns (real x) * zero dy: exact layout
        geo = _Geometry(x.shape, w_shape, stride, padding, dilation, groups, OH, OW, exact=True)
    G, R, L, Kp = geo.G, geo.R, geo.L, geo.Kp
    CK = G * Kp
    ones = bool(bias) and G == 1            # the bias gradient as one more GEMM row
    nb = _blocks(N, (CK + ones + O * R) * L * x.itemsize, _BLOCK_BYTES_GRAD)
    view = geo.block_views(x, nb)
    cbuf = np.empty((CK + ones) * nb * L, dtype=x.dtype)
    dys = _DyBlocks(dy, nb, R, geo.OHb, geo.Wrow)
    acc = np.zeros((G, Kp + ones, (O // G) * R), dtype=x.dtype)
    part = np.empty_like(acc)
    for n0 in range(0, N, nb):
        m = min(nb, N - n0)
        cm = geo.columns(cbuf, view, n0, m, ones)
        d, _ = dys.get(n0, m)
        # (G, Kp[+1], m*L) @ (G, m*L, Og*R) -> (G, Kp[+1], Og*R); junk columns, rows of d are 0
        np.matmul(cm, d.reshape(G, -1, m * L).transpose(0, 2, 1),
                  out=acc if n0 == 0 else part)
        if n0:
            acc += part
    res = geo.fold_weight_grad(acc[:, :Kp] if ones else acc)
    if out is not None:
        np.copyto(out, res)
        res = out
    else:   # C-contiguous, as the weight: the optimizers' one-pass BLAS updates need it (a
        res = np.ascontiguousarray(res)     # copy the size of w, small beside the GEMMs)
    if not bias:
        return res
    db = acc[0, Kp].reshape(O, R).sum(axis=1) if ones else dy.sum(axis=(0, 2, 3))
    return res, db
