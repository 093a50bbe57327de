"""Tests of the dependency engine (hybridl.engine): sequential semantics of the threaded engine
against the naive one on random programs (hypothesis), read/write ordering, concurrency of
readers, error passing, clean interpreter exit, several frontend threads, bulking, engine
switching and priorities.

Engine-level tests run on their own ``ThreadedEngine`` instances so the global engine is not
disturbed; NDArray-level tests use the global engine. Timing is only ever compared between
events recorded inside ops (never wall-clock totals), except for the generous bound on how
long a process takes to exit.
"""
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridl as hl
from hybridl.engine import NaiveEngine, OpError, ThreadedEngine, Var

DEVS = [hl.cpu(i) for i in range(3)]
MOD = 2 ** 61 - 1


@pytest.fixture
def eng():
    e = ThreadedEngine()
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def _clean_global_engine():
    """Each test starts and ends with the default threaded engine and no pending error."""
    with contextlib.suppress(OpError):
        hl.waitall()
    assert isinstance(hl.engine.get_engine(), ThreadedEngine)
    yield
    with contextlib.suppress(OpError):
        hl.waitall()
    assert isinstance(hl.engine.get_engine(), ThreadedEngine)


# ============================================================================ property test

@st.composite
def programs(draw):
    """A random program: Vars, ops (reads, writes, device, delay, priority, failure) and
    sync points (``wait_for`` of a Var in the middle of the program)."""
    nv = draw(st.integers(2, 5))
    var = st.integers(0, nv - 1)
    steps = draw(st.lists(st.one_of(
        st.tuples(st.just("op"),
                  st.lists(var, max_size=3),                       # reads (duplicates allowed)
                  st.lists(var, max_size=3),                       # writes (duplicates allowed)
                  st.integers(0, 2),                               # device cpu(i)
                  st.sampled_from([0.0, 0.0, 0.0002, 0.0005, 0.001]),   # delay (s)
                  st.integers(-2, 2),                              # priority
                  st.integers(0, 11).map(lambda i: i == 0),        # fails (1 in 12)
                  st.sampled_from([False, True, "key"])),          # pure (may run inline)
        st.tuples(st.just("sync"), var)),
        min_size=1, max_size=25))
    return {"nv": nv, "steps": steps,
            "num_workers": draw(st.integers(1, 2)),
            "inline_s": draw(st.sampled_from([0.0, 50e-6, 2e-3])),
            "bulk": draw(st.sampled_from([None, None, 1, 3, 8]))}


def _make_fn(k, reads, writes, delay, fails, state, log):
    def fn():
        vals = tuple(state[r] for r in reads)          # read at the start...
        log[k] = vals
        if delay:
            time.sleep(delay)                          # ... write at the end: races show up
        if fails:
            raise ValueError(f"op{k} failed on purpose")
        for j, w in enumerate(writes):
            state[w] = (k * 1_000_003 + 31 * j
                        + sum((i + 7) * v for i, v in enumerate(vals))) % MOD
    fn.__name__ = f"op{k}"
    return fn


def _run_program(engine, prog):
    """Run ``prog`` on ``engine``; return (final state, read log, per-Var error op name, sync
    values, number of errors raised at push/waitall)."""
    nv = prog["nv"]
    state = {i: 1000 + i for i in range(nv)}
    log, syncs = {}, []
    vs = [Var(f"v{i}") for i in range(nv)]
    raised = 0
    bulk = engine.bulk(prog["bulk"]) if prog["bulk"] else contextlib.nullcontext()
    with bulk:
        for k, step in enumerate(prog["steps"]):
            if step[0] == "sync":
                try:
                    engine.wait_for(vs[step[1]])
                    syncs.append((k, state[step[1]]))
                except OpError as e:
                    syncs.append((k, "error", e.op_name))
                continue
            _, reads, writes, dev, delay, prio, fails, pure = step
            fn = _make_fn(k, reads, writes, delay, fails, state, log)
            try:
                engine.push(fn, [vs[r] for r in reads], [vs[w] for w in writes], DEVS[dev],
                            priority=prio, name=f"op{k}", pure=(delay, dev) if pure == "key"
                            else pure)
            except OpError:
                raised += 1                        # NaiveEngine: raised at the push
    try:
        engine.waitall()
    except OpError:
        raised += 1
    errs = []
    for v in vs:
        try:
            engine.wait_for(v)
            errs.append(None)
        except OpError as e:
            errs.append(e.op_name)
    return dict(state), dict(log), errs, syncs, raised


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_threaded_engine_matches_naive(prog):
    expected = _run_program(NaiveEngine(), prog)
    e = ThreadedEngine(num_workers=prog["num_workers"], inline_s=prog["inline_s"])
    try:
        _run_program(e, prog)                      # learns run times: later runs inline some
        got = _run_program(e, prog)
        assert e._pending == 0
    finally:
        e.shutdown()
    state, log, errs, syncs, raised = got
    assert state == expected[0]
    assert log == expected[1]                     # every op read exactly what it should
    assert errs == expected[2]
    assert syncs == expected[3]
    # the threaded engine raises at waitall() iff some op failed (the naive one at each push)
    assert (raised > 0) == (expected[4] > 0)


# ============================================================================ ordering

def _stamp(events, key):
    events[key] = time.perf_counter()


def test_read_after_write(eng):
    v, out = Var("v"), Var("out")
    state, ev = {"v": 0, "out": None}, {}

    def writer():
        _stamp(ev, "w0")
        time.sleep(0.05)
        state["v"] = 42
        _stamp(ev, "w1")

    def reader():
        _stamp(ev, "r0")
        state["out"] = state["v"] + 1

    eng.push(writer, [], [v], DEVS[0])
    eng.push(reader, [v], [out], DEVS[1])          # another device: only the dependency orders
    eng.wait_for(out)
    assert state["out"] == 43
    assert ev["r0"] >= ev["w1"]


def test_write_after_read(eng):
    v, out = Var("v"), Var("out")
    state, ev = {"v": 7, "out": None}, {}

    def reader():
        _stamp(ev, "r0")
        a = state["v"]
        time.sleep(0.05)
        state["out"] = (a, state["v"])              # value at start and at end of the read
        _stamp(ev, "r1")

    def writer():
        _stamp(ev, "w0")
        state["v"] = 99

    eng.push(reader, [v], [out], DEVS[0])
    eng.push(writer, [], [v], DEVS[1])
    eng.waitall()
    assert state["out"] == (7, 7)
    assert state["v"] == 99
    assert ev["w0"] >= ev["r1"]


def test_write_after_write(eng):
    v = Var("v")
    state, ev = {"v": 0}, {}

    def first():
        _stamp(ev, "a0")
        time.sleep(0.05)
        state["v"] = 1
        _stamp(ev, "a1")

    def second():
        _stamp(ev, "b0")
        state["v"] = 2

    eng.push(first, [], [v], DEVS[0])
    eng.push(second, [], [v], DEVS[1])
    eng.wait_for(v)
    assert state["v"] == 2
    assert ev["b0"] >= ev["a1"]


def test_concurrent_readers_overlap(eng):
    v, o1, o2 = Var("v"), Var("o1"), Var("o2")
    state = {"v": 0}
    ev = {}
    both = threading.Barrier(2, timeout=10)        # passes only if the readers run together

    def write():
        state["v"] = 5

    def make_reader(tag):
        def read():
            _stamp(ev, tag + "0")
            both.wait()
            time.sleep(0.05)
            state[tag] = state["v"] * 2
            _stamp(ev, tag + "1")
        return read

    eng.push(write, [], [v], DEVS[0])
    eng.push(make_reader("a"), [v], [o1], DEVS[1])
    eng.push(make_reader("b"), [v], [o2], DEVS[2])
    eng.waitall()                                   # a broken barrier would raise OpError here
    assert state["a"] == state["b"] == 10
    assert max(ev["a0"], ev["b0"]) < min(ev["a1"], ev["b1"])    # the intervals overlap


def test_op_waiting_inside_worker_is_an_error(eng):
    v, w = Var("v"), Var("w")
    gate = threading.Event()
    eng.push(lambda: gate.wait(10), [], [v], DEVS[1])          # v stays pending
    eng.push(lambda: eng.wait_for(v), [], [w], DEVS[0], name="waits_inside")
    with pytest.raises(OpError) as ei:
        eng.wait_for(w)
    gate.set()
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert "deadlock" in str(ei.value)
    with pytest.raises(OpError):
        eng.waitall()


# ============================================================================ errors

def _failing_op():
    raise ZeroDivisionError("denominator is zero in the failing op")


def test_error_stored_passed_on_and_raised(eng):
    a, b, c = Var("a"), Var("b"), Var("c")
    state = {"a": 1, "b": 0, "c": 0}
    ran = []
    eng.push(_failing_op, [], [a], DEVS[0], name="my_failing_op")

    def consumer():
        ran.append("consumer")
        state["b"] = state["a"] + 1

    eng.push(consumer, [a], [b], DEVS[1], name="consumer")

    with pytest.raises(OpError) as ei:
        eng.wait_for(a)
    err = ei.value
    assert err.op_name == "my_failing_op"
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert err.original is err.__cause__
    msg = str(err)
    assert "'my_failing_op'" in msg
    assert "denominator is zero in the failing op" in msg
    assert "Traceback" in msg and "_failing_op" in msg and "test_engine.py" in msg

    with pytest.raises(OpError) as ei2:             # the reader did not run, passed it on
        eng.wait_for(b)
    assert ei2.value is err
    assert ran == [] and state["b"] == 0

    with pytest.raises(OpError) as ei3:
        eng.waitall()
    assert ei3.value is err
    eng.waitall()                                   # raised once: the next waitall is clean

    # the engine works afterwards: a new write of `a` clears its error
    def rewrite():
        state["a"] = 10

    eng.push(rewrite, [], [a], DEVS[0])
    eng.push(consumer, [a], [b], DEVS[1])

    def to_c():
        state["c"] = state["b"] * 3

    eng.push(to_c, [b], [c], DEVS[2])
    eng.wait_for(c)
    assert state == {"a": 10, "b": 11, "c": 33}
    assert ran == ["consumer"]
    eng.waitall()


@pytest.mark.parametrize("make", [ThreadedEngine, NaiveEngine])
def test_user_meta_with_a_bulk_key_keeps_error_handling(make):
    """``meta`` is the caller's profiler figures: even ``{"bulk": True}`` must not make the
    engine treat a plain op as its own bulk group (which skips error passing)."""
    e = make()
    a, b = Var("a"), Var("b")
    ran = []
    try:
        try:
            e.push(_failing_op, [], [a], DEVS[0], name="failing", meta={"bulk": True})
        except OpError:                  # the NaiveEngine raises at the push
            pass
        e.push(lambda: ran.append(1), [a], [b], DEVS[0], name="reader", meta={"bulk": True})
        with pytest.raises(OpError) as ei:
            e.wait_for(b)
        assert ei.value.op_name == "failing" and ran == []
        with contextlib.suppress(OpError):
            e.waitall()
    finally:
        e.shutdown() if hasattr(e, "shutdown") else None


def test_naive_engine_raises_at_push():
    e = NaiveEngine()
    a, b = Var("a"), Var("b")
    with pytest.raises(OpError) as ei:
        e.push(_failing_op, [], [a], name="my_failing_op")
    assert ei.value.op_name == "my_failing_op"
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    ran = []
    e.push(lambda: ran.append(1), [a], [b], name="consumer")     # skipped, passes it on
    assert ran == []
    with pytest.raises(OpError) as ei2:
        e.wait_for(b)
    assert ei2.value is ei.value
    e.waitall()                                      # already raised at the push
    e.push(lambda: ran.append(2), [], [a])
    e.wait_for(a)
    assert ran == [2]


def test_ndarray_take_error_at_sync_points_and_waitall():
    x = hl.nd.array(np.arange(5.0))
    bad = hl.nd.array(np.array([1, 7]))
    y = hl.nd.take(x, bad, mode="raise")             # shape is fine: no error at the call
    z = y * 2.0 + 1.0
    with pytest.raises(hl.OpError) as ei:
        z.wait_to_read()
    assert ei.value.op_name == "take"
    assert isinstance(ei.value.__cause__, IndexError)
    assert "index out of range" in str(ei.value)
    with pytest.raises(hl.OpError):
        z.asnumpy()
    with pytest.raises(hl.OpError):
        y.asnumpy()
    with pytest.raises(hl.OpError) as ei2:
        hl.waitall()
    assert ei2.value is ei.value
    hl.waitall()
    # afterwards new arrays compute fine, also from the same inputs
    good = hl.nd.take(x, hl.nd.array(np.array([4, 0])), mode="raise")
    np.testing.assert_array_equal((good * 2.0 + 1.0).asnumpy(), [9.0, 1.0])
    np.testing.assert_array_equal((x + 1.0).asnumpy(), np.arange(5.0) + 1)
    hl.waitall()


def test_ndarray_error_only_at_waitall():
    x = hl.nd.array(np.arange(3.0))
    hl.nd.take(x, hl.nd.array(np.array([-9])), mode="raise")     # never read
    with pytest.raises(hl.OpError) as ei:
        hl.waitall()
    assert isinstance(ei.value.__cause__, IndexError)


def test_naive_engine_ndarray_error_at_the_line():
    prev = hl.engine.get_engine()
    x = hl.nd.array(np.arange(5.0))
    with hl.engine.set_engine("naive") as e:
        assert isinstance(e, NaiveEngine) and hl.engine.get_engine() is e
        with pytest.raises(hl.OpError) as ei:
            hl.nd.take(x, hl.nd.array(np.array([9])), mode="raise")
        assert isinstance(ei.value.__cause__, IndexError)
        np.testing.assert_array_equal((x * 3.0).asnumpy(), np.arange(5.0) * 3)
    assert hl.engine.get_engine() is prev


# ============================================================================ process exit

def test_exit_with_pending_work_is_clean():
    code = textwrap.dedent("""
        import os, hybridl as hl
        x = hl.nd.ones((1500, 1500), dtype="float64")
        y = x
        for _ in range(50):
            y = hl.nd.dot(x, y) * 1e-3
            # one byte per finished matmul, written with os.write (no buffered-stdout lock
            # shared with the exiting main thread)
            hl.engine.push(lambda: os.write(1, b"."), [y._var], [], y.device, name="mark")
        os.write(1, b"pushed\\n")
    """)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                       env={**os.environ, "HYBRIDL_ENGINE": "threaded"})
    elapsed = time.perf_counter() - t0
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "pushed" in out
    assert "Fatal Python error" not in r.stderr.decode()
    # exit finishes what it can in a short grace period and cancels the rest, saying so
    done = out.count(".")
    assert done == 50 or "had not run when the program ended and were cancelled" in \
        r.stderr.decode(), (done, r.stderr.decode())
    assert elapsed < 20.0


def test_exit_reports_unwaited_errors_and_cancelled_ops():
    """Ops pending at exit were cancelled, and the error of an op nobody waited for was lost,
    without a word (exit code 0). Exit still cancels (see the test above), but says so."""
    code = textwrap.dedent("""
        import time, hybridl as hl
        from hybridl.engine import Var
        v = Var()
        def fails():
            raise RuntimeError("nobody waited for me")
        hl.engine.push(fails, [], [Var()], hl.cpu(1))
        time.sleep(0.5)                              # it has run (and failed)
        hl.engine.push(lambda: time.sleep(4.0), [], [v], hl.cpu(0))     # past the grace
        for _ in range(3):
            hl.engine.push(lambda: None, [v], [Var()], hl.cpu(0))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HYBRIDL_ENGINE": "threaded"})
    assert r.returncode == 0, r.stderr
    assert "an op failed and nothing waited for its result" in r.stderr
    assert "nobody waited for me" in r.stderr
    import re
    m = re.search(r"(\d+) pushed op\(s\) had not run when the program ended and were cancelled",
                  r.stderr)
    assert m and int(m.group(1)) >= 3, r.stderr      # (the sleeper too, if it had not started)


# ============================================================================ frontend threads

def test_four_frontend_threads():
    rng = np.random.default_rng(0)
    shared_np = rng.integers(-3, 4, size=(16, 16)).astype(np.float64)
    shared = hl.nd.array(shared_np)
    acc = hl.nd.zeros((16, 16), dtype="float64")
    acc_lock = threading.Lock()      # `acc += r` reads then writes acc's handle in the frontend
    results, errors = {}, []

    def work(t):
        try:
            dev = hl.cpu(t % 3)
            p_np = rng_t = np.random.default_rng(t).integers(-2, 3, size=(16, 16)).astype(np.float64)
            p = hl.nd.array(p_np, device=dev)
            s = shared.copyto(dev)
            ref = p_np.copy()
            for i in range(30):
                p = hl.nd.relu(p @ s * 0.5 + float(i)) - s
                ref = np.maximum(ref @ shared_np * 0.5 + float(i), 0) - shared_np
                p = p / (hl.nd.abs(p).max() + 1.0)
                ref = ref / (np.abs(ref).max() + 1.0)
            priv = hl.nd.zeros((16, 16), dtype="float64", device=dev)
            for i in range(20):
                priv += s * float(t + i)
            ones = hl.nd.ones((16, 16), dtype="float64")
            with acc_lock:
                acc[...] = acc + ones * float(t + 1)
            results[t] = (p.asnumpy(), ref, priv.asnumpy(), rng_t)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    for t in range(4):
        got, ref, priv, _ = results[t]
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(priv, shared_np * sum(t + i for i in range(20)))
    np.testing.assert_array_equal(acc.asnumpy(), np.full((16, 16), 1.0 + 2 + 3 + 4))
    np.testing.assert_array_equal(shared.asnumpy(), shared_np)     # never written


def test_four_threads_on_one_engine_instance(eng):
    state = {i: 0 for i in range(4)}
    shared = Var("shared")
    shared_val = {"v": 3}
    vs = [Var(f"p{i}") for i in range(4)]

    def work(t):
        for i in range(200):
            def step(t=t, i=i):
                state[t] = (state[t] * shared_val["v"] + i) % 1_000_003
            eng.push(step, [shared], [vs[t]], DEVS[t % 3])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    eng.waitall()
    ref = 0
    for i in range(200):
        ref = (ref * 3 + i) % 1_000_003
    assert state == {i: ref for i in range(4)}


# ============================================================================ inline execution

def test_tiny_pure_ops_run_inline_big_ones_on_the_worker():
    # "inline" = run by push itself, before it returns; an op that is not run inline runs on
    # the worker, or in a thread that waits for it (wait_for / waitall help instead of sleeping)
    e = ThreadedEngine(inline_s=1e-3)
    try:
        v, big = Var("v"), Var("big")
        where = []
        state = {"v": 0, "in_push": False}

        def tiny():
            where.append((threading.current_thread().name, state["in_push"]))
            state["v"] += 1

        def slow():
            where.append((threading.current_thread().name, state["in_push"]))
            time.sleep(0.02)                        # a slow, non-CPU op: never inline
            while time.thread_time() - t0 < 0.005:  # ... and 5 ms of CPU
                pass

        def push(*a, **k):
            state["in_push"] = True
            try:
                e.push(*a, **k)
            finally:
                state["in_push"] = False

        me = threading.current_thread().name
        t0 = time.thread_time()
        push(tiny, [v], [v], DEVS[0], name="tiny", pure=True)      # unknown cost: not inline
        e.waitall()
        assert where[0] != (me, True)
        for _ in range(5):
            push(tiny, [v], [v], DEVS[0], name="tiny", pure=True)
            assert where[-1] == (me, True)                          # ran before push returned
        push(tiny, [v], [v], DEVS[0], name="tiny")                  # not pure: the worker
        e.waitall()
        assert state["v"] == 7
        assert where[-1][0].startswith("hybridl-")

        def slow_timed():
            nonlocal t0
            t0 = time.thread_time()
            slow()

        for _ in range(2):
            push(slow_timed, [], [big], DEVS[0], name="slow", pure=True)
            e.waitall()
            assert where[-1] != (me, True)                          # never inline
        # a tiny op pushed while the device is busy queues behind (and after) it
        gate = threading.Event()
        e.push(lambda: gate.wait(10), [], [Var()], DEVS[0])
        push(tiny, [v], [v], DEVS[0], name="tiny", pure=True)
        assert state["v"] == 7
        gate.set()
        e.wait_for(v)
        assert state["v"] == 8 and where[-1][1] is False
    finally:
        e.shutdown()


def test_inline_op_error_is_stored_not_raised():
    e = ThreadedEngine(inline_s=1.0)
    try:
        v, w = Var("v"), Var("w")
        flag = {"fail": False}

        def maybe_fail():
            if flag["fail"]:
                raise KeyError("inline failure")

        e.push(maybe_fail, [], [v], DEVS[0], name="maybe_fail", pure=True)
        e.waitall()
        flag["fail"] = True
        e.push(maybe_fail, [], [v], DEVS[0], name="maybe_fail", pure=True)    # inline, fails
        e.push(lambda: None, [v], [w], DEVS[0], name="after", pure=True)
        with pytest.raises(OpError) as ei:
            e.wait_for(w)
        assert ei.value.op_name == "maybe_fail" and isinstance(ei.value.__cause__, KeyError)
        with pytest.raises(OpError):
            e.waitall()
    finally:
        e.shutdown()


def _busy(seconds):
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


_WIDE_SCRIPT = textwrap.dedent("""
    import threading, time
    from hybridl.engine import ThreadedEngine, Var
    from hybridl.ops import _blas
    import hybridl as hl
    e = ThreadedEngine()
    me = threading.current_thread().name
    v = Var("v")
    log, in_push = [], [False]

    def op():
        _blas.for_gemm()                    # what a GEMM kernel calls first
        log.append(in_push[0] and threading.current_thread().name == me)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 3e-4:   # not tiny (inline_s is 100 us)
            pass

    def push_and_wait(dev, work):
        in_push[0] = True
        try:
            e.push(op, [v], [v], dev, name="gemm-op", pure=True)
        finally:
            in_push[0] = False
        if work:
            time.sleep(work)                # frontend time away from the engine
        else:                               # another push before the wait: not a
            e.push(lambda: None, [], [Var()], dev, name="other", pure=True)  # sync loop
        e.waitall()

    def phase(n, dev=hl.cpu(0), work=0):
        log.clear()
        for _ in range(n):
            push_and_wait(dev, work)
        print("".join("P" if f else "w" for f in log))

    phase(4)                                # one device, default budget: every core
    with hl.engine.blas_threads(1):         # a smaller pool: learned at the next timed run
        phase(12)
    phase(9)                                # back to every core
    phase(14, work=0.005)                   # 5 ms of frontend time after each push
    phase(20)                               # (weight 1/4 per push: ~13 pushes to go back)
    e.push(lambda: None, [], [Var()], ("comm", "mpi"), name="collective")   # a communication
    e.waitall()                             # queue's thread is no compute worker:
    phase(4)                                # still nothing beside the op
    e.push(lambda: None, [], [Var()], hl.cpu(1), name="start")   # a second device: the
    e.waitall()                             # budget halves, for every later push
    phase(4)
    print(_blas._CORES)
    e.shutdown()
""")


def _solo_phases(env=None):
    r = subprocess.run([sys.executable, "-c", _WIDE_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _check_solo_phases(phases):
    one, pinned, back, busy, again, comm, two, _ = phases
    assert one[1:] == "PPP"                 # (the first run, the lesson, ran anywhere)
    assert pinned[-3:] == "PPP"             # fewer BLAS threads: still nothing beside it
    assert back[-3:] == "PPP"
    assert busy[-4:] == "wwww"              # 5 ms of frontend work >> the op's 0.3 ms (the
    # average grows at most 1.75x per push: one time slice lost to the machine is no trend)
    assert again[-3:] == "PPP"              # the average comes back down
    assert comm[1:] == "PPP"                # an MPI communication thread: still one worker
    assert two == "wwww"                    # a second device's worker could run beside it


def test_with_one_compute_worker_ops_run_in_the_pusher_unless_the_frontend_keeps_working():
    """One device, one worker: a ready op runs in the pushing thread once its cost is known,
    unless the frontend usually keeps working for long after pushing it (moving average);
    after the first push to a second device, ops go to the workers again (not after one to
    the MPI communication queue: its thread runs no kernels). Another op is
    pushed before each wait (no synchronous loop): without the rule the worker, or the
    waiter, would run every one. In a fresh process: the budget depends on the devices the
    process has used."""
    _check_solo_phases(_solo_phases())


def test_a_one_thread_blas_pool_follows_the_same_rule():
    """OPENBLAS_NUM_THREADS=1 (the README's advice on a busy machine): the rule is about
    workers, not BLAS threads; frontend work after a push still gets the op overlapped
    (a 1-thread pool on 2 cores had made every GEMM op synchronous)."""
    _check_solo_phases(_solo_phases(dict(os.environ, OPENBLAS_NUM_THREADS="1")))


_WIDE_EAGER_SCRIPT = textwrap.dedent("""
    import time
    import numpy as np
    import hybridl as hl
    import hybridl.engine.threaded as T
    pushed = [0]
    orig = T.ThreadedEngine._push

    def counting(self, op):
        pushed[0] += op.name == "matmul"
        return orig(self, op)
    T.ThreadedEngine._push = counting
    r = np.random.default_rng(0)
    a = r.standard_normal((256, 784)).astype(np.float32)
    w = r.standard_normal((784, 784)).astype(np.float32) / 28
    A, W = hl.nd.array(a), hl.nd.array(w)
    ref = a.copy()

    def chain(n, work, pieces=1):
        global ref
        x, p0 = A, pushed[0]
        for _ in range(n):
            x = hl.nd.dot(x, W)             # 0.3 GFLOP: far from tiny
            for _ in range(pieces if work else 0):
                x.reshape((-1,))            # a tiny op on its result, run at once: not
                time.sleep(work / pieces)   # frontend work; then frontend time
        got = x.asnumpy()
        exp = a
        for _ in range(n):
            exp = exp @ w
        assert np.allclose(got, exp, rtol=1e-4, atol=1e-4), abs(got - exp).max()
        return pushed[0] - p0

    counts = [chain(4, 0) for _ in range(4)]          # back to back: run at once, no op
    busy = [chain(4, 0.04) for _ in range(4)]         # 40 ms of frontend time after each
    # (long: on a loaded machine OpenBLAS's threads spin while one of them waits for a core,
    # and the product's CPU time, the measure it is compared with, grows to 10-20 ms)
    print(counts[-1], busy[-1], len(__import__("os").sched_getaffinity(0)))
""")


def test_eager_ops_run_at_once_with_one_worker_unless_the_frontend_keeps_working():
    """Eager ops (not tiny), pushed back to back on one device, run in the calling thread
    without making an engine op (the engine's bookkeeping is the overhead left); once the
    program works for long after each (a tiny op on the result in between does not count),
    they are pushed to the worker again. Results equal NumPy's either way. In a fresh process
    (the budget depends on the devices used)."""
    r = subprocess.run([sys.executable, "-c", _WIDE_EAGER_SCRIPT], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    quick, busy, _ = map(int, r.stdout.split())
    assert quick == 0                       # 4 products, no op pushed
    assert busy == 4                        # each one pushed to the worker


def test_a_wait_inside_an_op_run_by_a_waiting_thread_raises_instead_of_hanging():
    """An op run in the frontend thread (taken by its wait, or inline) that itself waits
    gets the same clear error as on a worker; the engine goes on working."""
    e = ThreadedEngine()
    try:
        v = Var("v")
        box = {}

        def bad():
            e.waitall()                     # would wait for this very op

        def run():
            e.push(bad, [], [v], DEVS[0], name="bad", pure=True)
            try:
                e.wait_for(v)
            except OpError as err:
                box["err"] = err
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "hung"
        assert "inside a worker thread" in str(box["err"])
        with contextlib.suppress(OpError):
            e.waitall()
        w = Var("w")
        e.push(lambda: None, [], [w], DEVS[0], name="ok", pure=True)
        e.wait_for(w)
    finally:
        e.shutdown()


def test_blas_threads_holds_for_ops_pushed_inside_it_that_run_later():
    """``blas_threads(1)``: an op pushed inside the block runs on 1 BLAS thread even when
    the worker reaches it after the block (here it is busy with a long op first): the same
    bits as the naive engine, which runs it at its push."""
    r = np.random.default_rng(0)
    a = r.standard_normal((256, 784)).astype(np.float32)
    w = r.standard_normal((784, 256)).astype(np.float32)
    A, W = hl.nd.array(a), hl.nd.array(w)
    big = hl.nd.array(r.standard_normal((1500, 1500)).astype(np.float32))
    with hl.engine.set_engine("naive"):
        with hl.engine.blas_threads(1):
            ref = hl.nd.dot(A, W).asnumpy()
    for _ in range(5):
        hl.nd.exp(big)                      # keeps the worker busy
        with hl.engine.blas_threads(1):
            y = hl.nd.dot(A, W)
        assert np.array_equal(y.asnumpy(), ref)


def test_a_push_that_wakes_an_idle_worker_returns_once_it_took_the_op(monkeypatch):
    """The pusher hands the GIL to the worker it woke: when ``push`` returns, the worker has
    taken the op (it is running or done), rather than starting after the frontend's burst of
    Python code. Results and order are unchanged (the ops here count their own order)."""
    from hybridl.engine import threaded as T
    monkeypatch.setattr(T, "_HANDOFF_S", 30.0)   # a broken hand-over hangs, not passes late
    e = ThreadedEngine()
    try:
        v = Var("v")
        order = []

        def op(k):
            order.append(k)
            _busy(3e-4)                     # not tiny, no GEMM: a worker's op

        e.push(lambda: None, [], [Var()], DEVS[0], name="start")     # starts the worker
        for k in range(6):
            e.waitall()
            time.sleep(0.005)               # the worker is asleep again
            e.push(lambda k=k: op(k), [v], [v], DEVS[0], name="cpu-op", pure=True)
            q = e._queues[DEVS[0]]
            with e._lock:
                taken = not q.heap          # popped by the worker (busy or finished)
            assert taken, k
            _busy(1e-3)                     # frontend work while the op runs
        e.waitall()
        assert order == list(range(6))
        assert q.ack is None                # no hand-over left pending
    finally:
        e.shutdown()


def test_sync_loop_ops_run_in_the_pusher_until_the_program_overlaps_again():
    """An op waited for right after its push, before the worker woke up (here: the worker is
    never woken by pushes, so the waiter always finds it queued), twice in a row, runs in the
    pushing thread from then on, except every 16th push; pushing another op before waiting
    gives the key back to the worker at once. Results and order are the same either way."""
    from hybridl.engine import threaded as T
    e = ThreadedEngine(inline_s=1e-6)           # nothing here counts as tiny
    me = threading.current_thread().name
    try:
        v, other = Var("v"), Var("other")
        log = []

        def step():
            name = threading.current_thread().name
            log.append((name, in_push[0] and name == me))   # (a push waits for the worker
            t0 = time.thread_time()                         # to take an op it woke up for)
            while time.thread_time() - t0 < 2e-4:      # 0.2 ms of CPU: not tiny
                pass

        in_push = [False]

        def push(fn, name):
            in_push[0] = True
            try:
                e.push(fn, [v], [v], DEVS[0], name=name, pure=True)
            finally:
                in_push[0] = False

        push(step, "warm")                       # starts the worker, then idle
        e.waitall()
        q = e._queues[DEVS[0]]
        q.cond.notify = lambda n=1: None         # pushes never wake it: waiters take the ops
        log.clear()
        n = 3 + 2 * T._SYNC_PROBE
        for _ in range(n):
            push(step, "step")
            e.wait_for(v)
        ran_in_push = [p for _, p in log]
        assert all(t == me for t, _ in log)      # taken by the waiter, or run by push
        assert ran_in_push[:T._SYNC_STREAK] == [False] * T._SYNC_STREAK
        # after the streak, inline except every _SYNC_PROBE-th push (a probe, taken by the wait)
        assert ran_in_push.count(False) == T._SYNC_STREAK + (n - T._SYNC_STREAK) // T._SYNC_PROBE
        # the program starts overlapping: another op pushed before the wait (the worker is
        # woken again, as always outside this test)
        del q.cond.notify
        log.clear()
        for _ in range(2 * T._SYNC_PROBE):
            push(step, "step")
            e.push(lambda: None, [], [other], DEVS[0], name="other", pure=True)
            e.wait_for(v)
        # the first push ran in the pusher (the loop so far waited at once), but pushing
        # another op before the wait gave the key back to the worker, for good
        flags = [p for _, p in log]
        assert flags[0] is True and not any(flags[1:])
        e.waitall()
    finally:
        e.shutdown()


def test_eager_fast_path_error_is_stored_not_raised():
    """A tiny eager op whose inputs are ready runs in the pushing thread without making an op
    (Engine.run_ready); a failure there must behave exactly like a pushed op's: no raise at the
    call, raised at the sync points of dependents and by waitall(), the engine fine after."""
    e = ThreadedEngine(inline_s=1.0)
    try:
        with hl.engine.set_engine(e):
            x = hl.nd.array(np.arange(5.0))
            ok = hl.nd.array(np.array([1, 2]))
            bad = hl.nd.array(np.array([1, 7]))
            for _ in range(3):                       # learn the cost key: later runs go fast
                np.testing.assert_array_equal(hl.nd.take(x, ok, mode="raise").asnumpy(), [1.0, 2.0])
            cell = e._cost[next(k for k in e._cost if getattr(k[0], "name", None) == "take")]
            runs = cell[1]
            y = hl.nd.take(x, bad, mode="raise")     # fails in the fast path: stored, not raised
            assert cell[1] == runs + 1               # it did take the fast path
            z = y + 1.0
            with pytest.raises(hl.OpError) as ei:
                z.wait_to_read()
            assert ei.value.op_name == "take" and isinstance(ei.value.__cause__, IndexError)
            with pytest.raises(hl.OpError) as ei2:
                hl.waitall()
            assert ei2.value is ei.value
            np.testing.assert_array_equal(hl.nd.take(x, ok, mode="raise").asnumpy(), [1.0, 2.0])
            hl.waitall()
    finally:
        e.shutdown()


def test_naive_fast_path_raises_at_the_line():
    with hl.engine.set_engine("naive"):
        x = hl.nd.array(np.arange(5.0))
        for _ in range(2):
            hl.nd.take(x, hl.nd.array(np.array([0])), mode="raise")
        with pytest.raises(hl.OpError) as ei:
            hl.nd.take(x, hl.nd.array(np.array([9])), mode="raise")
        assert isinstance(ei.value.__cause__, IndexError)
        hl.waitall()                                 # raised once, at the line: not again

def test_help_while_waiting_runs_queued_tiny_ops():
    e = ThreadedEngine(inline_s=1e-3)
    try:
        v = Var("v")
        state = {"v": 0}

        def inc():
            state["v"] += 1

        e.push(inc, [v], [v], DEVS[0], name="inc", pure=True)
        e.waitall()
        started, gate = threading.Event(), threading.Event()
        e.push(lambda: (started.set(), gate.wait(10)), [], [Var("other")], DEVS[0])
        assert started.wait(10)                     # the worker is busy
        for _ in range(10):
            e.push(inc, [v], [v], DEVS[0], name="inc", pure=True)      # queued
        threading.Timer(0.5, gate.set).start()
        e.wait_for(v)                               # runs the 10 queued incs itself
        assert state["v"] == 11
        assert not gate.is_set()                    # ... before the worker came back
        gate.set()
        e.waitall()
    finally:
        e.shutdown()


# ============================================================================ bulk

def _chain(x, w):
    y = x
    for i in range(30):
        y = hl.nd.tanh(y @ w + float(i) * 0.01) * 1.5
    return y


def test_bulk_results_identical():
    rng = np.random.default_rng(1)
    x = hl.nd.array(rng.standard_normal((4, 8)))
    w = hl.nd.array(rng.standard_normal((8, 8)) * 0.3)
    ref = _chain(x, w).asnumpy()
    with hl.engine.bulk(8):
        y = _chain(x, w)
        z = y + 1.0
    np.testing.assert_array_equal(y.asnumpy(), ref)
    np.testing.assert_array_equal(z.asnumpy(), ref + 1.0)
    with hl.engine.bulk(8):
        y2 = _chain(x, w)
        np.testing.assert_array_equal(y2.asnumpy(), ref)     # a sync point inside a bulk
    hl.waitall()


def test_bulk_error_surfaces_and_independent_ops_still_run():
    x = hl.nd.array(np.arange(6.0))
    with hl.engine.bulk(8):
        a = x * 2.0
        bad = hl.nd.take(x, hl.nd.array(np.array([10])), mode="raise")
        c = bad + 1.0
        d = a + 1.0                                 # independent of the failure
    with pytest.raises(hl.OpError) as ei:
        c.asnumpy()
    assert ei.value.op_name == "take" and isinstance(ei.value.__cause__, IndexError)
    with pytest.raises(hl.OpError):
        bad.wait_to_read()
    np.testing.assert_array_equal(d.asnumpy(), np.arange(6.0) * 2 + 1)
    with pytest.raises(hl.OpError):
        hl.waitall()
    np.testing.assert_array_equal((x + 1.0).asnumpy(), np.arange(6.0) + 1)


def test_bulk_on_engine_instance_groups_ops(eng):
    calls = []

    class Prof:
        def record(self, name, key, thread, t0, t1, meta):
            calls.append(name)

    eng.profiler = Prof()
    v = Var("v")
    state = {"v": 0}

    def inc():
        state["v"] += 1

    with eng.bulk(8):
        for _ in range(20):
            eng.push(inc, [v], [v], DEVS[0], name="inc")
    eng.waitall()
    assert state["v"] == 20
    assert calls.count("inc") == 20
    assert sorted(n for n in calls if n.startswith("bulk")) == ["bulk[4]", "bulk[8]", "bulk[8]"]
    with pytest.raises(ValueError):
        eng.bulk(0)


# ============================================================================ engine choice

def test_set_engine_context_manager_restores():
    prev = hl.engine.get_engine()
    with hl.engine.set_engine("naive"):
        assert isinstance(hl.engine.get_engine(), NaiveEngine)
        y = hl.nd.array([1.0, 2.0]) * 3.0
        np.testing.assert_array_equal(y.asnumpy(), [3.0, 6.0])
    assert hl.engine.get_engine() is prev
    with pytest.raises(ValueError):
        hl.engine.set_engine("nope")
    assert hl.engine.get_engine() is prev


def test_set_engine_with_pending_error_does_not_switch():
    prev = hl.engine.get_engine()
    hl.nd.take(hl.nd.array([1.0]), hl.nd.array(np.array([3])), mode="raise")
    with pytest.raises(hl.OpError):
        with hl.engine.set_engine("naive"):
            pytest.fail("the body must not run")
    assert hl.engine.get_engine() is prev


def test_env_var_selects_naive_engine():
    code = ("import hybridl as hl, numpy as np; e = hl.engine.get_engine(); "
            "y = hl.nd.array([1.0, 2.0]) + 1.0; print(type(e).__name__, y.asnumpy().tolist())")
    for env, name in (("naive", "NaiveEngine"), ("threaded", "ThreadedEngine")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "HYBRIDL_ENGINE": env})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"{name} [2.0, 3.0]"


# ============================================================================ priority

def test_priority_high_op_overtakes_queued_low_ops():
    e = ThreadedEngine(num_workers=1)
    try:
        started, gate = threading.Event(), threading.Event()
        order = []

        def blocker():
            started.set()
            assert gate.wait(10)

        e.push(blocker, [], [Var("block")], DEVS[0], name="blocker")
        assert started.wait(10)                     # the only worker is busy now
        for i in range(10):
            e.push(lambda i=i: order.append(f"low{i}"), [], [Var()], DEVS[0], priority=0)
        e.push(lambda: order.append("high"), [], [Var()], DEVS[0], priority=5)
        gate.set()
        e.waitall()
        assert order == ["high"] + [f"low{i}" for i in range(10)]
    finally:
        e.shutdown()


def test_priority_does_not_break_dependencies(eng):
    v = Var("v")
    state = {"v": []}
    started, gate = threading.Event(), threading.Event()
    eng.push(lambda: (started.set(), gate.wait(10)), [], [Var()], DEVS[0])
    assert started.wait(10)
    eng.push(lambda: state["v"].append("first"), [], [v], DEVS[0], priority=-5)
    eng.push(lambda: state["v"].append("second"), [v], [v], DEVS[0], priority=5)
    gate.set()
    eng.waitall()
    assert state["v"] == ["first", "second"]


def test_malloc_tuning_applied_once_and_can_be_turned_off():
    import subprocess
    import sys
    code = ("import hybridl, hybridl.engine._malloc as m; "
            "print(sorted(m.applied()), m.apply() == m.applied())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").gnu_get_libc_version
        glibc = True
    except (OSError, AttributeError):
        glibc = False
    if glibc:
        assert "MALLOC_MMAP_THRESHOLD_" in out.stdout and "True" in out.stdout
    env = dict(os.environ, HYBRIDL_MALLOC_TUNING="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0 and out.stdout.startswith("[]"), (out.stdout, out.stderr)


def test_threaded_engine_shortens_the_gil_time_slice_unless_the_program_chose_one(monkeypatch):
    import sys
    from hybridl.engine import threaded
    old = sys.getswitchinterval()
    try:
        monkeypatch.delenv("HYBRIDL_SWITCH_INTERVAL", raising=False)
        sys.setswitchinterval(0.005)                  # Python's default
        threaded._set_switch_interval()
        assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
        sys.setswitchinterval(0.002)                  # the program's own choice stays
        threaded._set_switch_interval()
        assert abs(sys.getswitchinterval() - 0.002) < 1e-9
        monkeypatch.setenv("HYBRIDL_SWITCH_INTERVAL", "0")
        sys.setswitchinterval(0.005)
        threaded._set_switch_interval()
        assert abs(sys.getswitchinterval() - 0.005) < 1e-9
        monkeypatch.setenv("HYBRIDL_SWITCH_INTERVAL", "0.001")
        threaded._set_switch_interval()
        assert abs(sys.getswitchinterval() - 0.001) < 1e-9
    finally:
        sys.setswitchinterval(old)


def test_ctrl_c_in_an_op_run_by_the_main_thread_is_a_keyboard_interrupt():
    """An op run by the main thread (inline, or taken while waiting) that gets Ctrl-C: the
    program sees KeyboardInterrupt, as for any Ctrl-C; the op's output is marked failed (its
    value is unknown) and waitall() does not raise it again."""
    for eng in (ThreadedEngine(inline_s=1.0), NaiveEngine()):
        try:
            v, w = Var("v"), Var("w")
            ok = {"n": 0}

            def fine():
                ok["n"] += 1

            def interrupted():
                raise KeyboardInterrupt

            eng.push(fine, [], [v], DEVS[0], name="fine", pure=True)
            eng.waitall()
            eng.push(fine, [], [v], DEVS[0], name="fine", pure=True)   # learned: inline now
            with pytest.raises(KeyboardInterrupt):
                eng.push(interrupted, [], [w], DEVS[0], name="fine", pure=True)
                eng.wait_for(w)
            with pytest.raises(OpError) as ei:
                eng.wait_for(w)
            assert isinstance(ei.value.__cause__, KeyboardInterrupt)
            eng.waitall()                       # not raised again
            eng.push(fine, [], [v], DEVS[0], name="fine", pure=True)
            eng.wait_for(v)
            assert ok["n"] == 3
        finally:
            eng.shutdown()


def test_after_shutdown_push_raises_and_thread_ids_are_released():
    e = ThreadedEngine()
    v = Var("v")
    e.push(lambda: None, [], [v], DEVS[0], name="first")
    e.waitall()
    workers = set(e._worker_ids)
    assert workers
    e.shutdown()
    assert not e._worker_ids                   # a new thread may get a worker's id
    with pytest.raises(RuntimeError, match="shut down"):
        e.push(lambda: None, [], [v], DEVS[0], name="late")


def test_shutdown_cancels_queued_ops_and_their_waiters_get_an_error():
    """Ops still queued at shutdown (or waiting for a running one) never run; whoever waits
    for their outputs gets an OpError saying so instead of waiting forever."""
    e = ThreadedEngine()
    gate, started = threading.Event(), threading.Event()
    a, b, c = Var("a"), Var("b"), Var("c")
    ran = []
    e.push(lambda: (started.set(), gate.wait(10)), [], [a], DEVS[0], name="running")
    assert started.wait(10)
    e.push(lambda: ran.append("after"), [a], [b], DEVS[0], name="after")     # waits for it
    e.push(lambda: ran.append("queued"), [], [c], DEVS[0], name="queued")
    threading.Timer(0.2, gate.set).start()
    e.shutdown(timeout=5)
    for v in (b, c):
        with pytest.raises(OpError, match="shut down"):
            e.wait_for(v)
    e.wait_for(a)                              # the running op finished normally
    assert ran == []


def test_set_engine_context_switches_back_even_when_leaving_raises():
    with hl.engine.set_engine("naive"):
        naive = hl.engine.get_engine()
        with pytest.raises(hl.OpError, match="boom"):
            with hl.engine.set_engine("threaded") as eng:
                assert eng is not naive and eng.name == "threaded"

                def boom():
                    raise ValueError("boom")
                eng.push(boom, [], [Var("x")])
        assert hl.engine.get_engine() is naive      # restored although the exit raised


@pytest.mark.parametrize("kind", ["naive", "threaded"])
def test_push_refuses_an_unhashable_pure_key_on_both_engines(kind):
    from hybridl.engine import NaiveEngine, ThreadedEngine
    eng = NaiveEngine() if kind == "naive" else ThreadedEngine()
    try:
        with pytest.raises(TypeError, match="pure: expected a bool or a hashable cost key"):
            eng.push(lambda: None, [], [Var()], hl.cpu(0), pure=[1])
        eng.push(lambda: None, [], [Var()], hl.cpu(0), pure=("key", 1))
        eng.waitall()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("engine", ["threaded", "naive"])
def test_skip_clean_lists_the_writes_that_take_a_failed_inputs_error(engine):
    """push(skip_clean=[v, ...]): an op skipped because an input failed passes the error on
    to the listed writes only; the others keep their values. An error raised by the op
    itself still marks every write. A listed Var the op does not write is a TypeError."""
    from hybridl.engine import Var

    def push(fn, reads, writes, **kw):          # the naive engine raises at the push
        try:
            hl.engine.push(fn, reads, writes, **kw)
        except hl.OpError:
            assert engine == "naive"

    def raises_once_more():
        if engine == "threaded":
            with pytest.raises(hl.OpError):
                hl.waitall()
    with hl.engine.set_engine(engine):
        bad, loss, weight = Var("bad"), Var("loss"), Var("weight")
        box = {"w": 1.0}

        def fail():
            raise ValueError("broken batch")
        push(fail, [], [bad])

        def step():
            box["w"] += 1.0
        push(step, [bad], [loss, weight], skip_clean=[loss])
        with pytest.raises(hl.OpError, match="broken batch"):
            hl.engine.wait_for(loss)
        hl.engine.wait_for(weight)                      # clean: kept its value
        assert box["w"] == 1.0 and weight.exc is None
        raises_once_more()
        # the op's own error marks every write, listed or not
        push(fail, [], [loss, weight], skip_clean=[loss])
        with pytest.raises(hl.OpError, match="broken batch"):
            hl.engine.wait_for(weight)
        raises_once_more()
        with pytest.raises(TypeError, match="skip_clean"):
            hl.engine.push(step, [], [loss], skip_clean=[weight])


def test_push_checks_priority_device_and_var_lists_before_queueing_anything():
    """priority='high' was queued before the heap compared it: the device's worker died and
    waitall hung for good; None ran anyway; device=[...] and writes=None failed with Python's
    own messages."""
    from hybridl.engine import Var
    ran = []
    for kw, msg in ((dict(priority="high"), "priority: expected an integer"),
                    (dict(priority=None), "priority: expected an integer"),
                    (dict(priority=float("nan")), "priority: expected an integer"),
                    (dict(priority=True), "priority: expected an integer"),
                    (dict(device=[hl.cpu(0)]), "device: expected a Device"),
                    (dict(writes=None), "writes: expected an iterable of engine Vars")):
        args = dict(reads=(), writes=(Var(),), device=hl.cpu(0))
        args.update(kw)
        with pytest.raises(TypeError, match=msg):
            hl.engine.push(lambda: ran.append(1), **args)
    hl.waitall()                                    # returns: nothing was queued
    assert ran == []
    hl.engine.push(lambda: ran.append(1), (), (Var(),), hl.cpu(0), priority=np.int64(3))
    hl.waitall()
    assert ran == [1]
