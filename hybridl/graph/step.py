"""Whole-step compilation: forward, loss, backward and the optimizer update in ONE program.

``step = hl.TrainStep(net, loss_fn, trainer)`` then ``loss = step(data, label)`` does what the
Gluon loop does::

    with autograd.record():
        loss = loss_fn(net(data), label)
    loss.backward()
    trainer.step(data.shape[0])

but as one compiled program pushed as one engine op (as ``jax.jit`` of a train step, or
``torch.compile`` of a step with ``backward()`` and ``optimizer.step()`` inside). The program is
the ``gradient`` pass's joint forward+backward graph of ``sum(loss)`` followed by one update
node per trained parameter; each update runs as soon as its gradient exists and every other
reader of that weight has run, so a layer's gradient buffer is reused by the next layer's (the
memory plan covers the gradients too, which a separate backward program must hand out). The
largest ReLU output that would otherwise stay alive while the next layer's input gradient is
computed is compared with 0 at its weight gradient instead (a bool mask), when that lowers the
plan's peak (``_release_relu_inputs``: MLP 784-256-128-10 at batch 256, 0.625 -> 0.5625 MiB,
for one unfused update: ~1-5% slower there).

Differences from the loop, by design:

* ``Parameter.grad()`` is not written: the gradients live only inside the program (as under
  ``jax.jit``). Use the loop when you need them (gradient clipping by global norm, logging).
* one device, no kvstore: for several devices or processes use the loop with a kvstore.
* parameters with ``grad_req='add'`` are refused (their accumulated ``.grad`` is not kept).

Everything else is the loop's: the same parameters, optimizer and optimizer state (momentum,
Adam moments, update counts; ``trainer.save_states`` works), ``trainer.set_learning_rate``,
``lr_mult``/``wd_mult``, BatchNorm running statistics, Dropout drawing from ``hl.random`` in
the same order. Results equal the loop's bit for bit, except that a plain-SGD weight whose
gradient GEMM and update are fused (``fuse_updates=True``, the default: one BLAS ``gemm`` with
``beta``, whose rounding differs in the last bit) agrees to float rounding (tests: float32,
rtol 1e-5); ``fuse_updates=False`` gives the loop's bits. One difference on a failed batch
(e.g. a label out of range): the step is one program, so none of it is kept -- weights,
optimizer states and BatchNorm running statistics stay as they were (its random draws are
used up, as the loop's) -- while the loop keeps the running statistics of the forward that
ran before its loss failed.

Parameters the loss does not depend on (an auxiliary head left out of it, a layer behind
``stop_gradient``) get no gradient and are not updated, as in the loop (a RuntimeWarning
names them when the step is compiled).
"""
import itertools
import warnings

import numpy as np

from .. import autograd
from .. import engine as _engine
from ..ndarray import NDArray
from ..ops import _blas
from ..ops.math import _dot2
from ..ops.registry import Op
from . import trace as _trace
from .autodiff import gradient
from .hybrid import _Cache, _last_writes, _param_arrays, trace_graph, unused_draws
from .ir import Graph, Node, Symbol, TracingError, const
from .passes import DEFAULT_PASSES, PASSES, _VIEW_OPS, run_passes
from .program import Program, _graph_cost

__all__ = ["TrainStep"]

# one row of the per-call hyper-parameter input: lr, wd, t, rescale, owned, clip (nan: none)
_HP = 6
_TOKEN = np.zeros((), np.float32)
# the engine's cost key of each TrainStep program: a number never reused (a new program at a
# freed one's address must not inherit its run times)
_PROGRAM_NUMBERS = itertools.count()


def _update_kernel(w, g, hp, *deps, slot, step, scratch, out=None):
    """The optimizer update of one weight, in place when nobody else can see it (the row
    ``hp[slot]`` holds the values taken when the step was pushed, and the update count ``t``
    set when it runs); ``deps`` only order it after every other reader of ``w``. Returns a
    0-d token (the node's value)."""
    lr, wd, t, rescale, owned, clip = hp[slot]
    holder = step.weights[slot]
    step.updated += 1                   # from here on the step has changed state
    res = step.opt.step_kernel(w, g, step.states[slot]["arrays"], lr, wd, int(t), rescale,
                                None if clip != clip else clip,         # nan: no clipping
                                out=w if owned else None, scratch=g if scratch else None)
    if res is not w:
        holder._data = res
    return _TOKEN


def _update_infer(w, g, hp, *deps, slot, step, scratch):
    return [((), np.dtype(np.float32))]


def _update_cost(in_shapes, out_shapes, itemsize, **attrs):
    n = float(np.prod(in_shapes[0]))
    return 3.0 * n, 5.0 * n * itemsize       # as SGD: scale, subtract; g, w read, w written


_UPDATE = Op("optimizer_update", _update_kernel, _update_infer, None, cost=_update_cost,
             differentiable=False)


def _gemm_update_kernel(w, g, x, hp, *deps, slot, step, out=None):
    """The weight gradient ``g.T @ x`` and its update in one: when the optimizer's update is
    ``w = beta w + alpha grad`` (:meth:`~hybridl.optim.Optimizer.gemm_coefficients`: plain
    SGD) and ``w`` may be written in place, ONE GEMM with accumulation (BLAS ``?gemm``'s
    ``C = alpha A B + beta C``, as MXNet's ``kAddTo`` / PyTorch's ``addmm_``) updates ``w``
    and no gradient is stored; otherwise the gradient is computed and the optimizer's own
    kernel applies it."""
    lr, wd, t, rescale, owned, clip = hp[slot]
    coef = (step.opt.gemm_coefficients(lr, wd, rescale, None if clip != clip else clip)
            if owned else None)
    if coef is not None and _blas.gemm_tn_accumulate(coef[0], g, x, coef[1], w):
        step.updated += 1               # (one BLAS call: it writes w whole or not at all)
        return _TOKEN
    _blas.for_gemm()
    grad = _dot2(g.T, x)
    return _update_kernel(w, grad, hp, slot=slot, step=step, scratch=True)


def _gemm_update_infer(w, g, x, hp, *deps, slot, step):
    return [((), np.dtype(np.float32))]


def _gemm_update_cost(in_shapes, out_shapes, itemsize, **attrs):
    (u, k), b = in_shapes[0], in_shapes[1][0]
    return 2.0 * b * u * k + 2.0 * u * k, float((2 * u * k + b * (u + k)) * itemsize)


_GEMM_UPDATE = Op("gemm_update", _gemm_update_kernel, _gemm_update_infer, None,
                  cost=_gemm_update_cost, differentiable=False)
_UPDATES = (_UPDATE, _GEMM_UPDATE)


def _uses(graph):
    """(value key -> number of node inputs reading it, keys of the program outputs)."""
    count = {}
    for n in graph.nodes:
        for s in n.inputs:
            count[s.key()] = count.get(s.key(), 0) + 1
    return count, {s.key() for s in graph.outputs}


def _fuse_gemm_updates(graph, keep=()):
    """update(w, matmul(transpose(g), x)) -> gemm_update(w, g, x): a weight gradient read by
    its update only (2-D, same float dtype) is never stored. Not when ``g`` or ``x`` may share
    memory with a weight that is updated in place (the GEMM would read what it writes, or
    another update could run first), nor for an ``x`` in ``keep`` (value keys released at
    their product, see :func:`_release_relu_inputs`)."""
    aliases = _weight_aliases(graph)
    count, outs = _uses(graph)

    def rw(node, ins):
        if node.op is not _UPDATE:
            return None
        w, gs, hp = ins[:3]
        mm = gs.node
        if (mm.kind != "op" or mm.op.name != "matmul" or count.get(gs.key(), 0) != 1
                or gs.key() in outs):
            return None
        a, x = mm.inputs
        tr = a.node
        if tr.kind != "op" or tr.op.name != "transpose" or len(a.shape) != 2:
            return None
        g = tr.inputs[0]
        if aliases.get(g.key()) or aliases.get(x.key()) or x.key() in keep:
            return None
        if (len(g.shape) != 2 or len(x.shape) != 2 or g.shape[0] != x.shape[0]
                or tuple(w.shape) != (g.shape[1], x.shape[1])
                or not (w.dtype == g.dtype == x.dtype) or w.dtype.kind != "f"):
            return None
        attrs = {"slot": node.attrs["slot"], "step": node.attrs["step"]}
        return Node("op", _GEMM_UPDATE, [w, g, x, hp], attrs, node.specs, node.name).outputs()
    from .ir import rebuild
    return rebuild(graph, rw)


def _mask_kernel(y, out=None):
    return np.greater(y, 0, out=out)


def _masked_kernel(g, mask, out=None):
    # the relu_grad kernel's product (np.multiply(g, y > 0)) with the comparison made earlier
    return np.multiply(g, mask, out=out)


# (ew: elementwise, as relu_grad's expression; the memory plan then writes the product into
# the buffer of a g that dies there)
_RELU_MASK = Op("relu_mask", _mask_kernel, lambda y: [(y.shape, np.dtype(bool))], None,
                differentiable=False, ew="({0} > 0)")
_RELU_GRAD_MASKED = Op("relu_grad_masked", _masked_kernel, lambda g, m: [(g.shape, g.dtype)],
                       None, differentiable=False, ew="where({1}, {0} * 1, {0} * 0)")
#: activations smaller than this keep their relu_grad (the early mask is one more op, ~1 us)
MASK_MIN_BYTES = 64 * 1024


def _release_relu_inputs(graph):
    """Let a ReLU output ``y`` die at its layer's weight gradient, not after the input
    gradient: when ``y`` is read, after the weight-gradient product ``matmul(transpose(g), y)``
    of the next layer, only by the relu_grad of its own layer, the comparison ``y > 0`` is
    made right after that product (a bool mask, a quarter of ``y``'s bytes) and the relu_grad
    multiplies by the mask. Otherwise ``y`` stays alive while ``g @ w``, the input gradient
    of ``y``'s size, is computed (it must read ``w`` before the update writes it), and that is
    the training step's peak: for the MLP 784-256-128-10 at batch 256, y (256 KiB), g and
    ``g @ w`` (256 KiB) at once, 0.625 MiB; with the mask 0.5625 MiB (the mask, the weight
    gradient, g and ``g @ w``). Same values (the same product, mask computed earlier).

    Only the largest such ``y`` (the first of equals): the peak is at most at one place, and
    every release costs a mask op and an update not fused with its GEMM (the caller keeps the
    result only when the peak went down, :func:`_lower_peak`).

    Returns (graph, keys of the released ``y``): their weight-gradient products must stay
    separate ops (a fused gemm_update would read ``y`` after ``g @ w``)."""
    at = _release_candidates(graph)
    if not at:
        return graph, set()
    big = max(at, key=lambda k: (int(np.prod(at[k].shape)) * at[k].dtype.itemsize, -k))
    at = {big: at[big]}
    mapping, masks, released = {}, {}, set()
    for n in graph.nodes:                   # every node copied: creation order = this order
        if n.kind != "op":
            for i in range(len(n.specs)):
                mapping[(n.id, i)] = Symbol(n, i)
            continue
        ins = [mapping[s.key()] for s in n.inputs]
        if n.op.name == "relu_grad" and n.inputs[1].key() in masks:
            new = Node("op", _RELU_GRAD_MASKED, [ins[0], masks[n.inputs[1].key()]], {},
                       n.specs, n.name)
        else:
            new = Node("op", n.op, ins, n.attrs, n.specs, n.name)
        for i, o in enumerate(new.outputs()):
            mapping[(n.id, i)] = o
        y = at.get(n.id)
        if y is not None:                   # right after y's weight-gradient product
            ny = mapping[y.key()]
            masks[y.key()] = Node("op", _RELU_MASK, [ny], {}, [(tuple(ny.shape), np.dtype(bool))],
                                  "relu mask").out()
            released.add(ny.key())
    return Graph(graph.inputs, [mapping[s.key()] for s in graph.outputs]), released


def _lower_peak(plain, released):
    """The program of the two whose memory plan has fewer bytes live at once (``plain`` on a
    tie)."""
    if released.memory_plan.live_peak_bytes < plain.memory_plan.live_peak_bytes:
        return released
    return plain


def _release_candidates(graph):
    """matmul node id -> the ReLU output ``y`` it may release (see _release_relu_inputs)."""
    count, outs = _uses(graph)
    pos = {n.id: i for i, n in enumerate(graph.nodes)}
    readers = {}
    for n in graph.nodes:
        for s in n.inputs:
            readers.setdefault(s.key(), []).append(n)
    at = {}                                 # matmul node id -> y (the value it releases)
    for n in graph.nodes:
        if n.kind != "op" or n.op is not _UPDATE:
            continue
        gs = n.inputs[1]
        mm = gs.node
        if (mm.kind != "op" or mm.op.name != "matmul" or count.get(gs.key(), 0) != 1
                or gs.key() in outs):
            continue
        a, y = mm.inputs
        if a.node.kind != "op" or a.node.op.name != "transpose" or y.key() in outs:
            continue
        if y.dtype.kind != "f" or int(np.prod(y.shape)) * y.dtype.itemsize < MASK_MIN_BYTES:
            continue
        later = [r for r in readers.get(y.key(), ()) if pos[r.id] > pos[mm.id]]
        if later and all(r.kind == "op" and r.op.name == "relu_grad"
                         and r.inputs[1].key() == y.key() and r.inputs[0].key() != y.key()
                         for r in later):
            at[mm.id] = y
    return at


def _weight_aliases(graph):
    """Value key -> keys of the updated weights it may share memory with: a weight itself,
    and what views (or ops that may return views: no ``out=``) make of it."""
    al = {}
    for n in graph.nodes:
        if n.kind == "op" and n.op in _UPDATES:
            al[n.inputs[0].key()] = {n.inputs[0].key()}
    for n in graph.nodes:
        if n.kind != "op" or n.op in _UPDATES:
            continue
        if n.op.name in _VIEW_OPS or not n.op.out_ok:
            src = set().union(*(al.get(s.key(), ()) for s in n.inputs))
            if src:
                for o in n.outputs():
                    al[o.key()] = src
    return al


def _copy_kernel(x, out=None):
    if out is None:
        return np.array(x, copy=True)
    np.copyto(out, x)
    return out


_COPY = Op("copy", _copy_kernel, lambda x: [(x.shape, x.dtype)], None, differentiable=False)


def _protect(graph):
    """Copies where a value that may share memory with a weight updated in place must keep
    the old value: a program output (e.g. a net returning a view of its weight) and the
    gradient read by an update (e.g. d(a*b)/da = b, another weight)."""
    al = _weight_aliases(graph)
    if len(al) == sum(1 for n in graph.nodes if n.kind == "op" and n.op in _UPDATES):
        return graph            # nothing but the weights themselves: nothing to copy

    def rw(node, ins):
        if node.op is _UPDATE and al.get(node.inputs[1].key()):
            ins = list(ins)
            ins[1] = Node("op", _COPY, [ins[1]], {}, [(ins[1].shape, ins[1].dtype)], "copy").out()
            return Node("op", node.op, ins, node.attrs, node.specs, node.name).outputs()
        return None
    from .ir import rebuild
    g = rebuild(graph, rw)
    al = _weight_aliases(g)
    outs = [Node("op", _COPY, [s], {}, [(s.shape, s.dtype)], "copy").out() if al.get(s.key())
            else s for s in g.outputs]
    return Graph(g.inputs, outs)


def _fuse_loss_and_grad(graph):
    """softmax_cross_entropy(z, y) and softmax_cross_entropy_grad(d, z, y) -> one node making
    both (labels checked and softmax computed once), when the loss is only a program output."""
    from ..ops.nn import SCE, SCE_GRAD, SCE_WITH_GRAD
    used, _ = _uses(graph)
    losses = {tuple(s.key() for s in n.inputs): n for n in graph.nodes
              if n.kind == "op" and n.op is SCE and n.outputs()[0].key() not in used}
    loss_ids = {a.id for a in losses.values()}
    copies, fused = {}, {}

    def rw(node, ins):
        if node.op is SCE and node.id in loss_ids:
            nn = Node("op", node.op, ins, node.attrs, node.specs, node.name)
            copies[node.id] = nn
            return nn.outputs()
        if node.op is SCE_GRAD:
            a = losses.get(tuple(s.key() for s in node.inputs[1:]))
            if a is not None and a.id in copies:
                d = node.inputs[0]
                unit = (d.node.kind == "const" and d.node.value.size > 0
                        and bool(np.all(d.node.value == 1)))
                f = Node("op", SCE_WITH_GRAD, ins, {"unit": unit},
                         copies[a.id].specs + node.specs, "softmax_cross_entropy_with_grad")
                fused[copies[a.id].id] = f.out(0)
                return [f.out(1)]
        return None
    from .ir import rebuild
    g = rebuild(graph, rw)
    outs = [fused.get(s.node.id, s) if s.index == 0 else s for s in g.outputs]
    return Graph(g.inputs, outs)


def _substitute(graph, inputs, sub, extra=()):
    """Copy ``graph`` with leaf values replaced by ``sub`` (key -> Symbol); ``inputs``: the
    new program inputs. Returns the new Graph and the copies of the ``extra`` Symbols (values
    of ``graph`` that are not among its outputs, e.g. side effects)."""
    mapping = {}
    for n in Graph(graph.inputs, list(graph.outputs) + list(extra)).nodes:
        if n.kind != "op":
            for i in range(len(n.specs)):
                mapping[(n.id, i)] = sub.get((n.id, i), Symbol(n, i))
            continue
        nn = Node("op", n.op, [mapping[s.key()] for s in n.inputs], n.attrs, n.specs, n.name)
        for i, o in enumerate(nn.outputs()):
            mapping[(n.id, i)] = o
    return (Graph(inputs, [mapping[s.key()] for s in graph.outputs]),
            [mapping[s.key()] for s in extra])


def _schedule_updates(graph):
    """Give each update node the outputs of every other reader of its weight (and of views of
    it) as extra inputs, and place it right after the last of its inputs: the weight is
    written in place only once nobody reads it any more, and the gradient dies there. Nodes
    are recreated in the new order (a Graph orders its nodes by creation)."""
    nodes = graph.nodes
    consumers = {}
    for n in nodes:
        for s in n.inputs:
            consumers.setdefault(s.key(), []).append(n)

    def readers(w):
        """Nodes reading ``w`` or a value that may alias it (views; ops without ``out=``)."""
        found, todo, seen = [], [w.key()], set()
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            for c in consumers.get(k, ()):
                if c.op in _UPDATES:
                    continue
                found.append(c)
                if c.op.name in _VIEW_OPS or not c.op.out_ok:
                    todo.extend(o.key() for o in c.outputs())
        return found

    def ancestors(syms):
        seen, todo = set(), [s.node for s in syms]
        while todo:
            m = todo.pop()
            if m.id not in seen:
                seen.add(m.id)
                todo.extend(s.node for s in m.inputs)
        return seen

    deps = {}
    for n in nodes:
        if n.kind == "op" and n.op in _UPDATES:
            # readers the update already depends on (the forward) need no extra edge, which
            # would keep their outputs alive until the update
            before = ancestors(n.inputs)
            rs = {c.id: c for c in readers(n.inputs[0]) if c.id not in before}
            deps[n.id] = [c.outputs()[0] for c in rs.values()]
    order = [n for n in nodes if n.kind == "op" and n.op not in _UPDATES]
    pos = {n.id: i for i, n in enumerate(order)}
    after = {}                      # index in ``order`` -> update nodes placed after it
    for n in nodes:
        if n.kind == "op" and n.op in _UPDATES:
            last = max((pos.get(s.node.id, -1) for s in n.inputs + deps[n.id]), default=-1)
            after.setdefault(last, []).append(n)
    sequence = after.get(-1, [])
    for i, n in enumerate(order):
        sequence.append(n)
        sequence.extend(after.get(i, []))
    mapping = {}
    for n in nodes:
        if n.kind != "op":
            for i in range(len(n.specs)):
                mapping[(n.id, i)] = Symbol(n, i)
    for n in sequence:
        ins = [mapping[s.key()] for s in n.inputs]
        if n.op in _UPDATES:
            ins += [mapping[s.key()] for s in deps[n.id]]
        nn = Node("op", n.op, ins, n.attrs, n.specs, n.name)
        for i, o in enumerate(nn.outputs()):
            mapping[(n.id, i)] = o
    return Graph(graph.inputs, [mapping[s.key()] for s in graph.outputs])


class _Entry:
    """One cached program and what its update nodes write (``opt``, ``weights``, ``states``:
    bound by each call's engine op before the program runs; calls are serialized by the
    engine, as each writes the weights)."""
    __slots__ = ("prog", "params", "upd", "tindex", "upd_pos", "read_pos", "side", "ckey",
                 "random", "cost", "owned", "opt", "weights", "states", "updated")


class TrainStep:
    """A compiled training step: ``loss = step(data, label)`` (see the module docstring).

    Args:
        net (Block): the model; it may be hybridized or not (it is traced either way).
        loss_fn (callable): ``loss_fn(net(data), label)`` -> per-sample losses (N,), e.g.
            ``hl.loss.SoftmaxCrossEntropyLoss()``.
        trainer (Trainer): its optimizer, hyper-parameters and state are used and updated.
        passes: compiler passes (names), default :data:`hybridl.graph.DEFAULT_PASSES`.
        return_outputs (bool): also return the net's outputs (e.g. for accuracy).
        fuse_updates (bool): compute a plain-SGD weight gradient and its update as one GEMM
            with accumulation (faster, no gradient buffer; last-bit rounding differs from the
            loop). False: bit-identical to the loop.

    Call ``step(data, label, batch_size=None)``: data and label NDArrays on one device;
    ``batch_size`` (default ``data.shape[0]``) scales the gradients by 1 / batch_size as
    ``trainer.step(batch_size)``. Returns the per-sample losses (an NDArray, asynchronous),
    or ``(losses, outputs)`` with ``return_outputs``.
    One program per signature (shapes, dtypes, device); ``cache_info()`` as hybridized blocks.
    ``last_program`` is the compiled :class:`~hybridl.graph.program.Program` (``.source``,
    ``.memory_plan``).

    Raises:
        TypeError: ``trainer`` is not a Trainer, ``passes`` not a list of names or functions,
            data or label not NDArrays.
        TracingError: the forward or the loss needs a traced value in Python (``float(x)``,
            ``if x > 0``); train such models with the loop.
        ValueError: the trainer has a kvstore or parameters on several devices, a trained
            parameter has ``grad_req='add'``, the loss is not a float array, data and label on
            different devices, or ``batch_size`` <= 0.
    """

    def __init__(self, net, loss_fn, trainer, passes=None, return_outputs=False,
                 fuse_updates=True):
        from ..optim.trainer import Trainer
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer: expected an hl.Trainer, got {type(trainer).__name__}")
        if not callable(net) or not callable(loss_fn):
            raise TypeError("net and loss_fn: expected callables (a Block and a loss)")
        if trainer._kv_spec is not None:
            raise ValueError(f"trainer: TrainStep runs on one device without a kvstore, got "
                             f"kvstore={trainer._kv_spec!r}; use the record/backward/step loop")
        self.net, self.loss_fn, self.trainer = net, loss_fn, trainer
        if passes is not None and not isinstance(passes, (list, tuple)):
            raise TypeError(f"passes: expected a list of pass names or functions, got "
                            f"{type(passes).__name__} {passes!r}")
        self._passes = tuple(DEFAULT_PASSES if passes is None else passes)
        for p in self._passes:
            if isinstance(p, str):
                if p not in PASSES:
                    raise ValueError(f"passes: unknown pass {p!r}; known: {sorted(PASSES)}")
            elif not callable(p):
                raise TypeError(f"passes: expected pass names or functions Graph -> Graph, got "
                                f"{type(p).__name__} {p!r}")
        from .passes import check_passes
        check_passes(list(self._passes))    # ('gradient' is hl.compile's only), as hybridize
        self._fuse_updates = bool(fuse_updates)
        self._cache = _Cache()
        self._last = None
        self._return_outputs = bool(return_outputs)

    # ------------------------------------------------------------------ building
    def _build(self, data, label):
        want_out = self._return_outputs

        def fn(x, y):
            out = self.net(x)
            loss = self.loss_fn(out, y)
            if not isinstance(loss, Symbol):
                raise ValueError(f"loss_fn: expected one array of per-sample losses computed "
                                 f"from the net's output, got {type(loss).__name__}")
            if want_out and not isinstance(out, Symbol):
                raise ValueError(f"return_outputs: the net returned {type(out).__name__}; "
                                 f"TrainStep returns the net's output when it is one array")
            return (loss, out) if want_out else loss

        with autograd.train_mode():
            try:
                inputs, outs, _, ctx = trace_graph(fn, [data, label])
            except TracingError as err:
                raise TracingError(f"{err} (TrainStep always compiles the whole step: for "
                                   f"value-dependent Python, train with the record/backward/"
                                   f"step loop)") from None
        loss, net_out = outs[0], (outs[1] if want_out else None)
        if loss.dtype.kind != "f":
            raise ValueError(f"loss_fn: expected a float loss, got dtype {loss.dtype}")
        params = ctx.params
        tr = self.trainer
        tr._warn_unfrozen("TrainStep", 4)
        index = {}
        for i, p in enumerate(tr._params):     # a parameter listed twice: its first entry,
            index.setdefault(id(p), i)          # as the loop's state
        for p in params:
            if id(p) in index and len(p.list_device()) > 1:
                raise ValueError(f"parameter {p.name!r} lives on {len(p.list_device())} devices; "
                                 f"TrainStep runs on one device (use the loop with a kvstore)")
            if id(p) in index and p.grad_req == "add":
                raise ValueError(f"parameter {p.name!r} has grad_req='add'; TrainStep does not "
                                 f"keep .grad (use the record/backward/step loop)")
        n_data = 2
        wrt = [n_data + j for j, p in enumerate(params)      # frozen since: not trained
               if id(p) in index and p.dtype.kind == "f" and p.grad_req != "null"]
        if not wrt:         # computing losses only (a frozen net) is allowed, but say so
            warnings.warn("TrainStep: no parameter of the trainer that the forward uses has a "
                          "gradient (all frozen with grad_req='null', or not used): the step "
                          "computes the loss and trains nothing", RuntimeWarning, stacklevel=3)
        unused = [p.name for p in tr._params if all(p is not q for q in params)]
        if unused:
            warnings.warn(f"TrainStep: trainer parameters {unused} are not used by the forward "
                          f"and are never updated", RuntimeWarning, stacklevel=3)
        side_params, side_vals = _last_writes(ctx)
        joint, cots, wrt = gradient(Graph(inputs, [loss]), wrt)
        dead = set(joint.no_grad)       # no differentiable path to the loss: not updated,
        if dead:                        # as the loop's Trainer skips a stale gradient
            names = [params[wrt[k] - n_data].name for k in sorted(dead)]
            warnings.warn(f"TrainStep: parameters {names} get no gradient from the loss "
                          f"(unused by it, or behind stop_gradient) and are not updated",
                          RuntimeWarning, stacklevel=3)
        live = [k for k in range(len(wrt)) if k not in dead]
        # the head gradient of loss.backward() is ones: a constant the passes can fold
        ones = const(np.ones(loss.shape, loss.dtype))
        hp = Node("input", specs=[((max(len(live), 1), _HP), np.float64)], name="hyperparams").out()
        # unused random draws (a Dropout in a head the loss leaves out) run and are dropped,
        # so that the random stream advances as in the loop (see hybrid.unused_draws)
        outs_kept = [net_out] if self._return_outputs else []
        dropped = unused_draws(ctx, [loss] + side_vals + outs_kept)
        ns, n_drop = len(side_vals), len(dropped)
        g, extra = _substitute(joint, inputs + [hp], {cots[0].key(): ones},
                               side_vals + dropped + outs_kept)
        side_vals, dropped, out_vals = extra[:ns], extra[ns:ns + n_drop], extra[ns + n_drop:]
        grads = g.outputs[1:]
        e = _Entry()
        upd, tokens = [], []
        for slot, k in enumerate(live):
            i, gsym = wrt[k], grads[k]
            p = params[i - n_data]
            upd.append(p)
            node = Node("op", _UPDATE, [inputs[i], gsym, hp],
                        {"slot": slot, "step": e, "scratch": False}, [((), np.float32)],
                        f"update {p.name}")
            tokens.append(node.out())
        graph = Graph(inputs + [hp], [g.outputs[0]] + tokens + side_vals + dropped + out_vals)
        # every pass but the memory plan, then the updates' order, then the plan
        planner = PASSES["plan_memory"]
        plan = any(p == "plan_memory" or p is planner for p in self._passes)
        graph = run_passes(graph, [p for p in self._passes if p != "plan_memory" and p is not planner])
        graph = _fuse_loss_and_grad(graph)
        prog = self._program(graph, plan)
        if plan:
            # the largest ReLU output released at its weight gradient: kept only when that
            # lowers the plan's peak (elsewhere it costs a mask op and an unfused update)
            released_graph, released = _release_relu_inputs(graph)
            if released:
                prog = _lower_peak(prog, self._program(released_graph, plan, released))
        e.prog, e.params, e.upd, e.side = prog, params, upd, side_params
        e.tindex = [index[id(p)] for p in upd]
        pos = {id(p): j for j, p in enumerate(params)}
        e.upd_pos = [pos[id(p)] for p in upd]
        updated = set(e.upd_pos)
        e.read_pos = [j for j in range(len(params)) if j not in updated]
        from ..optim.optimizer import _owned     # (optim imports nn, which imports graph)
        e.owned = _owned
        e.random = prog.op.random
        flops, nbytes = _graph_cost(prog.graph)
        e.cost = {"flops": flops, "bytes": nbytes}
        e.ckey = ("train_step", next(_PROGRAM_NUMBERS))   # not id(): ids are reused
        return e

    def _program(self, graph, plan, released=frozenset()):
        """The program of ``graph`` (updates included) after the step's own rewrites;
        ``released``: the values _release_relu_inputs released in it."""
        if self._fuse_updates:
            graph = _fuse_gemm_updates(_protect(graph), keep=released)
        else:
            graph = _protect(graph)
        graph = _schedule_updates(_allow_scratch(graph))
        return Program(graph, ["plan_memory"] if plan else [], "train_step")

    # ------------------------------------------------------------------ running
    def __call__(self, data, label, batch_size=None):
        if not isinstance(data, NDArray) or not isinstance(label, NDArray):
            raise TypeError(f"data, label: expected NDArrays, got {type(data).__name__} and "
                            f"{type(label).__name__} (wrap with hl.nd.array)")
        dev = data.device
        if label.device != dev:
            raise ValueError(f"label: on {label.device!r} but data on {dev!r}; copy it with "
                             f"label.copyto({dev!r})")
        if batch_size is None:
            bs = data.shape[0] if data.shape else 0
            if not bs:
                raise ValueError(f"data: expected a batch of at least one sample (shape (N, ...)), "
                                 f"got shape {data.shape}")
        else:
            from ..optim.trainer import check_batch_size
            check_batch_size(batch_size)
            bs = batch_size
        cache = self._cache
        if cache.version != _trace.STRUCTURE_VERSION[0]:
            cache.entries = {}
            cache.version = _trace.STRUCTURE_VERSION[0]
        sig = ((tuple(data.shape), data.dtype.str, dev), (tuple(label.shape), label.dtype.str),
               tuple([p._grad_req for p in self.trainer._params]))
        e = cache.entries.get(sig)
        if e is None:
            cache.miss(_step_miss_reason(sig, list(cache.entries)), "TrainStep",
                       kind=(sig[0][:2],) + sig[1:], full=sig)
            try:
                e = self._build(data, label)
            except BaseException:
                cache.failed()
                raise
            cache.traced("TrainStep", stacklevel=3)
            cache.entries[sig] = e
            self._last = e
        else:
            cache.hits += 1
        res = self._run(e, data, label, dev, float(bs))
        # an earlier step's error that no sync point raised (its loss never read) is raised
        # here, after this step was pushed, rather than lost (as Trainer.step does)
        _engine.get_engine().raise_unreported()
        return res

    def _run(self, e, data, label, dev, bs):
        tr = self.trainer
        opt = tr._optimizer
        opt.rescale_grad = rescale = getattr(opt, "scale", 1.0) / bs     # (see Trainer.update)
        opt.num_update += 1
        clip = float("nan") if opt.clip_gradient is None else opt.clip_gradient
        pvals = _param_arrays(e.params, dev)
        weights, states, rows = [], [], []
        lr, wd = opt.lr, opt.wd
        known = tr._states
        for p, i, j in zip(e.upd, e.tindex, e.upd_pos):
            w = pvals[j]
            st = known.get((i, dev))
            if st is None:
                st = tr._state((i, dev), w)
            w._version += 1
            rows.append([lr * p.lr_mult, wd * p.wd_mult, 0, rescale, 0.0, clip])   # t: at run
            weights.append(w)
            states.append(st)
        # the program's hyperparams input: its rows as Python lists (the update nodes only
        # index it; Python floats unpack faster than a NumPy row)
        hp = rows or [[0.0] * _HP]
        loss = NDArray(*e.prog.out_specs[0], dev)
        out = NDArray(*e.prog.out_specs[-1], dev) if self._return_outputs else None
        side_nd = [p.data(dev) for p in e.side]
        n_tok = len(e.upd)
        fn = e.prog.fn
        rs = None
        reads = [data._var, label._var]
        reads += [pvals[j]._var for j in e.read_pos]        # the parameters not updated
        # and those updated (written too): weights left failed by a step that failed half-way
        # stop the next step instead of being trained on
        reads += [w._var for w in weights]
        upd_ids = {id(w) for w in weights}
        writes = [loss._var] + [w._var for w in weights] + [st["var"] for st in states]
        if out is not None:
            writes.append(out._var)
        writes += [s._var for s in side_nd if id(s) not in upd_ids]
        if e.random:
            from .. import random as _random
            rs = _random._ops
            reads.append(rs.var)
            writes.append(rs.var)

        owned = e.owned

        def run():
            e.opt, e.weights, e.states = opt, weights, states     # read by the update nodes
            e.updated = 0
            for k, w in enumerate(weights):
                hp[k][4] = 1.0 if owned(w) else 0.0
                hp[k][2] = states[k]["t"] + 1   # counted when the step runs (see Optimizer.update)
            arrays = [data._data, label._data] + [a._data for a in pvals] + [hp]
            try:
                res = fn(*arrays, _rng=rs.gen) if rs is not None else fn(*arrays)
            except BaseException as err:    # (Ctrl-C too: run in the main thread)
                if not e.updated:   # failed before any update: weights, states, statistics
                    # as they were (only the outputs take the error)
                    err.hybridl_failed_writes = [v._var for v in (loss, out) if v is not None]
                raise
            for k, st in enumerate(states):
                st["t"] = hp[k][2]
            loss._data = res[0]
            for s, v in zip(side_nd, res[1 + n_tok:]):
                # in the statistic's own dtype, as the loop's assignment casts (float64 data
                # through a float32 BatchNorm gives float64 statistics)
                s._data = v if v.dtype == s.dtype else v.astype(s.dtype)
            if out is not None:
                out._data = res[-1]

        eng = _engine.get_engine()
        meta = dict(e.cost) if eng.profiler is not None else None
        # fresh lists of Vars: the engine need not copy or check them
        # a failed batch (data or label from a failed op) fails the outputs only: the weights,
        # optimizer states and running statistics stay as they were, as when the program
        # fails before its first update (a failed weight stays failed: it is read too)
        failed_batch = [loss._var] + ([out._var] if out is not None else [])
        eng.push_trusted(run, reads, writes, dev, 0, "train_step", meta, e.ckey, failed_batch)
        return (loss, out) if out is not None else loss

    # ------------------------------------------------------------------ introspection
    def cache_info(self):
        """Hits, misses, the reason of each miss and the number of cached programs."""
        return self._cache.info()

    @property
    def last_program(self):
        """The compiled Program of the last new signature (None before the first call)."""
        return None if self._last is None else self._last.prog


def _step_miss_reason(sig, known):
    if not known:
        return "first call"
    (d, lab, req), (d0, lab0, req0) = sig, known[-1]
    diffs = [f"data {a} -> {b}" for a, b in ((d0, d),) if a != b]
    diffs += [f"label {a} -> {b}" for a, b in ((lab0, lab),) if a != b]
    if req != req0:
        diffs.append("grad_req of the trainer's parameters changed")
    return "; ".join(diffs) or "new signature"


def _allow_scratch(graph):
    """Mark updates whose gradient is theirs alone (a planned intermediate read by nothing
    else): the optimizer may use its buffer as scratch (``g *= lr; w -= g`` as by hand)."""
    count, outs = _uses(graph)

    def rw(node, ins):
        if node.op is not _UPDATE:
            return None
        gs = ins[1]
        prod = gs.node
        ok = (prod.kind == "op" and prod.op.out_ok and len(prod.specs) == 1
              and prod.op.name not in _VIEW_OPS and count.get(gs.key(), 0) == 1
              and gs.key() not in outs)
        attrs = dict(node.attrs, scratch=ok)
        return Node("op", node.op, ins, attrs, node.specs, node.name).outputs()
    from .ir import rebuild
    return rebuild(graph, rw)
