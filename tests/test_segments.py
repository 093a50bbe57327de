"""Parallel segments of compiled programs: same results as one program and as the naive
engine, and the segments really are separate engine ops."""
import numpy as np
import pytest

import hybridl as hl
from hybridl.graph.segments import partition


def _net_and_input(seed=0):
    hl.random.seed(seed)
    net = hl.models.inception_net(10, width=8)
    net.initialize()
    x = hl.nd.array(np.random.default_rng(seed).random((4, 3, 16, 16), dtype=np.float32))
    net(x).wait_to_read()
    return net, x


@pytest.fixture
def two_workers():
    eng = hl.engine.ThreadedEngine(num_workers=2)
    with hl.engine.set_engine(eng):
        yield eng


def test_partition_gives_one_segment_per_branch():
    net, x = _net_and_input()
    net.hybridize(parallel_segments=True)
    with hl.autograd.predict_mode():
        net(x).wait_to_read()
    prog = net._last_program.fwd
    # stem chain + 2 inception blocks x (4 branches + concat/tail) = 11 segments
    assert len(prog.segments) == 11
    sizes = [len(s) for s in partition(prog.graph)]
    assert sum(sizes) == len(prog.graph.op_nodes())


def test_segments_equal_one_program_and_naive(two_workers):
    net, x = _net_and_input()
    with hl.autograd.predict_mode():
        eager = net(x).asnumpy()
        net.hybridize()
        one = net(x).asnumpy()
        net.hybridize(parallel_segments=True)
        seg = net(x).asnumpy()
        seg2 = net(x).asnumpy()
    with hl.engine.set_engine("naive"):
        with hl.autograd.predict_mode():
            naive_seg = net(x).asnumpy()
    np.testing.assert_array_equal(one, seg)
    np.testing.assert_array_equal(seg, seg2)
    np.testing.assert_array_equal(seg, naive_seg)
    np.testing.assert_allclose(eager, one, rtol=1e-5, atol=1e-6)


def test_segments_are_separate_engine_ops(two_workers):
    net, x = _net_and_input()
    net.hybridize(parallel_segments=True)
    with hl.autograd.predict_mode():
        net(x).wait_to_read()
        with hl.profiler.profile() as prof:
            net(x).wait_to_read()
    names = [e.name for e in prof.events if e.name.startswith("InceptionNet") or ".seg" in e.name]
    assert len(names) == len(net._last_program.fwd.segments)


def test_training_falls_back_to_one_program():
    net, x = _net_and_input()
    net.hybridize(parallel_segments=True)
    for p in net.collect_params().values():
        if p.grad_req != "null":
            p.data().attach_grad()
    with hl.autograd.record():
        y = net(x).sum()
    y.backward()
    assert net._last_program.fwd.op is not None          # one program, with a gradient rule


def test_rank_priorities_are_longest_remaining_paths():
    from types import SimpleNamespace as NS

    from hybridl.graph.segments import _rank_priorities
    # a -> (b, c) -> d : a reads input "x"; b and c read a's output; d reads both
    est = {"a": 1e-3, "b": 5e-3, "c": 2e-3, "d": 1e-3}
    reads = {"a": ["x"], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    segs = [(NS(est_seconds=est[k], op=NS(priority=0)), reads[k], [k]) for k in "abcd"]
    _rank_priorities(segs)
    prio = {k: s[0].op.priority for k, s in zip("abcd", segs)}
    assert prio == {"d": 1000, "b": 6000, "c": 3000, "a": 7000}


def test_priorities_follow_measured_segment_times(two_workers):
    net, x = _net_and_input()
    net.hybridize(parallel_segments=True)
    with hl.autograd.predict_mode():
        net(x).wait_to_read()
        prog = net._last_program.fwd
        assert not prog._measured
        for _ in range(3):
            net(x).wait_to_read()
    assert prog._measured
    segs = prog.segments
    times = [p.est_seconds for p, _, _ in segs]
    assert all(t is not None and t > 0 for t in times)
    # the stem is on every path: its priority is the largest, >= every other's plus its time
    prios = [p.op.priority for p, _, _ in segs]
    assert prios[0] == max(prios) and prios[0] >= int(1e6 * times[0]) + max(prios[1:]) - 1
