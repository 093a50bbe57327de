"""``apply(op, *inputs, **attrs)``: one entry point, several interpreters (DESIGN §2).

Each frontend value type (NDArray for eager execution, the tracer of :mod:`hybridl.graph` while
hybridizing) registers an *interpreter*: a function ``interp(op, inputs, attrs)``. ``apply``
picks the interpreter of the first input that has one; Python scalars and NumPy arrays among the
inputs are passed through for the interpreter to turn into constants of its own kind.
"""
__all__ = ["apply", "register_interpreter"]

_INTERP = {}       # frontend value class -> interpreter function
_PRIO = {}         # frontend value class -> priority (traced values beat NDArrays)
_BASE = [None, None]   # the priority-0 class and its interpreter: the all-NDArray fast path


def register_interpreter(cls, fn, priority=0):
    """Use ``fn(op, inputs, attrs)`` for ops whose inputs include instances of ``cls``; when
    inputs of several kinds are mixed, the kind with the highest ``priority`` decides."""
    _INTERP[cls] = fn
    _PRIO[cls] = priority
    if priority == 0:
        _BASE[0], _BASE[1] = cls, fn


def apply(op, *inputs, **attrs):
    """Apply ``op`` to ``inputs`` with the interpreter their type selects.

    Raises:
        TypeError: no input is a frontend value (NDArray or traced value).
    """
    base = _BASE[0]
    for x in inputs:                # the common case: every input of the base kind (NDArray)
        if type(x) is not base:
            break
    else:
        if inputs:
            return _BASE[1](op, inputs, attrs)
    best, prio = None, -1
    for x in inputs:
        t = type(x)
        f = _INTERP.get(t)
        if f is not None and _PRIO[t] > prio:
            best, prio = f, _PRIO[t]
    if best is not None:
        return best(op, inputs, attrs)
    for x in inputs:     # subclasses
        for cls, f in _INTERP.items():
            if isinstance(x, cls):
                return f(op, inputs, attrs)
    raise TypeError(f"{op.name}: expected at least one NDArray (or traced value) among the "
                    f"inputs, got {[type(x).__name__ for x in inputs]}")
