"""Keep freed array memory for reuse: glibc ``mallopt`` settings applied at import.

Every eager op returns a fresh NumPy array. With glibc's defaults, arrays above the (dynamic)
mmap threshold, and freed memory at the top of the heap above the trim threshold, go back to
the operating system, and the next array of that size page-faults its memory in again (a 2.4
MB LeNet activation is ~600 faults). Frameworks keep such memory in a caching allocator
(PyTorch's, MXNet's pooled storage manager); here the C allocator is told to keep it:

* ``M_MMAP_THRESHOLD`` = 32 MiB: arrays below that come from the heap and are reused;
* ``M_TRIM_THRESHOLD`` = 128 MiB: free memory at the heap top is kept up to that;
* ``M_TOP_PAD`` = 64 MiB: the heap grows in large steps.

Measured on the 2-core development VM, LeNet training step (batch 128, eager, threaded
engine), two runs each: 24.2 / 21.5 ms with the defaults, 17.0 / 16.3 ms with these settings.
The cost is memory that stays mapped after a peak (up to the thresholds above).

Applied once, only with glibc; ``HYBRIDL_MALLOC_TUNING=0`` leaves the allocator alone (and
glibc's own ``MALLOC_*_`` environment variables, when set, are respected, since those win only
if we do not call ``mallopt`` for the same parameter).
"""
import ctypes
import ctypes.util
import os

__all__ = ["apply", "applied"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 32 << 20),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 128 << 20),
             (_M_TOP_PAD, "MALLOC_TOP_PAD_", 64 << 20))
_applied = {}


def apply():
    """Set the parameters above (once); returns the dict of those set (empty if none)."""
    v = os.environ.get("HYBRIDL_MALLOC_TUNING", "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"HYBRIDL_MALLOC_TUNING={v!r}: expected 0 (leave glibc's allocator "
                         f"alone) or 1, or unset: 1")
    if _applied or v == "0":
        return dict(_applied)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version          # glibc only (musl/macOS: no such tuning)
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, env, value in _SETTINGS:
        if env in os.environ:              # the user's own glibc setting wins
            continue
        if mallopt(param, value) == 1:
            _applied[env] = value
    return dict(_applied)


def applied():
    """The settings :func:`apply` made (glibc variable name -> bytes)."""
    return dict(_applied)
