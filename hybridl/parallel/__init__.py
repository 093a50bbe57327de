"""``hl.parallel``: several logical devices in one process (DESIGN section 5).

* :func:`split_and_load` -- split a batch over devices (data parallelism's first step);
* :func:`transfer` -- an autograd-aware device copy (the gradient is copied back);
* :class:`DataParallel` -- wrap a network: split, run a replica per device, gather the outputs;
  with ``hl.Trainer(..., kvstore='device')`` the gradients are all-reduced
  (:mod:`hybridl.kv`, ring allreduce in :mod:`hybridl.parallel.allreduce`);
* :class:`SyncBatchNorm` -- batch statistics across devices (:mod:`.sync_bn`);
* :class:`Pipeline` -- GPipe / 1F1B micro-batch pipelines (:mod:`.pipeline`);
* :class:`ColumnParallelDense`, :class:`RowParallelDense`, :class:`ChannelParallelConv2D` --
  tensor-parallel layers (:mod:`.tensor`);
* :func:`train_multi_device` -- ``hybridl train --devices cpu:0,cpu:1 --strategy ...``.
"""
import numpy as np

from .allreduce import allreduce, reduce_broadcast, ring_allreduce  # noqa: F401

__all__ = ["split_and_load", "split_data", "transfer", "DataParallel", "allreduce",
           "ring_allreduce", "reduce_broadcast", "SyncBatchNorm", "Pipeline",
           "ColumnParallelDense", "RowParallelDense", "ChannelParallelConv2D",
           "train_multi_device"]

_LAZY = {"SyncBatchNorm": "sync_bn", "Pipeline": "pipeline", "ColumnParallelDense": "tensor",
         "RowParallelDense": "tensor", "ChannelParallelConv2D": "tensor",
         "train_multi_device": "train"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'hybridl.parallel' has no attribute {name!r}")
    import importlib
    val = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = val
    return val


# ============================================================================ splitting


def _bounds(size, k, even_split, what="data"):
    if k < 1:
        raise ValueError("devices: expected at least one device, got none")
    if even_split:
        if size % k:
            raise ValueError(f"split_and_load: {what} has {size} samples along the batch axis, "
                             f"which does not split evenly over {k} devices; pass "
                             f"even_split=False or use a batch size divisible by {k}")
    elif size < k:
        raise ValueError(f"split_and_load: {what} has {size} samples along the batch axis, fewer "
                         f"than the {k} devices (a device would get an empty slice)")
    step, rem = divmod(size, k)
    b = [0]
    for i in range(k):
        b.append(b[-1] + step + (1 if i < rem else 0))
    return b


def split_data(data, num_slice, batch_axis=0, even_split=True):
    """Split ``data`` (NDArray or NumPy array) into ``num_slice`` slices along ``batch_axis``
    on its own device. With ``even_split=False`` the first ``size % num_slice`` slices get one
    extra sample (as ``numpy.array_split``).

    Raises:
        ValueError: an uneven split with ``even_split=True``, fewer samples than slices, or a
            bad ``batch_axis``.
    """
    nd_ = getattr(data, "ndim", None)
    if nd_ is None:
        data = np.asarray(data)
        nd_ = data.ndim
    if not -nd_ <= batch_axis < nd_:
        raise ValueError(f"batch_axis: expected an axis of the {nd_}-d data, got {batch_axis}")
    ax = batch_axis % nd_
    b = _bounds(data.shape[ax], num_slice, even_split)
    out = []
    for i in range(num_slice):
        key = (slice(None),) * ax + (slice(b[i], b[i + 1]),)
        out.append(data[key])
    return out


def split_and_load(data, devices, batch_axis=0, even_split=True):
    """Split a batch along ``batch_axis`` and copy one slice to each device.

    Args:
        data: an NDArray or a NumPy array (or anything ``numpy.asarray`` accepts),
            shape (N, ...) with N on ``batch_axis``.
        devices: a list of Devices (or strings like ``'cpu:1'``); slice i goes to devices[i].
        batch_axis (int): the axis to split.
        even_split (bool): require N divisible by ``len(devices)`` (each device then gets
            N / k samples); False gives the first ``N % k`` devices one more sample.

    Returns:
        list of NDArray, one per device, each copied there with ``copyto`` (an asynchronous
        engine copy); a NumPy input is wrapped directly on each device.

    Raises:
        ValueError: uneven split with ``even_split=True``, N < number of devices, no devices,
            or a bad ``batch_axis``.
    """
    from ..device import Device
    from ..ndarray import NDArray, array
    if isinstance(devices, (Device, str)):
        devices = [devices]
    devices = [Device.parse(d) for d in devices]
    if not devices:
        raise ValueError("devices: expected at least one device, got an empty list")
    if not isinstance(data, NDArray):
        data = np.asarray(data)
    if isinstance(batch_axis, bool) or not isinstance(batch_axis, (int, np.integer)):
        raise TypeError(f"batch_axis: expected an int, got {type(batch_axis).__name__} "
                        f"{batch_axis!r}")
    if not -data.ndim <= batch_axis < data.ndim:
        raise ValueError(f"batch_axis: expected an axis of the {data.ndim}-d data, got {batch_axis}")
    if not isinstance(data, NDArray):
        if len(devices) == 1:
            return [array(data, device=devices[0])]
        return [array(s, device=d) for s, d in zip(split_data(data, len(devices), batch_axis,
                                                               even_split), devices)]
    if len(devices) == 1:
        return [data.to(devices[0])]
    from .. import autograd
    parts = split_data(data, len(devices), batch_axis, even_split)
    if autograd.is_recording() and (data._ag is not None or data._grad_req != "null"):
        # data that needs a gradient (a generator's output, an input for a saliency map):
        # differentiable copies, so each slice's gradient comes back to data's device
        return [transfer(p, d) for p, d in zip(parts, devices)]
    with autograd.pause(autograd.is_training()):
        return [p if p.device == d else p.copyto(d) for p, d in zip(parts, devices)]


# ============================================================================ transfer


def _transfer_grad(ctx, g):
    return (transfer(g, ctx.inputs[0].device),)


_TRANSFER = None


def _transfer_op():
    global _TRANSFER
    if _TRANSFER is None:
        from ..ops.registry import Op
        _TRANSFER = Op("device_copy", lambda x: x, lambda x: [(x.shape, x.dtype)], _transfer_grad,
                       cost=lambda i, o, s, **a: (0.0, 2.0 * float(np.prod(i[0])) * s))
    return _TRANSFER


def transfer(x, device):
    """``x.copyto(device)`` that autograd differentiates correctly across devices: the gradient
    of the copy is copied back to ``x.device`` (``NDArray.copyto`` records an identity whose
    gradient would stay on the destination device).

    Returns ``x`` itself when it is already on ``device``.
    """
    from .. import autograd
    from ..device import Device
    dev = Device.parse(device)
    if x.device == dev:
        return x
    with autograd.pause(autograd.is_training()):
        out = x.copyto(dev)
    if autograd.is_recording() and (x._ag is not None or x._grad_req != "null"):
        autograd.record_op(_transfer_op(), (x,), [out], {})
    return out


# ============================================================================ data parallel


class DataParallel:
    """Data parallelism as a Block-like wrapper: ``DataParallel(net, devices)(x)`` splits ``x``
    over ``devices`` (:func:`split_and_load`, ``even_split=False``), runs ``net`` on each slice
    (one replica per device: initialize ``net`` with ``device=devices``), and gathers the outputs
    on ``devices[0]`` (concatenated along axis 0, gradients flowing back through
    :func:`transfer`; a network returning a tuple or list of arrays gives a tuple or list of
    gathered arrays).

    With ``hl.Trainer(net.collect_params(), ..., kvstore='device')`` each replica's gradient is
    all-reduced before the update, so every copy takes the same step: training equals
    single-device training on the whole batch (up to float rounding).

    The loss is then computed on ``devices[0]`` (only the logits move); to keep it per device
    use the explicit loop::

        xs, ys = split_and_load(x, devices), split_and_load(y, devices)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(x.shape[0])

    Per-device batch: a total batch B gives B / k samples per device; scaling B with k and the
    learning rate linearly with B (Goyal et al. 2017, "Accurate, Large Minibatch SGD") keeps
    per-sample work per device constant.
    """

    def __init__(self, net, devices):
        from ..device import Device
        self.net = net
        if isinstance(devices, (Device, str)):
            devices = [devices]
        self.devices = [Device.parse(d) for d in devices]
        if not self.devices:
            raise ValueError("DataParallel: devices: expected at least one device, got an "
                             "empty list")

    def __call__(self, x):
        from ..ops.math import concat
        k = min(len(self.devices), x.shape[0])
        from .. import autograd
        if k < len(self.devices) and autograd.is_training() and self._has_sync_bn():
            raise ValueError(f"DataParallel: a batch of {x.shape[0]} sample(s) over "
                             f"{len(self.devices)} devices leaves a device without data, and "
                             f"the network's SyncBatchNorm waits for every device; use a batch "
                             f"of at least {len(self.devices)}")
        if k <= 1:
            return self.net(x.to(self.devices[0]))
        xs = split_and_load(x, self.devices[:k], even_split=False)
        outs = [self.net(a) for a in xs]
        home = self.devices[0]
        if isinstance(outs[0], (tuple, list)):  # several outputs: each gathered on its own
            if any(not isinstance(o, (tuple, list)) or len(o) != len(outs[0]) for o in outs):
                raise TypeError("DataParallel: the network returned outputs of different "
                                "structure on different devices")
            return type(outs[0])(concat(*[transfer(o[j], home) for o in outs], axis=0)
                                 for j in range(len(outs[0])))
        return concat(*[transfer(o, home) for o in outs], axis=0)

    forward = __call__

    def _has_sync_bn(self):
        if self.__dict__.get("_sync_bn") is None:
            from .sync_bn import SyncBatchNorm
            found = []
            self.net.apply(lambda b: found.append(b) if isinstance(b, SyncBatchNorm) else None)
            self._sync_bn = bool(found)
        return self._sync_bn

    def collect_params(self, select=None):
        return self.net.collect_params(select)

    def hybridize(self, active=True, **kw):
        self.net.hybridize(active, **kw)
