"""NaiveEngine: runs every op at once, in the caller's thread (``HYBRIDL_ENGINE=naive``).

Same results as the threaded engine, but an error is raised at the exact line that pushed the
failing op: the debugging switch.
"""
import threading

from .base import Engine

__all__ = ["NaiveEngine"]


class NaiveEngine(Engine):
    """Synchronous engine: ``push`` runs ``fn`` before returning.

    Raises (from ``push``):
        OpError: the op raised; the error is also stored on its written Vars.
    """

    name = "naive"

    def __init__(self):
        super().__init__()
        self._lock = threading.RLock()   # several frontend threads: one op at a time

    def _push_op(self, op):
        with self._lock:
            err = self._execute(op)
        if err is not None:
            with self._err_lock:        # raised here, at the caller's line, not again later
                if err in self._errors:
                    self._errors.remove(err)
            raise err

    def _wait_op(self, op):
        pass

    def _wait_all(self):
        pass
