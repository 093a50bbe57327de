"""Allreduce built on engine ops: ring (reduce-scatter + all-gather) and reduce-then-broadcast.

Ring allreduce (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2)); the arithmetic of the d2l chapter "Parameter
Servers" (Zhang et al., *Dive into Deep Learning*, section 12.7):

* k arrays of S bytes, one per device; each is split into k chunks of S/k bytes.
* Reduce-scatter, k-1 steps: in step s device i+1 receives chunk (i - s) mod k from device i and
  adds it to its own. After k-1 steps device i holds the full sum of chunk (i + 1) mod k.
* All-gather, k-1 steps: in step s device i+1 receives the finished chunk (i + 1 - s) mod k from
  device i and keeps it. After k-1 steps every device holds every summed chunk.
* Every device sends and receives 2 (k-1) S / k bytes in all; with a link bandwidth B per device
  the time is ``2 (k-1) / k * S / B`` -- almost independent of k -- whereas reducing on one device
  and broadcasting moves ``2 (k-1) S`` bytes through that device's link: ``2 (k-1) S / B``.
  With S = 160 MB, k = 4 and B = 16 GB/s (PCIe 3.0 x16), d2l's figures: 60 ms on one GPU,
  15 ms for the ring.

Here every step is ONE engine op pushed to the ``('copy', receiver)`` queue of the device that
receives: it reads the neighbour's chunk (a Var of the neighbour) and writes its own chunk (a Var
of the receiver). Chunks have their own Vars, so step s of chunk c waits only for what it needs:
different chunks, different keys and backward compute on the compute queues all overlap, and
every op carries the caller's ``priority``. Logical CPU devices share host memory, so "receiving"
is reading the neighbour's buffer -- the op is the copy; on a machine with separate memories it
would be a transfer into a receive buffer followed by the add.
"""
import numpy as np

from .. import engine as _engine
from ..engine import Var

__all__ = ["ring_allreduce", "reduce_broadcast", "allreduce"]


def _check(arrays, out, same_len=True):
    from ..ndarray import NDArray
    arrays = list(arrays)
    if not arrays:
        raise ValueError("allreduce: expected at least one array, got none")
    for a in arrays:
        if not isinstance(a, NDArray):
            raise TypeError(f"allreduce: expected NDArrays, got {type(a).__name__}")
        if a.shape != arrays[0].shape:
            raise ValueError(f"allreduce: all arrays must have the same shape; got {arrays[0].shape} "
                             f"and {a.shape}")
    if out is None:
        out = arrays
    out = list(out)
    if same_len and len(out) != len(arrays):
        raise ValueError(f"allreduce: out must hold one array per input ({len(arrays)}), got "
                         f"{len(out)}")
    for o in out:
        if o.shape != arrays[0].shape:
            raise ValueError(f"allreduce: out arrays must have shape {arrays[0].shape}, got {o.shape}")
    return arrays, out


def ring_allreduce(arrays, out=None, priority=0, extra_out=None, name="allreduce"):
    """Sum ``arrays`` (one per device) with a ring allreduce; write the sum into every ``out``.

    Args:
        arrays (list of NDArray): same shape; array i lives on device i of the ring (devices may
            repeat; the algorithm is the same).
        out (list of NDArray or None): destinations (default: ``arrays``, in place); ``out[i]``
            receives the sum on ``arrays[i]``'s device position in the ring, written by an engine
            op of ``out[i].device``'s copy queue.
        priority (int): engine priority of every op (higher runs first among ready ops).
        extra_out (list of NDArray or None): a second set of destinations bound to the same
            result (the KVStore's stored copies); optional.

    Returns:
        ``out`` (the list). Asynchronous: returns after pushing ``2 k (k-1) + 2 k`` engine ops.

    Raises:
        ValueError: shapes differ or ``out`` has the wrong length.  TypeError: not NDArrays.

    Algorithm: module docstring (Patarasuk & Yuan 2009).
    """
    arrays, out = _check(arrays, out)
    k = len(arrays)
    shape, dtype = arrays[0].shape, np.result_type(*[a.dtype for a in arrays])
    size = int(np.prod(shape)) if shape else 1
    bounds = np.linspace(0, size, k + 1).astype(np.int64) if k > 1 else np.array([0, size])
    # per device: the working buffer (a private copy: NDArray storage is never mutated in place,
    # but these buffers are ours) and one Var per chunk.
    bufs = [None] * k
    cvars = [[Var(f"{name}.d{i}.c{c}") for c in range(k)] for i in range(k)]
    devs = [a.device for a in arrays]
    push = _engine.push

    for i in range(k):
        def load(i=i):
            bufs[i] = np.array(arrays[i]._data, dtype=dtype, copy=True).reshape(-1)
        push(load, [arrays[i]._var], cvars[i], ("copy", devs[i]), priority, f"{name}.load")

    def chunk(i, c):
        return bufs[i][bounds[c]:bounds[c + 1]]

    # reduce-scatter: step s, device r = i+1 receives chunk (i - s) mod k from device i and adds
    for s in range(k - 1):
        for i in range(k):
            r, c = (i + 1) % k, (i - s) % k

            def add(i=i, r=r, c=c):
                dst = chunk(r, c)
                dst += chunk(i, c)          # in place into the receiver's private buffer
            # the receiver's chunk is read too: when its device's input failed (its buffer was
            # never loaded), this op passes that error on instead of failing on its own
            push(add, [cvars[i][c], cvars[r][c]], [cvars[r][c]], ("copy", devs[r]), priority,
                 f"{name}.reduce_scatter")
    # all-gather: step s, device r = i+1 receives the finished chunk (i + 1 - s) mod k from i
    for s in range(k - 1):
        for i in range(k):
            r, c = (i + 1) % k, (i + 1 - s) % k

            def gather(i=i, r=r, c=c):
                chunk(r, c)[...] = chunk(i, c)
            push(gather, [cvars[i][c], cvars[r][c]], [cvars[r][c]], ("copy", devs[r]), priority,
                 f"{name}.all_gather")

    for i in range(k):
        o = out[i]
        e = extra_out[i] if extra_out is not None else None
        writes = [o._var] + ([e._var] if e is not None and e is not o else [])

        def store(i=i, o=o, e=e):
            res = bufs[i].reshape(shape)
            o._data = res if res.dtype == o.dtype else res.astype(o.dtype)
            if e is not None:
                e._data = o._data          # never mutated in place: sharing is safe
        push(store, cvars[i], writes, ("copy", o.device), priority, f"{name}.store")
    return out


def reduce_broadcast(arrays, out=None, priority=0, root=None, extra_out=None, name="reduce"):
    """Sum ``arrays`` on one device (``root``, default ``cpu(0)``), then copy the sum to every
    ``out`` (the d2l "aggregate on one GPU / on the CPU" scheme: ``2 (k-1) S`` bytes through the
    root's link).

    Args, Returns, Raises: as :func:`ring_allreduce`, except that ``out`` may hold any number
    of arrays on any devices; ``extra_out`` (one NDArray on ``root``) receives the sum too.
    """
    from ..device import cpu
    arrays, out = _check(arrays, out, same_len=False)
    root = cpu(0) if root is None else root
    dtype = np.result_type(*[a.dtype for a in arrays])
    box = [None]
    svar = Var(f"{name}.sum") if extra_out is None else extra_out._var
    ex = extra_out

    def reduce():
        acc = np.array(arrays[0]._data, dtype=dtype, copy=True)
        for a in arrays[1:]:
            acc += a._data
        box[0] = acc
        if ex is not None:
            ex._data = acc if acc.dtype == ex.dtype else acc.astype(ex.dtype)
    _engine.push(reduce, [a._var for a in arrays], [svar], root, priority, f"{name}.sum")
    for o in out:
        def bcast(o=o):
            d = box[0]
            o._data = np.array(d, dtype=o.dtype, copy=True)
        _engine.push(bcast, [svar], [o._var], ("copy", o.device), priority, f"{name}.broadcast")
    return out


def allreduce(arrays, out=None, priority=0, algorithm="ring"):
    """Sum NDArrays living on several devices into every ``out`` (default in place).

    ``algorithm``: ``'ring'`` (:func:`ring_allreduce`) or ``'reduce'``
    (:func:`reduce_broadcast` on ``cpu(0)``).

    Raises:
        ValueError: unknown algorithm, or see :func:`ring_allreduce`.
    """
    if algorithm == "ring":
        return ring_allreduce(arrays, out, priority)
    if algorithm == "reduce":
        return reduce_broadcast(arrays, out, priority)
    raise ValueError(f"algorithm: expected 'ring' or 'reduce', got {algorithm!r}")
