"""``hl.sym``: the symbolic API. ``var`` makes a program input; every ``hl.nd`` function and
operator applies to Symbols too (building graph nodes); ``hl.compile`` turns outputs into a
Program."""
from .graph import compile, const, var  # noqa: F401,A004
from .graph.ir import Symbol  # noqa: F401
from .nd import *  # noqa: F401,F403
