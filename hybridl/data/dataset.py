"""Datasets: indexable collections of samples.

A *sample* is whatever ``dataset[i]`` returns: a single array/scalar, or a tuple of them
(e.g. ``(image, label)``). :class:`~hybridl.data.DataLoader` turns samples into batches.

Datasets that can hand out a whole batch at once (``ArrayDataset``, and an ``ArrayDataset``
transformed by a *batchable* transform from :mod:`hybridl.data.transforms`) implement the
private fast path ``_gather(indices)``: one NumPy fancy-index per array instead of a Python
loop over samples. The loader uses it automatically.

The interface follows MXNet Gluon's ``gluon.data.Dataset`` (``transform``,
``transform_first``, ``ArrayDataset``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["Dataset", "SimpleDataset", "ArrayDataset"]


def _to_numpy(obj, name="array"):
    """Return ``obj`` as a NumPy array (accepts NDArray-like objects with ``.asnumpy()``)."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "asnumpy"):
        return np.asarray(obj.asnumpy())
    try:
        return np.asarray(obj)
    except Exception as exc:  # pragma: no cover - exotic input
        raise TypeError(
            f"{name}: expected a numpy array, an NDArray or an array-like, "
            f"got {type(obj).__name__} ({exc})") from exc


def _is_batchable(fn) -> bool:
    """True if ``fn(batch)`` equals stacking ``fn(sample)`` over the batch's samples."""
    return bool(getattr(fn, "batchable", False))


class Dataset:
    """Abstract dataset: subclasses implement ``__getitem__(i)`` and ``__len__()``.

    ``__getitem__`` takes an integer index in ``[0, len(self))`` and returns one sample
    (an array/scalar or a tuple of them).
    """

    def __getitem__(self, idx):
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")

    def __len__(self):
        raise NotImplementedError(f"{type(self).__name__} must implement __len__")

    # -- fast path (private): whole-batch gather ------------------------------------------------
    def _can_gather(self) -> bool:
        """True if :meth:`_gather` is available (no per-sample Python work is needed)."""
        return False

    def _gather(self, indices):  # pragma: no cover - overridden
        """Return the batch for ``indices`` (1-D int array) as a tuple of stacked arrays."""
        raise NotImplementedError

    # -- transforms ------------------------------------------------------------------------------
    def transform(self, fn, lazy=True):
        """Return a dataset whose samples are ``fn(*sample)`` (tuple samples) or ``fn(sample)``.

        Args:
            fn: callable applied to every sample.
            lazy: if True (default) ``fn`` runs when a sample is read (each epoch, possibly in
                a loader worker thread); if False it runs now, once per sample, and the
                results are stored in a :class:`SimpleDataset`.

        If ``fn`` is *batchable* (``fn.batchable is True``, as for the classes in
        :mod:`hybridl.data.transforms`) and samples are single arrays, the loader applies
        ``fn`` once to the whole batch instead of sample by sample.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"transform: fn must be callable, got {type(fn).__name__}")
        ds = _TransformedDataset(self, fn)
        if lazy:
            return ds
        return SimpleDataset([ds[i] for i in range(len(ds))])

    def transform_first(self, fn, lazy=True):
        """Like :meth:`transform`, but ``fn`` is applied to the first element of each sample
        only (e.g. the image of ``(image, label)``); the other elements pass through.

        With a batchable ``fn`` on a gatherable dataset (e.g. ``ArrayDataset``) the fast
        whole-batch path is kept: ``fn`` runs once per batch on the gathered ``(N, ...)``
        array.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"transform_first: fn must be callable, got {type(fn).__name__}")
        ds = _TransformFirstDataset(self, fn)
        if lazy:
            return ds
        return SimpleDataset([ds[i] for i in range(len(ds))])


class SimpleDataset(Dataset):
    """Wrap any indexable sequence with a length (list, tuple, ...) as a Dataset."""

    def __init__(self, data):
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise TypeError(f"SimpleDataset: data must support len() and indexing, "
                            f"got {type(data).__name__}")
        self._data = data

    def __getitem__(self, idx):
        return self._data[idx]

    def __len__(self):
        return len(self._data)


class ArrayDataset(Dataset):
    """A dataset of one or more arrays indexed together along their first axis.

    ``ArrayDataset(X, y)[i] == (X[i], y[i])``; with a single array, ``ds[i] == X[i]``
    (as in Gluon). Batches are gathered with one fancy-index per array.

    Args:
        *arrays: NumPy arrays, NDArrays (anything with ``.asnumpy()``) or array-likes, all
            with the same length ``N`` along axis 0. They are converted to NumPy once, here
            (NDArrays are synchronised); NumPy inputs are not copied.

    Attributes:
        arrays: tuple of the NumPy arrays.

    Raises:
        ValueError: no arrays, a 0-d array, or lengths that differ.
    """

    def __init__(self, *arrays):
        if not arrays:
            raise ValueError("ArrayDataset: expected at least one array, got none")
        conv = []
        for k, a in enumerate(arrays):
            a = _to_numpy(a, name=f"ArrayDataset: arrays[{k}]")
            if a.ndim == 0:
                raise ValueError(f"ArrayDataset: arrays[{k}] must have at least 1 dimension "
                                 f"(samples along axis 0), got a 0-d array")
            conv.append(a)
        lengths = [len(a) for a in conv]
        if len(set(lengths)) != 1:
            raise ValueError(f"ArrayDataset: all arrays must have the same length along axis 0, "
                             f"got lengths {lengths} (shapes {[a.shape for a in conv]})")
        self.arrays = tuple(conv)
        self._length = lengths[0]

    def __getitem__(self, idx):
        if len(self.arrays) == 1:
            return self.arrays[0][idx]
        return tuple(a[idx] for a in self.arrays)

    def __len__(self):
        return self._length

    def _can_gather(self):
        # a subclass that overrides __getitem__ changes what a sample is: the loader must call
        # it per sample rather than index the arrays directly
        return type(self).__getitem__ is ArrayDataset.__getitem__

    def _gather(self, indices):
        return tuple(a[indices] for a in self.arrays)

    def __repr__(self):
        shapes = ", ".join(f"{a.shape} {a.dtype}" for a in self.arrays)
        return f"{type(self).__name__}(len={self._length}: {shapes})"


class _TransformedDataset(Dataset):
    """Lazily applies ``fn`` to every sample of ``base`` (see :meth:`Dataset.transform`)."""

    def __init__(self, base, fn):
        self._base, self._fn = base, fn

    def __len__(self):
        return len(self._base)

    def __getitem__(self, idx):
        item = self._base[idx]
        if isinstance(item, tuple):
            return self._fn(*item)
        return self._fn(item)

    def _can_gather(self):
        # Whole-batch application is only equivalent for single-array samples: fn takes one
        # argument that may carry a leading batch axis.
        if not (_is_batchable(self._fn) and self._base._can_gather()):
            return False
        arrays = getattr(self._base, "arrays", None)
        return arrays is not None and len(arrays) == 1

    def _gather(self, indices):
        (batch,) = self._base._gather(indices)
        out = self._fn(batch)
        return out if isinstance(out, tuple) else (out,)


class _TransformFirstDataset(_TransformedDataset):
    """Lazily applies ``fn`` to the first element of each sample of ``base``."""

    def __getitem__(self, idx):
        item = self._base[idx]
        if isinstance(item, tuple):
            return (self._fn(item[0]),) + tuple(item[1:])
        return self._fn(item)

    def _can_gather(self):
        return _is_batchable(self._fn) and self._base._can_gather()

    def _gather(self, indices):
        first, *rest = self._base._gather(indices)
        return (self._fn(first),) + tuple(rest)
