"""Vectorized data transforms.

Every transform here is *batchable*: applied to one sample ``(C, H, W)`` or to a whole batch
``(N, C, H, W)`` it gives the same values per sample, so the loader applies it once per batch
(one NumPy expression over ``N`` samples) when the dataset allows it
(``ArrayDataset(...).transform_first(t)``). Transforms work on NumPy arrays (and on objects
with ``.asnumpy()``) and return NumPy arrays.

Use them with :meth:`hybridl.data.Dataset.transform_first`::

    t = Compose([ToFloat(), Normalize(0.1307, 0.3081)])
    ds = ArrayDataset(images_uint8, labels).transform_first(t)
"""

from __future__ import annotations

import numpy as np

from .dataset import _to_numpy

__all__ = ["Transform", "ToFloat", "Normalize", "Compose"]


class Transform:
    """Base class. A subclass that sets ``batchable = True`` promises
    ``t(batch)[i] == t(batch[i])``, and the DataLoader may then apply it to a whole batch at
    once; the default (False) applies it to each sample, which is always correct."""

    batchable = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # a subclass that redefines __call__ without saying batchable=True itself makes no
        # promise about batches, even when it extends a batchable transform (ToFloat)
        if "__call__" in cls.__dict__ and "batchable" not in cls.__dict__:
            cls.batchable = False

    def __call__(self, x):  # pragma: no cover - abstract
        raise NotImplementedError


class ToFloat(Transform):
    """Cast to float32 and multiply by ``scale``: ``x.astype(float32) * scale``.

    Args:
        scale: multiplier (default ``1/255``, mapping uint8 pixels 0..255 to [0, 1]).

    Input: any shape, any real dtype. Output: same shape, float32.
    """

    batchable = True

    def __init__(self, scale=1.0 / 255.0):
        try:
            self.scale = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"ToFloat: scale must be a number, got {scale!r}") from None
        if not np.isfinite(self.scale):
            raise ValueError(f"ToFloat: scale must be finite, got {scale!r}")

    def __call__(self, x):
        x = np.asarray(_to_numpy(x), dtype=np.float32)
        if self.scale != 1.0:
            x = x * np.float32(self.scale)
        return x

    def __repr__(self):
        return f"ToFloat(scale={self.scale!r})"


class Normalize(Transform):
    """Per-channel standardisation ``(x - mean) / std`` for images in CHW / NCHW layout.

    Args:
        mean: scalar or sequence of length ``C`` (one value per channel).
        std: scalar or sequence of length ``C``; every value must be > 0.

    Input: ``(C, H, W)`` or ``(N, C, H, W)`` (with scalar mean/std: any shape); float.
    Output: same shape, float32.

    Per-channel values are reshaped to ``(C, 1, 1)``, which broadcasts over both a single
    image and a batch — that is what makes this transform batchable.

    Raises:
        ValueError: ``std`` has a value <= 0, mean/std lengths differ, or (at call time) the
            channel axis of the input does not have ``C`` entries.
    """

    batchable = True

    def __init__(self, mean, std):
        try:
            mean = np.asarray(mean, dtype=np.float32)
            std = np.asarray(std, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"Normalize: mean and std must be numbers or sequences of numbers, "
                             f"got mean={mean!r}, std={std!r}") from None
        if mean.ndim > 1 or std.ndim > 1:
            raise ValueError(f"Normalize: mean and std must be scalars or 1-D (one per channel), "
                             f"got shapes {mean.shape} and {std.shape}")
        mean, std = mean.reshape(-1), std.reshape(-1)
        if mean.size == 0 or std.size == 0:
            raise ValueError(f"Normalize: mean and std must be non-empty, got mean={mean}, std={std}")
        if mean.size != std.size and 1 not in (mean.size, std.size):
            raise ValueError(f"Normalize: mean and std must have the same length (one per channel), "
                             f"got len(mean)={mean.size}, len(std)={std.size}")
        if not np.all(np.isfinite(mean)):
            raise ValueError(f"Normalize: mean must be finite, got {mean.tolist()}")
        with np.errstate(over="ignore", divide="ignore"):
            inv = 1.0 / std
        if not (np.all(std > 0) and np.all(np.isfinite(std)) and np.all(np.isfinite(inv))):
            raise ValueError(f"Normalize: std must be finite and > 0 (with a finite 1/std in "
                             f"float32), got {std.tolist()}")
        self.channels = max(mean.size, std.size)
        self.mean = mean.reshape(-1, 1, 1) if mean.size > 1 else mean.reshape(())
        self.inv_std = (1.0 / std).astype(np.float32)
        self.inv_std = self.inv_std.reshape(-1, 1, 1) if std.size > 1 else self.inv_std.reshape(())

    def __call__(self, x):
        x = np.asarray(_to_numpy(x), dtype=np.float32)
        if self.channels > 1 and (x.ndim < 3 or x.shape[-3] != self.channels):
            raise ValueError(f"Normalize: expected input (C, H, W) or (N, C, H, W) with "
                             f"C={self.channels}, got shape {x.shape}")
        return (x - self.mean) * self.inv_std

    def __repr__(self):
        return f"Normalize(mean={self.mean.ravel().tolist()}, std={(1 / self.inv_std).ravel().tolist()})"


class Compose(Transform):
    """Apply ``transforms`` in order. Batchable iff every member is batchable.

    Raises:
        TypeError: a member is not callable.
    """

    def __init__(self, transforms):
        transforms = list(transforms)
        for k, t in enumerate(transforms):
            if not callable(t):
                raise TypeError(f"Compose: transforms[{k}] must be callable, got {type(t).__name__}")
        self.transforms = transforms
        self.batchable = all(getattr(t, "batchable", False) for t in transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self):
        return f"Compose({self.transforms!r})"
