"""hybridl: a small deep-learning framework built around computational performance.

    import hybridl as hl
    x = hl.nd.array([[1., 2.], [3., 4.]])      # async NDArray on hl.cpu(0)
    y = (x @ x).relu().sum()                    # pushed to the dependency engine, returns at once
    print(y.item())                             # sync point

See README.md (and DESIGN.md, in the development setup's shared/ folder) for the layers:
engine -> ops -> ndarray/autograd -> graph -> nn.
"""
import importlib as _importlib
import os as _os
import sys as _sys


def _cli_invocation():
    """Whether this process is the ``hybridl`` command (the console script, or ``python -m
    hybridl``): then a bad setting read at import is a usage error, not a traceback."""
    argv0 = _sys.argv[0] if _sys.argv else ""
    if _os.path.basename(argv0) in ("hybridl", "hybridl.exe"):
        return True
    orig = list(getattr(_sys, "orig_argv", ()))
    mods = ("hybridl", "hybridl.cli", "hybridl.__main__")
    for i, a in enumerate(orig):
        if a == "-m" and i + 1 < len(orig):
            return orig[i + 1] in mods
        if a.startswith("-m") and len(a) > 2:           # python -mhybridl
            return a[2:] in mods
    return False


try:
    from . import engine  # noqa: F401 (reads HYBRIDL_ENGINE: a bad value raises ValueError)
except ValueError as _e:
    if not _cli_invocation():
        raise
    print(f"hybridl: {_e}", file=_sys.stderr)
    raise SystemExit(2) from None
from . import autograd, engine, nd, random  # noqa: F401,F811
from .device import Device, cpu, current_device  # noqa: F401
from .engine import OpError, waitall  # noqa: F401
from .ndarray import NDArray  # noqa: F401

__version__ = "0.1.0"

_LAZY = {"nn", "init", "loss", "optim", "data", "models", "hardware", "graph", "sym", "parallel",
         "kv", "distributed", "profiler", "onnx", "kernels"}
_LAZY_ATTRS = {"Trainer": ("optim", "Trainer"), "jit": ("graph", "jit"),
               "TrainStep": ("graph", "TrainStep"),
               "compile": ("graph", "compile"), "TracingError": ("graph", "TracingError")}


def __getattr__(name):
    if name in _LAZY:
        mod = _importlib.import_module(f".{name}", __name__)
        globals()[name] = mod
        return mod
    if name in _LAZY_ATTRS:
        m, a = _LAZY_ATTRS[name]
        val = getattr(_importlib.import_module(f".{m}", __name__), a)
        globals()[name] = val
        return val
    raise AttributeError(f"module 'hybridl' has no attribute {name!r}")


def __dir__():
    # the lazily imported modules and names too (tab completion, dir(hl))
    return sorted(set(globals()) | _LAZY | set(_LAZY_ATTRS))
