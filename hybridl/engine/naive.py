"""NaiveEngine: runs every op at once, in the caller's thread (``HYBRIDL_ENGINE=naive``).

Same results as the threaded engine, but an error is raised at the exact line that pushed the
failing op: the debugging switch.
"""
import contextlib
import threading

from .base import Engine, _blas_module, _Bulk

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

    def bulk(self, size):
        """Validates ``size`` and groups nothing: every op still runs (and raises) at its push.

        Grouping saves scheduling cost, which this engine does not have; running each op at its
        own line keeps the debugging guarantee (and an error raised while flushing a group would
        otherwise drop the op whose push triggered the flush).
        """
        _Bulk(self, size)                # argument check only
        return contextlib.nullcontext(self)

    def _apply_budget(self, budget):
        """Ops run at their push, one at a time: each with the budget of its push."""
        if budget is not None:
            blas = _blas_module()
            if blas._state["max"] != budget:
                blas.set_budget(budget)

    def run_ready(self, kernel, arrays, outs, attrs, device, cost_key, name):
        """Every op runs at its push here: run it without making an op (see Engine.run_ready);
        an error is raised at once, as from ``push``."""
        if self.profiler is not None:
            return False
        for a in arrays:
            if a._var.exc is not None:      # let push pass the input's error on
                return False
        budget = self._op_budget(device)
        with self._lock:
            self._apply_budget(budget)
            err = self._run_now(kernel, arrays, outs, attrs, name, None)
        if err is not None:
            raise err
        return True

    def _push_op(self, op):
        op.budget = self._op_budget(op.key)
        with self._lock:
            self._apply_budget(op.budget)
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
