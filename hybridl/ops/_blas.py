"""BLAS thread policy: every GEMM runs on the thread *budget* of the engine op it belongs to.

The budget is ``cores() // compute workers`` (see :meth:`hybridl.engine.base.Engine.blas_budget`:
the devices pushed to so far, in push order), so that workers x BLAS threads <= cores when
several workers compute at once; :func:`hybridl.engine.blas_threads` pins it. Each op keeps the
budget of its push; the threaded engine sets it (:func:`set_budget`) when the op starts and
never runs two ops with different budgets at once. Kernels call :func:`for_gemm` before a GEMM;
it applies the budget to the BLAS library (OpenBLAS's own setter, else threadpoolctl's
controller; ~2 us, only when it changed).

Why not a thread count per GEMM shape (one thread for small products)? OpenBLAS's pool size is
process-wide, and its result depends on it: the same product on 1 and 2 threads differs in the
last bits (the work is split and blocked differently; measured on the development VM for 6 of 7
shapes). Per-GEMM switching from several threads at once (two device workers, or a tiny op run
inline in the frontend while a worker multiplies) races: a GEMM may run on the count another
thread just set, and results stop being reproducible. With the budget fixed per op by program
order, a result depends only on the program: identical run to run, for the naive and the
threaded engine, inline or on a worker. Runs with different budgets (one device vs two devices
on 2 cores: 2 vs 1 BLAS threads) agree to float rounding, as with PyTorch or MKL at different
thread counts. OpenBLAS itself keeps small products on one thread.
"""
import os
import threading
from ctypes import addressof as _addressof
from ctypes import c_char as _c_char

__all__ = ["for_gemm", "set_budget", "budget", "cores", "pin", "gemm_tn_accumulate", "axpy"]


def _affinity():
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cores():
    """The BLAS threads this process may use in all: the CPUs it may run on (its affinity
    mask, e.g. one core per rank under ``mpiexec -bind-to core``), capped by
    ``OPENBLAS_NUM_THREADS`` (else ``OMP_NUM_THREADS``) when set to a positive integer."""
    n = _affinity()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(var, "").strip()
        if v.isascii() and v.isdigit() and int(v) > 0:   # ('²'.isdigit() is True)
            return max(1, min(n, int(v)))
    return max(1, n)


_state = {"ctl": None, "cur": None, "max": cores(), "ok": None, "pin": None}
# one lookup (of the controller, of a cblas function) at a time: device workers make their
# first GEMM or update together, and a half-done lookup must not read as "not available"
_LOOKUP = threading.Lock()


def _controller():
    """The thread controllers of the BLAS libraries loaded (NumPy's; SciPy's own too when
    something imported SciPy), as one object with ``set_num_threads``."""
    if _state["ok"] is None:
        with _LOOKUP:                   # once, even when two workers ask first at once
            if _state["ok"] is None:
                try:
                    import numpy  # noqa: F401 - loads the BLAS library
                    from threadpoolctl import ThreadpoolController
                    libs = ThreadpoolController().select(user_api="blas").lib_controllers
                    _state["ctl"] = _All(libs) if libs else None
                except Exception:  # noqa: BLE001 - no control: leave BLAS as it is
                    _state["ctl"] = None
                _state["ok"] = _state["ctl"] is not None
    return _state["ctl"]


class _All:
    """``set_num_threads`` for every BLAS library loaded. OpenBLAS (pthreads build, NumPy's
    wheels) is called directly: threadpoolctl (>= 3.6) lets only the first thread that sets a
    limit through it change the pool size and silently ignores every other thread, and the
    budget is set from whichever engine worker runs the next GEMM (ignored calls left GEMMs
    on a stale count: 2 workers x 2 BLAS threads on 2 cores, and timing-dependent bits)."""

    def __init__(self, libs):
        self.setters = [_direct_setter(lib) or lib.set_num_threads for lib in libs]

    def set_num_threads(self, n):
        for fn in self.setters:
            fn(n)


def _direct_setter(lib):
    """OpenBLAS's own ``openblas_set_num_threads`` (a process-wide setting in its pthreads
    build, callable from any thread) for threadpoolctl's controller ``lib``, or None (another
    library, OpenBLAS's OpenMP build, or the symbol not found)."""
    if getattr(lib, "internal_api", None) != "openblas" or \
            getattr(lib, "threading_layer", None) == "openmp":
        return None
    try:
        import ctypes
        dl = ctypes.CDLL(lib.filepath)
        for prefix in ("scipy_", ""):
            for suffix in ("64_", "_64", ""):
                fn = getattr(dl, f"{prefix}openblas_set_num_threads{suffix}", None)
                if fn is not None:
                    fn.argtypes = [ctypes.c_int]
                    fn.restype = None
                    return lambda n, fn=fn: fn(int(n))
    except (OSError, AttributeError):
        pass
    return None


def for_gemm():
    """Make the BLAS pool size equal to the budget before a GEMM (the count does not depend on
    the product's shape, see above), and count it in :func:`wide_gemms` when that pool covers
    every core."""
    want = _state["max"]
    if want != _state["cur"]:
        ctl = _controller()
        if ctl is not None:
            ctl.set_num_threads(want)
        _state["cur"] = want
    if want >= _CORES:
        _tls.wide = getattr(_tls, "wide", 0) + 1


# the CPUs this process may run on when it started (not capped by OPENBLAS_NUM_THREADS: a
# 1-thread pool on a 2-core machine leaves a core free for other work)
_CORES = _affinity()
_tls = threading.local()


def wide_gemms():
    """How many GEMMs the calling thread has started on a BLAS pool covering every core (the
    engine compares it before and after an op: such an op leaves no core for other work, see
    :class:`hybridl.engine.threaded.ThreadedEngine`)."""
    return getattr(_tls, "wide", 0)


_KIND = {"f": "s", "d": "d"}


def _kind(dtype):
    """BLAS's letter for ``dtype`` (``s`` float32, ``d`` float64), or None for other dtypes
    and for a non-native byte order (BLAS would read the bytes as native floats)."""
    return _KIND.get(dtype.char) if dtype.isnative else None


_CBLAS = {}        # (routine, kind) -> (function, integer type) or None


def _argtypes(routine, itype, real):
    import ctypes
    p = ctypes.c_void_p
    if routine == "gemm":      # order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
        return [ctypes.c_int, ctypes.c_int, ctypes.c_int, itype, itype, itype, real, p, itype,
                p, itype, real, p, itype]
    if routine == "axpby":     # n, alpha, x, incx, beta, y, incy
        return [itype, real, p, itype, real, p, itype]
    return [itype, real, p, itype, p, itype]          # axpy: n, alpha, x, incx, y, incy


def _cblas(routine, kind):
    """``cblas_<kind><routine>`` (``gemm``, ``axpy`` or ``axpby``; kind ``s`` or ``d``) of the BLAS NumPy
    itself is linked to (the same library, threads and budget as ``np.matmul``; a second BLAS
    in the process would bring a second pool of spinning threads), through ctypes, or None when
    it cannot be found (looked up once, under a lock: a thread that asks while another looks it
    up waits for that answer). Returns ``(function, integer type)``."""
    key = (routine, kind)
    got = _CBLAS.get(key, _LOOKUP)
    if got is not _LOOKUP:
        return got
    with _LOOKUP:
        if key not in _CBLAS:
            _CBLAS[key] = _find_cblas(routine, kind)
        return _CBLAS[key]


def _find_cblas(routine, kind):
    try:
        import ctypes

        import numpy  # noqa: F401 - loads the BLAS library
        from threadpoolctl import threadpool_info
        paths = [i["filepath"] for i in threadpool_info()
                 if i.get("user_api") == "blas" and "numpy" in i["filepath"]]
        for path in paths:
            lib = ctypes.CDLL(path)
            for name, itype in ((f"scipy_cblas_{kind}{routine}64_", ctypes.c_int64),
                                (f"cblas_{kind}{routine}64_", ctypes.c_int64),
                                (f"cblas_{kind}{routine}", ctypes.c_int)):
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = None
                    fn.argtypes = _argtypes(routine, itype,
                                            ctypes.c_float if kind == "s" else ctypes.c_double)
                    return (fn, itype)
    except Exception:  # noqa: BLE001 - no such library: callers fall back to NumPy
        pass
    return None


def _address(a):
    """The address of ``a``'s first element: through the buffer protocol (~1 us; the NumPy
    ``a.ctypes`` helper costs ~3 us, and a small GEMM is called many times per step), or
    ``a.ctypes.data`` for read-only or empty arrays, which ``from_buffer`` refuses."""
    try:
        return _addressof(_c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


def gemm_tn_accumulate(alpha, a, b, beta, c):
    """``c = alpha * a.T @ b + beta * c`` in place, as ONE BLAS call (``cblas_?gemm``, whose
    ``beta`` NumPy's matmul lacks). ``a`` (K, M), ``b`` (K, N), ``c`` (M, N): C-contiguous,
    one float dtype (float32 or float64). Returns False (and does nothing) when that BLAS
    function is not available or the arrays do not qualify; the caller then computes it with
    NumPy."""
    kind = _kind(c.dtype)
    if (kind is None or not (a.dtype == b.dtype == c.dtype) or a.ndim != 2 or b.ndim != 2
            or not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous
                    and c.flags.writeable)
            or a.shape[0] != b.shape[0] or c.shape != (a.shape[1], b.shape[1])):
        return False
    got = _cblas("gemm", kind)
    if got is None:
        return False
    (k, m), n = a.shape, b.shape[1]
    for_gemm()
    # row-major (101); a transposed (112), b as is (111)
    got[0](101, 112, 111, m, n, k, alpha, _address(a), max(m, 1), _address(b), max(n, 1), beta,
           _address(c), max(n, 1))
    return True


def ready(arrays, written=(), routines=("axpy", "axpby")):
    """Whether the one-pass BLAS updates ``routines`` can work on ``arrays``: one float dtype
    (float32 or float64, native byte order), one shape, not empty, all C-contiguous, the
    arrays of ``written`` writable, and the routines found in NumPy's BLAS."""
    a0 = arrays[0]
    kind = _kind(a0.dtype)
    return (kind is not None and a0.size > 0
            and all(a.dtype == a0.dtype and a.shape == a0.shape and a.flags.c_contiguous
                    for a in arrays)
            and all(a.flags.writeable for a in written)
            and all(_cblas(r, kind) is not None for r in routines))


def _level1(routine, x, y):
    """``cblas_?<routine>`` for a one-pass update of ``y`` from ``x`` (see :func:`ready`), or
    None when it is not available or the arrays do not qualify."""
    if not ready((x, y), (y,), (routine,)):
        return None
    for_gemm()
    return _cblas(routine, _kind(y.dtype))[0]


def axpy(alpha, x, y):
    """``y += alpha * x`` in place in ONE pass over both (BLAS ``?axpy``: no temporary for
    ``alpha * x``, as NumPy's two calls need). ``x``, ``y``: C-contiguous, same shape, one
    float dtype (float32 or float64); ``y`` writable. Returns False (and does nothing) when
    that BLAS function is not available or the arrays do not qualify.

    Each element is ``y + alpha * x`` rounded once or twice (the library may fuse the
    multiply-add), the same every run for the same size and thread budget."""
    fn = _level1("axpy", x, y)
    if fn is None:
        return False
    fn(y.size, alpha, _address(x), 1, _address(y), 1)
    return True


def axpby(alpha, x, beta, y):
    """``y = alpha * x + beta * y`` in place in ONE pass (``?axpby``, an OpenBLAS extension:
    NumPy needs three passes and a temporary). Arrays, return value and rounding as
    :func:`axpy`."""
    fn = _level1("axpby", x, y)
    if fn is None:
        return False
    fn(y.size, alpha, _address(x), 1, beta, _address(y), 1)
    return True


def set_budget(n):
    """BLAS threads for every GEMM from now on (the engine sets cores // compute workers);
    ignored while :func:`pin` holds a count."""
    if _state["pin"] is not None:
        return
    _state["max"] = max(1, int(n))
    _state["cur"] = None


def pin(n):
    """Hold the budget at ``n`` (None: release) whatever workers start meanwhile; returns the
    previous pin (used by :func:`hybridl.engine.blas_threads`)."""
    prev = _state["pin"]
    _state["pin"] = None if n is None else max(1, int(n))
    if n is not None:
        _state["max"] = _state["pin"]
        _state["cur"] = None
    return prev


def budget():
    """The current BLAS threads per GEMM."""
    return _state["max"]
