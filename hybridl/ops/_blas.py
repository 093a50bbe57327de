"""BLAS thread policy: small GEMMs on one thread, large ones on the thread budget.

OpenBLAS (NumPy's BLAS) starts its thread pool for every GEMM above a tiny size; for the
small matrices of a LeNet step the hand-over costs more than it gains, and on a loaded machine
spinning BLAS threads can make a step 5-10x slower. Kernels call :func:`for_gemm` before a
GEMM: below ``HYBRIDL_BLAS_MT_FLOPS`` (default 2e6 flops, about a 100^3 product) one thread is
used, above it the budget set by the engine (cores // busy workers). Measured on the 2-core
development VM (quiet): two threads win 1.1-1.8x from ~2e6 flops with outputs of >= 4096
elements (128x120 @ 120x84: 48 -> 27 us; 256x128 @ 128x128: 130 -> 75 us); below that OpenBLAS
gains nothing. Switching costs ~2 us
through threadpoolctl's OpenBLAS controller and only happens when the wanted count changes.
"""
import os

__all__ = ["for_gemm", "set_budget", "budget"]

MT_FLOPS = float(os.environ.get("HYBRIDL_BLAS_MT_FLOPS", 2e6))
MT_OUT = int(os.environ.get("HYBRIDL_BLAS_MT_OUT", 64 * 64))
_state = {"ctl": None, "cur": None, "max": os.cpu_count() or 1, "ok": None}


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


def for_gemm(m, n, k):
    """Set the BLAS thread count suited to an (m x k) @ (k x n) product: several threads only
    when it has >= ``MT_FLOPS`` flops AND an output of >= ``MT_OUT`` elements (OpenBLAS splits
    the output among threads; a tall-skinny product with a tiny output gains nothing)."""
    want = _state["max"] if (2.0 * m * n * k >= MT_FLOPS and m * n >= MT_OUT) else 1
    if want != _state["cur"]:
        ctl = _controller()
        if ctl is not None:
            ctl.set_num_threads(want)
        _state["cur"] = want


def set_budget(n):
    """Maximum BLAS threads per GEMM (the engine sets cores // busy workers)."""
    _state["max"] = max(1, int(n))
    _state["cur"] = None


def budget():
    """The current maximum BLAS threads per GEMM."""
    return _state["max"]
