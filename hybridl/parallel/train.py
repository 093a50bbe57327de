"""``hybridl train --devices cpu:0,cpu:1 --strategy data|pipeline|tensor``.

Strategies (all print the same per-epoch lines as single-device training, through
:func:`hybridl.train_cli.fit`):

* ``data`` (default): one replica per device (``net.initialize(device=devices)``), each batch
  split over the devices (:class:`hybridl.parallel.DataParallel`), gradients all-reduced by
  ``hl.Trainer(..., kvstore='device')`` (ring allreduce) and every replica updated identically.
  ``--batch-size`` is the *total* batch: each device gets ``batch / k`` samples. The linear
  scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"):
  when the total batch grows k-fold (to keep per-device work constant) multiply the learning
  rate by k (with a warm-up for large k). It is *not* applied automatically: ``--lr`` is used
  as given.
* ``pipeline``: the model's layers cut into ``len(devices)`` consecutive stages of balanced
  parameter count, ``--microbatches`` micro-batches, ``--schedule gpipe|1f1b``
  (:class:`hybridl.parallel.Pipeline`).
* ``tensor``: every Dense layer becomes a :class:`ColumnParallelDense` and every Conv2D a
  :class:`ChannelParallelConv2D` over the devices (outputs gathered on the first device); the
  other layers run on the first device. Runs imperatively.
"""
import sys
import time

__all__ = ["train_multi_device", "to_tensor_parallel", "sequential_layers"]


def sequential_layers(net):
    """The layers of ``net`` as a flat list for pipelining: a (Hybrid)Sequential's children,
    or a ResNet's stem, blocks, pool, flatten and classifier.

    Raises:
        ValueError: the network is not a chain of layers.
    """
    from ..models import ResNet
    from ..nn import HybridSequential, Sequential
    if isinstance(net, ResNet):
        return list(net.stem._children.values()) + list(net.stages._children.values()) + \
            [net.pool, net.flat, net.fc]
    if isinstance(net, (HybridSequential, Sequential)):
        return list(net._children.values())
    raise ValueError(f"strategy 'pipeline': {type(net).__name__} is not a chain of layers "
                     f"(use a Sequential/HybridSequential model)")


def to_tensor_parallel(net, devices):
    """Replace (in place, recursively) every Dense by a ColumnParallelDense and every Conv2D
    (groups 1) by a ChannelParallelConv2D over ``devices``, with the same configuration.
    Returns ``net``. Call before ``initialize``."""
    from ..nn import Conv2D, Dense
    from .tensor import ChannelParallelConv2D, ColumnParallelDense

    def convert(block):
        for name, c in list(block._children.items()):
            new = None
            if isinstance(c, Dense) and c._flatten and c._units >= len(devices):
                new = ColumnParallelDense(c._units, devices, c._act_name, c.bias is not None,
                                          c.weight.shape[1], dtype=c.weight.dtype)
            elif isinstance(c, Conv2D) and c._groups == 1 and c._channels >= len(devices):
                new = ChannelParallelConv2D(c._channels, c._kernel, devices, c._strides,
                                            c._padding, c._dilation, c._act_name,
                                            c.bias is not None, c.weight.shape[1],
                                            dtype=c.weight.dtype)
            if new is None:
                convert(c)
                continue
            block._children[name] = new
            if block.__dict__.get(name) is c:
                object.__setattr__(block, name, new)
        return block
    return convert(net)


class _PipelineNet:
    """Adapter for ``fit``/``evaluate``: outputs come back to the first device (labels live
    there)."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __call__(self, x):
        from . import transfer
        return transfer(self.pipe(x), self.pipe.devices[0])


def train_multi_device(args, net, train_loader, test_loader, devices, opt_params):
    """Train ``net`` on several devices with ``args.strategy`` (module docstring); prints the
    header, the per-epoch lines of :func:`hybridl.train_cli.fit` and a summary. Returns 0.

    Args:
        args: the parsed ``hybridl train`` arguments (``strategy``, ``optimizer``, ``epochs``,
            ``batch_size`` (total), ``lr``, ``no_hybridize``, ``microbatches``, ``schedule``,
            ``save``, ``quiet``, ``model``, ``dataset``).
        devices (list of Device): at least two.

    Raises:
        ValueError: unknown strategy, or a model the strategy cannot split.
    """
    from .. import loss as L
    from .. import optim
    from ..train_cli import fit, lr_schedule
    from . import DataParallel, transfer
    from .pipeline import Pipeline, split_stages
    strategy = getattr(args, "strategy", "data") or "data"
    k = len(devices)
    hyb = not getattr(args, "no_hybridize", False)
    batch_fn = None
    if strategy == "data":
        net.initialize(device=devices)
        if hyb:
            net.hybridize()
        model = DataParallel(net, devices)
        trainer = optim.Trainer(net.collect_params(), args.optimizer, opt_params, kvstore="device")
        detail = f"data parallel, {args.batch_size // k} samples per device, kvstore 'device'"
        params_owner = net
    elif strategy == "pipeline":
        from ..nn import HybridSequential
        groups = split_stages(sequential_layers(net), k)
        stages = []
        for g in groups:
            s = HybridSequential()
            s.add(*g)
            stages.append(s)
        m = getattr(args, "microbatches", None) or 4
        sched = getattr(args, "schedule", None) or "1f1b"
        pipe = Pipeline(stages, devices, m, sched)
        pipe.initialize()
        if hyb:
            pipe.hybridize()
        loss_fn = L.SoftmaxCrossEntropyLoss()
        trainer = optim.Trainer(pipe.collect_params(), args.optimizer, opt_params)
        model = _PipelineNet(pipe)

        def pipe_batch(x, y):
            loss, out = pipe.forward_backward(x, y, loss_fn)
            return transfer(loss, devices[0]), transfer(out, devices[0])
        batch_fn = pipe_batch
        detail = (f"pipeline of {k} stages ({[len(g) for g in groups]} layers), {m} "
                  f"micro-batches, schedule {sched}")
        params_owner = None
    elif strategy == "tensor":
        to_tensor_parallel(net, devices)
        net.initialize(device=devices[0])
        hyb = False
        model = net
        trainer = optim.Trainer(net.collect_params(), args.optimizer, opt_params)
        detail = "tensor parallel (Dense by output features, Conv2D by output channels)"
        params_owner = net
    else:
        raise ValueError(f"strategy: expected 'data', 'pipeline' or 'tensor', got {strategy!r}")
    print(f"hybridl train: {args.model} on {args.dataset} ({len(train_loader.dataset)} train / "
          f"{len(test_loader.dataset)} test images), {args.epochs} epoch(s), batch "
          f"{args.batch_size} (last partial batch dropped), {args.optimizer} lr {args.lr} "
          f"({getattr(args, 'lr_schedule', 'constant')}), devices "
          f"{', '.join(str(d) for d in devices)}: {detail}, "
          f"{'hybridized' if hyb else 'imperative'}", flush=True)
    t0 = time.perf_counter()
    hist = fit(model, trainer, train_loader, test_loader, args.epochs,
               progress=not getattr(args, "quiet", False) and sys.stderr.isatty(),
               batch_fn=batch_fn, lr_schedule=lr_schedule(args, len(train_loader)))
    total = time.perf_counter() - t0
    last = hist[-1]
    saved = ""
    if getattr(args, "save", None):
        if params_owner is None:
            saved = " (--save is not supported with --strategy pipeline; not saved)"
        else:
            params_owner.save_parameters(args.save)
            saved = f", parameters saved to {args.save}"
    from ..train_cli import _overall_rate
    print(f"done: {args.model}/{args.dataset} test accuracy {last['test_acc']:.4f} after "
          f"{args.epochs} epoch(s) in {total:.1f} s "
          f"({_overall_rate(hist):.0f} samples/s) on {k} devices "
          f"({strategy})" + saved, flush=True)
    return 0
