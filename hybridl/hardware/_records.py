"""Record types shared by the hardware probe and the microbenchmarks.

Every microbenchmark returns a :class:`Measurement`: one figure (``value`` in ``unit``), the
``method`` used to obtain it, the ``settings`` it ran with, the raw per-repetition ``samples``
(same unit) and free-form ``details`` (for example the whole latency curve).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measurement:
    """One measured figure.

    Attributes:
        name: what was measured, e.g. ``"stream_triad"``, ``"gemm_fp32"``.
        value: the figure in ``unit`` (median of ``samples`` unless the method says otherwise);
            ``None`` when it could not be measured (``details["error"]`` says why).
        unit: ``"GB/s"`` (10**9 bytes per second), ``"MB/s"`` (10**6 bytes/s), ``"ns"``,
            ``"us"``, ``"GFLOP/s"``, ``"IOPS"``.
        method: how it was measured, in words (algorithm, byte counting, cache bypass, ...).
        settings: the parameters it ran with (sizes in bytes, thread counts, repeats, ...).
        samples: the per-repetition values, in ``unit``.
        details: anything else (curves, detected cache levels, errors).
    """

    name: str
    value: float | None
    unit: str
    method: str
    settings: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict (keys: name, value, unit, method, settings,
        samples, details)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def __str__(self) -> str:
        v = "n/a" if self.value is None else f"{self.value:.4g}"
        return f"{self.name}: {v} {self.unit} ({self.method})"


def median(xs) -> float:
    """Median of a non-empty sequence of numbers."""
    return float(statistics.median(xs))


def _jsonable(x: Any) -> Any:
    """Convert numpy scalars/arrays, tuples and non-finite floats into plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return _jsonable(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if dataclasses.is_dataclass(x):
        return _jsonable(dataclasses.asdict(x))
    return str(x)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Return ``value`` as int; raise ValueError naming ``name`` unless it is an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        hasattr(value, "__index__")
    ):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_positive_float(name: str, value) -> float:
    """Return ``value`` as float; raise ValueError naming ``name`` unless it is finite and > 0."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return f
