"""``hl.kv``: the key-value store interface of parameter servers (MXNet's KVStore).

::

    kv = hl.kv.create('device')                  # or 'local'
    kv.init(3, hl.nd.zeros((2, 3)))
    kv.push(3, [g0, g1])                         # g0 on cpu(0), g1 on cpu(1): stores g0 + g1
    kv.pull(3, out=[w0, w1])                     # every out receives the stored value
    kv.pushpull(3, grads, out=grads, priority=-i)  # allreduce in place (what the Trainer uses)

Semantics (MXNet's KVStore, Li et al. 2014 "Scaling distributed machine learning with the
parameter server"; d2l section 12.7):

* ``init(key, value)`` stores a copy of ``value`` (for a list, its first element).
* ``push(key, values)`` sums the list (one value per device) and *replaces* the stored value
  with the sum (with an updater set by :meth:`KVStore.set_updater`, calls
  ``updater(key, sum, stored)`` instead).
* ``pull(key, out)`` writes the stored value into every array of ``out``, each on its own device.
* ``pushpull`` = push then pull, fused.

Two kinds, differing only in *where* the sum is computed:

* ``'local'``: every value is reduced on ``cpu(0)`` (one op reading them all), then broadcast
  (one copy op per destination). Simple; everything goes through one device.
* ``'device'``: a ring allreduce over the devices of the pushed values
  (:func:`hybridl.parallel.allreduce.ring_allreduce`, Patarasuk & Yuan 2009): every step is an
  engine op of the receiving device's copy queue, so reduction overlaps compute and runs at the
  given ``priority``; the stored value keeps one copy per device, so a pull is local.

All calls are asynchronous: they push engine ops and return; keys are ints or strings, and
``init``/``push``/``pull``/``pushpull`` also take a list of keys with a list of values.
"""
import numpy as np

from . import engine as _engine
from .device import cpu

__all__ = ["KVStore", "create"]


class KVStore:
    """A key-value store of NDArrays with push (sum) / pull (broadcast) semantics.

    Args:
        kind (str): ``'local'`` (reduce on cpu(0)) or ``'device'`` (ring allreduce across the
            values' devices).

    Raises:
        ValueError: unknown kind.
    """

    def __init__(self, kind="device"):
        if kind not in ("local", "device"):
            raise ValueError(f"kvstore: expected 'local' or 'device', got {kind!r}")
        self.type = kind
        self._store = {}          # key -> {Device: NDArray}
        self._updater = None

    # ------------------------------------------------------------------ info (single process)
    @property
    def rank(self):
        """This worker's rank (0: a single-process store)."""
        return 0

    @property
    def num_workers(self):
        """Number of worker processes (1)."""
        return 1

    def set_updater(self, updater):
        """``updater(key, merged, stored)`` runs on every push instead of replacing the stored
        value (e.g. an optimizer update on the store)."""
        self._updater = updater

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _keys(key, value):
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(key):
                raise ValueError(f"kvstore: with a list of {len(key)} keys, expected a list of as "
                                 f"many values, got {type(value).__name__}")
            return list(zip(key, value))
        return [(key, value)]

    @staticmethod
    def _list(value, what):
        from .ndarray import NDArray
        vals = list(value) if isinstance(value, (list, tuple)) else [value]
        if not vals:
            raise ValueError(f"kvstore: {what} is an empty list")
        for v in vals:
            if not isinstance(v, NDArray):
                raise TypeError(f"kvstore: {what} must be NDArrays, got {type(v).__name__}")
        return vals

    def _stored(self, key):
        st = self._store.get(key)
        if st is None:
            raise KeyError(f"kvstore: key {key!r} has not been initialized; call init({key!r}, "
                           f"value) first")
        return st

    def _check_shape(self, key, vals, what):
        ref = next(iter(self._stored(key).values()))
        for v in vals:
            if v.shape != ref.shape:
                raise ValueError(f"kvstore: {what} for key {key!r} has shape {v.shape}, the stored "
                                 f"value has shape {ref.shape}")
        return ref

    # ------------------------------------------------------------------ interface
    def init(self, key, value):
        """Store a copy of ``value`` (NDArray, or a list whose first element is used) under
        ``key``; ``'local'`` keeps it on cpu(0), ``'device'`` on the value's device.

        Raises:
            ValueError: the key was already initialized.  TypeError: not an NDArray.
        """
        for k, v in self._keys(key, value):
            if k in self._store:
                raise ValueError(f"kvstore: key {k!r} is already initialized")
            v0 = self._list(v, "value")[0]
            dev = cpu(0) if self.type == "local" else v0.device
            self._store[k] = {dev: v0.copyto(dev)}

    def push(self, key, value, priority=0):
        """Sum ``value`` (an NDArray or a list, one per device) into the store for ``key``.

        Raises:
            KeyError: key not initialized.  ValueError: shape mismatch.
        """
        for k, v in self._keys(key, value):
            self._push(k, self._list(v, "value"), priority)

    def _push(self, k, vals, priority, out=None):
        from .ndarray import NDArray
        from .parallel.allreduce import reduce_broadcast, ring_allreduce
        ref = self._check_shape(k, vals, "pushed value")
        if self._updater is not None:
            merged = self._merge_to(vals, ref.device, priority)
            for d, s in self._stored(k).items():
                self._updater(k, merged if d == merged.device else merged.copyto(d), s)
            if out is not None:
                self._pull(k, out, priority)
            return
        if self.type == "local":
            root = cpu(0)
            stored = NDArray(ref.shape, ref.dtype, root)
            reduce_broadcast(vals, out if out is not None else [], priority, root, stored,
                             name=f"kv[{k}]")
            self._store[k] = {root: stored}
            return
        devs = [v.device for v in vals]
        if len(set(devs)) != len(devs):     # several values on one device: add them there first
            vals = self._combine_same_device(vals, priority)
            devs = [v.device for v in vals]
        stored = [NDArray(ref.shape, ref.dtype, d) for d in devs]
        if len(vals) == 1:
            v = vals[0]

            def keep(v=v, s=stored[0]):
                s._data = v._data if v.dtype == s.dtype else v._data.astype(s.dtype)
            _engine.push(keep, [v._var], [stored[0]._var], ("copy", devs[0]), priority, "kv.keep")
        else:
            ring_allreduce(vals, stored, priority, name=f"kv[{k}]")
        self._store[k] = dict(zip(devs, stored))
        if out is not None:
            self._pull(k, out, priority)

    @staticmethod
    def _combine_same_device(vals, priority):
        from .ndarray import NDArray
        groups = {}
        for v in vals:
            groups.setdefault(v.device, []).append(v)
        res = []
        for d, vs in groups.items():
            if len(vs) == 1:
                res.append(vs[0])
                continue
            s = NDArray(vs[0].shape, vs[0].dtype, d)

            def add(vs=vs, s=s):
                acc = np.array(vs[0]._data, dtype=s.dtype, copy=True)
                for v in vs[1:]:
                    acc += v._data
                s._data = acc
            _engine.push(add, [v._var for v in vs], [s._var], d, priority, "kv.local_sum")
            res.append(s)
        return res

    @staticmethod
    def _merge_to(vals, device, priority):
        from .ndarray import NDArray
        s = NDArray(vals[0].shape, vals[0].dtype, device)

        def add():
            acc = np.array(vals[0]._data, dtype=s.dtype, copy=True)
            for v in vals[1:]:
                acc += v._data
            s._data = acc
        _engine.push(add, [v._var for v in vals], [s._var], device, priority, "kv.merge")
        return s

    def pull(self, key, out=None, priority=0):
        """Write the stored value of ``key`` into every array of ``out`` (NDArray or list), each
        by a copy op on its own device's copy queue (local when the store has a copy there).

        Raises:
            KeyError: key not initialized.  ValueError: ``out`` missing or shape mismatch.
        """
        if out is None:
            raise ValueError("kvstore.pull: out is required (the arrays to write into)")
        for k, o in self._keys(key, out):
            self._pull(k, self._list(o, "out"), priority)

    def _pull(self, k, outs, priority):
        st = self._stored(k)
        self._check_shape(k, outs, "out")
        first = next(iter(st.values()))
        for o in outs:
            src = st.get(o.device, first)
            if src is o:
                continue

            def copy(o=o, src=src):
                o._data = np.array(src._data, dtype=o.dtype, copy=True)
            _engine.push(copy, [src._var], [o._var], ("copy", o.device), priority, "kv.pull")

    def pushpull(self, key, value, out=None, priority=0):
        """``push(key, value)`` then ``pull(key, out)`` (``out`` default: ``value``, in place).

        With ``'device'`` and ``out`` on the devices of ``value``, the ring writes the sum
        straight into ``out`` (no extra copy); the store keeps the result too.

        Raises:
            KeyError, ValueError: as push and pull.
        """
        if out is None:
            out = value
        for (k, v), (_, o) in zip(self._keys(key, value), self._keys(key, out)):
            vals, outs = self._list(v, "value"), self._list(o, "out")
            self._check_shape(k, outs, "out")
            devs = [x.device for x in vals]
            if (self.type == "device" and self._updater is None and len(vals) > 1
                    and len(set(devs)) == len(devs) and [x.device for x in outs] == devs):
                from .ndarray import NDArray
                ref = self._check_shape(k, vals, "pushed value")
                stored = [NDArray(ref.shape, ref.dtype, d) for d in devs]
                from .parallel.allreduce import ring_allreduce
                ring_allreduce(vals, outs, priority, extra_out=stored, name=f"kv[{k}]")
                self._store[k] = dict(zip(devs, stored))
            elif self.type == "local" and self._updater is None:
                self._push(k, vals, priority, out=outs)
            else:
                self._push(k, vals, priority)
                self._pull(k, outs, priority)

    def __repr__(self):
        return f"KVStore({self.type!r}, keys={list(self._store)})"


def create(name="device"):
    """A :class:`KVStore`: ``'local'`` or ``'device'`` (see the module docstring).

    ``'dist'`` / ``'dist_sync'`` (across processes) are provided by
    :mod:`hybridl.distributed` when it is available.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(name, KVStore):
        return name
    if isinstance(name, str) and name.startswith("dist"):
        try:
            from . import distributed
        except ImportError as e:
            raise ValueError(f"kvstore {name!r}: hybridl.distributed is not available ({e})") from None
        if not hasattr(distributed, "create_kvstore"):
            raise ValueError(f"kvstore {name!r}: hybridl.distributed provides no create_kvstore()")
        return distributed.create_kvstore(name)
    return KVStore(name)
