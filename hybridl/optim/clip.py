"""Gradient clipping by global norm (MXNet Gluon's ``gluon.utils.clip_global_norm``; PyTorch's
``torch.nn.utils.clip_grad_norm_``; Pascanu, Mikolov & Bengio 2013, "On the difficulty of
training recurrent neural networks", section 3.2)."""
import math
import numbers
import warnings

__all__ = ["clip_global_norm"]


def clip_global_norm(arrays, max_norm, check_isfinite=True):
    """Scale ``arrays`` in place by ``max_norm / norm`` when their joint 2-norm
    ``norm = sqrt(sum_i ||a_i||^2)`` exceeds ``max_norm``; returns ``norm`` (before clipping).

    Typical use, between backward and the update (the Trainer divides by the batch size after
    this, so ``max_norm`` bounds the summed gradient)::

        loss.backward()
        hl.optim.clip_global_norm([p.grad() for p in params], 1.0)
        trainer.step(batch_size)

    With parameters on several devices: ``trainer.allreduce_grads()`` (every device then holds
    the summed gradients), clip EACH device's list (``clip_global_norm([p.grad(d) for p in
    params], max_norm)`` for every device ``d``: equal lists, so equal norms and scales), then
    ``trainer.update(batch_size)``. Not for ``grad_req='add'`` parameters on several devices
    (the update then reads separate reduced buffers).

    Args:
        arrays: a non-empty list of float NDArrays (any shapes and devices); not inside
            ``autograd.record()``.
        max_norm (float): > 0.
        check_isfinite (bool): warn when the norm is inf or NaN (the arrays are then scaled
            by NaN or 0, as in Gluon).

    Returns:
        float: the global norm before clipping (computed in float64; a sync point).

    Raises:
        TypeError: arrays not a list of NDArrays, or not float ones.
        ValueError: an empty list, or max_norm not a finite number > 0.
    """
    from ..ndarray import NDArray
    from .. import nd
    if isinstance(arrays, NDArray) or not isinstance(arrays, (list, tuple)):
        raise TypeError(f"arrays: expected a list of NDArrays, got {type(arrays).__name__}")
    if not arrays:
        raise ValueError("arrays: expected at least one array, got an empty list")
    for i, a in enumerate(arrays):
        if not isinstance(a, NDArray):
            raise TypeError(f"arrays[{i}]: expected an NDArray, got {type(a).__name__}")
        if a.dtype.kind != "f":
            raise TypeError(f"arrays[{i}]: expected a float array, got dtype {a.dtype}")
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) \
            or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm: expected a finite number > 0, got {max_norm!r}")
    dev = arrays[0].device
    parts = [nd.sum(nd.square(a.astype("float64"))) for a in arrays]
    total = parts[0]
    for p in parts[1:]:
        total = total + (p if p.device == dev else p.copyto(dev))
    norm = math.sqrt(float(total.item()))
    if check_isfinite and not math.isfinite(norm):
        warnings.warn("clip_global_norm: the norm is inf or NaN; the clipped values are "
                      "undefined", RuntimeWarning, stacklevel=2)
    scale = max_norm / (norm + 1e-8)
    if not scale >= 1.0:                    # (NaN scales too, as in Gluon)
        for a in arrays:
            a *= scale
    return norm
