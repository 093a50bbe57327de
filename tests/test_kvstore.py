"""KVStore push/pull semantics ('local' and 'device') and the ring allreduce underneath."""
import numpy as np
import pytest

import hybridl as hl
from hybridl.parallel.allreduce import reduce_broadcast, ring_allreduce

KINDS = ["local", "device"]


def devs(k):
    return [hl.cpu(i) for i in range(k)]


def on(values, devices, dtype="float32"):
    return [hl.nd.array(np.asarray(v, dtype=dtype), device=d) for v, d in zip(values, devices)]


@pytest.mark.parametrize("kind", KINDS)
def test_push_sums_and_pull_writes_every_out(kind):
    kv = hl.kv.create(kind)
    rng = np.random.default_rng(0)
    kv.init(3, hl.nd.zeros((4, 5)))
    vals = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(3)]
    kv.push(3, on(vals, devs(3)))
    outs = [hl.nd.zeros((4, 5), device=d) for d in devs(4)]
    kv.pull(3, out=outs)
    for o, d in zip(outs, devs(4)):
        assert o.device == d
        np.testing.assert_allclose(o.asnumpy(), sum(vals), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_push_replaces_and_pull_after_push(kind):
    kv = hl.kv.create(kind)
    kv.init("w", hl.nd.ones((3,)) * 7)
    out = hl.nd.zeros((3,), device=hl.cpu(1))
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out.asnumpy(), [7, 7, 7])      # init value
    kv.push("w", hl.nd.ones((3,)) * 2)
    kv.push("w", on([[1, 2, 3], [10, 20, 30]], devs(2)))          # replaces, no accumulation
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out.asnumpy(), [11, 22, 33])


@pytest.mark.parametrize("kind", KINDS)
def test_keys_on_different_devices(kind):
    kv = hl.kv.create(kind)
    kv.init(["a", "b"], [hl.nd.zeros((2,), device=hl.cpu(0)), hl.nd.zeros((2,), device=hl.cpu(2))])
    kv.push("a", on([[1, 1], [2, 2]], [hl.cpu(0), hl.cpu(1)]))
    kv.push("b", on([[5, 6], [1, 1], [1, 1]], [hl.cpu(2), hl.cpu(3), hl.cpu(1)]))
    oa = [hl.nd.zeros((2,), device=hl.cpu(3))]
    ob = [hl.nd.zeros((2,), device=hl.cpu(0)), hl.nd.zeros((2,), device=hl.cpu(2))]
    kv.pull(["a", "b"], out=[oa, ob])
    np.testing.assert_array_equal(oa[0].asnumpy(), [3, 3])
    for o in ob:
        np.testing.assert_array_equal(o.asnumpy(), [7, 8])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_pushpull_in_place_is_allreduce(kind, k):
    kv = hl.kv.create(kind)
    rng = np.random.default_rng(k)
    vals = [rng.standard_normal((7, 3)) for _ in range(k)]           # 21 elements, k chunks
    arrs = on(vals, devs(k), "float64")
    kv.init(0, arrs[0])
    kv.pushpull(0, arrs, out=arrs, priority=-5)
    for a in arrs:
        np.testing.assert_allclose(a.asnumpy(), sum(vals), rtol=1e-12)
    out = hl.nd.zeros((7, 3), "float64", hl.cpu(0))
    kv.pull(0, out=out)                                               # the store has the sum too
    np.testing.assert_allclose(out.asnumpy(), sum(vals), rtol=1e-12)


def test_pushpull_reads_values_before_overwriting_them():
    kv = hl.kv.create("device")
    a = on([[1.0], [2.0]], devs(2))
    kv.init(1, a[0])
    kv.pushpull(1, a)                       # out defaults to the values (in place)
    kv.pushpull(1, a)
    assert [x.asnumpy()[0] for x in a] == [6.0, 6.0]


def test_several_values_on_one_device():
    kv = hl.kv.create("device")
    kv.init(0, hl.nd.zeros((2,)))
    kv.push(0, on([[1, 1], [2, 2], [4, 4]], [hl.cpu(0), hl.cpu(0), hl.cpu(1)]))
    o = hl.nd.zeros((2,), device=hl.cpu(1))
    kv.pull(0, out=o)
    np.testing.assert_array_equal(o.asnumpy(), [7, 7])


def test_local_store_lives_on_cpu0_and_init_list_uses_first():
    kv = hl.kv.create("local")
    kv.init(5, on([[1, 2], [9, 9]], [hl.cpu(2), hl.cpu(3)]))
    (dev, arr), = kv._store[5].items()
    assert dev == hl.cpu(0)
    np.testing.assert_array_equal(arr.asnumpy(), [1, 2])


def test_set_updater():
    kv = hl.kv.create("device")
    kv.init(0, hl.nd.ones((2,)))
    seen = []

    def upd(key, merged, stored):
        seen.append(key)
        stored += merged * 0.5

    kv.set_updater(upd)
    kv.push(0, on([[2, 2], [4, 4]], devs(2)))
    o = hl.nd.zeros((2,))
    kv.pull(0, out=o)
    np.testing.assert_array_equal(o.asnumpy(), [4, 4])
    assert seen == [0]


def test_errors():
    with pytest.raises(ValueError, match="local"):
        hl.kv.create("bogus")
    kv = hl.kv.create("device")
    with pytest.raises(KeyError, match="not been initialized"):
        kv.push(1, hl.nd.zeros((2,)))
    kv.init(1, hl.nd.zeros((2,)))
    with pytest.raises(ValueError, match="already initialized"):
        kv.init(1, hl.nd.zeros((2,)))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        kv.push(1, hl.nd.zeros((3,)))
    with pytest.raises(ValueError, match="out"):
        kv.pull(1)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        kv.pull(1, out=hl.nd.zeros((4,)))
    with pytest.raises(TypeError, match="NDArray"):
        kv.push(1, np.zeros(2))


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_ring_allreduce_any_size_and_out(size):
    rng = np.random.default_rng(size)
    k = 3
    vals = [rng.standard_normal(size).astype(np.float32) for _ in range(k)]
    arrs = on(vals, devs(k))
    outs = [hl.nd.zeros((size,), device=d) for d in devs(k)]
    ring_allreduce(arrs, outs, priority=3)
    for a, o, v in zip(arrs, outs, vals):
        np.testing.assert_array_equal(a.asnumpy(), v)          # inputs untouched
        np.testing.assert_allclose(o.asnumpy(), sum(vals), rtol=1e-5, atol=1e-6)
    outs2 = [hl.nd.zeros((size,), device=d) for d in devs(2)]
    reduce_broadcast(arrs, outs2)
    for o in outs2:
        np.testing.assert_allclose(o.asnumpy(), sum(vals), rtol=1e-5, atol=1e-6)


def test_ring_ops_are_engine_ops_on_receiver_copy_queues():
    """2 k (k-1) step ops + k loads + k stores, each on the copy queue of a ring device."""
    events = []

    class Rec:
        def record(self, name, key, thread, t0, t1, meta):
            events.append((name, key))

    eng = hl.engine.get_engine()
    hl.waitall()
    prev, eng.profiler = eng.profiler, Rec()
    try:
        k = 3
        arrs = on([np.ones(9)] * k, devs(k))
        ring_allreduce(arrs)
        hl.waitall()
    finally:
        eng.profiler = prev
    names = [n for n, _ in events if n.startswith("allreduce")]
    assert names.count("allreduce.reduce_scatter") == k * (k - 1)
    assert names.count("allreduce.all_gather") == k * (k - 1)
    assert all(key[0] == "copy" for n, key in events if n.startswith("allreduce"))
    np.testing.assert_array_equal(arrs[1].asnumpy(), np.full(9, 3.0))
