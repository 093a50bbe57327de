"""BLAS thread policy: every GEMM runs on the thread *budget*, and the budget changes only when
the number of engine workers does (or inside :func:`hybridl.engine.blas_threads`).

The budget is ``cores() // compute workers`` (the engine sets it), so that workers x BLAS threads
<= cores when several workers compute at once. Kernels call :func:`for_gemm` before a GEMM; it
applies the budget to the BLAS library (threadpoolctl's controller; ~2 us, only when it changed).

Why not a thread count per GEMM shape (one thread for small products)? OpenBLAS's pool size is
process-wide, and its result depends on it: the same product on 1 and 2 threads differs in the
last bits (the work is split and blocked differently; measured on the development VM for 6 of 7
shapes). Per-GEMM switching from several threads at once (two device workers, or a tiny op run
inline in the frontend while a worker multiplies) races: a GEMM may run on the count another
thread just set, and results stop being reproducible. With one count for everything, a result
depends only on the shapes and the budget: identical run to run, for the naive and the threaded
engine, and inline or on a worker. Runs with different budgets (one device vs two devices on 2
cores: 2 vs 1 BLAS threads) agree to float rounding, as with PyTorch or MKL at different thread
counts. OpenBLAS itself keeps small products on one thread.
"""
import os

__all__ = ["for_gemm", "set_budget", "budget", "cores", "pin"]


def cores():
    """The BLAS threads this process may use in all: the CPUs it may run on (its affinity
    mask, e.g. one core per rank under ``mpiexec -bind-to core``), capped by
    ``OPENBLAS_NUM_THREADS`` (else ``OMP_NUM_THREADS``) when set to a positive integer."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return max(1, min(n, int(v)))
    return max(1, n)


_state = {"ctl": None, "cur": None, "max": cores(), "ok": None, "pin": None}


def _controller():
    if _state["ok"] is None:
        try:
            import numpy  # noqa: F401 - loads the BLAS library
            from threadpoolctl import ThreadpoolController
            libs = ThreadpoolController().select(user_api="blas").lib_controllers
            _state["ctl"] = libs[0] if libs else None
        except Exception:  # noqa: BLE001 - no control: leave BLAS as it is
            _state["ctl"] = None
        _state["ok"] = _state["ctl"] is not None
    return _state["ctl"]


def for_gemm():
    """Make the BLAS pool size equal to the budget before a GEMM (the count does not depend on
    the product's shape, see above)."""
    want = _state["max"]
    if want != _state["cur"]:
        ctl = _controller()
        if ctl is not None:
            ctl.set_num_threads(want)
        _state["cur"] = want


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
