"""Block, HybridBlock, Sequential, HybridSequential.

A Block owns Parameters and child Blocks, registered by attribute assignment
(``self.fc = nn.Dense(10)``); names are attribute paths (``'features.0.weight'``), as in
PyTorch's state_dict. ``forward`` is ordinary Python over NDArrays. A HybridBlock's ``forward``
must be traceable (no Python branching on array values); ``hybridize()`` compiles it
(see :mod:`hybridl.graph`).
"""
import re
import warnings
from collections import OrderedDict

import numpy as np

from .parameter import DeferredInitializationError, Parameter, ParameterDict

__all__ = ["Block", "HybridBlock", "Sequential", "HybridSequential"]

from ..graph.trace import STRUCTURE_VERSION  # noqa: E402  (bumped when a child is added)
from ..graph.trace import _tls as _TRACE  # noqa: E402  (.ctx: the trace running in this thread)


def _load_bfloat16_file(path):
    """The tensors of a safetensors file that holds bfloat16 ones (NumPy has no bfloat16, so
    ``safetensors.numpy`` cannot read it): ``(arrays, names of the bfloat16 ones)``, those
    widened to float32 exactly (a bfloat16 is the top 16 bits of a float32). Format: an 8-byte
    little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``,
    then the data (https://github.com/huggingface/safetensors, "Format").

    Raises:
        ValueError: a malformed file or a dtype NumPy cannot hold."""
    import json
    import struct
    kinds = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
             "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out, bf16 = {}, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        raw = data[lo:hi]
        shape = tuple(t["shape"])
        if t["dtype"] == "BF16":
            bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(shape)
            bf16.append(name)
        elif t["dtype"] in kinds:
            out[name] = np.frombuffer(raw, kinds[t["dtype"]]).reshape(shape).copy()
        else:
            raise ValueError(f"tensor {name!r} has dtype {t['dtype']}, which NumPy cannot hold")
    return out, bf16


def _cast_keeping_values(val, dtype, name, path):
    """``val.astype(dtype)`` for load_parameters(cast_dtype=True); ValueError when that changes
    a value beyond float rounding (overflow to inf, a fraction or an out-of-range number into
    an integer type, a complex number)."""
    if val.dtype.kind == "c":
        raise ValueError(f"load_parameters: parameter {name!r} is complex in {path!r}")
    with np.errstate(all="ignore"):
        out = val.astype(dtype)
        if dtype.kind == "f":
            ok = np.isfinite(out) | ~np.isfinite(val)
        else:
            ok = out.astype(val.dtype) == val
    if not ok.all():
        raise ValueError(f"load_parameters: parameter {name!r} ({val.dtype} in {path!r}) has "
                         f"values that {dtype} cannot hold")
    return out


class Block:
    """Base class of layers and models.

    Subclasses define ``forward(*args)`` and create their parameters / children in
    ``__init__`` (after ``super().__init__()``).
    """

    def __init__(self):
        object.__setattr__(self, "_children", OrderedDict())
        object.__setattr__(self, "_reg_params", OrderedDict())

    def __setattr__(self, name, value):
        if "_children" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before assigning "
                               f"attributes in __init__")
        if isinstance(value, Block):
            self._children[name] = value
            self._reg_params.pop(name, None)
            self._structure_changed()
        elif isinstance(value, Parameter):
            self._reg_params[name] = value
            self._children.pop(name, None)
            self._structure_changed()     # compiled programs read the old Parameter object
        elif name in self._children or name in self._reg_params:
            # a child or parameter replaced by something else (None, a number): it is no
            # longer part of the block (collect_params, save_parameters, compiled programs)
            self._children.pop(name, None)
            self._reg_params.pop(name, None)
            self._structure_changed()
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if name in self._children or name in self._reg_params:
            self._children.pop(name, None)
            self._reg_params.pop(name, None)
            self._structure_changed()
        object.__delattr__(self, name)

    def _structure_changed(self):
        """Children or parameters changed: when this block ran in a traced program (its
        ``_traced`` mark, see ``__call__``), every cached program is stale (programs of
        enclosing blocks too, hence one global version). A block no program has run (a layer
        being built, a slice ``net[:2]``) changes nothing compiled: no version bump, so
        building layers does not make every hybridized network retrace."""
        if self.__dict__.get("_traced"):
            STRUCTURE_VERSION[0] += 1
        self._on_child_change()

    def _on_child_change(self):
        pass

    def register_child(self, block, name=None):
        """Register ``block`` as a child (Sequential uses '0', '1', ...)."""
        name = str(len(self._children)) if name is None else name
        self._children[name] = block
        self._structure_changed()
        return block

    # ------------------------------------------------------------------ parameters
    def _named_params(self, prefix=""):
        for n, p in self._reg_params.items():
            yield prefix + n, p
        for cn, c in self._children.items():
            yield from c._named_params(prefix + cn + ".")

    def collect_params(self, select=None):
        """All parameters of this block and its children as a ParameterDict, optionally only
        those whose name matches the regular expression ``select``, matched from the start of
        the name (``re.match``, as MXNet Gluon): ``'.*weight'`` selects every weight,
        ``'0\\.'`` the first child's parameters, ``'weight'`` only a top-level ``weight``.

        Parameter names are set to their attribute paths (``'0.weight'``) on the way.

        Raises:
            ValueError: ``select`` is not a valid regular expression.

        Warns:
            UserWarning: ``select`` matches none of the block's parameters.
        """
        out = ParameterDict()
        try:
            rx = re.compile(select) if select else None
        except (re.error, TypeError) as e:
            raise ValueError(f"select: expected a regular expression, got {select!r} ({e})") from None
        seen = set()
        for name, p in self._named_params():
            if id(p) in seen:          # shared parameter: first name wins
                continue
            seen.add(id(p))
            p.name = name
            if rx is None or rx.match(name):
                out[name] = p
        if rx is not None and not out and seen:
            warnings.warn(f"collect_params({select!r}) matched none of the {len(seen)} "
                          f"parameters (names like {name!r}); the pattern is matched from the "
                          f"start of each name, e.g. '.*{select}'", UserWarning, stacklevel=2)
        return out

    def initialize(self, init=None, device=None, force_reinit=False, verbose=False):
        """Initialize every parameter (default initializer: Xavier, biases zero).

        Args:
            init: an Initializer (or name) for parameters without one of their own.
            device: a Device or a list of Devices (one copy of each parameter per device).
            force_reinit: re-initialize parameters that already have values.
        """
        self.collect_params().initialize(init, device, force_reinit, _stacklevel=3)
        return self

    def zero_grad(self):
        """Zero every parameter's gradient."""
        self.collect_params().zero_grad()

    def reset_device(self, device):
        """Move every parameter to ``device`` (a Device or list)."""
        self.collect_params().reset_device(device)

    # ------------------------------------------------------------------ save / load
    def save_parameters(self, path):
        """Save parameter values (first device) to ``path`` in safetensors format.

        Written to a temporary file in the same directory, then renamed: a crash never leaves a
        half-written file. Names are the attribute paths of ``collect_params()``.

        Raises:
            TypeError: ``path`` is not a file path.  RuntimeError: a parameter is not
            initialized.  FileNotFoundError / IsADirectoryError: the directory does not
            exist, or ``path`` is one.  OSError: the write failed (the file under ``path``,
            if any, is unchanged).
        """
        from safetensors.numpy import save_file

        from .._io import check_path
        path = check_path(path, "save_parameters: path")
        from ..ndarray import snapshot
        params = self.collect_params()      # every value at one point of the program (a
        vals = snapshot([p.data() for p in params.values()])    # training thread beside)
        tensors = dict(zip(params.keys(), vals))                # (0-d stays 0-d)
        _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "hybridl"}))

    def load_parameters(self, path, device=None, allow_missing=False, ignore_extra=False,
                        cast_dtype=False):
        """Load values saved by :meth:`save_parameters`.

        ``device``: where parameters not initialized yet are created (default: the current
        device); parameters already initialized keep their devices (as in MXNet) -- move them
        with ``reset_device``.

        ``cast_dtype=True`` converts a tensor of another dtype to the parameter's (as MXNet's
        option of that name), refusing conversions that do not keep the values (float overflow
        to inf, fractions or out-of-range numbers into integers); by default a dtype that
        differs is an error. bfloat16 tensors (PyTorch's files), which NumPy cannot hold, are
        read as float32 (exactly) and count as another dtype.

        Raises:
            TypeError: ``path`` is not a file path.  FileNotFoundError: no such file.
            IsADirectoryError: ``path`` is a directory.
            ValueError: the file is not a valid safetensors file, names are missing or extra
                (unless allowed), or a shape or dtype differs — the message names them.
        """
        from safetensors import SafetensorError, safe_open
        from safetensors.numpy import load_file

        from .._io import check_file
        if not isinstance(cast_dtype, (bool, np.bool_)):
            raise TypeError(f"load_parameters: cast_dtype must be True or False, got {cast_dtype!r}")
        path = check_file(path, "load_parameters: path")
        bf16 = []
        try:
            with safe_open(path, "numpy") as f:
                kind = (f.metadata() or {}).get("format")
            try:
                loaded = load_file(path)
            except TypeError as e:          # NumPy has no bfloat16 (a file PyTorch wrote)
                if "bfloat16" not in str(e):
                    raise
                loaded, bf16 = _load_bfloat16_file(path)
        except (SafetensorError, OSError, ValueError, Exception) as e:  # noqa: BLE001
            raise ValueError(f"load_parameters: {path!r} is not a valid safetensors parameter "
                             f"file ({type(e).__name__}: {e})") from None
        if kind == "hybridl-trainer":
            raise ValueError(f"load_parameters: {path!r} is a Trainer state file (written by "
                             f"Trainer.save_states), not parameters: load it with "
                             f"trainer.load_states({path!r})")
        params = self.collect_params()
        missing = [n for n in params if n not in loaded]
        extra = [n for n in loaded if n not in params]
        problems = []                       # every kind at once: a file of another model
        if missing and not allow_missing:   # usually has several
            problems.append(f"it lacks parameters {missing} (pass allow_missing=True to keep "
                            f"their current values)")
        if extra and not ignore_extra:
            problems.append(f"it has parameters {extra} that this network does not have (pass "
                            f"ignore_extra=True to skip them)")
        shapes = []
        for name, p in params.items():
            if name not in loaded:
                continue
            val = loaded[name]
            shp = p.shape       # may hold 0 for a dimension still to be inferred (deferred)
            if shp is not None and shp == () and val.shape == (1,):
                val = loaded[name] = val.reshape(())    # a 0-d parameter saved as [1] before
            if shp is not None and (len(shp) != val.ndim or
                                    any(a and a != b for a, b in zip(shp, val.shape))):
                shapes.append(f"parameter {name!r} has shape {p.shape} in the network but "
                              f"{tuple(val.shape)} in the file")
        if shapes:                          # every kind of mismatch in one error
            problems.append(", ".join(shapes[:6]) + (f" (and {len(shapes) - 6} more)"
                                                      if len(shapes) > 6 else ""))
        if problems:
            raise ValueError(f"load_parameters: {path!r}: " + "; ".join(problems))
        for name, p in params.items():
            if name not in loaded:
                continue
            val = loaded[name]
            if val.dtype != p.dtype or name in bf16:
                if not cast_dtype:
                    raise ValueError(f"load_parameters: parameter {name!r} is {p.dtype} in the "
                                     f"network but {'bfloat16' if name in bf16 else val.dtype} "
                                     f"in {path!r} (pass cast_dtype=True to convert)")
                loaded[name] = _cast_keeping_values(val, p.dtype, name, path)
        for name, p in params.items():
            if name not in loaded:
                continue
            if p._data is None:
                dev = device if device is not None else (p._deferred[1] if p._deferred else None)
                p._shape = tuple(loaded[name].shape)
                p.initialize(init="zeros", device=dev)
            p.set_data(loaded[name])

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        if _TRACE.__dict__.get("ctx") is not None:
            _mark_traced(self)
        return self.forward(*args, **kwargs)

    def forward(self, *args):
        if hasattr(self, "hybrid_forward"):     # Gluon 1.x style: hybrid_forward(self, F, x)
            raise NotImplementedError(
                f"{type(self).__name__} defines hybrid_forward(self, F, ...) (MXNet Gluon 1.x); "
                f"hybridl blocks define forward(self, x, ...) and call hl.nd / layers directly "
                f"(as Gluon 2 and PyTorch): rename it to forward and drop the F argument")
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def apply(self, fn):
        """Call ``fn(block)`` on every child (recursively) and on this block."""
        for c in self._children.values():
            c.apply(fn)
        fn(self)
        return self

    def hybridize(self, active=True, **kwargs):
        """Hybridize every HybridBlock child (a plain Block itself stays imperative).

        Raises:
            TypeError: an unknown option; ValueError: an unknown pass name (see
                :meth:`HybridBlock.hybridize`)."""
        _check_hybridize_options(kwargs)
        for c in self._children.values():
            c.hybridize(active, **kwargs)

    def __repr__(self):
        lines = [f"{type(self).__name__}("]
        for n, c in self._children.items():
            sub = repr(c).replace("\n", "\n  ")
            lines.append(f"  ({n}): {sub}")
        return "\n".join(lines) + ")" if self._children else f"{type(self).__name__}({self._extra_repr()})"

    def _extra_repr(self):
        return ""


# hybridize() options: the compiler's, and MXNet's two, which hybridl's compiled programs
# always do (a memory plan of static buffers for fixed shapes), so they change nothing
_HYBRIDIZE_OPTIONS = ("passes", "parallel_segments", "static_alloc", "static_shape")


def _check_hybridize_options(kwargs):
    bad = sorted(k for k in kwargs if k not in _HYBRIDIZE_OPTIONS)
    if bad:
        raise TypeError(f"hybridize: unknown option(s) {bad}; the options are "
                        f"{list(_HYBRIDIZE_OPTIONS)}")
    if kwargs.get("passes") is not None:        # a bad name is an error here, not at the call
        from ..graph.passes import check_passes
        check_passes(kwargs["passes"])


def _atomic_write(path, write):
    """Write through a temporary file and rename (see :mod:`hybridl._io`)."""
    from .._io import atomic_write
    atomic_write(path, write)


_GRAPH = []      # [graph.hybrid.call_cached] once imported


def _mark_traced(block):
    """``block`` runs in a traced program: from now on its structure changes bump
    STRUCTURE_VERSION (see Block._structure_changed)."""
    if not block.__dict__.get("_traced"):
        object.__setattr__(block, "_traced", True)


class HybridBlock(Block):
    """A Block whose ``forward`` can be traced into a graph and compiled (``hybridize()``).

    ``forward`` must use only hl.nd operations on its inputs and parameters (no Python
    branches on array values; use ``hl.nd.where``).
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "_active", False)
        object.__setattr__(self, "_cached", None)
        object.__setattr__(self, "_hybrid_flags", {})

    def __deepcopy__(self, memo):
        """A deep copy without the compiled programs (the copy traces its own on its first
        hybridized call): parameters, children and settings are copied."""
        import copy
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k in ("_hcache", "_last_program", "_last_call", "_fast"):
                continue
            object.__setattr__(new, k, None if k == "_cached" else copy.deepcopy(v, memo))
        return new

    def _on_child_change(self):
        if getattr(self, "_cached", None) is not None:
            object.__setattr__(self, "_cached", None)

    def hybridize(self, active=True, **kwargs):
        """Compile ``forward`` on its next call (one cached program per input signature).

        Calling it again (or adding a child) clears the cache. A signature keeps one
        program per set of parameters that want gradients (freezing and unfreezing a part,
        as a GAN's loop does, switches programs without retracing). ``hybridize(False)``
        goes back to imperative execution. Options: ``passes=[...]`` (graph passes by name,
        default all), ``parallel_segments=True`` (run independent parts of the graph as
        separate engine ops, which may run at once); MXNet's ``static_alloc`` and
        ``static_shape`` are accepted and change nothing (compiled programs always run from
        a static memory plan for their fixed shapes).

        Raises:
            TypeError: an unknown option.  ValueError: an unknown pass name (see
                :func:`hybridl.graph.passes.check_passes`).

        The backward of a hybridized block is a compiled program without a gradient of its
        own: ``autograd.grad(..., create_graph=True)`` through it raises NotImplementedError
        (higher-order gradients need the block imperative).
        """
        _check_hybridize_options(kwargs)
        object.__setattr__(self, "_active", bool(active))
        object.__setattr__(self, "_hybrid_flags", dict(kwargs))
        object.__setattr__(self, "_cached", None)
        object.__setattr__(self, "_fast", None)
        for c in self._children.values():       # children run inside the parent's program
            c.hybridize(False)

    def __call__(self, *args, **kwargs):
        if _TRACE.__dict__.get("ctx") is not None:     # inside a trace: inline it
            _mark_traced(self)
        elif self._active:
            if not kwargs:
                call = _GRAPH
                if not call:                       # imported on first use (graph imports nn)
                    from ..graph import hybrid
                    call.append(hybrid.call_cached)
                fast = self.__dict__.get("_fast")      # the last call's program again
                if fast is not None:                    # (see graph.hybrid._fast_call)
                    out = fast(args)
                    if out is not None:
                        return out
                return call[0](self, args)
            elif not self.__dict__.get("_warned_kwargs"):
                object.__setattr__(self, "_warned_kwargs", True)
                warnings.warn(f"{type(self).__name__} is hybridized but was called with "
                              f"keyword arguments {sorted(kwargs)}: such calls run "
                              f"imperatively (not compiled); pass arrays positionally",
                              RuntimeWarning, stacklevel=2)
        return self.forward(*args, **kwargs)

    def export(self, prefix, *example_inputs):
        """Write ``prefix-symbol.json`` (graph) and ``prefix.safetensors`` (parameters), loadable
        with ``hl.nn.SymbolBlock.imports`` without this class. See :mod:`hybridl.graph.export`.
        Returns (symbol_file, param_file)."""
        from ..graph.export import export
        return export(self, prefix, *example_inputs)

    @property
    def last_program(self):
        """The compiled :class:`~hybridl.graph.program.Program` of the last new signature this
        block was traced for (``.source``, ``.graph``, ``.memory_plan``; under autograd its
        ``.backward`` is the compiled backward half), or None before the first hybridized call."""
        entry = self.__dict__.get("_last_program")
        if entry is None:
            return None
        prog = entry.fwd
        prog.backward = entry.bwd
        return prog

    def cache_info(self):
        """Hits, misses, the reason of each miss and the number of cached programs."""
        from ..graph.hybrid import cache_info
        return cache_info(self)

    def infer_shape(self, *args):
        """Finish deferred parameter shapes from example inputs (runs one forward)."""
        from .. import autograd
        with autograd.pause():
            self.forward(*args)


class Sequential(Block):
    """Children called in order: ``net.add(a, b, c)`` (or ``Sequential(a, b, c)``, as
    ``torch.nn.Sequential``); ``net(x) == c(b(a(x)))``.

    Raises:
        TypeError: a child that is not a Block."""

    def __init__(self, *blocks):
        super().__init__()
        if blocks:
            self.add(*blocks)

    def add(self, *blocks):
        """Append blocks (registered as children '0', '1', ...)."""
        for b in blocks:
            if not isinstance(b, Block):
                raise TypeError(f"add: expected Blocks, got {type(b).__name__}")
            self.register_child(b)
        return self

    def forward(self, x, *args):
        for b in self._children.values():
            x = b(x, *args) if args else b(x)
            args = ()
        return x

    def __getitem__(self, i):
        kids = list(self._children.values())
        if isinstance(i, slice):
            s = type(self)()
            s.add(*kids[i])
            return s
        return kids[i]

    def __len__(self):
        return len(self._children)


class HybridSequential(HybridBlock):
    """Sequential of HybridBlocks: hybridizable as a whole; ``HybridSequential(a, b, c)`` or
    ``.add(a, b, c)``."""

    def __init__(self, *blocks):
        super().__init__()
        if blocks:
            self.add(*blocks)

    add = Sequential.add
    forward = Sequential.forward
    __len__ = Sequential.__len__
    __getitem__ = Sequential.__getitem__


_ = DeferredInitializationError
