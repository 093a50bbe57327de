"""Hybridization: trace a HybridBlock's forward (or a function) into a Graph, compile it, cache
one program per call signature, and run it as one engine op.

Signature = (input shapes, dtypes, devices; training mode; autograd recording; which inputs
need gradients). On a cache miss the reason is recorded (``cache_info()``); after
``RETRACE_WARN`` misses a warning says why the program keeps being retraced.

Parameters are program *inputs*, read through ``Parameter.data()`` during tracing, never
baked-in constants: ``set_data`` or an optimizer update is seen by the next call. Writes to
parameters during the forward (BatchNorm running statistics) become extra program outputs
that are assigned back after the call. Under ``autograd.record()`` the program is the forward
half of the joint forward+backward program (``gradient`` pass + split); its gradient rule runs
the compiled backward half, so ``loss.backward()`` runs compiled code too.
"""
import functools
import inspect
import warnings
import weakref

from .. import autograd
from .. import engine as _engine
from ..ndarray import NDArray, _eager_exec
from ..ops import math as M
from ..ops.dispatch import apply
from . import trace as _trace
from .autodiff import cotangent_deps, gradient, split_forward_backward
from .ir import Graph, Node, Symbol, TracingError
from .program import Program

__all__ = ["call_cached", "jit", "CacheInfo", "RETRACE_WARN", "trace_graph"]

RETRACE_WARN = 8


class CacheInfo(dict):
    """``{'hits', 'misses', 'reasons', 'programs'}`` with attribute access."""

    __getattr__ = dict.__getitem__


class _TraceCtx:
    treedef = None                # the structure of a dict / nested result (see trace_graph)
    as_list = False               # a flat list of arrays was returned (given back as a list)

    def __init__(self):
        self.params = []          # Parameters in first-use order
        self.syms = {}            # id(param) -> Symbol (the program input)
        self.side_effects = []    # (Parameter, Symbol), in program order
        self.current = {}         # id(param) -> Symbol of its last write in this program
        self.owner = {}           # key of a written Symbol -> its Parameter
        self.recording = False    # autograd was recording at the call being traced
        self.random_nodes = []    # nodes of random ops, in trace order (see unused_draws)

    def param_value(self, param):
        """The parameter's value at this point of the program: its last write in the traced
        code (a BatchNorm called twice reads the statistics its first call wrote, as eager
        code does), else the program input that holds it."""
        w = self.current.get(id(param))
        if w is not None:
            return w
        s = self.syms.get(id(param))
        if s is None:
            param._check_init()
            s = Node("param", specs=[(param.shape, param.dtype)], name=param.name or "param",
                     param=param).out()
            self.syms[id(param)] = s
            self.params.append(param)
        return s


class _Compiled:
    """One cached entry: the forward Program (+ backward), and how to map its outputs."""

    treedef = None                          # set by _build for structured results
    as_list = False                         # a flat list result (see _TraceCtx)

    def __init__(self, fwd, n_user, single, side_params, params, bwd=None, n_dropped=0):
        self.fwd, self.n_user, self.single = fwd, n_user, single
        self.side_params, self.params, self.bwd = side_params, params, bwd
        self.n_dropped = n_dropped          # unused random draws: the program's last outputs

    @property
    def source(self):
        return self.fwd.source


def trace_graph(fn, args, static=None):
    """Trace ``fn(*args)`` on symbolic inputs. Returns (graph inputs, user outputs, single?,
    ctx) where graph inputs are the data inputs followed by the parameters read."""
    ctx = _TraceCtx()
    ctx.recording = autograd.is_recording()
    syms = [Node("input", specs=[(tuple(a.shape), a.dtype)], name=f"data{i}").out()
            for i, a in enumerate(args)]
    with _trace.tracing(ctx), autograd.pause(autograd.is_training()):
        out = fn(*syms, **(static or {}))
    single = isinstance(out, Symbol)
    if single or (isinstance(out, (tuple, list)) and all(isinstance(o, Symbol) for o in out)):
        outs = [out] if single else list(out)
        ctx.treedef = None
        ctx.as_list = isinstance(out, list)
    else:                                   # dicts, nested tuples, None entries: flattened
        outs = []
        ctx.treedef = _flatten_outputs(out, outs, "output")
    if not outs:
        raise TracingError("hybridized forward returned no array (only None or empty "
                           "containers); return at least one computed array")
    # an output that is a program input is returned as a copy (outputs never alias inputs)
    outs = [M.identity(o) if o.node.kind in ("input", "param") else o for o in outs]
    return syms + [ctx.syms[id(p)] for p in ctx.params], outs, single, ctx


def _flatten_outputs(out, leaves, path):
    """The structure of a traced forward's result (dicts, tuples, lists of traced arrays and
    None), with each array replaced by its index in ``leaves`` (appended to).

    Raises:
        TracingError: a leaf that is neither a traced array nor None."""
    if isinstance(out, Symbol):
        leaves.append(out)
        return len(leaves) - 1
    if out is None:
        return _NONE
    if isinstance(out, dict):
        return ("dict", [(k, _flatten_outputs(v, leaves, f"{path}[{k!r}]")) for k, v in out.items()])
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, [_flatten_outputs(v, leaves, f"{path}[{i}]")
                                     for i, v in enumerate(out)])
    what = ("an NDArray that depends on no input or parameter (created or captured in the "
            "traced code, so it is not computed by the program)"
            if isinstance(out, NDArray) else type(out).__name__)
    raise TracingError(f"hybridized forward must return arrays computed from its inputs or "
                       f"parameters (an array, or tuples, lists and dicts of them, or None); "
                       f"{path} is {what}. Compute it from an input (e.g. "
                       f"hl.nd.zeros_like(x) + 1), or return it outside the hybridized call")


_NONE = ("none",)


def _unflatten_outputs(tree, leaves):
    if isinstance(tree, int):
        return leaves[tree]
    if tree is _NONE or tree == _NONE:
        return None
    kind, items = tree
    if kind == "dict":
        return {k: _unflatten_outputs(v, leaves) for k, v in items}
    vals = [_unflatten_outputs(v, leaves) for v in items]
    return tuple(vals) if kind == "tuple" else vals


def _last_writes(ctx):
    """(parameters written by the traced code, the value each holds at the end): the program
    outputs assigned back after a call (one per parameter, its last write)."""
    last = {}
    for p, v in ctx.side_effects:
        last[id(p)] = (p, v)
    return [p for p, _ in last.values()], [v for _, v in last.values()]


def unused_draws(ctx, roots):
    """The random ops of a trace whose results ``roots`` do not depend on (a Dropout whose
    output is unused, an auxiliary head the loss leaves out), one Symbol each. A program
    computes and drops them: the eager code draws their random numbers, so leaving them out
    would shift every later draw of the stream (other masks, the next batch's)."""
    if not ctx.random_nodes:
        return []
    live = {n.id for n in Graph([], list(roots)).nodes}
    return [n.out() for n in ctx.random_nodes if n.id not in live]


def _build(fn, args, name, passes, want_grad_data, static=None, parallel_segments=False):
    inputs, outs, single, ctx = trace_graph(fn, args, static)
    entry = _build_programs(inputs, outs, single, ctx, args, name, passes, want_grad_data,
                            parallel_segments)
    entry.treedef = ctx.treedef             # the structure of a dict / nested result, or None
    entry.as_list = ctx.as_list
    return entry


def _build_programs(inputs, outs, single, ctx, args, name, passes, want_grad_data,
                    parallel_segments):
    params = ctx.params
    n_data = len(args)
    side_params, side_vals = _last_writes(ctx)
    # program outputs: the user's, the parameters' last writes, then unused random draws
    dropped = unused_draws(ctx, outs + side_vals)
    wrt = []
    if autograd.is_recording():
        wrt = [i for i in range(n_data) if want_grad_data[i] and inputs[i].dtype.kind == "f"]
        wrt += [n_data + j for j, p in enumerate(params) if p.grad_req != "null"
                and p.dtype.kind == "f"]
    if not wrt:
        if parallel_segments:
            from .segments import SegmentedProgram
            prog = SegmentedProgram(Graph(inputs, outs + side_vals + dropped), passes, name)
            return _Compiled(prog, len(outs), single, side_params, params, n_dropped=len(dropped))
        prog = Program(Graph(inputs, outs + side_vals + dropped), passes, name)
        return _Compiled(prog, len(outs), single, side_params, params, n_dropped=len(dropped))
    joint, cots, wrt = gradient(Graph(inputs, outs), wrt)
    fwd_g, bwd_g, res_spec = split_forward_backward(joint, len(inputs), len(outs))
    fwd_g = Graph(fwd_g.inputs, fwd_g.outputs + side_vals + dropped)
    bwd = Program(bwd_g, passes, name + ".backward")
    n_user, n_in = len(outs), len(inputs)
    float_out = [c is not None for c in cots]
    bop = bwd.op
    # per gradient, the outputs (cotangent positions) it comes from: when none of them got a
    # gradient in a call (an auxiliary head the loss leaves out), or it depends on none (no
    # differentiable path: unused, or behind stop_gradient), the input gets no gradient, as
    # in eager autograd: its .grad is not written and the Trainer skips it (stale-gradient
    # warning) instead of applying zeros
    deps = cotangent_deps(bwd_g, sum(float_out))

    def grad(c, *ogs):
        if autograd.is_recording():
            # create_graph=True: the compiled backward is one op without a gradient of its
            # own, so a higher-order graph through it would silently treat it as a constant
            raise NotImplementedError(
                f"second-order gradients (create_graph=True) through the hybridized block "
                f"{name!r} are not supported: its backward is a compiled program; call "
                f"hybridize(False) on it for higher-order gradients")
        cot, live = [], set()
        for k in range(n_user):
            if not float_out[k]:
                continue
            g = ogs[k]
            if g is None:
                g = M.zeros_like_op(c.outputs[k])
            else:
                live.add(len(cot))
                if g.dtype != c.outputs[k].dtype:   # a later layer of another float type
                    g = g.astype(c.outputs[k].dtype)
            cot.append(g)
        res = [c.inputs[i] if kind == "input" else c.outputs[i] for kind, i in res_spec]
        gs = apply(bop, *res, *cot)
        gs = gs if isinstance(gs, tuple) else (gs,)
        full = [None] * n_in
        for k, idx in enumerate(wrt):
            if not deps[k].isdisjoint(live):
                full[idx] = gs[k]
        return tuple(full)

    prog = Program(fwd_g, passes, name, grad=grad)
    # what the backward reads (autograd checks only these for later writes: the BatchNorm
    # statistics the program itself assigns after each call are not among them)
    prog.op.grad_reads = (frozenset(i for kind, i in res_spec if kind == "input"),
                          frozenset(i for kind, i in res_spec if kind != "input"))
    return _Compiled(prog, n_user, single, side_params, params, bwd, len(dropped))


_AG = autograd._state


def _signature(args):
    sig = []
    for a in args:
        if not isinstance(a, NDArray):
            raise TypeError(f"hybridized call: inputs must be NDArrays (or NumPy arrays), got "
                            f"{type(a).__name__} (wrap data with hl.nd.array)")
        sig.append((tuple(a.shape), a.dtype, a.device, a._ag is not None or a._grad_req != "null"))
    if len(sig) > 1 and any(s[2] != sig[0][2] for s in sig):
        devs = ", ".join(f"input {i} on {s[2]}" for i, s in enumerate(sig))
        raise ValueError(f"hybridized call: inputs are on different devices ({devs}); a program "
                         f"runs on one device: copy them there with x.copyto(device)")
    return (tuple(sig), _AG.training, _AG.recording)


def _without_devices(sig):
    """A call signature (see :func:`_signature`) less the inputs' devices."""
    ins, training, recording = sig
    return tuple((s[0], s[1], s[3]) for s in ins), training, recording


def _miss_reason(sig, known):
    if not known:
        return "first call"
    best = None
    for k in known:
        diffs = []
        (a_in, a_tr, a_rec), (b_in, b_tr, b_rec) = k, sig
        if len(a_in) != len(b_in):
            diffs.append(f"number of inputs {len(a_in)} -> {len(b_in)}")
        else:
            for i, (x, y) in enumerate(zip(a_in, b_in)):
                for j, what in enumerate(("shape", "dtype", "device", "requires grad")):
                    if x[j] != y[j]:
                        diffs.append(f"input {i} {what} {x[j]} -> {y[j]}")
        if a_tr != b_tr:
            diffs.append(f"training mode {a_tr} -> {b_tr}")
        if a_rec != b_rec:
            diffs.append(f"autograd recording {a_rec} -> {b_rec}")
        if best is None or len(diffs) < len(best):
            best = diffs
    return "; ".join(best) or "new signature"


class _Cache:
    def __init__(self):
        self.entries = {}
        self.hits = 0
        self.misses = 0
        self.reasons = []
        self.warned = False
        self.version = -1
        self.kinds = set()      # signatures less their devices (see miss)
        self.seen = set()       # full signatures ever traced (a repeat counts: see miss)
        self.counted = 0        # misses that count towards the retrace warning
        # (signature, grad_req mask) -> entry: every program of a signature, one per set of
        # parameters that want gradients (a GAN's frozen / unfrozen halves): switching back
        # and forth reuses them instead of retracing; entries[sig] is the last one used
        self.variants = {}
        self.cleared = None     # why the programs were dropped (the next miss's reason)
        self._pending = (False, [])     # the last miss's count and new keys (see failed)

    def info(self):
        progs = {id(e) for e in self.entries.values()} | {id(e) for e in self.variants.values()}
        return CacheInfo(hits=self.hits, misses=self.misses, reasons=list(self.reasons),
                         programs=len(progs))

    def clear(self, why):
        """Drop every program; ``why`` becomes the reason of the next miss (None: say
        nothing, e.g. nothing was cached)."""
        if self.entries:
            self.cleared = why
        self.entries = {}
        self.variants = {}

    def add(self, sig, entry):
        self.entries[sig] = entry
        self.variants[(sig, entry.req_mask)] = entry

    def variant(self, sig, entry):
        """The program of signature ``sig`` traced for the parameters' grad_req settings of
        now (``entry`` is one traced for other settings), or None."""
        alt = self.variants.get((sig, _req_mask(entry.params)))
        if alt is not None:
            self.entries[sig] = alt
        return alt

    def reason(self, sig, known):
        """The reason of a miss of ``sig`` (see _miss_reason), or why the cache was cleared."""
        why = _miss_reason(sig, known)
        if why == "first call" and self.cleared:
            why = self.cleared
        self.cleared = None
        return why

    def miss(self, reason, owner, kind=None, full=None):
        """Count a miss with its reason (then :meth:`traced` or :meth:`failed`, from the same
        caller). ``kind``: the signature less its devices, ``full``: the signature. A miss
        that only adds a device to a kind already traced does not count towards the retrace
        warning (each device of a data-parallel step has its own program: no retracing to
        warn about); a new kind counts, and so does a signature traced again (the cache was
        cleared)."""
        self.misses += 1
        self.reasons.append(reason)
        count = True
        new = []
        if kind is not None:
            count = kind not in self.kinds or (full is not None and full in self.seen)
            for key, known in ((kind, self.kinds), (full, self.seen)):
                if key is not None and key not in known:
                    known.add(key)
                    new.append((key, known))
        self.counted += count
        self._pending = (count, new)

    def failed(self):
        """The trace of the last miss raised (a user error): it does not count towards the
        retrace warning, and its reason says so."""
        count, new = self._pending
        self.counted -= count
        for key, known in new:
            known.discard(key)
        self.reasons[-1] = f"{self.reasons[-1]} (the trace failed)"

    def traced(self, owner, stacklevel=3):
        """The last miss was traced: warn once after more than RETRACE_WARN counted misses."""
        if self.counted > RETRACE_WARN and not self.warned:
            self.warned = True
            warnings.warn(f"{owner} was retraced {self.misses} times; last reasons: "
                          f"{self.reasons[-3:]}. Keep input shapes fixed (e.g. last_batch="
                          f"'discard'), or call it imperatively.", RuntimeWarning, stacklevel=stacklevel)


def _param_arrays(params, dev):
    """``[p.data(dev) for p in params]`` without Parameter.data's checks when the copy on
    ``dev`` exists (the call path of every compiled call); otherwise ``data`` and its errors."""
    pvals = []
    for p in params:
        d = p._data
        a = d.get(dev) if d is not None else None
        pvals.append(a if a is not None else p.data(dev))
    return pvals


def _run(entry, args, pvals=None):
    """Run a cached entry on ``args`` (NDArrays on one device). ``pvals``: its parameters'
    arrays on that device, already checked against the program (the fast path of
    :func:`_fast_call`), else read and checked now."""
    dev = args[0].device if args else None
    checked = pvals is not None
    if not checked:
        pvals = _param_arrays(entry.params, dev)
    if entry.fwd.op is None:
        outs = entry.fwd.run(list(args) + pvals)
    else:
        outs = entry.fwd._run_arrays([*args, *pvals], dev, checked)
    if entry.side_params:                   # (before the dropped random draws, at the end)
        end = len(outs) - entry.n_dropped
        side = outs[end - len(entry.side_params):end]
        with autograd.pause(autograd.is_training()):
            for p, v in zip(entry.side_params, side):   # a failed call (its batch, or the
                p.data(dev)._assign(v, skip_clean=True)    # program) leaves them as they were

    user = outs[:entry.n_user]
    if entry.treedef is not None:
        return _unflatten_outputs(entry.treedef, user)
    if entry.single:
        return user[0]
    return list(user) if entry.as_list else tuple(user)


def _fast_call(cache, entry, sig, args):
    """A function ``f(args)`` that runs ``entry`` again, skipping the signature's hashing,
    the cache lookup and the parameters' checks, while nothing it depends on has changed:
    the same number of NDArray inputs with the same shapes, dtypes, devices and gradient
    needs, the same training mode and recording, no child added anywhere (STRUCTURE_VERSION),
    and no parameter's arrays or grad_req changed (``parameter.DATA_VERSION``); ``hybridize()``
    drops it. Otherwise ``f`` returns None and the caller (``HybridBlock.__call__``) takes the
    full path, :func:`call_cached`. None when ``entry`` does not qualify (a constant
    program, NumPy inputs)."""
    if entry.fwd.op is None or not args or any(type(a) is not NDArray for a in args):
        return None
    from ..nn import parameter as _parameter
    ins, training, recording = sig
    n = len(ins)
    dev = ins[0][2]
    pvals = _param_arrays(entry.params, dev)
    specs = entry.fwd.in_specs[n:]
    if len(pvals) != len(specs) or any(a.shape != s or a.dtype != d
                                       for a, (s, d) in zip(pvals, specs)):
        return None                         # the full path raises the descriptive error
    structure, v_structure = _trace.STRUCTURE_VERSION, _trace.STRUCTURE_VERSION[0]
    data, v_data = _parameter.DATA_VERSION, _parameter.DATA_VERSION[0]
    ag = _AG
    prog = entry.fwd
    # one NDArray result, no parameter written: _run's steps, inlined
    single = entry.single and entry.n_user == 1 and not entry.side_params and entry.treedef is None
    op, ospecs, ckey = prog.op, prog.out_specs, prog._ckey
    (shape0, dtype0), n_out = ospecs[0], len(ospecs)
    # one output, nothing recorded: the engine's lane for this kernel (run_ready without its
    # per-call lookups), made for the engine in use at the first call and again after a switch
    laned = n_out == 1 and not recording and not op.random
    kernel, lane = op.kernel, [None, None]

    def fast(args):
        if (len(args) != n or ag.training != training or ag.recording != recording
                or structure[0] != v_structure or data[0] != v_data):
            return None
        for a, (shp, dt, d, req) in zip(args, ins):
            if (type(a) is not NDArray or a.shape != shp or (a.dtype is not dt and a.dtype != dt)
                    or (a.device is not d and a.device != d)
                    or (a._ag is not None or a._grad_req != "null") is not req):
                return None
        cache.hits += 1
        if not single:
            return _run(entry, args, pvals)
        out = NDArray(shape0, dtype0, dev)
        if laned:
            eng = _engine._current             # (get_engine(), one call less)
            if lane[0] is not eng:
                lane[:] = [eng, eng.inline_lane(ckey, op.name)]
            if lane[1] is not None and lane[1](kernel, [*args, *pvals], out):
                return out
        outs = [out] if n_out == 1 else [out] + [NDArray(s, d, dev) for s, d in ospecs[1:]]
        _eager_exec(op, [*args, *pvals], outs, ospecs, {}, dev, ckey)
        return out
    return fast


def call_cached(block, args):
    """Run ``block`` hybridized on ``args`` (NDArrays): look up or build the program."""
    cache = block.__dict__.get("_hcache")
    version = _trace.STRUCTURE_VERSION[0]
    if cache is None or block._cached is None or cache.version != version:
        if cache is None:
            cache = _Cache()
        else:
            cache.clear("cache cleared: a block's children or parameters changed"
                        if cache.version != version else "cache cleared: hybridize() called again")
        cache.version = version
        object.__setattr__(block, "_hcache", cache)
        object.__setattr__(block, "_cached", cache.entries)
    try:
        sig = _signature(args)
    except TypeError:
        args = _numpy_inputs(block, args)      # as the eager call takes them, or re-raises
        sig = _signature(args)
    entry = cache.entries.get(sig)
    stale = None
    if entry is not None and sig[2] and entry.req_mask != _req_mask(entry.params):
        stale = entry                          # a parameter frozen or unfrozen since the trace
        entry = cache.variant(sig, entry)      # the program traced for today's settings
    if entry is not None:
        cache.hits += 1
    else:
        if stale is not None:
            changed = [p.name for p, a in zip(stale.params, stale.req_mask)
                       if (p.grad_req != "null") != a]
            reason = f"grad_req of parameter(s) {changed} changed"
            mask = _req_mask(stale.params)
        else:
            reason, mask = cache.reason(sig, list(cache.entries)), None
        cache.miss(reason, type(block).__name__, kind=(_without_devices(sig), mask),
                   full=(sig, mask))
        flags = block._hybrid_flags
        try:
            entry = _build(block.forward, args, type(block).__name__, flags.get("passes"),
                           [s[3] for s in sig[0]],
                           parallel_segments=flags.get("parallel_segments", False))
        except BaseException:
            cache.failed()
            raise
        cache.traced(type(block).__name__, stacklevel=4)
        entry.req_mask = _req_mask(entry.params)
        cache.add(sig, entry)
        object.__setattr__(block, "_last_program", entry)
        object.__setattr__(block, "_traced", True)     # (see Block._structure_changed)
    block.__dict__["_last_call"] = entry       # what export() traces without example inputs
    block.__dict__["_fast"] = _fast_call(cache, entry, sig, args)
    return _run(entry, args)


def _numpy_inputs(block, args):
    """``args`` with NumPy arrays made NDArrays (in a supported dtype, as ``hl.nd.array``),
    on the device of the other inputs, else of the block's parameters when they live on one
    device, else the current device: the eager call takes NumPy inputs too."""
    import numpy as np

    from .. import nd
    from ..device import current_device
    devs = {a.device for a in args if isinstance(a, NDArray)}
    if not devs:
        for p in block.collect_params().values():
            if p._data:
                devs.update(p._data)
    dev = devs.pop() if len(devs) == 1 else current_device()
    return tuple(nd.array(a, device=dev) if isinstance(a, np.ndarray) else a for a in args)


def _req_mask(params):
    return tuple(p.grad_req != "null" for p in params)


def cache_info(block):
    """Hits, misses, miss reasons and number of cached programs of a hybridized block."""
    c = block.__dict__.get("_hcache")
    if c is None:
        return CacheInfo(hits=0, misses=0, reasons=[], programs=0)
    info = c.info()
    if block.__dict__.get("_cached") is None:      # cleared (hybridize() again, a new child)
        info["programs"] = 0
    return info


class _JitFunction:
    def __init__(self, fn, static_argnames, passes, bound=False):
        if isinstance(fn, (classmethod, staticmethod)) or not callable(fn):
            raise TypeError(f"hl.jit: expected a function, got {type(fn).__name__}; on a "
                            f"classmethod or staticmethod put @hl.jit below that decorator")
        functools.update_wrapper(self, fn)
        self._fn = fn
        # (a functools.partial or a callable object has no __name__)
        self._name = getattr(fn, "__name__", None) or type(fn).__name__
        try:                                # a method called through its class: Cls.m(obj, x)
            first = None if bound else next(iter(inspect.signature(fn).parameters), None)
        except (TypeError, ValueError):
            first = None
        self._method = first in ("self", "cls")
        if isinstance(static_argnames, str):    # one name, as jax.jit takes it
            static_argnames = (static_argnames,)
        elif static_argnames is not None:
            try:
                static_argnames = tuple(static_argnames)
            except TypeError:
                raise TypeError(f"static_argnames: expected a name (str) or a sequence of names, "
                                f"got {type(static_argnames).__name__} {static_argnames!r}") from None
        self._static = tuple(static_argnames or ())
        bad = [a for a in self._static if not isinstance(a, str) or not a.isidentifier()]
        if bad:
            raise TypeError(f"static_argnames: expected argument names (str), got {bad!r}")
        if passes is not None:              # a bad name is an error here, not at the call
            from .passes import check_passes
            check_passes(passes)
        self._passes = passes
        self._cache = _Cache()

    def __call__(self, *args, **kwargs):
        if self._method and args and not isinstance(args[0], (NDArray, Symbol)):
            return self.__get__(args[0])(*args[1:], **kwargs)
        if _trace._tls.__dict__.get("ctx") is not None:
            # called while another program is being traced (from a hybridized forward or
            # another jit function): inlined into that program, like a child block
            return self._fn(*args, **kwargs)
        static = {k: kwargs.pop(k) for k in list(kwargs) if k in self._static}
        if kwargs:
            raise TypeError(f"{self._name}: keyword arguments {sorted(kwargs)} are not "
                            f"static_argnames {self._static}; pass arrays positionally")
        try:
            sig = _signature(args)
        except TypeError:                   # says which argument, and where Python values go
            i, a = next((i, a) for i, a in enumerate(args) if not isinstance(a, NDArray))
            hint = (f"; static arguments {list(self._static)} must be passed by keyword"
                    if self._static else "; Python values that select the program go in "
                    "static_argnames and are passed by keyword")
            raise TypeError(f"{self._name}: positional argument {i} must be an "
                            f"NDArray, got {type(a).__name__}{hint}") from None
        # the value's type is part of the key: 2, 2.0 and True are equal (and hash alike) in
        # Python but may trace different programs (integer vs float arithmetic)
        sig = (sig, tuple(sorted((k, _static_key(v)) for k, v in static.items())))
        cache = self._cache
        version = _trace.STRUCTURE_VERSION[0]
        if cache.version != version:        # a block the function calls may have changed
            cache.clear("cache cleared: a block's children or parameters changed")
            cache.version = version
        try:
            entry = cache.entries.get(sig)
        except TypeError:                   # an unhashable static value
            bad = [k for k, v in static.items() if not _hashable(_static_key(v))]
            raise TypeError(f"{self._name}: static argument(s) {bad} must be hashable "
                            f"(a number, string, tuple, ...): one program is kept per value") from None
        stale = None
        if entry is not None and sig[0][2] and entry.req_mask != _req_mask(entry.params):
            # a parameter frozen or unfrozen since the trace (as for a hybridized block): the
            # program would give it no gradient, or one it no longer wants
            stale, entry = entry, cache.variant(sig, entry)
        if entry is None:
            mask = None
            if stale is not None:
                changed = [p.name for p, a in zip(stale.params, stale.req_mask)
                           if (p.grad_req != "null") != a]
                reason, mask = f"grad_req of parameter(s) {changed} changed", _req_mask(stale.params)
            else:
                known = list(cache.entries)
                same = [k[0] for k in known if k[1] == sig[1]]
                reason = (cache.reason(sig[0], same) if same or not known
                          else f"static arguments {sig[1]}")
            cache.miss(reason, self._name, kind=(_without_devices(sig[0]), sig[1], mask),
                       full=(sig, mask))
            try:
                entry = _build(self._fn, args, self._name, self._passes,
                               [s[3] for s in sig[0][0]], static)
            except BaseException:
                cache.failed()
                raise
            cache.traced(self._name)
            entry.req_mask = _req_mask(entry.params)
            cache.add(sig, entry)
            self._last_entry = entry
        else:
            cache.hits += 1
        return _run(entry, args)

    def __get__(self, obj, objtype=None):
        """``@hl.jit`` on a method: ``obj.method`` is a jit function of its own, with ``obj``
        bound: one cache per object (by identity, dropped when the object is collected;
        copies of the object get their own). The object's parameters are program inputs, as
        in a hybridized block; its other attributes are read when tracing.

        Objects that cannot be weakly referenced (``__slots__`` without ``'__weakref__'``)
        get no cache: every call traces again (warned once)."""
        if obj is None:
            return self
        bound_by_id = self.__dict__.setdefault("_bound", {})
        hit = bound_by_id.get(id(obj))
        if hit is not None:
            return _BoundJit(hit[1], obj)
        fn = self._fn
        try:
            ref = weakref.ref(obj)          # the cache must not keep obj alive
        except TypeError:
            ref = None
            if not self.__dict__.get("_warned_noref"):
                self._warned_noref = True
                warnings.warn(f"@hl.jit method {fn.__name__!r}: {type(obj).__name__} objects "
                              f"cannot be weakly referenced (add '__weakref__' to __slots__), so "
                              f"their programs are not cached: every call traces again",
                              RuntimeWarning, stacklevel=2)
        get = ref if ref is not None else (lambda: obj)

        def method(*args, **kwargs):
            return fn(get(), *args, **kwargs)
        bound = _JitFunction(functools.wraps(fn)(method), self._static, self._passes, bound=True)
        if ref is not None:
            key = id(obj)
            bound_by_id[key] = (ref, bound)
            weakref.finalize(obj, bound_by_id.pop, key, None)
        return _BoundJit(bound, obj)

    def cache_info(self):
        """Hits, misses, miss reasons and number of cached programs."""
        return self._cache.info()

    @property
    def last_program(self):
        """The :class:`~hybridl.graph.program.Program` traced for the last new signature
        (``.source``, ``.graph``, ``.memory_plan``), or None before the first call."""
        entry = getattr(self, "_last_entry", None)
        if entry is None:
            return None
        entry.fwd.backward = entry.bwd
        return entry.fwd


class _BoundJit:
    """``obj.method`` of a jit method: holds ``obj`` (as a bound method does) while the
    object's cached jit function, which refers to it weakly, is called."""

    __slots__ = ("_jit", "_obj")

    def __init__(self, jit, obj):
        self._jit, self._obj = jit, obj

    def __call__(self, *args, **kwargs):
        return self._jit(*args, **kwargs)

    def __getattr__(self, name):            # cache_info, last_program, __name__ ...
        return getattr(self._jit, name)


def _static_key(v):
    """A cache key for a static argument that tells apart values Python calls equal but that
    may trace different programs: 2, 2.0 and True (by type), 0.0 and -0.0 (by repr), and the
    same inside tuples, lists and dicts."""
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_static_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), _static_key(x)) for k, x in v.items())))
    if isinstance(v, float):
        return ("float", repr(v))
    return (type(v).__name__, v)


def _hashable(v):
    try:
        hash(v)
    except TypeError:
        return False
    return True


def jit(fn=None, *, static_argnames=None, passes=None):
    """Compile a function of NDArrays (``@hl.jit`` or ``@hl.jit(static_argnames=('n',))``).

    The function is traced on its first call per signature (input shapes, dtypes, devices,
    training mode, autograd recording); static arguments (by name, passed by keyword) are
    Python values baked into the program, one program per distinct value. Called while
    another program is being traced (inside a hybridized forward or another jit function),
    it is inlined into that program. On a method, ``obj.method`` is bound to ``obj``, with
    one cache per object.

    What the program reads: its arguments and the Parameters it uses are program inputs
    (later ``set_data`` and optimizer updates are seen). Anything else it reads -- Python
    numbers, object attributes, NDArrays captured from a closure or an attribute -- is read
    once, when tracing, and baked into the program as a constant (as ``jax.jit`` does): a
    later change to it is not seen. Pass such arrays as arguments; a captured array that
    needs a gradient is refused under ``autograd.record()`` (TracingError). An in-place
    update of an intermediate value (``y += 1``) makes a new traced value bound to that name:
    another name for the same array (``z = y`` before it) keeps the old value, where eager
    code would see the change through both names.

    Args:
        fn: the function; positional arguments NDArrays; returns an NDArray, or tuples,
            lists and dicts of them (None entries allowed).
        static_argnames (str or sequence of str): names of keyword arguments that select
            the program (a single name may be given as a str, as in ``jax.jit``).
        passes (list of str): graph passes (default: all, see :mod:`hybridl.graph.passes`).

    Raises:
        TypeError: ``static_argnames`` not names; at a call, a positional argument that is
            not an NDArray, or a keyword argument that is not static.
        ValueError: an unknown pass name in ``passes`` (at decoration).
        TracingError: the function branches on a traced value (see :class:`TracingError`).
    """
    if fn is None:
        return lambda f: _JitFunction(f, static_argnames, passes)
    return _JitFunction(fn, static_argnames, passes)
