"""Tracing context: while a HybridBlock or a jit function is being traced, parameters read
through ``Parameter.data()`` resolve to the traced inputs that stand for them."""
import threading

_tls = threading.local()

# Incremented whenever any block gains a child (hybridl.nn.block): a hybridized block compares
# it with the value its programs were built at, so adding a grandchild invalidates the parent.
STRUCTURE_VERSION = [0]


def is_tracing():
    """Whether this thread is tracing a program."""
    return getattr(_tls, "ctx", None) is not None


def current_context():
    return getattr(_tls, "ctx", None)


def current_param_value(param, device=None):
    """The traced value standing for ``param`` in the trace being built, else None."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        return None
    return ctx.param_value(param)


class _Enter:
    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        self.prev = getattr(_tls, "ctx", None)
        _tls.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc):
        _tls.ctx = self.prev
        return False


def tracing(ctx):
    """Context manager that makes ``ctx`` the active trace of this thread."""
    return _Enter(ctx)
