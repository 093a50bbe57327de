"""Parallel segments: split a compiled program into independent pieces pushed as separate
engine ops, so the branches of a multi-branch model run on different workers at once.

Partition (a chain decomposition): walking the nodes in order, a node joins the segment of its
producer when it has exactly one producing op node and that producer has no other consumer;
otherwise it starts a new segment. Forks therefore start one segment per branch and joins
(``concat``) start a new one — the branches of an Inception block become independent
segments. Each segment is compiled on its own (its external values become inputs) and applied
through the eager interpreter, so the engine orders it after exactly the segments it reads.
Buffers are not planned across segments (they may run concurrently), and segmented programs
are used for inference (forward without autograd recording).

Enable with ``net.hybridize(parallel_segments=True)`` and give each device several workers
(``hl.engine.set_num_workers(2)``); the thread budget then gives each worker cores // workers
BLAS threads.
"""
from ..ops.dispatch import apply
from .ir import Graph, Node
from .passes import run_passes
from .program import Program, node_cost

__all__ = ["partition", "SegmentedProgram"]

_SEG_PASSES = ("fold_constants", "simplify_algebra", "eliminate_common_subexpressions",
               "eliminate_dead_code", "fuse_elementwise")


def partition(graph):
    """List of segments (lists of op nodes in order) of ``graph`` (see module docstring)."""
    consumers = {}
    for n in graph.nodes:
        if n.kind == "op":
            for s in n.inputs:
                consumers.setdefault(s.node.id, set()).add(n.id)
    out_ids = {s.node.id for s in graph.outputs}
    seg_of, segments = {}, []
    for n in graph.nodes:
        if n.kind != "op":
            continue
        prods = {s.node.id: s.node for s in n.inputs if s.node.kind == "op"}
        if len(prods) == 1:
            (pid, p), = prods.items()
            if len(consumers.get(pid, ())) == 1 and pid not in out_ids:
                seg_of[n.id] = seg_of[pid]
                segments[seg_of[n.id]].append(n)
                continue
        seg_of[n.id] = len(segments)
        segments.append([n])
    return segments


# Relative weights of the cost estimate that orders ready segments (not a hardware model: only
# the order matters): seconds ~ flops / 5e10 + bytes / 1e10 (about one core of the dev VM).
_FLOPS_PER_S, _BYTES_PER_S = 5e10, 1e10


def _node_seconds(n):
    flops, nbytes = node_cost(n)
    return flops / _FLOPS_PER_S + nbytes / _BYTES_PER_S


def _rank_priorities(segments):
    """Engine priority of each segment = its upward rank (HEFT, Topcuoglu, Hariri & Wu 2002):
    its estimated time plus the largest rank among the segments that read its outputs, in
    microseconds. Among ready segments the worker then takes the one on the longest remaining
    path first; for the branches of one block that is the longest branch first (LPT), which
    keeps two workers evenly loaded."""
    producer = {}
    for k, (_, _, outs) in enumerate(segments):
        for o in outs:
            producer[o] = k
    succ = [set() for _ in segments]
    for k, (_, ext, _) in enumerate(segments):
        for e in ext:
            if e in producer:
                succ[producer[e]].add(k)
    rank = [0.0] * len(segments)
    for k in reversed(range(len(segments))):       # segments are in topological order
        rank[k] = segments[k][0].est_seconds + max((rank[j] for j in succ[k]), default=0.0)
        segments[k][0].op.priority = int(rank[k] * 1e6)


class SegmentedProgram:
    """A program run as several engine ops (one per segment)."""

    def __init__(self, graph, passes=None, name="program"):
        import time
        t0 = time.perf_counter()
        passes = [p for p in (passes or _SEG_PASSES) if p != "plan_memory"]
        self.graph = run_passes(graph, passes)
        self.in_specs = [(tuple(s.shape), s.dtype) for s in self.graph.inputs]
        self.out_specs = [(tuple(s.shape), s.dtype) for s in self.graph.outputs]
        self.memory_plan = None
        segs = partition(self.graph)
        in_seg = {n.id: k for k, seg in enumerate(segs) for n in seg}
        used_outside = set()
        for k, seg in enumerate(segs):
            for n in seg:
                for s in n.inputs:
                    if s.node.kind == "op" and in_seg[s.node.id] != k:
                        used_outside.add(s.key())
        for s in self.graph.outputs:
            used_outside.add(s.key())
        self.segments = []            # (Program, external input keys, output keys)
        for k, seg in enumerate(segs):
            ext, ph = [], {}
            for n in seg:
                for s in n.inputs:
                    if s.node.kind == "const":
                        continue
                    if (s.node.kind != "op" or in_seg[s.node.id] != k) and s.key() not in ph:
                        ph[s.key()] = Node("input", specs=[(s.shape, s.dtype)], name=f"x{len(ext)}").out()
                        ext.append(s.key())
            mapping = dict(ph)
            for n in seg:
                ins = [mapping.get(s.key(), s) for s in n.inputs]
                nn = Node("op", n.op, ins, n.attrs, n.specs, n.name)
                for i, o in enumerate(nn.outputs()):
                    mapping[(n.id, i)] = o
            outs = [(n.id, i) for n in seg for i in range(len(n.specs)) if (n.id, i) in used_outside]
            if not outs:
                continue
            prog = Program(Graph([ph[e] for e in ext], [mapping[o] for o in outs]), [],
                           f"{name}.seg{k}")
            self.segments.append((prog, ext, outs))
            prog.est_seconds = sum(_node_seconds(n) for n in seg)
        _rank_priorities(self.segments)
        self.source = "\n".join(f"# segment {k}: reads {len(e)} value(s)\n{p.source}"
                                for k, (p, e, _) in enumerate(self.segments))
        self.compile_seconds = time.perf_counter() - t0
        self.op = None
        self._measured = False

    def _remeasure(self):
        """Once every segment has run and been timed by the engine, rank by the measured
        times instead of the static estimate (which knows flops and bytes, not how fast each
        kernel turns them into time)."""
        from .. import engine as _engine
        eng = _engine.get_engine()
        times = []
        for prog, _, _ in self.segments:
            t = eng.learned_seconds(prog._ckey)    # the key its calls are timed under
            if t is None:
                return
            times.append(t)
        for (prog, _, _), t in zip(self.segments, times):
            prog.est_seconds = t
        _rank_priorities(self.segments)
        self._measured = True

    def run(self, args):
        """Push every segment; returns the outputs (NDArrays) in order."""
        if not self._measured:
            self._remeasure()
        vals = {s.key(): a for s, a in zip(self.graph.inputs, args)}
        for prog, ext, outs in self.segments:
            res = apply(prog.op, *[vals[e] for e in ext])
            res = res if isinstance(res, tuple) else (res,)
            for o, r in zip(outs, res):
                vals[o] = r
        out, seen = [], set()
        for s in self.graph.outputs:
            if s.node.kind == "const":
                from .. import nd
                out.append(nd.array(s.node.value))
                continue
            v = vals[s.key()]
            # an input (or a parameter) returned as it is, or one value returned twice: a
            # copy, as a one-op program gives (outputs never alias inputs or each other)
            if s.node.kind != "op" or s.key() in seen:
                v = v.copyto(v.device)
            seen.add(s.key())
            out.append(v)
        return tuple(out)

    def __repr__(self):
        return f"SegmentedProgram({len(self.segments)} segments)"
