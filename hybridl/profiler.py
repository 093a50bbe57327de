"""Profiler: engine op events -> Chrome trace JSON (Perfetto), per-op table, bound classification.

::

    with hl.profiler.profile() as prof:
        y = (x @ w).relu().sum()
        y.wait_to_read()
    prof.export_chrome_trace("trace.json")      # open in https://ui.perfetto.dev
    print(prof.table(sort_by="total"))

While a :class:`Profile` is active it is installed as ``hl.engine.get_engine().profiler``; every
executed engine op then calls :meth:`Profile.record` from the thread that ran it (a device
worker, or the caller's thread with the naive engine) with its name, queue key (a Device, or
``('copy', Device)`` for copies), thread name, start and end times (``time.perf_counter()``
seconds) and cost figures (``flops``, ``bytes``) from the op's cost function. When no profiler is
installed the engine skips all of this (one ``is None`` test per op): profiling costs nothing
when off.

Ops grouped by ``hl.engine.bulk(n)`` appear twice: each member op, and the group itself as
``bulk[k]`` (category ``bulk``); the table lists the members and reports the groups on a
separate line so that shares are not counted twice.

The trace uses the Trace Event Format (Google, "Trace Event Format",
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKHFoTM7s): one complete
event (``ph: 'X'``) per op with ``ts`` and ``dur`` in microseconds, and metadata events
(``ph: 'M'``) naming the process and the worker threads.
"""
import json
import os
import threading
import time

__all__ = ["Event", "Profile", "profile", "start", "stop", "is_active"]

SORT_KEYS = ("total", "count", "mean", "name")


class Event:
    """One executed engine op.

    Attributes:
        name (str): the op name (``matmul``, ``copy``, ``bulk[16]``, ...).
        key: the engine queue key: a Device, or ``('copy', Device)`` for a copy.
        device: the Device (the copy's destination for copies), or the key itself when it is
            not a Device.
        queue (str): ``'compute'``, ``'copy'``, ``'bulk'`` (a bulk group containing other events),
            ``'comm'`` (an MPI collective), ``'sync'`` (a wait for other devices, e.g.
            SyncBatchNorm's gate) or ``'frontend'`` (a span of the Python program marked with
            :meth:`Profile.span`).
        thread (str): name of the thread that ran the op (``hybridl-cpu(0)-w0``, ``MainThread``).
        start, end (float): ``time.perf_counter()`` seconds.
        flops (float or None): floating-point operations of the op (cost function).
        bytes (float or None): bytes read and written by the op (cost function).
    """

    __slots__ = ("name", "key", "device", "queue", "thread", "start", "end", "flops", "bytes")

    def __init__(self, name, key, thread, start, end, meta):
        self.name = name
        self.key = key
        if isinstance(key, tuple) and len(key) == 2 and key[0] == "copy":
            self.device, self.queue = key[1], "copy"
        elif key == "frontend":
            self.device, self.queue = None, "frontend"
        elif isinstance(key, tuple) and key and key[0] == "comm":
            self.device, self.queue = key, "comm"      # MPI collectives (hl.distributed)
        elif isinstance(key, tuple):
            self.device, self.queue = key, "sync"      # waits (SyncBatchNorm's gate)
        else:
            self.device, self.queue = key, "compute"
        if self.queue == "compute" and name.startswith("bulk[") and not meta:
            self.queue = "bulk"
        self.thread = thread
        self.start = start
        self.end = end
        meta = meta or {}
        self.flops = meta.get("flops")
        self.bytes = meta.get("bytes")

    @property
    def duration(self):
        """Seconds the op ran (``end - start``)."""
        return self.end - self.start

    def as_dict(self):
        return {s: getattr(self, s) for s in self.__slots__}

    def __repr__(self):
        return (f"Event({self.name!r}, device={self.device!r}, queue={self.queue!r}, "
                f"thread={self.thread!r}, {self.duration * 1e6:.1f} us)")


class Profile:
    """Records engine op events while active (a context manager; see the module docstring).

    Args:
        engine: the engine to profile (default: the current one when the profile starts).

    Attributes:
        events (list of :class:`Event`): recorded ops, in completion order.
        t_origin (float): ``time.perf_counter()`` when recording started; trace timestamps are
            relative to it.

    Raises:
        TypeError: ``engine`` neither None nor an Engine.
    """

    def __init__(self, engine=None):
        from .engine import Engine
        if engine is not None and not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an Engine (hl.engine.get_engine()) or None, got "
                            f"{type(engine).__name__} {engine!r}")
        self._engine_arg = engine
        self._engine = None
        self._prev = None
        self._lock = threading.Lock()
        self.events = []
        self.t_origin = None
        self.t_stop = None
        self.active = False

    # ------------------------------------------------------------------ recording
    def record(self, op_name, key, thread_name, t0, t1, meta):
        """Called by the engine after each op (from the thread that ran it). Thread-safe."""
        ev = Event(op_name, key, thread_name, t0, t1, meta)
        with self._lock:
            self.events.append(ev)
        prev = self._prev
        if prev is not None:            # an enclosing profile records too
            prev.record(op_name, key, thread_name, t0, t1, meta)

    def span(self, name):
        """Context manager marking a span of the frontend (the calling thread), e.g. one training
        step: ``with prof.span('step 3'): ...``. Spans show in the trace on the caller's thread
        (category ``frontend``); the table leaves them out of the op shares."""
        return _Span(self, name)

    def start(self):
        """Install this profile on the engine and start recording; returns ``self``.

        Raises:
            RuntimeError: this profile is already active.
        """
        if self.active:
            raise RuntimeError("profile: already started")
        from . import engine as _engine
        eng = self._engine_arg or _engine.get_engine()
        eng._flush_bulk()        # ops pushed before the profile began are not recorded
        eng._wait_all()          # (waits without raising or consuming their errors)
        self._engine = eng
        self._prev = eng.profiler
        if self.t_origin is None:
            self.t_origin = time.perf_counter()
        eng.profiler = self
        self.active = True
        return self

    def stop(self):
        """Wait for the ops pushed so far, uninstall, and return ``self``.

        Pending op errors are not raised here (nor consumed): they stay for the next sync point.
        """
        if not self.active:
            return self
        eng = self._engine
        try:
            flush = getattr(eng, "_flush_bulk", None)
            if flush is not None:
                flush()
            wait = getattr(eng, "_wait_all", None)
            if wait is not None:
                wait()
        except Exception:  # noqa: BLE001 - stopping the profiler must not raise op errors
            pass
        finally:
            if eng.profiler is self:
                eng.profiler = self._prev
            else:               # stopped before a profile started inside it: unlink it from
                node = eng.profiler     # the chain, so the inner one stops forwarding to it
                while node is not None:
                    if node._prev is self:
                        node._prev = self._prev
                        break
                    node = node._prev
            self._prev = None
            self.active = False
            self.t_stop = time.perf_counter()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # ------------------------------------------------------------------ views
    def _snapshot(self):
        with self._lock:
            return list(self.events)

    def threads(self):
        """Names of the threads that ran recorded ops, sorted."""
        return sorted({e.thread for e in self._snapshot()})

    def stats(self, sort_by="total", hardware="auto"):
        """Per-op-name aggregates as a list of dicts, sorted by ``sort_by``.

        Each row: ``name``, ``count``, ``total`` (seconds), ``mean`` (seconds), ``share``
        (percent of the summed op time, bulk groups excluded so the shares add to 100), ``flops``
        and ``bytes`` (sums, None when unknown); with a hardware profile also ``gflops``
        (achieved GFLOP/s), ``gbs`` (achieved GB/s) and ``bound`` (``compute`` | ``memory`` |
        ``overhead``, see :func:`hybridl.hardware.classify_op`).

        Args:
            sort_by: ``'total'`` | ``'count'`` | ``'mean'`` (descending) or ``'name'`` (ascending).
            hardware: ``'auto'`` (the profile cached by ``hybridl hw``, if any), a profile dict,
                or None (no hardware columns).

        Raises:
            ValueError: ``sort_by`` is not one of those.
        """
        if sort_by not in SORT_KEYS:
            raise ValueError(f"sort_by: expected one of {SORT_KEYS}, got {sort_by!r}")
        agg = {}
        for e in self._snapshot():
            if e.queue in ("bulk", "frontend"):
                continue
            r = agg.get(e.name)
            if r is None:
                r = agg[e.name] = {"name": e.name, "count": 0, "total": 0.0, "flops": 0.0,
                                   "bytes": 0.0, "_cost_known": True}
            r["count"] += 1
            r["total"] += e.duration
            if e.flops is None or e.bytes is None:
                r["_cost_known"] = False
            else:
                r["flops"] += e.flops
                r["bytes"] += e.bytes
        grand = sum(r["total"] for r in agg.values())
        hw = _hardware_profile(hardware)
        rows = []
        for r in agg.values():
            known = r.pop("_cost_known")
            if not known:
                r["flops"] = r["bytes"] = None
            r["mean"] = r["total"] / r["count"]
            r["share"] = 100.0 * r["total"] / grand if grand > 0 else 100.0 / len(agg)
            if hw is not None:
                r.update(_classify(r, hw))
            rows.append(r)
        if sort_by == "name":
            rows.sort(key=lambda r: r["name"])
        else:
            rows.sort(key=lambda r: (-r[sort_by], r["name"]))
        return rows

    def table(self, sort_by="total", hardware="auto", limit=None):
        """The per-op table as text (``print(prof.table())``): count, total, mean and share per op
        name, plus achieved GFLOP/s, GB/s and the bound class when a hardware profile exists
        (``hybridl hw`` caches one).

        Args:
            sort_by: ``'total'`` | ``'count'`` | ``'mean'`` | ``'name'``.
            hardware: see :meth:`stats`.
            limit (int): show only the first ``limit`` rows (None: all).

        Raises:
            ValueError: bad ``sort_by`` or ``limit``.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit: expected an integer >= 1 or None, got {limit!r}")
        rows = self.stats(sort_by, hardware)
        hw_cols = any("bound" in r for r in rows)
        w = max([24] + [len(r["name"]) for r in rows])
        head = f"{'op':<{w}} {'count':>7} {'total ms':>10} {'mean us':>10} {'share %':>8}"
        if hw_cols:
            head += f" {'GFLOP/s':>9} {'GB/s':>8} {'bound':>9}"
        lines = [head, "-" * len(head)]
        shown = rows if limit is None else rows[:limit]
        for r in shown:
            line = (f"{r['name']:<{w}} {r['count']:>7d} {r['total'] * 1e3:>10.3f} "
                    f"{r['mean'] * 1e6:>10.1f} {r['share']:>8.1f}")
            if hw_cols:
                line += (f" {_fmt(r.get('gflops')):>9} {_fmt(r.get('gbs')):>8} "
                         f"{(r.get('bound') or '-'):>9}")
            lines.append(line)
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more op names")
        tot = sum(r["total"] for r in rows)
        n = sum(r["count"] for r in rows)
        lines.append("-" * len(head))
        lines.append(f"{'total':<{w}} {n:>7d} {tot * 1e3:>10.3f} {'':>10} {100.0 if rows else 0.0:>8.1f}")
        groups = [e for e in self._snapshot() if e.queue == "bulk"]
        if groups:
            lines.append(f"(+ {len(groups)} bulk groups, {sum(e.duration for e in groups) * 1e3:.3f} "
                         f"ms, containing the ops above)")
        spans = [e for e in self._snapshot() if e.queue == "frontend"]
        if spans:
            lines.append(f"(+ {len(spans)} frontend spans, {sum(e.duration for e in spans) * 1e3:.3f} "
                         f"ms of wall time)")
        threads = self.threads()
        if threads:
            lines.append(f"threads: {', '.join(threads)}")
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    # ------------------------------------------------------------------ chrome trace
    def chrome_trace(self):
        """The trace as a dict in the Trace Event Format (``{'traceEvents': [...], ...}``).

        Complete events (``ph 'X'``): ``ts`` = microseconds since :attr:`t_origin`, ``dur`` in
        microseconds, ``pid`` = this process, ``tid`` = a small integer per thread, ``cat`` =
        ``compute`` | ``copy`` | ``bulk``, ``args`` = device, flops, bytes. Metadata events
        (``ph 'M'``) name the process and each thread (``thread_name``) and order the threads.
        """
        events = self._snapshot()
        origin = self.t_origin if self.t_origin is not None else (
            min((e.start for e in events), default=0.0))
        pid = os.getpid()
        tids = {}
        for name in sorted({e.thread for e in events}, key=_thread_order):
            tids[name] = len(tids) + 1
        out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                "args": {"name": "hybridl"}}]
        for name, tid in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        for e in sorted(events, key=lambda e: e.start):
            args = {"device": repr(e.device)} if e.device is not None else {}
            if e.flops is not None:
                args["flops"] = e.flops
            if e.bytes is not None:
                args["bytes"] = e.bytes
            out.append({"name": e.name, "cat": e.queue, "ph": "X",
                        "ts": round((e.start - origin) * 1e6, 3),
                        "dur": round(max(e.end - e.start, 0.0) * 1e6, 3),
                        "pid": pid, "tid": tids[e.thread], "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"producer": "hybridl.profiler", "clock": "time.perf_counter",
                              "origin_s": origin}}

    def export_chrome_trace(self, path):
        """Write the trace (see :meth:`chrome_trace`) as JSON to ``path`` atomically (a temp file
        in the same folder, then ``os.replace``). Open it in https://ui.perfetto.dev or
        chrome://tracing. Returns ``path``.

        Raises:
            TypeError: ``path`` is not a file path.  OSError: the folder does not exist or is
            not writable.
        """
        from ._io import atomic_write, check_path
        path = check_path(path, "export_chrome_trace: path")
        data = self.chrome_trace()

        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(data, f, separators=(",", ":"))
        atomic_write(path, write)
        return path


class _Span:
    def __init__(self, prof, name):
        self.prof, self.name = prof, str(name)

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.prof.record(self.name, "frontend", threading.current_thread().name, self.t0,
                         time.perf_counter(), None)
        return False


def _thread_order(name):
    # frontend first, then compute workers, then copy workers, each by name
    if not name.startswith("hybridl-"):
        return (0, name)
    return (2 if name.startswith("hybridl-copy-") else 1, name)


def _fmt(v):
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _hardware_profile(hardware):
    """The hardware profile dict for the table columns, or None (never raises)."""
    if hardware is None or hardware is False:
        return None
    if hardware != "auto":
        return hardware
    try:
        from .hardware import load_cached
        return load_cached()
    except (ImportError, AttributeError):
        return None
    except Exception:  # noqa: BLE001 - an unreadable profile just means no columns
        return None


def _classify(row, hw):
    if row["flops"] is None or row["bytes"] is None or row["total"] <= 0:
        return {"gflops": None, "gbs": None, "bound": None}
    try:
        from .hardware import classify_op
        c = classify_op(row["flops"], row["bytes"], row["total"], profile=hw)
    except (ImportError, AttributeError):
        return {}
    except (ValueError, TypeError):
        return {"gflops": None, "gbs": None, "bound": None}
    return {"gflops": c.get("gflops"), "gbs": c.get("gbs"), "bound": c.get("bound")}


# ============================================================================ module helpers

def profile(engine=None):
    """A new :class:`Profile`; use as ``with hl.profiler.profile() as prof:``.

    Raises:
        TypeError: ``engine`` neither None nor an Engine.
    """
    return Profile(engine)


_active = None
_active_lock = threading.Lock()


def start(engine=None):
    """Start a module-level profile (``hl.profiler.start()`` ... ``prof = hl.profiler.stop()``).

    Raises:
        RuntimeError: one started by :func:`start` is already running.
    """
    global _active
    with _active_lock:
        if _active is not None:
            raise RuntimeError("profiler.start: a profile is already running; call stop() first")
        _active = Profile(engine).start()
        return _active


def stop():
    """Stop the profile started by :func:`start` and return it (None if none was running)."""
    global _active
    with _active_lock:
        p, _active = _active, None
    return p.stop() if p is not None else None


def is_active():
    """True while a profile started by :func:`start` is running."""
    return _active is not None
