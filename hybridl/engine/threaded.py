"""ThreadedEngine: per-device worker threads, dependency tracking, priority ready queues.

Bookkeeping per :class:`Var`: the last op that writes it and the ops that read it since. A new op
depends on the pending last writer of every Var it reads or writes, and, for a Var it writes, on
the pending readers since that write. When its count of pending dependencies reaches zero it goes
to its device's ready queue (a heap: highest priority first, then push order). Every worker of
that device takes ops from the queue. One lock guards the whole graph: an op's bookkeeping is a
few list operations, much cheaper than the GIL hand-over that follows.
"""
import heapq
import itertools
import os
import threading

from .base import Engine

__all__ = ["ThreadedEngine"]


class _Queue:
    __slots__ = ("heap", "cond", "threads")

    def __init__(self, lock):
        self.heap = []
        self.cond = threading.Condition(lock)
        self.threads = []


class ThreadedEngine(Engine):
    """Asynchronous engine (the default). See :mod:`hybridl.engine.base` for the semantics.

    Args:
        num_workers (int): worker threads per device queue (default 1, or ``HYBRIDL_NUM_WORKERS``).
    """

    name = "threaded"

    def __init__(self, num_workers=None):
        super().__init__()
        if num_workers is None:
            num_workers = int(os.environ.get("HYBRIDL_NUM_WORKERS", "1") or 1)
        if num_workers < 1:
            raise ValueError(f"num_workers: expected an integer >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queues = {}
        self._pending = 0
        self._seq = itertools.count()
        self._stopping = False
        self._worker_ids = set()
        self.on_new_worker = None      # callback(total_worker_count), used for the thread budget

    # ------------------------------------------------------------------ scheduling
    def _push_op(self, op):
        op.seq = next(self._seq)
        with self._lock:
            if self._stopping:
                return
            n = 0
            wids = set()
            for v in op.writes:
                wids.add(id(v))
                w = v._writer
                if w is not None and not w.done and w is not op:   # a Var listed twice
                    w.dependents.append(op)
                    n += 1
                for r in v._readers:
                    if not r.done and r is not op:
                        r.dependents.append(op)
                        n += 1
                v._writer = op
                v._readers = []
            for v in op.reads:
                if id(v) in wids:
                    continue
                w = v._writer
                if w is not None and not w.done:
                    w.dependents.append(op)
                    n += 1
                rl = v._readers
                if len(rl) > 32:
                    rl[:] = [r for r in rl if not r.done]
                rl.append(op)
            op.pending = n
            self._pending += 1
            if n == 0:
                self._enqueue(op)

    def _enqueue(self, op):                 # lock held
        q = self._queues.get(op.key)
        if q is None:
            q = self._queues[op.key] = _Queue(self._lock)
            for i in range(self.num_workers):
                t = threading.Thread(target=self._worker, args=(q,), daemon=True,
                                     name=f"hybridl-{_key_name(op.key)}-w{i}")
                q.threads.append(t)
                t.start()
                self._worker_ids.add(t.ident)
            if self.on_new_worker is not None:
                self.on_new_worker(sum(len(x.threads) for x in self._queues.values()))
        heapq.heappush(q.heap, op)
        q.cond.notify()

    def _worker(self, q):
        lock = self._lock
        op = None
        while True:
            with lock:
                if op is not None:
                    self._finish(op)
                while not q.heap:
                    if self._stopping:
                        return
                    q.cond.wait()
                if self._stopping:
                    q.heap.clear()
                    return
                op = heapq.heappop(q.heap)
            self._execute(op)

    def _finish(self, op):                  # lock held
        op.done = True
        for d in op.dependents:
            d.pending -= 1
            if d.pending == 0:
                self._enqueue(d)
        op.dependents = None
        op.fn = None                        # drop closures (and the arrays they hold) early
        if op.event is not None:
            op.event.set()
        self._pending -= 1
        if self._pending == 0:
            self._idle.notify_all()

    # ------------------------------------------------------------------ waiting
    def _check_not_worker(self):
        if threading.get_ident() in self._worker_ids:
            raise RuntimeError("an engine op waited for an array inside a worker thread; "
                               "ops must not call asnumpy()/wait_to_read() (deadlock)")

    def _wait_op(self, op):
        with self._lock:
            if op.done:
                return
            if op.event is None:
                op.event = threading.Event()
            ev = op.event
        self._check_not_worker()
        ev.wait()

    def _wait_all(self):
        self._check_not_worker()
        with self._lock:
            while self._pending:
                self._idle.wait()

    def shutdown(self, timeout=2.0):
        """Cancel queued ops, let running ones finish (up to ``timeout`` seconds), stop workers."""
        with self._lock:
            self._stopping = True
            for q in self._queues.values():
                q.cond.notify_all()
            threads = [t for q in self._queues.values() for t in q.threads]
        for t in threads:
            t.join(timeout)


def _key_name(key):
    """Thread-name part for a queue key: ``cpu(0)`` for a Device, ``copy-cpu(1)`` for a copy queue
    (so profiler traces show ``hybridl-cpu(0)-w0``, ``hybridl-copy-cpu(1)-w0``)."""
    if isinstance(key, tuple):
        return "-".join(_key_name(k) for k in key)
    return (key if isinstance(key, str) else repr(key)).replace(" ", "")
