"""Measure this machine and reason with a roofline: which of two ops is compute-bound?

Run:  python examples/hardware.py      (a quick measurement, ~10 s)
"""
import time

import numpy as np

import hybridl.hardware as hw

info = hw.probe()
print(f"{info.cpu_model}: {info.physical_cores} cores, SIMD {', '.join(info.simd)}")
for c in info.caches:
    print(f"  L{c.level} {c.type}: {c.size_bytes} bytes, shared by {c.shared_by_cpus} CPU(s)")

(gemm,) = hw.measure_gemm(512, "float32", threads=info.usable_cpus or 1, repeats=3)
triad = hw.measure_memory_bandwidth(threads=1, repeats=2, probe_info=info)["triad"]
roof = hw.roofline(gemm.value, triad.value)
print(f"peak {gemm.value:.1f} GFLOP/s, bandwidth {triad.value:.1f} GB/s, "
      f"ridge {roof.ridge:.1f} FLOP/byte")

n = 512
a = np.random.rand(n, n).astype(np.float32)
t0 = time.perf_counter()
a @ a
t = time.perf_counter() - t0
print("matmul   :", hw.classify_op(2 * n**3, 3 * a.nbytes, t, profile=roof))
x = np.random.rand(4_000_000).astype(np.float32)
t0 = time.perf_counter()
x + x
t = time.perf_counter() - t0
print("vector add:", hw.classify_op(x.size, 3 * x.nbytes, t, profile=roof))
x = np.ones(8, np.float32)
t0 = time.perf_counter()
x + x
t = time.perf_counter() - t0
print("tiny add  :", hw.classify_op(x.size, 3 * x.nbytes, t, profile=roof))
