"""End-to-end training: `hybridl train` / `hybridl export` as a user runs them, and fit()."""
import contextlib
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hybridl as hl
from hybridl import autograd

EPOCH_RE = re.compile(r"^epoch\s+(\d+)\s+loss ([\d.]+)\s+train acc ([\d.]+)\s+test acc ([\d.]+)",
                      re.M)
DONE_RE = re.compile(r"^done: (\S+) test accuracy ([\d.]+) after (\d+) epoch", re.M)


def _clear_errors():
    """hl.waitall() once more after a failed batch: it reports the error again (and clears it)."""
    try:
        hl.waitall()
    except hl.OpError:
        pass


def _env():
    env = dict(os.environ)
    env.pop("HYBRIDL_ENGINE", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(hl.__file__)))] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _hybridl(*args, timeout=120, cwd=None):
    return subprocess.run([sys.executable, "-m", "hybridl", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=cwd)


def _start(*args, cwd=None):
    return subprocess.Popen([sys.executable, "-m", "hybridl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd)


def _signal_state(pid):
    """The signal masks of process ``pid`` (blocked, ignored, caught: /proc/PID/status), for
    a failed Ctrl-C test's message: a signal that never arrived tells them apart."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "(no /proc status)"


def _epochs(out):
    """Per-epoch (loss, train acc, test acc) as printed (samples/s varies and is left out)."""
    return [m.group(0) for m in EPOCH_RE.finditer(out)]


def _mnist_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.environ.get("HYBRIDL_DATA") and os.path.join(os.environ["HYBRIDL_DATA"], "mnist"),
              os.path.join(here, "..", "..", "shared", "datasets", "mnist"),   # beside the clone
              "/work/shared/datasets/mnist"):
        if d and os.path.exists(os.path.join(d, "train-images-idx3-ubyte.gz")):
            return d
    return None


def test_default_train_digits():
    t0 = time.perf_counter()
    r = _hybridl("train", timeout=120)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    epochs = EPOCH_RE.findall(r.stdout)
    assert [int(e[0]) for e in epochs] == list(range(1, 11))
    losses = [float(e[1]) for e in epochs]
    assert losses[-1] < losses[0] / 4
    m = DONE_RE.search(r.stdout)
    assert m, r.stdout
    assert m.group(1) == "lenet/digits"
    acc = float(m.group(2))
    assert acc >= 0.95, r.stdout
    assert acc == float(epochs[-1][3])
    assert wall < 60, f"hybridl train took {wall:.1f} s"


@pytest.mark.skipif(_mnist_dir() is None, reason="MNIST not found (set HYBRIDL_DATA)")
def test_mnist_lenet_one_epoch():
    r = _hybridl("train", "--dataset", "mnist", "--data-dir", _mnist_dir(), "--epochs", "1", "--quiet",
                 timeout=300)
    assert r.returncode == 0, r.stderr
    m = DONE_RE.search(r.stdout)
    assert m and m.group(1) == "lenet/mnist", r.stdout
    assert "60000 train / 10000 test" in r.stdout
    assert float(m.group(2)) >= 0.97, r.stdout


def test_same_seed_same_losses_and_naive_equals_threaded():
    common = ("--epochs", "2", "--quiet", "--seed", "5")
    procs = [_start("train", *common), _start("train", *common),
             _start("train", *common, "--engine", "naive"),
             _start("train", "--epochs", "2", "--quiet", "--seed", "6")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(_epochs(out))
    a, b, naive, other = outs
    assert len(a) == 2
    assert a == b, "same seed, different epoch lines run-to-run"
    assert a == naive, "threaded and naive engines disagree"
    assert a != other, "a different seed should change the run"


def test_save_then_export(tmp_path):
    params = tmp_path / "lenet.safetensors"
    r = _hybridl("train", "--epochs", "1", "--quiet", "--save", str(params))
    assert r.returncode == 0, r.stderr
    assert f"parameters saved to {params}" in r.stdout
    assert params.exists() and not [f for f in os.listdir(tmp_path) if "tmp" in f]
    saved = params.read_bytes()
    # --out naming the checkpoint itself (lenet -> lenet.safetensors) is refused, nothing written
    r = _hybridl("export", "--params", str(params), "--out", str(tmp_path / "lenet"))
    assert r.returncode == 2 and "over the --params file" in r.stderr, r.stderr
    assert params.read_bytes() == saved and not (tmp_path / "lenet-symbol.json").exists()
    out = tmp_path / "lenet-graph"
    r = _hybridl("export", "--params", str(params), "--out", str(out))
    assert r.returncode == 0, r.stderr
    sym, par = tmp_path / "lenet-graph-symbol.json", tmp_path / "lenet-graph.safetensors"
    assert sym.exists() and par.exists() and params.read_bytes() == saved
    # the exported graph reproduces the trained LeNet
    net = hl.models.lenet(10, input_size=8)
    net.initialize()
    net.load_parameters(str(params))
    x = hl.nd.array(np.random.default_rng(0).random((1, 1, 8, 8)), dtype="float32")
    with hl.autograd.predict_mode():
        ref = net(x).asnumpy()
    blk = hl.nn.SymbolBlock.imports(str(sym), param_file=str(par))
    np.testing.assert_allclose(blk(x).asnumpy(), ref, rtol=1e-5, atol=1e-6)
    # a corrupt parameter file is a short error, not a traceback
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    r = _hybridl("export", "--params", str(bad), "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "bad.safetensors" in r.stderr
    # parameters of another model: the error names the options the file fits
    r = _hybridl("export", "--model", "mlp", "--params", str(params), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "the file fits `--model lenet --dataset digits`" in r.stderr, r.stderr
    assert not (tmp_path / "y-symbol.json").exists()


def test_export_checks_every_output_path_before_writing(tmp_path):
    (tmp_path / "adir").mkdir()
    for args, msg in ((("--out", str(tmp_path / "m"), "--onnx", str(tmp_path / "adir")), "is a directory"),
                      (("--out", str(tmp_path / "m"), "--onnx", str(tmp_path / "no" / "m.onnx")),
                       "does not exist"),
                      (("--out", ""), "expected a file prefix"),
                      (("--out", str(tmp_path) + "/"), "expected a file prefix")):
        r = _hybridl("export", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["adir"]          # nothing written by any of them
    r = _hybridl("export", "--model", "resnet18", "--out", str(tmp_path / "r18"))
    assert r.returncode == 0, r.stderr                       # batch 1, 1x1 maps: predict-mode BN


BAD_OPTIONS = [
    (("--epochs", "0"), "--epochs"),
    (("--model", "nope"), "--model"),
    (("--lr", "-1"), "--lr"),
    (("--no-such-flag",), "--no-such-flag"),
    (("--dataset", "mnist", "--data-dir", "/nonexistent"), "/nonexistent"),
    (("--batch-size", "abc"), "--batch-size"),
    (("--momentum", "5"), "momentum"),
    (("--lr-schedule", "linear"), "--lr-schedule"),
    (("--save", "/nonexistent/p.safetensors"), "/nonexistent"),     # before training, not after
    (("--save", "/"), "expected a file name"),
    (("--save", "/proc/p.safetensors"), "cannot write files into '/proc'"),
    (("--devices", "cpu:0,cpu:1", "--batch-size", "2000"), "larger than the 1438 training samples"),
    (("--devices", ""), "comma-separated list of devices"),
    (("--devices", "cpu:0,,cpu:1"), "comma-separated list of devices"),
    (("--device", "cpu:1", "--devices", "cpu:0,cpu:1"), "either --device"),
    (("--microbatches", "8"), "applies only to --strategy pipeline"),      # was silently ignored
    (("--devices", "cpu:0,cpu:1", "--batch-size", "3"), "does not split evenly over 2 devices"),
    (("--data-dir", "/tmp"), "--data-dir is for --dataset mnist"),        # was ignored
    (("--download",), "--download is for --dataset mnist"),
    (("--devices", "cpu:0,cpu:1", "--batch-size", "1"), "use a multiple of 2"),
    (("--devices", "cpu:0,cpu:1", "--schedule", "gpipe"), "applies only to --strategy pipeline"),
    (("--devices", "cpu:0,cpu:1", "--strategy", "pipeline", "--microbatches", "64",
      "--batch-size", "32"), "each micro-batch needs at least one sample"),   # was after the header
]


@pytest.mark.parametrize("args,needle", BAD_OPTIONS)
def test_bad_options_exit_2_with_short_message(args, needle, capsys):
    from hybridl.cli import main
    try:
        rc = main(["train", *args])
    except SystemExit as e:           # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert needle in err and "error" in err
    assert len(err.strip().splitlines()) <= 15
    assert "epoch" not in out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # NumPy's overflow, from the workers
def test_diverging_training_stops_with_exit_1(capsys):
    # a learning rate far too large: the loss becomes NaN in the first epoch; the run stops
    # there with one clear line (exit 1: the options were valid, the run failed) instead of
    # training on NaN for every epoch
    from hybridl.cli import main
    rc = main(["train", "--lr", "1e6", "--epochs", "3", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert "training diverged" in err and "--lr was 1000000.0" in err
    assert "epoch   1" in out and "epoch   2" not in out


def test_bad_options_in_a_real_process():
    procs = [_start("train", *args) for args, _ in BAD_OPTIONS[:5]]
    for p, (args, needle) in zip(procs, BAD_OPTIONS):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (args, out, err)
        assert "Traceback" not in err and needle in err
    r = _hybridl("nosuchcommand", timeout=60)
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_fit_and_evaluate_in_process():
    from hybridl import data, loss, models, optim
    from hybridl.train_cli import evaluate, fit
    hl.random.seed(0)
    train = data.DataLoader(data.Digits(train=True), 64, shuffle=True, seed=0)
    test = data.DataLoader(data.Digits(train=False), 256)
    net = models.mlp((64,), 10)
    net.initialize()
    trainer = optim.Trainer(net.collect_params(), "adam", dict(learning_rate=0.01))
    lines = []
    hist = fit(net, trainer, train, test, 3, loss_fn=loss.SoftmaxCrossEntropyLoss(),
               log=lines.append, progress=False)
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert len(lines) == 3 and lines[0].startswith("epoch   1")
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert set(hist[0]) >= {"loss", "train_acc", "test_acc", "samples_per_s", "seconds"}
    acc = evaluate(net, test)
    assert acc == hist[-1]["test_acc"]
    assert acc >= 0.9


def test_fit_reduces_epoch_statistics_over_processes():
    """reduce_stats (an allreduce in an MPI job) sums (loss, correct, samples) over the ranks:
    the printed figures are the job's, and a NaN on another rank stops every rank at once."""
    from hybridl import data, models, optim
    from hybridl.train_cli import fit

    def run(reduce_stats):
        hl.random.seed(0)
        train = data.DataLoader(data.Digits(train=True), 64, shuffle=True, seed=0)
        net = models.mlp((64,), 10)
        net.initialize()
        trainer = optim.Trainer(net.collect_params(), "sgd", dict(learning_rate=0.05))
        return fit(net, trainer, train, None, 2, log=lambda s: None, progress=False,
                   reduce_stats=reduce_stats)
    seen = []

    def other_rank_agrees(v):          # another rank with the same figures: means unchanged
        seen.append(v.copy())
        return 2 * v
    plain, reduced = run(None), run(other_rank_agrees)
    assert len(seen) == 2 and seen[0].dtype == np.float64
    assert seen[0][2] == len(data.Digits(train=True))          # samples of the epoch
    for a, b in zip(plain, reduced):
        assert b["loss"] == a["loss"] and b["train_acc"] == a["train_acc"]
        assert b["samples_per_s"] * b["seconds"] == pytest.approx(2 * seen[0][2])   # the job's

    def other_rank_diverged(v):
        return v + np.array([np.nan, 0.0, v[2]])
    with pytest.raises(FloatingPointError, match="epoch 1 is nan"):
        run(other_rank_diverged)
    for bad in (lambda v: v[:2], lambda v: None, lambda v: v[None], lambda v: v * 0,
                lambda v: v + np.array([0.0, 0.0, np.nan]), lambda v: v + 0.5):
        with pytest.raises(ValueError, match="reduce_stats: "):
            run(bad)


@pytest.mark.parametrize("engine", ["threaded", "naive"])
def test_a_failed_batch_skips_one_update_and_training_goes_on(engine):
    """A batch whose op fails (a label 2.5) raises at the user's sync point; its update is
    skipped and the weights and momentum stay usable: the run then equals one that never saw
    that batch, bit for bit (with the threaded engine the skipped update used to mark the
    weights failed, so every later step and even inference raised the old error)."""
    def run(labels_seq):
        with hl.engine.set_engine(engine):
            hl.random.seed(0)
            net = hl.nn.Dense(3, in_units=6)
            net.initialize()
            trainer = hl.Trainer(net.collect_params(), "sgd",
                                 {"learning_rate": 0.1, "momentum": 0.9})
            loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
            x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
            failed = 0
            for labels in labels_seq:
                try:
                    with autograd.record():
                        loss = loss_fn(net(x), hl.nd.array(np.array(labels), dtype="float32"))
                    loss.backward()
                    trainer.step(4)
                    loss.asnumpy()
                except hl.OpError as e:
                    assert "whole numbers" in str(e)
                    failed += 1
                    _clear_errors()            # the error is reported once more here
            out = net(x).asnumpy()             # inference works after the failure
            return failed, [p.data().asnumpy() for p in net.collect_params().values()], out
    good = [0.0, 1.0, 2.0, 0.0]
    f1, w1, o1 = run([good, [0.0, 1.0, 2.5, 0.0], good, good])
    f0, w0, o0 = run([good, good, good])
    assert (f1, f0) == (1, 0)
    for a, b in zip(w1, w0):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(o1, o0)


@pytest.mark.parametrize("engine", ["threaded", "naive"])
@pytest.mark.parametrize("ndev", [1, 2])
def test_a_failed_batch_with_accumulated_gradients_skips_its_update(engine, ndev):
    """grad_req='add' (gradient accumulation; every Pipeline): a batch that fails on one
    device must not update the weights either. Its failed accumulation used to leave the
    buffer clean, so the threaded engine's step applied what the buffer held (zeros moved by
    momentum; on 2 devices the other device's gradient, to every replica). [good, failed,
    good, good] equals [good, good, good] bit for bit, under both engines; zero_grad only
    after a good batch (the buffer keeps the failed step's other contributions, as naive)."""
    def run(labels_seq):
        with hl.engine.set_engine(engine):
            hl.random.seed(0)
            devs = [hl.cpu(i) for i in range(ndev)]
            net = hl.nn.Dense(3, in_units=6)
            net.initialize(device=devs)
            for p in net.collect_params().values():
                p.grad_req = "add"
            trainer = hl.Trainer(net.collect_params(), "sgd",
                                 {"learning_rate": 0.1, "momentum": 0.9})
            loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
            x = np.random.default_rng(0).random((4, 6)).astype(np.float32)
            failed = 0
            for labels in labels_seq:
                xs = hl.parallel.split_and_load(x, devs)
                ys = hl.parallel.split_and_load(np.array(labels, np.float32), devs)
                try:
                    with autograd.record():
                        losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
                    autograd.backward(losses)
                    trainer.step(4)
                    for loss in losses:
                        loss.asnumpy()
                except hl.OpError:
                    failed += 1
                    _clear_errors()
                    continue
                net.collect_params().zero_grad()
            return failed, [p.data(d).asnumpy() for p in net.collect_params().values()
                            for d in devs]
    good = [0.0, 1.0, 2.0, 0.0]
    f1, w1 = run([good, [0.0, 1.0, 2.0, 7.0], good, good])    # label 7: the last device's
    f0, w0 = run([good, good, good])
    assert (f1, f0) == (1, 0)
    for a, b in zip(w1, w0):
        np.testing.assert_array_equal(a, b)


def test_freezing_a_parameter_after_making_the_trainer_on_several_devices():
    # grad_req='null' set after the Trainer was made: not updated, the others train, on two
    # devices as on one (allreduce_grads asked the frozen parameter for its gradient: crash)
    def run(devs, kvstore="device"):
        hl.random.seed(0)
        net = hl.nn.HybridSequential()
        net.add(hl.nn.Dense(4, in_units=3), hl.nn.Dense(2, in_units=4))
        net.initialize(device=devs)
        tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kvstore)
        w0 = net[0].weight.data().asnumpy()
        net[0].weight.grad_req = "null"
        xs = hl.parallel.split_and_load(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, devs)
        with autograd.record():
            ls = [net(x).sum() for x in xs]
        autograd.backward(ls)
        tr.step(4)
        np.testing.assert_array_equal(net[0].weight.data(devs[-1]).asnumpy(), w0)
        return [p.data(d).asnumpy() for p in net.collect_params().values() for d in devs]
    one = run([hl.cpu(0)], None)
    two = run([hl.cpu(0), hl.cpu(1)])
    for k in range(len(one)):
        np.testing.assert_allclose(two[2 * k], one[k], rtol=1e-6)
        np.testing.assert_array_equal(two[2 * k], two[2 * k + 1])


def _train_once(net, loss_fn, trainer, step, x, y):
    """One training step: ``step(x, y)`` (a TrainStep) when given, else the Gluon loop
    (record, backward, ``trainer.step``). Returns the loss, not waited for."""
    if step is not None:
        return step(x, y)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(x.shape[0])
    return loss


@pytest.mark.parametrize("compiled", [False, True])
def test_a_failed_step_does_not_count_for_adam(compiled):
    """Adam's bias correction uses each parameter's update count t: a step that failed (a bad
    label) and made no update must not count, in the loop (threaded engine) and in TrainStep:
    [good, bad, good] then gives the weights of [good, good], bit for bit."""
    def run(labels_seq):
        hl.random.seed(0)
        net = hl.nn.Dense(3, in_units=6)
        net.initialize()
        trainer = hl.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01})
        loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
        step = hl.TrainStep(net, loss_fn, trainer) if compiled else None
        x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
        for labels in labels_seq:
            y = hl.nd.array(np.array(labels), dtype="float32")
            try:
                _train_once(net, loss_fn, trainer, step, x, y).asnumpy()
            except hl.OpError:
                with pytest.raises(hl.OpError):
                    hl.waitall()
        hl.waitall()
        counts = sorted(st["t"] for st in trainer._states.values())
        return counts, [p.data().asnumpy() for p in net.collect_params().values()]
    good = [0.0, 1.0, 2.0, 0.0]
    t1, w1 = run([good, [0.0, 1.5, 2.0, 0.0], good])
    t0, w0 = run([good, good])
    assert t1 == t0 == [2, 2]
    for a, b in zip(w1, w0):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["eager", "hybridized", "train_step"])
def test_a_batchs_own_error_is_raised_where_its_loss_is_read_not_by_the_step(mode):
    """A bad label: the error is raised by ``loss.asnumpy()`` after the step, as the README
    says, also when the loss op ran at its push (one device: ops run in the calling thread)
    and its error was stored before ``trainer.step``; the step (or TrainStep call) of that
    batch never raises it, and training goes on."""
    rng = np.random.RandomState(0)
    net = hl.nn.HybridSequential()
    net.add(hl.nn.Dense(16, activation="relu", in_units=64), hl.nn.Dense(10, in_units=16))
    net.initialize()
    if mode != "eager":
        net.hybridize()
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    step = hl.TrainStep(net, loss_fn, tr) if mode == "train_step" else None
    x = hl.nd.array(rng.rand(32, 64).astype("float32"))
    caught = []
    for i in range(8):
        labels = rng.randint(0, 10, 32).astype("float32")
        if i in (2, 5):
            labels[3] = 12                  # out of range for 10 classes
        y = hl.nd.array(labels)
        loss = _train_once(net, loss_fn, tr, step, x, y)
        try:
            loss.asnumpy()
        except hl.OpError:
            caught.append(i)
            with contextlib.suppress(hl.OpError):
                hl.waitall()
    assert caught == [2, 5]
    hl.waitall()


def test_ctrl_c_inside_a_train_step_before_its_updates_leaves_the_model_usable():
    """Ctrl-C while a TrainStep program runs (in the main thread when it runs at its push on
    one device) before any update: only that step's loss is failed, and the next step trains
    from the unchanged weights (they used to stay failed for good: the program caught
    Exception only)."""
    rng = np.random.RandomState(0)
    net = hl.nn.HybridSequential()
    net.add(hl.nn.Dense(8, activation="relu", in_units=6), hl.nn.Dense(3, in_units=8))
    net.initialize()
    tr = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), tr)
    x = hl.nd.array(rng.rand(4, 6).astype("float32"))
    y = hl.nd.array(np.array([0, 1, 2, 0], np.float32))
    step(x, y).asnumpy()
    before = [p.data().asnumpy() for p in net.collect_params().values()]
    (e,) = step._cache.entries.values()
    prog = e.prog
    real = prog.fn

    def interrupted(*a, **k):               # Ctrl-C arriving inside the program
        prog.fn = real
        raise KeyboardInterrupt
    prog.fn = interrupted
    # in the main thread (one device: the step runs at its push) Ctrl-C goes on to the
    # program; on a worker (this process used other devices before) it is the step's error
    with pytest.raises((KeyboardInterrupt, hl.OpError)):
        step(x, y).asnumpy()
    with contextlib.suppress(hl.OpError):
        hl.waitall()
    for p, b in zip(net.collect_params().values(), before):
        np.testing.assert_array_equal(p.data().asnumpy(), b)      # readable, unchanged
    assert np.isfinite(step(x, y).asnumpy()).all()                # and training goes on
    assert not np.array_equal(net[0].weight.data().asnumpy(), before[0])


def test_an_error_no_sync_point_raised_stops_the_next_step():
    """A failing op on the gradients (here a user's clipping op) makes its update be skipped,
    the weights staying usable; the loss does not depend on it, so no sync point raises it:
    the next trainer.step does (it used to go unnoticed, every update skipped), once."""
    net = hl.nn.Dense(3, in_units=6)
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
    y = hl.nd.array(np.array([0, 1, 2, 0]))
    w = net.weight.data()

    def step(bad):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if bad:
            g = w.grad

            def clip():
                g._data = np.clip(g._data, -1.0)          # a bug: a_max missing
            hl.engine.push(clip, [g._var], [g._var], name="clip_grad")
        trainer.step(4)
        return loss.asnumpy()
    step(False)
    before = w.asnumpy()
    step(True)                                          # loss fine, update skipped
    np.testing.assert_array_equal(w.asnumpy(), before)  # weights unchanged and readable
    with pytest.raises(hl.OpError, match="clip_grad"):
        step(False)
    step(False)                                         # raised once: training goes on
    assert not np.array_equal(w.asnumpy(), before)
    with pytest.raises(hl.OpError, match="clip_grad"):
        hl.waitall()                                    # and once more by waitall, as always
    hl.waitall()


def test_writing_a_failed_value_into_a_parameter_still_fails_its_reads():
    """Only optimizer updates leave the weights clean when skipped: set_data of a value whose
    op failed marks the parameter failed, as any array (nothing is dropped in silence)."""
    net = hl.nn.Dense(2, in_units=3)
    net.initialize()
    bad = hl.nd.array(np.zeros((2, 3), np.float32)) / hl.nd.array(np.zeros((2, 3), np.int64) + 1)
    bad = hl.nd.take(bad, hl.nd.array([0, 5]), mode="raise")      # index 5 out of range
    with pytest.raises(hl.OpError):
        net.weight.set_data(bad)
        net.weight.data().asnumpy()
    with pytest.raises(hl.OpError):
        hl.waitall()


def test_a_failed_train_step_leaves_weights_and_batch_norm_statistics_as_they_were():
    """A TrainStep whose program fails before any update (a bad label) marks only its outputs
    failed: the weights stay readable and the BatchNorm running statistics usable, so the next
    steps run and [good, bad, good] equals [good, good], statistics included (the statistics
    used to stay failed, and every later step failed with the old error)."""
    def run(labels_seq):
        hl.random.seed(0)
        net = hl.nn.HybridSequential()
        net.add(hl.nn.Dense(8, in_units=6), hl.nn.BatchNorm(in_channels=8),
                hl.nn.Dense(3, in_units=8))
        net.initialize()
        trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
        step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer)
        x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
        failed = 0
        for labels in labels_seq:
            try:
                step(x, hl.nd.array(np.array(labels), dtype="float32")).asnumpy()
            except hl.OpError:
                failed += 1
                net[0].weight.data().asnumpy()          # readable at once
                with pytest.raises(hl.OpError):
                    hl.waitall()
        return failed, {k: p.data().asnumpy() for k, p in net.collect_params().items()}
    good = [0.0, 1.0, 2.0, 0.0]
    f1, v1 = run([good, [0.0, 2.5, 2.0, 0.0], good])
    f0, v0 = run([good, good])
    assert (f1, f0) == (1, 0) and v1.keys() == v0.keys()
    assert any("running" in k for k in v1)
    for k in v1:
        np.testing.assert_array_equal(v1[k], v0[k], err_msg=k)


@pytest.mark.parametrize("mode", ["eager", "hybridized", "TrainStep"])
def test_a_batch_from_a_failed_op_leaves_weights_and_statistics_as_they_were(mode):
    """A batch whose data comes from a failed op (hl.nd.take out of range): with the threaded
    engine the BatchNorm running statistics (eager and hybridized loop) and, in a TrainStep,
    the weights too took the batch's error, so every later step and inference raised it. Now
    only the loss fails: [good, failed, good, good] equals [good, good, good], statistics
    included, and inference works."""
    def run(bad_at):
        hl.random.seed(0)
        net = hl.nn.HybridSequential()
        net.add(hl.nn.Dense(8, in_units=5), hl.nn.BatchNorm(in_channels=8),
                hl.nn.Dense(4, in_units=8))
        net.initialize()
        if mode != "eager":
            net.hybridize()
        loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
        trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
        step = hl.TrainStep(net, loss_fn, trainer) if mode == "TrainStep" else None
        rng = np.random.default_rng(0)
        data = hl.nd.array(rng.standard_normal((16, 5)).astype(np.float32))
        y = hl.nd.array(rng.integers(0, 4, 16).astype(np.float32))
        failed = 0
        for i in range(4 if bad_at is not None else 3):
            idx = np.arange(16) + (100 if i == bad_at else 0)        # 100+: out of range
            x = hl.nd.take(data, hl.nd.array(idx), mode="raise")
            try:
                _train_once(net, loss_fn, trainer, step, x, y).asnumpy()
            except hl.OpError:
                failed += 1
                _clear_errors()
        out = net(data).asnumpy()                          # inference works afterwards
        return failed, {k: p.data().asnumpy() for k, p in net.collect_params().items()}, out
    f1, v1, o1 = run(bad_at=1)
    f0, v0, o0 = run(bad_at=None)
    assert (f1, f0) == (1, 0)
    assert any("running" in k for k in v1)
    for k in v1:
        np.testing.assert_array_equal(v1[k], v0[k], err_msg=k)
    np.testing.assert_array_equal(o1, o0)


def test_a_hybridized_forward_that_fails_leaves_batch_norm_statistics_as_they_were():
    """A hybridized block whose forward fails in its own program (the loss inside it, a label
    out of range) wrote its failed running statistics back into the BatchNorm parameters, so
    every later call raised the old error (threaded engine). Now they keep their values."""
    class WithLoss(hl.nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.body = hl.nn.HybridSequential()
            self.body.add(hl.nn.Dense(8, in_units=5), hl.nn.BatchNorm(in_channels=8),
                          hl.nn.Dense(4, in_units=8))
            self.loss = hl.loss.SoftmaxCrossEntropyLoss()

        def forward(self, x, y):
            return self.loss(self.body(x), y)

    def run(labels_seq):
        hl.random.seed(0)
        net = WithLoss()
        net.initialize()
        net.hybridize()
        x = hl.nd.array(np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32))
        res = []
        for labels in labels_seq:
            try:
                with autograd.train_mode():
                    res.append(float(net(x, hl.nd.array(labels)).asnumpy().sum()))
            except hl.OpError:
                res.append("failed")
                _clear_errors()
        stats = {k: p.data().asnumpy() for k, p in net.collect_params().items() if "running" in k}
        return res, stats
    good = np.array([0, 1, 2, 3, 0, 1], np.float32)
    bad = np.array([0, 1, 7, 3, 0, 1], np.float32)              # 7: not one of 4 classes
    r1, s1 = run([good, bad, good, good])
    r0, s0 = run([good, good, good])
    assert r1[1] == "failed" and r1[:1] + r1[2:] == r0
    for k in s1:
        np.testing.assert_array_equal(s1[k], s0[k], err_msg=k)


def test_save_states_after_a_handled_failure(tmp_path):
    """save_states waits for the optimizer states, not for everything: an error already
    raised at its sync point (and not yet by waitall) does not stop the checkpoint."""
    net = hl.nn.Dense(3, in_units=6)
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
    failed = 0
    for labels in ([0.0, 1.0, 2.0, 0.0], [0.0, 1.5, 2.0, 0.0]):
        try:                # raised by the loss's sync, or by trainer.step when it ran already
            with autograd.record():
                loss = loss_fn(net(x), hl.nd.array(np.array(labels), dtype="float32"))
            loss.backward()
            trainer.step(4)
            loss.asnumpy()
        except hl.OpError:
            failed += 1
    assert failed == 1
    trainer.save_states(str(tmp_path / "s.safetensors"))
    other = hl.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    other.load_states(str(tmp_path / "s.safetensors"))
    assert sorted(st["t"] for st in other._states.values()) == [1, 1]     # the good step only
    with pytest.raises(hl.OpError):
        hl.waitall()


@pytest.mark.parametrize("engine", ["threaded", "naive"])
def test_gradient_accumulation_keeps_the_good_micro_batches_of_a_failed_one(engine):
    """grad_req='add': a micro-batch that fails (a bad label) adds nothing, the others'
    gradients stay summed and the step applies them: [good, bad, good] then step equals
    [good, good] then step, on both engines (the threaded engine dropped the whole step)."""
    def run(micro):
        with hl.engine.set_engine(engine):
            hl.random.seed(0)
            net = hl.nn.Dense(3, in_units=6)
            net.initialize()
            net.collect_params().setattr("grad_req", "add")
            trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
            loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
            x = hl.nd.array(np.random.default_rng(0).random((4, 6)), dtype="float32")
            for labels in micro:
                try:
                    with autograd.record():
                        loss = loss_fn(net(x), hl.nd.array(np.array(labels), dtype="float32"))
                    loss.backward()
                    loss.asnumpy()
                except hl.OpError:
                    pass
            _clear_errors()
            trainer.step(4 * 2)
            return [p.data().asnumpy() for p in net.collect_params().values()]
    good = [0.0, 1.0, 2.0, 0.0]
    for a, b in zip(run([good, [0.0, 0.5, 2.0, 0.0], good]), run([good, good])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("batch, units", [(8, 4), (1, 1)])
def test_train_step_returning_outputs_recovers_from_a_bad_batch(batch, units):
    """TrainStep(return_outputs=True): a bad batch raises its own error once and the next
    steps train (the failure handler tested the output array's truth value: a ValueError that
    hid the real one and failed the weights for good, or, for a 1-element output, a wait on
    the running op itself: a hang)."""
    net = hl.nn.Dense(units, in_units=6)
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    step = hl.TrainStep(net, hl.loss.SoftmaxCrossEntropyLoss(), trainer, return_outputs=True)
    x = hl.nd.array(np.random.default_rng(0).random((batch, 6)), dtype="float32")
    good = hl.nd.array(np.zeros(batch, np.float32))
    bad = hl.nd.array(np.full(batch, 0.5, np.float32))
    raised = []
    for i, y in enumerate([good] * 4 + [bad] + [good] * 3):
        try:
            loss, out = step(x, y)
            loss.asnumpy()
            out.asnumpy()
        except hl.OpError as e:
            raised.append((i, "whole numbers" in str(e)))
    assert raised == [(4, True)]
    net.weight.data().asnumpy()
    with pytest.raises(hl.OpError, match="whole numbers"):
        hl.waitall()
    hl.waitall()


def test_each_bad_batch_raises_once_and_none_is_lost():
    """One bad batch raises one error (the loss's gradient no longer checks the same labels
    again: a second error raised by the next, good step), a TrainStep whose loss is never read
    raises at the next call, and errors already raised do not crowd out a new one when a loop
    catches many without calling waitall."""
    net = hl.nn.Dense(4, in_units=5)
    net.initialize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    loss_fn = hl.loss.SoftmaxCrossEntropyLoss()
    x = hl.nd.array(np.random.default_rng(0).random((8, 5)), dtype="float32")
    good = hl.nd.array(np.zeros(8, np.int64))
    out_of_range = hl.nd.array(np.r_[99, np.zeros(7)].astype(np.int64))

    def batch(y, read):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
        if read:
            loss.asnumpy()
    raised = []
    for i in range(70):                 # many caught errors, no waitall: none may crowd out
        try:
            batch(out_of_range if i % 2 == 0 else good, read=True)
        except hl.OpError:
            raised.append(i)
    assert raised == list(range(0, 70, 2))
    raised = []
    for i in range(4):                  # a bad batch whose loss is never read
        try:
            batch(out_of_range if i == 1 else good, read=False)
        except hl.OpError:
            raised.append(i)
        net.weight.data().wait_to_read()    # the batch has run (the weights stay clean)
    # raised once: by its own trainer.step when its ops ran inline already, else by the next
    assert raised in ([1], [2])
    with pytest.raises(hl.OpError):
        hl.waitall()
    hl.waitall()
    step = hl.TrainStep(net, loss_fn, trainer)
    raised = []
    for i in range(4):
        try:
            step(x, out_of_range if i == 1 else good)
        except hl.OpError:
            raised.append(i)
        net.weight.data().wait_to_read()    # the step has run (its weights stay clean)
    assert raised in ([1], [2])             # by this or the next call, the loss never read
    with pytest.raises(hl.OpError):
        hl.waitall()


def test_cosine_schedule_values_and_use_in_fit():
    import math
    from hybridl import data, models, optim
    from hybridl.train_cli import cosine_lr, fit
    f = cosine_lr(0.1, 8)
    want = [0.1 * (1 + math.cos(math.pi * t / 8)) / 2 for t in range(8)]
    np.testing.assert_allclose([f(t) for t in range(8)], want, rtol=1e-12)
    assert f(0) == 0.1 and f(4) == pytest.approx(0.05) and f(8) == pytest.approx(0.0, abs=1e-15)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="total_steps"):
            cosine_lr(0.1, bad)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="base_lr"):
            cosine_lr(bad, 8)
    # fit sets the rate before every step: the trainer ends on the last step's rate
    hl.random.seed(0)
    train = data.DataLoader(data.Digits(train=True), 512, last_batch="discard")
    net = models.mlp((16,), 10)
    net.initialize()
    trainer = optim.Trainer(net.collect_params(), "sgd", dict(learning_rate=0.1))
    seen = []
    orig = trainer.set_learning_rate
    trainer.set_learning_rate = lambda lr: (seen.append(lr), orig(lr))
    fit(net, trainer, train, None, 2, log=lambda s: None, progress=False,
        lr_schedule=cosine_lr(0.1, 2 * len(train)))
    n = 2 * len(train)
    np.testing.assert_allclose(seen, [0.1 * (1 + math.cos(math.pi * t / n)) / 2 for t in range(n)])
    assert trainer.learning_rate == pytest.approx(seen[-1])


def test_hybridl_without_a_command_prints_usage_and_exits_2(capsys):
    from hybridl.cli import main
    assert main([]) == 2
    assert "usage: hybridl <command>" in capsys.readouterr().err
    assert main(["--help"]) == 0


@pytest.mark.parametrize("sig, rc, said", [("SIGINT", 130, "interrupted"),
                                            ("SIGTERM", 143, "terminated (SIGTERM)")])
def test_ctrl_c_ends_training_with_one_line_and_no_file(tmp_path, sig, rc, said):
    """Ctrl-C, and SIGTERM (kill, timeout, a batch system; its default action ended the
    process without the clean-up) end a run with one line and no file left behind."""
    import signal
    save = tmp_path / "m.safetensors"
    p = _start("train", "--epochs", "200", "--save", str(save))
    try:
        line = p.stdout.readline()             # the run has started
        while line and "epoch" not in line:
            line = p.stdout.readline()
        state = _signal_state(p.pid)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == rc, (err, state)
    assert f"hybridl train: {said}" in err and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []          # no --save file, no temporary


@pytest.mark.skipif(_mnist_dir() is None, reason="MNIST not found (set HYBRIDL_DATA)")
def test_ctrl_c_with_a_long_queue_drops_it_at_once_and_says_one_line():
    """An MNIST epoch pushes many steps ahead: after a Ctrl-C the exit waited 2 s for that
    queue and then printed a second line about the cancelled ops."""
    import signal
    p = _start("train", "--dataset", "mnist", "--data-dir", _mnist_dir(), "--epochs", "1")
    try:
        line = p.stdout.readline()
        while line and "hybridl train" not in line:
            line = p.stdout.readline()
        time.sleep(2.0)                         # the epoch is under way
        state = _signal_state(p.pid)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        dt = time.perf_counter() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (err, state)
    # (a loaded machine adds the CLI's busy note, "note: this machine is busy ...", first)
    lines = [ln for ln in err.splitlines()
             if ln.strip() and not ln.startswith("note: this machine is busy")]
    assert lines == ["hybridl train: interrupted"], err
    assert dt < 1.5


def test_save_through_a_dangling_link_fails_before_training_and_a_failed_final_save_exits_1(
        tmp_path, monkeypatch, capsys):
    """--save through a symbolic link into a missing folder passed the early check (it looked
    at the link's folder) and failed after the whole run; a final save that failed (disk full)
    ended in a traceback. Now the first is a usage error before training, the second one line
    and exit code 1."""
    from hybridl.cli import main
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "no_such_dir" / "p.safetensors")
    rc = main(["train", "--model", "mlp", "--epochs", "1", "--quiet", "--save", str(link)])
    out, err = capsys.readouterr()
    assert rc == 2 and "no_such_dir" in err and "epoch" not in out

    def disk_full(self, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hl.nn.Block, "save_parameters", disk_full)
    rc = main(["train", "--model", "mlp", "--epochs", "1", "--quiet", "--save",
               str(tmp_path / "p.safetensors")])
    out, err = capsys.readouterr()
    assert rc == 1 and "epoch" in out
    assert "--save: the trained parameters could not be written" in err and "Traceback" not in err


def test_export_refuses_an_onnx_path_that_is_another_file_it_reads_or_writes(tmp_path, capsys):
    """`hybridl export --params ckpt --onnx ckpt` overwrote the checkpoint with the ONNX model
    (exit 0); --onnx on one of --out's own files left a broken export."""
    from hybridl.cli import main
    ckpt = tmp_path / "ckpt.safetensors"
    assert main(["train", "--model", "mlp", "--epochs", "1", "--quiet", "--save", str(ckpt)]) == 0
    before = ckpt.read_bytes()
    capsys.readouterr()
    for onnx_path in (ckpt, tmp_path / "g.safetensors", tmp_path / "g-symbol.json"):
        rc = main(["export", "--model", "mlp", "--params", str(ckpt), "--out",
                   str(tmp_path / "g"), "--onnx", str(onnx_path)])
        err = capsys.readouterr().err
        assert rc == 2 and "--onnx would write" in err, err
    assert ckpt.read_bytes() == before
    assert not (tmp_path / "g-symbol.json").exists()


def test_trainer_kvstore_and_cli_distributed_options_are_checked_up_front(capsys):
    """kvstore='nccl' or 'dist_async' failed only at the first step, kvstore=123 with an
    AttributeError; `hybridl train --distributed --devices a,b` trained each process on its own
    (no gradient exchange) and both wrote --save; `hybridl launch --timeout 0` failed in
    every rank with a traceback."""
    from hybridl.cli import main
    net = hl.nn.Dense(2, in_units=2)
    net.initialize()
    for bad, err in (("nccl", ValueError), ("dist_async", ValueError), (123, TypeError)):
        with pytest.raises(err, match="kvstore: expected"):
            hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=bad)
    assert main(["train", "--distributed", "--devices", "cpu:0,cpu:1"]) == 2
    assert "--distributed trains one device per process" in capsys.readouterr().err
    for t in ("0", "-5", "nan", "inf"):
        assert main(["launch", "-n", "2", "--timeout", t, "--", "python", "-c", "1"]) == 2
        assert "--timeout: expected seconds" in capsys.readouterr().err


def test_cli_optimizer_defaults_and_no_cancelled_note_after_a_usage_error(capsys, tmp_path):
    """--optimizer adamw trained exactly as adam (the CLI's --wd default 0 replaced AdamW's
    0.01); --momentum with adam was ignored; a usage error could be followed by a note that a
    pushed op was cancelled at exit (the RNG's seeding)."""
    import subprocess
    import sys
    from hybridl.train_cli import _opt_params, build_parser
    args = build_parser().parse_args(["--optimizer", "adamw"])
    assert "wd" not in _opt_params(args)                    # AdamW's own default
    assert _opt_params(build_parser().parse_args([]))["momentum"] == 0.9
    from hybridl.cli import main
    assert main(["train", "--optimizer", "adam", "--momentum", "0.3"]) == 2
    assert "--momentum applies to --optimizer sgd" in capsys.readouterr().err
    for _ in range(3):
        r = subprocess.run([sys.executable, "-m", "hybridl", "train", "--save",
                            str(tmp_path / "missing" / "m.safetensors")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "cancelled" not in r.stderr, r.stderr


def test_bad_engine_setting_is_a_usage_error_not_a_traceback():
    """HYBRIDL_ENGINE is read when hybridl is imported, before the command parses anything:
    the command still answers with one line and exit code 2; a library import raises."""
    env = dict(_env(), HYBRIDL_ENGINE="bogus")
    r = subprocess.run([sys.executable, "-m", "hybridl", "train", "--epochs", "1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == ("hybridl: HYBRIDL_ENGINE='bogus': expected one of ['naive', "
                                "'threaded'] (or unset: threaded)"), r.stderr
    r = subprocess.run([sys.executable, "-c", "import hybridl"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and "ValueError: HYBRIDL_ENGINE='bogus'" in r.stderr, r.stderr


@pytest.mark.parametrize("var,value", [
    ("HYBRIDL_NUM_WORKERS", "100000"),          # was: thousands of threads, then a traceback
    ("HYBRIDL_SWITCH_INTERVAL", "1e20"),        # was: accepted, CPython made it 0
    ("HYBRIDL_MALLOC_TUNING", "false"),         # was: silently "on"
    ("OMP_NUM_THREADS", "0"),                   # was: numexpr's message run into the output
    ("NUMEXPR_MAX_THREADS", "100000"),          # was: the process died in pthread_create
    ("HYBRIDL_FUSION_THRESHOLD", "abc"),
])
def test_bad_thread_and_engine_settings_are_usage_errors(var, value):
    """Each setting is named in one line with exit code 2 (train and export), never a
    traceback."""
    env = dict(_env(), **{var: value})
    for cmd in (["train", "--epochs", "1", "--quiet"], ["export", "--out", os.devnull + "x"]):
        r = subprocess.run([sys.executable, "-m", "hybridl", *cmd], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert f"{var}={value!r}" in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_openmp_thread_lists_and_odd_digits_are_accepted():
    """OMP_NUM_THREADS=4,2 (an OpenMP list: numexpr takes its first number; int() of it was a
    traceback) and OPENBLAS_NUM_THREADS=² ('²'.isdigit() is True; int() of it was a traceback
    at import) train as usual."""
    for var, value in (("OMP_NUM_THREADS", "4,2"), ("OPENBLAS_NUM_THREADS", "\u00b2")):
        env = dict(_env(), **{var: value})
        r = subprocess.run([sys.executable, "-m", "hybridl", "train", "--epochs", "1", "--quiet"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, (var, r.stderr)
