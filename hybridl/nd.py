"""``hl.nd``: the NDArray namespace (creation, math, NN ops, random).

Every function here accepts NDArrays (eager, asynchronous) and, inside hybridized code, traced
values; see :mod:`hybridl.ops` for the op definitions.
"""
from . import random  # noqa: F401  (hl.nd.random.uniform, ...)
from .ndarray import (NDArray, arange, array, empty, empty_like, from_numpy, full,  # noqa: F401
                      full_like, ones, ones_like, waitall, zeros, zeros_like)
from .ops.math import (abs, add, argmax, argmin, broadcast_to, cast, clip, concat, cos,  # noqa: F401,A004
                       divide, dot, equal, exp, expand_dims, expm1, flatten, floor,
                       fully_connected, greater, greater_equal, identity, less, less_equal, log,
                       log1p, logical_and, logical_not, logical_or, logical_xor, matmul, max,
                       maximum, mean, min, minimum, multiply, negative, not_equal, one_hot, power,
                       prod, reciprocal, relu, reshape, sigmoid, sign, sin, slice_, softplus,
                       split, sqrt, square, squeeze, stack, stop_gradient, subtract, sum, sum_to,
                       swapaxes, take, tanh, transpose, where)
from .ops.nn import (avg_pool2d, batch_norm, class_indices, conv2d, dropout,  # noqa: F401
                     embedding, global_avg_pool2d, layer_norm, log_softmax, max_pool2d, softmax,
                     softmax_cross_entropy)
