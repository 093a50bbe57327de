"""Graph passes: each a function ``Graph -> Graph``, selectable by name (see ``PASSES``).

* ``fold_constants`` — evaluate ops whose inputs are all constants ((1 + 2) + (3 + 4) -> 10);
* ``eliminate_common_subexpressions`` — one node per (op, inputs, attrs); equal constants merged;
* ``eliminate_dead_code`` — keep only what the outputs need;
* ``simplify_algebra`` — x*1, 1*x, x/1, x+0, 0+x, x-0, -(-x), transpose of transpose, reshape
  chains, reshape/identity to the same shape; the ReLU mask of a max-pooling gradient moved
  before the pooling gradient (on kernel*kernel times fewer elements);
* ``fuse_elementwise`` — chains of elementwise ops with one consumer each become one numexpr
  kernel (one pass over memory) when the arrays have at least ``fusion_threshold()`` elements;
* ``plan_memory`` — liveness analysis and buffer reuse (see :func:`plan_memory`);
* ``gradient`` — the joint forward+backward program (:func:`gradient`; ``hl.compile`` only:
  it extends the inputs and outputs).

The symbolic differentiation itself lives in :mod:`hybridl.graph.autodiff`. Every pass keeps the graph's
meaning: the tests check each on random graphs and inputs (hypothesis).
"""
import builtins
import os
import sys

import numpy as np

from .._env import env_int
from ..ops.registry import Op, register
from .ir import Graph, Node, Symbol, const, rebuild

__all__ = ["fold_constants", "eliminate_common_subexpressions", "eliminate_dead_code",
           "simplify_algebra", "fuse_elementwise", "plan_memory", "PASSES", "DEFAULT_PASSES",
           "run_passes", "fusion_threshold", "set_fusion_threshold", "MemoryPlan"]

_MAX_FOLD_ELEMS = 1 << 20     # do not materialise huge constants at compile time


def _is_const(s):
    return s.node.kind == "const"


def fold_constants(graph):
    """Replace every op whose inputs are all constants (and that draws no random numbers) by a
    constant holding its value, computed now with the op's kernel. An op whose kernel raises
    on those constants is left in place: the program then fails when it runs, with the op's
    name, as without this pass (it raised at compile time, naming neither op nor pass)."""
    def rw(node, ins):
        if node.op.random or not ins or not all(_is_const(s) for s in ins):
            return None
        if sum(int(np.prod(s)) for s, _ in node.specs) > _MAX_FOLD_ELEMS:
            return None
        try:
            res = node.op.kernel(*[s.node.value for s in ins], **node.attrs)
        except Exception:  # noqa: BLE001 - any kernel error: leave it to the run
            return None
        res = res if isinstance(res, tuple) else (res,)
        outs = []
        for r, (shape, dt) in zip(res, node.specs):
            a = np.array(r, dtype=dt, copy=True).reshape(shape)
            outs.append(const(a))
        return outs
    return rebuild(graph, rw)


def _freeze(v):
    """A hashable key of an attribute value; floats by ``repr`` (0.0 and -0.0 differ: clip's
    bound of -0.0 gives -inf where 0.0 gives +inf after 1/x; and NaN equals NaN)."""
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (float, np.floating)):
        return ("float", repr(float(v)))
    return v


def eliminate_common_subexpressions(graph):
    """Give each distinct (op, inputs, attributes) one node; merge equal small constants.
    Random ops are never merged (two dropouts draw two masks)."""
    seen = {}
    consts = {}

    def canon(s):
        if _is_const(s) and s.node.value.size <= 64:
            v = s.node.value
            k = (v.dtype.str, v.shape, v.tobytes())
            return consts.setdefault(k, s)
        return s

    def rw(node, ins):
        ins = [canon(s) for s in ins]
        if node.op.random:
            return Node("op", node.op, ins, node.attrs, node.specs, node.name).outputs()
        # the output specs too: two nodes of one op on the same inputs may be labelled with
        # other dtypes (a pass's rewrite), and merging them would mislabel one's data
        key = (node.op.name, tuple(s.key() for s in ins), _freeze(node.attrs),
               tuple((tuple(s), str(d)) for s, d in node.specs))
        hit = seen.get(key)
        if hit is not None:
            return hit
        nn = Node("op", node.op, ins, node.attrs, node.specs, node.name)
        seen[key] = nn.outputs()
        return seen[key]
    g = rebuild(graph, rw)
    return Graph(g.inputs, [canon(s) for s in g.outputs])


def eliminate_dead_code(graph):
    """Drop every node that no output depends on (the program inputs stay)."""
    return Graph(graph.inputs, graph.outputs)


def _all_equal(s, value):
    return _is_const(s) and s.node.value.size > 0 and bool(np.all(s.node.value == value))


def _zero_identity(s, dtype, negative):
    """``s`` is a constant zero that adding (``negative``: -0.0) or subtracting (+0.0) leaves
    every value unchanged in ``dtype``. IEEE 754 signed zeros: ``-0.0 + 0.0`` is ``+0.0``, so
    only ``x + (-0.0)`` and ``x - (+0.0)`` are x for every float x (the rule C compilers follow
    without -fno-signed-zeros); for integers any zero is."""
    if not _all_equal(s, 0):
        return False
    if dtype.kind != "f":
        return True
    sign = np.signbit(s.node.value)
    return bool(np.all(sign)) if negative else not bool(np.any(sign))


def simplify_algebra(graph):
    """Algebraic identities that keep shape, dtype and every value (NaN, inf and the sign of
    zero included): x*1, 1*x, x/1, x-0, x+(-0) and (-0)+x (x+0 only for integers: in floating
    point ``-0.0 + 0.0`` is ``+0.0``), -(-x), transpose(transpose(x)), reshape(reshape(x)),
    reshape/broadcast/identity to the same shape; a sum/mean/max/min over axes that keep a
    concat's axis is taken part by part (``_reduce_parts``); and the ReLU mask of a max-pooling
    gradient is applied to the pooled gradient instead (``_relu_grad_before_pool``)."""
    def same(a, node):
        return tuple(a.shape) == node.specs[0][0] and a.dtype == node.specs[0][1]

    def rw(node, ins):
        name = node.op.name
        dt = node.specs[0][1] if node.specs else None
        if name == "multiply":
            a, b = ins
            if _all_equal(b, 1) and same(a, node):
                return [a]
            if _all_equal(a, 1) and same(b, node):
                return [b]
        elif name == "add":
            a, b = ins
            if _zero_identity(b, dt, True) and same(a, node):
                return [a]
            if _zero_identity(a, dt, True) and same(b, node):
                return [b]
        elif name == "divide":
            a, b = ins
            if _all_equal(b, 1) and same(a, node):
                return [a]
        elif name == "subtract":
            a, b = ins
            if _zero_identity(b, dt, False) and same(a, node):
                return [a]
        elif name == "negative":
            src = ins[0]
            if src.node.kind == "op" and src.node.op.name == "negative":
                return [src.node.inputs[0]]
        elif name == "transpose":
            src = ins[0]
            if src.node.kind == "op" and src.node.op.name == "transpose":
                inner, outer = src.node.attrs["axes"], node.attrs["axes"]
                axes = tuple(inner[a] for a in outer)
                base = src.node.inputs[0]
                if axes == tuple(range(len(axes))):
                    return [base]
                return [Node("op", node.op, [base], {"axes": axes}, node.specs).out()]
        elif name == "reshape":
            src = ins[0]
            if same(src, node):
                return [src]
            if src.node.kind == "op" and src.node.op.name == "reshape":
                base = src.node.inputs[0]
                if same(base, node):
                    return [base]
                return [Node("op", node.op, [base], node.attrs, node.specs).out()]
        elif name in ("identity", "broadcast_to", "sum_to"):
            if same(ins[0], node):
                return [ins[0]]
        elif name in _PER_PART_REDUCTIONS:
            return _reduce_parts(node, ins[0])
        elif name == "relu_grad":
            return _relu_grad_before_pool(node, ins, uses, outs)
        return None
    uses, outs = _uses(graph), {s.key() for s in graph.outputs}
    return rebuild(graph, rw)


def _uses(graph):
    """value key -> number of node inputs that read it."""
    uses = {}
    for n in graph.nodes:
        for s in n.inputs:
            uses[s.key()] = uses.get(s.key(), 0) + 1
    return uses


def _relu_grad_before_pool(node, ins, uses, outs):
    """``relu_grad(max_pool2d_grad(dy, x, y), x)`` -> ``max_pool2d_grad(relu_grad(dy, y), x, y)``
    (``y = max_pool2d(x)``): the ReLU mask applied to the pooled gradient, kernel*kernel times
    fewer elements (LeNet's first layer: 602k -> 150k), instead of the scattered one.

    Exact, value for value: each window's ``dy`` goes to one position, its first maximum,
    where ``x == y`` (or both are NaN), so ``x > 0`` there is ``y > 0``; every other position
    gets ``dy * 0`` either way, with the same sign of zero (``relu_grad`` is ``g * (y > 0)``,
    the pooling gradient ``dy * hit``: both products, in either order, give ``dy * 1`` or
    ``dy * 0``). Only when every input position lies in exactly one window and is written
    once (stride == kernel, no padding, the size divisible: the kernel's direct path); with
    overlapping windows the accumulated sums could round or sign their zeros differently. The
    pooling gradient must feed nothing else."""
    src = node.inputs[0]
    pg = src.node
    if (pg.kind != "op" or pg.op.name != "max_pool2d_grad" or uses.get(src.key(), 0) != 1
            or src.key() in outs or pg.inputs[1].key() != node.inputs[1].key()):
        return None
    a = pg.attrs
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    H, W = pg.inputs[1].shape[2:]
    if not (kh == sh and kw == sw and ph == pw == 0 and H % kh == 0 and W % kw == 0):
        return None
    dy, x, y = ins[0].node.inputs
    masked = Node("op", node.op, [dy, y], {}, [(tuple(dy.shape), dy.dtype)]).out()
    return [Node("op", pg.op, [masked, x, y], pg.attrs, node.specs).out()]


# reductions that may move through a concat along an axis they keep (each output element
# reduces the elements of one part only)
_PER_PART_REDUCTIONS = ("sum", "mean", "max", "min")


def _reduce_parts(node, src):
    """``reduce(concat(x1..xk, axis=c), axes)`` with c not reduced ->
    ``concat(reduce(x1, axes)..reduce(xk, axes), axis=c')``: each part is reduced where it is
    made (in parallel segments: on its own branch's worker) and only the small results are
    joined, instead of copying every part into one large array first (e.g. the global average
    pool after an Inception block's concat)."""
    if src.node.kind != "op" or src.node.op.name != "concat":
        return None
    axes, keepdims = node.attrs.get("axis"), node.attrs.get("keepdims")
    c = src.node.attrs["axis"]
    if not isinstance(axes, tuple) or c in axes:
        return None
    if any(x.dtype != src.dtype for x in src.node.inputs):
        return None         # concat promotes: a part reduced in its own dtype rounds otherwise
    parts = []
    for x in src.node.inputs:
        shape = tuple((1 if keepdims else None) if i in axes else d for i, d in enumerate(x.shape))
        shape = tuple(d for d in shape if d is not None)
        parts.append(Node("op", node.op, [x], dict(node.attrs), [(shape, node.specs[0][1])]).out())
    new_c = c if keepdims else c - builtins.sum(1 for a in axes if a < c)
    return [Node("op", src.node.op, parts, {"axis": new_c}, node.specs).out()]


# ---------------------------------------------------------------------------- fusion

# Measured with ``python benchmarks/fusion_threshold.py`` (measure_fusion_threshold below) on this
# project's 2-core reference VM, 2026-11-30: the fused numexpr kernel (numexpr 2.14, no VML) was
# 2.5-10x SLOWER than NumPy op by op for the 4-op chain relu(tanh(a*b + a)) at every size from
# 256 to 4M elements (numexpr's tanh is ~3.5x slower than NumPy's), and pure arithmetic chains
# won only from about 4M elements. So the default is 2**23 elements: fusion is kept for very
# large arrays only. Re-measure on your machine and set_fusion_threshold() /
# HYBRIDL_FUSION_THRESHOLD accordingly (0 fuses every chain, e.g. in tests).
_FUSION_THRESHOLD = [env_int("HYBRIDL_FUSION_THRESHOLD", 1 << 23, 0,
                              "elements; 0 fuses every chain")]


def fusion_threshold():
    """Minimum output size (elements) for which ``fuse_elementwise`` fuses a chain."""
    return _FUSION_THRESHOLD[0]


def set_fusion_threshold(n):
    """Set the fusion size threshold (elements, >= 0; 0 fuses every chain).

    Raises:
        ValueError: n is negative or not an integer.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n: expected an integer >= 0, got {n!r}")
    _FUSION_THRESHOLD[0] = int(n)


def measure_fusion_threshold(sizes=None, reps=15):
    """Time a 4-op float32 elementwise chain ``relu(tanh(a * b + a))`` op by op in NumPy vs one
    fused kernel (what ``fuse_elementwise`` emits: numexpr), over sizes (elements).

    Returns ``(threshold, rows)``: threshold is the smallest size from which the fused kernel
    wins at every larger size measured (or twice the largest size when it never does);
    rows = [(size, numpy_seconds, fused_seconds), ...] (medians of ``reps``).
    """
    import time
    sizes = sizes or [1 << k for k in range(8, 23)]
    expr, names, dt = "where(tanh(i0 * i1 + i0) > 0, tanh(i0 * i1 + i0), 0)", ("i0", "i1"), "float32"
    rows = []
    for n in sizes:
        a = np.random.rand(n).astype(np.float32)
        b = np.random.rand(n).astype(np.float32)

        def f_np():
            return np.maximum(np.tanh(a * b + a), 0)

        def f_fused():
            return _fused_kernel(a, b, expr=expr, names=names, dtype=dt, shape=(n,))
        ts = []
        for f in (f_np, f_fused):
            f()
            t = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                t.append(time.perf_counter() - t0)
            ts.append(float(np.median(t)))
        rows.append((n, ts[0], ts[1]))
    thr = None
    for i in range(len(rows)):
        if all(r[2] < r[1] for r in rows[i:]):
            thr = rows[i][0]
            break
    return (thr if thr is not None else sizes[-1] * 2), rows


_NE_MAX = 1024
_NE = []            # the numexpr module once imported (the fused kernels ask on every call)


def _numexpr():
    """The numexpr module, its thread settings checked first: numexpr reads
    ``NUMEXPR_MAX_THREADS``, ``NUMEXPR_NUM_THREADS`` and ``OMP_NUM_THREADS`` when it is
    imported, and a bad value there was a traceback naming none of them (``int()`` of
    '4,2'), a thread pool of 100000 (the process died in ``pthread_create``) or a message with
    no end of line. An OpenMP list (``OMP_NUM_THREADS=4,2``) gives numexpr its first number.

    Raises:
        ValueError: a variable that is set but not an integer in [1, 1024] (its name, value
            and what was expected)."""
    if _NE:
        return _NE[0]
    if "numexpr" not in sys.modules:
        env = os.environ
        for var in ("NUMEXPR_MAX_THREADS", "NUMEXPR_NUM_THREADS", "OMP_NUM_THREADS"):
            v = env.get(var, "").strip()
            if not v or (var == "OMP_NUM_THREADS" and env.get("NUMEXPR_NUM_THREADS", "").strip()):
                continue
            first = v.split(",")[0].strip() if var == "OMP_NUM_THREADS" else v
            if not (first.isascii() and first.isdigit() and 1 <= int(first) <= _NE_MAX):
                raise ValueError(
                    f"{var}={env[var]!r}: expected an integer in [1, {_NE_MAX}] (threads; "
                    f"numexpr, which runs the fused elementwise code, reads it), or unset")
            if var == "OMP_NUM_THREADS" and first != v:     # numexpr parses one integer
                env["NUMEXPR_NUM_THREADS"] = first
    import numexpr
    _NE.append(numexpr)
    return numexpr


def _fused_kernel(*arrays, expr, names, dtype, shape=None, out=None):
    ne = _numexpr()
    r = ne.evaluate(expr, local_dict=dict(zip(names, arrays)), out=out)
    r = r if r.dtype == dtype else r.astype(dtype)
    if shape is not None and r.shape != tuple(shape):
        r = np.array(np.broadcast_to(r, shape))
    return r


def _fused_infer(*xs, expr, names, dtype, shape):
    return [(shape, np.dtype(dtype))]


def _g_fused(c, g):
    raise RuntimeError("fused_elementwise has no gradient rule: run 'gradient' before fusion")


FUSED = register("fused_elementwise", _fused_kernel, _fused_infer, None, differentiable=False)
FUSED.ew = None


def _once_used(node):
    """The inputs of an elementwise node that its template writes once: one written twice
    (relu's ``where({0} <= 0, 0, {0})``, maximum's three ``{0}``) stays a leaf of the fused
    expression, since an absorbed input's whole expression would be copied at each place,
    and a chain of such ops grew exponentially (16 relus: a 2 MB program, 35 s to compile)."""
    t = node.op.ew
    return [s for i, s in enumerate(node.inputs) if t.count("{%d}" % i) <= 1]


# ops per fused kernel: a longer chain is cut into several kernels (the expression is built
# recursively, one level per op: 600 ops hit Python's recursion limit; numexpr compiles
# expressions of a few dozen ops as well as longer ones)
_MAX_FUSED = 64


def fuse_elementwise(graph, threshold=None):
    """Fuse chains of elementwise ops (``Op.ew`` templates) into one numexpr kernel.

    A chain grows backwards from an elementwise node through inputs that are elementwise,
    used only once and not graph outputs. Chains of at least 2 ops whose output has at least
    ``threshold`` elements (default :func:`fusion_threshold`) are fused; the fused
    expression's result dtype is checked on a tiny sample before it is accepted.
    """
    ne = _numexpr()
    thr = fusion_threshold() if threshold is None else threshold
    uses = _uses(graph)
    outs = {s.key() for s in graph.outputs}

    def ew(n):
        # NumPy computes x ** c for a scalar c of 0.5, 2, -1 ... by sqrt, square, reciprocal
        # (sqrt(-inf) is nan, pow(-inf, 0.5) inf); numexpr always calls pow: a power with
        # a one-element exponent stays NumPy's
        return (n.kind == "op" and n.op.ew is not None and len(n.specs) == 1
                and not (n.op.name == "power" and int(np.prod(n.inputs[1].shape)) == 1))

    def fusable(s):
        return ew(s.node) and uses.get(s.key(), 0) == 1 and s.key() not in outs

    def big_ew(n):
        return ew(n) and int(np.prod(n.specs[0][0])) >= thr

    # chain roots and the values they absorb: consumers come after producers, so walking the
    # nodes backwards meets each chain at its root first (fusing at inner nodes first would
    # cut one chain into several kernels)
    absorbed = set()
    for n in reversed(graph.nodes):
        if not big_ew(n) or n.outputs()[0].key() in absorbed:
            continue
        stack = _once_used(n)
        size = 1                # ops in this chain: at most _MAX_FUSED (see there)
        while stack:
            s = stack.pop()
            if (size < _MAX_FUSED and fusable(s) and int(np.prod(s.shape)) >= 1
                    and s.key() not in absorbed):
                absorbed.add(s.key())
                size += 1
                stack.extend(_once_used(s.node))
    new_of = {}        # original value key -> its value in the rebuilt graph

    def rw(node, ins):
        for s, t in zip(node.inputs, ins):
            new_of[s.key()] = t
        if not big_ew(node) or node.outputs()[0].key() in absorbed:
            return None
        leaves, names = [], {}
        count = [1]
        dtypes = set()          # of the chain's leaves and intermediate values

        def expr_of(s):
            dtypes.add(np.dtype(s.dtype))
            if s.key() in absorbed:
                count[0] += 1
                return "(" + s.node.op.ew.format(*[expr_of(x) for x in s.node.inputs]) + ")"
            k = s.key()
            if k not in names:
                names[k] = f"i{len(leaves)}"
                leaves.append(new_of.get(k, s))
            return names[k]
        expr = node.op.ew.format(*[expr_of(x) for x in node.inputs])
        if count[0] < 2:
            return None
        # one float dtype throughout: numexpr's own promotions differ from NumPy's for mixed
        # or integer operands (int32 > float32 compares in float32 there, in float64 in
        # NumPy; abs of an int is a float there), so such chains keep the kernels
        if len(dtypes) != 1 or next(iter(dtypes)).kind != "f":
            return None
        shape, dt = node.specs[0]
        try:
            sample = {names[k]: np.ones((1,) * len(s.shape), s.dtype)
                      for k, s in zip(names, leaves)}
            if ne.evaluate(expr, local_dict=sample).dtype != dt:
                return None
        except Exception:  # noqa: BLE001 - numexpr cannot express it: keep the chain
            return None
        attrs = {"expr": expr, "names": tuple(names[k] for k in names), "dtype": dt.name,
                 "shape": shape}
        return [Node("op", FUSED, leaves, attrs, node.specs, "fused").out()]
    return eliminate_dead_code(rebuild(graph, rw))


# ---------------------------------------------------------------------------- memory planning


class MemoryPlan:
    """Where each intermediate value lives.

    Attributes:
        buffers (list of int): byte sizes of the persistent buffers.
        assign (dict): (node id, output index) -> buffer index, for values written with out=.
        offset (dict): the same keys -> byte offset of the value in its buffer.
        inplace (set): values written into the buffer of an input that dies there.
        naive_bytes (int): bytes of every freshly allocated value (no reuse; views are free).
        planned_bytes (int): buffer bytes plus values still allocated fresh (outputs and what
            can alias them).
        fresh_bytes (int): the part of both that holds results: the graph's outputs and the
            values they may be views of (allocated fresh on every call, handed to the caller).
        live_peak_bytes (int): the most bytes of planned values live at once (the sum of the
            allocations whose lifetimes include one node, maximized over the nodes): a lower
            bound on the arena of any placement of these values in this op order (Pisarchyk &
            Lee 2020, section 3); the arena equals it when placement wastes nothing.
    """

    def __init__(self):
        self.buffers, self.assign, self.inplace, self.offset = [], {}, set(), {}
        self.naive_bytes = self.planned_bytes = self.fresh_bytes = self.live_peak_bytes = 0

    @property
    def ratio(self):
        """planned_bytes / naive_bytes (lower is better)."""
        return self.planned_bytes / self.naive_bytes if self.naive_bytes else 1.0

    @property
    def internal_ratio(self):
        """Internal memory only, as in MXNet's memory-cost estimate (intermediate nodes; the
        results handed to the caller -- for a training program the gradients and the loss --
        are excluded on both sides): (planned - fresh_bytes) / (naive - fresh_bytes). Values
        that cannot be planned (kernels without ``out=``) count on both sides."""
        naive = self.naive_bytes - self.fresh_bytes
        return (self.planned_bytes - self.fresh_bytes) / naive if naive else 1.0

    def __repr__(self):
        return (f"MemoryPlan({len(self.buffers)} buffers, naive {self.naive_bytes} B, planned "
                f"{self.planned_bytes} B, ratio {self.ratio:.2f}, intermediates ratio "
                f"{self.internal_ratio:.2f}, {len(self.inplace)} in-place)")


def _live_peak(groups):
    """The largest sum of ``nbytes`` over allocations ``[nbytes, first, last]`` alive at one
    node (an allocation is alive from ``first`` to ``last`` inclusive)."""
    events = sorted([(f, 0, nb) for nb, f, _ in groups] + [(l + 1, -1, -nb) for nb, _, l in groups])
    live = peak = 0
    for _, _, d in events:      # at one node, ends (-1) are applied before starts (0)
        live += d
        peak = max(peak, live)
    return peak


_VIEW_OPS = {"reshape", "transpose", "broadcast_to", "slice", "identity", "stop_gradient"}
_ALIGN = 64                 # byte alignment of planned values (a cache line)


def plan_memory(graph):
    """Liveness analysis and buffer reuse (the MXNet paper's memory planning, Chen et al. 2015).

    A value gets a planned buffer when its kernel accepts ``out=``, it is not an output and no
    output can alias it (ops without ``out=`` may return views of their inputs, so their
    outputs extend the lifetime of the buffers they read). An elementwise op whose input dies
    at that op writes in place into the input's memory. Every planned value then gets an
    offset in one arena buffer: memory is reused once the last reader of every value aliasing
    it has run, and values whose lifetimes overlap never share bytes. The plan is attached as
    ``graph.memory_plan`` and used by code generation.
    """
    plan = MemoryPlan()
    nodes = graph.nodes
    pos = {n.id: i for i, n in enumerate(nodes)}
    out_keys = {s.key() for s in graph.outputs}
    last_use = {}
    consumers = {}
    for i, n in enumerate(nodes):
        for s in n.inputs:
            last_use[s.key()] = i
            consumers.setdefault(s.key(), []).append(n)
    for s in graph.outputs:
        last_use[s.key()] = len(nodes)

    def plannable(n):          # (an empty value needs no memory: its kernel makes it)
        return (n.kind == "op" and n.op.out_ok and len(n.specs) == 1
                and int(np.prod(n.specs[0][0])) > 0)

    def aliasing(n):            # not planned and may return views of its inputs
        return n.kind == "op" and not plannable(n) and not n.op.fresh

    # values that escape to an output (directly or through aliasing ops)
    escapes = set(out_keys)
    for n in reversed(nodes):
        if n.kind != "op":
            continue
        if aliasing(n) and any(o.key() in escapes for o in n.outputs()):
            for s in n.inputs:
                escapes.add(s.key())
    # lifetime end of each value, extended through aliasing consumers
    end = dict(last_use)
    for n in reversed(nodes):
        if not aliasing(n):
            continue
        e = max((end.get(o.key(), pos[n.id]) for o in n.outputs()), default=pos[n.id])
        for s in n.inputs:
            end[s.key()] = max(end.get(s.key(), 0), e)

    # 1. allocations: each planned value opens one, or joins its input's when it is written
    #    in place; an allocation lives from its first value's node to its last reader
    groups = []             # [nbytes, first node, last node]
    gsize = []              # item size of each allocation's values
    gid = {}                # planned value key -> allocation index
    alias = {}              # value key -> allocations it may be (a view of)
    for i, n in enumerate(nodes):
        if n.kind != "op":
            continue
        for (shape, dt) in n.specs:
            if n.op.name not in _VIEW_OPS:
                plan.naive_bytes += int(np.prod(shape)) * dt.itemsize
        if not plannable(n) or n.outputs()[0].key() in escapes:
            if aliasing(n):             # may return views: its outputs alias its inputs' buffers
                bufs = set().union(*(alias.get(s.key(), ()) for s in n.inputs))
                for o in n.outputs():
                    alias[o.key()] = bufs
            if n.op.name not in _VIEW_OPS:
                for o, (s, d) in zip(n.outputs(), n.specs):
                    nb = int(np.prod(s)) * d.itemsize
                    plan.planned_bytes += nb
                    if o.key() in escapes:      # the memory of a result, not an intermediate
                        plan.fresh_bytes += nb
            continue
        key = n.outputs()[0].key()
        shape, dt = n.specs[0]
        need = max(int(np.prod(shape)) * dt.itemsize, 1)
        # in place: an elementwise op whose input (same shape/dtype, planned) dies here
        if n.op.ew is not None or n.op.name == "fused_elementwise":
            for s in n.inputs:
                k = s.key()
                if (k in gid and end.get(k) == i and tuple(s.shape) == tuple(shape)
                        and s.dtype == dt
                        # no other input reads the same buffer through a view (x + x.T):
                        # writing into it would change what is still to be read
                        and not any(gid[k] in alias.get(t.key(), ())
                                    for t in n.inputs if t.key() != k)):
                    g = gid[k]
                    gid[key] = g
                    groups[g][2] = max(groups[g][2], end.get(key, i))
                    plan.inplace.add(key)
                    alias[key] = {g}
                    break
            if key in gid:
                continue
        gid[key] = len(groups)
        groups.append([need, i, end.get(key, i)])
        gsize.append(dt.itemsize)
        alias[key] = {gid[key]}
    # 2. placement in one arena, largest allocation first, each at the lowest offset free of
    #    every placed allocation whose lifetime overlaps (the greedy-by-size offset planner of
    #    TensorFlow Lite's arena; Pisarchyk & Lee 2020, "Efficient Memory Management for Deep
    #    Neural Net Inference"): the arena is close to the peak of live bytes
    placed = []             # (offset, nbytes, first, last)
    offsets = [0] * len(groups)
    for g in sorted(range(len(groups)), key=lambda g: (-groups[g][0], groups[g][1])):
        size, first, last = groups[g]
        # aligned to the dtype (required), and to a cache line for values of 4 KiB and more
        align = _ALIGN if size >= 4096 else gsize[g]
        off = 0
        for o, sz in sorted((o, sz) for o, sz, f2, l2 in placed if f2 <= last and first <= l2):
            if off + size <= o:
                break
            off = max(off, -(-(o + sz) // align) * align)
        placed.append((off, size, first, last))
        offsets[g] = off
    if groups:
        arena = max(o + sz for o, sz, _, _ in placed)
        total = sum(gr[0] for gr in groups)
        if arena > total:       # tiny values lost to alignment: no reuse beats that; laid out
            off = 0             # by item size, largest first, every offset stays aligned
            for g in sorted(range(len(groups)), key=lambda g: -gsize[g]):
                offsets[g] = off
                off += groups[g][0]
            arena = total
        plan.buffers = [arena]
        plan.live_peak_bytes = _live_peak(groups)
        for key, g in gid.items():
            plan.assign[key] = 0
            plan.offset[key] = offsets[g]
    plan.planned_bytes += sum(plan.buffers)
    g = Graph(graph.inputs, graph.outputs)
    g.memory_plan = plan
    return g


def gradient(graph):
    """The joint forward+backward program (:func:`hybridl.graph.autodiff.gradient`) as a pass:
    inputs = the graph's inputs followed by one cotangent per float output; outputs = the
    graph's outputs followed by the gradient of sum(cotangent * output) with respect to each
    float input. Unlike the other passes it extends the graph's inputs and outputs, so it is
    taken by :func:`hybridl.compile` only (hybridized blocks and ``@hl.jit`` build their
    gradient programs themselves, under ``autograd.record()``); run it before
    ``fuse_elementwise`` (a fused kernel has no gradient rule)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"gradient: expected a Graph, got {type(graph).__name__}")
    from .autodiff import gradient as _joint
    return _joint(graph)[0]


gradient.extends_signature = True

PASSES = {
    "fold_constants": fold_constants,
    "simplify_algebra": simplify_algebra,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "eliminate_dead_code": eliminate_dead_code,
    "fuse_elementwise": fuse_elementwise,
    "plan_memory": plan_memory,
    "gradient": gradient,
}
DEFAULT_PASSES = ("fold_constants", "simplify_algebra", "eliminate_common_subexpressions",
                  "eliminate_dead_code", "fuse_elementwise", "plan_memory")


def check_passes(passes, allow_gradient=False):
    """The passes to run, as functions (``None``: :data:`DEFAULT_PASSES`): what
    :func:`run_passes` checks, without a graph (``hybridize(passes=...)`` and
    ``hl.jit(passes=...)`` check at once rather than at the first call).

    Raises:
        ValueError: an unknown pass name (the message lists the known ones), a string instead
            of a list, not a list, or an entry that is neither a name nor a function.
    """
    if isinstance(passes, str):
        raise ValueError(f"passes: expected a list of pass names, got the string {passes!r} "
                         f"(write passes=[{passes!r}])")
    try:
        items = list(DEFAULT_PASSES if passes is None else passes)
    except TypeError:
        raise ValueError(f"passes: expected a list of pass names or functions, got "
                         f"{type(passes).__name__} {passes!r}") from None
    fns = []
    for p in items:
        if isinstance(p, str):
            if p not in PASSES:
                raise ValueError(f"passes: unknown pass {p!r}; known: {sorted(PASSES)}")
            p = PASSES[p]
        elif not callable(p):
            raise ValueError(f"passes: expected pass names or functions Graph -> Graph, got {p!r}")
        if getattr(p, "extends_signature", False) and not allow_gradient:
            raise ValueError("passes: 'gradient' extends the program's inputs and outputs (it "
                             "is a pass of hl.compile only); hybridized blocks, @hl.jit and "
                             "TrainStep build their gradient programs under autograd.record()")
        fns.append(p)
    return fns


def _check_pass_result(p, before, after):
    """A pass must return a Graph with the same inputs and outputs (number, shapes, dtypes):
    a user's pass that got it wrong raises here, naming it, instead of making a program whose
    results claim one shape or dtype and hold another."""
    name = getattr(p, "__name__", repr(p))
    if not isinstance(after, Graph):
        raise ValueError(f"passes: pass {name!r} returned {type(after).__name__}, expected a Graph")

    def specs(syms):
        return [(tuple(s.shape), np.dtype(s.dtype)) for s in syms]
    for what in ("inputs", "outputs"):
        a, b = specs(getattr(before, what)), specs(getattr(after, what))
        if getattr(p, "extends_signature", False):      # ('gradient': appends to both)
            b = b[:len(a)]
        if a != b:
            raise ValueError(f"passes: pass {name!r} changed the graph's {what} from {a} to {b}; "
                             f"a pass must keep them (number, shapes and dtypes)")


def run_passes(graph, passes=None, allow_gradient=False):
    """Apply passes (names or functions) in order; default :data:`DEFAULT_PASSES`
    (``allow_gradient``: the ``gradient`` pass is taken, see :func:`gradient`).

    Raises:
        ValueError: as :func:`check_passes`.
    """
    for p in check_passes(passes, allow_gradient):
        plan = getattr(graph, "memory_plan", None)
        before = graph
        graph = p(graph)
        _check_pass_result(p, before, graph)
        if plan is not None and not hasattr(graph, "memory_plan"):
            graph.memory_plan = None
    return graph


_ = (Op, Symbol)
