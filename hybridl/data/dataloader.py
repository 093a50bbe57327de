"""DataLoader: batches, shuffling, sharding and background prefetch.

Sample order (per epoch ``e``, documented so that every rank / run can reproduce it):

1. ``order = np.random.default_rng([seed, e]).permutation(N)`` if ``shuffle`` else
   ``np.arange(N)``. ``N = len(dataset)``. The permutation does not touch any global RNG.
2. Sharding (``num_shards = S``, ``shard_index = r``): ``m = N // S`` and rank ``r`` takes the
   *contiguous* slice ``order[r*m : (r+1)*m]``. The last ``N - S*m`` entries of ``order`` are
   dropped so every rank sees the same number of samples (ranks stay in lockstep). All ranks
   must use the same ``seed`` so the shards are disjoint.
3. Batching of the shard's ``m`` indices by ``batch_size = B``, according to ``last_batch``:
   ``'keep'`` (last batch may be smaller), ``'discard'`` (drop it), ``'rollover'`` (the
   leftover indices are put in front of the next epoch's indices, as in MXNet Gluon).

With ``num_workers > 0`` a thread pool loads up to ``prefetch`` batches ahead of the consumer
(NumPy releases the GIL in the copies), and batches are handed out in order, so output is
identical for every ``num_workers`` -- provided the dataset's ``__getitem__`` (and its lazy
transforms) are thread-safe: workers are threads that call it concurrently.
"""

from __future__ import annotations

import atexit
import collections
import numbers
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["DataLoader", "default_batchify_fn"]

_LAST_BATCH = ("keep", "discard", "rollover")


def _check_int(name, value, minimum, maximum=None, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"DataLoader: {name} must be an integer, got {value!r} "
                         f"({type(value).__name__})")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"DataLoader: {name} must be {rng}, got {value}")
    return value


def default_batchify_fn(samples):
    """Stack a list of samples into a batch: a tuple of NumPy arrays (or a dict).

    Each sample is an array/scalar, a tuple/list of fields, or a dict; field ``k`` of the
    batch is ``np.stack([s[k] for s in samples])`` (shape ``(len(samples),) + field_shape``,
    dtype as NumPy's stacking gives; Python ints become int64, floats float64). Fields that
    are tuples or dicts are batched the same way, recursively (a dict sample gives a dict
    batch with its keys); a list inside a sample is one array field (``[0.1, 0.2, 0.3]``
    -> shape (N, 3)), as in MXNet Gluon.

    Raises:
        ValueError: samples have different numbers of fields, different keys, or different
            field shapes (the message gives the field's path, e.g. ``['x'][1]``).
    """
    if isinstance(samples[0], list):        # a sample given as a list: its fields
        samples = [tuple(s) if isinstance(s, list) else s for s in samples]
    out = _collate(samples, "")
    return out if isinstance(out, (tuple, dict)) else (out,)


def _collate(samples, path):
    first = samples[0]
    if isinstance(first, dict):
        keys = list(first)
        for s in samples:
            if not isinstance(s, dict) or set(s) != set(keys):
                raise ValueError(f"batchify: every sample{path} must be a dict with the keys "
                                 f"{sorted(keys, key=str)} like the first one, got "
                                 f"{type(s).__name__} "
                                 f"{sorted(s, key=str) if isinstance(s, dict) else ''}")
        return {k: _collate([s[k] for s in samples], f"{path}[{k!r}]") for k in keys}
    if isinstance(first, tuple):
        nfields = len(first)
        for s in samples:
            if not isinstance(s, tuple) or len(s) != nfields:
                raise ValueError(f"batchify: every sample{path} must have {nfields} fields like "
                                 f"the first one, got {type(s).__name__} of length "
                                 f"{len(s) if hasattr(s, '__len__') else '?'}")
        return tuple(_collate([s[k] for s in samples], f"{path}[{k}]") for k in range(nfields))
    f = [np.asarray(x.asnumpy()) if hasattr(x, "asnumpy") else x for x in samples]
    try:
        return np.stack(f)
    except ValueError as exc:
        shapes = sorted({np.shape(x) for x in f})
        where = f"field {path}" if path else "the samples"
        raise ValueError(f"batchify: {where} has different shapes {shapes[:4]}; cannot stack "
                         f"({exc})") from exc


def _draw_seed():
    """A fresh non-negative seed from hybridl's global RNG if present, else NumPy's global."""
    try:
        from hybridl import random as hl_random  # lazy: optional, higher-level module
    except Exception:
        hl_random = None
    if hl_random is not None:
        randint = getattr(hl_random, "randint", None)
        if callable(randint):  # hl.random.randint(low, high, shape) -> NDArray (synchronised here)
            try:
                r = randint(0, 2 ** 31 - 1, shape=(1,))
                r = r.asnumpy() if hasattr(r, "asnumpy") else r
                return int(np.asarray(r).ravel()[0])
            except Exception:
                pass
        for name in ("draw_seed", "next_seed", "new_seed"):
            fn = getattr(hl_random, name, None)
            if callable(fn):
                try:
                    return int(fn()) % (2 ** 63)
                except Exception:
                    pass
        for name in ("get_rng", "get_generator", "generator", "host_rng"):
            fn = getattr(hl_random, name, None)
            if callable(fn):
                try:
                    g = fn()
                    return int(g.integers(0, 2 ** 63 - 1))
                except Exception:
                    pass
    return int(np.random.randint(0, 2 ** 31 - 1))


_LIVE_STOPS = weakref.WeakSet()      # the stop Events of iterations under way


def _stop_all_at_exit():
    """At interpreter exit, before the worker threads are joined: stop every loading still
    under way. An iterator kept but not finished (``it = iter(loader); next(it)`` as a
    script's last use) never runs its ``finally``, so its workers went on loading the batches
    in flight, which delayed the exit by that long."""
    for stop in list(_LIVE_STOPS):
        stop.set()


# (threading's exit hooks run before the executor's, which joins its threads; atexit's after)
getattr(threading, "_register_atexit", atexit.register)(_stop_all_at_exit)


class _Batches:
    """An epoch's batches of indices: slices of the epoch's index array, made as they are
    read (a list of them cost 4 s and 1.4 GB before the first batch for 10^7 samples in
    batches of 1)."""

    __slots__ = ("idx", "b", "n")

    def __init__(self, idx, b, n):
        self.idx, self.b, self.n = idx, b, n

    def __len__(self):
        return self.n

    def __iter__(self):
        idx, b = self.idx, self.b
        for i in range(self.n):
            yield idx[i * b:(i + 1) * b]


class DataLoader:
    """Iterate over a dataset in batches of NDArrays.

    Args:
        dataset: a :class:`~hybridl.data.Dataset` (or anything with ``len`` and integer
            indexing).
        batch_size (int > 0): samples per batch.
        shuffle (bool): shuffle every epoch (see module docstring for the exact order).
        last_batch: ``'keep'`` | ``'discard'`` | ``'rollover'``.
        num_workers (int >= 0): background loader *threads* (not processes, unlike
            PyTorch's workers); 0 loads in the caller's thread. ``None`` reads
            ``$HYBRIDL_LOADER_WORKERS`` (default 0; not ``HYBRIDL_NUM_WORKERS``, the
            engine's worker threads per device). With workers, the dataset's
            ``__getitem__`` and its lazy transforms run in several threads at once, so they
            must be thread-safe (a shared file handle that is seeked and read is not: open one
            per thread, or read under a lock); the batches are then identical for every
            ``num_workers``, unless ``__getitem__`` draws random numbers from a shared
            generator (``np.random``'s global state, ``random``): its samples then take the
            draws in whatever order the threads run. For random augmentation that does not
            depend on the worker count, seed a generator per sample, e.g.
            ``np.random.default_rng([seed, epoch, index])``.
        seed (int >= 0 or None): shuffle seed; epoch ``e`` uses
            ``np.random.default_rng([seed, e]).permutation(N)``. ``None`` with ``shuffle=True``
            draws one seed at construction with ``hybridl.random.randint`` (so
            ``hl.random.seed(n)`` makes it reproducible; NumPy's global RNG if
            ``hybridl.random`` is unavailable); without shuffling nothing is drawn (seed 0).
        num_shards (int >= 1), shard_index (int in [0, num_shards)): distributed sharding,
            contiguous slices of the permutation, remainder dropped (see module docstring).
        prefetch (int >= 0; >= 1 if num_workers > 0): batches loaded ahead of the consumer
            (in flight or ready); each worker loads whole batches, so at most
            ``min(num_workers, prefetch)`` workers are busy at once. Ignored when
            ``num_workers == 0``.
        batchify_fn: ``fn(list_of_samples) -> array, tuple of arrays or dict of arrays``;
            default :func:`default_batchify_fn`. Giving one disables the whole-batch fast
            path.
        device: device of the produced NDArrays (passed to ``hybridl.ndarray.array``).

    Yields:
        tuple of ``hybridl.ndarray.NDArray``, one per sample field, each of shape
        ``(batch, ...)`` (a field that is a tuple or dict in the samples is a tuple or dict of
        NDArrays); a dict of NDArrays when the samples are dicts. Each array in the dtype
        ``hl.nd.array`` gives it: float32/float64/int32/int64/bool kept, other floats as
        float32 and other integers as int64 (so raw uint8 images come out int64: convert
        them to float32 in the dataset or with ``transforms.ToFloat``).

    Fast path: for an ``ArrayDataset`` (optionally ``.transform_first`` / ``.transform``
    with a batchable transform) a batch is one fancy-index per array, no per-sample loop.

    ``len(loader)`` is the number of batches the next epoch yields (for ``'rollover'`` it
    depends on the leftover of the previous epoch).

    Raises:
        ValueError: an argument is out of range (message names it, the expected and the given
            value).
        TypeError: ``dataset`` has no ``len``/indexing or ``batchify_fn`` is not callable.
    """

    def __init__(self, dataset, batch_size, shuffle=False, last_batch="keep", num_workers=0,
                 seed=None, num_shards=1, shard_index=0, prefetch=2, batchify_fn=None,
                 device=None):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"DataLoader: dataset must support len() and indexing, "
                            f"got {type(dataset).__name__}")
        self.batch_size = _check_int("batch_size", batch_size, 1)
        if not isinstance(last_batch, str) or last_batch not in _LAST_BATCH:
            raise ValueError(f"DataLoader: last_batch must be one of {_LAST_BATCH}, "
                             f"got {last_batch!r}")
        if num_workers is None:
            from .._env import env_int
            num_workers = env_int("HYBRIDL_LOADER_WORKERS", 0, 0, "DataLoader threads")
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.num_shards = _check_int("num_shards", num_shards, 1)
        if 0 < len(dataset) < self.num_shards:
            raise ValueError(f"DataLoader: num_shards must be at most the dataset's "
                             f"{len(dataset)} samples (every shard would be empty), got "
                             f"{self.num_shards}")
        self.shard_index = _check_int("shard_index", shard_index, 0, self.num_shards - 1)
        self.prefetch = _check_int("prefetch", prefetch, 1 if self.num_workers > 0 else 0)
        if batchify_fn is not None and not callable(batchify_fn):
            raise TypeError(f"DataLoader: batchify_fn must be callable or None, "
                            f"got {type(batchify_fn).__name__}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise ValueError(f"DataLoader: shuffle must be a bool, got {shuffle!r}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.last_batch = last_batch
        self.batchify_fn = batchify_fn
        if device is not None:          # a bad device is an error here, not at the first batch
            from hybridl.device import Device  # lazy: hybridl.device sits above data's deps
            try:
                Device.parse(device)
            except (ValueError, TypeError) as e:
                raise type(e)(f"DataLoader: {e}") from None
        self.device = device
        if seed is None:
            if self.shuffle and self.num_shards > 1:
                warnings.warn("DataLoader: shuffle with num_shards > 1 and seed=None; pass the "
                              "same seed on every rank or shards may overlap", stacklevel=2)
            # drawn only when it is used: an unshuffled loader leaves the global RNG alone
            # (building a test loader between hl.random.seed and initialize changed the weights)
            seed = _draw_seed() if self.shuffle else 0
        self.seed = _check_int("seed", seed, 0)
        self.epoch = 0
        self._leftover = np.empty(0, dtype=np.int64)
        can_gather = getattr(dataset, "_can_gather", None)
        self._fast = batchify_fn is None and callable(can_gather) and bool(can_gather())

    # -- order -----------------------------------------------------------------------------------
    def set_epoch(self, epoch):
        """Set the epoch number used by the next iteration (the permutation depends on it)."""
        self.epoch = _check_int("epoch", epoch, 0)

    def _shard_len(self):
        return len(self.dataset) // self.num_shards

    def epoch_indices(self, epoch=None):
        """The shard's sample indices for ``epoch`` (default: the next one), before batching.

        Returns: int64 array of length ``len(dataset) // num_shards``.
        """
        e = self.epoch if epoch is None else epoch
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng([self.seed, e]).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        m = n // self.num_shards
        return np.asarray(order[self.shard_index * m:(self.shard_index + 1) * m], dtype=np.int64)

    def __len__(self):
        m, b = self._shard_len(), self.batch_size
        if self.last_batch == "keep":
            return -(-m // b)
        if self.last_batch == "discard":
            return m // b
        return (len(self._leftover) + m) // b

    def _plan(self):
        """Batches of indices for the next epoch; advances epoch and rollover state."""
        idx = self.epoch_indices()
        b = self.batch_size
        if self.last_batch == "rollover":
            idx = np.concatenate([self._leftover, idx])
        nfull = len(idx) // b
        rest = idx[nfull * b:]
        n = nfull + (1 if self.last_batch == "keep" and len(rest) else 0)
        if self.last_batch == "rollover":
            self._leftover = rest.copy()
        self.epoch += 1
        return _Batches(idx, b, n)

    # -- loading ---------------------------------------------------------------------------------
    def _load(self, indices, stop=None):
        """Load one batch as a tuple of NumPy arrays (runs in a worker thread if any).
        ``stop``: an Event set when the consumer has left the loop; a worker then stops
        between samples instead of finishing a batch nobody will read (which kept the
        process from exiting until every started batch was loaded)."""
        if self._fast:
            return tuple(self.dataset._gather(indices))
        samples = []
        for i in indices:
            if stop is not None and stop.is_set():
                return None
            try:
                samples.append(self.dataset[int(i)])
            except Exception as e:
                if hasattr(e, "add_note"):  # (Python 3.11+) which sample, the type unchanged
                    e.add_note(f"(DataLoader: loading sample {int(i)} of the dataset)")
                raise
        fn = self.batchify_fn or default_batchify_fn
        out = fn(samples)
        if isinstance(out, dict):
            return out
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _to_ndarray(self, batch):
        from hybridl.ndarray import array  # lazy: hybridl.ndarray sits above data's deps
        from hybridl.device import Device as _D

        def _device(d):
            return _D.parse(d)
        def convert(a):
            if hasattr(a, "asnumpy"):  # already an NDArray: on the loader's device
                return (a if self.device is None or a.device == _device(self.device)
                        else a.copyto(_device(self.device)))
            b = a if isinstance(a, (np.ndarray, np.generic)) else np.asarray(a)
            if b.dtype.kind not in "biuf":
                raise TypeError(f"DataLoader: a batch field holds {type(a).__name__} of dtype "
                                f"{b.dtype}, expected numbers: samples must be arrays or "
                                f"numbers (or give a batchify_fn that returns arrays)")
            return array(b, device=self.device)
        def walk(a):                # nested tuples and dicts of arrays (see default_batchify_fn)
            if isinstance(a, dict):
                return {k: walk(v) for k, v in a.items()}
            if isinstance(a, tuple):
                return tuple(walk(v) for v in a)
            return convert(a)
        return walk(batch) if isinstance(batch, dict) else tuple(walk(a) for a in batch)

    def _iter_numpy(self, batches):
        if self.num_workers == 0 or not batches:
            for bidx in batches:
                yield self._load(bidx)
            return
        pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="hybridl-data")
        pending = collections.deque()
        stop = threading.Event()
        _LIVE_STOPS.add(stop)
        it = iter(batches)

        def submit(bidx):
            if not stop.is_set():
                try:
                    return bidx, pool.submit(self._load, bidx, stop)
                except RuntimeError:    # the main thread has ended: the executor takes no more
                    pass
            return bidx, None
        try:
            for bidx in it:
                pending.append(submit(bidx))
                if len(pending) >= self.prefetch:
                    break
            while pending:
                bidx, fut = pending.popleft()
                batch = fut.result() if fut is not None else None
                if batch is None:
                    # not loaded by a worker: the main thread ended (the exit hook stopped the
                    # workers) while this thread, still alive, goes on iterating: load it here
                    batch = self._load(bidx)
                nxt = next(it, None)  # keep `prefetch` batches in flight while the consumer works
                if nxt is not None:
                    pending.append(submit(nxt))
                yield batch
        finally:
            stop.set()
            for _, f in pending:
                if f is not None:
                    f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def __iter__(self):
        batches = self._plan()  # eager: epoch/rollover state advance when iteration starts
        return self._gen(batches)

    def _gen(self, batches):
        for batch in self._iter_numpy(batches):
            yield self._to_ndarray(batch)

    def __repr__(self):
        return (f"DataLoader(len(dataset)={len(self.dataset)}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, last_batch={self.last_batch!r}, "
                f"num_workers={self.num_workers}, num_shards={self.num_shards}, "
                f"shard_index={self.shard_index}, seed={self.seed}, fast_path={self._fast})")
