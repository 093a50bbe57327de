"""Compiled programs: a Graph run as ONE engine op.

A :class:`Program` holds the optimized graph, the generated source and memory plan, and an
:class:`~hybridl.ops.registry.Op` whose kernel is the generated function. Applying that op to
NDArrays goes through the same eager interpreter as any op: shapes are checked in the caller's
thread, one engine op reads every input (parameters included) and writes every output.
Outputs are fresh arrays on every call (planned buffers are never returned), so a result kept
from call 1 does not change when call 2 runs.
"""
import threading

import numpy as np

from ..ndarray import NDArray, _eager_exec
from ..ops.registry import Op
from .codegen import generate
from .passes import run_passes

__all__ = ["Program", "compile_graph"]


class Program:
    """A compiled graph.

    Attributes:
        graph: the optimized Graph; source (str): generated Python; fn: the generated function
        (NumPy arrays in, a tuple of NumPy arrays out; calls are serialized when the program
        has planned buffers); memory_plan: MemoryPlan or None; op: the engine-level Op;
        in_specs / out_specs: lists of (shape, dtype); compile_seconds (float).
    """

    def __init__(self, graph, passes=None, name="program", grad=None, allow_gradient=False):
        import time
        t0 = time.perf_counter()
        self.input_graph = graph
        self.graph = run_passes(graph, passes, allow_gradient)
        self.memory_plan = getattr(self.graph, "memory_plan", None)
        self.source, self._globals, self.fn, rnd = generate(self.graph, "program")
        self.in_specs = [(tuple(s.shape), s.dtype) for s in self.graph.inputs]
        self.out_specs = [(tuple(s.shape), s.dtype) for s in self.graph.outputs]
        self.input_names = [s.node.name for s in self.graph.inputs]
        fn = self.fn
        n_out = len(self.out_specs)
        in_specs, out_specs = self.in_specs, self.out_specs
        pname = name

        def infer(*xs, **attrs):
            if len(xs) != len(in_specs):
                raise ValueError(f"{pname}: expected {len(in_specs)} inputs, got {len(xs)}")
            for i, (x, (s, d)) in enumerate(zip(xs, in_specs)):
                if tuple(x.shape) != s or x.dtype != d:
                    raise ValueError(f"{pname}: input {i} ({self.input_names[i]}) must have shape "
                                     f"{s} and dtype {d}, got {tuple(x.shape)} {x.dtype}")
            return out_specs

        lock = None
        if self.memory_plan is not None and self.memory_plan.buffers:
            # the planned buffers are this program's scratch memory: one call at a time uses
            # them (two threads, or an inline call beside a worker, may run it at once)
            lock = threading.Lock()
            plain = fn

            def fn(*arrays, **kw):
                with lock:
                    return plain(*arrays, **kw)
            self.fn = fn
        if rnd:
            def kernel(*arrays, _rng=None):
                return fn(*arrays, _rng=_rng)
        elif n_out == 1 or lock is not None:
            # the engine's kernel: the same code with the lock and the single result inside
            # (one Python call per program call instead of three)
            kernel = _variant(self.source, self._globals, lock, n_out == 1)
        else:
            kernel = fn
        flops, nbytes = _graph_cost(self.graph)

        def cost(in_shapes, out_shapes, itemsize, **attrs):    # static: the graph's own shapes
            return flops, nbytes
        self.op = Op(name, kernel, infer, grad, cost=cost, n_out=n_out, random=rnd)
        self._ckey = (self.op, self.in_specs[0][0] if self.in_specs else None,
                      out_specs[0][0] if out_specs else None)
        self.compile_seconds = time.perf_counter() - t0

    def _run_arrays(self, arrays, device, checked=False):
        """Run on NDArrays already known to be on ``device`` (the caller guarantees it): the
        fast path of a hybridized call (input shapes and dtypes checked against the program's
        unless ``checked``, output shapes the program's; no conversion). Returns a list of
        NDArrays. Users call the program itself (``__call__``), which converts and checks
        everything.

        Raises:
            ValueError: wrong number of inputs, or an input's shape or dtype differs."""
        if not checked:
            specs = self.in_specs
            if len(arrays) != len(specs):
                self.op.infer(*arrays)             # raises the descriptive error
            for a, (shp, dt) in zip(arrays, specs):
                if a.shape != shp or a.dtype != dt:
                    self.op.infer(*arrays)
        outs = [NDArray(shp, dt, device) for shp, dt in self.out_specs]
        _eager_exec(self.op, arrays, outs, self.out_specs, {}, device, self._ckey)
        return outs

    def __call__(self, /, *args, **kwargs):
        """Run on NDArrays (or NumPy arrays / numbers, converted), given in input order or
        by input name (``prog(x=..., y=...)``, the names of :attr:`input_names`, ``self``
        included); returns NDArray(s).

        Raises:
            TypeError: an unknown input name, or an input given twice or not at all.
            ValueError: wrong number of inputs; an input's shape or dtype differs from the
                program's, or its values do not fit the input's dtype."""
        from .. import nd
        from ..ops.dispatch import apply
        if kwargs:
            names = list(self.input_names)
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise TypeError(f"{self.op.name}: inputs {dup} share a name; pass the inputs "
                                f"by position (order: {names})")
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                raise TypeError(f"{self.op.name}: unknown input name(s) {unknown}; inputs: {names}")
            given = dict(zip(names, args))
            twice = [k for k in kwargs if k in given]
            if twice:
                raise TypeError(f"{self.op.name}: input(s) {twice} given by position and by name")
            given.update(kwargs)
            missing = [n for n in names if n not in given]
            if missing:
                raise TypeError(f"{self.op.name}: missing input(s) {missing}; inputs: {names}")
            args = tuple(given[n] for n in names)
        if len(args) != len(self.in_specs):
            raise ValueError(f"{self.op.name}: expected {len(self.in_specs)} inputs "
                             f"{self.input_names}, got {len(args)}")
        conv = []
        for i, (x, (s, d)) in enumerate(zip(args, self.in_specs)):
            conv.append(x if isinstance(x, nd.NDArray) else nd.array(self._convert(i, x, d)))
        if not conv:
            return self._run_constant()
        return apply(self.op, *conv)

    def _convert(self, i, x, d):
        """A NumPy array / number for input ``i`` as dtype ``d``; ValueError when that changes
        a value beyond float rounding (wrap-around into an integer type, a fraction or NaN
        into an integer, overflow to inf)."""
        a = np.asarray(x)
        if a.dtype == d:
            return a
        if a.dtype.kind not in "biuf":
            raise ValueError(f"{self.op.name}: input {i} ({self.input_names[i]}) must be numbers "
                             f"convertible to {d}, got dtype {a.dtype}")
        with np.errstate(all="ignore"):
            c = a.astype(d)
            ok = (np.isfinite(c) | ~np.isfinite(a)) if d.kind == "f" else (c.astype(a.dtype) == a)
            if d.kind == "i" and a.dtype.kind == "u":    # uint64 -> int64 wraps both ways
                ok &= c >= 0
        if not np.all(ok):
            raise ValueError(f"{self.op.name}: input {i} ({self.input_names[i]}) has values that "
                             f"{d} cannot hold (given {a.dtype}); convert it explicitly")
        return c

    def _run_constant(self):
        from .. import nd
        if self.op.random:       # no inputs but random draws: use the RNG after earlier draws
            from .. import engine as _engine
            from .. import random as _random
            _engine.wait_for(_random._ops.var)
            outs = self.fn(_rng=_random._ops.gen)
        else:
            outs = self.fn()
        res = [nd.array(np.array(o, copy=True)) for o in outs]
        return res[0] if len(res) == 1 else tuple(res)

    def __repr__(self):
        return f"Program({len(self.graph.op_nodes())} ops, {len(self.in_specs)} inputs, {len(self.out_specs)} outputs)"


def _variant(source, glob, lock, single):
    """Recompile a generated program as ``kernel`` with the body under ``with _lock:`` (when
    ``lock``) and returning its single result unpacked (when ``single``)."""
    lines = source.rstrip("\n").split("\n")
    body, ret = lines[1:-1], lines[-1]
    if single:
        ret = ret.replace("return (", "return ", 1).rstrip(")").rstrip(",")
    if lock is not None:
        glob["_lock"] = lock
        body = ["    with _lock:"] + ["    " + b for b in body]
        ret = "    " + ret
    src = "\n".join(["def kernel" + lines[0][len("def program"):]] + body + [ret]) + "\n"
    exec(compile(src, "<hybridl program kernel>", "exec"), glob)  # noqa: S102 - our own code
    return glob.pop("kernel")


def node_cost(n):
    """(flops, bytes) of one op node by its op's cost model; (0, 0) when the model fails."""
    f, b = n.op.estimate([s.shape for s in n.inputs], n.specs, n.attrs)
    return f or 0.0, b or 0.0


def _graph_cost(graph):
    """(flops, bytes) of a graph: the sum over its op nodes (what the profiler reports for a
    compiled call: GFLOP/s and the roofline bound of the whole program)."""
    costs = [node_cost(n) for n in graph.op_nodes()]
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


def compile_graph(graph, passes=None, name="program"):
    """Optimize ``graph`` with ``passes`` and generate its code; returns a :class:`Program`."""
    return Program(graph, passes, name)
