"""Tests of hybridl.kernels: forward against naive loop references (float64), gradients against
central finite differences of the scalar sum(dy * f(x)), dtype preservation, error messages,
and (when torch is installed) agreement with torch.nn.functional."""

import numpy as np
import pytest

from hybridl import kernels as K

RNG = np.random.default_rng(1234)


# ------------------------------------------------------------------------------------------
# naive references
# ------------------------------------------------------------------------------------------

def ref_conv2d(x, w, b, stride, padding, dilation, groups):
    N, C, H, W = x.shape
    O, Cg, KH, KW = w.shape
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    OH = (H + 2 * ph - dh * (KH - 1) - 1) // sh + 1
    OW = (W + 2 * pw - dw * (KW - 1) - 1) // sw + 1
    Og = O // groups
    y = np.zeros((N, O, OH, OW))
    for n in range(N):
        for o in range(O):
            g = o // Og
            for oh in range(OH):
                for ow in range(OW):
                    s = 0.0 if b is None else b[o]
                    for c in range(Cg):
                        for i in range(KH):
                            for j in range(KW):
                                s += w[o, c, i, j] * xp[n, g * Cg + c, oh * sh + i * dh, ow * sw + j * dw]
                    y[n, o, oh, ow] = s
    return y


def ref_pool(x, kernel, stride, padding, mode, count_include_pad=True):
    N, C, H, W = x.shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    OH = (H + 2 * ph - kh) // sh + 1
    OW = (W + 2 * pw - kw) // sw + 1
    y = np.zeros((N, C, OH, OW))
    for n in range(N):
        for c in range(C):
            for oh in range(OH):
                for ow in range(OW):
                    vals, cnt = [], 0
                    for i in range(kh):
                        for j in range(kw):
                            h, w_ = oh * sh - ph + i, ow * sw - pw + j
                            inside = 0 <= h < H and 0 <= w_ < W
                            if mode == "max":
                                vals.append(x[n, c, h, w_] if inside else -np.inf)
                            else:
                                vals.append(x[n, c, h, w_] if inside else 0.0)
                                cnt += inside
                    if mode == "max":
                        y[n, c, oh, ow] = max(vals)
                    else:
                        y[n, c, oh, ow] = sum(vals) / (kh * kw if count_include_pad else cnt)
    return y


def numgrad(f, x, dy, eps=1e-6):
    """Central finite difference of s(x) = sum(dy * f(x)) w.r.t. x (float64)."""
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for k in range(flat.size):
        old = flat[k]
        flat[k] = old + eps
        sp = np.sum(dy * f(x))
        flat[k] = old - eps
        sm = np.sum(dy * f(x))
        flat[k] = old
        gf[k] = (sp - sm) / (2 * eps)
    return g


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


CONV_CASES = [
    # (N, C, H, W, O, KH, KW, stride, padding, dilation, groups)
    (2, 3, 7, 6, 4, 3, 3, (1, 1), (0, 0), (1, 1), 1),
    (2, 3, 7, 9, 4, 3, 2, (1, 1), (1, 0), (1, 1), 1),
    (2, 2, 9, 8, 3, 3, 3, (2, 2), (1, 1), (1, 1), 1),
    (1, 2, 9, 10, 2, 3, 2, (1, 2), (2, 1), (2, 2), 1),
    (2, 4, 8, 7, 6, 3, 3, (2, 1), (1, 2), (2, 1), 2),
    (1, 1, 10, 10, 3, 5, 5, (1, 1), (2, 2), (1, 1), 1),
    (2, 4, 5, 5, 4, 1, 1, (1, 1), (0, 0), (1, 1), 4),
    (3, 5, 4, 6, 7, 1, 1, (1, 1), (0, 0), (1, 1), 1),   # 1x1: the batched-GEMM path
    (1, 2, 4, 13, 2, 2, 5, (3, 2), (0, 2), (1, 1), 1),
]


# ------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_forward_matches_naive(case):
    N, C, H, W, O, KH, KW, s, p, d, g = case
    x = RNG.standard_normal((N, C, H, W))
    w = RNG.standard_normal((O, C // g, KH, KW))
    b = RNG.standard_normal(O)
    close(K.conv2d(x, w, b, s, p, d, g), ref_conv2d(x, w, b, s, p, d, g), 1e-10)
    close(K.conv2d(x, w, None, s, p, d, g), ref_conv2d(x, w, None, s, p, d, g), 1e-10)


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_grads_finite_difference(case):
    N, C, H, W, O, KH, KW, s, p, d, g = case
    x = RNG.standard_normal((N, C, H, W))
    w = RNG.standard_normal((O, C // g, KH, KW))
    y = K.conv2d(x, w, None, s, p, d, g)
    dy = RNG.standard_normal(y.shape)
    dx = K.conv2d_grad_input(dy, w, x.shape, s, p, d, g)
    dw = K.conv2d_grad_weight(dy, x, w.shape, s, p, d, g)
    close(dx, numgrad(lambda t: K.conv2d(t, w, None, s, p, d, g), x.copy(), dy), 1e-6)
    close(dw, numgrad(lambda t: K.conv2d(x, t, None, s, p, d, g), w.copy(), dy), 1e-6)


def test_im2col_layout():
    x = RNG.standard_normal((2, 3, 6, 5))
    cols = K.im2col(x, (3, 2), (2, 1), (1, 0), (1, 2))
    OH, OW = (6 + 2 - 3) // 2 + 1, (5 - 3) // 1 + 1
    assert cols.shape == (2, 3 * 3 * 2, OH * OW)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0)))
    for c in range(3):
        for i in range(3):
            for j in range(2):
                r = (c * 3 + i) * 2 + j
                for oh in range(OH):
                    for ow in range(OW):
                        assert cols[1, r, oh * OW + ow] == xp[1, c, oh * 2 + i, ow + 2 * j]
    w = RNG.standard_normal((4, 3, 3, 2))
    close((w.reshape(4, -1) @ cols).reshape(2, 4, OH, OW), K.conv2d(x, w, None, (2, 1), (1, 0), (1, 2)), 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_dtype_and_out(dtype):
    x = RNG.standard_normal((3, 2, 8, 8)).astype(dtype)
    w = RNG.standard_normal((4, 2, 3, 3)).astype(dtype)
    b = RNG.standard_normal(4).astype(dtype)
    y = K.conv2d(x, w, b, (1, 1), (1, 1))
    assert y.dtype == dtype
    out = np.empty_like(y)
    assert K.conv2d(x, w, b, (1, 1), (1, 1), out=out) is out
    close(out, y, 0)
    dy = RNG.standard_normal(y.shape).astype(dtype)
    dx = K.conv2d_grad_input(dy, w, x.shape, (1, 1), (1, 1), (1, 1), 1)
    dw = K.conv2d_grad_weight(dy, x, w.shape, (1, 1), (1, 1), (1, 1), 1)
    assert dx.dtype == dtype and dw.dtype == dtype
    outw = np.empty_like(dw)
    assert K.conv2d_grad_weight(dy, x, w.shape, (1, 1), (1, 1), (1, 1), 1, out=outw) is outw
    close(outw, dw, 1e-5)
    ref = ref_conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), (1, 1), (1, 1), (1, 1), 1)
    close(y, ref, 1e-4 if dtype == np.float32 else 1e-10)


def test_conv2d_errors():
    x = np.zeros((2, 3, 5, 5))
    with pytest.raises(ValueError, match="x: expected a 4-D"):
        K.conv2d(np.zeros((3, 5, 5)), np.zeros((2, 3, 3, 3)))
    with pytest.raises(ValueError, match="w: expected a 4-D"):
        K.conv2d(x, np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match=r"w.shape\[1\] == C // groups"):
        K.conv2d(x, np.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match="groups"):
        K.conv2d(x, np.zeros((2, 1, 3, 3)), groups=2)
    with pytest.raises(ValueError, match="larger than the padded input"):
        K.conv2d(x, np.zeros((2, 3, 7, 7)), padding=(0, 0))
    with pytest.raises(ValueError, match="b: expected shape"):
        K.conv2d(x, np.zeros((2, 3, 3, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="dy: expected shape"):
        K.conv2d_grad_input(np.zeros((2, 2, 4, 4)), np.zeros((2, 3, 3, 3)), x.shape)
    with pytest.raises(ValueError, match="floating"):
        K.conv2d(x.astype(np.int64), np.zeros((2, 3, 3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="act: expected None or 'relu', got 'tanh'"):
        K.conv2d(x, np.zeros((2, 3, 3, 3)), act="tanh")


# ------------------------------------------------------------------------------------------
# pooling
# ------------------------------------------------------------------------------------------

POOL_CASES = [
    # (shape, kernel, stride, padding)
    ((2, 3, 8, 6), (2, 2), (2, 2), (0, 0)),  # fast path
    ((2, 2, 9, 9), (3, 3), (3, 3), (0, 0)),  # fast path, k=3
    ((2, 2, 7, 9), (3, 3), (2, 2), (1, 1)),  # overlapping, padded
    ((1, 2, 9, 8), (3, 2), (2, 1), (0, 1)),  # overlapping, non-square
    ((2, 2, 7, 7), (2, 2), (2, 2), (0, 0)),  # k == s but not divisible
    ((1, 1, 6, 7), (2, 3), (1, 2), (1, 1)),
]


def _untied(shape):
    # a permutation of distinct values: no ties inside any window
    return RNG.permutation(np.prod(shape)).reshape(shape).astype(np.float64) / 7.0 + RNG.random(shape) * 1e-3


@pytest.mark.parametrize("shape,k,s,p", POOL_CASES)
def test_max_pool_forward_and_grad(shape, k, s, p):
    x = _untied(shape)
    y = K.max_pool2d(x, k, s, p)
    close(y, ref_pool(x, k, s, p, "max"), 0)
    dy = RNG.standard_normal(y.shape)
    dx = K.max_pool2d_grad(dy, x, y, k, s, p)
    close(dx, numgrad(lambda t: K.max_pool2d(t, k, s, p), x.copy(), dy, eps=1e-7), 1e-6)


def test_max_pool_separable_blocks_match_definition(monkeypatch):
    # the separable pass over blocks of planes (tiny blocks here, so several and a partial
    # last one) equals the kh*kw-offset definition bit for bit, NaN included, for
    # non-contiguous inputs and outputs
    from hybridl.kernels import pool as P
    monkeypatch.setattr(P, "_POOL_BLOCK_BYTES", 700)
    rng = np.random.default_rng(5)
    for _ in range(60):
        kh, kw = (int(v) for v in rng.integers(1, 5, 2))
        sh, sw = (int(v) for v in rng.integers(1, 4, 2))
        ph, pw = int(rng.integers(0, kh // 2 + 1)), int(rng.integers(0, kw // 2 + 1))
        H, W = int(rng.integers(max(1, kh - 2 * ph), 11)), int(rng.integers(max(1, kw - 2 * pw), 11))
        x = rng.standard_normal((int(rng.integers(1, 4)), int(rng.integers(1, 5)), W, H)).transpose(0, 1, 3, 2)
        x[0, 0, 0, 0] = np.nan if rng.random() < 0.3 else x[0, 0, 0, 0]
        y = K.max_pool2d(x, (kh, kw), (sh, sw), (ph, pw))
        # the definition with NumPy's NaN rule (np.maximum propagates NaN)
        xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
        OH, OW = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
        ref = np.full(x.shape[:2] + (OH, OW), -np.inf)
        for i in range(kh):
            for j in range(kw):
                ref = np.maximum(ref, xp[:, :, i:i + sh * (OH - 1) + 1:sh, j:j + sw * (OW - 1) + 1:sw])
        np.testing.assert_array_equal(y, ref)
        out = np.empty(y.shape[:2] + y.shape[:1:-1]).transpose(0, 1, 3, 2)
        assert K.max_pool2d(x, (kh, kw), (sh, sw), (ph, pw), out=out) is out
        np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("shape,k,s,p", [c for c in POOL_CASES if c[3] != (0, 0)])
def test_max_pool_grad_of_minus_inf_windows_stays_inside_the_input(shape, k, s, p):
    # windows whose real inputs are all -inf (a masked score map): the max is -inf, and so is
    # the padding; the gradient must go to the first *input* position (PyTorch's argmax),
    # not to a padding cell that is then cropped (the gradient was lost)
    x = _untied(shape)
    x[..., : shape[2] // 2, :] = -np.inf
    x[0, 0] = -np.inf
    y = K.max_pool2d(x, k, s, p)
    dy = np.ones_like(y)
    dx = K.max_pool2d_grad(dy, x, y, k, s, p)
    # reference: each window's dy to its first maximum among its input positions
    ref = np.zeros_like(x)
    N, C, H, W = shape
    for n in range(N):
        for c in range(C):
            for oh in range(y.shape[2]):
                for ow in range(y.shape[3]):
                    best = None
                    for i in range(k[0]):
                        for j in range(k[1]):
                            r, q = oh * s[0] + i - p[0], ow * s[1] + j - p[1]
                            if 0 <= r < H and 0 <= q < W and (best is None or x[n, c, r, q] > x[n, c][best]):
                                best = (r, q)
                    ref[n, c][best] += dy[n, c, oh, ow]
    np.testing.assert_array_equal(dx, ref)
    assert dx.sum() == dy.sum()


def test_max_pool_grad_ties_go_to_first_max():
    x = np.ones((1, 1, 4, 4))
    y = K.max_pool2d(x, (2, 2), (2, 2), (0, 0))
    dx = K.max_pool2d_grad(np.ones_like(y), x, y, (2, 2), (2, 2), (0, 0))
    expect = np.zeros((4, 4))
    expect[::2, ::2] = 1
    close(dx[0, 0], expect, 0)
    # overlapping windows on a constant input: each window picks its top-left element
    x = np.ones((1, 1, 5, 5))
    y = K.max_pool2d(x, (3, 3), (2, 2), (0, 0))
    dx = K.max_pool2d_grad(np.ones_like(y), x, y, (3, 3), (2, 2), (0, 0))
    expect = np.zeros((5, 5))
    expect[0:3:2, 0:3:2] = 1
    close(dx[0, 0], expect, 0)


@pytest.mark.parametrize("shape,k,s,p", POOL_CASES)
@pytest.mark.parametrize("cip", [True, False])
def test_avg_pool_forward_and_grad(shape, k, s, p, cip):
    x = RNG.standard_normal(shape)
    y = K.avg_pool2d(x, k, s, p, cip)
    close(y, ref_pool(x, k, s, p, "avg", cip), 1e-12)
    dy = RNG.standard_normal(y.shape)
    dx = K.avg_pool2d_grad(dy, x.shape, k, s, p, cip)
    close(dx, numgrad(lambda t: K.avg_pool2d(t, k, s, p, cip), x.copy(), dy), 1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pool_dtypes(dtype):
    x = RNG.standard_normal((2, 3, 6, 6)).astype(dtype)
    for k, s, p in [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1))]:
        y = K.max_pool2d(x, k, s, p)
        assert y.dtype == dtype
        assert K.max_pool2d_grad(np.ones_like(y), x, y, k, s, p).dtype == dtype
        a = K.avg_pool2d(x, k, s, p)
        assert a.dtype == dtype
        assert K.avg_pool2d_grad(np.ones_like(a), x.shape, k, s, p).dtype == dtype


def test_pool_errors():
    with pytest.raises(ValueError, match="x: expected a 4-D"):
        K.max_pool2d(np.zeros((3, 4, 4)), (2, 2), (2, 2), (0, 0))
    with pytest.raises(ValueError, match="kernel"):
        K.max_pool2d(np.zeros((1, 1, 3, 3)), (5, 5), (1, 1), (0, 0))
    with pytest.raises(ValueError, match="padding"):
        K.avg_pool2d(np.zeros((1, 1, 8, 8)), (2, 2), (2, 2), (2, 2))
    with pytest.raises(ValueError, match="dy: expected shape"):
        K.avg_pool2d_grad(np.zeros((1, 1, 3, 3)), (1, 1, 8, 8), (2, 2), (2, 2), (0, 0))


# ------------------------------------------------------------------------------------------
# normalization
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 3, 2)])
def test_batch_norm(shape):
    x = RNG.standard_normal(shape) * 2 + 1
    C = shape[1]
    gamma, beta = RNG.standard_normal(C), RNG.standard_normal(C)
    eps = 1e-5
    y, mean, var = K.batch_norm_train(x, gamma, beta, eps)
    red = tuple(a for a in range(x.ndim) if a != 1)
    bs = [1] * x.ndim
    bs[1] = C
    close(mean, x.mean(red), 1e-12)
    close(var, x.var(red), 1e-12)
    close(y, (x - mean.reshape(bs)) / np.sqrt(var.reshape(bs) + eps) * gamma.reshape(bs) + beta.reshape(bs), 1e-10)
    yi = K.batch_norm_infer(x, gamma, beta, mean, var, eps)
    close(yi, y, 1e-10)
    dy = RNG.standard_normal(shape)
    dx, dg, db = K.batch_norm_grad(dy, x, gamma, mean, var, eps)
    close(dx, numgrad(lambda t: K.batch_norm_train(t, gamma, beta, eps)[0], x.copy(), dy), 1e-5)
    close(dg, numgrad(lambda t: K.batch_norm_train(x, t, beta, eps)[0], gamma.copy(), dy), 1e-6)
    close(db, numgrad(lambda t: K.batch_norm_train(x, gamma, t, eps)[0], beta.copy(), dy), 1e-6)


def test_batch_norm_other_axis_and_dtype():
    x = RNG.standard_normal((5, 3, 4)).astype(np.float32)
    g, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    y, m, v = K.batch_norm_train(x, g, b, 1e-5, axis=-1)
    assert y.dtype == m.dtype == v.dtype == np.float32 and m.shape == (4,)
    close(y.reshape(-1, 4).mean(0), np.zeros(4), 1e-5)
    dx, dg, db = K.batch_norm_grad(np.ones_like(x), x, g, m, v, 1e-5, axis=-1)
    assert dx.dtype == dg.dtype == db.dtype == np.float32
    with pytest.raises(ValueError, match="gamma: expected shape"):
        K.batch_norm_train(x, np.ones(3), b, 1e-5, axis=-1)
    with pytest.raises(ValueError, match="x: expected a"):
        K.batch_norm_train(np.zeros(3), np.ones(3), np.zeros(3), 1e-5)


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 6)])
def test_layer_norm(shape):
    x = RNG.standard_normal(shape) * 3 - 1
    D = shape[-1]
    gamma, beta = RNG.standard_normal(D), RNG.standard_normal(D)
    eps = 1e-5
    y, mean, var = K.layer_norm(x, gamma, beta, eps)
    assert mean.shape == shape[:-1]
    close(y, (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta, 1e-10)
    dy = RNG.standard_normal(shape)
    dx, dg, db = K.layer_norm_grad(dy, x, gamma, mean, var, eps)
    close(dx, numgrad(lambda t: K.layer_norm(t, gamma, beta, eps)[0], x.copy(), dy), 1e-5)
    close(dg, numgrad(lambda t: K.layer_norm(x, t, beta, eps)[0], gamma.copy(), dy), 1e-6)
    close(db, numgrad(lambda t: K.layer_norm(x, gamma, t, eps)[0], beta.copy(), dy), 1e-6)
    y32 = K.layer_norm(x.astype(np.float32), gamma.astype(np.float32), beta.astype(np.float32), eps)[0]
    assert y32.dtype == np.float32
    with pytest.raises(ValueError, match="axis"):
        K.layer_norm(x, gamma, beta, eps, axis=0)


# ------------------------------------------------------------------------------------------
# softmax
# ------------------------------------------------------------------------------------------

def test_softmax_and_log_softmax_stable():
    x = RNG.standard_normal((4, 7)) * 3
    ref = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    close(K.softmax(x), ref, 1e-12)
    close(K.log_softmax(x), np.log(ref), 1e-12)
    close(K.softmax(x, axis=0), np.exp(x) / np.exp(x).sum(0, keepdims=True), 1e-12)
    big = np.array([[1000.0, 1001.0, -1000.0]], dtype=np.float32)
    s = K.softmax(big)
    assert s.dtype == np.float32 and np.all(np.isfinite(s))
    assert np.all(np.isfinite(K.log_softmax(big)))


def test_softmax_cross_entropy():
    logits = RNG.standard_normal((5, 4)) * 2
    labels = RNG.integers(0, 4, 5)
    loss = K.softmax_cross_entropy(logits, labels)
    close(loss, -np.log(K.softmax(logits))[np.arange(5), labels], 1e-12)
    dloss = RNG.standard_normal(5)
    g = K.softmax_cross_entropy_grad(dloss, logits, labels)
    close(g, numgrad(lambda t: K.softmax_cross_entropy(t, labels), logits.copy(), dloss), 1e-6)
    l32 = K.softmax_cross_entropy(logits.astype(np.float32), labels)
    assert l32.dtype == np.float32
    assert K.softmax_cross_entropy_grad(np.ones(5, np.float32), logits.astype(np.float32), labels).dtype == np.float32
    with pytest.raises(ValueError, match="labels: expected an integer"):
        K.softmax_cross_entropy(logits, labels.astype(np.float64))
    with pytest.raises(ValueError, match="labels: expected class indices"):
        K.softmax_cross_entropy(logits, np.array([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="logits: expected a 2-D"):
        K.softmax_cross_entropy(logits[0], labels)


@pytest.mark.parametrize("dt", [np.int8, np.int32, np.int64, np.uint8, np.uint16, np.uint64, ">i8",
                                ">i4", ">u8"])
def test_softmax_cross_entropy_label_range_every_int_dtype(dt):
    # the range check views signed labels as unsigned (one reduction for both bounds); a
    # non-native byte order takes the two-reduction path: every one must refuse -1 and K
    logits = RNG.standard_normal((3, 4))
    ok = np.array([3, 0, 2]).astype(dt)
    ref = -np.log(K.softmax(logits))[np.arange(3), [3, 0, 2]]
    close(K.softmax_cross_entropy(logits, ok), ref, 1e-12)
    bad = [np.array([0, 4, 1]).astype(dt)]
    if np.dtype(dt).kind == "i":
        bad.append(np.array([0, -1, 1]).astype(dt))
    loss, grad = K.softmax_cross_entropy_with_grad(1.0, logits, ok)
    close(loss, ref, 1e-12)
    close(grad, K.softmax_cross_entropy_grad(1.0, logits, np.array([3, 0, 2])), 0)
    for b in bad:
        with pytest.raises(ValueError, match=r"labels: expected class indices in \[0, 4\)"):
            K.softmax_cross_entropy_with_grad(1.0, logits, b)


@pytest.mark.parametrize("groups,bias", [(1, False), (1, True), (2, False)])
def test_conv_weight_gradient_is_contiguous(groups, bias):
    # a C-contiguous weight gradient, like the weight: the optimizers' BLAS updates need it
    x = RNG.standard_normal((3, 4, 9, 9)).astype(np.float32)
    w_shape = (6, 4 // groups, 3, 3)
    dy = RNG.standard_normal((3, 6, 7, 7)).astype(np.float32)
    r = K.conv2d_grad_weight(dy, x, w_shape, (1, 1), (0, 0), (1, 1), groups, bias=bias)
    dw = r[0] if bias else r
    assert dw.shape == w_shape and dw.flags.c_contiguous
    want = K.conv2d_grad_weight(dy.astype(np.float64), x.astype(np.float64), w_shape, (1, 1),
                                (0, 0), (1, 1), groups)
    close(dw, want, 1e-4)


@pytest.mark.parametrize("shift,scale", [(0.0, 1.0), (1000.0, 1.0), (50.0, 1e3)])
def test_batch_norm_float32_close_to_float64(shift, scale):
    # the per-channel sums run as one einsum over the (N, C, rest) view and the backward
    # never stores xhat: float32 results stay within float32 rounding of the float64 ones
    # (float32 holds x ~ 1000 to 6e-5, so a mean of 1000 with std 1 loses 4 digits of the
    # centred values in any float32 code: the previous kernel's dgamma was off by 2e-4 there)
    rng = np.random.default_rng(5)
    x64 = rng.standard_normal((64, 8, 12, 12)) * scale + shift
    dy64, g64, b64 = rng.standard_normal(x64.shape), rng.standard_normal(8), rng.standard_normal(8)
    y64, mu64, var64 = K.batch_norm_train(x64, g64, b64, 1e-5)
    ref = K.batch_norm_grad(dy64, x64, g64, mu64, var64, 1e-5)
    x, dy, g, b = (a.astype(np.float32) for a in (x64, dy64, g64, b64))
    y, mu, var = K.batch_norm_train(x, g, b, 1e-5)
    got = K.batch_norm_grad(dy, x, g, mu, var, 1e-5)
    tol = 1e-3 if shift > 100 * scale else 2e-6
    for a, r in zip((y,) + got, (y64,) + ref):
        assert a.dtype == np.float32
        assert np.abs(a - r).max() <= tol * np.abs(r).max()
    # float64 against the textbook formulas
    m = x64.mean(axis=(0, 2, 3), keepdims=True)
    v = x64.var(axis=(0, 2, 3), keepdims=True)
    xhat = (x64 - m) / np.sqrt(v + 1e-5)
    close(y64, g64.reshape(1, 8, 1, 1) * xhat + b64.reshape(1, 8, 1, 1), 1e-9)
    close(ref[1], (dy64 * xhat).sum(axis=(0, 2, 3)), 1e-9)


def test_batch_norm_long_runs_empty_batch_and_float16():
    # (1) a sample's channel of a million values: einsum alone adds it in SIMD lanes,
    # sequentially (2.5e-6 relative for the sum, 1.2e-5 for sum(dy * xc)); summed in runs of
    # 4096 and then pairwise it stays at float32 rounding
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((1, 2, 1024, 1024)) + 3).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, mu, var = K.batch_norm_train(x, np.ones(2, "f4"), np.zeros(2, "f4"), 1e-5)
    x64 = x.astype(np.float64)
    assert np.abs(mu - x64.mean(axis=(0, 2, 3))).max() < 1e-6 * 3
    assert np.abs(var / x64.var(axis=(0, 2, 3)) - 1).max() < 1e-6
    _, dg, db = K.batch_norm_grad(dy, x, np.ones(2, "f4"), mu, var, 1e-5)
    xhat = (x64 - x64.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(
        x64.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    want = (dy * xhat).sum(axis=(0, 2, 3))
    assert np.abs(dg - want).max() < 1e-6 * np.abs(want).max() + 1e-3
    close(db, dy.astype(np.float64).sum(axis=(0, 2, 3)), 1e-4)
    # (2) an empty batch: an empty y with NaN statistics, and zero gradients (as before)
    with np.errstate(all="ignore"):
        y, m, v = K.batch_norm_train(np.zeros((0, 3, 4, 4), "f4"), np.ones(3), np.zeros(3), 1e-5)
    assert y.shape == (0, 3, 4, 4) and np.isnan(m).all() and np.isnan(v).all()
    dx, dg, db = K.batch_norm_grad(np.zeros((0, 3, 4, 4), "f4"), np.zeros((0, 3, 4, 4), "f4"),
                                   np.ones(3), m, v, 1e-5)
    assert dx.shape == (0, 3, 4, 4) and not dg.any() and not db.any()
    # (3) float16: statistics accumulated in float32, as NumPy's mean (a float16 sum of
    # 16,384 values near 100 overflows)
    x16 = (rng.standard_normal((16, 2, 32, 32)) + 100).astype(np.float16)
    y, m, v = K.batch_norm_train(x16, np.ones(2), np.zeros(2), 1e-5)
    assert y.dtype == np.float16 and np.isfinite(y).all()
    close(m.astype(np.float64), x16.astype(np.float64).mean(axis=(0, 2, 3)), 1e-3)


def test_softmax_cross_entropy_large_logits_keep_precision():
    # the labelled logit is subtracted after the shift by the row max: with max + log(sum)
    # first, float32 rounds log(2) to 0.6875 at 1e6 and to 0 at 1e8 (torch: log 2 at both)
    for v in (1e6, 1e8, 3e38):
        logits = np.array([[v, v], [v, 0]], np.float32)
        labels = np.array([0, 0])
        want = np.array([np.log(2.0), 0.0], np.float32)
        close(K.softmax_cross_entropy(logits, labels), want, 1e-6)
        close(K.softmax_cross_entropy_with_grad(1.0, logits, labels)[0], want, 1e-6)


def test_softmax_cross_entropy_strided_logits_and_out():
    # flat label positions are used for C-contiguous arrays only: strided logits and a
    # strided out= give the same values as contiguous ones
    big = RNG.standard_normal((6, 10))
    logits, labels = big[::2, 1:8], RNG.integers(0, 7, 3)
    dense = np.ascontiguousarray(logits)
    dloss = RNG.standard_normal(3)
    l1, g1 = K.softmax_cross_entropy_with_grad(dloss, logits, labels)
    l2, g2 = K.softmax_cross_entropy_with_grad(dloss, dense, labels)
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(g1, g2)
    out = np.zeros((3, 14))[:, ::2]
    K.softmax_cross_entropy_grad(dloss, logits, labels, out=out)
    np.testing.assert_array_equal(out, g2)
    np.testing.assert_array_equal(K.softmax_cross_entropy(logits, labels), l2)


# ------------------------------------------------------------------------------------------
# against torch.nn.functional (optional)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CONV_CASES[:5] + [(4, 1, 28, 28, 6, 5, 5, (1, 1), (2, 2), (1, 1), 1),
                                                  (4, 6, 14, 14, 16, 5, 5, (1, 1), (0, 0), (1, 1), 1)])
def test_conv_vs_torch(case):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    N, C, H, W, O, KH, KW, s, p, d, g = case
    x = RNG.standard_normal((N, C, H, W))
    w = RNG.standard_normal((O, C // g, KH, KW))
    b = RNG.standard_normal(O)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = F.conv2d(tx, tw, torch.tensor(b), s, p, d, g)
    dy = RNG.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    close(K.conv2d(x, w, b, s, p, d, g), ty.detach().numpy(), 1e-10)
    close(K.conv2d_grad_input(dy, w, x.shape, s, p, d, g), tx.grad.numpy(), 1e-10)
    close(K.conv2d_grad_weight(dy, x, w.shape, s, p, d, g), tw.grad.numpy(), 1e-10)


@pytest.mark.parametrize("shape,k,s,p", POOL_CASES[:4])
def test_pool_vs_torch(shape, k, s, p):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = _untied(shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = F.max_pool2d(tx, k, s, p)
    dy = RNG.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    y = K.max_pool2d(x, k, s, p)
    close(y, ty.detach().numpy(), 0)
    close(K.max_pool2d_grad(dy, x, y, k, s, p), tx.grad.numpy(), 1e-12)
    for cip in (True, False):
        tx = torch.tensor(x, requires_grad=True)
        ty = F.avg_pool2d(tx, k, s, p, count_include_pad=cip)
        ty.backward(torch.tensor(dy))
        close(K.avg_pool2d(x, k, s, p, cip), ty.detach().numpy(), 1e-12)
        close(K.avg_pool2d_grad(dy, x.shape, k, s, p, cip), tx.grad.numpy(), 1e-12)


def test_norm_softmax_vs_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = RNG.standard_normal((4, 3, 5, 5))
    g, b = RNG.standard_normal(3), RNG.standard_normal(3)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    ty = F.batch_norm(tx, None, None, tg, tb, training=True, eps=1e-5)
    dy = RNG.standard_normal(x.shape)
    ty.backward(torch.tensor(dy))
    y, m, v = K.batch_norm_train(x, g, b, 1e-5)
    close(y, ty.detach().numpy(), 1e-10)
    dx, dg, db = K.batch_norm_grad(dy, x, g, m, v, 1e-5)
    close(dx, tx.grad.numpy(), 1e-10)
    close(dg, tg.grad.numpy(), 1e-10)
    close(db, tb.grad.numpy(), 1e-10)

    x = RNG.standard_normal((3, 4, 6))
    g, b = RNG.standard_normal(6), RNG.standard_normal(6)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    ty = F.layer_norm(tx, (6,), tg, tb, 1e-5)
    dy = RNG.standard_normal(x.shape)
    ty.backward(torch.tensor(dy))
    y, m, v = K.layer_norm(x, g, b, 1e-5)
    close(y, ty.detach().numpy(), 1e-10)
    dx, dg, db = K.layer_norm_grad(dy, x, g, m, v, 1e-5)
    close(dx, tx.grad.numpy(), 1e-10)
    close(dg, tg.grad.numpy(), 1e-10)
    close(db, tb.grad.numpy(), 1e-10)

    z = RNG.standard_normal((6, 5))
    lab = RNG.integers(0, 5, 6)
    tz = torch.tensor(z, requires_grad=True)
    tl = F.cross_entropy(tz, torch.tensor(lab), reduction="none")
    dl = RNG.standard_normal(6)
    tl.backward(torch.tensor(dl))
    close(K.softmax_cross_entropy(z, lab), tl.detach().numpy(), 1e-12)
    close(K.softmax_cross_entropy_grad(dl, z, lab), tz.grad.numpy(), 1e-12)
    close(K.log_softmax(z, 0), F.log_softmax(torch.tensor(z), 0).numpy(), 1e-12)


def test_conv_cols_cache_is_transparent():
    # (the kernels no longer cache columns between forward and backward; set_cols_cache_bytes
    # remains as a no-op setting, and the weight gradient must track x mutated in place)
    from hybridl.kernels import conv as C
    x = RNG.standard_normal((2, 3, 8, 8))
    w = RNG.standard_normal((4, 3, 3, 3))
    y = K.conv2d(x, w, None, (1, 1), (1, 1))
    dy = RNG.standard_normal(y.shape)
    ref = ref_dw = numgrad(lambda t: K.conv2d(x, t, None, (1, 1), (1, 1)), w.copy(), dy)
    close(K.conv2d_grad_weight(dy, x, w.shape, (1, 1), (1, 1), (1, 1), 1), ref, 1e-6)  # cache hit
    # x mutated in place after the forward: the cached columns must not be used
    K.conv2d(x, w, None, (1, 1), (1, 1))
    x2 = x
    x2 += 1.0
    ref2 = numgrad(lambda t: K.conv2d(x2, t, None, (1, 1), (1, 1)), w.copy(), dy)
    close(K.conv2d_grad_weight(dy, x2, w.shape, (1, 1), (1, 1), (1, 1), 1), ref2, 1e-6)
    prev = C.set_cols_cache_bytes(0)
    try:
        K.conv2d(x, w, None, (1, 1), (1, 1))
        close(K.conv2d_grad_weight(dy, x, w.shape, (1, 1), (1, 1), (1, 1), 1), ref2, 1e-6)
    finally:
        C.set_cols_cache_bytes(prev)
    assert ref_dw is ref


def test_conv2d_property_random_geometry():
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=12, deadline=None)
    @hyp.given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(3, 7), st.integers(3, 7),
               st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.integers(1, 2), st.integers(0, 1),
               st.integers(0, 2), st.integers(1, 2), st.integers(1, 2), st.integers(0, 2**31 - 1),
               st.booleans(), st.booleans(), st.sampled_from([None, 1]))
    def check(N, g, cg, H, W, KH, KW, sh, sw, ph, pw, dh, dw, seed, bias, relu, block_bytes):
        if dh * (KH - 1) + 1 > H + 2 * ph or dw * (KW - 1) + 1 > W + 2 * pw:
            return
        from hybridl.kernels import conv as C_
        r = np.random.default_rng(seed)
        C, O = g * cg, g * 2
        x = r.standard_normal((N, C, H, W))
        w = r.standard_normal((O, cg, KH, KW))
        args = ((sh, sw), (ph, pw), (dh, dw), g)
        y = K.conv2d(x, w, None, *args)
        close(y, ref_conv2d(x, w, None, *args), 1e-10)
        # bias (folded into the GEMM with one group) and the fused ReLU, in one-sample blocks too
        b = r.standard_normal(O) if bias else None
        saved = C_._BLOCK_BYTES
        C_._BLOCK_BYTES = saved if block_bytes is None else block_bytes
        try:
            yb = K.conv2d(x, w, b, *args, act="relu" if relu else None)
        finally:
            C_._BLOCK_BYTES = saved
        ref = ref_conv2d(x, w, b, *args)
        close(yb, np.maximum(ref, 0) if relu else ref, 1e-10)
        dy = r.standard_normal(y.shape)
        # adjoint identities: <dy, conv(x, w)> = <conv_grad_input(dy), x> = <conv_grad_weight(dy), w>
        s = np.sum(dy * y)
        close(np.sum(K.conv2d_grad_input(dy, w, x.shape, *args) * x), s, 1e-9)
        close(np.sum(K.conv2d_grad_weight(dy, x, w.shape, *args) * w), s, 1e-9)

    check()


# ------------------------------------------------------------------------------------------
# batch-blocked conv / fast avg-pool paths against straightforward float64 references
# ------------------------------------------------------------------------------------------

def _windows64(x, KH, KW, stride, padding, dilation):
    """float64 (N, C, OH, OW, KH, KW) view of the zero-padded input's windows."""
    from numpy.lib.stride_tricks import sliding_window_view
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    win = sliding_window_view(xp, (dh * (KH - 1) + 1, dw * (KW - 1) + 1), axis=(2, 3))
    return win[:, :, ::sh, ::sw, ::dh, ::dw]


def ref64_conv(x, w, b, stride, padding, dilation, groups):
    """(y, dx(dy), dw(dy)) references in float64 by einsum over windows (no im2col, no blocks)."""
    N, C, H, W = x.shape
    O, Cg, KH, KW = w.shape
    win = _windows64(x, KH, KW, stride, padding, dilation)
    w64 = w.astype(np.float64)
    Og = O // groups
    y = np.concatenate([np.einsum("nchwij,ocij->nohw", win[:, g * Cg:(g + 1) * Cg], w64[g * Og:(g + 1) * Og])
                        for g in range(groups)], axis=1)
    if b is not None:
        y = y + b.astype(np.float64)[None, :, None, None]

    def grads(dy):
        dy = dy.astype(np.float64)
        dw = np.concatenate([np.einsum("nohw,nchwij->ocij", dy[:, g * Og:(g + 1) * Og], win[:, g * Cg:(g + 1) * Cg])
                             for g in range(groups)], axis=0)
        (sh, sw), (ph, pw), (dh, dwl) = stride, padding, dilation
        OH, OW = dy.shape[2:]
        dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
        for g in range(groups):
            for i in range(KH):
                for j in range(KW):
                    dxp[:, g * Cg:(g + 1) * Cg, i * dh:i * dh + sh * (OH - 1) + 1:sh, j * dwl:j * dwl + sw * (OW - 1) + 1:sw] += \
                        np.einsum("nohw,oc->nchw", dy[:, g * Og:(g + 1) * Og], w64[g * Og:(g + 1) * Og, :, i, j])
        return dxp[:, :, ph:ph + H, pw:pw + W], dw

    return y, grads


FAST_CONV_CASES = [
    # (N, C, H, W, O, KH, KW, stride, padding, dilation, groups)
    (37, 1, 28, 28, 6, 5, 5, (1, 1), (2, 2), (1, 1), 1),  # LeNet conv1 (odd N: a partial block)
    (37, 6, 14, 14, 16, 5, 5, (1, 1), (0, 0), (1, 1), 1),  # LeNet conv2
    (5, 4, 9, 11, 6, 3, 3, (2, 2), (1, 1), (1, 1), 1),  # stride 2, padding 1
    (5, 3, 12, 10, 4, 3, 2, (1, 1), (2, 1), (2, 2), 1),  # dilation 2 (wide path)
    (5, 4, 10, 9, 6, 3, 3, (1, 1), (1, 1), (1, 1), 2),  # groups 2 (wide path)
    (4, 4, 11, 10, 4, 3, 3, (2, 1), (0, 2), (1, 2), 2),  # mixed, groups 2 (plain path)
    (3, 2, 9, 8, 4, 3, 3, (1, 1), (0, 1), (1, 1), 1),  # 2 rows per GEMM column, odd OH
    (3, 3, 9, 12, 4, 3, 3, (1, 1), (1, 0), (1, 2), 1),  # 2 rows per column, W-dilation, odd OH
    (3, 2, 6, 5, 3, 1, 1, (1, 1), (0, 0), (1, 1), 1),  # 1x1 kernel
    (3, 2, 5, 30, 3, 2, 12, (1, 1), (0, 0), (1, 1), 1),  # Wp > 2*OW: plain path at stride 1
    (1, 3, 8, 7, 2, 3, 3, (1, 1), (1, 1), (1, 1), 1),  # N=1
    (0, 3, 8, 7, 2, 3, 3, (1, 1), (1, 1), (1, 1), 1),  # N=0
    (6, 3, 12, 10, 9, 3, 2, (1, 1), (0, 0), (2, 2), 1),  # no padding, dilation 2: reads x itself
    (2, 6, 14, 14, 16, 5, 5, (1, 1), (0, 0), (1, 1), 1),  # no padding, N=2: last block copied
]


def test_conv_fast_path_selection():
    # the cases above reach every column layout: LeNet conv1 (O=6) computes 2 output rows per
    # GEMM column, conv2 is 'wide', stride 2 is plain
    from hybridl.kernels import conv as C
    g1 = C._Geometry((8, 1, 28, 28), (6, 1, 5, 5), (1, 1), (2, 2), (1, 1), 1, 28, 28)
    g2 = C._Geometry((8, 6, 14, 14), (16, 6, 5, 5), (1, 1), (0, 0), (1, 1), 1, 10, 10)
    g3 = C._Geometry((5, 4, 9, 11), (6, 4, 3, 3), (2, 2), (1, 1), (1, 1), 1, 5, 6)
    assert (g1.wide, g1.R) == (True, 2) and (g2.wide, g2.R) == (True, 1) and (g3.wide, g3.R) == (False, 1)


@pytest.mark.parametrize("case", FAST_CONV_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block_bytes", [None, 1])
def test_conv_blocked_paths_match_float64_reference(case, dtype, block_bytes, monkeypatch):
    from hybridl.kernels import conv as C
    if block_bytes is not None:
        monkeypatch.setattr(C, "_BLOCK_BYTES", block_bytes)  # one sample per block
        monkeypatch.setattr(C, "_BLOCK_BYTES_GRAD", block_bytes)
    N, Cc, H, W, O, KH, KW, s, p, d, g = case
    r = np.random.default_rng(7)
    x = r.standard_normal((N, Cc, H, W)).astype(dtype)
    w = r.standard_normal((O, Cc // g, KH, KW)).astype(dtype)
    b = r.standard_normal(O).astype(dtype)
    y_ref, grads = ref64_conv(x, w, b, s, p, d, g)
    dy = r.standard_normal(y_ref.shape).astype(dtype)
    dx_ref, dw_ref = grads(dy)
    tol = 2e-4 if dtype == np.float32 else 1e-10
    y = K.conv2d(x, w, b, s, p, d, g)
    y_relu = K.conv2d(x, w, b, s, p, d, g, act="relu")
    y_nobias = K.conv2d(x, w, None, s, p, d, g)
    dx = K.conv2d_grad_input(dy, w, x.shape, s, p, d, g)
    dw = K.conv2d_grad_weight(dy, x, w.shape, s, p, d, g)
    dw_b, db = K.conv2d_grad_weight(dy, x, w.shape, s, p, d, g, bias=True)   # + bias gradient
    for got, ref in ((y, y_ref), (y_relu, np.maximum(y_ref, 0)),
                     (y_nobias, y_ref - b.astype(np.float64).reshape(-1, 1, 1)),
                     (dx, dx_ref), (dw, dw_ref), (dw_b, dw_ref),
                     (db, dy.astype(np.float64).sum(axis=(0, 2, 3)))):
        assert got.dtype == dtype and got.shape == ref.shape
        scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)


def test_conv_blocked_out_noncontiguous_and_aliasing():
    r = np.random.default_rng(3)
    x = r.standard_normal((6, 4, 9, 9))
    w = r.standard_normal((4, 4, 3, 3))
    b = r.standard_normal(4)
    args = ((1, 1), (1, 1), (1, 1), 1)
    y_ref, grads = ref64_conv(x, w, b, *args)
    dy = r.standard_normal(y_ref.shape)
    dx_ref, dw_ref = grads(dy)
    # non-contiguous input and out buffers
    xt = np.asfortranarray(x)
    out = np.empty((9, 9, 4, 6)).transpose(3, 2, 0, 1)
    assert K.conv2d(xt, w, b, *args, out=out) is out
    close(out, y_ref, 1e-10)
    dxo = np.empty((9, 9, 4, 6)).transpose(3, 2, 0, 1)
    assert K.conv2d_grad_input(np.asfortranarray(dy), w, x.shape, *args, out=dxo) is dxo
    close(dxo, dx_ref, 1e-10)
    # out aliasing an input (same-shape conv written over its own input / over dy)
    xa = x.copy()
    assert K.conv2d(xa, w, b, *args, out=xa) is xa
    close(xa, y_ref, 1e-10)
    dya = dy.copy()
    assert K.conv2d_grad_input(dya, w, x.shape, *args, out=dya) is dya
    close(dya, dx_ref, 1e-10)
    # results do not alias the inputs
    y = K.conv2d(x, w, None, (1, 1), (0, 0))
    assert not np.may_share_memory(y, x)
    dw = K.conv2d_grad_weight(dy, x, w.shape, *args)
    dw_before = dw.copy()
    K.conv2d_grad_weight(2 * dy, x, w.shape, *args)
    close(dw, dw_before, 0)


AVG_FAST_CASES = [
    # (shape, kernel) with stride == kernel, no padding, divisible: the fast path
    ((128, 6, 28, 28), (2, 2)),  # LeNet pool1
    ((128, 16, 10, 10), (2, 2)),  # LeNet pool2
    ((3, 2, 9, 6), (3, 3)),
    ((3, 2, 8, 6), (2, 3)),
    ((3, 2, 8, 6), (4, 1)),
    ((3, 2, 8, 6), (1, 2)),
    ((3, 2, 5, 7), (1, 1)),
    ((1, 1, 2, 2), (2, 2)),
    ((0, 3, 4, 4), (2, 2)),
]


@pytest.mark.parametrize("shape,k", AVG_FAST_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_avg_pool_fast_path_matches_float64_reference(shape, k, dtype):
    r = np.random.default_rng(5)
    x = r.standard_normal(shape).astype(dtype)
    N, C, H, W = shape
    kh, kw = k
    x64 = x.astype(np.float64)
    y_ref = x64.reshape(N, C, H // kh, kh, W // kw, kw).mean(axis=(3, 5))
    y = K.avg_pool2d(x, k, k, (0, 0))
    assert y.dtype == dtype
    tol = 1e-6 if dtype == np.float32 else 1e-14
    close(y, y_ref, tol)
    dy = r.standard_normal(y.shape).astype(dtype)
    dx_ref = np.broadcast_to((dy.astype(np.float64) / (kh * kw))[:, :, :, None, :, None],
                             (N, C, H // kh, kh, W // kw, kw)).reshape(shape)
    dx = K.avg_pool2d_grad(dy, shape, k, k, (0, 0))
    assert dx.dtype == dtype and dx.flags.c_contiguous
    close(dx, dx_ref, tol)
    # caller buffers: contiguous, non-contiguous; non-contiguous dy
    out = np.empty(shape, dtype)
    assert K.avg_pool2d_grad(dy, shape, k, k, (0, 0), out=out) is out
    close(out, dx_ref, tol)
    out = np.empty(shape[::-1], dtype).T
    assert K.avg_pool2d_grad(np.asfortranarray(dy), shape, k, k, (0, 0), out=out) is out
    close(out, dx_ref, tol)
    yo = np.empty(y.shape[::-1], dtype).T
    assert K.avg_pool2d(np.asfortranarray(x), k, k, (0, 0), out=yo) is yo
    close(yo, y_ref, tol)
    assert not np.may_share_memory(K.avg_pool2d(x, (1, 1), (1, 1), (0, 0)), x)


# ------------------------------------------------------------------------------------------
# non-finite values stay where a direct convolution puts them (0 * inf in padded layouts)
# ------------------------------------------------------------------------------------------

def test_conv_inf_and_nan_do_not_leak_into_other_outputs():
    # float64 references by einsum over windows: an inf/NaN reaches only the outputs whose
    # window (or gradient tap) contains it; the fast layouts multiply zeros with real data
    # (R == 2 rows per GEMM column, junk columns, zero-padded dy), where 0 * inf = NaN
    with np.errstate(invalid="ignore"):
        x = np.zeros((1, 1, 6, 4))
        x[0, 0, 5, 1] = np.inf                         # forward, R == 2 (O <= 8, KH >= 3)
        w = np.ones((1, 1, 3, 3))
        y = K.conv2d(x, w)
        np.testing.assert_array_equal(y[0, 0, :, 0], [0, 0, 0, np.inf])
        xr = np.zeros((1, 1, 6, 6))
        xr[0, 0, 5, 2] = np.nan
        yr = K.conv2d(xr, np.ones((4, 1, 3, 3)), np.zeros(4), act="relu")
        assert np.array_equal(np.isnan(yr).any(axis=(0, 1, 3)), [False, False, False, True])
        for O in (4, 9):                               # weight gradient: R == 2 and wide R == 1
            x = np.zeros((1, 1, 4, 4))
            x[0, 0, 1, 0] = np.inf
            dw = K.conv2d_grad_weight(np.ones((1, O, 2, 2)), x, (O, 1, 3, 3))
            np.testing.assert_array_equal(dw[0, 0], [[np.inf, 0, 0], [np.inf, 0, 0], [0, 0, 0]])
        w = np.zeros((1, 1, 3, 3))
        w[0, 0, 2, 2] = np.inf                         # input gradient, stride 1
        dx = K.conv2d_grad_input(np.ones((1, 1, 2, 2)), w, (1, 1, 4, 4))
        np.testing.assert_array_equal(dx[0, 0], [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, np.inf, np.inf],
                                                 [0, 0, np.inf, np.inf]])


def test_conv_argument_types_are_checked_not_converted():
    x = np.ones((1, 2, 4, 4), np.float32)
    w = np.ones((2, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="groups: expected an int, got float 1.5"):
        K.conv2d(x, w, groups=1.5)
    with pytest.raises(ValueError, match=r"padding: expected an int or a pair \(int, int\), got True"):
        K.conv2d(x, w, padding=True)
    with pytest.raises(ValueError, match="b: expected a floating-point array"):
        K.conv2d(x, w, np.array([1, None], dtype=object))
    with pytest.raises(ValueError, match="out: expected a writeable array"):
        K.conv2d(x, w, out=np.broadcast_to(np.float32(0), (1, 2, 2, 2)))
    from hybridl import nd
    with pytest.raises(ValueError, match=r"conv2d: stride: expected an int or a pair \(int, int\), got 'ab'"):
        nd.conv2d(nd.array(x), nd.array(w), stride="ab")
    with pytest.raises(ValueError, match="conv2d: groups: expected an int, got bool True"):
        nd.conv2d(nd.array(x), nd.array(w), groups=True)
    # NumPy integers and a float bias of another precision are fine (the bias is cast)
    y = K.conv2d(x, w, np.ones(2), stride=np.int64(1), padding=(np.int32(1), 1))
    assert y.dtype == np.float32 and y.shape == (1, 2, 4, 4)


@pytest.mark.parametrize("k,st,pad", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)),
                                      ((2, 2), (1, 1), (0, 0))])
def test_max_pool_grad_sends_a_nan_windows_gradient_to_its_first_nan(k, st, pad):
    # the reference by hand: for each window, the first position (row-major) holding the max,
    # where a NaN counts as the max (as max_pool2d propagates it; PyTorch's CPU rule)
    from hybridl.kernels import pool
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 6, 6))
    x[0, 0, 1, 2] = np.nan
    x[1, 1, 4, 3] = np.nan
    x[1, 1, 4, 4] = np.nan
    y = pool.max_pool2d(x, k, st, pad)
    dy = rng.standard_normal(y.shape)
    dx = pool.max_pool2d_grad(dy, x, y, k, st, pad)
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])), constant_values=-np.inf)
    want = np.zeros_like(xp)
    for n in range(2):
        for c in range(2):
            for oh in range(y.shape[2]):
                for ow in range(y.shape[3]):
                    win = xp[n, c, oh * st[0]:oh * st[0] + k[0], ow * st[1]:ow * st[1] + k[1]]
                    flat = win.ravel()
                    i = int(np.flatnonzero(np.isnan(flat))[0]) if np.isnan(flat).any() \
                        else int(np.argmax(flat))
                    want[n, c, oh * st[0] + i // k[1], ow * st[1] + i % k[1]] += dy[n, c, oh, ow]
    want = want[:, :, pad[0]:pad[0] + 6, pad[1]:pad[1] + 6]
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)
