"""The operator registry: every op is defined once.

An :class:`Op` bundles (DESIGN §2, after JAX's primitives and CMU needle's compute/gradient pairs):

* ``infer(*inputs, **attrs) -> [(shape, dtype), ...]`` — runs in the caller's thread on anything
  with ``.shape`` and ``.dtype``; raises ``ValueError``/``TypeError`` naming the op and shapes;
* ``kernel(*arrays, **attrs) -> array | tuple`` — NumPy computation on backend arrays; must return
  arrays of exactly the inferred shapes and dtypes, and must never return a view that aliases a
  mutable buffer (NDArray storage is never mutated in place, so views of inputs are fine);
* ``grad(ctx, *out_grads) -> tuple`` — the vector-Jacobian product written with *frontend* ops
  (so the backward pass is itself asynchronous in eager mode and traceable when hybridized);
  ``ctx.inputs``, ``ctx.outputs`` and ``ctx.attrs`` are available; ``None`` for no gradient;
* ``cost(in_shapes, out_shapes, itemsize, **attrs) -> (flops, bytes)`` for the profiler and the
  roofline; by default one flop per output element and every input/output byte moved once;
* ``ew``: for elementwise ops, a numexpr template (``'exp({0})'``) used by the fusion pass;
* ``emit(out, ins, attrs, in_specs, out_spec, buf) -> (lines, uses_gemm) | None`` (optional):
  inline Python for a compiled program instead of a kernel call (``out``/``ins``/``buf`` are
  variable names, ``buf`` the planned output buffer or None); it must compute exactly what the
  kernel computes. None when the node does not qualify (see :mod:`hybridl.graph.codegen`);
* ``priority``: the engine priority of the op's pushes (compiled segments set their upward rank);
* ``fresh``: the kernel always returns new arrays, never views of its inputs (default False).
  The memory planner assumes an op it cannot place (no ``out=``, several outputs) may return
  views, which keeps its inputs' buffers alive as long as its outputs; ``fresh`` lifts that.
"""
__all__ = ["Op", "register", "OPS", "GradCtx"]

OPS = {}


# ``Op.grad_reads`` of an op whose gradient reads no input or output value (only shapes,
# attributes and the incoming gradient): writes to its arrays after recording change nothing
NO_VALUES = (frozenset(), frozenset())


class Op:
    __slots__ = ("name", "kernel", "infer", "grad", "cost", "n_out", "ew", "differentiable",
                 "random", "out_ok", "priority", "emit", "fresh", "__weakref__", "grad_reads")

    def __init__(self, name, kernel, infer, grad=None, cost=None, n_out=1, ew=None,
                 differentiable=True, random=False, fresh=False):
        self.name = name
        self.kernel = kernel
        self.infer = infer
        self.grad = grad
        self.cost = cost or default_cost
        self.n_out = n_out
        self.ew = ew
        self.differentiable = differentiable and grad is not None
        self.random = random     # reads and writes the engine RNG Var
        self.priority = 0        # engine priority of its ops (a program segment's critical path)
        self.emit = None         # optional inline code for compiled programs (graph.codegen)
        self.fresh = fresh       # outputs never views of the inputs (module docstring)
        # (input indices, output indices) the gradient rule reads, when known (compiled
        # programs: their backward's residuals); None: any input or output may be read
        self.grad_reads = None
        try:
            import inspect
            self.out_ok = "out" in inspect.signature(kernel).parameters
        except (TypeError, ValueError):
            self.out_ok = False

    def estimate(self, in_shapes, out_specs, attrs):
        """``(flops, bytes)`` by the cost model for inputs of ``in_shapes`` and outputs
        ``out_specs`` [(shape, dtype)], or ``(None, None)`` when the model fails (a cost model
        must never break execution or compilation)."""
        try:
            return self.cost([tuple(s) for s in in_shapes], [tuple(s) for s, _ in out_specs],
                             out_specs[0][1].itemsize if out_specs else 4, **attrs)
        except Exception:  # noqa: BLE001
            return None, None

    def __repr__(self):
        return f"Op({self.name})"


def default_cost(in_shapes, out_shapes, itemsize, **attrs):
    """One flop per output element; every input and output element moved once (bytes)."""
    import math
    nout = sum(math.prod(s) for s in out_shapes)
    nin = sum(math.prod(s) for s in in_shapes)
    return float(nout), float((nin + nout) * itemsize)


def register(name, kernel, infer, grad=None, cost=None, n_out=1, ew=None,
             differentiable=True, random=False, fresh=False):
    """Create and register an :class:`Op` under ``name`` (which must be new).

    Raises:
        ValueError: an op of that name exists already.
    """
    if name in OPS:
        raise ValueError(f"name: op {name!r} is already registered")
    op = Op(name, kernel, infer, grad, cost, n_out, ew, differentiable, random, fresh)
    OPS[name] = op
    return op


class GradCtx:
    """What a gradient rule sees: the op's inputs, outputs (frontend values) and attributes.

    ``needs[i]`` is False when nobody wants the gradient of input ``i`` (e.g. the data batch of
    the first layer): a rule may return None there instead of pushing work that is thrown away
    (PyTorch's ``needs_input_grad``). Rules that ignore it stay correct.
    """

    __slots__ = ("inputs", "outputs", "attrs", "needs")

    def __init__(self, inputs, outputs, attrs, needs=None):
        self.inputs = inputs
        self.outputs = outputs
        self.attrs = attrs
        self.needs = needs if needs is not None else (True,) * len(inputs)
