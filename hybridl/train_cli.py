"""``hybridl train`` (and ``trace``, ``export``): the main job.

``hybridl train`` with no options trains LeNet on the 8x8 Digits that ship with scikit-learn
(no network, under a minute on 2 cores) and prints per-epoch loss, train/test accuracy and
samples/s, then a one-line summary.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

from ._argparse import Parser, usage_error
from ._io import probe_write as _probe_write

__all__ = ["main", "build_parser", "fit", "evaluate"]

_DATASETS = ("digits", "mnist", "fashion-mnist")


def _positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _positive_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def _device_list(s):
    from .device import Device
    parts = [x.strip() for x in s.split(",")]
    if not s.strip() or any(not x for x in parts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of devices such as "
                                         f"cpu:0,cpu:1, got {s!r}")
    try:
        return [Device.parse(x) for x in parts]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# options of a whole training run, which `hybridl trace` (a few recorded steps on one device in
# one process) does not take
_RUN_ONLY = ("--epochs", "--lr-schedule", "--devices", "--strategy", "--microbatches",
             "--schedule", "--save", "--distributed", "--quiet")


def build_parser(prog="hybridl train", run_options=True):
    """The parser of ``hybridl train``; ``run_options=False`` leaves out the options of a
    whole run (``_RUN_ONLY``), for commands that record a few steps (``hybridl trace``)."""
    p = Parser(prog=prog, description="Train a model on a vision data set.")
    add = p.add_argument

    def opt(*names, **kw):
        if run_options or names[0] not in _RUN_ONLY:
            add(*names, **kw)
    opt("--model", default="lenet", choices=("mlp", "lenet", "resnet18", "inception"))
    opt("--dataset", default="digits", choices=_DATASETS)
    opt("--data-dir", default=None,
        help="folder with the IDX .gz files (default $HYBRIDL_DATA/<dataset> when "
        "HYBRIDL_DATA is set, else ~/.hybridl/datasets/<dataset>)")
    opt("--download", action="store_true", help="download MNIST/Fashion-MNIST if missing")
    opt("--epochs", type=_positive_int, default=None,
        help="default: 10 for digits, 1 otherwise")
    opt("--batch-size", type=_positive_int, default=None,
        help="total batch per step (default 32 for digits, 128 otherwise)")
    opt("--lr", type=_positive_float, default=None,
        help="default 0.05 sgd / 0.002 adam and adamw")
    opt("--lr-schedule", default="cosine", choices=("cosine", "constant"),
        help="cosine (default): the learning rate decays from --lr to 0 over the "
        "run, per step (Loshchilov & Hutter 2017, without restarts); constant")
    opt("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    opt("--momentum", type=float, default=None, help="SGD momentum (default 0.9; sgd only)")
    opt("--wd", type=float, default=None,
        help="weight decay (default: the optimizer's, 0 for sgd and adam, 0.01 for adamw)")
    opt("--device", default=None, type=_device_list, help="e.g. cpu:0 (default)")
    opt("--devices", default=None, type=_device_list,
        help="several devices, e.g. cpu:0,cpu:1 (data parallel by default); "
        "--batch-size stays the total batch, so each device gets batch/k "
        "samples, and the last partial batch of an epoch is dropped (so the "
        "figures differ slightly from one device's). Linear scaling rule "
        "(Goyal et al. 2017): if you grow the batch k-fold, multiply --lr by k "
        "(not done automatically)")
    opt("--strategy", default="data", choices=("data", "pipeline", "tensor"),
        help="with --devices: data (replicas + ring allreduce), pipeline (stages "
        "+ micro-batches) or tensor (Dense/Conv2D split by output features; "
        "runs imperatively)")
    opt("--microbatches", type=_positive_int, default=None,
        help="micro-batches per batch for --strategy pipeline (default 4)")
    opt("--schedule", default=None, choices=("gpipe", "1f1b"),
        help="pipeline schedule for --strategy pipeline (default 1f1b)")
    opt("--engine", default=None, choices=("threaded", "naive"))
    opt("--seed", type=int, default=0)
    opt("--save", default=None, metavar="PATH", help="save parameters (safetensors)")
    opt("--no-hybridize", action="store_true", help="run the model imperatively")
    opt("--num-workers", type=int, default=1, help="data loader threads")
    opt("--distributed", action="store_true", help="data parallel over MPI ranks")
    opt("--quiet", action="store_true", help="no progress bar")
    return p


def _load_data(args):
    from . import data
    if args.dataset == "digits":
        return data.Digits(train=True), data.Digits(train=False), 8
    cls = data.MNIST if args.dataset == "mnist" else data.FashionMNIST
    root = args.data_dir
    return (cls(root=root, train=True, download=args.download),
            cls(root=root, train=False, download=args.download), 28)


def _model(name, size):
    from . import models
    if name == "lenet":
        return models.lenet(10, input_size=size)
    if name == "mlp":
        return models.mlp((256, 128), 10)
    if name == "resnet18":
        return models.resnet18(10, width=16 if size <= 8 else 64)
    return models.inception_net(10)


def _has_batch_norm(net):
    """Whether ``net`` has a BatchNorm layer (SyncBatchNorm included)."""
    from .nn import BatchNorm
    found = []
    net.apply(lambda b: found.append(b) if isinstance(b, BatchNorm) else None)
    return bool(found)


def _fitting_options(path, tried):
    """``--model M --dataset D`` options (text) whose network ``path``'s parameters fit
    (names and shapes), other than ``tried``; '' when none does. Digits and the 28x28
    datasets differ only in the input size, so one of those stands for the others."""
    from . import nd
    found = []
    for model in ("lenet", "mlp", "resnet18", "inception"):
        for dataset, size in (("digits", 8), ("mnist", 28)):
            if (model, dataset) == tuple(tried) or (model, size) in [(m, s) for m, s, _ in found]:
                continue
            net = _model(model, size)
            net.initialize()
            try:
                net(nd.zeros((1, 1, size, size)))
                net.load_parameters(path)
            except (ValueError, OSError):
                continue
            found.append((model, size, f"`--model {model} --dataset {dataset}`"))
    return " or ".join(text for _, _, text in found)


def evaluate(net, loader, devices=None):
    """Accuracy (fraction in [0, 1]) of ``net`` over ``loader``, in predict mode."""
    from . import autograd, nd
    correct = total = 0
    pending = []
    with autograd.predict_mode():
        for x, y in loader:
            out = net(x)
            pending.append((nd.sum(nd.equal(nd.argmax(out, axis=1), y.astype("int64"))), y.shape[0]))
    for c, n in pending:
        correct += int(c.item())
        total += n
    return correct / max(total, 1)


def cosine_lr(base_lr, total_steps):
    """The cosine schedule without restarts (Loshchilov & Hutter 2017, "SGDR", eq. 5 with one
    cycle and eta_min = 0): ``lr(t) = base_lr * (1 + cos(pi * t / total_steps)) / 2`` for step
    ``t`` in ``[0, total_steps)`` -- ``base_lr`` at the first step, near 0 at the last.

    Returns:
        a function ``step -> learning rate``.

    Raises:
        ValueError: ``total_steps`` < 1 or ``base_lr`` < 0.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps: expected an integer >= 1, got {total_steps!r}")
    if not base_lr >= 0:
        raise ValueError(f"base_lr: expected a number >= 0, got {base_lr!r}")
    return lambda t: base_lr * 0.5 * (1.0 + math.cos(math.pi * min(t, total_steps) / total_steps))


def fit(net, trainer, train_loader, test_loader, epochs, loss_fn=None, log=print,
        progress=True, rank0=True, step_hook=None, batch_fn=None, lr_schedule=None,
        compiled=False, reduce_stats=None):
    """Train ``net`` for ``epochs``; returns a list of per-epoch dicts (loss, train_acc,
    test_acc, samples_per_s, seconds). Per-epoch loss is the mean per-sample loss.

    ``batch_fn(x, y) -> (per-sample losses, outputs)``, when given, replaces the default
    record/forward/backward of a batch (e.g. a pipeline's micro-batch schedule); the trainer
    step, the statistics and the printed lines stay the same. ``lr_schedule(step) -> lr``
    (e.g. :func:`cosine_lr`), when given, sets the learning rate before every step (``step``
    counts from 0 over the whole run). ``compiled=True`` runs each step as one
    :class:`hybridl.TrainStep` program (forward, loss, backward and update; same results).
    ``reduce_stats(v) -> v``, when given, sums a float64 vector (loss sum, correct count,
    samples) over the processes of a data-parallel job at the end of every epoch, so that the
    printed loss, accuracy and samples/s are the whole job's and every process makes the same
    divergence decision (one rank raising alone would leave the others blocked in their next
    collective until the dead-rank timeout).

    Raises:
        FloatingPointError: an epoch's mean loss is NaN or infinite (training diverged).
    """
    from . import autograd, loss as L, nd
    loss_fn = loss_fn or L.SoftmaxCrossEntropyLoss()
    train_step = None
    if compiled:
        from .graph import TrainStep
        train_step = TrainStep(net, loss_fn, trainer, return_outputs=True)
    history = []
    step = 0
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        it = train_loader
        bar = None
        if progress and rank0:
            from tqdm import tqdm
            bar = tqdm(total=len(train_loader), desc=f"epoch {epoch}/{epochs}", leave=False,
                       unit="batch", file=sys.stderr, dynamic_ncols=True)
        sums, n_seen = [], 0
        for x, y in it:
            if lr_schedule is not None:
                trainer.set_learning_rate(lr_schedule(step))
            step += 1
            if train_step is not None:
                loss, out = train_step(x, y)
            else:
                if batch_fn is not None:
                    loss, out = batch_fn(x, y)
                else:
                    with autograd.record():
                        out = net(x)
                        loss = loss_fn(out, y)
                    loss.backward()
                trainer.step(x.shape[0])
            sums.append((nd.sum(loss), nd.sum(nd.equal(nd.argmax(out, axis=1), y.astype("int64")))))
            n_seen += x.shape[0]
            if step_hook is not None:
                step_hook()
            if bar is not None:
                bar.update(1)
        stats = np.array([sum(float(s.item()) for s, _ in sums),
                          sum(int(c.item()) for _, c in sums), n_seen], np.float64)
        if reduce_stats is not None:
            stats = _check_stats(reduce_stats(stats), stats)
        tot_loss, tot_ok, n_seen = float(stats[0]), float(stats[1]), int(stats[2])
        dt = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        test_acc = evaluate(net, test_loader) if test_loader is not None else float("nan")
        rec = {"epoch": epoch, "loss": tot_loss / max(n_seen, 1), "train_acc": tot_ok / max(n_seen, 1),
               "test_acc": test_acc, "samples_per_s": n_seen / dt, "seconds": dt}
        history.append(rec)
        if rank0:
            log(f"epoch {epoch:3d}  loss {rec['loss']:.4f}  train acc {rec['train_acc']:.4f}  "
                f"test acc {rec['test_acc']:.4f}  {rec['samples_per_s']:.0f} samples/s")
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(
                f"training diverged: the mean loss of epoch {epoch} is {rec['loss']} (a "
                f"smaller learning rate usually helps)")
    return history


def _check_stats(got, mine):
    """The vector ``reduce_stats`` returned, checked: 3 real numbers, the sample count a whole
    number at least this process's own (a sum over processes)."""
    try:
        v = np.asarray(got)
    except Exception:  # noqa: BLE001 - whatever it is, it is not a vector of 3 numbers
        v = None
    if v is None or v.shape != (3,) or v.dtype.kind not in "iuf":
        what = type(got).__name__
        if v is not None:
            what += f" of shape {v.shape} dtype {v.dtype}"
        raise ValueError(f"reduce_stats: expected a vector of 3 real numbers (loss sum, correct "
                         f"count, samples) summed over the processes, got {what}")
    v = v.astype(np.float64)
    n = v[2]
    if not (np.isfinite(n) and n == int(n) and n >= mine[2]):
        raise ValueError(f"reduce_stats: the summed sample count must be a whole number at "
                         f"least this process's {int(mine[2])}, got {n}")
    return v


def _sum_over_ranks(dist):
    """``reduce_stats`` for :func:`fit` in an MPI job: the vector summed over the ranks."""
    from . import nd

    def reduce(v):
        return dist.allreduce(nd.array(v), "sum").asnumpy()
    return reduce


def _engine_name():
    from . import engine
    return engine.get_engine().name


class _SaveFailed(Exception):
    """The final --save write failed: exit 1 with one line (not a usage error)."""


class _SettingError(Exception):
    """A bad HYBRIDL_DIST_* environment variable: exit 2 with its one-line message (no
    pointer to --help: it is not an option)."""


def _opt_params(args):
    """The optimizer's hyper-parameters from --lr, --wd (else the optimizer's own: AdamW's is
    0.01) and --momentum (sgd; default 0.9); `hybridl train` and `hybridl trace` share it."""
    params = {"learning_rate": args.lr}
    if args.wd is not None:
        params["wd"] = args.wd
    if args.optimizer == "sgd":
        params["momentum"] = 0.9 if args.momentum is None else args.momentum
    return params


def _default_batch(dataset):
    """The batch size when --batch-size is not given."""
    return 32 if dataset == "digits" else 128


def _setup(args):
    import warnings
    # NumPy's overflow/invalid warnings of a diverging run (from the workers): the run stops
    # with its own one-line message instead (see fit's divergence check)
    warnings.filterwarnings("ignore", message=r"(invalid value|overflow|divide by zero) "
                            r"encountered", category=RuntimeWarning)
    from . import engine, random
    if args.engine:
        engine.set_engine(args.engine)
    random.seed(args.seed)
    if args.epochs is None:
        args.epochs = 10 if args.dataset == "digits" else 1
    if args.batch_size is None:
        args.batch_size = _default_batch(args.dataset)
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "sgd" else 0.002
    if not getattr(args, "no_hybridize", True):
        from .graph.passes import _numexpr
        _numexpr()      # its thread settings (OMP_NUM_THREADS...) checked before training


def _busy_note(load=None, others=None):
    """A hint when other programs keep this machine's cores busy and BLAS may use several
    threads: a multi-threaded GEMM then waits for a time slice for each of its threads (on a
    2-core machine with the other core busy, 10-20x slower steps were measured). Returns the
    note, or None. ``load``: the 1-minute load average (default: the system's); ``others``:
    how many other tasks are runnable right now (default: /proc/loadavg's count less this
    one; unknown: not checked). The load average lags by about a minute both ways: a job
    that just ended still shows, so the note also needs another task running now."""
    import os

    from .ops import _blas
    if _blas.budget() < 2 or os.environ.get("OPENBLAS_NUM_THREADS"):
        return None
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
        if others is None:
            others = _runnable_others()
    cores = _blas.cores()
    if load < cores - 0.5 or (others is not None and others < 1):
        return None
    return (f"note: this machine is busy (load average {load:.1f} on {cores} cores); BLAS "
            f"products on {_blas.budget()} threads wait for one another and can be many times "
            f"slower: OPENBLAS_NUM_THREADS=1 hybridl train ... is often faster then (about the same "
            f"accuracy up to rounding: other last bits)")


def _runnable_others():
    """Tasks runnable now besides the calling one (``/proc/loadavg``'s "running/total"), or
    None where that file does not exist."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return None


def lr_schedule(args, steps_per_epoch):
    """The schedule ``--lr-schedule`` names, for ``args.epochs`` epochs (None: constant)."""
    if getattr(args, "lr_schedule", "constant") != "cosine":
        return None
    return cosine_lr(args.lr, max(1, args.epochs * steps_per_epoch))


def _digits_data_option(args):
    """The error for --data-dir/--download given with --dataset digits (which ignores them:
    the digits ship with scikit-learn), or None; ``hybridl train`` and ``trace`` share it."""
    if args.dataset == "digits" and (args.data_dir or args.download):
        return (f"{'--data-dir' if args.data_dir else '--download'} is for --dataset mnist "
                f"or fashion-mnist; the digits ship with scikit-learn")
    return None


def _usage_error(msg):
    """Print ``msg`` as ``hybridl train``'s error with the pointer to --help; exit code 2."""
    return usage_error("hybridl train", msg)


def main_train(argv=None):
    """Entry point of ``hybridl train``; returns the exit code."""
    args = build_parser().parse_args(argv)
    devs = args.devices or []
    from .device import cpu
    if devs and args.device is not None:
        return _usage_error(f"give either --device ({','.join(map(str, args.device))}) "
                            f"or --devices ({','.join(map(str, devs))}), not both")
    args.device = args.device or [cpu(0)]
    if args.save is not None and not args.save.strip():
        return _usage_error("--save: expected a file path, got an empty string")
    if len(set(devs)) != len(devs):
        return _usage_error(f"--devices lists a device twice: {','.join(map(str, devs))}")
    if args.strategy != "data" and len(devs) < 2:
        return _usage_error(f"--strategy {args.strategy} needs --devices with at least two "
                            f"devices, e.g. --devices cpu:0,cpu:1")
    given = [f"--{n}" for n in ("microbatches", "schedule") if getattr(args, n) is not None]
    if given and args.strategy != "pipeline":
        return _usage_error(f"{' and '.join(given)} "
                            f"{'apply' if len(given) > 1 else 'applies'} only to --strategy pipeline "
                            f"(the strategy is {args.strategy})")
    args.microbatches = 4 if args.microbatches is None else args.microbatches
    args.schedule = "1f1b" if args.schedule is None else args.schedule
    batch = args.batch_size or _default_batch(args.dataset)
    if args.strategy == "pipeline" and args.microbatches > batch:
        return _usage_error(f"--microbatches {args.microbatches} is more than the batch size "
                            f"{batch}: each micro-batch needs at least one sample")
    bad = _digits_data_option(args)
    if bad:
        return _usage_error(bad)
    if args.momentum is not None and args.optimizer != "sgd":
        return _usage_error(f"--momentum applies to --optimizer sgd (the optimizer is "
                            f"{args.optimizer}: its betas are fixed)")
    if args.distributed and len(devs) > 1:
        return _usage_error(f"--distributed trains one device per process: drop --devices "
                            f"{','.join(map(str, devs))} (run more processes instead)")
    if args.save and len(devs) > 1 and args.strategy != "data":
        return _usage_error(f"--save is supported with --strategy data (or one device); the "
                            f"{args.strategy} strategy splits the parameters across devices")
    try:
        return _train(args)
    except BrokenPipeError:         # `hybridl train | head`: the reader left; stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141                  # 128 + SIGPIPE, as shell tools
    except FloatingPointError as e:  # diverged: the options were valid, the run failed
        print(f"hybridl train: error: {e}; --lr was {args.lr}", file=sys.stderr)
        return 1
    except _SaveFailed as e:
        print(f"hybridl train: error: {e}", file=sys.stderr)
        return 1
    except _SettingError as e:
        sys.stderr.write(f"hybridl train: error: {e}\n")  # one write: ranks print at once
        return 2
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        from .data import DownloadError
        if isinstance(e, DownloadError):    # --download failed (the network, the mirrors):
            print(f"hybridl train: error: {e}", file=sys.stderr)    # the options were valid,
            return 1                                                # the run failed
        msg = str(e).strip().splitlines()
        text = f"{type(e).__name__}: {msg[0] if msg else e}" + "".join(f"\n  {m}" for m in msg[1:6])
        if getattr(args, "started", False):     # valid options, a failure while training
            print(f"hybridl train: error: {text}", file=sys.stderr)
            return 1
        return _usage_error(text)


def _overall_rate(hist):
    """Samples per second over the whole training: every epoch's samples / the total time
    (not the mean of the per-epoch rates, which a fast short epoch would inflate)."""
    secs = sum(h["seconds"] for h in hist)
    return sum(h["samples_per_s"] * h["seconds"] for h in hist) / secs if secs > 0 else 0.0


def _check_save(path):
    """``--save PATH`` can be written (before training, not after it)."""
    from ._io import _check_target, resolve
    target = resolve(path)          # a link: where its file is (or would be) written
    try:
        _check_target(target)
    except (ValueError, OSError) as e:
        raise type(e)(f"--save: {e}") from None
    _probe_write(target, "--save")


def _launched_size():
    """The number of processes of the MPI job that started this one, and the launcher's
    variable that tells (``(1, None)`` when none)."""
    from .distributed._backend import launched_size
    return launched_size()


def _train(args):
    from . import data, optim
    _setup(args)
    dist = None
    if args.distributed:
        from . import distributed as dist
        try:
            dist.init()
        except ValueError as e:     # a HYBRIDL_DIST_* setting (raised on every rank together)
            raise _SettingError(str(e)) from None
    elif _launched_size()[0] > 1:
        n, var = _launched_size()
        raise ValueError(f"this process is one of {n} started by mpiexec ({var}={n} in the "
                         f"environment), but --distributed is not given: each would train "
                         f"alone; add --distributed")
    rank0 = dist is None or dist.rank() == 0
    if args.save:
        # only rank 0 writes it (on a cluster the folder may exist on its node only); its
        # verdict is shared, so that every rank stops with it rather than at a timeout
        err = None
        if rank0:
            try:
                _check_save(args.save)
            except (ValueError, OSError) as e:
                err = e
        if dist is not None and dist.size() > 1:
            from . import nd
            bad = dist.broadcast(nd.array([0 if err is None else 1], dtype="int32"))
            if bad.asnumpy()[0] and err is None:
                raise ValueError(f"--save: rank 0 cannot write {args.save!r} (see its message)")
        if err is not None:
            raise err
    train_set, test_set, size = _load_data(args)
    devices = args.devices or args.device
    shard = {}
    local_batch = args.batch_size
    multi = dist is not None and dist.size() > 1      # several processes: kvstore 'dist'
    if multi:
        # --batch-size stays the global batch: each rank takes batch / size samples of its
        # shard per step (same shuffle on every rank: the loader's seed)
        if args.batch_size % dist.size():
            raise ValueError(f"--batch-size {args.batch_size} does not split evenly over "
                             f"{dist.size()} processes; use a multiple of {dist.size()}")
        local_batch = args.batch_size // dist.size()
        shard = dict(num_shards=dist.size(), shard_index=dist.rank())
    if len(devices) > 1 and args.strategy == "data" and local_batch % len(devices):
        # split_and_load would give the devices unequal shares (batch 1 on 2 devices: one
        # device idle, trained like one device while the banner said 0 samples per device)
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over "
                         f"{len(devices)} devices; use a multiple of {len(devices)}")
    discard = len(devices) > 1 or bool(shard)
    net = _model(args.model, size)
    if _has_batch_norm(net):
        # BatchNorm normalizes each channel over a batch in training: one sample per device
        # (or micro-batch) has nothing to normalize over (a ValueError mid-run, after training)
        share = (local_batch // args.microbatches if args.strategy == "pipeline" and len(devices) > 1
                 else local_batch // len(devices) if args.strategy == "data" else local_batch)
        if share < 2:
            where = ("micro-batch" if args.strategy == "pipeline" and len(devices) > 1 else
                     "device" if len(devices) > 1 else "batch")
            raise ValueError(f"--batch-size {args.batch_size}: the {args.model} model has BatchNorm "
                             f"layers, which need at least 2 samples per {where} in training "
                             f"(got {share})")
        if not discard and len(train_set) % local_batch == 1:
            discard = True
            if rank0:
                print(f"note: the last batch of each epoch would hold 1 sample ({len(train_set)} "
                      f"= {len(train_set) // local_batch} x {local_batch} + 1), which BatchNorm "
                      f"cannot normalize in training: it is left out", file=sys.stderr)
    per_rank = len(train_set) // (shard.get("num_shards", 1))
    if discard and local_batch > per_rank:
        # the loader drops the incomplete last batch (every device/rank needs its share):
        # nothing would be trained
        raise ValueError(f"--batch-size {args.batch_size} is larger than the {per_rank} training "
                         f"samples each {'rank' if shard else 'step'} can use; with several "
                         f"devices or processes an incomplete batch is dropped, so use at most "
                         f"{per_rank * (args.batch_size // local_batch)}")
    train_loader = data.DataLoader(train_set, local_batch, shuffle=True, seed=args.seed,
                                   last_batch="discard" if discard else "keep",
                                   num_workers=args.num_workers, device=devices[0], **shard)
    test_loader = data.DataLoader(test_set, 256, num_workers=args.num_workers, device=devices[0])
    opt_params = _opt_params(args)
    optim.create(args.optimizer, **opt_params)      # its settings checked (--momentum 5)
    if len(devices) > 1:
        from .parallel import train_multi_device
        args.started = True         # from here on an error is the run's, not the options'
        return train_multi_device(args, net, train_loader, test_loader, devices, opt_params)
    net.initialize(device=devices[0])
    if multi:
        from . import autograd, nd
        with autograd.predict_mode():       # finish deferred shapes, so that the Trainer
            net(nd.zeros((1,) + tuple(train_set[0][0].shape), device=devices[0]))  # broadcasts
    if not args.no_hybridize:                                          # rank 0's parameters
        net.hybridize()
    # several processes: the update sharded over the ranks where they share a machine (the
    # default allreduce path elsewhere; the same results, see Trainer's update_on_kvstore)
    trainer = optim.Trainer(net.collect_params(), args.optimizer, opt_params,
                            kvstore="dist" if multi else None, update_on_kvstore=multi or None)
    compiled = not args.no_hybridize and not multi     # TrainStep runs without a kvstore
    mode = ("hybridized, compiled steps" if compiled else
            "imperative" if args.no_hybridize else "hybridized")
    if rank0:
        print(f"hybridl train: {args.model} on {args.dataset} ({len(train_set)} train / "
              f"{len(test_set)} test images), {args.epochs} epoch(s), batch {args.batch_size}, "
              f"{args.optimizer} lr {args.lr} ({args.lr_schedule}), device {devices[0]}"
              + (f" on each of {dist.size()} processes" if multi else "")
              + (" (--distributed: one process, not launched under MPI)"
                 if dist is not None and not multi else "")
              + f", {mode}, {_engine_name()} engine", flush=True)
        busy = _busy_note()
        if busy:
            print(busy, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    args.started = True             # from here on an error is the run's, not the options'
    hist = fit(net, trainer, train_loader, test_loader, args.epochs,
               progress=not args.quiet and sys.stderr.isatty(), rank0=rank0,
               lr_schedule=lr_schedule(args, len(train_loader)),
               compiled=compiled, reduce_stats=_sum_over_ranks(dist) if multi else None)
    total = time.perf_counter() - t0
    last = hist[-1]
    if args.save and rank0:
        try:
            net.save_parameters(args.save)
        except OSError as e:        # (disk full): the run is done, only the file is missing
            raise _SaveFailed(f"--save: the trained parameters could not be written ({e}); "
                              f"the file that was there, if any, is unchanged") from None
    nproc = dist.size() if dist is not None else 1
    if rank0:
        print(f"done: {args.model}/{args.dataset} test accuracy {last['test_acc']:.4f} after "
              f"{args.epochs} epoch(s) in {total:.1f} s "
              f"(training {sum(h['seconds'] for h in hist):.1f} s at "
              f"{_overall_rate(hist):.0f} samples/s"
              + (f" over {nproc} processes" if nproc > 1 else "") + "; the rest is evaluation)"
              + (f", parameters saved to {args.save}" if args.save and rank0 else ""), flush=True)
    return 0


main = main_train


def main_export(argv=None):
    """``hybridl export``: write a trained model as graph JSON + safetensors (and ONNX).

    Example: ``hybridl train --save lenet.safetensors`` then
    ``hybridl export --params lenet.safetensors --out lenet-graph [--onnx lenet.onnx]``
    (``--out`` may not name the ``--params`` file: the export would replace the checkpoint).
    """
    p = Parser(prog="hybridl export", description="Export a model for use without its Python code.")
    p.add_argument("--model", default="lenet", choices=("mlp", "lenet", "resnet18", "inception"))
    p.add_argument("--dataset", default="digits", choices=_DATASETS,
                   help="sets the input size the model was trained for (8x8 digits, 28x28 MNIST)")
    p.add_argument("--params", default=None, help="parameters saved by `hybridl train --save`")
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="writes PREFIX-symbol.json and PREFIX.safetensors")
    p.add_argument("--batch-size", type=_positive_int, default=1,
                   help="input batch of the exported graph (default 1); shapes are static, so "
                        "the exported model accepts exactly this batch size")
    p.add_argument("--onnx", default=None, metavar="PATH", help="also write an ONNX model")
    args = p.parse_args(argv)
    from ._io import _check_target
    try:                    # every output path checked before anything is written
        if not args.out or args.out.endswith(("/", os.sep)):
            raise ValueError(f"--out: expected a file prefix such as models/lenet, got {args.out!r}")
        for path in [args.out + "-symbol.json", args.out + ".safetensors"] + \
                ([args.onnx] if args.onnx else []):
            _check_target(path)
            _probe_write(path, "--onnx" if path == args.onnx else "--out")
    except (ValueError, OSError) as e:
        print(f"hybridl export: error: {e}", file=sys.stderr)
        return 2
    # no output may land on the --params file or on another output (a link: where it points)
    from ._io import resolve
    outs = [("--out", args.out + "-symbol.json"), ("--out", args.out + ".safetensors")]
    if args.onnx:
        outs.append(("--onnx", args.onnx))
    seen = {}
    if args.params:
        seen[os.path.abspath(resolve(args.params))] = "the --params file it reads"
    for opt, path in outs:
        key = os.path.abspath(resolve(path))
        if key in seen:
            print(f"hybridl export: error: {opt} would write {path} over {seen[key]}; choose "
                  f"other names (e.g. --out {args.out}-graph, --onnx {args.out}.onnx)",
                  file=sys.stderr)
            return 2
        seen[key] = f"the file {opt} writes"
    if args.onnx:
        try:
            import onnx  # noqa: F401 - checked before anything is written
        except ImportError:
            print("hybridl export: error: --onnx needs the onnx package: pip install -e \".[onnx]\"",
                  file=sys.stderr)
            return 2
    if not args.params:
        print("hybridl export: note: no --params given: exporting freshly initialized weights",
              file=sys.stderr)
    from . import nd
    size = 8 if args.dataset == "digits" else 28
    try:
        net = _model(args.model, size)      # (imports the compiler: HYBRIDL_FUSION_THRESHOLD)
        from .graph.passes import _numexpr
        _numexpr()                          # numexpr's thread settings (OMP_NUM_THREADS)
    except ValueError as e:
        print(f"hybridl export: error: {e}", file=sys.stderr)
        return 2
    net.initialize()
    try:
        x = nd.zeros((args.batch_size, 1, size, size))
    except MemoryError:
        print(f"hybridl export: error: --batch-size {args.batch_size}: an example batch that "
              f"large does not fit in memory", file=sys.stderr)
        return 2
    net(x)                                          # finish deferred shapes
    try:
        if args.params:
            try:
                net.load_parameters(args.params)
            except ValueError as e:          # names/shapes differ: most likely another model
                import re               # (the Python-API remedies do not apply to the CLI)
                msg = re.sub(r" \(pass (allow_missing|ignore_extra)=True[^)]*\)", "", str(e))
                fits = _fitting_options(args.params, (args.model, args.dataset))
                hint = (f"the file fits {fits}: pass those options" if fits else
                        "it fits none of the models of `hybridl train`")
                raise ValueError(f"{msg}; {args.params!r} was not saved by `hybridl train "
                                 f"--model {args.model} --dataset {args.dataset}`: {hint}") from e
        net.hybridize()
        sym, par = net.export(args.out, x)
        print(f"wrote {sym} and {par}")
        if args.onnx:
            from . import onnx
            onnx.export(net, x, args.onnx)
            print(f"wrote {args.onnx}")
    except (ValueError, ImportError, OSError) as e:
        print(f"hybridl export: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a writer's own error (safetensors: /proc, full disk)
        if type(e).__name__ != "SafetensorError":
            raise
        print(f"hybridl export: error: could not write {args.out}.safetensors: {e}", file=sys.stderr)
        return 2
    return 0
