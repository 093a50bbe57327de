"""Logical devices.

``hl.cpu(i)`` names a *logical* CPU device (as in MXNet): each has its own engine worker
thread(s) and ready queue, so independent work on ``cpu(0)`` and ``cpu(1)`` runs at the same
time. All CPU devices share the host memory; moving an array between them is still an explicit,
asynchronous copy (``x.copyto(hl.cpu(1))``) so that the programming model is the one of real
accelerators.
"""
import threading

__all__ = ["Device", "cpu", "current_device"]


class Device:
    """A logical device: ``Device('cpu', 0)`` (also written ``hl.cpu(0)`` or ``'cpu:0'``).

    There is one Device object per ``(device_type, device_id)``, so devices compare and hash
    by identity. Used as a context manager it sets
    the default device for array creation in this thread::

        with hl.cpu(1):
            x = hl.nd.zeros((2, 3))      # x.device == cpu(1)

    Raises:
        ValueError: ``device_type`` is not ``'cpu'`` or ``device_id`` is not an integer >= 0.
    """

    __slots__ = ("device_type", "device_id", "_key")
    _types = ("cpu",)
    _interned = {}

    def __new__(cls, device_type="cpu", device_id=0):
        # one object per device: equality and hashing are then the identity's (C-level, as
        # fast as they get; devices are dictionary keys on every hot path)
        if device_type not in cls._types:
            raise ValueError(f"device_type: expected one of {cls._types}, got {device_type!r}")
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id: expected an integer >= 0, got {device_id!r}")
        key = (device_type, int(device_id))
        d = cls._interned.get(key)
        if d is None:
            d = object.__new__(cls)
            for name, v in (("device_type", device_type), ("device_id", int(device_id)), ("_key", key)):
                object.__setattr__(d, name, v)
            d = cls._interned.setdefault(key, d)
        return d

    def __setattr__(self, name, value):
        raise AttributeError(f"Device is immutable (one object per device, shared): cannot set "
                             f"{name!r}; use hl.cpu(i) or Device('cpu', i) for another device")

    def __reduce__(self):
        return (Device, self._key)

    @staticmethod
    def parse(spec):
        """Parse ``'cpu'``, ``'cpu:1'``, ``'cpu(1)'`` or a Device into a Device.

        Raises:
            ValueError: the string is not of one of those forms.
        """
        if isinstance(spec, Device):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"device: expected a Device or a string like 'cpu:0', got {spec!r}")
        s = spec.strip().lower().replace("(", ":").rstrip(")")
        kind, _, idx = s.partition(":")
        if kind not in Device._types or (idx and not idx.isdigit()):
            raise ValueError(f"device: expected a string like 'cpu:0', got {spec!r}")
        return Device(kind, int(idx) if idx else 0)

    def __repr__(self):
        return f"{self.device_type}({self.device_id})"

    def __str__(self):
        return f"{self.device_type}:{self.device_id}"

    def __enter__(self):
        stack = _state.__dict__.setdefault("stack", [])
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _state.stack.pop()
        return False


_state = threading.local()
_CPU_CACHE = {}


def cpu(device_id=0):
    """The logical CPU device number ``device_id`` (``hl.cpu()`` is ``cpu(0)``)."""
    d = _CPU_CACHE.get(device_id) if type(device_id) is int else None   # True == 1, 9.0 == 9
    if d is None:
        d = _CPU_CACHE[device_id] = Device("cpu", device_id)
    return d


def current_device():
    """The default device of this thread: the innermost ``with device:`` block, else ``cpu(0)``."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else cpu(0)
