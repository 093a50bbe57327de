"""Measure this machine and reason with a roofline: which of three ops (a matmul, a vector add,
a tiny add) is compute-bound, memory-bound or overhead-bound?

Run:  python examples/hardware.py      (a quick measurement, a few seconds)
"""
import time

import numpy as np

import hybridl.hardware as hw

info = hw.probe()
print(f"{info.cpu_model}: {info.physical_cores} cores, SIMD {', '.join(info.simd)}")
for c in info.caches:
    print(f"  L{c.level} {c.type}: {c.size_bytes} bytes, shared by {c.shared_by_cpus} CPU(s)")

(gemm,) = hw.measure_gemm(1024, "float32", threads=info.usable_cpus or 1, repeats=5)
# the roof: the best sustained rate of the four STREAM kernels (triad, with its temporary,
# is the slowest of them in NumPy; a plain add reaches more)
stream = hw.measure_memory_bandwidth(threads=1, repeats=3, probe_info=info)
bw = max(m.value for m in stream.values())
roof = hw.roofline(gemm.value, bw)
print(f"peak {gemm.value:.1f} GFLOP/s, bandwidth {bw:.1f} GB/s, "
      f"ridge {roof.ridge:.1f} FLOP/byte (fractions above 1: this machine was faster than "
      f"when the roof was measured)")



def best_time(f, repeats=5):
    """Best of ``repeats`` runs (seconds): load from other processes only ever adds time."""
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


n = 512
a = np.random.rand(n, n).astype(np.float32)
c = np.empty_like(a)
t = best_time(lambda: np.matmul(a, a, out=c))
print("matmul    :", hw.classify_op(2 * n**3, 3 * a.nbytes, t, profile=roof))
# two distinct inputs and an existing output: 2 reads + 1 write, as the triad it is compared
# with (x + x would read x once, and a fresh output would add page faults), each array 128 MB
# (4x a 32 MB last-level cache, STREAM's rule: smaller ones are partly served from cache)
x = np.random.rand(32_000_000).astype(np.float32)
y = np.random.rand(32_000_000).astype(np.float32)
z = np.empty_like(x)
t = best_time(lambda: np.add(x, y, out=z))
print("vector add:", hw.classify_op(x.size, 3 * x.nbytes, t, profile=roof))
x, y, z = (np.ones(8, np.float32) for _ in range(3))
t = best_time(lambda: np.add(x, y, out=z))
print("tiny add  :", hw.classify_op(x.size, 3 * x.nbytes, t, profile=roof))
