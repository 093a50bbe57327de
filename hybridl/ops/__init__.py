"""Operator definitions: one place per op (infer, kernel, grad, cost). See :mod:`.registry`."""
from . import math, nn  # noqa: F401  (registers every op)
from .dispatch import apply, register_interpreter  # noqa: F401
from .registry import OPS, GradCtx, Op, register  # noqa: F401
