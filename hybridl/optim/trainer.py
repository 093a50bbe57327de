"""Trainer: applies an optimizer to a set of Parameters (MXNet Gluon's Trainer)."""
import functools
import json
import numbers
import threading
import warnings

import numpy as np

from .. import engine as _engine
from ..engine import Var
from ..nn.parameter import Parameter, ParameterDict
from .optimizer import Optimizer, create

__all__ = ["Trainer"]


def check_batch_size(batch_size):
    """Raise ValueError unless ``batch_size`` is a positive real number (not a bool)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) or \
            not 0 < batch_size < float("inf"):
        raise ValueError(f"batch_size: expected a positive finite number, got {batch_size!r}")


_KV_NAMES = ("device", "local", "dist", "dist_sync")


def _check_kvstore(kvstore):
    """``kvstore`` must be None, a KVStore, or one of :data:`_KV_NAMES`.

    Raises:
        ValueError / TypeError: anything else (the message lists the names)."""
    if kvstore is None or isinstance(kvstore, str) and kvstore in _KV_NAMES:
        return
    from ..kv import KVStore
    if isinstance(kvstore, KVStore) or hasattr(kvstore, "pushpull"):
        return                          # a KVStore instance (the dist one too)
    if isinstance(kvstore, str):
        raise ValueError(f"kvstore: expected one of {list(_KV_NAMES)} (or a KVStore), got "
                         f"{kvstore!r}" + ("; asynchronous updates are not provided"
                                           if kvstore.startswith("dist") else ""))
    raise TypeError(f"kvstore: expected None, a name {list(_KV_NAMES)} or a KVStore, got "
                    f"{type(kvstore).__name__} {kvstore!r}")


_STATE_LOCK = threading.Lock()      # creating an optimizer state (Trainer._state)


def _keep_values():
    """The kernel of an op that marks its writes usable, values unchanged."""


def _drop_failed_step(bufs, vs):
    """When a gradient buffer or status of ``bufs`` (their Vars ``vs``) failed this step, zero
    every buffer (the op then clears the errors); otherwise leave them as they are."""
    if any(v.exc is not None for v in vs):
        for g in bufs:
            g._data = np.zeros(g.shape, g.dtype)


class Trainer:
    """``Trainer(params, optimizer='sgd', optimizer_params=None, kvstore=None)``.

    ``step(batch_size)`` rescales gradients by 1 / batch_size and pushes one update op per
    parameter copy. With several devices per parameter, gradients are first aggregated by a
    KVStore (``kvstore='device'`` ring allreduce or ``'local'``; default 'device' when there
    is more than one device; ``'dist'`` across processes), so every copy takes the same update.

    ``update_on_kvstore`` (MXNet's option): None or False (default): the update runs on each
    device after the gradients are aggregated. True, with ``kvstore='dist'``: the store
    applies it, sharded -- where every rank runs on one machine, rank r updates 1/N of the
    parameters in one shared copy that every rank reads
    (:meth:`hybridl.distributed.kvstore.DistKVStore.pushpull_update`; an elementwise
    optimizer: SGD, Adam, AdamW); after ``step`` the gradients then keep this rank's own
    values, as in MXNet. Elsewhere (ranks on several machines, ``HYBRIDL_DIST_SHM=0``, one
    process, ``grad_req='add'``, several devices per process) the default path is taken.

    Raises:
        TypeError: ``params`` is not a ParameterDict, dict or list of Parameters.
        ValueError: unknown optimizer; ``update_on_kvstore=True`` without ``kvstore='dist'``,
            or with an optimizer whose update is not elementwise.
    """

    def __init__(self, params, optimizer="sgd", optimizer_params=None, kvstore=None,
                 update_on_kvstore=None):
        if update_on_kvstore not in (None, False, True):
            raise ValueError(f"update_on_kvstore: expected None, False or True, got "
                             f"{update_on_kvstore!r}")
        if update_on_kvstore and not _is_dist(kvstore):
            raise ValueError(f"update_on_kvstore=True: needs kvstore='dist' (the update sharded "
                             f"over the processes); with kvstore={kvstore!r} the update runs on "
                             f"each device after the aggregation: leave update_on_kvstore None")
        self._update_on_kv = bool(update_on_kvstore)
        if isinstance(params, dict):
            plist = list(params.values())
        elif isinstance(params, (list, tuple)):
            plist = list(params)
        else:
            raise TypeError(f"params: expected a ParameterDict, dict or list of Parameters, got "
                            f"{type(params).__name__}")
        for p in plist:
            if not isinstance(p, Parameter):
                raise TypeError(f"params: expected Parameters, got {type(p).__name__}")
        seen = set()                        # a parameter listed twice is one parameter
        plist = [p for p in plist if not (id(p) in seen or seen.add(id(p)))]
        self._params = [p for p in plist if p.grad_req != "null"]
        self._all_params = plist
        # frozen when the Trainer was made: never updated by it (warned once if unfrozen)
        self._frozen = [p for p in plist if p.grad_req == "null"]
        self._warned_unfrozen = False
        if not self._params:
            warnings.warn("Trainer: no parameter to train (params is empty, or every one has "
                          "grad_req='null'): step() will change nothing", UserWarning, stacklevel=2)
        all_names = [p.name for p in plist]
        if len(set(all_names)) != len(all_names):   # e.g. Parameters of blocks never collected:
            # all 'weight' -> states by position among ALL the parameters given (stable when
            # some are frozen later)
            all_names = [f"{n}#{i}" for i, n in enumerate(all_names)]
        name_of = {id(p): n for p, n in zip(plist, all_names)}
        self._all_names = all_names
        self._names = [name_of[id(p)] for p in self._params]
        if optimizer_params is not None and not isinstance(optimizer_params, dict):
            raise TypeError(f"optimizer_params: expected a dict of hyper-parameters (e.g. "
                            f"{{'learning_rate': 0.1}}), got {type(optimizer_params).__name__} "
                            f"{optimizer_params!r}")
        self._optimizer = create(optimizer, **(optimizer_params or {})) if not isinstance(
            optimizer, Optimizer) else optimizer
        if isinstance(optimizer, Optimizer) and optimizer_params:
            raise ValueError("optimizer_params: must be None when optimizer is an Optimizer instance")
        if self._update_on_kv and not getattr(self._optimizer, "elementwise", False):
            raise ValueError(f"update_on_kvstore=True: the update of "
                             f"{type(self._optimizer).__name__} is not marked elementwise "
                             f"(Optimizer.elementwise), so it cannot be split into blocks")
        self._states = {}
        self._pushing = threading.Lock()    # one step's updates pushed, or a state snapshot
        self._ignore_stale = False
        _check_kvstore(kvstore)     # here, not at the first step
        if not _is_dist(kvstore):
            from ..distributed._backend import launched_size
            n, var = launched_size()
            if n > 1:                   # (hybridl train refuses this without --distributed)
                warnings.warn(f"Trainer: this process is one of {n} started by an MPI launcher "
                              f"({var}={n}) but kvstore={kvstore!r}: each process trains its "
                              f"own model; pass kvstore='dist' for data-parallel training",
                              UserWarning, stacklevel=2)
        self._kv_spec = kvstore
        self._kv = None
        self._kv_ready = False
        self._kv_devices = []
        self._reduced = {}          # (param index, device) -> reduced gradient ('add' params)
        self._rbufs = {}            # param index -> buffers those are reduced into
        if _is_dist(kvstore) and all(p._data is not None for p in self._params):
            self._init_kvstore()    # broadcast rank 0's parameters before the first forward

    # ------------------------------------------------------------------ properties
    @property
    def learning_rate(self):
        """The optimizer's current learning rate."""
        return self._optimizer.lr

    def set_learning_rate(self, lr):
        """Change the learning rate (e.g. from a schedule).

        Raises:
            ValueError: ``lr`` is not a finite number >= 0."""
        self._optimizer.set_learning_rate(lr)

    @property
    def optimizer(self):
        return self._optimizer

    # ------------------------------------------------------------------ stepping
    def _state(self, key, weight):
        st = self._states.get(key)
        if st is None:
            with _STATE_LOCK:       # two threads' first steps (TrainStep called from several
                st = self._states.get(key)      # threads) must share one state, not each
                if st is None:                  # make one and lose the other's updates
                    st = self._states[key] = {"t": 0,
                                              "arrays": self._optimizer.create_state(weight),
                                              "var": Var("optimizer_state")}
        return st

    def _init_kvstore(self, first_step=False):
        """Make the kvstore and register the parameters. A 'dist' store broadcasts rank 0's
        values: at construction when every parameter has its shape; else at the first step
        (``first_step``), after a forward already used each rank's own values -- so the
        ranks' trained values are compared first, and differing ones raise."""
        if first_step and _is_dist(self._kv_spec) and self._params:
            self._check_same_values()
        self._kv_ready = True
        self._kv_devices = [tuple(p.list_device()) for p in self._params]
        multi = any(len(p.list_device()) > 1 for p in self._params)
        spec = self._kv_spec
        if spec is None and not multi:
            return
        from .. import kv
        if spec is None:
            spec = "device"
        self._kv = spec if not isinstance(spec, str) else kv.create(spec)
        if self._params:            # all keys in one call: a 'dist' store checks them at once
            try:
                self._kv.init(list(range(len(self._params))),
                              [p.list_data() for p in self._params])
            except ValueError as e:
                if "already initialized" not in str(e):
                    raise
                raise ValueError(f"Trainer: kvstore: this KVStore object already holds keys "
                                 f"(another Trainer uses it: the keys are the parameter "
                                 f"indices 0..{len(self._params) - 1}); give each Trainer its "
                                 f"own store, e.g. kvstore='device' ({e})") from None
        # frozen parameters and BatchNorm running statistics (grad_req='null': no keys, never
        # reduced) get rank 0's values too, as PyTorch DDP broadcasts parameters and buffers
        rest = [p for p in self._frozen if p._data is not None]
        if rest and hasattr(self._kv, "broadcast_values"):
            self._kv.broadcast_values([(p.name, p.list_data()) for p in rest])

    def _check_same_values(self):
        """Every rank's trainable values equal rank 0's (one small collective: a checksum),
        else DistributedError on every rank: the first step's gradients came from different
        models and no broadcast now can repair it."""
        import zlib

        from ..distributed import _backend
        if _backend.init().size <= 1:       # one process (no launcher): nothing to compare
            return
        vals = [p.list_data()[0] for p in self._params]
        box = {}

        def check(comm):           # the ranks' checksums compared as a layout is
            h = 0
            for v in vals:
                h = zlib.crc32(np.ascontiguousarray(v._data).view(np.uint8), h)
            try:
                _backend.check_layout(comm, f"values crc32 {h}", "trainer.check_initial_values")
                box["same"] = True
            except _backend.DistributedError:
                box["same"] = False
        done = Var("trainer.check_values")
        _backend.push_collective(check, [v._var for v in vals], [done],
                                 "trainer.check_initial_values", 16)
        _engine.wait_for(done)
        if not box["same"]:
            raise _backend.DistributedError(
                "kvstore 'dist': the ranks' parameter values differ at the first step: the "
                "Trainer was made while parameters still had deferred shapes, so rank 0's values "
                "could not be broadcast before the first forward, and each rank's first "
                "gradients came from its own weights. Run one forward before making the "
                "Trainer (e.g. with autograd.predict_mode(): net(x)), or give every rank the "
                "same seed (hl.random.seed(0)) and the same checkpoint")

    def allreduce_grads(self, _batch=None):
        """Sum each parameter's gradients over its device copies (and processes), in place.

        A copy that no backward wrote since the last step (its device got no data) counts as
        zero and is updated like the others, so replicas stay identical. Parameters with
        ``grad_req='add'`` are reduced into separate buffers: each copy's ``.grad`` keeps its
        own accumulated sum (reduced in place, the next step would add the previous sum once
        per device), and the update uses the reduced one."""
        if not self._kv_ready:
            self._init_kvstore(first_step=True)
        elif [tuple(p.list_device()) for p in self._params] != self._kv_devices:
            self._devices_changed()
        self._reduced = {}
        if self._kv is None:
            return
        self._detach_shared()
        if hasattr(self._kv, "local_batch"):    # a 'dist' store: this process's batch (from
            self._kv.local_batch = _batch       # step(); unknown when called directly)
            self._kv.step_number = self._optimizer.num_update + 1
        n = len(self._params)
        # several processes: a parameter this rank's step did not use (its gradient is the
        # previous step's) adds zero and takes the others' step, so replicas stay identical
        ranks = getattr(self._kv, "num_workers", 1) > 1
        for i in reversed(range(n)):          # last layers first, at the highest priority: their
            # gradients are ready first, while backward of earlier layers is still running
            p = self._params[i]
            if p.grad_req == "null":        # frozen after the Trainer was made: not updated
                if ranks:                   # (the ranks' buckets would wait for it forever)
                    raise RuntimeError(
                        f"Trainer.step: parameter {p.name!r} has grad_req='null' but this "
                        f"Trainer (kvstore {self._kv_spec!r}) was made when it had a gradient; "
                        f"with several processes make a new Trainer (on every rank) after "
                        f"freezing parameters")
                continue
            grads = p.list_grad()
            if len(grads) > 1 or ranks:
                fresh = [getattr(g, "_fresh", True) for g in grads]
                if not all(fresh) and (ranks or any(fresh)):
                    # a copy no backward wrote this step (its device got no data: a batch
                    # smaller than the number of devices) adds nothing new to the sum: with
                    # 'write' its buffer holds the previous step's gradient and is zeroed; with
                    # 'add' it holds what it accumulated, which belongs to the sum. Either way
                    # it takes the same step as the others
                    for g, f in zip(grads, fresh):
                        if not f:
                            if p.grad_req != "add":
                                g[:] = 0
                            g._fresh = True
                if p.grad_req == "add":
                    # accumulating buffers keep their own sums: reduced into separate arrays
                    # (reduced in place, the next step would add the sum k times over)
                    outs = self._reduce_bufs(i, grads)
                    self._kv.pushpull(i, grads, out=outs, priority=i)
                    for d, o in zip(p.list_device(), outs):
                        self._reduced[(i, d)] = o
                    continue
            self._kv.pushpull(i, grads, out=grads, priority=i)

    def _devices_changed(self):
        """Parameters were moved (``reset_device``) since the gradient aggregation was planned:
        plan it again for the new devices, and give each new device copy the optimizer state
        of a copy it replaces (replicas are identical, so are their states), as MXNet's
        ``reset_ctx`` resets the trainer's kvstore."""
        if _is_dist(self._kv_spec):
            raise RuntimeError("Trainer: parameters changed devices (reset_device) during "
                               "distributed training; make a new Trainer on every rank")
        for i, p in enumerate(self._params):
            old = self._kv_devices[i] if i < len(self._kv_devices) else ()
            have = [d for d in old if (i, d) in self._states]
            for d, w in zip(p.list_device(), p.list_data()):
                if (i, d) in self._states or not have:
                    continue
                src = self._states[(i, have[0])]
                st = self._state((i, d), w)
                _engine.wait_for(src["var"])        # its pending update first
                st["t"] = src["t"]
                st["arrays"] = {k: np.array(v, copy=True) for k, v in src["arrays"].items()}
            for d in old:
                if d not in p.list_device():
                    self._states.pop((i, d), None)
        self._rbufs = {}
        if self._kv_spec is None or isinstance(self._kv_spec, str):
            self._kv = None                 # a store of the same kind, for the new devices
            self._init_kvstore()
        else:                               # the user's store object: its keys stay; it sums
            self._kv_devices = [tuple(p.list_device()) for p in self._params]   # any copies

    def _reduce_bufs(self, i, grads):
        bufs = self._rbufs
        got = bufs.get(i)
        if got is None or [b.shape for b in got] != [g.shape for g in grads] or \
                [b.device for b in got] != [g.device for g in grads]:
            from .. import nd
            got = bufs[i] = [nd.zeros(g.shape, g.dtype, g.device) for g in grads]
        return got

    def step(self, batch_size, ignore_stale_grad=False):
        """One optimization step: aggregate gradients, then update every parameter copy.

        Args:
            batch_size (int): gradients are scaled by 1 / batch_size (the loss is a sum over
                the batch in the usual ``loss.backward()``). With a ``'dist'`` kvstore this is
                the batch of THIS process: the summed gradients are also divided by the number
                of processes (the mean over the global batch, as Horovod does); processes with
                different batches (an uneven last batch) get the mean over the sum of their
                batches (up to the last bit: each rank rounds its own scale). There, a
                parameter this process's step did not use adds zero to the sum and is updated
                like the others (replicas stay identical; when no process used it, its
                update has a zero gradient: momentum and weight decay still apply).

        Raises:
            ValueError: batch_size <= 0.
            OpError: an op pushed in an earlier step failed (e.g. in that step's backward)
                and no sync point raised its error yet; raised after this step's update was
                pushed. Errors of this step's own ops are left to the program's sync points
                (its loss read after the step). An update skipped because its gradient failed
                leaves the weights as they were.
        """
        check_batch_size(batch_size)
        self._warn_unfrozen("Trainer.step", 3)
        self._ignore_stale = ignore_stale_grad
        accum = self._gate_accumulated()
        if not (self._update_on_kv and not accum and self._step_on_kvstore(batch_size)):
            self.allreduce_grads(_batch=batch_size)
            self.update(batch_size)
        if accum:
            self._drop_failed_accumulation(accum)
        # an error no sync point raised (a failing op on the gradients of an earlier step: its
        # update was skipped, the weights stay usable) is raised here rather than going
        # unnoticed; after this step's update was pushed, so no good step is lost to it
        _engine.get_engine().raise_unreported()

    def _step_on_kvstore(self, batch_size):
        """``update_on_kvstore``: push the sharded update (see the class docstring); False
        when this step cannot take it (it then takes the default path)."""
        if not self._kv_ready:
            self._init_kvstore(first_step=True)
        kv = self._kv
        if kv is None or not getattr(kv, "can_update", lambda: False)() or any(
                p.grad_req != "write" or len(p.list_device()) != 1 for p in self._params):
            return False
        if [tuple(p.list_device()) for p in self._params] != self._kv_devices:
            self._devices_changed()         # (raises: a 'dist' store's devices are fixed)
        opt = self._optimizer
        opt.rescale_grad = getattr(opt, "scale", 1.0) / (batch_size * kv.num_workers)
        opt.num_update += 1
        kv.local_batch = batch_size
        kv.step_number = opt.num_update      # (incremented above: this step, from 1)
        self._reduced = {}
        with self._pushing:
            jobs = {}
            for i, p in enumerate(self._params):
                w = p.list_data()[0]
                g = w.grad
                if not getattr(g, "_fresh", True):
                    g[:] = 0            # not used by this rank's step: adds zero (as allreduce)
                g._fresh = False
                jobs[i] = (g, w, self._state((i, w.device), w), opt.lr * p.lr_mult,
                           opt.wd * p.wd_mult)
            kv.pushpull_update(jobs, opt.step_kernel, opt.rescale_grad, opt.clip_gradient)
        return True

    def _warn_unfrozen(self, who, stacklevel):
        """Warn once that parameters frozen when this Trainer was made and unfrozen since are
        not trained by it."""
        if not self._warned_unfrozen and any(p.grad_req != "null" for p in self._frozen):
            self._warned_unfrozen = True
            names = [p.name for p in self._frozen if p.grad_req != "null"]
            warnings.warn(f"{who}: parameters {names} had grad_req='null' when this "
                          f"Trainer was created and this Trainer does not update them; to train "
                          f"them, create a new Trainer now that they are unfrozen",
                          UserWarning, stacklevel=stacklevel)

    def _gate_accumulated(self):
        """grad_req='add' buffers: a micro-batch whose gradient failed left a buffer's values
        (the good micro-batches' sum) and failed its status Var (autograd.backward). A
        failure the program has seen (raised at a sync point before this step: it caught it
        and went on) is cleared, and the step applies the good sum; an unseen one fails the
        buffers' Vars, so that this step's update is skipped (the naive engine raised in that
        micro-batch's forward or backward, before the step). Returns the buffers."""
        bufs = [w.grad for p in self._params if p.grad_req == "add"
                for w in p.list_data() if w.grad is not None]
        gated = [g for g in bufs if getattr(g, "_status", None) is not None]
        if not gated:
            return bufs
        seen = [g._status for g in gated if g._status.exc is not None and g._status.exc.reported]
        if seen:
            _engine.push(_keep_values, [], seen, gated[0].device, name="keep_accumulated")
        by_dev = {}
        for g in gated:
            by_dev.setdefault(g.device, []).append(g)
        for d, gs in by_dev.items():
            _engine.push(_keep_values, [g._status for g in gs], [g._var for g in gs], d,
                         name="gate_accumulated", priority=1 << 20)
        return bufs

    def _drop_failed_accumulation(self, bufs):
        """After an update skipped for a failed micro-batch: drop the step as a whole, every
        accumulating buffer zeroed (on every device: they hold the step's other
        contributions) and usable again, its status cleared; as if the step had not run."""
        vs = [g._var for g in bufs] + [g._status for g in bufs
                                       if getattr(g, "_status", None) is not None]
        _engine.push(functools.partial(_drop_failed_step, bufs, vs), vs, vs, bufs[0].device,
                     name="drop_failed_accumulation", meta={"runs_on_failed_input": True})

    def _detach_shared(self):
        """After sharded steps (``update_on_kvstore``), an update on this rank alone must not
        write the shared weights and states: they get private copies first."""
        detach = getattr(self._kv, "detach_shared", None)
        if detach is not None:
            detach()

    def update(self, batch_size):
        """Apply the optimizer (no gradient aggregation)."""
        self._detach_shared()
        opt = self._optimizer
        workers = getattr(self._kv, "num_workers", 1) if self._kv is not None else 1
        opt.rescale_grad = getattr(opt, "scale", 1.0) / (batch_size * workers)
        opt.num_update += 1
        with self._pushing:     # a snapshot of the states (save_states) sees whole steps
            self._update(opt)

    def _update(self, opt):
        by_device = {}
        stale = []
        reduced = self._reduced
        for i, p in enumerate(self._params):
            for d, w in zip(p.list_device(), p.list_data()):
                g = w.grad
                if g is None:               # frozen (grad_req='null') after the Trainer was made
                    continue
                if not getattr(g, "_fresh", True):       # not written by backward since the
                    if p.name not in stale:               # last step: the parameter was not
                        stale.append(p.name)              # used (as MXNet, it is not updated)
                    continue
                g._fresh = False
                g = reduced.get((i, d), g)
                by_device.setdefault(d, []).append(
                    (w, g, self._state((i, d), w), p.lr_mult, p.wd_mult))
        if stale and not self._ignore_stale:
            import warnings
            warnings.warn(f"Trainer.step: parameters {stale} got no gradient from backward since "
                          f"the last step (unused in the forward?) and were not updated; pass "
                          f"ignore_stale_grad=True to silence this", RuntimeWarning, stacklevel=4)
        for d, items in by_device.items():      # one update op per device
            opt.update_many(items, d)

    def zero_grad(self):
        """Zero the gradients of all trained parameters."""
        for p in self._params:
            p.zero_grad()

    # ------------------------------------------------------------------ states
    def _wait_states(self):
        """Wait for the pending updates of every optimizer state (not for unrelated work: an
        error of another op, already raised at its sync point, does not stop a checkpoint)."""
        for st in list(self._states.values()):
            _engine.wait_for(st["var"])

    def _snapshot_states(self):
        """(state arrays by file key, update counts by key): copies of every optimizer state
        taken by ONE engine op, at one point of the program order, as
        :func:`hybridl.ndarray.snapshot` does for parameters. Read one by one while another
        thread trains, the states mixed steps, and a state made meanwhile (states are created
        at a parameter's first update) changed the dict being read."""
        with self._pushing, _STATE_LOCK:
            items = list(self._states.items())
            tensors, counts = {}, {}
            if not items:
                return tensors, counts
            names = self._names

            def run():
                for (i, d), st in items:
                    key = f"{names[i]}@{d}"
                    counts[key] = st["t"]
                    for n, a in st["arrays"].items():
                        tensors[f"{key}/{n}"] = np.array(a, order="C", copy=True)
            done = Var("save_states")
            _engine.push(run, [st["var"] for _, st in items], [done], items[0][0][1],
                         name="save_states")
        _engine.wait_for(done)
        return tensors, counts

    def save_states(self, path):
        """Save optimizer state (safetensors: the state arrays; in its metadata the optimizer's
        name, the update counts and the learning rate, not its other settings: a run may
        resume with another momentum or weight decay), written to a temporary file then
        renamed.

        Raises:
            TypeError: ``path`` is not a file path.  FileNotFoundError / IsADirectoryError:
            the directory does not exist, or ``path`` is one.  OSError: the write failed (the
            file under ``path``, if any, is unchanged)."""
        from safetensors.numpy import save_file

        from .._io import check_path
        from ..nn.block import _atomic_write
        path = check_path(path, "save_states: path")
        tensors, counts = self._snapshot_states()
        meta = {"format": "hybridl-trainer", "optimizer": type(self._optimizer).__name__,
                "counts": json.dumps(counts), "num_update": str(self._optimizer.num_update),
                "lr": repr(self._optimizer.lr),
                # every parameter of this trainer, with a state yet or not: load_states tells
                # "no state yet" (reset) from "not a parameter of the saving trainer" (refused)
                "params": json.dumps(list(self._names))}
        _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))

    def load_states(self, path):
        """Load optimizer state saved by :meth:`save_states`.

        States are matched to this trainer's parameters by name (the states of parameters
        frozen since, ``grad_req='null'``, are skipped). A parameter's states on its
        devices are matched in device order when the file has as many copies (so a run saved
        on ``cpu(0)`` resumes on ``cpu(1)``); otherwise (a run saved on 2 devices resumed on 1
        or 3) the saved copies must be identical, as data-parallel replicas' are, and that state
        is given to every copy here. Everything is checked before anything changes.

        Raises:
            TypeError: ``path`` is not a file path.  FileNotFoundError: no such file.
            IsADirectoryError: ``path`` is a directory.
            ValueError: a corrupt file or not a trainer state file; another optimizer or
                other optimizer settings (a state array missing, e.g. SGD saved without
                momentum); names in the file that are not parameters of this trainer, or
                parameters of this trainer that the saving trainer did not have (a trainer
                over another set of parameters, or the model nested differently);
                a state array whose shape differs from its parameter's; a state array this
                optimizer's settings do not use (momentum saved, loaded without); copies on
                another number of devices that differ from each other.
        """
        from safetensors import safe_open

        from .._io import check_file
        path = check_file(path, "load_states: path")
        try:
            with safe_open(path, framework="numpy") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            counts = json.loads(meta.get("counts", "{}"))
            num_update = int(meta.get("num_update", 0))
            lr = float(meta.get("lr", self._optimizer.lr))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"load_states: {path!r} is not a valid trainer state file ({e})") from None
        if meta.get("format") != "hybridl-trainer":
            raise ValueError(f"load_states: {path!r} is not a hybridl trainer state file")
        if meta.get("optimizer") != type(self._optimizer).__name__:
            raise ValueError(f"load_states: {path!r} holds {meta.get('optimizer')} state, this "
                             f"trainer uses {type(self._optimizer).__name__}")
        saved = {}                                  # name -> [key@device, ...] in file order
        for key in counts:
            name, _, _ = key.rpartition("@")
            saved.setdefault(name, []).append(key)
        index = {n: i for i, n in enumerate(self._names)}
        # parameters of this trainer frozen now (grad_req='null'): their state is not needed
        frozen = {n for p, n in zip(self._all_params, self._all_names)
                  if p.grad_req == "null"} - set(index)
        saved = {n: k for n, k in saved.items() if n not in frozen}
        extra = [n for n in saved if n not in index]
        if extra:
            raise ValueError(
                f"load_states: {path!r} holds state for {extra} that are not parameters of this "
                f"trainer (its parameters: {list(self._names)[:8]}"
                f"{' ...' if len(self._names) > 8 else ''}); save and load with trainers over "
                f"the same parameters, named alike")
        try:                        # files of earlier versions do not list their parameters
            listed = set(json.loads(meta["params"])) if "params" in meta else None
        except (TypeError, ValueError):
            raise ValueError(f"load_states: {path!r} is not a valid trainer state file (its "
                             f"parameter list is corrupt)") from None
        missing = [n for n in self._names if listed is not None and n not in listed
                   and n not in frozen]
        if missing:     # their state here would be dropped with nothing in its place
            raise ValueError(
                f"load_states: {path!r} was saved by a trainer without the parameters "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''} of this one, so it holds no "
                f"state for them; save and load with trainers over the same parameters")
        self._wait_states()
        plan = []                                   # (state key, t, {slot: array})
        for name, keys in saved.items():
            i = index[name]
            p = self._params[i]
            devs, ws = p.list_device(), p.list_data()
            if len(keys) not in (1, len(devs)):
                for k in keys[1:]:          # replicas: one state, whatever the device count
                    if counts[k] != counts[keys[0]] or _slots(tensors, k) != _slots(tensors, keys[0]) \
                            or any(not np.array_equal(tensors[f"{k}/{sl}"], tensors[f"{keys[0]}/{sl}"])
                                   for sl in _slots(tensors, k)):
                        raise ValueError(
                            f"load_states: parameter {name!r} has state for {len(keys)} devices "
                            f"in {path!r} and {len(devs)} here, and the saved copies differ, so "
                            f"they cannot be shared out; resume on {len(keys)} devices")
                keys = keys[:1]
            for j, (d, w) in enumerate(zip(devs, ws)):
                key = keys[j if len(keys) > 1 else 0]
                template = self._optimizer.create_state(w)
                unused = sorted(_slots(tensors, key) - set(template))
                if unused:
                    raise ValueError(
                        f"load_states: {path!r} has {unused} state for {name!r} that this "
                        f"{type(self._optimizer).__name__} does not use (saved with other settings, "
                        f"e.g. with momentum); create the trainer with the same optimizer_params")
                arrays = {}
                for slot, t in template.items():
                    a = tensors.get(f"{key}/{slot}")
                    if a is None:
                        raise ValueError(
                            f"load_states: {path!r} has no {slot!r} state for {name!r} (saved by "
                            f"a {meta.get('optimizer')} with other settings, e.g. without "
                            f"momentum); create the trainer with the same optimizer_params")
                    if tuple(a.shape) != tuple(np.shape(t)):
                        raise ValueError(f"load_states: {name!r} state {slot!r} has shape "
                                         f"{tuple(a.shape)} in {path!r}, the parameter here "
                                         f"{tuple(np.shape(t))}")
                    arrays[slot] = a.astype(np.asarray(t).dtype, copy=True)
                plan.append(((i, d), counts[key], arrays))
        self._states = {}
        for skey, t, arrays in plan:
            self._states[skey] = {"t": t, "arrays": arrays, "var": Var("optimizer_state")}
        self._optimizer.num_update = num_update
        self._optimizer.lr = lr


def _slots(tensors, key):
    """The state slot names saved for state ``key`` (``name@device``): tensors ``key/slot``."""
    pre = key + "/"
    return {k[len(pre):] for k in tensors if k.startswith(pre)}


def _is_dist(spec):
    if isinstance(spec, str):
        return spec.startswith("dist")
    return getattr(spec, "num_workers", 1) > 1


_ = ParameterDict

