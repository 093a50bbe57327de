"""Reverse-mode automatic differentiation on a tape of recorded ops.

Inside ``with autograd.record():`` every op whose inputs depend on a variable (an array that
called :meth:`NDArray.attach_grad`) is recorded as a node (op, attrs, inputs, outputs).
``y.backward()`` walks the nodes in reverse topological order and calls each op's gradient rule
(``Op.grad``, written with frontend ops), so the backward pass is pushed to the engine like any
other code and is asynchronous too. Gradients of several uses of one array are summed.

API (as in MXNet Gluon): ``record(train_mode=True)``, ``pause(train_mode=False)``,
``is_recording()``, ``is_training()``, ``train_mode()``, ``predict_mode()``,
``backward(heads, head_grads)``, ``grad(heads, variables, create_graph=False)``.
"""
import itertools
import threading

import numpy as np

from .ops.registry import GradCtx

__all__ = ["record", "pause", "is_recording", "is_training", "train_mode", "predict_mode",
           "backward", "grad", "mark_variables"]


class _State(threading.local):
    recording = False
    training = False


_state = _State()


class _Scope:
    def __init__(self, recording, training):
        self.rec, self.train = recording, training

    def __enter__(self):
        self.prev = (_state.recording, _state.training)
        if self.rec is not None:
            _state.recording = self.rec
        if self.train is not None:
            _state.training = self.train
        return self

    def __exit__(self, *exc):
        _state.recording, _state.training = self.prev
        return False


def record(train_mode=True):
    """Context: record ops for autograd (and, by default, run layers in training mode)."""
    return _Scope(True, train_mode)


def pause(train_mode=False):
    """Context: stop recording inside a ``record()`` block."""
    return _Scope(False, train_mode)


def train_mode():
    """Context: layers behave as in training (Dropout active, BatchNorm uses batch statistics)."""
    return _Scope(None, True)


def predict_mode():
    """Context: layers behave as in inference."""
    return _Scope(None, False)


def is_recording():
    """Whether ops are being recorded in this thread."""
    return _state.recording


def is_training():
    """Whether layers run in training mode in this thread."""
    return _state.training


_SEQ = itertools.count()    # recording order of the tape's nodes


class Node:
    __slots__ = ("op", "inputs", "outputs", "attrs", "freed", "versions", "out_versions", "seq")

    def __init__(self, op, inputs, outputs, attrs):
        self.op, self.inputs, self.outputs, self.attrs = op, inputs, outputs, attrs
        self.seq = next(_SEQ)
        self.freed = False
        # versions of the inputs and outputs: a write to one of them between recording and
        # backward would make the gradient use the new value (PyTorch's version counter)
        self.versions = tuple(getattr(x, "_version", 0) for x in inputs)
        self.out_versions = tuple(getattr(o, "_version", 0) for o in outputs)


_UNRECORDED = []     # [Op] once made (autograd is imported before the op registry)


def _unrecorded_op():
    if not _UNRECORDED:
        from .ops.registry import NO_VALUES, Op

        def grad(c, *gs):
            raise RuntimeError(
                "backward: the gradient reached an array that was assigned a recorded value "
                "inside autograd.record() (y[...] = x): such an assignment is not recorded, so "
                "the gradient cannot pass through it; build the array with ops (hl.nd.concat, "
                "hl.nd.where, ...) instead")
        op = Op("assignment_inside_record", lambda: None, lambda: [], grad)
        op.grad_reads = NO_VALUES
        _UNRECORDED.append(op)
    return _UNRECORDED[0]


def _mark_unrecorded(a):
    """``a`` was assigned a recorded value inside ``record()`` (not itself recorded): a
    backward whose gradient reaches ``a`` raises; using ``a`` for anything else (logging a
    loss into a buffer) is fine."""
    a._ag = (Node(_unrecorded_op(), (), [a], {}), 0)


def _is_unrecorded(a):
    """Whether ``a`` was marked by :func:`_mark_unrecorded`."""
    return a._ag is not None and _UNRECORDED and a._ag[0].op is _UNRECORDED[0]


def _tracked(a):
    """Whether ``a`` takes part in autograd: recorded by an op, or a variable."""
    return a._ag is not None or a._grad_req != "null"


def _check_versions(node):
    """RuntimeError when an array the gradient of ``node`` reads was written after recording:
    every input that needs a gradient, and the inputs and outputs its gradient rule reads, as
    the op declares them in ``grad_reads`` (None: any of them; a compiled program lists its
    backward's residuals; ``NO_VALUES`` for rules that read no value) -- a data batch refilled
    in place, an output overwritten."""
    reads = node.op.grad_reads
    for i, (x, v) in enumerate(zip(node.inputs, node.versions)):
        if getattr(x, "_version", v) != v and (_tracked(x) or reads is None or i in reads[0]):
            _modified(node, "an input", x, v)
    for j, (o, v) in enumerate(zip(node.outputs, node.out_versions)):
        if getattr(o, "_version", v) != v and (reads is None or j in reads[1]):
            _modified(node, "the result", o, v)


def _modified(node, what, x, v):
    raise RuntimeError(
        f"backward: {what} of {node.op.name!r} (shape {x.shape}) was modified after it was "
        f"recorded (version {v} -> {x._version}), e.g. by an optimizer step or an in-place "
        f"update (x[:] = ..., x += ...) before backward(); the gradient would use the new "
        f"value. Call backward() before changing it, or compute on a copy.")


def record_op(op, inputs, outputs, attrs):
    """Add a tape node for ``outputs = op(*inputs, **attrs)`` (called by the interpreters)."""
    node = Node(op, inputs, outputs, attrs)
    for i, o in enumerate(outputs):
        o._ag = (node, i)


def mark_variables(variables, gradients, grad_reqs="write"):
    """Attach ``gradients`` buffers to ``variables`` (MXNet's mark_variables)."""
    if not isinstance(grad_reqs, (list, tuple)):
        grad_reqs = [grad_reqs] * len(variables)
    for v, g, r in zip(variables, gradients, grad_reqs):
        v._grad_req = r
        v._ag = None
        v._grad = g


def _topo(heads):
    order, seen = [], set()
    stack = [(h._ag[0], False) for h in heads if h._ag is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.freed:
            raise RuntimeError("backward: the graph was already freed by an earlier backward(); "
                               "pass retain_graph=True to the first backward() to reuse it")
        stack.append((node, True))
        for x in node.inputs:
            if x._ag is not None and id(x._ag[0]) not in seen:
                stack.append((x._ag[0], False))
    # recording order (a topological order too): backward then visits the nodes in reverse
    # recording order, as the compiled backward of a hybridized block does, so that the
    # gradients of a value used three times or more are summed in the same order (float
    # addition is not associative: an Inception block's branches gave other bits)
    order.sort(key=_seq_of)
    return order      # inputs before outputs


def _seq_of(node):
    return node.seq


_MODS = []      # [ndarray, ops.math] once imported (they import this module)


def _ones_after(h, nd):
    """The head gradient ``ones_like(h)``, made by an engine op that reads ``h``: when the op
    computing the head failed, the whole backward is skipped with that same error instead of
    running (the loss's gradient would check the same bad labels again: a second error for
    one bad batch, raised later by an unrelated step)."""
    out = nd.NDArray(h.shape, h.dtype, h.device)
    eng = _ENGINE[0]
    if eng is None:
        from . import engine as _engine
        eng = _ENGINE[0] = _engine
    eng = eng.get_engine()
    # h computed and clean (the common case): made now, without an op (as any ready eager op
    # whose cost key is known to be tiny, Engine.run_ready); else an op that waits for h
    if eng.run_ready(_ones_kernel, [h], [out], {}, h.device, "ones_like", "ones_like"):
        return out
    shape, dt = h.shape, h.dtype

    def ones():
        out._data = np.ones(shape, dt)
    # fresh lists of Vars: the engine need not copy or check them
    eng.push_trusted(ones, [h._var], [out._var], h.device, 0, "ones_like", None, True)
    return out


_ENGINE = [None]


def _ones_kernel(h):
    return np.ones(h.shape, h.dtype)


def _run_backward(heads, head_grads, retain_graph, create_graph, wanted=None):
    if not _MODS:
        from . import ndarray
        from .ops import math
        _MODS[:] = [ndarray, math]
    nd, M = _MODS
    heads = list(heads)
    if head_grads is None:
        head_grads = [None] * len(heads)
    if len(head_grads) != len(heads):
        raise ValueError(f"backward: {len(heads)} head(s) but {len(head_grads)} head gradient(s)")
    grads = {}
    for h, hg in zip(heads, head_grads):
        if h._ag is None and h._grad_req == "null":
            raise ValueError("backward: the head array is not part of a recorded graph; compute "
                             "it inside autograd.record() from arrays that called attach_grad()")
        if hg is None:
            hg = _ones_after(h, nd)
        elif isinstance(hg, np.ndarray):      # NumPy data: taken in the head's dtype
            hg = nd.array(hg.astype(h.dtype, copy=False), dtype=h.dtype, device=h.device)
        if not isinstance(hg, nd.NDArray):
            raise TypeError(f"backward: head gradient: expected an NDArray (one per head, or "
                            f"None), got {type(hg).__name__}")
        elif hg.shape != h.shape:
            raise ValueError(f"backward: out_grad shape {hg.shape} differs from the head's shape {h.shape}")
        elif hg.dtype != h.dtype:
            raise TypeError(f"backward: head gradient dtype {hg.dtype} differs from the head's "
                            f"dtype {h.dtype}; cast it with .astype('{h.dtype}')")
        grads[id(h)] = (h, hg) if id(h) not in grads else (h, M.add(grads[id(h)][1], hg))
    order = _topo(heads)
    leaves = {}
    wanted_ids = {id(v) for v in wanted} if wanted is not None else ()
    kept = {}
    with _Scope(create_graph, None):
        for node in reversed(order):
            ogs = []
            for o in node.outputs:
                e = grads.pop(id(o), (None, None))
                if id(o) in wanted_ids:
                    kept[id(o)] = e
                ogs.append(e[1])
            if all(g is None for g in ogs):
                continue
            _check_versions(node)
            needs = tuple(x.dtype.kind == "f" and (x._ag is not None or x._grad_req != "null")
                          for x in node.inputs)
            ctx = GradCtx(node.inputs, node.outputs, node.attrs, needs)
            igs = node.op.grad(ctx, ogs[0]) if len(ogs) == 1 else node.op.grad(ctx, *ogs)
            for x, g in zip(node.inputs, igs):
                if g is None or x.dtype.kind != "f":
                    continue
                if x._ag is None and x._grad_req == "null":
                    continue
                k = id(x)
                if k in grads:
                    grads[k] = (x, M.add(grads[k][1], g))
                else:
                    grads[k] = (x, g)
                if x._ag is None:
                    leaves[k] = x
            if not retain_graph:
                node.freed = True
    if wanted is not None:
        kept.update({k: v for k, v in grads.items() if k in wanted_ids})
        return kept
    for h in heads:                      # a head that is itself a variable
        if h._ag is None and h._grad_req != "null":
            leaves[id(h)] = h
    groups = {}                # gradients made by the same op are bound by one assign op
    noted = {}                 # device -> accumulated (buffer, gradient) pairs
    for k, x in leaves.items():
        g = grads.get(k)
        if g is None or x._grad is None:
            continue
        g = g[1]
        add = x._grad_req == "add"
        plain = type(x._grad) is nd.NDArray and g.shape == x._grad.shape
        if add and plain and not create_graph and not _tracked(g):
            # accumulated by ONE op that reads and writes .grad (an add op and an assign op
            # let another thread's backward land in between and be lost); a micro-batch whose
            # gradient failed leaves the sum of the others (skip_clean), as with the naive
            # engine, where its backward raised before this, and fails the buffer's status
            # (_note_failures)
            x._grad._fresh = True
            x._grad._inplace(M.add, g, priority=1, skip_clean=True)
            noted.setdefault(x._grad.device, []).append((x._grad, g))
            continue
        if add:
            g = M.add(x._grad, g)
        x._grad._fresh = True
        if not plain:
            x._grad._assign(g, skip_clean=add)
            if add:
                noted.setdefault(x._grad.device, []).append((x._grad, g))
            continue
        if add:
            x._grad._assign(g, priority=1, skip_clean=True)
            noted.setdefault(x._grad.device, []).append((x._grad, g))
            continue
        # above compute (priority 1): a gradient is bound as soon as the op that makes it has
        # run, so its allreduce (kvstore 'dist'/'device') can start while backward of earlier
        # layers still runs; gradients of one op (a compiled backward) share one assign op
        key = (id(getattr(g._var, "_writer", None)), x._grad.device)
        groups.setdefault(key, []).append((x._grad, g))
    for pairs in groups.values():
        if len(pairs) == 1:
            pairs[0][0]._assign(pairs[0][1], priority=1)
        else:
            nd.assign_many(pairs, priority=1)
    for dev, pairs in noted.items():
        _note_failures(dev, pairs)
    return None


def _note_failures(device, pairs):
    """Accumulating gradient buffers keep their values when a micro-batch's gradient failed
    (the others' sum stays usable); their status Vars take that error instead (one op per
    device and backward: a failed gradient fails them all), so that the Trainer skips a
    step that contains the failure (see Trainer.step). ``pairs``: (buffer, gradient)."""
    from . import engine as _engine
    sts = []
    for buf, _ in pairs:
        st = getattr(buf, "_status", None)
        if st is None:
            st = buf._status = _engine.Var("grad_status")
        sts.append(st)
    _engine.push(_nothing, [g._var for _, g in pairs] + sts, sts, device, 1, name="grad_status",
                 pure=True)


def _nothing():
    pass


def backward(heads, head_grads=None, retain_graph=False):
    """Accumulate d(sum of heads)/d(variable) into each variable's ``.grad``.

    Args:
        heads: an NDArray or a list of NDArrays.
        head_grads: matching output gradients (default ones).
        retain_graph: keep the recorded graph for another backward.

    Raises:
        ValueError: a head is not part of a recorded graph, or a head gradient's shape differs.
        TypeError: a head gradient is not an NDArray, or its dtype differs from the head's.
        RuntimeError: the graph was freed by an earlier backward.
    """
    if not isinstance(heads, (list, tuple)):
        heads = [heads]
        head_grads = None if head_grads is None else [head_grads]
    _run_backward(heads, head_grads, retain_graph, False)


def grad(heads, variables, head_grads=None, retain_graph=None, create_graph=False):
    """Gradients of ``heads`` w.r.t. ``variables`` returned as a list (``.grad`` untouched).

    With ``create_graph=True`` the backward ops are themselves recorded, so the returned
    gradients can be differentiated again (higher-order derivatives). A variable the heads do
    not depend on gets zeros of its shape (as ``allow_unused`` in PyTorch, with zeros for None).

    Raises:
        ValueError: a head is not part of a recorded graph, or a head gradient's shape differs.
        TypeError: a head gradient is not an NDArray, or its dtype differs from the head's.
        RuntimeError: the graph was freed by an earlier backward, or a value its gradient reads
            was modified after recording.
    """
    from . import ndarray as nd
    if not isinstance(heads, (list, tuple)):
        heads = [heads]
        if isinstance(head_grads, (list, tuple)) and len(head_grads) == 1:
            head_grads = list(head_grads)       # one head, its gradient given as a list
        else:
            head_grads = None if head_grads is None else [head_grads]
    single = not isinstance(variables, (list, tuple))
    vs = [variables] if single else list(variables)
    saved = [(v._grad_req) for v in vs]
    for v in vs:                          # make plain variables count as leaves
        if v._ag is None and v._grad_req == "null":
            v._grad_req = "write"
    try:
        got = _run_backward(heads, head_grads, create_graph if retain_graph is None else retain_graph,
                            create_graph, wanted=vs)
    finally:
        for v, r in zip(vs, saved):
            v._grad_req = r
    out = []
    for v in vs:
        g = got.get(id(v))
        g = nd.zeros_like(v) if g is None else g[1]
        # in the variable's dtype, as its .grad would be (a float64 factor makes a float64
        # gradient of a float32 variable)
        out.append(g.astype(v.dtype) if g.dtype != v.dtype else g)
    return out[0] if single else out
