"""ThreadedEngine: per-device worker threads, dependency tracking, priority ready queues.

Bookkeeping per :class:`Var`: the last op that writes it and the ops that read it since. A new op
depends on the pending last writer of every Var it reads or writes, and, for a Var it writes, on
the pending readers since that write. When its count of pending dependencies reaches zero it goes
to its device's ready queue (a heap: highest priority first, then push order). Every worker of
that device takes ops from the queue. One lock guards the whole graph: an op's bookkeeping is a
few list operations, much cheaper than the GIL hand-over that follows.
"""
import heapq
import itertools
import os
import sys
import threading
from _thread import allocate_lock as _allocate_lock
from _thread import get_ident as _get_ident
from time import perf_counter as _now

from .base import (_GROUP_META, _KEYS, Engine, OpError, _blas_module, _cpu, _failed, _learn, _Op,
                   _untimed)

__all__ = ["ThreadedEngine"]


# The GIL time slice once workers run: Python's default (5 ms) makes a worker that needs the
# GIL for a moment between two NumPy calls wait up to 5 ms whenever the frontend is running
# Python code, so ops and frontend work barely overlap (examples/async_vs_sync.py: 1.1x of an
# ideal 1.9x on 2 cores; 1.6x at 0.5 ms). Applied only if the interval is still Python's
# default; HYBRIDL_SWITCH_INTERVAL (seconds) sets it, 0 keeps Python's.
_PY_DEFAULT_INTERVAL = 0.005

# Ops of a cost key whose pusher waited for them at once, before the worker had woken up,
# _SYNC_STREAK times in a row run in the pushing thread (a synchronous loop such as
# ``loss = step(x, y); loss.item()``: the hand-over to the worker and back costs tens of
# microseconds on a VM and buys no overlap); every _SYNC_PROBE-th such push still goes to the
# worker, so that a program that starts overlapping work with the op gets it back.
_SYNC_STREAK = 2
_SYNC_PROBE = 16
_SWITCH_INTERVAL = 0.0005

# A worker woken for an op pushed by the frontend needs the GIL to start it, and the frontend,
# running Python, holds it: the worker would get it only after a GIL time slice (0.5 ms, more
# with timer slack), so an op pushed at the start of a burst of eager code started after the
# burst. The pusher instead waits (GIL released) until the worker has taken the op, at most
# _HANDOFF_S seconds: tens of microseconds, once per wake-up of an idle worker.
_HANDOFF_S = 0.002

# With one compute worker in the process, an op runs in the pushing thread unless the frontend,
# after pushing it, has been running Python for more than _GAP_SHARE of the op's run time
# before coming back to the engine: then the op overlaps that work on the worker.
_GAP_SHARE = 0.5


def _env_switch_interval():
    """HYBRIDL_SWITCH_INTERVAL in seconds (default 0.5 ms; 0 keeps Python's).

    Raises:
        ValueError: not a number of seconds in [0, 1] (names the variable; a longer slice lets
            a busy thread keep the GIL for that long, and CPython turns a huge one into 0)."""
    v = os.environ.get("HYBRIDL_SWITCH_INTERVAL", "").strip()
    if not v:
        return _SWITCH_INTERVAL
    try:
        want = float(v)
    except ValueError:
        want = -1.0
    if not 0 <= want <= 1.0:
        raise ValueError(f"HYBRIDL_SWITCH_INTERVAL={v!r}: expected a number of seconds in "
                         f"[0, 1] (e.g. 0.0005; 0 keeps Python's GIL time slice)")
    return want


def _env_num_workers():
    """HYBRIDL_NUM_WORKERS (default 1).

    Raises:
        ValueError: not an integer in [1, 256] (names the variable; each worker is a thread,
            and thousands of them only make the machine thrash)."""
    from .._env import env_int
    return env_int("HYBRIDL_NUM_WORKERS", 1, 1, "worker threads per device", maximum=256)


def _set_switch_interval():
    want = _env_switch_interval()
    if want > 0 and sys.getswitchinterval() == _PY_DEFAULT_INTERVAL:
        sys.setswitchinterval(want)


class _Queue:
    __slots__ = ("heap", "cond", "threads", "sleeping", "busy", "ack")

    def __init__(self, lock):
        self.heap = []
        self.cond = threading.Condition(lock)
        self.threads = []
        self.sleeping = 0           # workers waiting on cond (notify only when > 0)
        self.busy = 0               # ops of this device running (in workers or inline)
        self.ack = None             # a held lock the pusher waits on until an op is taken


class ThreadedEngine(Engine):
    """Asynchronous engine (the default). See :mod:`hybridl.engine.base` for the semantics.

    Tiny ops run inline: an op pushed with ``pure`` set, ready at once, whose device has no op
    queued or running, and whose cost key has been taking less than ``inline_s`` (moving
    average of measured run times), runs in the pushing thread before ``push`` returns; a
    thread waiting for an op likewise runs such ops from the head of that device's queue
    instead of sleeping. For ops that small the hand-over to a worker (wake-up, GIL hand-over,
    wake-up of the waiter) costs more than the op. Results, ordering and error handling are the
    same (errors are still stored, not raised at the push); big or unknown ops stay asynchronous
    (with several compute workers; with one, see below).

    Synchronous loops: when the pushing thread has waited for the ops of one cost key right
    after pushing them, finding them still queued (the worker had not yet woken up), twice in a
    row, later ready ops of that key run in the pushing thread too, as tiny ops do, except
    every 16th, which goes to the worker again to look. Pushing another op before waiting for
    one (also for one that ran in the pushing thread), or the worker taking it first, gives the
    key back to the worker: a chain of dependent ops pushed without waits stays asynchronous
    after its first op. A loop such as
    ``loss = step(x, y); print(loss.item())`` then pays no hand-over to a worker and back
    (tens of microseconds on a small VM) for an overlap it never uses.

    One worker: when the process computes on one device with one worker (the default
    budget then gives it every core, see :meth:`~hybridl.engine.base.Engine.blas_budget`),
    nothing but the frontend can run beside an op, and a ready op whose device is idle runs
    in the pushing thread, eager ops without even making an engine op, unless the frontend,
    after pushing such an op, usually goes on with work of its own (Python, or waiting for
    files) for a stretch longer than half the op's run time before it pushes another op or
    waits (a stretch ends at each tiny op run at once or op queued behind unfinished work; a
    moving average per cost key, one outlier capped): then the op overlaps that work on the
    worker. Beside a
    short burst of frontend code the hand-over costs more than the overlap gains, and a
    product on every core loses time too:
    the frontend takes a core from the BLAS threads and OpenBLAS's static split waits for the
    thread that lost it (MLP 784-256-128-10, batch 256, 2 cores: its first GEMM 474 -> 685 us
    beside a 150 us burst of pushes). Eager training steps on 2 cores, ``benchmarks/
    train_step.py``: MLP batch 256 ~20% faster, LeNet ~7%. With several devices (or workers)
    ops stay asynchronous: another worker can run beside them. Copies and collectives (their
    own queues) always do; an MPI communication thread does not count as a compute worker
    (its collectives overlap the inline backward from their own thread).

    Hand-over: a push that wakes an idle worker waits (GIL released) until that worker has
    taken the op, at most 2 ms. Otherwise the worker, needing the GIL for a moment to start the
    op, would get it only when the frontend blocks or after a GIL time slice (0.5 ms plus the
    timer slack), which is after the frontend's whole burst of pushes: no overlap at all. Not
    for an op whose last timed run started a GEMM on a BLAS pool covering every CPU of the
    process (:func:`hybridl.ops._blas.wide_gemms`): the frontend, once it gave up the GIL,
    would find no free core until the product is done.

    When its first workers start, the interpreter's GIL time slice is shortened from Python's
    default 5 ms to 0.5 ms (``sys.setswitchinterval``; not when the program set its own, and
    ``HYBRIDL_SWITCH_INTERVAL`` seconds overrides, 0 keeps Python's): workers need the GIL for
    moments between NumPy calls, and with 5 ms slices ops hardly overlap frontend Python work.

    Args:
        num_workers (int): worker threads per device queue (default 1, or ``HYBRIDL_NUM_WORKERS``).
        inline_s (float): run-time bound for inline execution, seconds (default 100e-6; 0
            turns inlining off). Also settable as the attribute ``inline_s``. A hand-over to a
            worker and back (wake-up, GIL hand-over, wake-up of the waiter) takes tens of
            microseconds on a small VM; an op that takes less costs less run here.

    Raises:
        ValueError: ``num_workers`` < 1 or ``inline_s`` < 0.
    """

    name = "threaded"

    def __init__(self, num_workers=None, inline_s=100e-6):
        super().__init__()
        _env_switch_interval()              # a bad value is an error now, not ignored later
        if num_workers is None:
            num_workers = _env_num_workers()
        if num_workers < 1:
            raise ValueError(f"num_workers: expected an integer >= 1, got {num_workers!r}")
        if not inline_s >= 0:
            raise ValueError(f"inline_s: expected a number of seconds >= 0, got {inline_s!r}")
        self.num_workers = num_workers
        self.inline_s = inline_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._idle_waiters = 0
        self._queues = {}
        self._pending = 0
        self._seq = itertools.count()
        self._stopping = False
        self._worker_ids = set()
        # cost key -> [average run time (s) or None, runs, sync streak, sync-inline pushes,
        # whether its last timed run started a GEMM on every core (see wide_gemms), average
        # frontend time from its push to the next push or wait (s) or None]
        self._cost = {}
        self._fresh = None             # the last op pushed, not waited for yet ...
        self._fresh_inline = False     # ... and whether it ran in the pusher for a sync loop
        # BLAS budget of the ops running now (see Engine.blas_budget): ops pushed with another
        # budget wait until these have finished (OpenBLAS's thread count is process-wide)
        self._mode = None
        self._mode_busy = 0            # ops with a budget running (workers, inline, waiters)
        self._mode_waiters = 0
        self._want = {}                # budget -> workers waiting to start an op with it
        self._mode_cv = threading.Condition(self._lock)
        self._gating = False           # the budget has changed once: run_ready takes the lock
        self._solo = True              # one compute worker in the process (_budget_changed)
        self._gap = None               # [cell, thread, last engine exit, longest stretch]
        self.cancelled_at_exit = 0     # ops shutdown() cancelled (reported at exit)

    # ------------------------------------------------------------------ BLAS budget
    def _workers_per_key(self):
        return self.num_workers

    def _budget_changed(self, budget):
        # one compute worker in the process: nothing but the frontend could run beside an op
        # (a second device or worker lowers the budget: ops go back to the workers at once)
        # (an MPI communication thread does not count: it runs collectives, not kernels, and
        # a rank pinned to one core has no core for a compute worker beside its frontend --
        # queued there, every op paid a hand-over between two threads on one core, and the
        # alone phase of benchmarks/distributed.py, in a process with a communication
        # thread, ran slower than a 1-rank job. Run at their push, backward's ops still push
        # each bucket's allreduce once its gradients exist, and it overlaps the rest)
        self._solo = _KEYS["compute"] <= 1
        if self._budget is not None and budget != self._budget:
            self._gating = True
        self._budget = budget

    def _start_ok(self, budget):            # lock held
        """Whether an op pushed with ``budget`` may start now: no running op has another
        budget. Then it is counted as running and the BLAS budget is set to its own (also
        when something else set another in between: ``blas_threads`` on exit)."""
        if budget is None:
            return True
        if self._mode_busy and self._mode != budget:
            return False
        if budget == self._mode and self._mode_waiters > self._want.get(budget, 0):
            return False    # ops of another budget wait: let them go first (no starvation)
        blas = _blas_module()
        if self._mode != budget or blas._state["max"] != budget:
            self._mode = budget
            blas.set_budget(budget)
        self._mode_busy += 1
        return True

    def _ended(self, budget):               # lock held
        if budget is not None:
            self._mode_busy -= 1
            if not self._mode_busy and self._mode_waiters:
                self._mode_cv.notify_all()

    # ------------------------------------------------------------------ scheduling
    def _push_op(self, op):
        g = self._gap
        t_in = _now() if g is not None else 0.0
        self._push(op)
        if g is not None and g is self._gap:
            if op.pending:                  # queued behind unfinished work (the timed op
                if t_in - g[2] > g[3]:      # itself, when it went to the worker): as if
                    g[3] = t_in - g[2]      # that had run here, the frontend goes on
                g[2] = _now()
                return
            self._gap_end(t_in)
        cell = op.cell
        if (cell is not None and op.budget is not None
                and not (cell[0] is not None and cell[0] < self.inline_s)):
            # a device's op, not tiny: time the frontend's work until it is back (_GAP_SHARE)
            self._gap = [cell, _get_ident(), _now(), 0.0]

    def _gap_end(self, t_end=None):
        """The frontend is back in the engine with an op that can run now and is not tiny,
        or a wait (at ``t_end``, default now). Since it pushed the last device op that is not
        tiny, its longest stretch of own work (Python, or waiting for files: wall time)
        between two uses of the engine (a tiny op run at once; an op queued behind unfinished
        work, often that op's result: measured as if that op had run at its push) is work the
        op could have overlapped: async gains from long stretches, while short ones between
        dependent tiny ops cost more in hand-overs and GIL switches than they overlap. Folded
        into the op's average (cost cell index 5, see _GAP_SHARE), each sample capped at 4x
        the average (at least 50 us; the average starts at 0): a time slice lost to another
        program, or a first call's set-up, does not flip the op to the worker, while lasting
        work gets there in a few pushes. Other threads' returns are not this frontend's:
        ignored."""
        g = self._gap
        self._gap = None
        if g is not None and g[1] == _get_ident():
            dt = (_now() if t_end is None else t_end) - g[2]
            if dt < g[3]:
                dt = g[3]
            cell = g[0]
            old = cell[5] or 0.0            # (the first sample capped too: a first call's
            cap = 4.0 * old                 # set-up is no trend)
            if dt > cap:
                dt = cap if cap > 5e-5 else min(dt, 5e-5)
            cell[5] = old + 0.25 * (dt - old)

    def _push(self, op):
        budget = self._op_budget(op.key)
        # only pure ops hold a budget: an op that may wait on another thread (an event, a
        # collective) must not keep ops of another budget from starting while it waits
        op.budget = budget if op.pure or op.meta is _GROUP_META else None   # (a bulk group's
        # members are eager ops: gated even when one of them is not pure)
        op.seq = next(self._seq)
        pure = op.pure
        if pure:
            key = op.name if pure is True else pure
            cost = self._cost
            cell = cost.get(key)
            if cell is None:
                if len(cost) >= 4096:                # very many shapes: forget, re-learn
                    cost.clear()
                cell = cost[key] = [None, 0, 0, 0, False, None]
            op.cell = cell
        writes = op.writes
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"push: the engine was shut down; op {op.name!r} would never "
                                   f"run (make a new engine with hl.engine.set_engine)")
            f = self._fresh
            if f is not None:                # pushed something else before waiting on it:
                f.cell[2] = 0                # the program overlaps its work with that op
                self._fresh = None
            n = 0
            for v in writes:
                w = v._writer
                if w is not None and not w.done and w is not op:   # a Var listed twice
                    w.dependents.append(op)
                    n += 1
                rl = v._readers
                if rl:
                    for r in rl:
                        if not r.done and r is not op:
                            r.dependents.append(op)
                            n += 1
                    v._readers = []
                v._writer = op
            for v in op.reads:
                if writes and v in writes:
                    continue
                w = v._writer
                if w is not None and not w.done:
                    w.dependents.append(op)
                    n += 1
                rl = v._readers
                if len(rl) > 32:
                    rl[:] = [r for r in rl if not r.done]
                rl.append(op)
            op.pending = n
            self._pending += 1
            if n:
                return
            q = None
            if pure:
                c = cell[0]
                bound = self.inline_s
                if type(key) is tuple and key[0] == "bulk":
                    bound *= key[1]           # a group: inline when its members would be
                tiny = c is not None and c < bound
                solo = op.budget is not None and self._overlaps_nothing(cell, bound)
                inline = tiny or solo
                if not inline and cell[2] >= _SYNC_STREAK and bound > 0:
                    # waited for at once, the last times: run it here, except every
                    # _SYNC_PROBE-th push, which goes to the worker to look again
                    cell[3] += 1
                    inline = cell[3] % _SYNC_PROBE != 0
                if inline:
                    q = self._queues.get(op.key)
                    if q is not None and not q.busy and not q.heap and self._start_ok(op.budget):
                        q.busy += 1          # the device counts as busy while we run it here
                        if not (tiny or solo):      # inline for the loop: until it waits
                            self._fresh, self._fresh_inline = op, True
                    else:
                        q = None
            if q is None:
                # (not for an op whose GEMMs fill the cores: the frontend, once it gave up
                # the GIL, would wait for a core until the product is done)
                ack = self._enqueue(op, handoff=bool(pure) and not cell[4])
                if pure and self.inline_s > 0:   # until the next push or a wait for it
                    self._fresh, self._fresh_inline = op, False
        if q is None:
            if ack is not None:
                ack.acquire(True, _HANDOFF_S)
            return
        self._run_here(op, q)

    def run_ready(self, kernel, arrays, outs, attrs, device, cost_key, name):
        """Run a tiny kernel now without making an op (see Engine.run_ready) when its cost
        key has been taking less than ``inline_s`` and every input's last write has run (the
        device's worker may be busy with other, independent ops meanwhile: a tiny op does not
        wait behind them). An error is stored on the outputs and in the engine (raised at the
        next sync point), as for a pushed op. Some runs are timed into the cost key's
        average (see Engine._execute)."""
        cell = self._cost.get(cost_key)
        if cell is None or cell[0] is None:
            return False                    # (pushed instead: the push ends a gap)
        g = self._gap
        if not cell[0] < self.inline_s:
            if g is not None:               # the frontend is back with a real op
                self._gap_end()
            if cell[1] >= 2 and self._overlaps_nothing(cell, self.inline_s):
                return self._run_idle(kernel, arrays, outs, attrs, device, cell, name)
            return False
        t_in = _now() if g is not None else 0.0
        if not self._may_run_now(arrays):
            return False
        budget = self._op_budget(device)
        counted = self._gating              # several budgets in this process: run with its own
        if counted:                         # (read once: another thread may turn it on now)
            with self._lock:
                if not self._start_ok(budget):
                    return False
        runs = cell[1]
        cell[1] = runs + 1
        try:
            err = self._run_now(kernel, arrays, outs, attrs, name,
                                None if runs & _untimed(runs) else cell)
        finally:
            if counted:
                with self._lock:
                    self._ended(budget)
        if err is not None:
            self._keep_error(err)
        if g is not None and g is self._gap:    # a tiny op's run is compute, not frontend
            if t_in - g[2] > g[3]:             # work: a stretch of the frontend's own work
                g[3] = t_in - g[2]             # ended at its start
            g[2] = _now()
        return True

    def inline_lane(self, cost_key, name):
        """A function ``run(kernel, arrays, out) -> bool`` that does what
        ``run_ready(kernel, arrays, [out], {}, device, cost_key, name)`` does for a tiny
        kernel with one output, with the per-call lookups done once: for a caller that runs
        the same pure kernel again and again (a hybridized block's repeat calls, see
        :func:`hybridl.graph.hybrid._fast_call`). It returns False, having done nothing, in
        every case but the common one (a tiny op whose inputs are ready, no profiler, bulk
        group, budget change or gating): the caller then takes the general path. About 1.5-3 µs
        less per call than run_ready plus its caller (measured on the 2-core development VM,
        the MLP 512-256-128-2 forward at batch 1 of benchmarks/hybridize.py)."""
        cost = self._cost
        box = [cost.get(cost_key)]

        def run(kernel, arrays, out):
            cell = box[0]
            if cell is None:
                cell = box[0] = cost.get(cost_key)
                if cell is None:
                    return False
            c = cell[0]
            if (c is None or not c < self.inline_s or self._gating or self._gen != _KEYS["gen"]
                    or not self._may_run_now(arrays)):
                return False
            g = self._gap
            t_in = _now() if g is not None else 0.0
            runs = cell[1]
            cell[1] = runs + 1
            timed = not runs & _untimed(runs)
            c0 = _cpu() if timed else 0.0
            try:
                out._data = kernel(*[a._data for a in arrays])
            except BaseException as e:  # noqa: BLE001 - as Engine._run_now
                self._keep_error(_failed(name, e, (out,)))
                return True
            if timed:
                _learn(cell, _cpu() - c0)
            if g is not None and g is self._gap:    # (see run_ready)
                if t_in - g[2] > g[3]:
                    g[3] = t_in - g[2]
                g[2] = _now()
            return True
        return run

    def _may_run_now(self, arrays):
        """Whether a kernel reading ``arrays`` may run now without an op: no profiler (it
        records ops), no bulk group being filled (the op joins it), and every input's last
        write has run without an error (a failed input is passed on by a pushed op)."""
        if self.profiler is not None:
            return False
        b = self._bulk.buf
        if b is not None and b["ops"]:
            return False
        for a in arrays:
            v = a._var
            w = v._writer
            if (w is not None and not w.done) or v.exc is not None:
                return False
        return True

    def _overlaps_nothing(self, cell, bound):
        """Whether a (not tiny) device op of ``cell`` should run in the pushing thread: the
        process has one compute worker, and the frontend does not usually keep working for
        long after pushing such an op (see the class docstring)."""
        gap, c = cell[5], cell[0]
        return (bound > 0 and self._solo and c is not None
                and (gap is None or gap < _GAP_SHARE * c))

    def _run_idle(self, kernel, arrays, outs, attrs, device, cell, name):
        """:meth:`run_ready` for a device op that overlaps nothing: run it now, without
        making an op, when its inputs are ready and its device is idle (as a pushed one would
        run inline, minus the op's bookkeeping). Returns False when it cannot."""
        if not self._may_run_now(arrays):
            return False
        budget = self._op_budget(device)
        with self._lock:
            q = self._queues.get(device)
            if q is None or q.busy or q.heap or not self._start_ok(budget):
                return False
            q.busy += 1                     # the device is busy while it runs here
        runs = cell[1]
        cell[1] = runs + 1
        timed = not runs & _untimed(runs)   # (see Engine._execute)
        try:
            w0 = _blas_module().wide_gemms() if timed else 0
            err = self._run_now(kernel, arrays, outs, attrs, name, cell if timed else None)
            if timed:
                cell[4] = _blas_module().wide_gemms() != w0
        finally:
            with self._lock:
                q.busy -= 1
                self._ended(budget)
        if err is not None:
            self._keep_error(err)
        self._gap = [cell, _get_ident(), _now(), 0.0]   # as after a push (see _push_op)
        return True

    def learned_seconds(self, cost_key):
        """See :meth:`Engine.learned_seconds`."""
        cell = self._cost.get(cost_key)
        return None if cell is None else cell[0]

    def _run_here(self, op, q):
        """Run ``op`` (already counted in ``q.busy``) in the calling thread, then finish it.
        Meanwhile the thread counts as a worker: a wait inside the op raises (it would wait
        for the op itself)."""
        tid = _get_ident()
        ids = self._worker_ids
        outer = tid not in ids
        if outer:
            ids.add(tid)
        try:
            self._execute(op)
        finally:
            if outer:
                ids.discard(tid)
            with self._lock:
                q.busy -= 1
                self._ended(op.budget)
                self._finish(op)

    def _enqueue(self, op, handoff=False):  # lock held
        """Queue ``op`` (ready) on its device's heap, waking a sleeping worker. With
        ``handoff`` (a push by the frontend) and a worker woken for it, returns a held lock
        that the worker releases once it has taken an op: the pusher, waiting on it, gives
        the worker the GIL at once instead of after a GIL time slice (see _HANDOFF_S)."""
        q = self._queues.get(op.key)
        if q is None and self._stopping:    # released by a cancelled op: cancelled in turn
            q = self._queues[op.key] = _Queue(self._lock)
        elif q is None:
            _set_switch_interval()
            q = self._queues[op.key] = _Queue(self._lock)
            try:
                for i in range(self.num_workers):
                    t = threading.Thread(target=self._worker, args=(q,), daemon=True,
                                         name=f"hybridl-{_key_name(op.key)}-w{i}")
                    q.threads.append(t)
                    t.start()
                    self._worker_ids.add(t.ident)
            finally:    # Ctrl-C while a worker starts: the op is counted, it must be queued
                heapq.heappush(q.heap, op)
            return None
        heapq.heappush(q.heap, op)
        if q.sleeping:                      # an awake worker looks at the heap before sleeping
            q.cond.notify()
            if handoff and q.ack is None and not q.busy and len(q.heap) == 1:
                ack = q.ack = _allocate_lock()
                ack.acquire()
                return ack
        return None

    def _worker(self, q):
        try:
            self._work(q)
        finally:                            # a later thread may get this id: not a worker
            with self._lock:
                self._worker_ids.discard(threading.get_ident())

    def _work(self, q):
        lock = self._lock
        op = None
        while True:
            with lock:
                if op is not None:
                    q.busy -= 1
                    self._ended(op.budget)
                    self._finish(op)
                while not q.heap:
                    if self._stopping:
                        return
                    q.sleeping += 1
                    try:
                        q.cond.wait()
                    finally:
                        q.sleeping -= 1
                if self._stopping:
                    self._cancel_queued()
                    return
                op = heapq.heappop(q.heap)
                q.busy += 1
                _taken(q)
                while not self._start_ok(op.budget):    # ops of another budget are running
                    want = self._want
                    want[op.budget] = want.get(op.budget, 0) + 1
                    self._mode_waiters += 1
                    if not self._mode_busy:     # yielded to a waiter of another budget: wake
                        self._mode_cv.notify_all()  # it (nothing running will notify)
                    try:
                        self._mode_cv.wait()
                    finally:
                        self._mode_waiters -= 1
                        want[op.budget] -= 1
            self._execute(op)

    def _finish(self, op):                  # lock held
        op.done = True
        deps = op.dependents
        if deps:
            for d in deps:
                d.pending -= 1
                if d.pending == 0:
                    self._enqueue(d)
        op.dependents = None
        op.fn = None                        # drop closures (and the arrays they hold) early
        if op.event is not None:
            op.event.set()
        self._pending -= 1
        if self._pending == 0 and self._idle_waiters:
            self._idle.notify_all()

    # ------------------------------------------------------------------ waiting
    def _check_not_worker(self):
        if threading.get_ident() in self._worker_ids:
            raise RuntimeError("an engine op waited for an array inside a worker thread; "
                               "ops must not call asnumpy()/wait_to_read() (deadlock)")

    def _take(self, q):                     # lock held
        """The op at the head of ``q`` when a waiting thread should run it itself (then counted
        in ``q.busy``), else None. Help while waiting: a pure op runs here rather than waiting
        for the worker to wake up and win the GIL (this thread would only sleep meanwhile);
        ops that may block on other threads are not pure and never taken, except a collective
        marked ``waiter_may_run`` on an idle queue (it would block the waiter anyway)."""
        if not q.heap or self.inline_s <= 0:
            return None
        head = q.heap[0]
        if head.pure:
            cell = head.cell
            tiny = cell is not None and cell[0] is not None and cell[0] < self.inline_s
            # a big op only when the workers could not all be busy without it: this thread
            # computing beside every worker would oversubscribe
            if not (tiny or q.busy + len(q.heap) <= self.num_workers):
                return None
        elif q.busy or head.meta is None or not head.meta.get("waiter_may_run"):
            return None
        if not self._start_ok(head.budget):
            return None
        q.busy += 1
        _taken(q)
        return heapq.heappop(q.heap)

    def _waited_done(self, op):
        """``op``, the last op pushed, was waited for after it had finished (see _note_wait)."""
        with self._lock:
            self._note_wait(op, None)

    def _note_wait(self, op, job):          # lock held
        """A thread waits for ``op`` and took ``job`` from a queue to run it itself (or None).
        When ``op`` is the last op pushed, and still sat in its queue (the waiter came before
        the worker woke up), the hand-over to the worker was wasted: count it in the sync
        streak of its cost key; when it ran in the pushing thread for a synchronous loop, the
        loop goes on; otherwise (a worker runs it, or finished it before the wait) reset it."""
        if op is not self._fresh:
            return
        self._fresh = None
        if job is op:
            op.cell[2] += 1
        elif not (op.done and self._fresh_inline):
            op.cell[2] = 0

    def _wait_op(self, op):
        if self._gap is not None:
            self._gap_end()
        lock = self._lock
        with lock:
            if op.done:
                self._note_wait(op, None)
                return
        self._check_not_worker()
        while True:
            with lock:
                if op.done:
                    return
                q = self._queues.get(op.key)
                job = self._take(q) if q is not None else None
                self._note_wait(op, job)
                if job is None:
                    if op.event is None:
                        op.event = threading.Event()
                    ev = op.event
            if job is None:
                ev.wait()
                return
            self._run_here(job, q)

    def _wait_all(self):
        if self._gap is not None:
            self._gap_end()
        self._check_not_worker()
        lock = self._lock
        while True:
            with lock:
                if not self._pending:
                    if self._fresh is not None:
                        self._note_wait(self._fresh, None)
                    return
                job = None
                for q in self._queues.values():     # help: run a ready op here (see _take)
                    job = self._take(q)
                    if job is not None:
                        break
                if self._fresh is not None:
                    self._note_wait(self._fresh, job)
                if job is None:
                    self._idle_waiters += 1
                    try:
                        self._idle.wait()
                    finally:
                        self._idle_waiters -= 1
                    continue
            self._run_here(job, q)

    def pending(self):
        """Whether any device queue still has ops queued or running (ops waiting for those
        are released into the queues as they finish)."""
        with self._lock:
            return any(q.heap or q.busy for q in self._queues.values())

    def shutdown(self, timeout=2.0):
        """Cancel queued ops, let running ones finish (up to ``timeout`` seconds), stop workers.

        A cancelled op (queued, or waiting for one that was) never runs: its outputs get an
        OpError saying so, raised by whoever waits for them (nobody waits forever)."""
        with self._lock:
            self._stopping = True
            self._cancel_queued()
            for q in self._queues.values():
                q.cond.notify_all()
            threads = [t for q in self._queues.values() for t in q.threads]
        for t in threads:
            t.join(timeout)

    def _cancel_queued(self):               # lock held, _stopping set
        """Finish every queued op without running it, marking its writes with an OpError;
        the dependents this releases are queued and cancelled in turn."""
        while True:
            queued = [q for q in self._queues.values() if q.heap]
            if not queued:
                return
            for q in queued:
                _taken(q)                   # (a pusher may wait for a worker to take one)
                while q.heap:
                    op = heapq.heappop(q.heap)
                    self.cancelled_at_exit += 1
                    err = OpError(op.name, RuntimeError(
                        "the engine was shut down before this op ran"), "")
                    for w in op.writes:
                        w.exc = err
                    self._finish(op)


def _taken(q):                             # lock held
    """An op is being taken from ``q``: release the pusher waiting for that (see _enqueue)."""
    ack = q.ack
    if ack is not None:
        q.ack = None
        ack.release()


def _key_name(key):
    """Thread-name part for a queue key: ``cpu(0)`` for a Device, ``copy-cpu(1)`` for a copy queue
    (so profiler traces show ``hybridl-cpu(0)-w0``, ``hybridl-copy-cpu(1)-w0``)."""
    if isinstance(key, tuple):
        return "-".join(_key_name(k) for k in key)
    return (key if isinstance(key, str) else repr(key)).replace(" ", "")
