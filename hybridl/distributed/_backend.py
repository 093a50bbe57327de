"""The MPI backend of :mod:`hybridl.distributed`: process state, the communication queue and the
watchdog.

Every collective is an engine op on ONE queue key, :data:`COMM_KEY` ``('comm', 'mpi')``, and
writes ONE shared Var, :data:`COMM_VAR`. The write-after-write rule of the engine then runs the
collectives of a process strictly in the order the frontend pushed them, whatever their
priorities and whenever their inputs became ready (the ready queue orders by priority, so ops
that become ready at different times on different ranks could otherwise be reordered, and two
ranks entering different collectives deadlock). The frontend of every rank pushes the same
collectives in the same order (the Trainer walks its parameters in a fixed order), so every rank
issues the same sequence. Compute workers never block on communication: a collective waits for
its inputs like any op and then runs on the communication queue's own thread.

MPI calls are made only from that queue's thread (plus the local ``Get_rank``/``Get_size`` at
init and ``Abort`` from the watchdog), so ``MPI_THREAD_SERIALIZED`` suffices; mpi4py asks for
``MPI_THREAD_MULTIPLE`` and MPICH/Open MPI provide it, which the watchdog's ``Abort`` from its
own thread relies on.

Watchdog: a collective that has not completed ``timeout`` seconds after it started (another
rank died, hangs, or issued a different collective) makes the process print a message naming
the collective and call ``MPI_Abort`` on ``COMM_WORLD``, which ends every rank of the job.
``timeout`` is ``HYBRIDL_DIST_TIMEOUT`` (seconds, default 60) or :func:`set_timeout`.

Exit: a script may end with collectives still pending (nothing waited for the last steps);
they all run before the engine stops, within the same bound (``_finish_collectives_at_exit``).
"""
import atexit
import itertools
import os
import sys
import threading
import time

import numpy as np

from .. import engine as _engine
from ..engine import Var

__all__ = ["COMM_KEY", "COMM_VAR", "state", "init", "launched_under_mpi", "push_collective",
           "set_timeout", "get_timeout", "DistributedError"]

COMM_KEY = ("comm", "mpi")
COMM_VAR = Var("comm.mpi")

#: Environment variables set by MPI launchers for each process (MPICH hydra / Intel MPI: PMI_RANK,
#: MPI_LOCALRANKID; Open MPI: OMPI_COMM_WORLD_RANK; PMIx launchers (Open MPI 5, Slurm srun
#: --mpi=pmix): PMIX_RANK).
LAUNCHER_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


class DistributedError(RuntimeError):
    """Ranks disagree (parameters, bucket layouts, collectives), or MPI is unusable."""


class _State:
    def __init__(self):
        self.initialized = False
        self.mpi = None             # the mpi4py.MPI module (None: single process, no MPI)
        self.comm = None            # our own duplicate of COMM_WORLD
        self.node = None            # the ranks sharing this machine's memory (size > 1 only)
        self.shm = False            # all ranks on one machine, shared-window buckets on
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.thread_level = None
        self.seq = itertools.count()
        self.pushed = 0             # collectives pushed / run (ended, either way) so far
        self.ran = 0
        # a bad HYBRIDL_DIST_* value is raised by init() -- on every rank together (a rank
        # that raised alone, before the others' first collective, would leave them hanging)
        self.timeout, self.settings_error = 60.0, None
        try:
            self.timeout = _env_timeout()
        except ValueError as e:
            self.settings_error = e
        self.inflight = None        # (seq, name, nbytes, t_start) of the running collective
        self.watchdog = None
        self.lock = threading.Lock()
        self.failed_input = None    # the running collective's failed input (see push_collective)


MIN_TIMEOUT = 0.1


def check_seconds(value, what):
    """``value`` as a collective timeout in seconds: a finite number >= MIN_TIMEOUT (the
    watchdog polls every timeout / 8 s; inf would never fire, 1e-300 abort every collective).

    Raises:
        ValueError: naming ``what``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = None
    if v is None or not MIN_TIMEOUT <= v < float("inf"):
        raise ValueError(f"{what}: expected seconds, a finite number >= {MIN_TIMEOUT}, got "
                         f"{value!r}")
    return v


def _env_timeout():
    s = os.environ.get("HYBRIDL_DIST_TIMEOUT", "").strip()
    return check_seconds(s, "HYBRIDL_DIST_TIMEOUT") if s else 60.0


def env_bucket_bytes(default_mb):
    """``HYBRIDL_DIST_BUCKET_MB`` (MiB, a positive finite number; empty: ``default_mb``) in
    bytes.

    Raises:
        ValueError: naming the variable and its value."""
    s = os.environ.get("HYBRIDL_DIST_BUCKET_MB", "").strip()
    if not s:
        return int(default_mb * 2 ** 20)
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"HYBRIDL_DIST_BUCKET_MB: expected a positive number, got {s!r}") from None
    if not 0 < v < float("inf"):
        raise ValueError(f"HYBRIDL_DIST_BUCKET_MB: expected a positive finite number, got {s!r}")
    return int(v * 2 ** 20)


def _env_shm():
    """``HYBRIDL_DIST_SHM``: ``1`` (default) sums gradient buckets through a shared-memory
    window when all ranks are on one machine (:mod:`hybridl.distributed._shm`); ``0`` always
    uses ``MPI_Allreduce``."""
    s = os.environ.get("HYBRIDL_DIST_SHM", "").strip() or "1"
    if s not in ("0", "1"):
        raise ValueError(f"HYBRIDL_DIST_SHM: expected 0 or 1, got {s!r}")
    return s == "1"


state = _State()


def launched_under_mpi():
    """True when an MPI launcher (mpiexec/mpirun/srun) started this process (its env vars)."""
    return any(v in os.environ for v in LAUNCHER_VARS)


SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def launched_size():
    """``(processes, variable)``: the size of the MPI job that started this process, read from
    the launcher's environment before MPI is initialized, and the variable that said so
    (``(1, None)`` when none did)."""
    if not launched_under_mpi():
        return 1, None
    for var in SIZE_VARS:
        try:
            return max(1, int(os.environ[var])), var
        except (KeyError, ValueError):
            continue
    return 1, None


def set_timeout(seconds):
    """Seconds a collective may take before the watchdog aborts the job (see module docstring).

    Raises:
        ValueError: not a finite number >= 0.1.
    """
    state.timeout = check_seconds(seconds, "seconds")


def get_timeout():
    """The collective timeout in seconds."""
    return state.timeout


def init():
    """Initialize once (see :func:`hybridl.distributed.init`); returns the state."""
    st = state
    if st.initialized:
        return st
    with st.lock:
        if st.initialized:
            return st
        errors = [st.settings_error] if st.settings_error is not None else []
        want_shm = False
        try:
            want_shm = _env_shm()
        except ValueError as e:
            errors.append(e)
        try:                        # read again by each DistKVStore; checked here on all ranks
            env_bucket_bytes(1)
        except ValueError as e:
            errors.append(e)
        if launched_under_mpi():
            try:
                import mpi4py
            except ImportError:
                raise ImportError(
                    "hybridl.distributed: this process was started by an MPI launcher but mpi4py "
                    "is not installed; pip install -e '.[mpi]' (mpi4py + the mpich wheel), or "
                    "on a cluster `pip install mpi4py` built against the site's MPI") from None
            mpi4py.rc.thread_level = "multiple"
            from mpi4py import MPI
            if not MPI.Is_initialized():
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
            st.mpi = MPI
            st.thread_level = MPI.Query_thread()
            if st.thread_level < MPI.THREAD_SERIALIZED:
                raise DistributedError(
                    f"hybridl.distributed: the MPI library provides thread level "
                    f"{st.thread_level}; at least MPI_THREAD_SERIALIZED is needed (collectives run "
                    f"on the engine's communication thread)")
            st.comm = MPI.COMM_WORLD.Dup()
            # every rank learns whether any rank's settings are bad, and all raise together
            if not st.comm.allreduce(0 if errors else 1, op=MPI.MIN):
                if errors:
                    raise errors[0]
                raise ValueError("hybridl.distributed: another rank has an invalid "
                                 "HYBRIDL_DIST_TIMEOUT, HYBRIDL_DIST_SHM or "
                                 "HYBRIDL_DIST_BUCKET_MB (its own message names the value); "
                                 "every rank stops")
            try:                    # MPI errors raise (then abort with our message), not crash
                st.comm.Set_errhandler(MPI.ERRORS_RETURN)
            except Exception:  # noqa: BLE001
                pass
            st.rank = st.comm.Get_rank()
            st.size = st.comm.Get_size()
            for v in _LOCAL_RANK_VARS:
                if v in os.environ:
                    try:
                        st.local_rank = int(os.environ[v])
                    except ValueError:
                        pass
                    break
            if st.size > 1:
                # the ranks on this machine (collective: every rank calls init at its start)
                st.node = st.comm.Split_type(MPI.COMM_TYPE_SHARED)
                # every rank must take the same path: on only if it is on for all
                st.shm = bool(st.comm.allreduce(int(want_shm and st.node.Get_size() == st.size),
                                                op=MPI.MIN))
                st.watchdog = threading.Thread(target=_watchdog, name="hybridl-dist-watchdog",
                                               daemon=True)
                st.watchdog.start()
                # after the engine's exit hook is registered, so it runs before it (LIFO)
                atexit.register(_finish_collectives_at_exit)
                if sys.excepthook is not _excepthook:
                    _PREV_HOOK[0] = sys.excepthook
                    sys.excepthook = _excepthook
        elif errors:
            raise errors[0]
        st.initialized = True
    return st


_PREV_HOOK = [sys.__excepthook__]
#: seconds an uncaught exception waits before it ends the job: ranks that fail alike (a check
#: every rank makes) print their own messages meanwhile
UNCAUGHT_GRACE_S = 1.0


def _excepthook(exc_type, exc, tb):
    """An exception nobody caught on one rank of a job: printed as usual, then the whole job
    ends at once (``MPI_Abort``, exit code 1) instead of the other ranks waiting in their next
    collective for ``HYBRIDL_DIST_TIMEOUT`` seconds (as ``python -m mpi4py`` does)."""
    _PREV_HOOK[0](exc_type, exc, tb)
    try:
        sys.stderr.flush()
        time.sleep(UNCAUGHT_GRACE_S)
    finally:
        _abort(f"an uncaught {exc_type.__name__} ended this rank", code=1)


def _finish_collectives_at_exit():
    """At exit, run the collectives still pending before the engine stops (``atexit``, ahead of
    the engine's own exit hook). The engine's exit cancels what has not run after a grace
    period; one rank cancelling a collective that another rank runs would leave that rank
    waiting in it, and MPI_Finalize called while the communication thread is still inside MPI
    crashed the process (a segfault or glibc's "corrupted double-linked list"). So a rank
    waits for every collective it pushed: one that cannot complete (another rank never
    issues it) is ended by the watchdog after ``timeout`` seconds, with its message. A
    collective that never starts (its inputs' ops do not finish) is given up after
    ``timeout`` seconds without progress. Not after a Ctrl-C (the user asked to stop)."""
    st = state
    if getattr(sys, "last_type", None) is KeyboardInterrupt or _engine._INTERRUPTED[0]:
        return
    try:
        last, since = st.ran, time.monotonic()
        while st.ran < st.pushed:
            time.sleep(0.002)
            if st.ran != last or st.inflight is not None:
                last, since = st.ran, time.monotonic()
            elif time.monotonic() - since > st.timeout:
                sys.stderr.write(
                    f"hybridl.distributed: rank {st.rank}/{st.size}: {st.pushed - st.ran} "
                    f"collective(s) pushed had not started {st.timeout:g} s after the program "
                    f"ended (their inputs' ops did not finish); they are cancelled\n")
                return
    except KeyboardInterrupt:
        pass


def _watchdog():
    st = state
    while True:
        time.sleep(min(0.25, st.timeout / 8))
        cur = st.inflight
        if cur is None:
            continue
        seq, name, nbytes, t0 = cur
        waited = time.perf_counter() - t0
        if waited > st.timeout and st.inflight is cur:
            _abort(f"collective #{seq} {name!r} ({nbytes} bytes) has not completed after "
                   f"{waited:.1f} s (HYBRIDL_DIST_TIMEOUT={st.timeout:g}): another rank died, "
                   f"hangs, or issued a different collective")


def _abort(msg, code=70):
    st = state
    sys.stderr.write(f"hybridl.distributed: rank {st.rank}/{st.size}: {msg}; aborting the job "
                     f"(MPI_Abort)\n")
    sys.stderr.flush()
    # give the launcher's I/O forwarding a moment: MPI_Abort tears the job down at once, and
    # the message was sometimes lost on its way to mpiexec's stderr (1 run in 4 under load)
    time.sleep(0.5)
    try:                            # MPI_Abort skips MPICH's clean-up of its /dev/shm files
        from .launch import unlink_own_shm
        unlink_own_shm()
    except Exception:  # noqa: BLE001 - best effort
        pass
    try:
        st.mpi.COMM_WORLD.Abort(code)
    finally:                        # Abort does not return; if it did, end this process anyway
        os._exit(code)


def push_collective(fn, reads=(), writes=(), name="collective", nbytes=0, priority=1 << 20,
                    skip_clean=False):
    """Push ``fn(comm)`` as a collective on the communication queue (in push order, watched).

    ``fn`` runs on the communication thread with the MPI communicator; an MPI error inside it
    leaves the ranks' collective sequences out of step, so it aborts the job with a message (a
    Python error raised by ``fn`` itself, e.g. a layout check that every rank makes alike, is an
    ordinary op error raised at the next sync point).

    A failed input (an op of this rank's batch that raised) must not skip the collective:
    the other ranks would pair their next collective with it, and mix data of different
    steps. So the op runs anyway: :func:`failed_input` tells ``fn`` so (it then takes part
    with zeros, and where it can, tells the other ranks in-band so that they fail too), and
    its outputs on this rank take the input's error afterwards -- unless ``skip_clean`` (an
    optimizer update run as a collective, which raises before it writes anything): then its
    outputs keep their values and stay usable, as an update skipped for a failed gradient.
    """
    st = state
    seq = next(st.seq)
    st.pushed = seq + 1
    MPI = st.mpi

    reads = list(reads)

    def run():
        comm = st.comm
        cur = (seq, name, nbytes, time.perf_counter())
        failed = next((v.exc for v in reads if v.exc is not None), None)
        st.failed_input = failed
        st.inflight = cur
        try:
            fn(comm)
        except DistributedError:
            if failed is not None:  # this rank's own error says more than the ranks' one
                raise _original(failed) from None
            raise
        except Exception as e:  # noqa: BLE001
            if MPI is not None and isinstance(e, MPI.Exception):
                _abort(f"collective #{seq} {name!r} failed in MPI: {e}")
            raise
        finally:
            st.inflight = None
            st.failed_input = None
            st.ran += 1
        if failed is not None:      # took part with zeros: this rank's results are not real
            raise _original(failed)

    w = list(writes)
    w.append(COMM_VAR)
    # a thread waiting for the result may run it itself (it would only block meanwhile); a
    # failed input does not skip it (see above)
    _engine.push(run, reads, w, COMM_KEY, priority, name,
                 {"bytes": float(nbytes), "waiter_may_run": True, "runs_on_failed_input": True},
                 skip_clean=skip_clean)
    return seq


def _original(err):
    """The exception behind a failed input's OpError (raised again by the collective, whose
    outputs then carry it as their ``original``, as an op skipped for it would)."""
    return getattr(err, "original", None) or err


def failed_input():
    """Inside a collective's ``fn``: the error of a failed input of this rank (it must take
    part with zeros instead of reading it), else None."""
    return state.failed_input


def mpi_op(op):
    """The MPI reduction op for ``'sum' | 'max' | 'min' | 'prod'``."""
    MPI = state.mpi
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]


def layout_tag(text, small=True):
    """An integer identifying a layout string (same on every rank): in [1, 61] when ``small``
    (for :func:`tag_values`), else a 31-bit hash."""
    import zlib
    h = zlib.crc32(text.encode())
    return h % 61 + 1 if small else h & 0x7FFFFFFF


def check_layout(comm, text, what):
    """One tiny collective (``MPI_Allreduce`` MAX of (h, -h, failed), h a hash of ``text``):
    every rank raises DistributedError when the ranks' ``text`` differ, before any rank posts
    a mismatched data collective (which MPI may answer with a hang, a truncation error or a
    crash), and when a rank's input failed (see push_collective): then no rank posts it."""
    h = layout_tag(text, small=False)
    buf = np.array([h, -h, int(failed_input() is not None)], dtype=np.int64)
    comm.Allreduce(state.mpi.IN_PLACE, buf, op=state.mpi.MAX)
    if buf[2]:
        raise DistributedError(f"{what}: the input failed on a rank (that rank raises its "
                               f"error); no rank ran this collective")
    if buf[0] != h or buf[1] != -h:
        raise DistributedError(f"{what}: the ranks called it with different arguments (this rank: "
                               f"{text}); every rank must issue the same collectives with the "
                               f"same shapes and dtypes, in the same order")


def tag_values(tag, op, dtype):
    """Two extra elements appended to a reduced buffer so that every rank can check that all
    ranks reduced the same layout: for ``sum`` (tag, tag^2) -- all tags equal iff
    (sum t)^2 == size * sum t^2 (Cauchy-Schwarz equality), exact in float32 for tags <= 61 and up
    to 4096 ranks; for ``max``/``min`` (tag, -tag): all equal iff the max equals minus the
    max of the negated (and likewise for min)."""
    if op == "sum":
        return np.array([tag, tag * tag], dtype=dtype)
    if op in ("max", "min"):
        return np.array([tag, -tag], dtype=dtype)
    return None


def check_tag(vals, tag, op, size, what):
    """Raise DistributedError when the reduced tag elements show differing layouts."""
    a, b = float(vals[0]), float(vals[1])
    if op == "sum":
        ok = a == tag * size and b == tag * tag * size
    else:
        ok = a == tag and b == -tag
    if not ok:
        raise DistributedError(
            f"{what}: the ranks reduced different layouts (shapes/dtypes/keys differ between "
            f"ranks: every rank must push the same arrays in the same order)")
