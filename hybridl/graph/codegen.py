"""Code generation: Graph -> straight-line Python source over preallocated buffers.

An op may give inline code (``Op.emit``: e.g. a 2-D fully-connected layer becomes its
``np.matmul``, bias add and ReLU lines), which saves the kernel's call and argument handling;
other ops call their kernel.

The generated function takes the program inputs positionally (and ``_rng`` when the graph
draws random numbers) and returns a tuple of outputs. Kernels, constants and planned buffers
are bound as globals of the generated code; ``Program.source`` shows the text, e.g.::

    def program(i0, i1, i2, _rng=None):
        v7 = k0(i0, i1, i2, flatten=True, out=b0)   # fully_connected
        v8 = k1(v7, out=b0)                         # relu (in place)
        return (v8,)
"""
import keyword
import math

import numpy as np

__all__ = ["generate"]

_LITERAL_TYPES = (int, str, bool, type(None))


def _literal(v):
    if isinstance(v, _LITERAL_TYPES):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, tuple):
        return all(_literal(x) for x in v)
    return False


def generate(graph, name="program"):
    """Return ``(source, globals_dict, fn)`` for ``graph`` (uses ``graph.memory_plan`` if any).

    Buffers of the plan are allocated here, once per generated program.
    """
    plan = getattr(graph, "memory_plan", None)
    g = {"np": np}
    names = {}
    lines = []
    args = []
    for i, s in enumerate(graph.inputs):
        names[s.key()] = f"i{i}"
        args.append(f"i{i}")
    raw = []
    if plan is not None:
        raw = [np.empty(n, np.uint8) for n in plan.buffers]
    kernels = {}
    n_k = [0]
    rnd = False
    uses_gemm = False
    for n in graph.nodes:
        if n.kind in ("input", "param"):
            if (n.id, 0) not in names:            # an unused-by-position leaf (should not happen)
                raise ValueError(f"graph leaf {n!r} is not among the program inputs")
            continue
        if n.kind == "const":
            cname = f"c{n.id}"
            g[cname] = n.value
            names[(n.id, 0)] = cname
            continue
        op = n.op
        kn = kernels.get(id(op.kernel))
        if kn is None:
            kn = kernels[id(op.kernel)] = f"k{n_k[0]}"
            n_k[0] += 1
            g[kn] = op.kernel
        call_args = [names[s.key()] for s in n.inputs]
        for k, v in n.attrs.items():
            if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)):
                raise ValueError(f"node {n.id} ({op.name}): attribute name {k!r} is not an "
                                 f"identifier; it cannot be passed to the kernel")
            if _literal(v):
                call_args.append(f"{k}={v!r}")
            else:
                an = f"a{n.id}_{k}"
                g[an] = v
                call_args.append(f"{k}={an}")
        if op.random:
            call_args.append("_rng=_rng")
            rnd = True
        comment = op.name
        if plan is not None and (n.id, 0) in plan.assign and len(n.specs) == 1:
            b = plan.assign[(n.id, 0)]
            off = plan.offset.get((n.id, 0), 0)
            shape, dt = n.specs[0]
            bn = f"b{n.id}"
            cnt = int(np.prod(shape))
            if cnt == 0:                    # nothing to hold: no view of the buffer needed
                g[bn] = np.empty(shape, dt)
            else:
                g[bn] = raw[b][off: off + cnt * dt.itemsize].view(dt).reshape(shape)
            call_args.append(f"out={bn}")
            comment += f"  -> buffer {b} @{off}" + (" (in place)" if (n.id, 0) in plan.inplace else "")
        outs = [f"v{n.id}_{i}" if len(n.specs) > 1 else f"v{n.id}" for i in range(len(n.specs))]
        for i, o in enumerate(outs):
            names[(n.id, i)] = o
        inline = None
        if op.emit is not None and len(outs) == 1:
            inline = op.emit(outs[0], call_args[:len(n.inputs)], n.attrs,
                             [(tuple(s.shape), s.dtype) for s in n.inputs], n.specs[0],
                             call_args[-1][4:] if call_args and call_args[-1].startswith("out=") else None)
        if inline is not None:
            code, gemm = inline
            uses_gemm = uses_gemm or gemm
            lines.append(f"    {code[0]}  # {comment}")
            lines.extend(f"    {c}" for c in code[1:])
            continue
        lhs = ", ".join(outs) + ("," if len(outs) == 1 and len(n.specs) > 1 else "")
        lines.append(f"    {lhs} = {kn}({', '.join(call_args)})  # {comment}")
    ret = [names[s.key()] for s in graph.outputs]
    sig = ", ".join(args + (["_rng=None"] if rnd else []))
    if uses_gemm:         # inlined GEMMs: the BLAS thread budget, once per call (as kernels do)
        from ..ops._blas import for_gemm
        g["_for_gemm"] = for_gemm
        lines.insert(0, "    _for_gemm()")
    src = [f"def {name}({sig}):"] + lines + [f"    return ({', '.join(ret)}{',' if len(ret) == 1 else ''})"]
    source = "\n".join(src) + "\n"
    code = compile(source, f"<hybridl {name}>", "exec")
    exec(code, g)  # noqa: S102 - our own generated code
    return source, g, g[name], rnd
