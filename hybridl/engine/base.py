"""The engine interface shared by NaiveEngine and ThreadedEngine.

The whole scheduler is one call (after MXNet's engine, Chen et al. 2015, "MXNet: A Flexible and
Efficient Machine Learning Library for Heterogeneous Distributed Systems", section 3.2)::

    push(fn, reads, writes, device, priority=0, name=None)

``fn`` is a Python callable with no arguments. ``reads`` and ``writes`` are lists of :class:`Var`.
The engine guarantees the result is the same as running every pushed ``fn`` in push order:

* read-after-write:  an op runs after every earlier op that writes what it reads;
* write-after-read:  an op that writes a Var runs after every earlier op that reads it;
* write-after-write: writes of the same Var run in push order.

Errors: an exception raised by ``fn`` is wrapped in :class:`OpError` (naming the op, keeping the
original exception as ``__cause__`` and its formatted traceback in the message) and stored on
every Var the op writes. An op that reads a failed Var does not run and passes the error on to
the Vars it writes, except to Vars marked ``keep_clean`` (the RNG) and from an op pushed with
``skip_clean`` (an optimizer update: skipped for a failed gradient, it leaves the weights as
they were, usable; or only to the writes it lists: a training step whose batch failed fails
its loss, not its weights; a collective pushed with ``skip_clean``, which runs on a failed
input, leaves its writes clean when it raises: an update run as a collective raises before it
writes). The error is raised when a failed Var is waited for (``wait_for``), by
``waitall()``, and by :meth:`Engine.raise_unreported` (the Trainer calls it every step, so an
error no sync point raised, e.g. in a gradient op whose update was then skipped, is not lost).
"""
import operator
import threading
import time
import traceback

_now = time.perf_counter
_DATA = operator.attrgetter("_data")   # an NDArray's value (no Python frame per call)
_cpu = time.thread_time

__all__ = ["Var", "OpError", "Engine"]


class Var:
    """A tag for one piece of mutable state (an array's storage, the RNG state, a KVStore slot).

    The engine orders the ops that read and write the same Var. ``exc`` holds the
    :class:`OpError` of the last failed write (``None`` when the state is good).
    """

    __slots__ = ("name", "exc", "_writer", "_readers", "keep_clean", "__weakref__")

    def __init__(self, name=None, keep_clean=False):
        self.name = name
        self.exc = None
        # keep_clean: shared state (the RNG) that a failed op must not poison for everyone
        self.keep_clean = keep_clean
        self._writer = None      # last op that writes this Var (threaded engine bookkeeping)
        self._readers = []       # ops that read it since that write

    def __repr__(self):
        return f"Var({self.name or hex(id(self))})"


def _learn(cell, dt):
    """Fold one run time ``dt`` (s) into a cost cell ``[average, runs]``: a moving average
    (weight 1/4), each sample capped at 4x the average so that an outlier (preemption, a page
    fault burst) does not make a tiny op look big."""
    old = cell[0]
    cell[0] = dt if old is None else old + 0.25 * (min(dt, 4.0 * old) - old)


def _untimed(runs):
    """The mask that leaves run ``runs`` (0-based) of a cost key untimed when ``runs & mask``
    is not 0: every 8th run is timed for the first 256 runs, every 32nd after them (a timed
    run costs two CPU-clock reads, ~1 us: 10% of a 10 us op if every 8th)."""
    return 7 if runs < 256 else 31


_MAX_PENDING_ERRORS = 64     # errors kept for waitall(); each is also on the Vars it wrote

# meta of the engine's own bulk group op: identified by identity, so that a user's meta dict
# (even one with a "bulk" key) never turns off the error handling of a plain op
_GROUP_META = {"bulk": True}


def _op_error(name, e):
    """The OpError for exception ``e`` of op ``name``: the traceback text is kept, the frames
    (and the arrays they hold) are freed."""
    err = OpError(name, e, "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    e.__traceback__ = None
    return err


def _failed(name, e, outs):
    """The OpError of kernel ``name`` that raised ``e`` when run without an op (see
    Engine.run_ready), stored on the outputs' Vars; a Ctrl-C goes on as KeyboardInterrupt."""
    err = _op_error(name, e)
    for o in outs:
        o._var.exc = err
    if _interrupted(e):
        raise KeyboardInterrupt from None
    return err


def _interrupted(e):
    """Whether ``e`` is a Ctrl-C that reached an op run by the main thread (inline or while
    waiting): it goes on to the program as KeyboardInterrupt, as any Ctrl-C; the op's outputs
    keep an OpError (their values are unknown), and waitall() does not raise it again."""
    return isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()


# Threads blocked in wait_for (the op they wait for) or waitall (None): read by ops that wait
# for other pushes of a thread (SyncBatchNorm's gates), to tell a wait that can never end
WAITING = {}
_get_ident = threading.get_ident

# Training steps seen by Engine.raise_unreported (Trainer.step, TrainStep calls): an op's
# error is raised there only from the step after the one that pushed it
_EPOCH = [0]


class OpError(RuntimeError):
    """An exception raised inside an engine op, re-raised at a sync point.

    Attributes:
        op_name (str): the name given to ``push``.
        original (BaseException): the exception the op raised (also ``__cause__``).
    """

    def __init__(self, op_name, original, tb_text):
        self.op_name = op_name
        self.original = original
        self.reported = False       # raised to the program once (a sync point, raise_unreported)
        self.epoch = _EPOCH[0]      # the training step its op was pushed in (raise_unreported)
        super().__init__(
            f"operator {op_name!r} failed: {type(original).__name__}: {original}\n"
            f"--- original traceback (in the engine worker) ---\n{tb_text}"
        )
        self.__cause__ = original


class _BulkState(threading.local):
    buf = None                      # class default: no AttributeError on threads that never bulk


class _Op:
    __slots__ = ("fn", "reads", "writes", "key", "priority", "name", "pending",
                 "dependents", "done", "event", "meta", "seq", "pure", "cell", "skip_clean",
                 "budget", "epoch")

    def __init__(self, fn, reads, writes, key, priority, name, meta, pure=False,
                 skip_clean=False):
        self.fn = fn
        self.reads = reads
        self.writes = writes
        self.key = key
        self.priority = priority
        self.name = name
        self.meta = meta
        self.pending = 0
        self.dependents = []
        self.done = False
        self.event = None
        self.pure = pure
        self.cell = None            # threaded engine: the cost cell of the op's key
        self.skip_clean = skip_clean    # skipped for a failed input: its writes stay clean
        # (True), or all but those listed (a list of Vars), see Engine.push
        self.budget = None          # BLAS threads it runs with (set at push; None: no GEMMs)
        self.epoch = _EPOCH[0]      # the training step it was pushed in (see raise_unreported)

    def __lt__(self, other):            # heap order: higher priority first, then FIFO
        return (-self.priority, self.seq) < (-other.priority, other.seq)


_BLAS = []


def _blas_module():
    """hybridl.ops._blas (imported on first use: the ops package imports the engine)."""
    if not _BLAS:
        from ..ops import _blas
        _BLAS.append(_blas)
        _PIN.append(_blas._state)
    return _BLAS[0]


_PIN = []       # [hybridl.ops._blas._state] once imported (its "pin": blas_threads' count)


# Queue keys pushed to in this process, by any engine (see Engine.blas_budget): devices, and
# tuple keys whose first element is in _BUSY_QUEUES, count; "gen" changes with the count;
# "compute": the worker threads of the devices alone (no communication thread)
_KEYS = {"seen": set(), "busy": 0, "compute": 0, "gen": 0}
_KEYS_LOCK = threading.Lock()
_BUSY_QUEUES = ("comm",)        # the MPI communication thread polls the network


class Engine:
    """Common part of the engines: error handling, profiling hooks and bulking.

    Subclasses implement ``_submit(op)``, ``_wait_op(op)`` and ``_wait_all()``.
    """

    def __init__(self):
        self._gen = -1               # _KEYS["gen"] that self._budget was computed for
        self._budget = None          # BLAS threads of an op pushed now (see blas_budget)
        self._errors = []            # OpErrors not yet raised by waitall()
        self._err_lock = threading.Lock()
        self.profiler = None         # an object with .record(op_name, key, thread, t0, t1, meta)
        self._bulk = _BulkState()

    # ------------------------------------------------------------------ public interface
    def push(self, fn, reads=(), writes=(), device=None, priority=0, name=None, meta=None,
             pure=False, skip_clean=False):
        """Schedule ``fn()`` after its dependencies; returns at once (see module docstring).

        Args:
            fn: a callable with no arguments.
            reads, writes: iterables of :class:`Var`.
            device: the Device (or any hashable queue key) whose worker runs the op.
            priority (int): higher runs first among ready ops of the same device.
            name (str): shown in errors and in the profiler.
            meta (dict): optional cost figures for the profiler (``flops``, ``bytes``).
            pure (bool or hashable): true when ``fn`` only computes its writes from its reads
                (no waiting on events, locks, I/O or other threads); a pure op's GEMMs run
                with the BLAS budget of its push (see :meth:`blas_budget`), an impure op's
                with the budget of the pure ops running beside it. The threaded engine may
                then run it in the pushing thread when it is ready, its device is idle and
                ops with the same cost key have been taking less than ``inline_s`` (a thread
                hand-over costs more than that). The cost key is ``pure`` itself unless it is
                ``True`` (then the name), e.g. ``(op, input_shape, output_shape)``.
            skip_clean (bool or list of Var): when the op does not run because an input
                failed, its writes keep their values and stay usable instead of taking the
                error (an optimizer update skipped for a failed gradient leaves the weights as
                they were); a list names the writes that take the error all the same (a
                training step whose batch failed: its loss fails, the weights and running
                statistics stay as they were). An error raised by ``fn`` itself still marks
                every write.

        Raises:
            TypeError: ``fn`` is not callable, a read/write is not a Var, or ``pure`` is
                neither a bool nor hashable.
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        # checked before anything is queued: a priority the heap cannot compare killed the
        # device's worker (and waitall hung)
        try:
            if isinstance(priority, bool):
                raise TypeError
            priority = operator.index(priority)     # int, NumPy integers
        except TypeError:
            raise TypeError(f"priority: expected an integer, got {type(priority).__name__} "
                            f"{priority!r}") from None
        try:
            hash(device)
        except TypeError:
            raise TypeError(f"device: expected a Device (or a hashable queue key), got "
                            f"{type(device).__name__} {device!r}") from None
        for what, vs in (("reads", reads), ("writes", writes)):
            if vs is None or isinstance(vs, (str, bytes)) or not hasattr(vs, "__iter__"):
                raise TypeError(f"{what}: expected an iterable of engine Vars, got "
                                f"{type(vs).__name__} {vs!r}")
        if pure is not True and pure is not False:
            try:
                hash(pure)              # a cost key (both engines: the threaded one uses it)
            except TypeError:
                raise TypeError(f"pure: expected a bool or a hashable cost key, got "
                                f"{type(pure).__name__} {pure!r}") from None
        reads = list(reads)
        writes = list(writes)
        for v in reads:
            if type(v) is not Var and not isinstance(v, Var):
                raise TypeError(f"reads: expected engine Vars, got {type(v).__name__}")
        for v in writes:
            if type(v) is not Var and not isinstance(v, Var):
                raise TypeError(f"writes: expected engine Vars, got {type(v).__name__}")
        if skip_clean is not True and skip_clean is not False:
            skip_clean = list(skip_clean)
            ids = {id(w) for w in writes}
            if any(id(v) not in ids for v in skip_clean):
                raise TypeError("skip_clean: expected a bool or a list of some of the op's "
                                "write Vars, got a Var that the op does not write")
        if not name:
            name = getattr(fn, "__name__", "op")
        b = self._bulk.buf
        if b is not None:
            if b["key"] is not None and b["key"] != device:
                self._flush_bulk()
                b = self._bulk.buf
            b["key"] = device
            b["ops"].append(_Op(fn, reads, writes, device, priority, name, meta, pure,
                                skip_clean))
            if len(b["ops"]) >= b["size"]:
                self._flush_bulk()
            return
        self._push_op(_Op(fn, reads, writes, device, priority, name, meta, pure, skip_clean))

    def push_trusted(self, fn, reads, writes, device, priority, name, meta, pure,
                     skip_clean=False):
        """:meth:`push` for the library's own hot path (the eager interpreter): ``reads`` and
        ``writes`` are fresh lists of Vars, so nothing is copied or validated."""
        if self._bulk.buf is not None:
            return self.push(fn, reads, writes, device, priority, name, meta, pure, skip_clean)
        self._push_op(_Op(fn, reads, writes, device, priority, name, meta, pure, skip_clean))

    def _keep_error(self, err):
        """Remember ``err`` for the next waitall() (at most _MAX_PENDING_ERRORS of them; when
        full, those already raised at a sync point make room: a program that catches many
        errors without calling waitall must not lose a new one)."""
        with self._err_lock:
            if len(self._errors) >= _MAX_PENDING_ERRORS:
                self._errors = [e for e in self._errors if not e.reported]
            if len(self._errors) < _MAX_PENDING_ERRORS:
                self._errors.append(err)

    def run_ready(self, kernel, arrays, outs, attrs, device, cost_key, name):
        """Fast path of the eager interpreter: run a pure kernel now, in the calling thread,
        without making an op, when that gives the same result as pushing it — every input's
        last write has run and did not fail — and the engine would run it inline anyway (see
        the subclasses). Then ``outs[i]._data`` are set (or the error is stored on their Vars
        and, by the NaiveEngine, raised) and True is returned; otherwise nothing happens and
        False is returned (the caller pushes the op).

        ``kernel(*[a._data for a in arrays], **attrs)`` returns one array, or a tuple when
        ``len(outs) > 1``. The outputs must be fresh arrays nobody else has pushed ops on."""
        return False

    def inline_lane(self, cost_key, name):
        """A specialised :meth:`run_ready` for one cost key (see ThreadedEngine.inline_lane),
        or None when the engine has none: the caller uses run_ready."""
        return None

    def _run_now(self, kernel, arrays, outs, attrs, name, cell):
        """Run the kernel of :meth:`run_ready` (inputs known ready); returns the OpError or None.
        ``cell``: the cost cell to time this run into, or None."""
        c0 = _cpu() if cell is not None else 0.0
        try:
            res = kernel(*map(_DATA, arrays), **attrs)
            if len(outs) == 1:
                outs[0]._data = res
            else:
                for o, r in zip(outs, res):
                    o._data = r
        except BaseException as e:  # noqa: BLE001 - stored on the outputs as a pushed op's
            return _failed(name, e, outs)
        if cell is not None:
            _learn(cell, _cpu() - c0)
        return None

    def wait_for(self, var):
        """Block until every pushed write of ``var`` has run; raise its stored error if any.

        Raises:
            OpError: the last write of ``var`` (or an op it depended on) failed.
        """
        b = self._bulk.buf
        if b and b["ops"]:
            self._flush_bulk()
        w = var._writer
        if w is not None:
            if not w.done:
                tid = _get_ident()
                WAITING[tid] = w
                try:
                    self._wait_op(w)
                finally:
                    WAITING.pop(tid, None)
            elif w is self._fresh:
                self._waited_done(w)
        if var.exc is not None:
            var.exc.reported = True
            raise var.exc

    def raise_unreported(self):
        """Raise the first error kept for ``waitall()`` that was never raised to the program
        (no sync point waited for the failed op's results: e.g. a gradient op, whose update
        was then skipped) and whose op was pushed before the previous call; it is marked
        raised, and ``waitall()`` still reports it once. The Trainer (and TrainStep) calls this
        at every step, so that a failing backward stops the training loop instead of every
        update being skipped in silence; an op of the current step is left to the program's
        own sync points (its loss read after the step: that batch's error is raised there,
        whether the op ran at its push or on a worker). Does not wait for running ops.

        Raises:
            OpError: that error.
        """
        cur = _EPOCH[0]
        _EPOCH[0] = cur + 1
        if not self._errors:
            return
        with self._err_lock:
            err = next((e for e in self._errors if not e.reported and e.epoch < cur), None)
            if err is None:
                return
            err.reported = True
        raise err

    def waitall(self):
        """Block until all pushed ops have run; raise the first error since the last waitall.

        Raises:
            OpError: an op failed since the previous ``waitall()``.
        """
        self._flush_bulk()
        tid = _get_ident()
        WAITING[tid] = None
        try:
            self._wait_all()
        finally:
            WAITING.pop(tid, None)
        with self._err_lock:
            errs, self._errors = self._errors, []
        if errs:
            raise errs[0]

    def bulk(self, size):
        """Context manager: group up to ``size`` consecutive pushes of this thread into one op.

        Ops in a bulk run in push order inside one engine task, so per-op scheduling cost is paid
        once per group; dependencies on outside Vars are the union of the group's reads/writes.
        A tiny eager op that could run at once (:meth:`run_ready`) still does so while the
        group is empty: that is cheaper than any hand-over.
        """
        return _Bulk(self, size)

    def learned_seconds(self, cost_key):
        """The moving average run time (seconds, the running thread's CPU time) this engine
        has measured for ops of ``cost_key`` (an eager op's key is ``(op, first input shape,
        first output shape)``), or None when it has not run yet or the engine does not learn."""
        return None

    def blas_budget(self):
        """BLAS threads per GEMM of an op pushed now: ``cores() // workers``, where workers
        sums, over the devices pushed to so far in this process in push order, the worker
        threads per device of the engine that pushed to it first (1 for the naive engine, as
        for the threaded engine's default; the MPI communication queue counts too, its thread
        polls the network; not the copy and synchronization queues, which move memory or
        sleep), so that workers x BLAS threads <= cores when they all compute (see
        :func:`hybridl.ops._blas.cores`).

        Each pure op runs with the budget of its push, wherever and whenever it runs: the
        same product on 1 and 2 threads differs in the last bits, so a budget read when the
        op runs would make results depend on timing (a device's first op pushed while another
        device's GEMMs were queued). The naive engine and the threaded one then give the same
        results for the same program, on one device or several, also when a program switches
        engines."""
        gen = _KEYS["gen"]
        if self._gen != gen:
            n = _KEYS["busy"]
            self._budget_changed(max(1, _blas_module().cores() // max(1, n)))
            self._gen = gen     # after the budget: a thread that sees the new generation
        return self._budget     # also sees its budget (was None in 3 of 300 racing calls)

    def _workers_per_key(self):
        return 1

    def _op_budget(self, key):
        """The budget of an op pushed now on queue ``key`` (None for a tuple key: copy,
        communication and synchronization queues run no GEMMs); the first push to a new
        device lowers the budget of every later push."""
        if key not in _KEYS["seen"]:
            with _KEYS_LOCK:
                if key not in _KEYS["seen"]:
                    _KEYS["seen"].add(key)
                    if type(key) is not tuple or (key and key[0] in _BUSY_QUEUES):
                        # the worker threads of the engine that uses the device first; the
                        # count stays when the program switches engines
                        _KEYS["busy"] += self._workers_per_key()
                        if type(key) is not tuple:
                            _KEYS["compute"] += self._workers_per_key()
                        _KEYS["gen"] += 1
        if self._gen != _KEYS["gen"]:
            self.blas_budget()
        if type(key) is tuple:
            return None
        pin = _PIN[0]["pin"] if _PIN else _blas_module()._state["pin"]
        # inside hl.engine.blas_threads(n): n, also for an op that runs after the block ends
        return self._budget if pin is None else pin

    def _budget_changed(self, budget):
        """The budget of later pushes is now ``budget``."""
        self._budget = budget

    def shutdown(self):
        """Stop the workers (queued ops are cancelled). Called at interpreter exit."""

    # ------------------------------------------------------------------ shared internals
    def _flush_bulk(self):
        b = self._bulk.buf
        if not b or not b["ops"]:
            return
        ops, key = b["ops"], b["key"]
        b["ops"], b["key"] = [], None
        if len(ops) == 1:
            self._push_op(ops[0])
            return
        reads, writes, seen_r, seen_w = [], [], set(), set()
        for o in ops:
            for v in o.writes:
                if id(v) not in seen_w:
                    seen_w.add(id(v))
                    writes.append(v)
        for o in ops:
            for v in o.reads:
                if id(v) not in seen_w and id(v) not in seen_r:
                    seen_r.add(id(v))
                    reads.append(v)

        def run_bulk():                     # returns the first error of the group (or None)
            first = None
            for k, o in enumerate(ops):
                try:
                    err = self._execute(o)
                except KeyboardInterrupt:
                    # Ctrl-C in a member run by the main thread: the members after it never
                    # run, so their outputs take an error (unknown values) instead of looking
                    # done and clean with no data
                    cut = OpError(o.name, KeyboardInterrupt(), "interrupted (Ctrl-C) before "
                                  "this bulk member ran\n")
                    for later in ops[k + 1:]:
                        for w in later.writes:
                            if not w.keep_clean:
                                w.exc = cut
                    raise
                if first is None:
                    first = err
            return first

        # a group of pure ops is pure: the threaded engine runs it inline, as it would each
        # member, when the group has been taking less than inline_s per member
        pure = False
        if all(o.pure for o in ops):
            p0 = ops[0].pure
            pure = ("bulk", len(ops), ops[0].name if p0 is True else p0)
        self._push_op(_Op(run_bulk, reads, writes, key, max(o.priority for o in ops),
                          f"bulk[{len(ops)}]", _GROUP_META, pure))

    # the last op pushed, until something waits for it or another op is pushed (the threaded
    # engine's synchronous-loop detection; None in engines that do not track it)
    _fresh = None

    def _waited_done(self, op):
        """``op`` (the last op pushed) was waited for after it had finished."""
        self._fresh = None

    def _execute(self, op):
        """Run one op (in whatever thread the engine chose): error passing, profiling, and when
        the op has a cost cell ``[average, runs]``, the moving average of its run time that the
        threaded engine uses to run tiny ops inline. The run time is this thread's CPU time
        (wall time would count waits for the GIL and, on a loaded machine, preemption); as that
        clock is a system call (~0.5 us, twice per timed run), only the first two runs,
        every 8th of the first 256 runs and every 32nd run after them are timed (the second
        replaces a longer first: the first run of a kernel is often cold). The threaded
        engine's ops run without an op (run_ready) follow the same rule, ``_untimed``."""
        meta = op.meta
        if meta is _GROUP_META:
            # A group: each member passes/stores its own errors; the group must neither skip
            # members whose inputs are fine nor clear the errors its members stored.
            prof = self.profiler
            t0 = _now() if prof is not None else 0.0
            cell = op.cell
            if cell is not None:
                w0 = _blas_module().wide_gemms()
                c0 = _cpu()
            err = op.fn()
            if cell is not None:              # every run timed: a group is worth the ~1 us
                _learn(cell, _cpu() - c0)
                cell[1] += 1
                cell[4] = _blas_module().wide_gemms() != w0
            if prof is not None:
                prof.record(op.name, op.key, threading.current_thread().name, t0, _now(), None)
            return err
        for v in op.reads:
            if v.exc is not None:           # an input failed: do not run, pass the error on
                if meta is not None and meta.get("runs_on_failed_input"):
                    break                   # (a collective: every rank must take part in it,
                    # see hybridl.distributed._backend.push_collective; it handles the error)
                skip = op.skip_clean
                if skip is not True:        # (a list: only those writes take it)
                    for w in (op.writes if skip is False else skip):
                        if not w.keep_clean:
                            w.exc = v.exc
                return None
        prof = self.profiler
        cell = op.cell
        if cell is not None:
            runs = cell[1]
            cell[1] = runs + 1
            if runs & _untimed(runs) and runs != 1 and cell[0] is not None:
                cell = None                 # not timed this time
        t0 = _now() if prof is not None else 0.0
        if cell is not None:
            w0 = _blas_module().wide_gemms()
            c0 = _cpu()
        try:
            op.fn()
        except BaseException as e:  # noqa: BLE001 - a user error must never kill a worker
            t1 = _now()
            # an op that failed before changing some of its writes may say so: then only the
            # others take the error (a TrainStep that failed before any update: its loss)
            marked = getattr(e, "hybridl_failed_writes", None)
            if marked is None and op.skip_clean is True and meta is not None and \
                    meta.get("runs_on_failed_input"):
                marked = ()     # an update run as a collective raises before it writes
            err = _op_error(op.name, e)
            err.epoch = op.epoch
            for w in op.writes if marked is None else marked:
                if not w.keep_clean:
                    w.exc = err
            if prof is not None:
                prof.record(op.name, op.key, threading.current_thread().name, t0, t1, meta)
            if _interrupted(e):
                raise KeyboardInterrupt from None   # its outputs stay marked as failed
            self._keep_error(err)
            return err
        if cell is not None:
            dt = _cpu() - c0
            if cell[1] == 2 and cell[0] is not None:
                cell[0] = min(cell[0], dt)  # the first run is often cold (first touch of
            else:                           # buffers, library set-up): the second one decides
                _learn(cell, dt)
            cell[4] = _blas_module().wide_gemms() != w0
        for w in op.writes:
            w.exc = None
        if prof is not None:
            prof.record(op.name, op.key, threading.current_thread().name, t0, _now(), meta)
        return None


class _Bulk:
    def __init__(self, engine, size):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected an integer >= 1, got {size!r}")
        self.engine, self.size = engine, size

    def __enter__(self):
        loc = self.engine._bulk
        self.prev = loc.buf
        if self.prev is not None:
            self.engine._flush_bulk()
        loc.buf = {"ops": [], "key": None, "size": self.size}
        return self

    def __exit__(self, *exc):
        try:
            self.engine._flush_bulk()
        finally:                            # NaiveEngine raises an op error from the flush
            self.engine._bulk.buf = self.prev
        return False
