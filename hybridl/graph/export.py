"""Export a hybridized model as graph JSON + safetensors parameters, and load it back without
the model's Python class (``SymbolBlock.imports``). No pickle anywhere.

``prefix-symbol.json`` schema (``format: "hybridl-graph"``, ``version: 1``)::

    {"format": "hybridl-graph", "version": 1,
     "inputs":  [{"name": "data0", "shape": [N, C, H, W], "dtype": "float32"}, ...],
     "params":  [{"name": "0.weight", "shape": [...], "dtype": "float32"}, ...],
     "nodes":   [{"id": 7, "kind": "op" | "input" | "param" | "const", "op": "conv2d",
                  "inputs": [[node_id, output_index], ...], "attrs": {...},
                  "specs": [[shape, dtype], ...], "name": "..."}, ...],
     "outputs": [[node_id, output_index], ...]}

Attribute tuples are stored as JSON lists and read back as tuples. Constants are stored in the
safetensors file under ``__const__/<node id>``. The graph is the predict-mode forward, traced at
the input shapes of the export (shapes are static, as in an ONNX graph with fixed dims).
"""
import json
import os

import numpy as np

from .. import autograd
from .._io import atomic_write_all
from ..ops.dispatch import apply
from ..ops.registry import OPS
from .ir import Graph
from .passes import run_passes

__all__ = ["export", "SymbolBlock", "load_graph_json", "graph_to_json"]

FORMAT, VERSION = "hybridl-graph", 1
_EXPORT_PASSES = ("fold_constants", "simplify_algebra", "eliminate_common_subexpressions",
                  "eliminate_dead_code")


def _enc(v):
    if isinstance(v, tuple):
        return [_enc(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return v


def _dec(v):
    if isinstance(v, list):
        return tuple(_dec(x) for x in v)
    return v


def graph_to_json(graph, n_data):
    """(json dict, {tensor name: array}) for a traced graph whose first ``n_data`` inputs are
    data and the rest parameters."""
    tensors = {}
    nodes = []
    for n in graph.nodes:
        d = {"id": n.id, "kind": n.kind, "name": n.name,
             "specs": [[list(s), dt.name] for s, dt in n.specs]}
        if n.kind == "op":
            d["op"] = n.op.name
            d["inputs"] = [[s.node.id, s.index] for s in n.inputs]
            d["attrs"] = {k: _enc(v) for k, v in n.attrs.items()}
        elif n.kind == "const":
            tensors[f"__const__/{n.id}"] = np.array(n.value, order="C")     # 0-d stays 0-d
        nodes.append(d)
    doc = {"format": FORMAT, "version": VERSION,
           "inputs": [{"name": s.node.name, "shape": list(s.shape), "dtype": s.dtype.name,
                       "node": s.node.id} for s in graph.inputs[:n_data]],
           "params": [{"name": s.node.name, "shape": list(s.shape), "dtype": s.dtype.name,
                       "node": s.node.id,
                       # 'null' for values no optimizer updates (BatchNorm statistics)
                       "grad_req": getattr(s.node.param, "grad_req", "write")}
                      for s in graph.inputs[n_data:]],
           "nodes": nodes,
           "outputs": [[s.node.id, s.index] for s in graph.outputs]}
    return doc, tensors


def _flat_outputs_only(ctx, what):
    """Exported graphs have a flat list of outputs: refuse dict / nested / None results."""
    if ctx.treedef is not None:
        raise ValueError(f"{what}: the block returns a dict, a nested structure or None "
                         f"entries; an exported graph has a flat list of outputs: return an "
                         f"array or a tuple of arrays from forward (or wrap the block)")


def export(block, prefix, *example_inputs):
    """Write ``prefix-symbol.json`` and ``prefix.safetensors`` for a HybridBlock.

    The block is traced in predict mode at the shapes of ``example_inputs`` (NDArrays, given
    one by one or as one list/tuple, as ``hl.onnx.export`` takes them) or, if none are given,
    of its last hybridized call. Returns (symbol_file, param_file). Files are written to
    temporary names and renamed.

    Raises:
        RuntimeError: no example inputs and the block was never called hybridized.
        ValueError: an empty prefix or one naming a folder (ending in a separator).
        TypeError: ``prefix`` is not a path; an example input that is neither an NDArray nor a
            NumPy array.
        FileNotFoundError: the prefix's folder does not exist.
    """
    from safetensors.numpy import save_file

    from ..ndarray import NDArray
    from .hybrid import trace_graph
    from .._io import check_path
    prefix = check_path(prefix, "export: prefix")
    if not prefix or prefix.endswith(("/", os.sep)) or os.path.basename(prefix) in ("", ".", ".."):
        raise ValueError(f"export: prefix must name files (e.g. 'model' writes model-symbol.json "
                         f"and model.safetensors), got {prefix!r}")
    folder = os.path.dirname(prefix)
    if folder and not os.path.isdir(folder):
        raise FileNotFoundError(f"export: prefix {prefix!r}: the folder {folder!r} does not exist "
                                f"(the files are written there)")
    args = list(example_inputs)
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            from .. import nd
            args[i] = a = nd.array(a)
        if not isinstance(a, NDArray):
            raise TypeError(f"export: example input {i} must be an NDArray or a NumPy array "
                            f"(pass them as net.export(prefix, x1, x2) or net.export(prefix, "
                            f"[x1, x2])), got {type(a).__name__}")
    if not args:
        entry = block.__dict__.get("_last_call") or block.__dict__.get("_last_program")
        if entry is None:
            raise RuntimeError("export: call the hybridized block on data once first, or pass "
                               "example inputs: net.export(prefix, x)")
        from .. import nd
        args = [nd.zeros(s, d) for s, d in entry.fwd.in_specs[:len(entry.fwd.in_specs) - len(entry.params)]]
    with autograd.predict_mode():
        inputs, outs, single, ctx = trace_graph(block.forward, args)
    _flat_outputs_only(ctx, "export")
    # parameters are named by their path in this block (as save_parameters names them), not
    # by the names they got where they were initialized (two children initialized on their
    # own both have a 'weight'); unique in any case
    paths = {id(p): n for n, p in block.collect_params().items()}
    taken = set()
    for p, s in zip(ctx.params, inputs[len(args):]):
        name = paths.get(id(p)) or s.node.name
        base, k = name, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        s.node.name = name
    g = run_passes(Graph(inputs, outs), _EXPORT_PASSES)
    doc, tensors = graph_to_json(g, len(args))
    from ..ndarray import snapshot      # all at one point of the program order
    vals = snapshot([p.data() for p in ctx.params])
    for v, s in zip(vals, inputs[len(args):]):
        tensors[s.node.name] = v
    doc["single_output"] = single
    sym_file, param_file = f"{prefix}-symbol.json", f"{prefix}.safetensors"

    def write_json(tmp):
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
    atomic_write_all([(param_file, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT})),
                      (sym_file, write_json)])      # both complete before either is in place
    return sym_file, param_file


def load_graph_json(path):
    """Read and validate a ``-symbol.json`` file.

    Raises:
        FileNotFoundError; IsADirectoryError; ValueError: not JSON, wrong format/version,
        unknown op, dangling node reference (the message names the file and the problem).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"symbol_file: no such file: {path!r}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"symbol_file: {path!r} is a directory; expected the "
                                f"PREFIX-symbol.json file written by net.export(PREFIX)")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"symbol_file: {path!r} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"symbol_file: {path!r} is nested too deeply to be a hybridl graph") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"symbol_file: {path!r} is not a hybridl graph (format {FORMAT!r} expected)")
    if type(doc.get("version")) is not int or doc.get("version") != VERSION:
        raise ValueError(f"symbol_file: {path!r} has version {doc.get('version')!r}, expected "
                         f"the integer {VERSION}")
    seen = {}                     # node id -> number of outputs

    def bad(msg):
        raise ValueError(f"symbol_file: {path!r}: {msg}")

    def ref(r, where):
        if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(v, int) for v in r)):
            bad(f"{where}: expected a reference [node_id, output_index], got {r!r}")
        if r[0] not in seen:
            bad(f"{where}: refers to unknown node {r[0]} (not defined before it)")
        if not 0 <= r[1] < seen[r[0]]:
            bad(f"{where}: node {r[0]} has {seen[r[0]]} output(s), index {r[1]} is out of range")

    try:
        if not isinstance(doc["nodes"], list) or not doc["nodes"]:
            bad(f"'nodes' must be a non-empty list, got {type(doc['nodes']).__name__}")
        if not isinstance(doc["outputs"], list) or not doc["outputs"]:
            bad("'outputs' must be a non-empty list of [node_id, output_index]")
        for n in doc["nodes"]:
            if n["kind"] not in ("input", "param", "const", "op"):
                bad(f"node {n['id']} has unknown kind {n['kind']!r}")
            if not isinstance(n["id"], int) or isinstance(n["id"], bool):
                bad(f"node ids must be integers, got {n['id']!r}")
            for spec in n["specs"]:
                shp, dt = spec
                if not isinstance(shp, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                        and d >= 0 for d in shp):
                    bad(f"node {n['id']}: shape must be a list of integers >= 0, got {shp!r}")
                _dtype(dt, f"node {n['id']}", bad)
            if n["kind"] == "op":
                if n["op"] in _NOT_EXPORTED:
                    bad(f"node {n['id']}: op {n['op']!r} is internal to compiled programs and never "
                        f"exported")
                _op(n["op"], path)
                for r in n["inputs"]:
                    ref(r, f"node {n['id']} input")
                if not isinstance(n["attrs"], dict):
                    bad(f"node {n['id']}: 'attrs' must be an object, got {type(n['attrs']).__name__}")
                for k in n["attrs"]:
                    # attribute names become keyword arguments (and, hybridized, generated
                    # code): plain identifiers only
                    if not _attr_name_ok(k):
                        bad(f"node {n['id']}: attribute name {k!r} is not a plain identifier")
                    if k in _RESERVED_ATTRS:    # passed by the runtime, not by a graph
                        bad(f"node {n['id']}: attribute {k!r} is reserved (the runtime passes "
                            f"it), not an attribute of the op")
                why = _signature_mismatch(_op(n["op"], path), len(n["inputs"]), n["attrs"])
                if why:
                    bad(f"node {n['id']} ({n['op']}): {why}")
            if n["id"] in seen:
                bad(f"node id {n['id']} appears twice")
            seen[n["id"]] = len(n["specs"])
        for r in doc["outputs"]:
            ref(r, "output")
        kinds = {n["id"]: n["kind"] for n in doc["nodes"]}
        for what, kind in (("inputs", "input"), ("params", "param")):
            for e in doc[what]:
                if kinds.get(e["node"]) != kind:
                    bad(f"{what} entry {e.get('name')!r} refers to node {e['node']}, which is not "
                        f"an {kind} node")
        for what in ("inputs", "params"):
            for e in doc[what]:
                if not isinstance(e.get("name"), str) or not e["name"]:
                    bad(f"{what} entry {e!r} has no name")
        if not isinstance(doc.get("single_output"), bool):
            bad("'single_output' is missing or not true/false")
        listed_all = [e["node"] for e in doc["inputs"]] + [e["node"] for e in doc["params"]]
        listed = set(listed_all)
        if len(listed) != len(listed_all):
            bad("a node is listed more than once in 'inputs'/'params'")
        pnames = [e["name"] for e in doc["params"]]
        if len(set(pnames)) != len(pnames):
            bad("a parameter name is listed more than once in 'params'")
        for e in doc["params"]:
            if e.get("grad_req", "write") not in ("write", "add", "null"):
                bad(f"params entry {e['name']!r}: grad_req must be 'write', 'add' or 'null', "
                    f"got {e['grad_req']!r}")
        for n in doc["nodes"]:
            if n["kind"] in ("input", "param") and n["id"] not in listed:
                bad(f"{n['kind']} node {n['id']} is not listed in 'inputs'/'params'")
        specs = {n["id"]: n["specs"] for n in doc["nodes"]}
        for what in ("inputs", "params"):
            for e in doc[what]:
                _dtype(e["dtype"], f"{what} entry {e.get('name')!r}", bad)
                if [[list(e["shape"]), e["dtype"]]] != specs[e["node"]]:
                    bad(f"{what} entry {e.get('name')!r} says {e['dtype']} {list(e['shape'])}, its "
                        f"node {e['node']} says {specs[e['node']]}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ValueError) and str(e).startswith("symbol_file"):
            raise
        raise ValueError(f"symbol_file: {path!r} is malformed (missing or bad field {e})") from None
    return doc


# ops that only compiled programs contain (fusion output: its expression string goes to
# numexpr); an exported graph never holds them
_NOT_EXPORTED = frozenset({"fused_elementwise"})


# kernel keyword arguments that compiled programs and the engine pass themselves
_RESERVED_ATTRS = frozenset({"out", "_rng"})


def _signature_mismatch(op, n_inputs, attrs):
    """Why ``op``'s kernel cannot take ``n_inputs`` arrays and these attributes, or None."""
    import inspect
    try:
        sig = inspect.signature(op.kernel)
    except (TypeError, ValueError):          # a builtin without a signature: not checked
        return None
    extra = {"_rng": None} if op.random else {}     # random ops: the generator is passed too
    try:
        sig.bind(*([None] * n_inputs), **attrs, **extra)
    except TypeError as e:
        return f"{n_inputs} input(s) and attributes {sorted(attrs)} do not fit the op ({e})"
    return None


def _attr_name_ok(k):
    import keyword
    return isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) and not k.startswith("_")


def _dtype(dt, where, bad):
    from ..ops._util import SUPPORTED_DTYPES
    try:
        d = np.dtype(dt) if isinstance(dt, str) else None
    except (TypeError, ValueError):
        d = None
    if d is None or d not in SUPPORTED_DTYPES:
        bad(f"{where}: unsupported dtype {dt!r}")
    return d


def _op(name, path="<graph>"):
    op = OPS.get(name)
    if op is None and name.startswith("split") and name[5:].isdigit() and int(name[5:]) <= 4096:
        from ..ops.math import _split_op
        op = _split_op(int(name[5:]))
    if op is None:
        raise ValueError(f"symbol_file: {path!r} uses unknown op {name!r}")
    return op


def _one_element(a, shape):
    """A one-element tensor stored with another one-element shape (files written before 0-d
    tensors were kept 0-d stored scalars as [1]) reshaped to ``shape``; others unchanged."""
    if a.size == 1 and int(np.prod(shape)) == 1 and list(a.shape) != list(shape):
        return a.reshape(tuple(shape))
    return a


def _copy(x):
    from ..ndarray import NDArray
    if isinstance(x, NDArray):
        return x.copyto(x.device)
    from ..ops import math as M             # traced (a Symbol): hybridized outputs are copies
    return M.identity(x)


def _get_block_base():
    from ..nn.block import HybridBlock
    return HybridBlock


class SymbolBlock(_get_block_base()):
    """A block that runs an exported graph; needs no Python class of the original model.

    Use :meth:`imports`. Calling it interprets the graph node by node through ``apply``, so it
    runs eagerly, under autograd, and hybridized like any block. Input shapes are those of the
    export.
    """

    def __init__(self, doc, params, consts):
        super().__init__()
        from .. import nd
        from ..nn.parameter import Parameter
        object.__setattr__(self, "_doc", doc)
        object.__setattr__(self, "_consts", {k: nd.from_numpy(v) for k, v in consts.items()})
        object.__setattr__(self, "_pnodes", {})
        for i, pd in enumerate(doc["params"]):
            p = Parameter(pd["name"], tuple(pd["shape"]), pd["dtype"])
            p.grad_req = pd.get("grad_req", "write")    # files of earlier versions: 'write'
            p.initialize(init="zeros")
            p.set_data(params[pd["name"]])
            self._reg_params[pd["name"]] = p
            self._pnodes[pd["node"]] = p

    @staticmethod
    def imports(symbol_file, input_names=None, param_file=None, device=None):
        """Load ``symbol_file`` (+ ``param_file``) into a SymbolBlock.

        Raises:
            FileNotFoundError, ValueError: missing/corrupt files, input names that do not
            match, parameters missing from or mis-shaped in the parameter file.
        """
        from safetensors.numpy import load_file
        symbol_file = os.fspath(symbol_file)
        doc = load_graph_json(symbol_file)
        names = [i["name"] for i in doc["inputs"]]
        if input_names is not None:
            given = [input_names] if isinstance(input_names, str) else list(input_names)
            if given != names:
                raise ValueError(f"input_names: the graph's input(s) are {names}, got {given}")
        if param_file is None:
            if not symbol_file.endswith("-symbol.json"):
                raise ValueError(f"param_file: not given, and symbol_file {symbol_file!r} does not "
                                 f"end in '-symbol.json' to derive it from")
            param_file = symbol_file[:-len("-symbol.json")] + ".safetensors"
        from .._io import check_file
        param_file = check_file(param_file, "param_file")
        try:
            tensors = load_file(param_file)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"param_file: {param_file!r} is not a valid safetensors file ({e})") from None
        params = {}
        for pd in doc["params"]:
            a = tensors.get(pd["name"])
            if a is None:
                raise ValueError(f"param_file: {param_file!r} lacks parameter {pd['name']!r}")
            a = _one_element(a, pd["shape"])
            if list(a.shape) != list(pd["shape"]):
                raise ValueError(f"param_file: {param_file!r}: parameter {pd['name']!r} has shape "
                                 f"{list(a.shape)}, the graph expects {pd['shape']}")
            if a.dtype != np.dtype(pd["dtype"]):
                raise ValueError(f"param_file: {param_file!r}: parameter {pd['name']!r} has dtype "
                                 f"{a.dtype}, the graph expects {pd['dtype']}")
            params[pd["name"]] = a
        try:
            consts = {int(k.split("/", 1)[1]): v for k, v in tensors.items()
                      if k.startswith("__const__/")}
        except ValueError:
            raise ValueError(f"param_file: {param_file!r} has a malformed constant name") from None
        missing = [n["id"] for n in doc["nodes"] if n["kind"] == "const" and n["id"] not in consts]
        if missing:
            raise ValueError(f"param_file: {param_file!r} lacks the constants of nodes {missing}")
        for n in doc["nodes"]:
            if n["kind"] == "const":
                (shp, dt), = n["specs"]
                c = consts[n["id"]] = _one_element(consts[n["id"]], shp)
                if list(c.shape) != list(shp) or c.dtype != np.dtype(dt):
                    raise ValueError(f"param_file: {param_file!r}: constant of node {n['id']} is {c.dtype} "
                                     f"{list(c.shape)}, the graph expects {dt} {list(shp)}")
        blk = SymbolBlock(doc, params, consts)
        blk._validate(symbol_file)
        if device is not None:
            blk.reset_device(device)
        return blk

    def _validate(self, symbol_file):
        """Infer every node's output shapes and dtypes symbolically (no kernel runs) at the
        exported input shapes; a node whose op rejects its inputs or attributes, or whose
        result differs from what the file declares, is an error now rather than at a call."""
        import numpy as np

        from ..device import current_device
        from ..ndarray import NDArray
        from .hybrid import trace_graph
        # the trace reads only shapes and dtypes: read-only zero views, no memory (a file
        # declaring a 16 TiB input is refused by its graph's checks, not by MemoryError)
        args = []
        for i in self._doc["inputs"]:
            shape, dt = tuple(i["shape"]), np.dtype(i["dtype"])
            try:
                view = np.broadcast_to(np.zeros((), dt), shape)
            except ValueError as e:
                raise ValueError(f"symbol_file: {symbol_file!r}: input {i['name']!r} has shape "
                                 f"{list(shape)}, which no array can have ({e})") from None
            args.append(NDArray(shape, dt, current_device(), view))
        try:
            with autograd.predict_mode():
                trace_graph(self.forward, args)
        except ValueError as e:
            if str(e).startswith("symbol_file"):
                raise ValueError(f"symbol_file: {symbol_file!r}: {str(e)[len('symbol_file: '):]}") from None
            raise ValueError(f"symbol_file: {symbol_file!r} does not describe a valid graph: {e}") from None
        except Exception as e:  # noqa: BLE001 - any op rejecting the file's attributes
            raise ValueError(f"symbol_file: {symbol_file!r} does not describe a valid graph: "
                             f"{type(e).__name__}: {e}") from None

    def forward(self, *xs):
        doc = self._doc
        if len(xs) != len(doc["inputs"]):
            raise ValueError(f"SymbolBlock: expected {len(doc['inputs'])} input(s) "
                             f"{[i['name'] for i in doc['inputs']]}, got {len(xs)}")
        vals = {}
        dev = getattr(xs[0], "device", None) if xs else None
        in_nodes = {i["node"]: k for k, i in enumerate(doc["inputs"])}
        for n in doc["nodes"]:
            nid = n["id"]
            if n["kind"] == "input":
                x = xs[in_nodes[nid]]
                want = tuple(n["specs"][0][0])
                if tuple(x.shape) != want or x.dtype != np.dtype(n["specs"][0][1]):
                    raise ValueError(f"SymbolBlock: input {doc['inputs'][in_nodes[nid]]['name']!r} "
                                     f"must have the exported shape {want} and dtype "
                                     f"{n['specs'][0][1]}, got {tuple(x.shape)} {x.dtype} "
                                     f"(an exported graph has fixed shapes: those of the "
                                     f"example inputs given to net.export(prefix, *inputs), "
                                     f"else of the block's last call; export again with an "
                                     f"input of the shape you need)")
                vals[(nid, 0)] = x
            elif n["kind"] == "param":
                vals[(nid, 0)] = self._pnodes[nid].data(dev)
            elif n["kind"] == "const":
                c = self._consts[nid]
                vals[(nid, 0)] = c if dev is None or c.device == dev else c.to(dev)
            else:
                ins = [vals[(i, j)] for i, j in n["inputs"]]
                attrs = {k: _dec(v) for k, v in n["attrs"].items()}
                res = apply(_op(n["op"]), *ins, **attrs)
                res = res if isinstance(res, tuple) else (res,)
                if len(res) != len(n["specs"]):
                    raise ValueError(f"symbol_file: node {nid} ({n['op']}) declares "
                                     f"{len(n['specs'])} output(s), the op gives {len(res)}")
                for j, (r, (shp, dt)) in enumerate(zip(res, n["specs"])):
                    if tuple(r.shape) != tuple(shp) or r.dtype != np.dtype(dt):
                        raise ValueError(f"symbol_file: node {nid} ({n['op']}) output {j} is "
                                         f"declared {dt} {list(shp)} but is {r.dtype} "
                                         f"{list(r.shape)}")
                    vals[(nid, j)] = r
        kinds = {n["id"]: n["kind"] for n in doc["nodes"]}
        # an output that is an input, a parameter or a constant is handed out as a copy (as a
        # hybridized block's outputs are): never this block's own storage or the caller's array
        # and a value returned twice (the export's passes merge equal results) is a copy the
        # second time: the outputs never alias each other
        outs, seen = [], set()
        for i, j in doc["outputs"]:
            v = vals[(i, j)]
            outs.append(_copy(v) if kinds[i] != "op" or (i, j) in seen else v)
            seen.add((i, j))
        return outs[0] if doc.get("single_output", len(outs) == 1) else tuple(outs)
