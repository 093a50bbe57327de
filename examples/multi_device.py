"""Several logical devices in one process: data, pipeline and tensor parallelism.

    python examples/multi_device.py

1. Data parallel: ``split_and_load`` the batch over cpu(0) and cpu(1), one replica per device,
   gradients all-reduced by the ring-allreduce KVStore (``kvstore='device'``); the replicas stay
   identical and training matches one device on the whole batch.
2. The KVStore interface itself: push sums, pull broadcasts.
3. SyncBatchNorm: statistics over both devices (per-device BatchNorm sees half the batch).
4. A two-stage pipeline with 4 micro-batches (1F1B): measured bubble vs (p-1)/(m+p-1).
5. A Megatron-style MLP block: ColumnParallelDense -> ReLU -> RowParallelDense.
"""
import numpy as np

import hybridl as hl
from hybridl import autograd, nn
from hybridl.parallel import (ColumnParallelDense, Pipeline, RowParallelDense,
                              split_and_load)

devices = [hl.cpu(0), hl.cpu(1)]
rng = np.random.default_rng(0)

# 1. data parallel --------------------------------------------------------------------------
train = hl.data.Digits(train=True)
lossf = hl.loss.SoftmaxCrossEntropyLoss()


def train_on(devs, epochs=3, log=True):
    """The MLP trained for ``epochs`` on ``devs`` (the same seed, data and batches)."""
    hl.random.seed(0)
    loader = hl.data.DataLoader(train, 64, shuffle=True, seed=0, last_batch="discard")
    net = hl.models.mlp((64,), 10)
    net.initialize(device=devs)
    net.hybridize()
    trainer = hl.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="device" if len(devs) > 1 else None)
    for epoch in range(epochs):
        tot, n = 0.0, 0
        for x, y in loader:
            xs, ys = split_and_load(x, devs), split_and_load(y, devs)   # 32 samples each
            with autograd.record():
                losses = [lossf(net(a), b) for a, b in zip(xs, ys)]
            autograd.backward(losses)   # async: gradient allreduce starts while backward runs
            trainer.step(x.shape[0])
            tot += sum(float(l.sum().item()) for l in losses)
            n += x.shape[0]
        if log:
            print(f"1. data parallel epoch {epoch + 1}: loss {tot / n:.4f}")
    return net


net = train_on(devices)
w = net.collect_params()["0.weight"].list_data()
print(f"   replicas identical: {np.array_equal(w[0].asnumpy(), w[1].asnumpy())}")
one = train_on([hl.cpu(0)], log=False).collect_params()["0.weight"].data().asnumpy()
print(f"   vs one device on the whole batches: max |weight difference| "
      f"{np.abs(w[0].asnumpy() - one).max():.1e} (float32 rounding)")

# 2. KVStore ---------------------------------------------------------------------------------
kv = hl.kv.create("device")
kv.init("g", hl.nd.zeros((3,)))
kv.push("g", [hl.nd.ones((3,), device=d) * (i + 1) for i, d in enumerate(devices)])
out = [hl.nd.zeros((3,), device=d) for d in devices]
kv.pull("g", out=out)
print(f"2. push [1, 2] then pull -> {[float(o.asnumpy()[0]) for o in out]} on {[o.device for o in out]}")

# 3. SyncBatchNorm ---------------------------------------------------------------------------
x = rng.standard_normal((8, 4)).astype(np.float32)
x[:4] += 5.0                                   # the two devices see different statistics
for cls in (nn.BatchNorm, nn.SyncBatchNorm):
    bn = cls()
    bn.initialize(device=devices)
    with autograd.record():
        ys = [bn(a) for a in split_and_load(x, devices)]
    y = np.concatenate([a.asnumpy() for a in ys])
    print(f"3. {cls.__name__:<14} mean of device 0's outputs {y[:4].mean():+.3f} "
          f"(whole-batch normalization gives {((x - x.mean(0)) / x.std(0))[:4].mean():+.3f})")

# 4. pipeline --------------------------------------------------------------------------------
stages = []
for _ in devices:
    s = nn.HybridSequential()
    s.add(nn.Dense(512, activation="relu", in_units=512), nn.Dense(512, in_units=512))
    stages.append(s)
pipe = Pipeline(stages, devices, num_microbatches=4, schedule="1f1b")
pipe.initialize()
pipe.hybridize()
xb = rng.standard_normal((256, 512)).astype(np.float32)
for _ in range(2):
    pipe.forward_backward(xb, xb, hl.loss.L2Loss(), measure=True)
st = pipe.last_stats
print(f"4. pipeline p=2 m=4 1F1B: bubble measured {st['bubble_measured']:.2f}, theory "
      f"{st['bubble_theory']:.2f}, step {st['makespan_s'] * 1e3:.0f} ms")

# 5. tensor parallel -------------------------------------------------------------------------
col = ColumnParallelDense(64, devices, activation="relu", gather_output=False, in_units=32)
row = RowParallelDense(10, devices, input_is_parallel=True, in_units=64)
col.initialize()
row.initialize()
xt = hl.nd.array(rng.standard_normal((16, 32)).astype(np.float32))
shards = col(xt)
yt = row(shards)
print(f"5. Megatron MLP: shards {[s.shape for s in shards]} on {[s.device for s in shards]} "
      f"-> output {yt.shape} on {yt.device!r}")
