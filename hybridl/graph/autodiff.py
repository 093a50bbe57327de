"""Symbolic differentiation: the ``gradient`` pass and the forward/backward split.

``gradient(graph, wrt)`` builds the *joint* program: inputs = the graph's inputs followed by one
cotangent per float output; outputs = the graph's outputs followed by the gradient of
sum(cotangent * output) w.r.t. each input in ``wrt``. It runs every op's gradient rule (the same
``Op.grad`` used by eager autograd) on symbols, in reverse order, summing the contributions of
several uses.

``split_forward_backward`` partially evaluates the joint program (as JAX's linearize / vjp):
nodes that do not depend on a cotangent form the forward program, which also returns the
*residuals* (forward values the backward nodes read); the backward program takes the residuals
and the cotangents. Compiled, the two run as one engine op each.
"""
from .. import autograd
from ..ops import math as M
from ..ops.registry import GradCtx
from .ir import Graph, Node, Symbol, rebuild

__all__ = ["gradient", "split_forward_backward", "cotangent_deps"]


def gradient(graph, wrt=None):
    """The joint forward+backward graph (see module docstring). ``joint.no_grad`` lists the
    positions in ``wrt`` of the inputs with no differentiable path to an output (their
    gradient outputs are zeros; eager autograd gives them none).

    Args:
        graph: a Graph.
        wrt: indices of ``graph.inputs`` to differentiate w.r.t. (default: every float input).

    Returns:
        (joint Graph, list of cotangent Symbols (None for non-float outputs), wrt list).
    """
    if wrt is None:
        wrt = [i for i, s in enumerate(graph.inputs) if s.dtype.kind == "f"]
    cots = []
    for k, y in enumerate(graph.outputs):
        if y.dtype.kind == "f":
            cots.append(Node("input", specs=[(y.shape, y.dtype)], name=f"cotangent{k}").out())
        else:
            cots.append(None)
    grads = {}
    for y, c in zip(graph.outputs, cots):
        if c is not None:
            grads[y.key()] = c if y.key() not in grads else M.add(grads[y.key()], c)
    # the rules run on symbols, never recorded by eager autograd: with recording on (a block
    # hybridized inside the user's record()) some rules would take their create_graph=True
    # form (conv2d's bias gradient as a separate sum), another rounding than eager backward's
    with autograd._Scope(False, None):
        _backward_nodes(graph, grads, _active(graph, wrt))
    gouts, no_grad = [], []
    for k, i in enumerate(wrt):
        x = graph.inputs[i]
        g = grads.get(x.key())
        if g is None:       # no differentiable path to an output (unused, or behind
            no_grad.append(k)   # stop_gradient): zeros here; eager autograd writes nothing
        if g is not None and g.dtype != x.dtype:    # (x * a float64 constant: a float64
            g = M.cast(g, x.dtype.name)             # gradient; eager's is x's dtype)
        gouts.append(g if g is not None else M.zeros_like_op(x))
    joint = Graph(graph.inputs + [c for c in cots if c is not None], graph.outputs + gouts)
    joint.no_grad = no_grad
    return joint, cots, list(wrt)


def _active(graph, wrt):
    """Keys of the values that depend on an input in ``wrt`` (indices into graph.inputs):
    only they need a gradient. As eager autograd's ``needs``: a frozen weight
    (``grad_req='null'``) or the data gets no gradient computed, so a rule that then takes
    another path (conv2d's bias gradient as a sum instead of its weight-gradient GEMM) gives
    eager's bits, and no discarded gradient is computed."""
    active = {graph.inputs[i].key() for i in wrt}
    for node in graph.nodes:
        if node.kind == "op" and any(x.key() in active for x in node.inputs):
            active.update(o.key() for o in node.outputs())
    return active


def _backward_nodes(graph, grads, active=None):
    """Run the gradient rules of ``graph``'s op nodes in reverse order, adding into ``grads``
    (symbol key -> gradient symbol; several uses of a value are summed). ``active``: keys of
    the values that need a gradient (None: every float non-constant value)."""
    for node in reversed(graph.nodes):
        if node.kind != "op":
            continue
        outs = node.outputs()
        ogs = [grads.get(o.key()) for o in outs]
        if all(g is None for g in ogs):
            continue
        if node.op.name == "fused_elementwise":     # (not differentiable, but not zero either)
            raise RuntimeError("gradient: the graph has fused_elementwise kernels, which have "
                               "no gradient rule: run 'gradient' before fusion")
        if not node.op.differentiable:
            continue
        needs = tuple(x.dtype.kind == "f" and x.node.kind != "const"
                      and (active is None or x.key() in active) for x in node.inputs)
        if not any(needs):
            continue
        ctx = GradCtx(node.inputs, outs, node.attrs, needs)
        igs = node.op.grad(ctx, ogs[0]) if len(outs) == 1 else node.op.grad(ctx, *ogs)
        for x, n, g in zip(node.inputs, needs, igs):
            if g is None or not n:
                continue
            k = x.key()
            grads[k] = g if k not in grads else M.add(grads[k], g)


def split_forward_backward(joint, n_primal_inputs, n_outputs):
    """Split a joint graph into (forward Graph, backward Graph, residual specs).

    Forward: inputs = the primal inputs; outputs = the primal outputs + residuals.
    Backward: inputs = residual placeholders + cotangents; outputs = the gradients.
    Residuals that are primal inputs are returned as ``('input', index)``, others as
    ``('output', index into forward outputs)``.
    """
    prim = joint.inputs[:n_primal_inputs]
    cots = joint.inputs[n_primal_inputs:]
    cot_ids = {s.node.id for s in cots}
    dep = set(cot_ids)
    for n in joint.nodes:
        if n.kind == "op" and any(s.node.id in dep for s in n.inputs):
            dep.add(n.id)
    grads = joint.outputs[n_outputs:]
    bwd_nodes = [n for n in Graph(joint.inputs, grads).nodes if n.id in dep and n.kind == "op"]
    residuals, seen = [], set()
    for n in bwd_nodes:
        for s in n.inputs:
            if s.node.id in dep or s.node.kind == "const" or s.key() in seen:
                continue
            seen.add(s.key())
            residuals.append(s)
    for g in grads:                       # a gradient that is a forward value (e.g. zeros)
        if g.node.id not in dep and g.node.kind != "const" and g.key() not in seen:
            seen.add(g.key())
            residuals.append(g)
    prim_pos = {s.key(): i for i, s in enumerate(prim)}
    res_spec, fwd_extra = [], []
    for r in residuals:
        if r.key() in prim_pos:
            res_spec.append(("input", prim_pos[r.key()]))
        else:
            res_spec.append(("output", n_outputs + len(fwd_extra)))
            fwd_extra.append(r)
    fwd = Graph(prim, joint.outputs[:n_outputs] + fwd_extra)
    # backward: residuals become inputs
    placeholders = [Node("input", specs=[(r.shape, r.dtype)], name=f"residual{i}").out()
                    for i, r in enumerate(residuals)]
    sub = {r.key(): p for r, p in zip(residuals, placeholders)}
    tmp = Graph(joint.inputs, grads)

    def look(s):
        k = s.key()
        if k in mapping:
            return mapping[k]
        if k in sub:
            return sub[k]
        return s
    mapping = {}
    for n in tmp.nodes:
        if n.kind != "op" or n.id not in dep:
            continue
        ins = [look(s) for s in n.inputs]
        nn = Node("op", n.op, ins, n.attrs, n.specs, n.name)
        for i, o in enumerate(nn.outputs()):
            mapping[(n.id, i)] = o
    bouts = [look(g) for g in grads]
    bwd = Graph(placeholders + list(cots), bouts)
    return fwd, bwd, res_spec


_ = (rebuild, Symbol)


def cotangent_deps(bwd, n_cot):
    """For each output of the backward graph ``bwd`` (its last ``n_cot`` inputs are the
    cotangents), the frozenset of cotangent positions it depends on: a gradient whose
    cotangents all got no gradient in a call (their outputs unused by the loss) is no
    gradient at all, as in eager autograd, where backward never reaches that path."""
    first = len(bwd.inputs) - n_cot
    deps = {s.key(): frozenset((k,)) for k, s in enumerate(bwd.inputs[first:])}
    for n in bwd.nodes:
        if n.kind != "op":
            continue
        d = frozenset().union(*(deps.get(x.key(), frozenset()) for x in n.inputs))
        for o in n.outputs():
            deps[o.key()] = d
    return [deps.get(o.key(), frozenset()) for o in bwd.outputs]
