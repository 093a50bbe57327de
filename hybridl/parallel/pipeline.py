"""Pipeline (model) parallelism with micro-batches: GPipe and 1F1B schedules.

A model is cut into p consecutive *stages*, stage s living on ``devices[s]``; a batch is cut into
m *micro-batches*. Stage s runs forward on micro-batch j as soon as stage s-1 has produced it
(the activation is copied to the next device by an asynchronous engine copy), and backward once
stage s+1 has sent back the gradient of that activation (copied back). Gradients of the stage
parameters are summed over micro-batches (``grad_req='add'``), so the result equals the gradient
of the unsplit model over the whole batch.

Schedules (the order in which each stage takes its forward F and backward B steps):

* ``'gpipe'`` (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism"): all m forwards, then all m backwards. Activations of all m
  micro-batches are alive at the peak.
* ``'1f1b'`` (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", with a flush as in PipeDream-Flush / Megatron-LM): stage s runs ``p - s - 1``
  warm-up forwards, then alternates one forward and one backward, then drains the backwards.
  At most ``p - s`` micro-batches are in flight on stage s (activation memory bounded by p,
  not m); the bubble is the same.

Bubble (idle fraction of the p devices over the step) with equal stage times, both schedules:
``(p - 1) / (m + p - 1)`` (GPipe paper, section 2.3). :meth:`Pipeline.forward_backward` with
``measure=True`` reports the measured fraction beside it (``last_stats``): from the engine's op
events, ``1 - sum_s busy_s / (p * makespan)``.

Every step is pushed to the engine in an order consistent with each stage's schedule; the
engine runs a stage's work on its device's worker as soon as its inputs are there, so stages
overlap exactly as far as the dependencies allow.
"""
import threading
import time

import numpy as np

from .. import autograd
from .. import engine as _engine
from . import split_data, transfer

__all__ = ["Pipeline", "bubble_theory", "schedule", "split_stages"]


def bubble_theory(p, m):
    """GPipe's bubble fraction ``(p - 1) / (m + p - 1)`` for p stages and m micro-batches
    (Huang et al. 2019, section 2.3); the same for 1F1B with a flush."""
    return (p - 1) / (m + p - 1)


def schedule(p, m, kind="gpipe"):
    """Per-stage step lists: ``schedule(p, m)[s]`` is a list of ``('F', j)`` / ``('B', j)``.

    Raises:
        ValueError: unknown kind, p < 1 or m < 1.
    """
    if kind not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule: expected 'gpipe' or '1f1b', got {kind!r}")
    if p < 1 or m < 1:
        raise ValueError(f"schedule: expected p >= 1 and m >= 1, got p={p}, m={m}")
    out = []
    for s in range(p):
        if kind == "gpipe":
            seq = [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
        else:
            w = min(p - s - 1, m)
            seq = [("F", j) for j in range(w)]
            for i in range(m - w):
                seq += [("F", w + i), ("B", i)]
            seq += [("B", j) for j in range(m - w, m)]
        out.append(seq)
    return out


def split_stages(layers, p, weights=None):
    """Cut a list of layers into ``p`` consecutive groups of balanced total ``weights``
    (default: each layer's parameter count + 1). Returns a list of ``p`` lists.

    Raises:
        ValueError: fewer layers than stages.
    """
    layers = list(layers)
    if len(layers) < p:
        raise ValueError(f"split_stages: {len(layers)} layers cannot fill {p} stages")
    if weights is None:
        weights = []
        for b in layers:
            n = 1
            for prm in b.collect_params().values():
                n += int(np.prod(prm.shape)) if prm.shape and all(prm.shape) else 1
            weights.append(n)
    total = float(sum(weights))
    cuts, acc, s = [], 0.0, 1
    for i, w in enumerate(weights):
        acc += w
        left_layers = len(layers) - (i + 1)
        need = p - s
        if s < p and (acc >= total * s / p or left_layers == need) and left_layers >= need:
            cuts.append(i + 1)
            s += 1
    bounds = [0] + cuts + [len(layers)]
    return [layers[bounds[i]:bounds[i + 1]] for i in range(p)]


class _Recorder:
    """Engine profiler hook: keeps (queue key, start, end) of every op; forwards to ``prev``."""

    def __init__(self, prev):
        self.prev, self.events, self.lock = prev, [], threading.Lock()

    def record(self, name, key, thread, t0, t1, meta):
        with self.lock:
            self.events.append((key, t0, t1))
        if self.prev is not None:
            self.prev.record(name, key, thread, t0, t1, meta)


def _busy(intervals):
    tot, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


class Pipeline:
    """``Pipeline(stages, devices, num_microbatches, schedule='gpipe'|'1f1b')``.

    Args:
        stages (list of Block): stage s runs on ``devices[s]``; stage s's output is stage
            s+1's input.
        devices (list of Device or str): one per stage (may repeat).
        num_microbatches (int): m >= 1; the batch is split into m micro-batches (the first
            ``N % m`` get one more sample).
        schedule (str): ``'gpipe'`` or ``'1f1b'`` (module docstring).

    Use::

        pipe = Pipeline([s0, s1], [hl.cpu(0), hl.cpu(1)], 4, '1f1b')
        pipe.initialize()
        trainer = hl.Trainer(pipe.collect_params(), 'sgd', {...})
        losses = pipe.forward_backward(x, y, loss_fn)      # per-sample losses, last device
        trainer.step(x.shape[0])

    Raises:
        ValueError: no stages, ``len(stages) != len(devices)``, m < 1, unknown schedule.
    """

    def __init__(self, stages, devices, num_microbatches=1, schedule="gpipe"):
        from ..device import Device
        stages = list(stages)
        devices = [Device.parse(d) for d in devices]
        if not stages:
            raise ValueError("Pipeline: expected at least one stage")
        if len(stages) != len(devices):
            raise ValueError(f"Pipeline: {len(stages)} stages need {len(stages)} devices, got "
                             f"{len(devices)}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
                or num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected an integer >= 1, got {num_microbatches!r}")
        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule: expected 'gpipe' or '1f1b', got {schedule!r}")
        self.stages, self.devices = stages, devices
        self.num_microbatches, self.schedule = num_microbatches, schedule
        self.last_stats = None

    # ------------------------------------------------------------------ parameters
    def initialize(self, init=None, force_reinit=False):
        """Initialize stage s on ``devices[s]``; gradients accumulate over micro-batches
        (``grad_req='add'``; :meth:`forward_backward` zeroes them first)."""
        for st, d in zip(self.stages, self.devices):
            st.initialize(init, device=d, force_reinit=force_reinit)
            for p in st.collect_params().values():
                if p.grad_req != "null":
                    p.grad_req = "add"
        return self

    def collect_params(self):
        """All stage parameters, named ``'<stage>.<name>'``."""
        from ..nn.parameter import ParameterDict
        out = ParameterDict()
        for i, st in enumerate(self.stages):
            for n, p in st.collect_params().items():
                out[f"{i}.{n}"] = p
        return out

    def hybridize(self, active=True, **kw):
        for st in self.stages:
            st.hybridize(active, **kw)

    def zero_grad(self):
        for st in self.stages:
            st.collect_params().zero_grad()

    # ------------------------------------------------------------------ running
    def _split(self, x, what):
        m = self.num_microbatches
        n = x.shape[0]
        if n < m:
            raise ValueError(f"Pipeline: {what} has {n} samples, fewer than the {m} micro-batches")
        return split_data(x, m, 0, even_split=False)

    def __call__(self, x):
        """Forward only (no schedule needed): micro-batches flow through the stages; the
        outputs are concatenated on the last device. Shape (N, ...) -> stage outputs."""
        from ..ndarray import NDArray, array
        from ..ops.math import concat
        if not isinstance(x, NDArray):
            x = array(x, device=self.devices[0])
        outs = []
        for xb in self._split(x, "x"):
            h = xb
            for st, d in zip(self.stages, self.devices):
                h = st(transfer(h, d))
            outs.append(h)
        return outs[0] if len(outs) == 1 else concat(*outs, axis=0)

    forward = __call__

    def forward_backward(self, x, y, loss_fn, measure=False):
        """Forward and backward of every micro-batch in the schedule's order.

        Args:
            x: (N, ...) NDArray or NumPy input; y: (N, ...) labels.
            loss_fn: ``loss_fn(out, y_mb)`` -> per-sample losses; the backward is that of
                their sum (as ``loss.backward()`` on the unsplit batch).
            measure (bool): wait for the step and record the measured bubble in
                ``self.last_stats`` (``bubble_measured``, ``bubble_theory``, ``makespan_s``,
                ``busy_s`` per device, ``max_in_flight`` per stage).

        Returns:
            (losses, outputs): per-sample losses (N,) and model outputs, both concatenated on
            the last device.

        Raises:
            ValueError: N < num_microbatches.
        """
        from ..ndarray import NDArray, array
        from ..ops.math import concat
        p, m = len(self.stages), self.num_microbatches
        last = self.devices[-1]
        if not isinstance(x, NDArray):
            x = array(x, device=self.devices[0])
        if not isinstance(y, NDArray):
            y = array(y, device=last)
        xs, ys = self._split(x, "x"), [yy.to(last) for yy in self._split(y, "y")]
        self.zero_grad()
        eng = _engine.get_engine()
        rec = None
        if measure:
            eng.waitall()
            rec = _Recorder(eng.profiler)
            eng.profiler = rec
        try:
            t0 = time.perf_counter()
            inp = [[None] * m for _ in range(p)]
            out = [[None] * m for _ in range(p)]
            losses = [None] * m
            seqs = schedule(p, m, self.schedule)
            done = set()
            ptr = [0] * p
            in_flight, peak = [0] * p, [0] * p
            remaining = sum(len(q) for q in seqs)
            while remaining:
                progressed = False
                for s in range(p):
                    if ptr[s] >= len(seqs[s]):
                        continue
                    kind, j = seqs[s][ptr[s]]
                    if kind == "F":
                        if s > 0 and ("F", s - 1, j) not in done:
                            continue
                        self._fwd(s, j, xs, ys, inp, out, losses, loss_fn)
                        in_flight[s] += 1
                        peak[s] = max(peak[s], in_flight[s])
                    else:
                        if ("F", s, j) not in done or (s < p - 1 and ("B", s + 1, j) not in done):
                            continue
                        self._bwd(s, j, inp, out, losses)
                        in_flight[s] -= 1
                    done.add((kind, s, j))
                    ptr[s] += 1
                    remaining -= 1
                    progressed = True
                if not progressed:              # cannot happen with the schedules above
                    raise RuntimeError("Pipeline: the schedule is stuck (internal error)")
            push_s = time.perf_counter() - t0
            if measure:
                eng.waitall()
        finally:
            if rec is not None:
                eng.profiler = rec.prev
        if measure:
            self.last_stats = self._stats(rec.events, p, m, peak, push_s)
        loss = losses[0] if m == 1 else concat(*losses, axis=0)
        outs = out[-1][0] if m == 1 else concat(*out[-1], axis=0)
        return loss, outs

    def _fwd(self, s, j, xs, ys, inp, out, losses, loss_fn):
        d = self.devices[s]
        if s == 0:
            a = transfer(xs[j], d)
        else:
            with autograd.pause():
                a = out[s - 1][j].copyto(d) if out[s - 1][j].device != d else \
                    out[s - 1][j].detach()
            a.attach_grad()
        inp[s][j] = a
        with autograd.record():
            o = self.stages[s](a)
            if s == len(self.stages) - 1:
                loss = loss_fn(o, ys[j])
                if not len(getattr(loss, "shape", ())) or loss.shape[0] != o.shape[0]:
                    raise ValueError(   # (found now, before any backward ran, not at the end)
                        f"Pipeline: loss_fn must return per-sample losses (shape ({o.shape[0]},) "
                        f"for a micro-batch of {o.shape[0]}), got shape "
                        f"{tuple(getattr(loss, 'shape', ()))}; return the losses before any "
                        f"mean or sum")
                losses[j] = loss
        out[s][j] = o

    def _bwd(self, s, j, inp, out, losses):
        if s == len(self.stages) - 1:
            autograd.backward(losses[j])
        elif out[s][j]._ag is None:
            # nothing to differentiate in this stage (its parameters frozen, grad_req='null',
            # and its input the data): its output was not recorded, so no backward to run
            return
        else:
            g = inp[s + 1][j].grad
            with autograd.pause():
                g = g.copyto(self.devices[s]) if g.device != self.devices[s] else g
            autograd.backward(out[s][j], g)

    def _stats(self, events, p, m, peak, push_s):
        devs = list(dict.fromkeys(self.devices))
        mine = [e for e in events if e[0] in devs or (isinstance(e[0], tuple) and len(e[0]) == 2
                                                     and e[0][1] in devs)]
        if not mine:
            return None
        start = min(e[1] for e in mine)
        end = max(e[2] for e in mine)
        span = max(end - start, 1e-12)
        busy = {str(d): _busy([(a, b) for k, a, b in mine if k == d]) for d in devs}
        measured = 1.0 - sum(busy.values()) / (len(devs) * span)
        return {"p": p, "m": m, "schedule": self.schedule, "bubble_measured": measured,
                "bubble_theory": bubble_theory(p, m), "makespan_s": span, "busy_s": busy,
                "max_in_flight": peak, "frontend_push_s": push_s}
