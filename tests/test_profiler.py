"""hybridl.profiler: recording engine ops, the Chrome trace (Trace Event Format), the per-op
table, hardware columns, ``hybridl trace``, and the two-chain example's trace.

Timing is never asserted as a speed; only relations between recorded times (overlap, ordering,
consistency of ts/dur with perf_counter deltas)."""
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hybridl as hl
from hybridl import profiler
from hybridl.engine import OpError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean():
    with contextlib.suppress(OpError):
        hl.waitall()
    assert hl.engine.get_engine().profiler is None
    yield
    with contextlib.suppress(OpError):
        hl.waitall()
    if profiler.is_active():
        profiler.stop()
    assert hl.engine.get_engine().profiler is None


def _program(dev=None, n=64):
    x = hl.nd.array(np.arange(n * n, dtype=np.float32).reshape(n, n) / (n * n), device=dev)
    y = hl.nd.dot(x, x)
    z = hl.nd.tanh(y) + 1.0
    return z.sum()


def _load_example(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ============================================================================ recording

def test_profile_installs_records_and_uninstalls():
    eng = hl.engine.get_engine()
    with profiler.profile() as prof:
        assert eng.profiler is prof
        r = _program()
        r.wait_to_read()
    assert eng.profiler is None
    names = [e.name for e in prof.events]
    assert names.count("matmul") + names.count("dot") == 1
    assert {"tanh", "add", "sum"} <= set(names)
    for e in prof.events:
        assert e.start <= e.end
        assert e.device == hl.cpu(0) and e.queue == "compute"
        # the device's worker, or the pushing thread (the engine may run tiny ops inline)
        assert e.thread in ("hybridl-cpu(0)-w0", threading.current_thread().name)
        assert e.start >= prof.t_origin
    mm = [e for e in prof.events if e.name in ("matmul", "dot")][0]
    assert mm.flops == pytest.approx(2 * 64 ** 3, rel=0.05)
    assert mm.bytes >= 3 * 64 * 64 * 4
    n = len(prof.events)
    _program().wait_to_read()                      # off: nothing more recorded
    assert len(prof.events) == n


def test_exit_waits_for_pending_ops():
    x = hl.nd.ones((256, 256))
    with profiler.profile() as prof:
        for _ in range(10):
            x = hl.nd.dot(x, x) * 0.001
        # no wait in the block: stop() waits so these ops are recorded
    assert len(prof.events) == 20


def test_no_cost_when_off_meta_not_computed(monkeypatch):
    """With no profiler the eager interpreter does not call cost functions."""
    from hybridl import ndarray
    calls = []
    orig = ndarray._op_meta
    monkeypatch.setattr(ndarray, "_op_meta", lambda *a, **k: calls.append(1) or orig(*a, **k))
    _program().wait_to_read()
    assert calls == []
    with profiler.profile():
        _program().wait_to_read()
    assert calls


def test_record_is_thread_safe_many_devices_and_frontends():
    devs = [hl.cpu(i) for i in range(4)]
    per = 25

    def work(d):
        x = hl.nd.ones((8, 8), device=d)
        for _ in range(per):
            x = x + 1.0
        x.wait_to_read()

    with profiler.profile() as prof:
        ts = [threading.Thread(target=work, args=(d,)) for d in devs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    adds = [e for e in prof.events if e.name == "add"]
    assert len(adds) == per * len(devs)
    workers = {f"hybridl-cpu({i})-w0" for i in range(4)}
    frontends = {t.name for t in ts}               # tiny ops may run inline in the pusher
    assert {e.thread for e in adds} <= workers | frontends
    for e in adds:
        assert e.device in devs
        if e.thread in workers:
            assert e.thread == f"hybridl-{e.device!r}-w0"
    # direct concurrent calls of record()
    p = profiler.Profile()
    def rec(i):
        for j in range(2000):
            p.record("op", hl.cpu(0), f"t{i}", 0.0, 1.0, None)
    ts = [threading.Thread(target=rec, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(p.events) == 8000


def test_naive_engine_records_in_caller_thread():
    with hl.engine.set_engine("naive"):
        with profiler.profile() as prof:
            _program(hl.cpu(1)).wait_to_read()
    assert prof.events
    assert {e.thread for e in prof.events} == {threading.current_thread().name}
    assert {e.device for e in prof.events} == {hl.cpu(1)}


def test_nested_profiles_both_record_and_restore():
    eng = hl.engine.get_engine()
    with profiler.profile() as outer:
        _program().wait_to_read()
        with profiler.profile() as inner:
            (hl.nd.ones((3,)) * 2).wait_to_read()
        assert eng.profiler is outer
    assert eng.profiler is None
    assert [e.name for e in inner.events] == ["multiply"]
    assert len(outer.events) == len([e for e in outer.events]) and "multiply" in [e.name for e in outer.events]


def test_start_stop_helpers():
    prof = profiler.start()
    assert profiler.is_active() and hl.engine.get_engine().profiler is prof
    with pytest.raises(RuntimeError, match="already"):
        profiler.start()
    _program().wait_to_read()
    assert profiler.stop() is prof
    assert not profiler.is_active() and hl.engine.get_engine().profiler is None
    assert prof.events
    assert profiler.stop() is None


def test_stop_does_not_consume_op_errors():
    def bad():
        raise ZeroDivisionError("boom")
    v = hl.engine.Var()
    with profiler.profile() as prof:
        hl.engine.push(bad, [], [v], hl.cpu(0), name="bad_op")
    assert [e.name for e in prof.events] == ["bad_op"]
    with pytest.raises(OpError, match="bad_op"):
        hl.waitall()


def test_bulk_groups_and_spans_not_double_counted():
    x = hl.nd.ones((4, 4))
    with profiler.profile() as prof:
        with prof.span("frontend step"):
            with hl.engine.bulk(5):
                for _ in range(10):
                    x = x + 1.0
        x.wait_to_read()
    assert np.all(x.asnumpy() == 11)
    queues = [e.queue for e in prof.events]
    assert queues.count("bulk") == 2 and queues.count("frontend") == 1
    rows = prof.stats(hardware=None)
    assert [(r["name"], r["count"]) for r in rows] == [("add", 10)]
    assert rows[0]["share"] == pytest.approx(100.0)
    text = prof.table(hardware=None)
    assert "2 bulk groups" in text and "1 frontend spans" in text


# ============================================================================ table

def _fake_profile():
    p = profiler.Profile()
    t = 100.0
    for name, count, dur in [("a", 1, 0.5), ("b", 5, 0.01), ("c", 2, 0.1), ("d", 3, 0.04)]:
        for _ in range(count):
            p.record(name, hl.cpu(0), "w", t, t + dur, {"flops": 1e6, "bytes": 1e5})
            t += dur
    return p


@pytest.mark.parametrize("sort_by,expected", [
    ("total", ["a", "c", "d", "b"]),     # 0.5, 0.2, 0.12, 0.05
    ("count", ["b", "d", "c", "a"]),
    ("mean", ["a", "c", "d", "b"]),
    ("name", ["a", "b", "c", "d"]),
])
def test_table_sorting(sort_by, expected):
    p = _fake_profile()
    rows = p.stats(sort_by=sort_by, hardware=None)
    assert [r["name"] for r in rows] == expected
    text = p.table(sort_by=sort_by, hardware=None)
    body = [ln.split()[0] for ln in text.splitlines()[2:2 + len(expected)]]
    assert body == expected


def test_table_values_and_shares_sum_to_100():
    p = _fake_profile()
    rows = {r["name"]: r for r in p.stats(hardware=None)}
    assert rows["b"]["count"] == 5
    assert rows["b"]["total"] == pytest.approx(0.05)
    assert rows["b"]["mean"] == pytest.approx(0.01)
    assert rows["a"]["share"] == pytest.approx(100 * 0.5 / 0.87)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(100.0)
    # real run
    with profiler.profile() as prof:
        _program().wait_to_read()
        _program(hl.cpu(1)).wait_to_read()
    assert sum(r["share"] for r in prof.stats(hardware=None)) == pytest.approx(100.0)
    text = prof.table(hardware=None)
    shares = [float(ln.split()[-1]) for ln in text.splitlines()[2:] if ln and ln[0].isalpha()
              and not ln.startswith(("total", "threads"))]
    assert sum(shares) == pytest.approx(100.0, abs=0.1 * len(shares))


def test_table_bad_sort_by_names_argument():
    p = _fake_profile()
    with pytest.raises(ValueError, match="sort_by"):
        p.table(sort_by="speed")
    with pytest.raises(ValueError, match="sort_by"):
        p.stats(sort_by=None)
    with pytest.raises(ValueError, match="limit"):
        p.table(limit=0)


def test_table_limit_and_empty():
    p = _fake_profile()
    text = p.table(hardware=None, limit=2)
    assert "2 more op names" in text
    empty = profiler.Profile()
    assert "total" in empty.table(hardware=None)


def test_hardware_columns_when_profile_available(monkeypatch):
    import hybridl.hardware as hw
    seen = []

    def fake_classify(flops, nbytes, seconds, profile=None, **kw):
        seen.append((flops, nbytes, seconds, profile))
        return {"gflops": flops / seconds / 1e9, "gbs": nbytes / seconds / 1e9, "bound": "memory"}

    monkeypatch.setattr(hw, "classify_op", fake_classify)
    monkeypatch.setattr(hw, "load_cached", lambda *a, **k: {"fake": True})
    p = _fake_profile()
    text = p.table()
    assert "GFLOP/s" in text and "GB/s" in text and "memory" in text
    rows = {r["name"]: r for r in p.stats()}
    assert rows["b"]["gflops"] == pytest.approx(5e6 / 0.05 / 1e9)
    assert rows["b"]["bound"] == "memory"
    assert all(s[3] == {"fake": True} for s in seen)
    # no cached profile: no columns
    monkeypatch.setattr(hw, "load_cached", lambda *a, **k: None)
    assert "GFLOP/s" not in p.table()
    # hardware package missing or incomplete: no columns, no error
    monkeypatch.delattr(hw, "load_cached")
    assert "GFLOP/s" not in p.table()
    monkeypatch.setitem(sys.modules, "hybridl.hardware", None)
    assert "GFLOP/s" not in p.table()


# ============================================================================ chrome trace

REQUIRED_X = {"name", "cat", "ph", "ts", "dur", "pid", "tid"}


def validate_trace(data):
    """Check the Trace Event Format (JSON object form): returns the 'X' events."""
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    xs, named_tids, used_tids = [], set(), set()
    for ev in data["traceEvents"]:
        assert ev["ph"] in ("X", "M"), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["name"], str)
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert isinstance(ev["args"], dict)
            if ev["name"] == "thread_name":
                assert isinstance(ev["args"]["name"], str)
                named_tids.add((ev["pid"], ev["tid"]))
        else:
            assert REQUIRED_X <= set(ev), ev
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
            assert ev["ts"] >= 0 and ev["dur"] >= 0
            if "args" in ev:
                assert isinstance(ev["args"], dict)
            used_tids.add((ev["pid"], ev["tid"]))
            xs.append(ev)
    assert used_tids <= named_tids
    return xs


def test_chrome_trace_format_and_microseconds(tmp_path, monkeypatch):
    eng = hl.engine.get_engine()
    if hasattr(eng, "inline_s"):       # every op on a worker thread, whatever earlier tests ran
        monkeypatch.setattr(eng, "inline_s", 0.0)
    with profiler.profile() as prof:
        r = _program()
        c = r.copyto(hl.cpu(1))
        c.wait_to_read()
    path = tmp_path / "t.json"
    assert prof.export_chrome_trace(str(path)) == str(path)
    with open(path) as f:
        data = json.load(f)
    xs = validate_trace(data)
    assert len(xs) == len(prof.events)
    tnames = {ev["tid"]: ev["args"]["name"] for ev in data["traceEvents"]
              if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert "hybridl-cpu(0)-w0" in tnames.values()
    assert "hybridl-copy-cpu(1)-w0" in tnames.values()
    by_start = sorted(prof.events, key=lambda e: e.start)
    for ev, e in zip(xs, by_start):
        assert ev["name"] == e.name
        assert tnames[ev["tid"]] == e.thread
        assert ev["ts"] == pytest.approx((e.start - prof.t_origin) * 1e6, abs=0.01)
        assert ev["dur"] == pytest.approx((e.end - e.start) * 1e6, abs=0.01)
    mm = [ev for ev in xs if ev["name"] in ("matmul", "dot")][0]
    assert mm["args"]["flops"] == pytest.approx(2 * 64 ** 3, rel=0.05) and mm["args"]["bytes"] > 0
    assert {ev["cat"] for ev in xs} == {"compute", "copy"}
    # whole span in microseconds ~ perf_counter span
    span_us = max(ev["ts"] + ev["dur"] for ev in xs) - min(ev["ts"] for ev in xs)
    assert span_us == pytest.approx((max(e.end for e in prof.events)
                                     - min(e.start for e in prof.events)) * 1e6, abs=0.05)


def test_export_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text("old")
    p = _fake_profile()
    p.export_chrome_trace(path)
    validate_trace(json.loads(path.read_text()))
    assert os.listdir(tmp_path) == ["trace.json"]
    # a failure while writing leaves the old file and no temp file
    import hybridl.profiler as P
    monkeypatch.setattr(P.json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        p.export_chrome_trace(path)
    assert os.listdir(tmp_path) == ["trace.json"]
    validate_trace(json.loads(path.read_text()))
    with pytest.raises(OSError):
        p.export_chrome_trace(tmp_path / "missing" / "t.json")


# ============================================================================ examples / CLI

def _overlap(a, b):
    return min(a[1], b[1]) - max(a[0], b[0])


def test_two_chain_example_trace_overlaps_on_two_threads(tmp_path):
    mod = _load_example("two_chains")
    for attempt in range(10):         # overlap depends on the OS scheduler: allow retries
        path = tmp_path / f"two_chains{attempt}.json"
        res = mod.run(n=256, steps=24, repeat=1, trace=str(path), log=lambda *a: None)
        assert res["parallel"] > 0
        with open(path) as f:
            data = json.load(f)
        xs = validate_trace(data)
        tids = {ev["tid"] for ev in xs}
        assert len(tids) >= 2
        iv = {}
        for ev in xs:
            iv.setdefault(ev["tid"], []).append((ev["ts"], ev["ts"] + ev["dur"]))
        t = sorted(tids)
        if any(_overlap(a, b) > 0 for a in iv[t[0]] for b in iv[t[1]]):
            return
    pytest.fail("no overlapping intervals on two worker threads in 10 attempts")


def test_examples_run_small():
    r = _load_example("async_vs_sync").run(iters=4, n=64, work=1000, repeat=1, log=lambda *a: None)
    assert {"t1", "t2", "threaded", "naive"} <= set(r)
    r = _load_example("copy_overlap").run(m=128, k=8, steps=3, repeat=1, log=lambda *a: None)
    assert {"compute", "copy", "sequential", "overlapped", "overlap_fraction"} <= set(r)
    assert isinstance(hl.engine.get_engine(), hl.engine.ThreadedEngine)


def test_trace_cli(tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--steps", "2", "--warmup", "1",
                        "--model", "mlp", "--no-hybridize", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    xs = validate_trace(json.loads(out.read_text()))
    names = {ev["name"] for ev in xs}
    assert {"step 0", "step 1"} <= names
    assert any(n.startswith("sgd_update") for n in names)   # one update op per device
    assert "share %" in p.stdout and "trace written to" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--out",
                          str(tmp_path / "no" / "t.json"), "--no-hybridize"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--out" in bad.stderr
    link = tmp_path / "dangling.json"                   # a link to a missing folder: refused
    link.symlink_to(tmp_path / "nodir" / "t.json")      # before training, not after
    bad = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--out", str(link),
                          "--no-hybridize"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--out: path: directory" in bad.stderr
    assert "samples" not in bad.stdout
    bad = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--steps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--steps" in bad.stderr
    # options of a whole run are not offered (they were listed by --help and ignored)
    helptext = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--help"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert "--steps" in helptext and "--model" in helptext
    for opt in ("--epochs", "--save", "--strategy", "--schedule", "--quiet", "--devices"):
        assert opt not in helptext, opt
    bad = subprocess.run([sys.executable, "-m", "hybridl", "trace", "--epochs", "3"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--epochs" in bad.stderr


def test_compiled_call_reports_the_cost_of_its_whole_graph():
    # a hybridized call is one engine op: its flops are the sum of its nodes' (two dense layers)
    net = hl.nn.HybridSequential()
    net.add(hl.nn.Dense(32, in_units=16, activation="relu"), hl.nn.Dense(8, in_units=32))
    net.initialize()
    net.hybridize()
    x = hl.nd.ones((4, 16))
    net(x).wait_to_read()
    with hl.profiler.profile() as prof:
        net(x).wait_to_read()
    ev = [e for e in prof.events if e.name == "HybridSequential"]
    assert len(ev) == 1
    assert ev[0].flops == pytest.approx(2 * 4 * (16 * 32 + 32 * 8), rel=0.05)
    assert ev[0].bytes >= 4 * (16 * 32 + 32 * 8)          # at least the weights are read


def test_profiles_stopped_out_of_order_leave_the_engine_clean():
    eng = hl.engine.get_engine()
    before = eng.profiler
    a = hl.profiler.Profile().start()
    b = hl.profiler.Profile().start()
    a.stop()                                   # the outer one first
    x = hl.nd.ones((3,)) * 2
    x.wait_to_read()
    n_a = len(a.events)
    b.stop()
    assert eng.profiler is before
    assert n_a == len(a.events) == 0           # a records nothing after it stopped
    assert any(e.name == "multiply" for e in b.events)
