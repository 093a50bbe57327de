"""Pure-NumPy backend kernels: forward and backward math of NN ops as plain functions on
numpy arrays (NCHW layouts, float32/float64, dtype-preserving). No dependency on the rest of
hybridl; the op registry (``hybridl.ops``) wires them in.
"""

from .conv import conv2d, conv2d_grad_input, conv2d_grad_weight, conv2d_output_shape, im2col
from .norm import batch_norm_grad, batch_norm_infer, batch_norm_train, layer_norm, layer_norm_grad
from .pool import avg_pool2d, avg_pool2d_grad, max_pool2d, max_pool2d_grad, pool2d_output_shape
from .softmax import (log_softmax, softmax, softmax_cross_entropy, softmax_cross_entropy_grad,
                      softmax_cross_entropy_with_grad)

__all__ = [
    "conv2d", "conv2d_grad_input", "conv2d_grad_weight", "conv2d_output_shape", "im2col",
    "max_pool2d", "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad", "pool2d_output_shape",
    "batch_norm_train", "batch_norm_infer", "batch_norm_grad", "layer_norm", "layer_norm_grad",
    "softmax", "log_softmax", "softmax_cross_entropy", "softmax_cross_entropy_grad",
    "softmax_cross_entropy_with_grad",
]
