"""Graph IR: nodes, symbolic values, graphs.

A :class:`Node` is an op applied to input :class:`Symbol` s (or a leaf: a program input, a
parameter, a constant). A :class:`Symbol` is one output of a node and carries its shape and
dtype, so every value in a graph has a known shape and dtype. Symbols support the same
operators and methods as NDArray; applying an op to Symbols (through the one ``apply``, DESIGN
§2) builds nodes instead of computing. A :class:`Graph` is the set of nodes reachable from
chosen outputs, in a topological order that keeps the trace order (so random ops draw in the
same order as eager code).
"""
import itertools
import numbers
import sys

import numpy as np

from ..kernels._check import is_int
from ..ops import math as M
from ..ops.dispatch import register_interpreter
from ..ops.registry import Op

__all__ = ["Node", "Symbol", "Graph", "TracingError", "var", "const"]

_ids = itertools.count()


class TracingError(RuntimeError):
    """Python control flow or I/O that needs a traced value's *value* while tracing."""


class Node:
    """One operation (``kind == 'op'``) or a leaf (``'input'``, ``'param'``, ``'const'``).

    Attributes:
        op (Op or None), inputs (list of Symbol), attrs (dict), specs (list of (shape, dtype)),
        name (str), value (np.ndarray for constants), param (the Parameter for 'param' leaves).
    """

    __slots__ = ("id", "kind", "op", "inputs", "attrs", "specs", "name", "value", "param")

    def __init__(self, kind, op=None, inputs=(), attrs=None, specs=(), name=None, value=None,
                 param=None):
        self.id = next(_ids)
        self.kind = kind
        self.op = op
        self.inputs = list(inputs)
        self.attrs = dict(attrs or {})
        self.specs = [(tuple(s), np.dtype(d)) for s, d in specs]
        self.name = name or (op.name if op is not None else kind)
        self.value = value
        self.param = param

    def out(self, i=0):
        return Symbol(self, i)

    def outputs(self):
        return [Symbol(self, i) for i in range(len(self.specs))]

    def __repr__(self):
        return f"Node(%{self.id} {self.name})"


class Symbol:
    """A symbolic value: output ``index`` of ``node``, with ``shape`` and ``dtype``.

    Reading its value during tracing (``bool()``, ``float()``, ``int()``, ``asnumpy()``,
    ``item()``) raises :class:`TracingError` naming the user's line.
    """

    __slots__ = ("node", "index", "shape", "dtype", "__weakref__")
    __array_priority__ = 1001.0

    def __init__(self, node, index=0):
        self.node = node
        self.index = index
        self.shape, self.dtype = node.specs[index]

    @property
    def device(self):
        return None

    @property
    def name(self):
        return self.node.name

    def key(self):
        return (self.node.id, self.index)

    def __repr__(self):
        return f"Symbol(%{self.node.id}:{self.index} {self.node.name} {self.shape} {self.dtype})"

    # value access is not possible while tracing
    def _no_value(self, what):
        raise TracingError(
            f"{what} needs the value of a traced array while hybridizing, at {_user_site()}. "
            f"A compiled program cannot branch on data: use hl.nd.where(cond, a, b) for "
            f"value-dependent choices, or run this block imperatively with "
            f"net.hybridize(False) (or without @hl.jit).")

    def __bool__(self):
        self._no_value("bool()")

    def __float__(self):
        self._no_value("float()")

    def __int__(self):
        self._no_value("int()")

    def __index__(self):
        self._no_value("using a traced array as an index")

    def asnumpy(self):
        self._no_value("asnumpy()")

    def item(self):
        self._no_value("item()")

    def tolist(self):
        self._no_value("tolist()")

    def copy(self):
        return M.identity(self)

    def copyto(self, other):
        raise TracingError(
            f"copyto()/to(): a copy between devices while hybridizing, at {_user_site()}. A "
            f"compiled program runs on the device of its inputs: hybridize the blocks on each "
            f"side of the copy instead, and leave the block that moves data between devices "
            f"imperative (tensor-parallel layers, hl.parallel.transfer, SyncBatchNorm).")

    def to(self, device):
        self.copyto(device)

    as_in_device = to

    def wait_to_read(self):
        self._no_value("wait_to_read()")

    def __array__(self, *a, **k):
        self._no_value("conversion to a NumPy array")

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    __hash__ = object.__hash__

    def _assign(self, src, skip_clean=False):
        """Record a write of ``src`` into the parameter this symbol stands for (a side effect
        of the program, e.g. BatchNorm running statistics). ``skip_clean`` is NDArray's
        (a failed input leaves the parameter as it was); the compiled call always writes the
        side effects that way (see hybrid._run)."""
        from . import trace as _trace
        ctx = _trace.current_context()
        param = None
        if ctx is not None:
            param = self.node.param if self.node.kind == "param" else ctx.owner.get(self.key())
        if param is None:
            raise TracingError(f"assignment to a traced value that is not a parameter, at {_user_site()}")
        if not isinstance(src, Symbol):
            src = const(np.asarray(src, self.dtype))
        if src.shape != self.shape:
            raise ValueError(f"assign: value of shape {src.shape} does not match {self.shape}")
        ctx.side_effects.append((param, src))
        ctx.current[id(param)] = src            # later reads in this program see the write
        ctx.owner[src.key()] = param

    def __setitem__(self, key, value):
        raise TracingError(
            f"item assignment to a traced array (x[...] = v) while hybridizing, at "
            f"{_user_site()}: a compiled program computes new arrays instead; build the result "
            f"with hl.nd.where(mask, v, x) or hl.nd.concat, or run this block imperatively "
            f"with net.hybridize(False) (or without @hl.jit)")

    def _inplace(self, fn, other, sym):
        if self.node.kind in ("input", "param"):
            what = "a parameter" if self.node.kind == "param" else "an input of the traced code"
            raise TracingError(
                f"in-place update (x {sym}= ...) of {what} while hybridizing, at "
                f"{_user_site()}: run imperatively it changes the caller's array, compiled it "
                f"would not; write y = x {sym} ... (a new array) instead")
        # an intermediate value: the new array rebinds it, with eager in-place rules: the
        # shape stays, and the result is cast back to the array's dtype (NumPy 'same_kind')
        res = fn(self, other)
        if tuple(res.shape) != tuple(self.shape):
            raise ValueError(f"in-place {sym}=: the result's shape {tuple(res.shape)} differs from "
                             f"the array's {tuple(self.shape)}, at {_user_site()}")
        if res.dtype != self.dtype:
            if not np.can_cast(res.dtype, self.dtype, casting="same_kind"):
                raise TypeError(f"in-place {sym}=: cannot cast the result from {res.dtype} to the "
                                f"array's {self.dtype} (casting rule 'same_kind'), at {_user_site()}")
            res = M.cast(res, self.dtype)
        return res

    def __iadd__(self, other):
        return self._inplace(M.add, other, "+")

    def __isub__(self, other):
        return self._inplace(M.subtract, other, "-")

    def __imul__(self, other):
        return self._inplace(M.multiply, other, "*")

    def __itruediv__(self, other):
        return self._inplace(M.divide, other, "/")

    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self                     # as NDArray.astype(copy=False): the same array
        return M.cast(self, dtype)

    def attach_grad(self, *a, **k):
        raise TracingError(f"attach_grad() on a traced value, at {_user_site()}")


def _copy_methods():
    from ..ndarray import NDArray
    skip = {"__init__", "wait_to_read", "asnumpy", "item", "__array__", "__repr__", "__str__",
            "__bool__", "__float__", "__int__", "__index__", "__len__", "__iter__", "__hash__",
            "attach_grad", "backward", "detach", "copyto", "to", "as_in_device", "_assign",
            "tolist", "copy", "__deepcopy__", "__copy__",
            "__setitem__", "_inplace", "__iadd__", "__isub__", "__imul__", "__itruediv__",
            "astype", "grad", "grad_req", "zeros_like", "ones_like",
            "__slots__", "__weakref__", "__module__", "__doc__", "__array_priority__"}
    for name, val in NDArray.__dict__.items():
        if name in skip or name in Symbol.__dict__:
            continue
        if callable(val) or isinstance(val, property):
            setattr(Symbol, name, val)
    Symbol.detach = lambda self: M.stop_gradient(self)
    Symbol.zeros_like = lambda self: M.zeros_like_op(self)
    Symbol.ones_like = lambda self: M.ones_like_op(self)


def _user_site():
    """'file:line' of the innermost frame outside the hybridl package."""
    import os
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(pkg + os.sep):
            return f"{f.f_code.co_filename}:{f.f_lineno} (in {f.f_code.co_name})"
        f = f.f_back
    return "<unknown>"


# ---------------------------------------------------------------------------- leaves


def var(name, shape=None, dtype=None):
    """A symbolic program input (``hl.sym.var``).

    Args:
        name (str): the input's name (``compiled(name=value)`` or positional order).
        shape (tuple): required to compile; every value in a graph has a known shape.
        dtype: default float32.

    Raises:
        ValueError: shape missing, not integers (2.5 is not truncated), or negative.
    """
    from ..ops._util import F32, as_dtype
    if shape is None:
        raise ValueError(f"var {name!r}: shape is required (every value in a graph has a known "
                         f"shape), e.g. hl.sym.var({name!r}, shape=(32, 784))")
    if is_int(shape):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(is_int(s) for s in dims):
        raise ValueError(f"var {name!r}: shape must be a tuple of integers, got {shape!r}")
    shape = tuple(int(s) for s in dims)
    if any(s < 0 for s in shape):
        raise ValueError(f"var {name!r}: shape must be >= 0, got {shape}")
    return Node("input", specs=[(shape, as_dtype(dtype or F32))], name=name).out()


def const(value, dtype=None):
    """A constant Symbol holding a copy of ``value`` (a NumPy array or a number), taken now:
    a later change to the caller's array is not seen. Dtypes as ``hl.nd.array``: a Python
    float is float32, other floats than float32/float64 become float32, other integers than
    int32/int64 int64.

    Raises:
        TypeError: not numbers.  OverflowError: uint64 values beyond int64."""
    from ..ndarray import _supported
    a = np.array(value, dtype=dtype, copy=True)
    if a.dtype == np.float64 and dtype is None and not isinstance(value, np.ndarray):
        a = a.astype(np.float32)
    a = _supported(a, "const")
    return Node("const", specs=[(a.shape, a.dtype)], value=a, name="const").out()


# ---------------------------------------------------------------------------- interpreter


def _symbolic(op, inputs, attrs):
    """The tracing interpreter: add a node, return its output Symbol(s)."""
    from ..ndarray import NDArray, _operand_like, _scalar_value, _supported
    like = _operand_like(inputs, (Symbol, NDArray),
                         next((x.dtype for x in inputs if isinstance(x, (Symbol, NDArray))), None))
    syms = []
    for x in inputs:
        if isinstance(x, Symbol):
            syms.append(x)
        elif isinstance(x, NDArray):                  # a non-parameter array: baked in
            from . import trace as _trace
            ctx = _trace.current_context()
            if getattr(ctx, "recording", False) and (x._grad_req != "null" or x._ag is not None):
                raise TracingError(
                    f"{op.name}: an array that needs a gradient (attach_grad) is captured by "
                    f"the traced code (a closure or an attribute, not an argument), at "
                    f"{_user_site()}; a compiled program takes it as a constant, so no gradient "
                    f"would reach it: pass it as an argument, or make it a Parameter")
            syms.append(const(x.asnumpy()))
        elif isinstance(x, (numbers.Number, np.number, np.bool_)):   # as eager (ndarray._eager)
            syms.append(const(_scalar_value(x, like, op.name)))
        elif isinstance(x, np.ndarray):
            syms.append(const(_supported(x, f"{op.name}: input {len(syms)}", small_ints_32=True)))
        else:
            raise TypeError(f"{op.name}: unsupported input type {type(x).__name__}")
    specs = op.infer(*syms, **attrs)
    node = Node("op", op, syms, attrs, specs)
    if op.random:               # kept by the program even if its result is unused: it draws
        from . import trace as _trace       # from the random stream, as the eager op does
        seen = getattr(_trace.current_context(), "random_nodes", None)
        if seen is not None:
            seen.append(node)
    outs = node.outputs()
    return outs[0] if len(outs) == 1 else tuple(outs)


register_interpreter(Symbol, _symbolic, priority=1)
_copy_methods()


# ---------------------------------------------------------------------------- graph


class Graph:
    """Nodes reachable from ``outputs``, topologically ordered (trace order kept).

    Args:
        inputs (list of Symbol): the program's inputs in calling order (leaves of kind
            'input' or 'param').
        outputs (list of Symbol).
    """

    def __init__(self, inputs, outputs):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.nodes = _toposort(self.outputs, self.inputs)
        for s in self.inputs:
            if s.node.kind not in ("input", "param"):
                raise ValueError(f"Graph: input {s!r} is not a leaf")

    def op_nodes(self):
        return [n for n in self.nodes if n.kind == "op"]

    def count(self, op_name=None):
        """Number of op nodes (of one op name, if given)."""
        return sum(1 for n in self.op_nodes() if op_name is None or n.op.name == op_name)

    def __str__(self):
        lines = [f"graph({', '.join(f'%{s.node.id}:{s.node.name}{list(s.shape)}' for s in self.inputs)}) {{"]
        for n in self.nodes:
            if n.kind == "input" or n.kind == "param":
                continue
            outs = ", ".join(f"%{n.id}:{i} {list(s)} {d}" for i, (s, d) in enumerate(n.specs))
            if n.kind == "const":
                v = n.value
                desc = repr(v.item()) if v.size == 1 else f"array{list(v.shape)}"
                lines.append(f"  {outs} = const {desc}")
                continue
            ins = ", ".join(f"%{s.node.id}:{s.index}" for s in n.inputs)
            attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs.items())
            lines.append(f"  {outs} = {n.op.name}({ins}{', ' if attrs and ins else ''}{attrs})")
        lines.append(f"  return {', '.join(f'%{s.node.id}:{s.index}' for s in self.outputs)}")
        lines.append("}")
        return "\n".join(lines)

    __repr__ = __str__


def _toposort(outputs, inputs=()):
    seen = set()
    order = []
    stack = [(s.node, False) for s in reversed(outputs)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node.id in seen:
            continue
        seen.add(node.id)
        stack.append((node, True))
        for s in sorted(node.inputs, key=lambda s: -s.node.id):
            if s.node.id not in seen:
                stack.append((s.node, False))
    # a stable order: by creation id (trace order) is a valid topological order because a
    # node's inputs always exist before it
    order.sort(key=lambda n: n.id)
    extra = [s.node for s in inputs if s.node.id not in seen]
    return extra + order


def rebuild(graph, rewrite):
    """Copy ``graph`` node by node in order, calling ``rewrite(node, new_inputs)`` for each op
    node; it returns the list of new output Symbols (or None to copy the node unchanged).
    Returns the new Graph."""
    mapping = {}
    for n in graph.nodes:
        if n.kind != "op":
            for i in range(len(n.specs)):
                mapping[(n.id, i)] = Symbol(n, i)
            continue
        ins = [mapping[s.key()] for s in n.inputs]
        outs = rewrite(n, ins)
        if outs is None:
            if all(a is b or (a.node is b.node and a.index == b.index) for a, b in zip(ins, n.inputs)):
                outs = n.outputs()
            else:
                nn = Node("op", n.op, ins, n.attrs, n.specs, n.name)
                outs = nn.outputs()
        for i, o in enumerate(outs):
            mapping[(n.id, i)] = o
    return Graph(graph.inputs, [mapping[s.key()] for s in graph.outputs])


_ = Op
