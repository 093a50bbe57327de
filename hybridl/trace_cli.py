"""``hybridl trace``: record a few training steps with the profiler and write a Chrome trace.

    hybridl trace [train options] --steps N --out trace.json

Takes the options of ``hybridl train`` (model, data set, batch size, optimizer, device, engine,
``--no-hybridize``, ...), builds the same data, model and trainer, runs ``--warmup`` steps (not
recorded: first-call costs such as hybridization and allocation), then records ``--steps``
training steps under :func:`hybridl.profiler.profile`, writes the trace (Trace Event JSON: open it
in https://ui.perfetto.dev or chrome://tracing) and prints the per-op table. Hybridized (the
default), each step is one compiled :class:`hybridl.TrainStep` op, as in ``hybridl train``;
``--no-hybridize`` shows every op of the forward, backward and update.
"""
import argparse
import itertools
import sys
import time

__all__ = ["main", "build_parser"]


def build_parser():
    """``hybridl train``'s parser plus ``--steps``, ``--warmup``, ``--out``, ``--sort``, ``--limit``."""
    from .train_cli import _positive_int
    from .train_cli import build_parser as train_parser
    p = train_parser(prog="hybridl trace", run_options=False)
    p.description = ("Record training steps with the profiler: write a Chrome trace (Perfetto) "
                     "and print the per-op table.")
    p.add_argument("--steps", type=_positive_int, default=20, help="training steps to record (20)")
    # 5: the first steps compile the program, learn the engine's op costs and warm the caches;
    # with 2 the first recorded step took 5-10x the others and skewed the mean
    p.add_argument("--warmup", type=_nonnegative_int, default=5,
                   help="steps run before recording starts (5)")
    p.add_argument("--out", default="trace.json", metavar="PATH",
                   help="trace file to write (default trace.json)")
    p.add_argument("--sort", default="total", choices=("total", "count", "mean", "name"),
                   help="table order (default total time)")
    p.add_argument("--limit", type=_positive_int, default=None, help="table rows to show")
    return p


def _nonnegative_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def main(argv=None):
    """Entry point of ``hybridl trace``; returns the exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return _trace(args)
    except (ValueError, OSError) as e:
        print(f"hybridl trace: error: {e}\n(the options: hybridl trace --help)", file=sys.stderr)
        return 2


def _trace(args):
    from . import autograd, data, engine, optim, profiler
    from . import loss as L
    from .train_cli import _digits_data_option, _load_data, _model, _opt_params, _setup
    if _digits_data_option(args):
        raise ValueError(_digits_data_option(args))
    from .device import cpu
    devices = args.device or [cpu(0)]
    if len(devices) > 1:
        raise ValueError(f"--device: tracing records one device, got {len(devices)}; "
                         f"pass --device cpu:0")
    args.epochs = 1                 # (only the defaults of _setup need it)
    from ._io import _check_target, resolve  # fail before training, not after
    from .train_cli import _probe_write
    try:                            # (through a link: where its target would be written)
        _check_target(resolve(args.out))
    except (ValueError, OSError) as e:
        raise ValueError(f"--out: {e}") from None
    _probe_write(resolve(args.out), "--out")
    _setup(args)
    train_set, _, size = _load_data(args)
    loader = data.DataLoader(train_set, args.batch_size, shuffle=True, seed=args.seed,
                             last_batch="keep", num_workers=args.num_workers, device=devices[0])
    net = _model(args.model, size)
    net.initialize(device=devices[0])
    if not args.no_hybridize:
        net.hybridize()
    trainer = optim.Trainer(net.collect_params(), args.optimizer, _opt_params(args))
    loss_fn = L.SoftmaxCrossEntropyLoss()
    batches = itertools.chain.from_iterable(itertools.repeat(loader))

    from .graph import TrainStep
    compiled = None if args.no_hybridize else TrainStep(net, loss_fn, trainer)

    def step():             # as `hybridl train`: hybridized steps are compiled TrainSteps
        x, y = next(batches)
        if compiled is not None:
            return compiled(x, y)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        return loss

    mode = "imperative" if args.no_hybridize else "hybridized, compiled steps"
    print(f"hybridl trace: {args.model} on {args.dataset}, batch {args.batch_size}, "
          f"{args.optimizer}, device {devices[0]}, {mode}, engine {engine.get_engine().name}: "
          f"{args.warmup} warm-up + {args.steps} recorded step(s)", flush=True)
    for _ in range(args.warmup):
        step()
    engine.waitall()
    with profiler.profile() as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            with prof.span(f"step {i}"):
                loss = step()
        loss.wait_to_read()
        engine.waitall()
        wall = time.perf_counter() - t0
    try:
        prof.export_chrome_trace(args.out)
    except OSError as e:
        print(f"hybridl trace: error: cannot write {args.out!r}: {e}", file=sys.stderr)
        return 2
    print(prof.table(sort_by=args.sort, limit=args.limit))
    ops = [e for e in prof.events if e.queue not in ("frontend", "bulk")]
    print(f"recorded {args.steps} step(s) in {wall * 1e3:.1f} ms ({wall / args.steps * 1e3:.2f} ms/step), "
          f"{len(ops)} engine ops run by {', '.join(sorted({e.thread for e in ops})) or 'none'}; "
          f"last loss "
          f"{float(loss.mean().item()):.4f}")
    print(f"trace written to {args.out} (open in https://ui.perfetto.dev)")
    return 0
