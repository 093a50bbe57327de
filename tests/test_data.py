"""Tests for hybridl.data: Dataset / ArrayDataset / transforms / DataLoader."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hybridl.data import (ArrayDataset, Compose, DataLoader, Dataset, Normalize, SimpleDataset,
                          ToFloat)


@pytest.fixture
def nd():
    """The real hybridl.ndarray (loader tests need it to build batches)."""
    return pytest.importorskip("hybridl.ndarray")


def to_np(batch):
    assert isinstance(batch, tuple)
    return tuple(b.asnumpy() for b in batch)


def collect(loader):
    return [to_np(b) for b in loader]


def make_data(n=23, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 3, 2, 2)).astype(np.float32)
    y = np.arange(n, dtype=np.int32)  # label == sample index: easy to trace order
    return X, y


def ref_batches(order, bs, mode):
    """NumPy reference: split index order into batches for keep / discard."""
    out = [order[i:i + bs] for i in range(0, len(order), bs)]
    if mode == "discard" and out and len(out[-1]) < bs:
        out = out[:-1]
    return out


class PyTransformDataset(Dataset):
    """A per-sample Python dataset (forces the slow path)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __getitem__(self, i):
        return self.X[i] * 2.0, int(self.y[i])

    def __len__(self):
        return len(self.y)


# ------------------------------------------------------------------------------------------------
# Dataset / ArrayDataset
# ------------------------------------------------------------------------------------------------

class FakeND:
    def __init__(self, a):
        self.a = a

    def asnumpy(self):
        return self.a


def test_array_dataset_basics():
    X, y = make_data()
    ds = ArrayDataset(X, FakeND(y))
    assert len(ds) == 23
    xi, yi = ds[5]
    np.testing.assert_array_equal(xi, X[5])
    assert yi == 5
    single = ArrayDataset(X)
    np.testing.assert_array_equal(single[3], X[3])
    g = ds._gather(np.array([4, 1, 7]))
    np.testing.assert_array_equal(g[0], X[[4, 1, 7]])
    np.testing.assert_array_equal(g[1], y[[4, 1, 7]])


def test_array_dataset_errors():
    with pytest.raises(ValueError, match=r"same length.*\[3, 4\]"):
        ArrayDataset(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="at least one array"):
        ArrayDataset()
    with pytest.raises(ValueError, match="0-d"):
        ArrayDataset(np.float32(1.0))


def test_dataset_is_abstract():
    with pytest.raises(NotImplementedError):
        Dataset()[0]
    with pytest.raises(NotImplementedError):
        len(Dataset())


def test_transform_and_transform_first():
    X, y = make_data()
    ds = ArrayDataset(X, y)
    t = ds.transform(lambda a, b: (a + 1, b * 10))
    a, b = t[2]
    np.testing.assert_allclose(a, X[2] + 1)
    assert b == 20
    tf = ds.transform_first(lambda a: a * 3)
    a, b = tf[4]
    np.testing.assert_allclose(a, X[4] * 3)
    assert b == 4
    eager = ds.transform_first(lambda a: a - 1, lazy=False)
    assert isinstance(eager, SimpleDataset) and len(eager) == len(ds)
    np.testing.assert_allclose(eager[7][0], X[7] - 1)
    with pytest.raises(TypeError):
        ds.transform(3)
    # a plain Python function is not batchable: no fast path
    assert not tf._can_gather()
    # a batchable transform keeps the fast path
    assert ds.transform_first(ToFloat(scale=2.0))._can_gather()
    assert ArrayDataset(X).transform(ToFloat())._can_gather()
    assert not ds.transform(ToFloat())._can_gather()  # tuple samples: fn(*sample) per sample


# ------------------------------------------------------------------------------------------------
# transforms
# ------------------------------------------------------------------------------------------------

def test_tofloat():
    x = np.arange(0, 256, dtype=np.uint8).reshape(1, 16, 16)
    out = ToFloat()(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, x.astype(np.float64) / 255.0, rtol=1e-6)
    assert ToFloat(scale=1.0)(x).max() == 255.0


def test_normalize_per_channel_sample_equals_batch():
    rng = np.random.default_rng(1)
    batch = rng.random((5, 3, 4, 4)).astype(np.float32)
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 2.0]
    t = Normalize(mean, std)
    ref = (batch - np.array(mean, np.float32)[:, None, None]) / np.array(std, np.float32)[:, None, None]
    np.testing.assert_allclose(t(batch), ref, rtol=1e-5, atol=1e-6)
    for i in range(5):
        np.testing.assert_allclose(t(batch[i]), ref[i], rtol=1e-5, atol=1e-6)
    scalar = Normalize(0.5, 0.25)
    np.testing.assert_allclose(scalar(batch), (batch - 0.5) / 0.25, rtol=1e-5)
    with pytest.raises(ValueError, match="std must be finite and > 0"):
        Normalize(0.0, 0.0)
    with pytest.raises(ValueError, match="C=3"):
        t(rng.random((2, 4, 4, 4)))


def test_compose_batched_equals_per_sample():
    x = np.random.default_rng(2).integers(0, 256, (6, 1, 5, 5)).astype(np.uint8)
    t = Compose([ToFloat(), Normalize(0.1307, 0.3081)])
    assert t.batchable
    out = t(x)
    per = np.stack([t(s) for s in x])
    np.testing.assert_allclose(out, per, rtol=1e-6)
    np.testing.assert_allclose(out, (x / 255.0 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-5)
    assert not Compose([ToFloat(), lambda a: a]).batchable


# ------------------------------------------------------------------------------------------------
# DataLoader
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["keep", "discard"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_matches_reference(nd, mode, shuffle):
    X, y = make_data(23)
    loader = DataLoader(ArrayDataset(X, y), batch_size=5, shuffle=shuffle, last_batch=mode,
                        seed=7)
    assert loader._fast
    for epoch in range(3):
        order = (np.random.default_rng([7, epoch]).permutation(23) if shuffle
                 else np.arange(23))
        ref = ref_batches(order, 5, mode)
        assert len(loader) == len(ref)
        got = collect(loader)
        assert len(got) == len(ref)
        for (gx, gy), idx in zip(got, ref):
            np.testing.assert_array_equal(gx, X[idx])
            np.testing.assert_array_equal(gy, y[idx])
            assert gx.dtype == np.float32 and gy.dtype == np.int32


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_rollover_across_epochs(nd, shuffle):
    n, bs, epochs = 23, 5, 6
    X, y = make_data(n)
    loader = DataLoader(ArrayDataset(X, y), batch_size=bs, shuffle=shuffle,
                        last_batch="rollover", seed=3)
    # reference: the concatenated stream of every epoch's order, cut into full batches
    stream = np.concatenate([np.random.default_rng([3, e]).permutation(n) if shuffle
                             else np.arange(n) for e in range(epochs)])
    got = []
    lens = []
    for _ in range(epochs):
        expected_len = len(loader)
        batches = collect(loader)
        assert len(batches) == expected_len
        lens.append(len(batches))
        got.extend(batches)
    assert lens[:4] == [4, 5, 4, 5]  # 23 = 4*5+3; 3+23 = 26 -> 5 batches, 1 left; 1+23 -> 4, 4 left...
    assert all(len(b[1]) == bs for b in got)
    for k, (gx, gy) in enumerate(got):
        idx = stream[k * bs:(k + 1) * bs]
        np.testing.assert_array_equal(gy, y[idx])
        np.testing.assert_array_equal(gx, X[idx])


def test_shuffle_reproducible_and_differs_across_epochs(nd):
    X, y = make_data(40)
    a = DataLoader(ArrayDataset(X, y), batch_size=8, shuffle=True, seed=11)
    b = DataLoader(ArrayDataset(X, y), batch_size=8, shuffle=True, seed=11)
    ea0 = np.concatenate([t[1] for t in collect(a)])
    eb0 = np.concatenate([t[1] for t in collect(b)])
    np.testing.assert_array_equal(ea0, eb0)
    np.testing.assert_array_equal(ea0, np.random.default_rng([11, 0]).permutation(40))
    ea1 = np.concatenate([t[1] for t in collect(a)])
    assert not np.array_equal(ea0, ea1)
    assert sorted(ea1.tolist()) == list(range(40))
    # independent of NumPy's global RNG
    np.random.seed(0)
    c = DataLoader(ArrayDataset(X, y), batch_size=8, shuffle=True, seed=11)
    np.random.seed(1)
    np.testing.assert_array_equal(np.concatenate([t[1] for t in collect(c)]), ea0)
    # set_epoch jumps to an epoch's permutation
    c.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate([t[1] for t in collect(c)]), ea1)
    c2 = DataLoader(ArrayDataset(X, y), batch_size=8, shuffle=True, seed=12)
    assert not np.array_equal(np.concatenate([t[1] for t in collect(c2)]), ea0)


def test_seed_none_draws_a_seed(nd):
    X, y = make_data(30)
    loader = DataLoader(ArrayDataset(X, y), batch_size=10, shuffle=True)
    assert isinstance(loader.seed, int) and loader.seed >= 0
    labels = np.concatenate([t[1] for t in collect(loader)])
    np.testing.assert_array_equal(labels, np.random.default_rng([loader.seed, 0]).permutation(30))
    hl_random = pytest.importorskip("hybridl.random")
    seeds = []
    for _ in range(2):
        hl_random.seed(123)
        seeds.append(DataLoader(ArrayDataset(X, y), batch_size=10, shuffle=True).seed)
    assert seeds[0] == seeds[1]
    assert DataLoader(ArrayDataset(X, y), batch_size=10, shuffle=True).seed != seeds[0]


@pytest.mark.parametrize("mode", ["keep", "discard", "rollover"])
def test_workers_identical(nd, mode):
    X, y = make_data(57)
    fast = ArrayDataset(X, y)
    slow = PyTransformDataset(X, y)
    for ds in (fast, slow):
        runs = []
        for nw in (0, 2):
            loader = DataLoader(ds, batch_size=6, shuffle=True, last_batch=mode, seed=5,
                                num_workers=nw, prefetch=3)
            runs.append([collect(loader) for _ in range(3)])
        r0, r2 = runs
        assert len(r0) == len(r2)
        for e0, e2 in zip(r0, r2):
            assert len(e0) == len(e2)
            for b0, b2 in zip(e0, e2):
                for u, v in zip(b0, b2):
                    np.testing.assert_array_equal(u, v)
    # slow path values: X*2 and python int labels stacked to int64
    b = next(iter(DataLoader(slow, batch_size=4)))
    gx, gy = to_np(b)
    np.testing.assert_allclose(gx, X[:4] * 2.0)
    np.testing.assert_array_equal(gy, [0, 1, 2, 3])


def test_batchable_transform_fast_path_matches_slow(nd):
    rng = np.random.default_rng(0)
    X = rng.integers(0, 256, (31, 1, 6, 6)).astype(np.uint8)
    y = rng.integers(0, 10, 31).astype(np.int32)
    t = Compose([ToFloat(), Normalize(0.5, 0.2)])
    fast_ds = ArrayDataset(X, y).transform_first(t)
    slow_ds = ArrayDataset(X, y).transform_first(lambda a: t(a))
    fast = DataLoader(fast_ds, 8, shuffle=True, seed=1)
    slow = DataLoader(slow_ds, 8, shuffle=True, seed=1)
    assert fast._fast and not slow._fast
    for (fx, fy), (sx, sy) in zip(collect(fast), collect(slow)):
        np.testing.assert_allclose(fx, sx, rtol=1e-6)
        np.testing.assert_array_equal(fy, sy)
        assert fx.dtype == np.float32


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_disjoint_equal_cover(nd, shuffle):
    n, S = 103, 4
    X, y = make_data(n)
    shards = []
    for r in range(S):
        loader = DataLoader(ArrayDataset(X, y), batch_size=7, shuffle=shuffle, seed=9,
                            num_shards=S, shard_index=r)
        labels = np.concatenate([t[1] for t in collect(loader)])
        shards.append(labels)
    m = n // S
    assert all(len(s) == m for s in shards)
    allidx = np.concatenate(shards)
    assert len(np.unique(allidx)) == S * m  # disjoint
    order = np.random.default_rng([9, 0]).permutation(n) if shuffle else np.arange(n)
    # contiguous slices of the permutation, remainder (last n - S*m entries) dropped
    for r, s in enumerate(shards):
        np.testing.assert_array_equal(s, order[r * m:(r + 1) * m])
    np.testing.assert_array_equal(np.sort(allidx), np.sort(order[:S * m]))


def test_len_matches_iteration(nd):
    X, y = make_data(10)
    for mode, expected in (("keep", 4), ("discard", 3), ("rollover", 3)):
        loader = DataLoader(ArrayDataset(X, y), batch_size=3, last_batch=mode)
        assert len(loader) == expected
        assert len(list(loader)) == expected
    loader = DataLoader(ArrayDataset(X, y), batch_size=3, num_shards=3, shard_index=2)
    assert len(loader) == 1 and len(list(loader)) == 1  # 10 // 3 = 3 samples per shard


def test_custom_batchify_and_device(nd):
    X, y = make_data(9)

    def batchify(samples):
        return np.stack([s[0] for s in samples]).sum(axis=(1, 2, 3))

    loader = DataLoader(ArrayDataset(X, y), batch_size=4, batchify_fn=batchify)
    assert not loader._fast
    out = collect(loader)
    assert len(out) == 3 and len(out[0]) == 1
    np.testing.assert_allclose(out[0][0], X[:4].sum(axis=(1, 2, 3)), rtol=1e-5)


def test_prefetch_overlaps_with_consumer(nd):
    """Workers load batches ahead while the consumer is busy (no timing assertion)."""
    n, bs = 40, 4
    produced = []
    lock = threading.Lock()
    ahead = threading.Event()

    class Slow(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            time.sleep(0.002)  # slow per-sample transform
            with lock:
                produced.append(i)
                if len(produced) >= 3 * bs:  # batches 0, 1, 2 loaded
                    ahead.set()
            return np.float32(i)

    loader = DataLoader(Slow(), batch_size=bs, num_workers=2, prefetch=2)
    it = iter(loader)
    first = next(it)
    np.testing.assert_array_equal(first[0].asnumpy(), np.arange(4, dtype=np.float32))
    # The consumer is now "computing" on batch 0 and requests nothing; the producers must run
    # ahead and finish batches 1 and 2 meanwhile.
    assert ahead.wait(timeout=10.0), f"producer did not run ahead (loaded {len(produced)})"
    with lock:
        assert len(produced) <= (1 + 2) * bs  # but no further than `prefetch` batches
    rest = [b[0].asnumpy() for b in it]
    np.testing.assert_array_equal(np.concatenate([first[0].asnumpy()] + rest), np.arange(n))

    # without workers nothing is loaded ahead of the consumer
    produced.clear()
    ahead.clear()
    it0 = iter(DataLoader(Slow(), batch_size=bs, num_workers=0))
    next(it0)
    assert not ahead.wait(timeout=0.2)
    assert len(produced) == bs


def test_worker_error_propagates_and_early_break(nd):
    class Bad(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if i == 13:
                raise KeyError("boom at 13")
            return np.float32(i)

    loader = DataLoader(Bad(), batch_size=4, num_workers=2)
    with pytest.raises(KeyError, match="boom at 13"):
        list(loader)
    X, y = make_data(50)
    loader = DataLoader(ArrayDataset(X, y), batch_size=5, num_workers=2, prefetch=4)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert len(list(loader)) == 10  # a fresh epoch works after an abandoned one


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), r"batch_size must be >= 1, got 0"),
    (dict(batch_size=-3), r"batch_size must be >= 1, got -3"),
    (dict(batch_size=2.5), r"batch_size must be an integer, got 2.5"),
    (dict(batch_size=2, last_batch="drop"), r"last_batch must be one of .*'rollover'.*got 'drop'"),
    (dict(batch_size=2, num_workers=-1), r"num_workers must be >= 0, got -1"),
    (dict(batch_size=2, num_shards=0), r"num_shards must be >= 1, got 0"),
    (dict(batch_size=2, num_shards=2, shard_index=2), r"shard_index must be in \[0, 1\], got 2"),
    (dict(batch_size=2, shard_index=-1), r"shard_index must be in \[0, 0\], got -1"),
    (dict(batch_size=2, num_workers=2, prefetch=0), r"prefetch must be >= 1, got 0"),
    (dict(batch_size=2, prefetch=-1), r"prefetch must be >= 0, got -1"),
    (dict(batch_size=2, seed=-5), r"seed must be >= 0, got -5"),
    (dict(batch_size=2, shuffle="yes"), r"shuffle must be a bool"),
])
def test_bad_arguments(kwargs, match):
    X, y = make_data(10)
    with pytest.raises(ValueError, match=match):
        DataLoader(ArrayDataset(X, y), **kwargs)


def test_bad_dataset_and_batchify():
    with pytest.raises(TypeError, match="dataset"):
        DataLoader(5, batch_size=2)
    with pytest.raises(TypeError, match="batchify_fn"):
        DataLoader(ArrayDataset(np.zeros(3)), batch_size=2, batchify_fn=3)


def test_loader_calls_an_overridden_getitem_and_per_sample_transforms():
    from hybridl.data import ArrayDataset, DataLoader
    from hybridl.data.transforms import Transform

    class Flipped(ArrayDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return -x, y + 100
    ds = Flipped(np.ones((4, 2), np.float32), np.arange(4))
    x, y = next(iter(DataLoader(ds, batch_size=4)))
    np.testing.assert_array_equal(x.asnumpy(), -np.ones((4, 2)))
    np.testing.assert_array_equal(y.asnumpy(), [100, 101, 102, 103])

    class PerImageMax(Transform):          # batchable is not promised: applied per sample
        def __call__(self, x):
            return np.asarray(x, np.float32) / np.float32(np.max(x))
    imgs = np.array([[10.0] * 4, [200.0] * 4, [50.0] * 4], np.float32)
    t = ArrayDataset(imgs, np.arange(3)).transform_first(PerImageMax())
    (b, _), = list(DataLoader(t, batch_size=3))
    np.testing.assert_array_equal(b.asnumpy(), np.ones((3, 4)))


def test_unshuffled_loader_leaves_the_global_rng_alone_and_keeps_the_device():
    import hybridl as hl
    from hybridl.data import ArrayDataset, DataLoader
    ws = []
    for make_loader in (False, True):
        hl.random.seed(0)
        if make_loader:
            DataLoader(ArrayDataset(np.zeros((8, 2), np.float32)), batch_size=4)
        net = hl.nn.Dense(3, in_units=2)
        net.initialize(hl.init.Xavier())
        ws.append(net.weight.data().asnumpy())
    np.testing.assert_array_equal(ws[0], ws[1])
    ld = DataLoader(ArrayDataset(np.ones((4, 2), np.float32)), batch_size=2, device="cpu:1",
                    batchify_fn=lambda s: hl.nd.array(np.stack(s)))
    assert all(b[0].device == hl.cpu(1) for b in ld)


def test_normalize_and_tofloat_refuse_values_that_give_nan_or_inf():
    for mean, std in ((0.0, float("nan")), (0.0, float("inf")), (float("nan"), 1.0), (0.0, 1e-45)):
        with pytest.raises(ValueError, match="Normalize"):
            Normalize(mean, std)
    with pytest.raises(ValueError, match="1-D"):
        Normalize([[0.0, 0.0], [0.0, 0.0]], 1.0)
    with pytest.raises(ValueError, match="Normalize: mean and std must be numbers"):
        Normalize(0.0, "a")
    from hybridl.data.transforms import ToFloat
    for bad in (float("nan"), "x"):
        with pytest.raises(ValueError, match="ToFloat: scale"):
            ToFloat(bad)


def test_subclass_of_a_batchable_transform_that_redefines_call_is_per_sample():
    from hybridl.data.transforms import ToFloat

    class PerImageCentre(ToFloat):
        def __call__(self, x):
            x = super().__call__(x)
            return x - x.mean()
    assert ToFloat.batchable and not PerImageCentre.batchable
    imgs = np.array([[10.0] * 4, [200.0] * 4], np.float32)
    (b, _), = list(DataLoader(ArrayDataset(imgs, np.arange(2)).transform_first(
        PerImageCentre(1.0)), batch_size=2))
    np.testing.assert_array_equal(b.asnumpy(), np.zeros((2, 4)))


def test_loader_arguments_are_checked_at_construction(monkeypatch):
    """device='gpu:1' failed only at the first batch, deep inside; num_shards larger than the
    dataset gave every shard nothing, silently; HYBRIDL_NUM_WORKERS set the engine's worker
    threads AND the loaders' threads (0, a valid loader value, broke import hybridl): the
    loaders read HYBRIDL_LOADER_WORKERS."""
    with pytest.raises(ValueError, match="DataLoader: device: expected a string like 'cpu:0'"):
        DataLoader(np.arange(5), 2, device="gpu:1")
    with pytest.raises(ValueError, match="num_shards must be at most the dataset's 10 samples"):
        DataLoader(np.arange(10), 2, num_shards=11, shard_index=0)
    monkeypatch.setenv("HYBRIDL_NUM_WORKERS", "3")
    monkeypatch.setenv("HYBRIDL_LOADER_WORKERS", "2")
    assert DataLoader(np.arange(10), 2, num_workers=None).num_workers == 2
    monkeypatch.setenv("HYBRIDL_LOADER_WORKERS", "-1")
    with pytest.raises(ValueError, match=r"HYBRIDL_LOADER_WORKERS='-1': expected an integer >= 0"):
        DataLoader(np.arange(10), 2, num_workers=None)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_sample_says_which_one_and_non_numbers_are_named(workers):
    class Flaky(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i == 4:
                raise KeyError("boom")
            return np.float32(i)
    with pytest.raises(KeyError, match="boom") as ei:
        list(DataLoader(Flaky(), 2, num_workers=workers))
    if hasattr(ei.value, "__notes__"):                      # Python 3.11+
        assert "loading sample 4 of the dataset" in ei.value.__notes__[0]
    with pytest.raises(TypeError, match=r"DataLoader: a batch field holds ndarray of dtype <U1, "
                                        r"expected numbers"):
        list(DataLoader(SimpleDataset(["a", "b"]), 2, num_workers=workers))



def test_a_kept_unfinished_iterator_does_not_delay_the_exit():
    """``it = iter(loader); next(it)`` as a script's last use: the iterator's clean-up never
    ran, so at exit its workers went on loading the batches in flight (a whole batch of slow
    samples more). The exit hook now stops them between samples, before they are joined."""
    from hybridl.data import dataloader
    gate, loaded = threading.Event(), []

    class Gated(Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i >= 10:             # the batches after the first wait here
                gate.wait(10)
            loaded.append(i)
            return np.float32(i), np.int64(i)
    it = iter(DataLoader(Gated(), 10, num_workers=1, prefetch=2))
    next(it)
    time.sleep(0.2)                 # the worker is inside the second batch's first sample
    dataloader._stop_all_at_exit()  # what the interpreter's exit runs first
    gate.set()
    time.sleep(0.5)
    assert len(loaded) == 11        # the first batch and the sample under way, no more
    it.close()


def test_a_loader_iterated_in_a_thread_that_outlives_the_main_thread(tmp_path):
    """The exit hook (run when the main thread ends) stopped the workers of a loader still
    iterated by another, non-daemon thread, which then got None batches (TypeError), or the
    executor refused new work after shutdown (RuntimeError). The rest now loads in that
    thread: every sample, in order."""
    script = tmp_path / "bg.py"
    script.write_text(
        "import threading, time\n"
        "import numpy as np\n"
        "from hybridl.data import DataLoader, Dataset\n"
        "class Slow(Dataset):\n"
        "    def __len__(self): return 60\n"
        "    def __getitem__(self, i):\n"
        "        time.sleep(0.002)\n"
        "        return np.float32(i)\n"
        "def train():\n"
        "    seen = []\n"
        "    for ep in range(3):\n"
        "        for (x,) in DataLoader(Slow(), 4, num_workers=2):\n"
        "            seen += x.asnumpy().tolist()\n"
        "    print('samples', len(seen), seen == list(range(60)) * 3)\n"
        "threading.Thread(target=train).start()   # the main thread returns at once\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "samples 180 True"


def test_the_first_batch_does_not_wait_for_a_list_of_the_whole_epoch():
    """iter(loader) built every batch's index array first: 10^6 samples in batches of 1 took
    ~170 MB before the first batch. Now only the epoch's index array (8 MB) is made."""
    import tracemalloc

    class Virtual(Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            return np.float32(i)
    loader = DataLoader(Virtual(), 1, shuffle=True, seed=0)
    tracemalloc.start()
    it = iter(loader)
    (first,) = next(it)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 * 2 ** 20, peak
    assert first.asnumpy()[0] == loader.epoch_indices(0)[0]    # the shuffled order's first
    it.close()
