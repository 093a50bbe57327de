"""Tensor-parallel layers: one layer's weight split over devices (Megatron-LM style).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3: a Dense layer ``Y = X W^T`` (W: (out, in)) is split

* by output features (:class:`ColumnParallelDense`): device i holds rows ``W_i`` (out_i, in) and
  computes ``Y_i = X W_i^T``; the input is broadcast (its gradient is the sum of the devices'
  input gradients), the outputs are either gathered (concatenated on the feature axis) or kept
  as shards for a following row-parallel layer;
* by input features (:class:`RowParallelDense`): device i holds columns ``W_i`` (out, in_i) and
  the matching input slice ``X_i``; ``Y = sum_i X_i W_i^T`` needs one reduction (here: onto
  ``devices[0]``, where the bias is added).

Column then Row (Megatron's MLP block: ``Row(act(Column(x, gather_output=False)),
input_is_parallel=True)``) needs one broadcast going in and one reduction coming out, and the
elementwise activation runs on the shards. :class:`ChannelParallelConv2D` splits a convolution's
*output channels* the same way (each device convolves the whole input with its filters; the
feature maps are gathered on the channel axis).

Every shard is its own :class:`hybridl.nn.Parameter`, pinned to its device (``initialize``
on a parent block does not move it). Copies between devices are asynchronous engine ops
(:func:`hybridl.parallel.transfer`), so the shards compute in parallel. These layers are plain
Blocks (imperative); the blocks around them may be hybridized.
"""
import numpy as np

from .. import nd as F
from ..device import Device
from ..nn.block import Block
from ..nn.layers import _act
from ..nn.parameter import Parameter, _devices
from . import transfer

__all__ = ["ColumnParallelDense", "RowParallelDense", "ChannelParallelConv2D", "ShardParameter"]


class _ShardGroup:
    """The shards of one layer's weight (or bias), split along ``axis`` in ``sizes``: their
    initial values are slices of ONE draw of the whole tensor with the layer's initializer, so
    a tensor-parallel layer starts exactly as the unsplit layer would (with the same
    distribution -- Xavier's fans are the whole layer's -- and, under one seed, the same
    numbers) on any number of devices."""

    def __init__(self, axis, sizes):
        self.axis, self.sizes = axis, sizes
        self._full, self._served = None, set()

    def shard(self, index, init, shape, dtype, device):
        full_shape = list(shape)
        full_shape[self.axis] = int(sum(self.sizes))
        if self._full is None or index in self._served:     # a new round (or re-initialization)
            self._full = np.asarray(init(tuple(full_shape), dtype, device).asnumpy())
            self._served = set()
        self._served.add(index)
        off = int(sum(self.sizes[:index]))
        part = np.take(self._full, np.arange(off, off + shape[self.axis]), axis=self.axis)
        if len(self._served) == len(self.sizes):
            self._full = None                               # every shard has its slice
        from .. import nd
        return nd.array(part, dtype=dtype, device=device)


class ShardParameter(Parameter):
    """A Parameter that lives on one fixed device: ``initialize(device=...)`` and
    ``reset_device`` ignore the device asked for (a tensor-parallel shard must stay put).
    Shards of one layer share a :class:`_ShardGroup` and are initialized as slices of the
    whole layer's weight."""

    def __init__(self, *args, device=None, group=None, index=0, **kw):
        super().__init__(*args, **kw)
        self.home = Device.parse(device)
        self._group, self._index = group, index

    def initialize(self, init=None, device=None, default_init=None, force_reinit=False,
                   _warn=True):
        return super().initialize(init, self.home, default_init, force_reinit, _warn)

    def _init_now(self, init, devices, shape=None):
        g = self._group
        if g is None or g.sizes is None:
            return super()._init_now(init, devices, shape)

        def sliced(shape, dtype, device):
            return g.shard(self._index, init, shape, dtype, device)
        return super()._init_now(sliced, devices, shape)

    def reset_device(self, device):
        return None


def _sizes(n, k, what, layer):
    if n < k:
        raise ValueError(f"{layer}: {what}={n} cannot be split over {k} devices (need >= {k})")
    return [len(a) for a in np.array_split(np.arange(n), k)]


def _check_devices(devices, layer):
    devs = _devices(devices)
    if len(devs) < 1:
        raise ValueError(f"{layer}: expected at least one device")
    return devs


class _Sharded(Block):
    """Common part: shard parameters ``weight{i}``/``bias{i}`` on ``devices[i]``."""

    def _make(self, wshapes, bshapes, dtype, winit, binit, axis=0, sizes=None):
        """Shards ``weight{i}`` (and ``bias{i}``), split along ``axis`` of the weight in
        ``sizes`` (None: set later, when the input is seen)."""
        self._w, self._b = [], []
        self._wgroup = _ShardGroup(axis, sizes)
        bgroup = _ShardGroup(0, sizes)
        for i, d in enumerate(self.devices):
            w = ShardParameter(f"weight{i}", wshapes[i], dtype, winit, device=d,
                               group=self._wgroup, index=i)
            setattr(self, f"weight{i}", w)
            self._w.append(w)
            if bshapes is not None:
                b = ShardParameter(f"bias{i}", bshapes[i], dtype, binit, device=d,
                                   group=bgroup, index=i)
                setattr(self, f"bias{i}", b)
                self._b.append(b)

    def shard_params(self):
        """[(weight_i, bias_i or None)] per device."""
        return [(w, self._b[i] if self._b else None) for i, w in enumerate(self._w)]


class ColumnParallelDense(_Sharded):
    """Dense layer split by output features over ``devices``.

    Shapes: x (N, ...) (flattened to (N, in_units)) on any device -> (N, units) on
    ``devices[0]`` when ``gather_output`` (default), else a list of (N, units_i) shards, shard i
    on ``devices[i]``. Shard i holds ``weight{i}`` (units_i, in_units) and ``bias{i}``
    (units_i,), with units_i = the sizes of ``numpy.array_split(range(units), k)``.

    Raises:
        ValueError: units < number of devices; unknown activation.
    """

    def __init__(self, units, devices, activation=None, use_bias=True, in_units=0,
                 gather_output=True, dtype="float32", weight_initializer=None,
                 bias_initializer="zeros"):
        super().__init__()
        self.devices = _check_devices(devices, "ColumnParallelDense")
        self._units, self._in = units, in_units
        self._sizes = _sizes(units, len(self.devices), "units", "ColumnParallelDense")
        self._act = _act(activation)
        self._gather = gather_output
        self._make([(u, in_units) for u in self._sizes], [(u,) for u in self._sizes]
                   if use_bias else None, dtype, weight_initializer, bias_initializer,
                   0, self._sizes)

    def forward(self, x):
        if len(x.shape) != 2:
            x = F.reshape(x, (x.shape[0], -1))
        if not self._w[0]._shape_known():
            for w, u in zip(self._w, self._sizes):
                w._finish_deferred_init((u, x.shape[1]))
        ys = []
        for i, (w, b) in enumerate(self.shard_params()):
            d = self.devices[i]
            xi = transfer(x, d)
            y = F.fully_connected(xi, w.data(d), None if b is None else b.data(d), True)
            ys.append(self._act(y) if self._act else y)
        if not self._gather:
            return ys
        home = self.devices[0]
        return ys[0] if len(ys) == 1 else F.concat(*[transfer(y, home) for y in ys], axis=1)

    def load_full(self, weight, bias=None):
        """Set the shards from the unsplit ``weight`` (units, in_units) and ``bias`` (units,)."""
        w = np.asarray(weight)
        cuts = np.cumsum([0] + self._sizes)
        for i, (pw, pb) in enumerate(self.shard_params()):
            pw.set_data(w[cuts[i]:cuts[i + 1]])
            if pb is not None and bias is not None:
                pb.set_data(np.asarray(bias)[cuts[i]:cuts[i + 1]])


class RowParallelDense(_Sharded):
    """Dense layer split by input features over ``devices``; the partial products are summed
    on ``devices[0]``, where the bias (``bias0`` only) and activation are applied.

    Shapes: x (N, in_units) on any device, or (``input_is_parallel=True``) a list of shards
    (N, in_i) with shard i on ``devices[i]`` (the output of a ColumnParallelDense with
    ``gather_output=False`` and the same devices) -> (N, units) on ``devices[0]``. Shard i
    holds ``weight{i}`` (units, in_i).

    Raises:
        ValueError: in_units < number of devices; shard list of the wrong length.
    """

    def __init__(self, units, devices, activation=None, use_bias=True, in_units=0,
                 input_is_parallel=False, dtype="float32", weight_initializer=None,
                 bias_initializer="zeros"):
        super().__init__()
        self.devices = _check_devices(devices, "RowParallelDense")
        self._units, self._act = units, _act(activation)
        self._parallel_in = input_is_parallel
        k = len(self.devices)
        self._sizes = _sizes(in_units, k, "in_units", "RowParallelDense") if in_units else None
        self._make([(units, s) for s in (self._sizes or [0] * k)], None, dtype,
                   weight_initializer, bias_initializer, 1, self._sizes)
        self.bias = (ShardParameter("bias", (units,), dtype, bias_initializer,
                                    device=self.devices[0]) if use_bias else None)

    def forward(self, x):
        k = len(self.devices)
        if self._parallel_in:
            if not isinstance(x, (list, tuple)) or len(x) != k:
                raise ValueError(f"RowParallelDense: input_is_parallel expects a list of {k} "
                                 f"shards, got {type(x).__name__}")
            xs = [transfer(a if len(a.shape) == 2 else F.reshape(a, (a.shape[0], -1)), d)
                  for a, d in zip(x, self.devices)]
            sizes = [a.shape[1] for a in xs]
        else:
            if len(x.shape) != 2:
                x = F.reshape(x, (x.shape[0], -1))
            sizes = self._sizes or _sizes(x.shape[1], k, "in_units", "RowParallelDense")
            cuts = np.cumsum([0] + sizes)
            xs = [transfer(x[:, int(cuts[i]):int(cuts[i + 1])], d)
                  for i, d in enumerate(self.devices)]
        if self._sizes is None:
            self._sizes = sizes
        if self._wgroup.sizes is None:
            self._wgroup.sizes = list(sizes)
        if not self._w[0]._shape_known():
            for w, s in zip(self._w, sizes):
                w._finish_deferred_init((self._units, s))
        home = self.devices[0]
        parts = [transfer(F.fully_connected(a, w.data(d), None, True), home)
                 for a, w, d in zip(xs, self._w, self.devices)]
        y = parts[0]
        for q in parts[1:]:
            y = y + q
        if self.bias is not None:
            y = y + self.bias.data(home)
        return self._act(y) if self._act else y

    def load_full(self, weight, bias=None):
        """Set the shards from the unsplit ``weight`` (units, in_units) and ``bias`` (units,)."""
        w = np.asarray(weight)
        if self._sizes is None:
            self._sizes = _sizes(w.shape[1], len(self.devices), "in_units", "RowParallelDense")
        cuts = np.cumsum([0] + self._sizes)
        for i, pw in enumerate(self._w):
            pw.set_data(w[:, cuts[i]:cuts[i + 1]])
        if bias is not None and self.bias is not None:
            self.bias.set_data(np.asarray(bias))


class ChannelParallelConv2D(_Sharded):
    """2-D convolution (NCHW) whose output channels are split over ``devices``; each device
    convolves the whole input with its filters and the maps are gathered on ``devices[0]``
    (concatenated on the channel axis) unless ``gather_output=False`` (list of shards).

    Shapes: x (N, in_channels, H, W) -> (N, channels, OH, OW); shard i holds ``weight{i}``
    (channels_i, in_channels, KH, KW) and ``bias{i}`` (channels_i,).

    Raises:
        ValueError: channels < number of devices; groups != 1 is not supported.
    """

    def __init__(self, channels, kernel_size, devices, strides=1, padding=0, dilation=1,
                 activation=None, use_bias=True, in_channels=0, gather_output=True,
                 dtype="float32", weight_initializer=None, bias_initializer="zeros", groups=1):
        super().__init__()
        if groups != 1:
            raise ValueError(f"ChannelParallelConv2D: groups must be 1, got {groups}")
        self.devices = _check_devices(devices, "ChannelParallelConv2D")
        self._sizes = _sizes(channels, len(self.devices), "channels", "ChannelParallelConv2D")
        ks = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        self._kernel, self._conv_args = ks, (strides, padding, dilation, 1)
        self._act, self._gather = _act(activation), gather_output
        self._make([(c, in_channels) + ks for c in self._sizes], [(c,) for c in self._sizes]
                   if use_bias else None, dtype, weight_initializer, bias_initializer,
                   0, self._sizes)

    def forward(self, x):
        if len(x.shape) != 4:
            raise ValueError(f"ChannelParallelConv2D: expected 4-D input (N, C, H, W), got "
                             f"shape {x.shape}")
        if not self._w[0]._shape_known():
            for w, c in zip(self._w, self._sizes):
                w._finish_deferred_init((c, x.shape[1]) + self._kernel)
        ys = []
        for i, (w, b) in enumerate(self.shard_params()):
            d = self.devices[i]
            y = F.conv2d(transfer(x, d), w.data(d), None if b is None else b.data(d),
                         *self._conv_args)
            ys.append(self._act(y) if self._act else y)
        if not self._gather:
            return ys
        home = self.devices[0]
        return ys[0] if len(ys) == 1 else F.concat(*[transfer(y, home) for y in ys], axis=1)

    load_full = ColumnParallelDense.load_full
