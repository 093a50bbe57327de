"""``hl.graph``: the compiler (DESIGN §4): IR, tracing, passes, codegen, compiled execution.

    x = hl.sym.var('x', shape=(4,)); y = hl.sym.var('y', shape=(4,))
    prog = hl.compile((x + y) * 2)          # .graph, .source, .memory_plan
    prog(np.ones(4), np.ones(4))            # -> NDArray, one engine op
"""
from . import passes  # noqa: F401
from .autodiff import gradient, split_forward_backward  # noqa: F401
from .hybrid import cache_info, jit  # noqa: F401
from .ir import Graph, Node, Symbol, TracingError, const, var  # noqa: F401
from .passes import DEFAULT_PASSES, PASSES, fusion_threshold, set_fusion_threshold  # noqa: F401
from .program import Program
from .step import TrainStep  # noqa: F401

__all__ = ["Graph", "Node", "Symbol", "TracingError", "var", "const", "compile", "jit",
           "gradient", "passes", "Program", "cache_info", "TrainStep"]


def compile(outputs, passes=None, inputs=None, name="program"):  # noqa: A001 - hl.compile
    """Compile symbolic ``outputs`` (a Symbol or a list) into a :class:`Program`.

    Args:
        outputs: Symbol or list of Symbols built from ``hl.sym.var`` inputs.
        passes: pass names (see ``hl.graph.PASSES``) or None for the defaults. With
            ``'gradient'`` (before ``'fuse_elementwise'``) the program also takes one
            cotangent per float output and returns the gradients w.r.t. the float inputs
            after the outputs.
        inputs: the input Symbols in calling order (default: every ``var`` reachable, in
            creation order).

    Returns:
        Program with ``.source``, ``.graph``, ``.memory_plan``; call it with one array per input.

    Raises:
        ValueError: an unknown pass name, ``passes`` not a list of names/functions, no
            outputs, an output that is not a Symbol, an input that is not a ``var`` or is listed twice, a ``var``
            the outputs use that ``inputs`` leaves out.
    """
    if isinstance(outputs, Symbol):
        outs = [outputs]
    else:
        try:
            outs = list(outputs)
        except TypeError:
            raise ValueError(f"outputs: expected a Symbol or a list of Symbols built from "
                             f"hl.sym.var inputs, got {type(outputs).__name__}") from None
    if not outs:
        raise ValueError("outputs: expected at least one Symbol (a program with no outputs "
                         "computes nothing), got an empty list")
    for i, o in enumerate(outs):
        if not isinstance(o, Symbol):
            raise ValueError(f"outputs: expected Symbols built from hl.sym.var inputs; output {i} "
                             f"is {type(o).__name__}")
    if inputs is None:
        g = Graph([], outs)
        inputs = [n.out() for n in g.nodes if n.kind == "input"]
    inputs = [inputs] if isinstance(inputs, Symbol) else list(inputs)
    seen = set()
    for i, s in enumerate(inputs):
        if not isinstance(s, Symbol) or s.node.kind != "input":
            raise ValueError(f"inputs: expected hl.sym.var symbols; input {i} is "
                             f"{type(s).__name__ if not isinstance(s, Symbol) else s.node.kind}")
        if s.key() in seen:
            raise ValueError(f"inputs: {s.node.name!r} is listed twice")
        seen.add(s.key())
    missing = [n.name for n in Graph([], outs).nodes if n.kind == "input"
               and n.out().key() not in seen]
    if missing:
        raise ValueError(f"inputs: the outputs depend on var(s) {missing} that are not among "
                         f"the inputs; list every var the outputs use (or leave inputs=None)")
    return Program(Graph(inputs, outs), passes, name, allow_gradient=True)
