"""``hl.distributed``: data-parallel training over several processes (and machines) with MPI.

::

    # run with:  hybridl launch -n 2 -- python train.py      (or mpiexec -n 2 python train.py)
    import hybridl as hl
    hl.distributed.init()                       # no-op (rank 0 of 1) when not under mpiexec
    loader = hl.data.DataLoader(ds, 64, shuffle=True, seed=0,
                                num_shards=hl.distributed.size(),
                                shard_index=hl.distributed.rank())
    trainer = hl.Trainer(net.collect_params(), 'sgd', {...}, kvstore='dist')
    ...                                          # the usual loop: step(local batch size)

MPI (mpi4py, ``pip install 'hybridl[mpi]'``) is the distributed engine: every collective is an
engine op on one communication queue (``('comm', 'mpi')``), run in push order on every rank
(see :mod:`hybridl.distributed._backend`), so communication overlaps compute and never blocks a
compute worker. The kvstore ``'dist'`` (= ``'dist_sync'``, :class:`DistKVStore`) broadcasts
parameters from rank 0 at init and all-reduces gradients in buckets (default 25 MB) in reverse
layer order as soon as each bucket's gradients are ready (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", section 3.2.3; Sergeev & Del
Balso 2018, "Horovod"); on one machine a bucket is summed through an MPI-3 shared-memory window
(:mod:`hybridl.distributed._shm`, ``HYBRIDL_DIST_SHM=0`` to use ``MPI_Allreduce``).

Without an MPI launcher (none of ``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``,
``MPI_LOCALRANKID`` set) everything is a single process of size 1 and mpi4py is not imported
(importing ``mpi4py.MPI`` initializes MPI, which some MPI builds refuse outside a launcher).

Failure behaviour: ranks whose parameters differ (count, shape, dtype) get a
:class:`DistributedError` on every rank at the Trainer's kvstore init; gradient buckets carry a
layout check; a collective that does not complete within ``HYBRIDL_DIST_TIMEOUT`` seconds
(default 60; :func:`set_timeout`) aborts the whole job with a message naming it.
"""
import numpy as np

from .. import engine as _engine
from . import _backend
from ._backend import DistributedError, get_timeout, set_timeout

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "barrier", "broadcast",
           "allreduce", "broadcast_parameters", "create_kvstore", "DistKVStore",
           "DistributedError", "set_timeout", "get_timeout", "launched_under_mpi"]

launched_under_mpi = _backend.launched_under_mpi


def init():
    """Initialize the process group (idempotent); returns ``(rank, size)``.

    Under an MPI launcher this imports mpi4py (MPI initialized with ``MPI_THREAD_MULTIPLE``)
    and starts the collective watchdog; otherwise it is a no-op: rank 0 of 1, and mpi4py is
    never imported.

    Raises:
        ImportError: launched by mpiexec but mpi4py is not installed.
        DistributedError: the MPI library does not support calls from a helper thread.
    """
    st = _backend.init()
    return st.rank, st.size


def is_initialized():
    """True once :func:`init` has run."""
    return _backend.state.initialized


def rank():
    """This process's rank in ``[0, size())`` (initializes on first use)."""
    return _backend.init().rank


def size():
    """Number of processes of the job (1 without an MPI launcher)."""
    return _backend.init().size


def local_rank():
    """This process's rank among the processes of its machine (0 without a launcher)."""
    return _backend.init().local_rank


def _check_nd(x, what):
    from ..ndarray import NDArray
    if not isinstance(x, NDArray):
        raise TypeError(f"{what}: expected an NDArray, got {type(x).__name__}")


def barrier():
    """Block until every rank has reached this barrier (and this rank's pushed collectives have
    completed; compute work keeps running).

    Raises:
        OpError: a collective before it failed.
    """
    st = _backend.init()
    if st.size == 1:
        return
    from ..engine import Var
    v = Var("dist.barrier")
    _backend.push_collective(lambda comm: comm.Barrier(), [], [v], "dist.barrier")
    _engine.wait_for(v)


def broadcast(x, root=0, check=True):
    """``root``'s value of ``x`` on every rank: a new NDArray (same shape, dtype, device),
    computed asynchronously (an engine op on the communication queue).

    Args:
        x (NDArray): on every rank, the same shape and dtype.
        root (int): the rank whose value is sent.
        check (bool): compare the ranks' shape, dtype and root first (one 16-byte
            collective; see :func:`allreduce`).

    Raises:
        TypeError: ``x`` is not an NDArray.  ValueError: ``root`` out of range.
        DistributedError (at the sync point): the ranks' arguments differ.
    """
    _check_nd(x, "broadcast")
    st = _backend.init()
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < st.size:
        raise ValueError(f"root: expected a rank in [0, {st.size}), got {root!r}")
    from ..ndarray import NDArray
    out = NDArray(x.shape, x.dtype, x.device)
    if st.size == 1:
        from ..ndarray import _assign_data
        _assign_data(out, x)
        return out
    nbytes = int(x.size) * x.dtype.itemsize

    def bcast(comm):
        if check:
            _backend.check_layout(comm, f"broadcast(shape={x.shape}, dtype={x.dtype}, "
                                        f"root={root})", "hl.distributed.broadcast")
        if _backend.failed_input() is not None:     # (check=False: take part with zeros)
            buf = np.zeros(x.shape, x.dtype)
        else:
            buf = np.array(x._data, dtype=x.dtype, order="C", copy=True)
        comm.Bcast(buf, root=int(root))
        out._data = buf

    _backend.push_collective(bcast, [x._var], [out._var], "dist.broadcast", nbytes)
    return out


_OPS = ("sum", "mean", "max", "min", "prod")


def allreduce(x, op="sum", check=True):
    """The elementwise reduction of ``x`` over all ranks: a new NDArray (same shape, dtype,
    device), computed asynchronously (an engine op on the communication queue).

    Args:
        x (NDArray): on every rank, the same shape and dtype.
        op (str): ``'sum'``, ``'mean'`` (sum / size; float dtypes), ``'max'``, ``'min'``,
            ``'prod'``.
        check (bool): first compare the ranks' shape, dtype and op with one tiny collective
            (16 bytes), so that a mismatch raises a clear :class:`DistributedError` on every
            rank instead of a hang, a crash or mixed data; ``False`` saves that round trip.

    Raises:
        TypeError: ``x`` is not an NDArray, or not of an integer or float dtype (bool and
        complex have no MPI reduction for every op).  ValueError: unknown ``op``, or ``'mean'``
        of an integer array.  DistributedError (at the sync point): the ranks' arguments differ.
    """
    _check_nd(x, "allreduce")
    if op not in _OPS:
        raise ValueError(f"op: expected one of {_OPS}, got {op!r}")
    if op == "mean" and x.dtype.kind != "f":
        raise ValueError(f"op: 'mean' needs a float array, got dtype {x.dtype}")
    if x.dtype.kind not in "fiu":
        # MPI defines no sum/max/min/prod for bool (or max/min for complex): it would abort
        # the whole job from inside the collective
        raise TypeError(f"allreduce: expected an integer or float array, got dtype {x.dtype}; "
                        f"cast it first (e.g. x.astype('int32') for a count of True values)")
    st = _backend.init()
    from ..ndarray import NDArray
    out = NDArray(x.shape, x.dtype, x.device)
    if st.size == 1:
        from ..ndarray import _assign_data
        _assign_data(out, x)
        return out
    mop = "sum" if op == "mean" else op
    dt = x.dtype
    n = int(x.size)
    size = st.size

    def reduce(comm):
        if check:
            _backend.check_layout(comm, f"allreduce(shape={x.shape}, dtype={dt}, op={op!r})",
                                  "hl.distributed.allreduce")
        # straight from x's array into the new result: MPI's own copy is the only one. (A
        # reused buffer reduced in place, with a copy in and a copy out, measured 1.2-1.6x
        # slower from 64 KB to 16 MB on 2 ranks: 4 MB 2.5-2.9 ms against 2.0-2.2 ms.)
        failed = _backend.failed_input() is not None     # (check=False: zeros)
        src = np.zeros(n, dt) if failed else np.ascontiguousarray(x._data).reshape(-1)
        res = np.empty(x.shape, dt)
        comm.Allreduce(src, res.reshape(-1), op=_backend.mpi_op(mop))
        if op == "mean":
            res /= dt.type(size)
        out._data = res

    _backend.push_collective(reduce, [x._var], [out._var], f"dist.allreduce[{op}]", n * dt.itemsize)
    return out


def broadcast_parameters(params, root=0):
    """Overwrite every parameter (all device copies) with ``root``'s value, asynchronously.

    ``params``: a ParameterDict, dict or list of Parameters (initialized; call the network on
    data once first when shapes are deferred). The Trainer with ``kvstore='dist'`` does this at
    its kvstore init.

    Raises:
        DistributedError: the ranks' parameters differ in count, shape or dtype (every rank).
    """
    plist = list(params.values()) if isinstance(params, dict) else list(params)
    kv = DistKVStore()
    kv.init(list(range(len(plist))), [p.list_data() for p in plist], root=root)


def create_kvstore(name="dist_sync", **kwargs):
    """The kvstore behind ``hl.kv.create('dist')`` / ``'dist_sync'``.

    Raises:
        ValueError: an unknown dist kind (``'dist_async'`` is not provided).
    """
    if name not in ("dist", "dist_sync"):
        raise ValueError(f"kvstore {name!r}: expected 'dist' or 'dist_sync' (synchronous "
                         f"data-parallel over MPI); asynchronous kinds are not provided")
    return DistKVStore(name, **kwargs)


from .kvstore import DistKVStore  # noqa: E402
