"""DistKVStore: the ``'dist'`` / ``'dist_sync'`` kvstore -- synchronous data parallelism over MPI.

What the Trainer does with it (``hl.Trainer(..., kvstore='dist')``):

1. ``init(keys, params)`` (once, all keys together): every rank sends a description of its
   parameters (key, shape, dtype) to every other (``Allgatherv``); if they differ, every rank
   raises a :class:`DistributedError` naming the first difference (no rank hangs in a
   mismatched collective). Then rank 0's values are broadcast into every parameter (coalesced
   into buckets).
2. ``pushpull(key, grads, out=grads)`` per parameter, last layers first, right after backward
   has been *pushed*. Keys are grouped into buckets of about ``bucket_bytes`` (default 25 MB,
   ``HYBRIDL_DIST_BUCKET_MB``) in reverse key order (the order in which backward produces the
   gradients; PyTorch DDP, Li et al. 2020, section 3.2.3). When every key of a bucket has been
   pushed, ONE engine op is pushed on the communication queue that reads the bucket's gradient
   Vars and writes them: it packs them into one buffer, ``MPI_Allreduce``-s it (sum), and binds
   each gradient to its slice of the result. The engine starts it as soon as those gradients
   are computed -- while backward of earlier layers still runs on the compute worker -- and the
   optimizer update of a parameter waits only for its own bucket. When every rank runs on one
   machine the sum goes through an MPI-3 shared-memory window instead of ``MPI_Allreduce``
   (:mod:`hybridl.distributed._shm`; 2.3x faster for a 2 MB bucket on the development VM;
   ``HYBRIDL_DIST_SHM=0`` turns it off).
3. Each (float) bucket buffer carries five extra elements, summed with it: a layout tag and its
   square (see :func:`hybridl.distributed._backend.tag_values`): if ranks packed different
   layouts, every rank raises a :class:`DistributedError` instead of using mixed data; the
   number of ranks whose gradients failed (their batch raised: every rank then fails the
   step, see :func:`hybridl.distributed._backend.push_collective`); and each rank's batch
   size with a count of the ranks that gave one (unequal batches are rescaled to the mean
   over the global batch, see ``local_batch``).

4. ``pushpull_update`` (``Trainer(..., update_on_kvstore=True)``, ranks on one machine): the
   store also applies the optimizer, sharded: rank r sums only block r of each bucket and
   updates it in one shared copy of the weights and optimizer states (see the method).

The kvstore sums; the Trainer divides by ``num_workers`` as well as by the batch size, so
``trainer.step(local_batch_size)`` averages over the global batch (as Horovod's
DistributedTrainer does).
"""
import sys

import numpy as np

from .. import engine as _engine
from ..engine import Var
from ..kv import KVStore
from . import _backend
from ._backend import DistributedError  # noqa: F401 (raised by init)
from . import _shm
from ._shm import SharedBuckets

__all__ = ["DistKVStore", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0


class _Bucket:
    __slots__ = ("index", "keys", "offsets", "counts", "shapes", "dtype", "n", "tag", "name")

    def __init__(self, index, dtype):
        self.index, self.dtype = index, dtype
        self.keys, self.offsets, self.counts, self.shapes = [], [], [], []
        self.n = 0
        self.tag = None
        self.name = None

    def add(self, key, shape):
        cnt = int(np.prod(shape, dtype=np.int64))
        self.keys.append(key)
        self.offsets.append(self.n)
        self.counts.append(cnt)
        self.shapes.append(tuple(shape))
        self.n += cnt

    @property
    def nbytes(self):
        return self.n * self.dtype.itemsize


_POOL_MAX = 3


def _free_buffer(pool, n, dt):
    """A buffer of ``pool`` (a list) that nothing outside the pool refers to (no live views),
    else a new one (kept when the pool has room)."""
    for i in range(len(pool)):
        # references: the list, getrefcount's argument -> 2 when no view of it is alive
        if sys.getrefcount(pool[i]) <= 2 and pool[i].dtype == dt and pool[i].size == n:
            return pool[i]
    buf = np.empty(n, dtype=dt)
    if len(pool) < _POOL_MAX:
        pool.append(buf)
    return buf


class DistKVStore(KVStore):
    """KVStore across MPI processes (see the module docstring).

    Args:
        kind (str): ``'dist_sync'`` or its alias ``'dist'``.
        bucket_mb (float): gradient bucket size in MiB (default ``HYBRIDL_DIST_BUCKET_MB`` or
            25). Smaller buckets start communicating earlier; larger ones pay the per-message
            latency less often.

    Attributes:
        rank, num_workers (int): this process, the number of processes.
        buckets (list): the bucket plan once built (keys, element counts per bucket).

    Raises:
        ValueError: a bad ``bucket_mb``.
    """

    def __init__(self, kind="dist_sync", bucket_mb=None):
        if kind not in ("dist", "dist_sync"):
            raise ValueError(f"kvstore: expected 'dist' or 'dist_sync', got {kind!r}")
        if bucket_mb is None:
            self.bucket_bytes = _backend.env_bucket_bytes(DEFAULT_BUCKET_MB)
        else:
            if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not \
                    0 < bucket_mb < float("inf"):
                raise ValueError(f"bucket_mb: expected a positive number of MiB, got {bucket_mb!r}")
            self.bucket_bytes = max(1, int(bucket_mb * 2 ** 20))
        self._st = _backend.init()
        self.type = "dist_sync"
        self._store = {}            # key -> {Device: NDArray} (push/pull only)
        self._updater = None
        self._meta = {}             # key -> (shape, dtype), in init order
        self._plan = None
        self._key_bucket = {}
        self._staged = {}           # bucket index -> {key: (values, outs, priority)}
        self._bufs = {}             # bucket index -> its communication buffers (reused)
        self._shared = {}           # (bucket index, length, dtype) -> SharedBuckets (one machine)
        self._windows = {}          # bucket index -> its parameter / state windows (update)
        # this process's batch size for the current step (set by Trainer.step; None: not
        # known). Ranks with different batches: the reduced gradients are rescaled so that
        # each rank's update 1 / (batch * size) becomes 1 / (the sum of the ranks' batches)
        self.local_batch = None
        self.step_number = None     # the Trainer's step being reduced (for error messages)

    def _at(self):
        """`` (Trainer step k)`` for messages, when the Trainer told which step this is."""
        k = self.step_number
        return "" if k is None else f" (Trainer step {k}, counting from 1)"

    # ------------------------------------------------------------------ info
    @property
    def rank(self):
        return self._st.rank

    @property
    def num_workers(self):
        return self._st.size

    @property
    def buckets(self):
        """The bucket plan: a list of dicts (keys, elements, bytes, dtype), last keys first."""
        plan = self._get_plan()
        return [{"keys": list(b.keys), "elements": b.n, "bytes": b.nbytes, "dtype": str(b.dtype)}
                for b in plan]

    # ------------------------------------------------------------------ init
    def init(self, key, value, root=0):
        """Register ``key`` (or a list of keys) and overwrite ``value`` (an NDArray or a list
        of copies on several devices) with rank ``root``'s value on every rank.

        Pass all keys in one call (the Trainer does): the ranks' keys, shapes and dtypes are
        compared first, in one exchange.

        Raises:
            DistributedError: the ranks' keys/shapes/dtypes, or their bucket sizes, differ
                (raised on every rank).
            ValueError: a key already initialized.  TypeError: not NDArrays.
        """
        pairs = [(k, self._list(v, "value")) for k, v in self._keys(key, value)]
        seen = set()
        for k, vals in pairs:
            if k in self._meta or k in seen:
                raise ValueError(f"kvstore: key {k!r} is already initialized")
            seen.add(k)
            for v in vals[1:]:
                if v.shape != vals[0].shape or v.dtype != vals[0].dtype:
                    raise ValueError(f"kvstore: the copies of key {k!r} differ in shape/dtype: "
                                     f"{vals[0].shape} {vals[0].dtype} vs {v.shape} {v.dtype}")
        self._check_signature([(k, vals[0].shape, vals[0].dtype) for k, vals in pairs])
        for k, vals in pairs:
            self._meta[k] = (tuple(vals[0].shape), vals[0].dtype)
        self._plan = None
        if self._st.size > 1:
            self._broadcast(pairs, root)
        for k, vals in pairs:
            v0 = vals[0]
            self._store[k] = {v0.device: v0.copyto(v0.device)}

    def broadcast_values(self, named, root=0):
        """Overwrite values with rank ``root``'s, without registering them as keys (the Trainer
        uses it for frozen parameters and BatchNorm running statistics, which are never
        reduced). ``named``: (name, NDArray or list of device copies) pairs, the same names,
        shapes and dtypes on every rank.

        Raises:
            DistributedError: the ranks' names/shapes/dtypes differ (on every rank)."""
        try:
            named = [(k, v) for k, v in named]
        except (TypeError, ValueError):
            raise TypeError("named: expected (name, NDArray or list of copies) pairs") from None
        pairs = [(k, self._list(v, "value")) for k, v in named]
        self._check_signature([(k, vals[0].shape, vals[0].dtype) for k, vals in pairs])
        if self._st.size > 1 and pairs:
            self._broadcast(pairs, root)

    def _check_signature(self, sig):
        st = self._st
        if st.size == 1:
            return
        # the first line: the bucket size, which must match too (the ranks' buckets would
        # pair different gradients; MPI then failed with "Message truncated")
        desc = [f"bucket_bytes {self.bucket_bytes}"]
        desc += [f"{k!r}: shape {tuple(s)} {np.dtype(d)}" for k, s, d in sig]
        payload = "\n".join(desc).encode()
        box = {}

        def gather(comm):
            lens = np.zeros(st.size, dtype=np.int64)
            comm.Allgather(np.array([len(payload)], dtype=np.int64), lens)
            recv = np.zeros(int(lens.sum()), dtype=np.uint8)
            comm.Allgatherv(np.frombuffer(payload, dtype=np.uint8), [recv, lens])
            offs = np.concatenate([[0], np.cumsum(lens)])
            box["all"] = [bytes(recv[offs[r]:offs[r + 1]]).decode() for r in range(st.size)]

        v = Var("dist.signature")
        _backend.push_collective(gather, [], [v], "kv.check_parameters", len(payload))
        _engine.wait_for(v)
        head, *mine = box["all"][0].split("\n")
        sizes = [text.split("\n")[0] for text in box["all"]]
        if any(h != head for h in sizes):
            raise DistributedError(
                "kvstore 'dist': the ranks' gradient bucket sizes differ (bucket_mb / "
                "HYBRIDL_DIST_BUCKET_MB must be the same on every rank): "
                + ", ".join(f"rank {r} {h.split()[1]} bytes" for r, h in enumerate(sizes)))
        problems = []
        for r, text in enumerate(box["all"][1:], start=1):
            other = text.split("\n")[1:]
            if other == mine:
                continue
            msg = f"rank {r} has {len(other)} parameters, rank 0 has {len(mine)}"
            for i, (a, b) in enumerate(zip(mine, other)):
                if a != b:
                    msg += f"; first difference at position {i}: rank 0 {a} vs rank {r} {b}"
                    break
            problems.append(msg)
        if problems:
            raise DistributedError(
                "kvstore 'dist': the ranks' parameters differ (every rank must build the same "
                "model and pass the same parameters to the Trainer): " + "; ".join(problems))

    def _broadcast(self, pairs, root):
        """Coalesced broadcast of ``root``'s values into every copy (buckets of bucket_bytes)."""
        groups, cur = [], None
        for k, vals in pairs:
            nb = vals[0].size * vals[0].dtype.itemsize
            if cur is None or cur[0] != vals[0].dtype or (cur[2] and cur[2] + nb > self.bucket_bytes):
                cur = [vals[0].dtype, [], 0]
                groups.append(cur)
            cur[1].append((k, vals))
            cur[2] += nb
        for dt, members, nb in groups:
            reads = [v._var for _, vals in members for v in vals[:1]]
            writes = [v._var for _, vals in members for v in vals]

            def bcast(comm, dt=dt, members=members):
                n = sum(vals[0].size for _, vals in members)
                buf = np.empty(n, dtype=dt)
                off = 0
                if self._st.rank == root:
                    failed = _backend.failed_input() is not None
                    for _, vals in members:
                        c = vals[0].size
                        buf[off:off + c] = 0 if failed else np.asarray(vals[0]._data).reshape(-1)
                        off += c
                comm.Bcast(buf, root=int(root))
                off = 0
                for _, vals in members:
                    c = vals[0].size
                    res = buf[off:off + c].reshape(vals[0].shape)
                    for v in vals:
                        v._data = res
                    off += c

            _backend.push_collective(bcast, reads, writes,
                                     f"kv.broadcast[{len(members)} arrays]", nb)

    # ------------------------------------------------------------------ buckets
    def _get_plan(self):
        if self._plan is not None:
            return self._plan
        plan, cur = [], None
        for k in reversed(list(self._meta)):
            shape, dt = self._meta[k]
            nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if cur is None or cur.dtype != dt or (cur.n and cur.nbytes + nb > self.bucket_bytes):
                cur = _Bucket(len(plan), dt)
                plan.append(cur)
            cur.add(k, shape)
        for b in plan:
            layout = f"{b.index}|{b.dtype}|" + "|".join(f"{k!r}{s}" for k, s in zip(b.keys, b.shapes))
            b.tag = _backend.layout_tag(layout)
            size = (f"{b.nbytes / 2**20:.2f} MiB" if b.nbytes >= 2 ** 20 else
                    f"{b.nbytes / 2**10:.1f} KiB")
            b.name = (f"kv.allreduce[bucket {b.index}: {len(b.keys)} "
                      f"array{'s' if len(b.keys) != 1 else ''}, {size}]")
        self._plan = plan
        self._key_bucket = {k: b for b in plan for k in b.keys}
        self._staged = {}
        return plan

    def _meta_of(self, k):
        m = self._meta.get(k)
        if m is None:
            raise KeyError(f"kvstore: key {k!r} has not been initialized; call init({k!r}, "
                           f"value) first")
        return m

    def _check(self, k, arrays, what):
        shape, dt = self._meta_of(k)
        for a in arrays:
            if a.shape != shape:
                raise ValueError(f"kvstore: {what} for key {k!r} has shape {a.shape}, the "
                                 f"initialized value has shape {shape}")

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` over all local copies and all ranks into ``out`` (default: in place).

        Asynchronous: the bucket holding ``key`` is all-reduced by one engine op once every key
        of the bucket has been pushed in this round (see the module docstring). Until then
        ``out`` still holds this rank's own value, not the sum: push every key of the bucket
        (``buckets`` lists them; the Trainer pushes all its keys each step) before reading
        it, or make the store with a ``bucket_mb`` small enough for one key per bucket.

        Raises:
            KeyError: key not initialized.  ValueError: shape mismatch, or a key pushed again
            before the other keys of its bucket were pushed.
        """
        if out is None:
            out = value
        self._get_plan()
        for (k, v), (_, o) in zip(self._keys(key, value), self._keys(key, out)):
            vals, outs = self._list(v, "value"), self._list(o, "out")
            self._check(k, vals, "pushed value")
            self._check(k, outs, "out")
            b = self._key_bucket[k]
            staged = self._staged.setdefault(b.index, {})
            if k in staged:
                missing = [x for x in b.keys if x not in staged]
                raise ValueError(f"kvstore 'dist': key {k!r} pushed again before the rest of its "
                                 f"bucket {b.index} (keys {missing} not pushed yet); push every "
                                 f"initialized key once per step")
            staged[k] = (vals, outs, priority)
            if len(staged) == len(b.keys):
                del self._staged[b.index]
                self._launch(b, staged)

    def _launch(self, b, staged):
        st = self._st
        keys = b.keys
        items = [staged[k] for k in keys]
        if st.size == 1 and all(len(vals) == 1 and outs == vals for vals, outs, _ in items):
            return                  # one process, one copy, in place: the sum is the value
        reads = [v._var for vals, _, _ in items for v in vals]
        writes = [o._var for _, outs, _ in items for o in outs]
        n, dt, tag, size = b.n, b.dtype, b.tag, st.size
        # the buffer's tail (module docstring, 3.): tag, tag^2, failed (set when it runs),
        # this rank's batch, whether that is known
        lb = self.local_batch
        extra = None
        if dt in (np.float32, np.float64):
            extra = np.append(_backend.tag_values(tag, "sum", dt), [0, lb or 0, 1 if lb else 0])
            extra = extra.astype(dt)

        bufs = self._bufs
        at = self._at()

        def run(comm):
            # the bucket's own buffers, the same every step: MPI libraries register (pin) the
            # memory they move, and a fresh buffer per step costs that again each time
            # (measured: a 2 MB allreduce in a fresh buffer 4.1-4.7 ms, in a reused one plus
            # a copy out 1.3-1.7 ms, 2 ranks on the development VM). The reduced gradients are
            # handed out as views of the buffer (no copy out), so a buffer is reused only once
            # nothing refers to it any more (the next backward has replaced those gradients);
            # while a view is still held elsewhere, another buffer of the bucket's pool is used.
            m = n + (0 if extra is None else len(extra))
            rows = None
            if size > 1 and st.shm and b.nbytes >= _shm.MIN_BYTES:  # one machine (_shm.py)
                skey = (b.index, m, np.dtype(dt).str)
                shared = self._shared.get(skey)
                if shared is None:
                    shared = self._shared[skey] = SharedBuckets(st.node, st.mpi, m, dt, b.index)
                rows = shared.acquire()
            buf = rows[shared.rank] if rows is not None else \
                _free_buffer(bufs.setdefault(b.index, []), m, dt)
            failed = _backend.failed_input() is not None
            for (vals, _, _), off, cnt in zip(items, b.offsets, b.counts):
                seg = buf[off:off + cnt]
                if failed:              # a gradient of this rank failed: take part with zeros
                    seg[...] = 0
                    continue
                seg[...] = np.asarray(vals[0]._data).reshape(-1)
                for v in vals[1:]:
                    seg += np.asarray(v._data).reshape(-1)
            if size > 1:
                if extra is not None:
                    buf[n:] = extra
                    buf[n + 2] = 1 if failed else 0
                if rows is not None:
                    buf = shared.allreduce(rows)
                else:
                    comm.Allreduce(st.mpi.IN_PLACE, buf, op=st.mpi.SUM)
                if extra is not None:
                    _backend.check_tag(buf[n:n + 2], tag, "sum", size, f"gradient {b.name}")
                    if buf[n + 2]:
                        raise DistributedError(
                            f"gradient {b.name}{at}: the gradients of {int(buf[n + 2])} rank(s) "
                            f"failed (their batch's error is raised there); every rank skips "
                            f"this step's update of these parameters")
                    total, known = float(buf[n + 3]), int(buf[n + 4])
                    if known == size and lb and total != lb * size:
                        # unequal batches: the update's 1 / (lb * size) must give the mean
                        # over the global batch, 1 / total (equal batches: exactly 1, skipped)
                        buf[:n] *= np.dtype(dt).type(lb * size / total)
            for (_, outs, _), off, cnt, shp in zip(items, b.offsets, b.counts, b.shapes):
                res = buf[off:off + cnt].reshape(shp)
                for o in outs:
                    o._data = res if o.dtype == dt else res.astype(o.dtype)

        _backend.push_collective(run, reads, writes, b.name, b.nbytes,
                                 priority=max(p for _, _, p in items))

    # ------------------------------------------------------------------ update on the store
    def can_update(self):
        """Whether :meth:`pushpull_update` runs here: several ranks, all on one machine, the
        shared-memory path on (``HYBRIDL_DIST_SHM``)."""
        return self._st.size > 1 and bool(self._st.shm)

    def pushpull_update(self, jobs, kern, rescale, clip):
        """Sum the gradients over the ranks and apply the optimizer update, sharded: rank ``r``
        updates block ``r`` (about 1/N) of each bucket in ONE copy of the parameters, and of
        each optimizer state, in shared memory that every rank reads (``Trainer(...,
        update_on_kvstore=True)``; the sharded optimizer states of ZeRO stage 1, Rajbhandari
        et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
        with the parameters shared instead of all-gathered). Against the allreduce, each rank
        skips writing the other blocks' sums and updates 1/N of the parameters (one kernel
        call per run of parameters with the same lr, wd and update count): 0-0.5 ms (median ~0.2 ms, ~5%) less per step for the
        2.1 MB MLP of ``benchmarks/distributed.py`` on 2 ranks of the development VM.

        One engine op per bucket, pushed now, on the communication queue: it reads the
        gradients and writes the weights and the optimizer states. The gradients keep this
        rank's own values (as with MXNet's update on the kvstore). The first step, and any
        step after a weight or a state was replaced on some rank (``set_data``,
        ``load_parameters``, ``load_states``), or a weight's buffer is also held elsewhere (a
        view the update must not change), copies rank 0's weights, states and update counts
        into a free parameter window first, as the initial broadcast does (buckets under
        ``MIN_BYTES``, and buckets left without a window, sum by ``MPI_Allreduce`` or over the
        whole rows and update privately; there too rank 0's values are broadcast after a
        replacement). The weights are written in place: read them from another thread with
        :func:`hybridl.ndarray.snapshot`.

        Args:
            jobs (dict): key -> ``(grad, weight, state, lr, wd)`` for EVERY key (NDArrays, the
                Trainer's state dict ``{"t", "arrays", "var"}``, floats).
            kern: the optimizer's elementwise ``step_kernel``.
            rescale (float), clip (float or None): its gradient scale and clipping.

        Raises:
            RuntimeError: not :meth:`can_update` (one process, ranks on several machines,
                ``HYBRIDL_DIST_SHM=0``: use :meth:`pushpull` and the optimizer).
            KeyError: ``jobs`` lacks an initialized key, or has one that is not.
            TypeError: a job is not ``(grad, weight, state, lr, wd)`` with NDArrays and the
                Trainer's state dict.  ValueError: a grad or weight whose shape or dtype
                differs from the key's initialized value.
            DistributedError (at a sync point, on every rank): a rank's gradients failed or
                the layouts differ; nothing is updated.
        """
        if not self.can_update():
            raise RuntimeError("pushpull_update: needs several ranks on one machine with the "
                               "shared-memory path on (can_update() is False here); use "
                               "pushpull and apply the optimizer on each rank")
        if not isinstance(jobs, dict):
            raise TypeError(f"jobs: expected a dict key -> (grad, weight, state, lr, wd), got "
                            f"{type(jobs).__name__}")
        missing = [k for k in self._meta if k not in jobs]
        extra = [k for k in jobs if k not in self._meta]
        if missing or extra:
            raise KeyError(f"pushpull_update: jobs must hold every initialized key once: "
                           f"missing {missing}, not initialized {extra}")
        from ..ndarray import NDArray
        for k, job in jobs.items():
            ok = isinstance(job, tuple) and len(job) == 5
            if ok:
                g, w, state = job[:3]
                ok = (isinstance(g, NDArray) and isinstance(w, NDArray) and isinstance(state, dict)
                      and {"t", "arrays", "var"} <= state.keys())
            if not ok:
                raise TypeError(f"jobs[{k!r}]: expected (grad NDArray, weight NDArray, state "
                                f"dict with 't', 'arrays', 'var', lr, wd), got {job!r:.120}")
            self._check(k, [g, w], "grad/weight")
            dt = self._meta[k][1]
            if g.dtype != dt or w.dtype != dt:
                raise ValueError(f"jobs[{k!r}]: grad {g.dtype} / weight {w.dtype}, the "
                                 f"initialized value is {dt}")
        for b in self._get_plan():
            self._launch_update(b, [jobs[k] for k in b.keys], kern, rescale, clip)

    def _launch_update(self, b, items, kern, rescale, clip):
        st = self._st
        n, dt, tag, size = b.n, b.dtype, b.tag, st.size
        lb = self.local_batch
        # the tail (module docstring, 3.) and one more element: the ranks whose weights or
        # states were replaced since their last private update (see run)
        extra = np.append(_backend.tag_values(tag, "sum", dt), [0, lb or 0, 1 if lb else 0, 0])
        extra = extra.astype(dt)
        names = sorted(set().union(*(s["arrays"].keys() for _, _, s, _, _ in items)))
        for _, w, _, _, _ in items:
            w._version += 1
        reads = [g._var for g, *_ in items]
        writes = [w._var for _, w, *_ in items] + [s["var"] for _, _, s, _, _ in items]
        box = self._windows.setdefault(b.index, {})   # this bucket's parameter/state windows
        spec = (b.index, n, np.dtype(dt).str)
        if box.get("spec") != spec:
            box.clear()
            box["spec"] = spec
        at = self._at()
        opname = b.name.replace("allreduce", "update")
        box["vars"] = writes        # (for detach_shared: ordered after this update)
        box["device"] = items[0][1].device

        def bound():
            """Every weight and state is still the view of the windows it was given."""
            P = box.get("P")
            if P is None or sys.getrefcount(P) != box["refs"]:
                return False
            for (_, w, s, _, _), v, sv in zip(items, box["views"], box["sviews"]):
                if w._data is not v or any(s["arrays"].get(k) is not sv[k] for k in names):
                    return False
            return True

        def bound_private():
            """Every weight and state is still the array the last private update made."""
            last = box.get("priv")
            if last is None:
                return False
            for (_, w, s, _, _), (lw, ls) in zip(items, last):
                if w._data is not lw or s["arrays"].keys() != ls.keys() or any(
                        s["arrays"][k] is not a for k, a in ls.items()):
                    return False
            return True

        def run(comm):
            m = n + len(extra)
            failed = _backend.failed_input() is not None
            rows, adopt, r = None, False, st.node.Get_rank()
            if b.nbytes >= _shm.MIN_BYTES:  # (smaller: MPI_Allreduce and a private update)
                gpool = self._shared.get(("u",) + spec)
                if gpool is None:
                    gpool = self._shared[("u",) + spec] = SharedBuckets(st.node, st.mpi, m, dt,
                                                                        b.index)
                rows, fl = gpool.acquire(np.array([0 if bound() else 1], np.int64))
                adopt = bool(fl[0])
            if rows is None:                # no shared window: MPI_Allreduce, private update
                buf = np.empty(m, dtype=dt)
            else:
                buf = rows[r]
            lo, hi = gpool.block(n) if rows is not None else (0, 0)
            grads = [None if failed else np.asarray(g._data).reshape(-1) for g, *_ in items]

            def pack(a0, a1):               # this rank's gradients in [a0, a1) into its row
                for src, off, cnt in zip(grads, b.offsets, b.counts):
                    a, e = max(a0, off), min(a1, off + cnt)
                    if a < e:
                        buf[a:e] = 0 if src is None else src[a - off:e - off]
            # the whole row, this rank's own block too: summing that block from the gradients
            # where they lie instead (one 1/N pack saved) was 1.5-3% slower per MLP step (2
            # ranks, development VM, A/B interleaved in one job, 3 runs)
            pack(0, n)
            buf[n:] = extra
            buf[n + 2] = 1 if failed else 0
            buf[n + 5] = 0 if bound_private() else 1
            if rows is None:
                comm.Allreduce(st.mpi.IN_PLACE, buf, op=st.mpi.SUM)
                tail = buf[n:]
            else:
                gpool.sync(rows)            # every rank's gradients are in
                tail = rows[0, n:] + rows[1, n:]
                for q in range(2, size):
                    tail += rows[q, n:]
            _backend.check_tag(tail[:2], tag, "sum", size, f"gradient {opname}")
            if tail[2]:
                if rows is not None:
                    gpool.sync(rows)        # nobody writes its row again before all have read
                raise DistributedError(
                    f"gradient {opname}{at}: the gradients of {int(tail[2])} rank(s) failed "
                    f"(their batch's error is raised there); every rank skips this step's "
                    f"update of these parameters")
            total, known = float(tail[3]), int(tail[4])
            factor = lb * size / total if known == size and lb and total != lb * size else 1.0
            P = S = None
            if rows is not None and adopt:
                P, S = self._adopt(box, items, names, b, n, dt, st)
            elif rows is not None:
                P, S = box["P"], box["S"]
            if P is None:                   # no window for the parameters: each rank sums
                if rows is not None:        # and updates all of them in its own memory
                    gpool.sync(rows)        # every row whole
                    buf = rows[0] + rows[1]
                    for q in range(2, size):
                        buf += rows[q]
                    gpool.sync(rows)        # read by all before anybody writes it again
                if factor != 1.0:
                    buf[:n] *= np.dtype(dt).type(factor)
                if tail[5]:                 # replaced somewhere: rank 0's values, as at init
                    self._bcast_private(comm, items, names, b)
                self._update_private(box, items, names, b, buf, kern, rescale, clip)
                return
            if hi > lo:
                runs = []                   # [a, e, lr, wd, t]: consecutive pieces alike
                for (_, w, s, lr, wd), off, cnt in zip(items, b.offsets, b.counts):
                    a, e = max(lo, off), min(hi, off + cnt)
                    if a >= e:
                        continue
                    g = buf[a:e]                    # (= rows[r, a:e]: this rank's term)
                    if size == 2:                   # the sum in rank order
                        np.add(rows[0, a:e], rows[1, a:e], out=g)
                    else:                           # (g must not be written before it is read)
                        acc = rows[0, a:e] + rows[1, a:e]
                        for q in range(2, size):
                            acc += rows[q, a:e]
                        g[...] = acc
                    if runs and runs[-1][1] == a and runs[-1][2:] == [lr, wd, s["t"]]:
                        runs[-1][1] = e
                    else:
                        runs.append([a, e, lr, wd, s["t"]])
                if factor != 1.0:
                    buf[lo:hi] *= np.dtype(dt).type(factor)
                # the optimizer is elementwise: ONE kernel call per run of parameters with the
                # same lr, wd and update count (its Python and BLAS-call overhead, 15-45 us a
                # call while the frontend thread runs, paid once, not per small bias)
                for a, e, lr, wd, t in runs:
                    wv = P[0, a:e]
                    sl = {k: S[k][0, a:e] for k in names}
                    sd = dict(sl)
                    res = kern(wv, buf[a:e], sd, lr, wd, t + 1, rescale, clip, out=wv)
                    if res is not wv:
                        wv[...] = res
                    for k in names:             # a state the kernel replaced (SGD's first step)
                        if sd[k] is not sl[k]:
                            sl[k][...] = sd[k]
            for _, _, s, _, _ in items:
                s["t"] += 1
            gpool.sync(P, *S.values())      # every block updated before anybody reads

        # (every raise in run comes before the first write of a weight or a state: they keep
        # their values, as an update skipped for a failed gradient)
        _backend.push_collective(run, reads, writes, opname, b.nbytes, skip_clean=True)

    def _adopt(self, box, items, names, b, n, dt, st):
        """Put the bucket's weights and states in shared windows with rank 0's values (a free
        parameter window; the state windows are made once): returns (P, {name: S}), or
        (None, None) when /dev/shm has no room (collective)."""
        ppool = SharedBuckets(st.node, st.mpi, n, dt, b.index, rows=1, kind="param")
        P = ppool.acquire()
        S = dict(box.get("S") or {})
        for k in names:
            if k not in S:
                sp = SharedBuckets(st.node, st.mpi, n, dt, b.index, rows=1, kind=f"state:{k}")
                S[k] = sp.acquire()
        ok = np.array([P is not None and all(v is not None for v in S.values())], np.int64)
        st.node.Allreduce(st.mpi.IN_PLACE, ok, op=st.mpi.MIN)
        if not ok[0]:
            return None, None
        if st.node.Get_rank() == 0:
            for (_, w, s, _, _), off, cnt in zip(items, b.offsets, b.counts):
                P[0, off:off + cnt] = np.asarray(w._data).reshape(-1)
                for k in names:
                    v = s["arrays"].get(k)
                    S[k][0, off:off + cnt] = 0 if v is None else np.asarray(v).reshape(-1)
        ppool.sync(P)
        ts = np.array([s["t"] for _, _, s, _, _ in items], dtype=np.int64)
        st.node.Bcast(ts, root=0)           # rank 0's update counts go with its states
        for (_, _, s, _, _), t in zip(items, ts):
            s["t"] = int(t)
        views, sviews = [], []
        for (_, w, s, _, _), off, cnt, shp in zip(items, b.offsets, b.counts, b.shapes):
            v = P[0, off:off + cnt].reshape(shp)
            w._data = v
            sv = {k: S[k][0, off:off + cnt].reshape(shp) for k in names}
            s["arrays"].update(sv)
            views.append(v)
            sviews.append(sv)
        box.update(P=P, S=S, views=views, sviews=sviews, owners=[(w, s) for _, w, s, _, _ in items])
        box.pop("priv", None)
        # references now: this local, box, the pool's list, one per view, getrefcount's
        # argument -- the same ones bound() sees; any more: a view made elsewhere
        box["refs"] = sys.getrefcount(P)
        return P, S

    def _update_private(self, box, items, names, b, buf, kern, rescale, clip):
        """The whole update on this rank's own copies (``buf`` holds the summed gradients)."""
        for (_, w, s, lr, wd), off, cnt, shp in zip(items, b.offsets, b.counts, b.shapes):
            wv = np.array(w._data, copy=True)
            sd = {k: np.array(v, copy=True) for k, v in s["arrays"].items()}
            res = kern(wv, buf[off:off + cnt].reshape(shp), sd, lr, wd, s["t"] + 1, rescale,
                       clip, out=wv)
            w._data = res
            s["arrays"] = sd
            s["t"] += 1
        box.pop("P", None)
        box["priv"] = [(w._data, dict(s["arrays"])) for _, w, s, _, _ in items]

    def _bcast_private(self, comm, items, names, b):
        """Rank 0's weights, optimizer states and update counts into every rank's own copies
        (collective)."""
        dt = b.dtype
        flat = np.empty(b.n * (1 + len(names)), dtype=dt)
        ts = np.array([s["t"] for _, _, s, _, _ in items], dtype=np.int64)
        if comm.Get_rank() == 0:
            for j, src in enumerate(["w"] + names):
                for (_, w, s, _, _), off, cnt in zip(items, b.offsets, b.counts):
                    a = w._data if src == "w" else s["arrays"].get(src)
                    flat[j * b.n + off:j * b.n + off + cnt] = 0 if a is None else \
                        np.asarray(a).reshape(-1)
        comm.Bcast(flat, root=0)
        comm.Bcast(ts, root=0)
        for (_, w, s, _, _), off, cnt, shp, t in zip(items, b.offsets, b.counts, b.shapes, ts):
            w._data = flat[off:off + cnt].reshape(shp).copy()
            s["arrays"] = {k: flat[(j + 1) * b.n + off:(j + 1) * b.n + off + cnt].reshape(shp).copy()
                           for j, k in enumerate(names)}
            s["t"] = int(t)

    def detach_shared(self):
        """Give every weight and optimizer state that lives in a shared window a private copy
        (one engine op per bucket, after its pending updates): the Trainer calls it before
        an update outside :meth:`pushpull_update` (``grad_req='add'``, ``allreduce_grads`` +
        ``update`` by hand), which would otherwise update the ONE shared copy once per rank."""
        for box in self._windows.values():
            vs = box.get("vars")
            if not vs:
                continue

            def detach(box=box):            # (at run time: an update still pending may
                if box.get("P") is None:    # bind the windows first)
                    return
                for (w, s), v, sv in zip(box["owners"], box["views"], box["sviews"]):
                    if w._data is v:
                        w._data = np.array(v, copy=True)
                    for k, a in sv.items():
                        if s["arrays"].get(k) is a:
                            s["arrays"][k] = np.array(a, copy=True)
                for k in ("P", "S", "views", "sviews", "owners", "refs"):
                    box.pop(k, None)

            _engine.push(detach, list(vs), list(vs), box["device"], name="kv.detach_shared")
            box["vars"] = None

    # ------------------------------------------------------------------ push / pull
    def push(self, key, value, priority=0):
        """Sum ``value`` (local copies and all ranks) into the store (one collective per key;
        the Trainer uses the bucketed :meth:`pushpull`).

        Raises:
            KeyError, ValueError: as :meth:`pushpull`.
        """
        from . import allreduce
        for k, v in self._keys(key, value):
            vals = self._list(v, "value")
            self._check(k, vals, "pushed value")
            local = vals[0]
            if len(vals) > 1:
                local = self._merge_to(vals, vals[0].device, priority)
            total = allreduce(local, "sum")
            stored = self._store.get(k)
            if self._updater is not None and stored:
                for d, s in stored.items():
                    self._updater(k, total if d == total.device else total.copyto(d), s)
            else:
                self._store[k] = {total.device: total}

    def pull(self, key, out=None, priority=0):
        """Write the stored value of ``key`` (the last push, or the broadcast init value) into
        every array of ``out``.

        Raises:
            KeyError: key not initialized.  ValueError: ``out`` missing or shape mismatch.
        """
        if out is None:
            raise ValueError("kvstore.pull: out is required (the arrays to write into)")
        for k, o in self._keys(key, out):
            outs = self._list(o, "out")
            self._check(k, outs, "out")
            st = self._store[k]
            first = next(iter(st.values()))
            for a in outs:
                src = st.get(a.device, first)

                def copy(a=a, src=src):
                    a._data = np.array(src._data, dtype=a.dtype, copy=True)
                _engine.push(copy, [src._var], [a._var], ("copy", a.device), priority, "kv.pull")

    def __repr__(self):
        return (f"DistKVStore(rank={self.rank}, num_workers={self.num_workers}, "
                f"keys={len(self._meta)}, bucket_bytes={self.bucket_bytes})")

