"""``hl.nn``: Parameters, Blocks and layers (MXNet Gluon's names)."""
from .block import Block, HybridBlock, HybridSequential, Sequential  # noqa: F401
from .layers import (ELU, Activation, AvgPool2D, BatchNorm, Conv2D, Dense, Dropout,  # noqa: F401
                     Embedding, Flatten, GlobalAvgPool2D, LayerNorm, LeakyReLU, MaxPool2D)
from .parameter import DeferredInitializationError, Parameter, ParameterDict  # noqa: F401


def __getattr__(name):
    if name == "SymbolBlock":
        from ..graph.export import SymbolBlock
        return SymbolBlock
    if name == "SyncBatchNorm":
        from ..parallel.sync_bn import SyncBatchNorm
        return SyncBatchNorm
    raise AttributeError(f"module 'hybridl.nn' has no attribute {name!r}")
