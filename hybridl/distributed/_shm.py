"""Single-node allreduce through an MPI-3 shared-memory window (the gradient buckets' fast path).

When every rank of the job runs on one machine (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``
gives the whole job), a bucket is summed through memory that all ranks map
(``MPI_Win_allocate_shared``) instead of by ``MPI_Allreduce``:

1. every rank writes its packed gradients into its own row of an ``(N, m)`` shared array (the
   pack into a contiguous buffer that ``MPI_Allreduce`` needs as well);
2. ``MPI_Barrier``;
3. rank ``r`` sums column block ``r`` (about ``m / N`` elements, cache-line aligned) over the
   ``N`` rows, in rank order, and writes the sum into that block of every row;
4. ``MPI_Barrier``: every row now holds the whole sum, and rank ``r`` hands out views of row ``r``.

This is the reduce-scatter / allgather allreduce (Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH", section 4) with both phases done
by loads and stores into the shared window: each element is read ``N`` times and written ``N``
times in all, with no copies through MPI's own shared-memory cells. Measured on the 2-core
development VM (2 ranks, a 2 MB bucket packed from 6 arrays): 0.23 ms against 0.54 ms for the
pack plus ``MPI_Allreduce``; buckets under :data:`MIN_BYTES` keep ``MPI_Allreduce``, which is
faster for small messages (``benchmarks/distributed.py``, section 2, prints both). With 2 ranks the sum is
``a0 + a1``, bitwise what ``MPI_Allreduce`` gives; with more, the order is fixed (rank order),
so runs are reproducible.

MPI stays the transport and the synchronization (the window, the barriers, the memory model:
``MPI_Win_sync`` around each barrier inside a ``MPI_Win_lock_all`` epoch, the "separate"
model's rule, MPI 3.1 section 11.7), and every call is made on the communication thread in push
order, like any collective (:mod:`hybridl.distributed._backend`), so the watchdog still ends a
job whose rank died inside a barrier.

Buffer reuse: a row's views are the gradients the Trainer updates from, so a window is reused
only when no rank still holds a view of its own row. The ranks agree on that in the step's first
call (an ``MPI_Allreduce`` MAX of each rank's busy flags, with the bucket length so that ranks
with different layouts raise instead of writing past a row). Windows are kept for the process
(``MPI_Win_free`` is collective, and ranks drop a kvstore at different moments) in one pool per
bucket index, length and dtype that every kvstore of the process shares, at most :data:`POOL_MAX`
windows each: a new Trainer on the same model reuses them. A new window is made only when the
shared-memory file system (``/dev/shm``) has room for it plus a margin on every rank (MPI maps
the window from there, and a write past a full tmpfs is a bus error); when every window of the
pool is held, or there is no room, the caller falls back to ``MPI_Allreduce`` on a private
buffer.
"""
import os
import sys
import time

import numpy as np

from ._backend import DistributedError

__all__ = ["SharedBuckets", "POOL_MAX", "MIN_BYTES", "has_room"]

POOL_MAX = 3
#: Parameter windows (``Trainer(update_on_kvstore=True)``) per bucket shape: each model of
#: that shape holds one for good (a 4-model ensemble needs 4), and a view kept elsewhere one
#: more; /dev/shm's room is checked before each, as for gradient windows.
PARAM_POOL_MAX = 16
#: Smaller buckets use ``MPI_Allreduce``: this path's fixed cost (the flag exchange, two
#: barriers, Python) is ~20 us against MPI's 4-14 us up to 16 KB, while from 256 KB up it is
#: 2.5-2.8x faster (2 ranks, development VM; ``benchmarks/distributed.py``, section 2).
MIN_BYTES = 32 * 1024
_ALIGN = 16                     # elements: a 64-byte cache line of float32
SHM_DIR = "/dev/shm"

# (bucket index, elements per row, dtype) -> ([windows], [arrays]): every rank makes the same
# windows in the same (collective) order, so the pools are alike on every rank
_POOLS = {}
_WIN_OF = {}        # id(pooled array) -> its window (any pool)


def has_room(nbytes, path=None):
    """Whether the shared-memory file system can take ``nbytes`` more (bytes) and keep a margin
    of 16 MiB + 10% of its size for MPI and other programs. True where ``path`` (default
    ``/dev/shm``) does not exist (no tmpfs of that name to fill up)."""
    try:
        st = os.statvfs(path or SHM_DIR)
    except OSError:
        return True
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free >= nbytes + 16 * 2 ** 20 + total // 10


_ROOM = {}      # nbytes -> (time, has_room) of the last check (acquire asks every step)


def _has_room_cached(nbytes, ttl=1.0):
    """:func:`has_room` for the default path, asked again at most every ``ttl`` seconds (a
    ``statvfs`` per step was 45 us, ~1.5% of a 3 ms training step; a window is made only when
    every earlier one is still held, so a second-old answer errs only by its age)."""
    now = time.monotonic()
    got = _ROOM.get(nbytes)
    if got is None or now - got[0] > ttl:
        got = _ROOM[nbytes] = (now, has_room(nbytes))
    return got[1]


class SharedBuckets:
    """The shared windows of one bucket: ``(N, m)`` arrays of ``dtype`` on the node communicator.

    Args:
        node: the node-local communicator (every rank of the job).
        mpi: the ``mpi4py.MPI`` module.
        m (int): elements per row (the bucket plus its check elements).
        dtype: NumPy dtype of the row.
        index (int): the bucket's index in its kvstore's plan: the windows are shared with
            every bucket of the process that has the same index, length and dtype.
        rows (int): rows per window (default: one per rank; 1 for a window that holds ONE
            copy every rank reads, e.g. the parameters of ``update_on_kvstore``).
        kind (str): what the windows hold (separate pools for gradients, parameters and
            each optimizer state).
    """

    def __init__(self, node, mpi, m, dtype, index=0, rows=None, kind="grad"):
        self.node, self.mpi, self.m, self.dtype = node, mpi, int(m), np.dtype(dtype)
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.rows = self.size if rows is None else int(rows)
        # a parameter window is held by its model for good: one per model of this shape
        self.pool_max = POOL_MAX if kind != "param" else PARAM_POOL_MAX
        self.wins, self.arrays = _POOLS.setdefault(
            (index, self.m, self.dtype.str, self.rows, kind), ([], []))

    def acquire(self, extra=None):
        """A window that no rank holds a view of (collective on the node: every rank calls it
        at the same point): its ``(rows, m)`` array, or None when every window of the pool is
        still held somewhere (the caller then uses ``MPI_Allreduce``).

        ``extra``: optional int64 flags of the caller, MAX-reduced over the ranks in the same
        exchange; then returns ``(array or None, reduced extra)``.

        Raises:
            DistributedError: the ranks' bucket lengths differ (on every rank)."""
        MPI = self.mpi
        item = self.dtype.itemsize
        k = 0 if extra is None else len(extra)
        pm = self.pool_max
        flags = np.zeros(3 + pm + k, dtype=np.int64)
        flags[0], flags[1] = self.m, -self.m
        # no room for another window on this rank (checked only while the pool may grow)
        flags[2] = len(self.arrays) >= pm or not _has_room_cached(self.rows * self.m * item)
        for i in range(len(self.arrays)):
            # references: the list, getrefcount's argument -> 2 when no view of it is alive
            flags[3 + i] = sys.getrefcount(self.arrays[i]) > 2
        if k:
            flags[3 + pm:] = extra
        self.node.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        if flags[0] != self.m or -flags[1] != self.m:
            raise DistributedError(
                f"gradient bucket of {self.m} elements: the ranks' buckets have different "
                f"lengths ({-flags[1]}..{flags[0]}): every rank must push the same arrays in the "
                f"same order")
        got = next((self.arrays[i] for i in range(len(self.arrays)) if not flags[3 + i]), None)
        if got is None and not flags[2]:
            got = self._new()
        return got if extra is None else (got, flags[3 + pm:])

    def _new(self):
        """A new window of the pool (collective)."""
        MPI, item = self.mpi, self.dtype.itemsize
        nbytes = self.rows * self.m * item if self.rank == 0 else 0
        win = MPI.Win.Allocate_shared(nbytes, item, comm=self.node)
        win.Lock_all(MPI.MODE_NOCHECK)
        buf, _ = win.Shared_query(0)
        # made straight on the buffer, so that every view's .base is this array (a reshape of
        # np.frombuffer's result would make the views point past it, and hide them from acquire)
        arr = np.ndarray((self.rows, self.m), dtype=self.dtype, buffer=buf)
        self.wins.append(win)
        self.arrays.append(arr)
        _WIN_OF[id(arr)] = win          # (pooled arrays live as long as the process)
        return arr

    def sync(self, *arrs):
        """``MPI_Win_sync`` on the windows of ``arrs`` around one node barrier: what every rank
        wrote into them before is visible to every rank after (collective)."""
        wins = [_WIN_OF[id(arr)] for arr in arrs]
        for w in wins:
            w.Sync()
        self.node.Barrier()
        for w in wins:
            w.Sync()

    def block(self, n=None):
        """``(lo, hi)``: this rank's columns of the first ``n`` (default ``m``) elements of a row
        (about ``n / N`` of them, cache-line aligned)."""
        n = self.m if n is None else int(n)
        r, size = self.rank, self.size
        lo = (r * n // size) // _ALIGN * _ALIGN if r else 0
        hi = n if r == size - 1 else ((r + 1) * n // size) // _ALIGN * _ALIGN
        return lo, hi

    def allreduce(self, arr):
        """Sum the rows of ``arr`` (from :meth:`acquire`, this rank's row already written) into
        every row; returns this rank's row (collective on the node)."""
        self.sync(arr)
        lo, hi = self.block()
        if hi > lo:
            if self.size == 2:
                dst = arr[self.rank, lo:hi]
                np.add(arr[0, lo:hi], arr[1, lo:hi], out=dst)
                arr[1 - self.rank, lo:hi] = dst
            else:
                acc = arr[0, lo:hi] + arr[1, lo:hi]
                for s in range(2, self.size):
                    acc += arr[s, lo:hi]
                for s in range(self.size):
                    arr[s, lo:hi] = acc
        self.sync(arr)
        return arr[self.rank]
