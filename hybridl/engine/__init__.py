"""The dependency engine: asynchronous, parallel execution with sequential semantics.

Public interface (DESIGN §3)::

    hl.engine.push(fn, reads, writes, device, priority=0, name=None)
    hl.engine.wait_for(var); hl.waitall()
    hl.engine.set_engine('naive' | 'threaded')       # also a context manager
    with hl.engine.bulk(16): ...                      # group consecutive pushes
    hl.engine.set_num_workers(n)                      # worker threads per device

``HYBRIDL_ENGINE=naive|threaded`` selects the engine at import (default ``threaded``).
"""
import atexit
import contextlib
import os
import sys
import threading
import time

from . import _malloc
from .base import Engine, OpError, Var
from .naive import NaiveEngine
from .threaded import ThreadedEngine

__all__ = ["Var", "OpError", "Engine", "NaiveEngine", "ThreadedEngine", "push", "wait_for",
           "waitall", "get_engine", "set_engine", "bulk", "set_num_workers", "num_workers",
           "blas_threads", "start_workers"]

_ENGINES = {"naive": NaiveEngine, "threaded": ThreadedEngine}
_lock = threading.Lock()
_num_workers = None


_instances = {}


def _make(kind):
    if isinstance(kind, Engine):
        return kind
    if kind in _instances:              # switching back reuses the engine (and its workers)
        return _instances[kind]
    if kind not in _ENGINES:
        raise ValueError(f"engine: expected one of {sorted(_ENGINES)} or an Engine, got {kind!r}")
    eng = _ENGINES[kind](num_workers=_num_workers) if kind == "threaded" else _ENGINES[kind]()
    _instances[kind] = eng
    return eng


_malloc.apply()            # keep freed array memory for reuse (see engine/_malloc.py)
def _from_env():
    kind = os.environ.get("HYBRIDL_ENGINE", "threaded").strip().lower() or "threaded"
    if kind not in _ENGINES:
        raise ValueError(f"HYBRIDL_ENGINE={os.environ['HYBRIDL_ENGINE']!r}: expected one of "
                         f"{sorted(_ENGINES)} (or unset: threaded)")
    return _make(kind)


_current = _from_env()


def get_engine():
    """The engine in use (a NaiveEngine or ThreadedEngine)."""
    return _current


class _EngineScope:
    def __init__(self, prev):
        self.prev = prev

    def __enter__(self):
        return _current

    def __exit__(self, *exc):
        with _lock:
            try:
                _current.waitall()      # drain the engine being left; an error of its ops is
            finally:                    # raised after switching back: a with block restores
                _switch(self.prev)
        return False


def _switch(new):                           # _lock held
    global _current
    _current = new
    from ..ops import _blas
    _blas.set_budget(new.blas_budget())     # BLAS threads: cores // its compute workers


def set_engine(kind):
    """Switch engines: ``'naive'``, ``'threaded'`` or an Engine instance.

    Waits for all work of the previous engine first. Returns a context manager that switches
    back on exit, so both ``set_engine('naive')`` and ``with set_engine('naive'):`` work (on
    exit it waits for the engine it leaves and switches back even when that wait raises).

    Raises:
        ValueError: unknown engine name.
        OpError: an op of the previous engine failed (raised by its ``waitall``); the engine is
            not switched then.
    """
    new = _make(kind)
    with _lock:
        prev = _current
        prev.waitall()          # an error of the old engine raises here; no switch then (a
        _switch(new)            # ``with`` that raises at entry must not leave the engine changed)
    return _EngineScope(prev)


def push(fn, reads=(), writes=(), device=None, priority=0, name=None, meta=None, pure=False,
         skip_clean=False):
    """Push ``fn`` to the current engine (see :meth:`Engine.push`)."""
    _current.push(fn, reads, writes, device, priority, name, meta, pure, skip_clean)


def wait_for(var):
    """Wait until ``var``'s pending writes are done (see :meth:`Engine.wait_for`)."""
    _current.wait_for(var)


def waitall():
    """Wait for all pushed work; raise the first op error since the last call.

    Raises:
        OpError: an op failed.
    """
    _current.waitall()


def bulk(size):
    """``with hl.engine.bulk(n):`` groups up to ``n`` consecutive ops into one engine task."""
    return _current.bulk(size)


def set_num_workers(n):
    """Set worker threads per device for the threaded engine (takes effect for new engines and
    for devices not yet used; the thread budget then gives each ``cores // workers`` BLAS threads).

    Raises:
        ValueError: ``n`` is not an integer >= 1.
    """
    global _num_workers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    _num_workers = n
    if isinstance(_current, ThreadedEngine):
        _current.num_workers = n


def num_workers():
    """Worker threads per device of the threaded engine."""
    return getattr(_current, "num_workers", 1)


@contextlib.contextmanager
def blas_threads(n):
    """Context: run with ``n`` BLAS threads per GEMM — threadpoolctl's process-wide limit and
    the budget of :mod:`hybridl.ops._blas`, held even when workers start inside the block — and
    afterwards the engine's budget as it is then (cores // compute workers).

    Raises:
        ValueError: ``n`` is not an integer >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    from threadpoolctl import threadpool_limits

    from ..ops import _blas
    with threadpool_limits(limits=n, user_api="blas"):
        prev = _blas.pin(n)            # held even if workers start inside the block
        try:
            yield
        finally:
            _blas.pin(prev)
            if prev is None:           # back to the engine's budget as it is now
                _blas.set_budget(_current.blas_budget())


def start_workers(devices):
    """Start the worker threads (and copy queues) of ``devices`` now, e.g. before timing: a new
    queue changes the thread budget, which should not happen inside a measurement."""
    for d in devices:
        for key in (d, ("copy", d)):
            _current.push(lambda: None, (), (Var(),), key, name="start")
    _current.waitall()


_EXIT_GRACE_S = 2.0     # seconds pending work may take at exit before it is cancelled
_INTERRUPTED = [False]


def interrupted():
    """Say that the program is ending because of a Ctrl-C it caught itself (``hybridl``'s
    commands do): at exit the pending work is then cancelled at once and nothing is printed,
    as after an uncaught KeyboardInterrupt (see ``_shutdown``)."""
    _INTERRUPTED[0] = True


@atexit.register
def _shutdown():
    """At exit pending work gets up to ``_EXIT_GRACE_S`` seconds to finish (the last op of a
    script whose result nothing read, a file being written), then the workers stop: what is
    still queued is cancelled (DESIGN: exit finishes or cancels pending work, cleanly).
    Nothing goes unsaid: the errors of ops whose results nothing waited for, and how many
    pushed ops were cancelled, are printed on stderr (``hl.waitall()`` before the end runs
    everything and raises). After a Ctrl-C that ended the program nothing waits and nothing
    is printed (the user asked to stop)."""
    eng = _current
    interrupted = getattr(sys, "last_type", None) is KeyboardInterrupt or _INTERRUPTED[0]
    try:
        pending = getattr(eng, "pending", None)
        if pending is not None and not interrupted:
            end = time.monotonic() + _EXIT_GRACE_S
            while pending() and time.monotonic() < end:
                time.sleep(0.005)
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a Ctrl-C while waiting: stop
        pass
    try:
        eng.shutdown()
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a second Ctrl-C while the
        pass                                # workers stop: the program is leaving anyway
    try:
        if interrupted:
            return
        with eng._err_lock:
            lost = [e for e in eng._errors if not e.reported]
        for e in lost[:3]:
            head = str(e).strip().splitlines()[0]       # (the traceback: at waitall())
            print(f"hybridl: an op failed and nothing waited for its result: {head}",
                  file=sys.stderr)
        if len(lost) > 3:
            print(f"hybridl: ... and {len(lost) - 3} more failed op(s)", file=sys.stderr)
        n = getattr(eng, "cancelled_at_exit", 0)
        if n:
            print(f"hybridl: {n} pushed op(s) had not run when the program ended and were "
                  f"cancelled (call hl.waitall() before the end to run them)", file=sys.stderr)
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - nothing may fail at exit
        pass
