"""Operator definitions: one place per op (infer, kernel, grad, cost). See :mod:`.registry`."""
from . import math, nn  # noqa: F401  (registers every op)
from .dispatch import apply, register_interpreter  # noqa: F401
from .registry import NO_VALUES, OPS, GradCtx, Op, register  # noqa: F401

# gradient rules that read no input or output value (autograd then checks only the inputs that
# need gradients for writes after recording; see hybridl.autograd._check_versions)
for _name in ("add", "subtract", "negative", "reshape", "transpose", "broadcast_to", "sum",
              "mean", "sum_to", "identity", "stop_gradient", "slice", "slice_grad", "concat",
              "cast", "zeros_like", "ones_like"):
    OPS[_name].grad_reads = NO_VALUES
del _name
