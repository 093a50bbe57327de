"""Pointer-chasing kernels: a dependent-load loop run outside the Python interpreter.

Memory latency is the time of a load whose address depends on the previous load. NumPy has no
such operation (fancy indexing issues independent loads, which overlap: that is throughput,
not latency), and a Python loop costs ~30-60 ns per step, more than an L1/L2/L3 hit. So the
chase ``p = *p`` runs in native code, obtained in this order:

1. ``"x86_64-machine-code"``: 12 bytes of x86-64 code (SysV ABI) copied into an executable
   anonymous mmap page and called through ctypes — no compiler needed::

       loop: mov rdi, [rdi]   ; p = *p
             dec rsi
             jnz loop
             mov rax, rdi     ; return p (so the chain cannot be optimized away)
             ret

2. ``"c-compiler"``: the same loop in C, compiled with ``cc -O2 -shared`` into a temp dir.
3. ``"python-loop"``: ``i = mv[i]`` over a memoryview, with the loop's own cost (measured on an
   L1-resident chain) subtracted; only the excess over L1 is meaningful, L1/L2 knees are not.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile

_X86_64_CODE = bytes([0x48, 0x8B, 0x3F, 0x48, 0xFF, 0xCE, 0x75, 0xF8, 0x48, 0x89, 0xF8, 0xC3])
_C_SRC = """
#include <stdint.h>
uint64_t chase(uint64_t p, uint64_t n) {
    volatile uint64_t *q = (volatile uint64_t *)p;
    while (n--) q = (volatile uint64_t *)*q;
    return (uint64_t)q;
}
"""
_CFUNC = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
_cache: dict = {}


def _machine_code():
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name != "posix":
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError):
        return None
    page.write(_X86_64_CODE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fn = _CFUNC(addr)
    return fn, page


def _compiled():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None
    d = tempfile.mkdtemp(prefix="hybridl_chase_")
    src, lib = os.path.join(d, "chase.c"), os.path.join(d, "chase.so")
    with open(src, "w") as f:
        f.write(_C_SRC)
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", lib], check=True,
                       capture_output=True, timeout=60)
        so = ctypes.CDLL(lib)
    except Exception:
        return None
    finally:            # a loaded library stays mapped after its file is removed (POSIX)
        shutil.rmtree(d, ignore_errors=True)
    so.chase.restype = ctypes.c_uint64
    so.chase.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    return so.chase, so


def _selftest(fn) -> bool:
    """Chase a 4-node cycle built in a ctypes array; True if the kernel follows it."""
    arr = (ctypes.c_uint64 * 4)()
    base = ctypes.addressof(arr)
    for i, j in enumerate([2, 3, 1, 0]):
        arr[i] = base + 8 * j
    try:
        return fn(base, 3) == base + 8 * 3 and fn(base, 4) == base
    except Exception:
        return False


def get_kernel(prefer: str | None = None):
    """Return ``(fn, method)``: ``fn(address, steps) -> address`` follows ``steps`` pointers
    starting at ``address`` (uint64 absolute addresses); ``fn`` is None for the Python
    fallback. ``prefer`` forces one method ("x86_64-machine-code", "c-compiler",
    "python-loop")."""
    key = prefer or "auto"
    if key in _cache:
        return _cache[key]
    order = [("x86_64-machine-code", _machine_code), ("c-compiler", _compiled)]
    if prefer:
        order = [o for o in order if o[0] == prefer]
    result = (None, "python-loop")
    for name, make in order:
        got = make()
        if got is not None and _selftest(got[0]):
            _cache.setdefault("_keep", []).append(got)  # keep the mmap page / library alive
            result = (got[0], name)
            break
    _cache[key] = result
    return result
