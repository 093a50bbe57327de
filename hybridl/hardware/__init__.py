"""Hardware model: probe the machine, measure it, and reason about it with a roofline.

- :func:`probe` — CPU model, cores, SIMD features, caches, memory, NUMA nodes, GPUs (CuPy).
- ``measure_*`` — microbenchmarks returning :class:`Measurement` records (value, unit,
  method, settings): :func:`measure_memory_bandwidth` (STREAM), :func:`measure_memory_latency`
  (pointer chasing, cache knees), :func:`measure_gemm` / :func:`measure_scalar_gemm`,
  :func:`measure_storage`, :func:`measure_interconnect`.
- :func:`roofline` / :class:`Roofline` (Williams, Waterman & Patterson 2009),
  :func:`classify_op` (compute / memory / overhead bound, for the profiler),
  :func:`plot_roofline`.
- :func:`load_cached` — the profile written by ``hybridl hw`` (schema in
  :mod:`hybridl.hardware.report`), or None.

This package imports nothing else from hybridl.
"""
from ._records import Measurement
from .cache import SCHEMA_VERSION, cache_path, hybridl_home, load_cached, save_report, validate_report
from .compute import gemm_flops, measure_gemm, measure_scalar_gemm
from .interconnect import measure_interconnect
from .memory import (compare_cache_levels, detect_cache_levels, measure_memory_bandwidth,
                     measure_memory_latency)
from .probe import CacheLevel, GPUInfo, HardwareInfo, probe
from .roofline import OVERHEAD_FACTOR, Roofline, classify_op, plot_roofline, roofline
from .storage import measure_storage

__all__ = [
    "probe", "HardwareInfo", "CacheLevel", "GPUInfo", "Measurement",
    "measure_memory_bandwidth", "measure_memory_latency", "measure_gemm",
    "measure_scalar_gemm", "measure_storage", "measure_interconnect",
    "detect_cache_levels", "compare_cache_levels", "gemm_flops",
    "Roofline", "roofline", "classify_op", "plot_roofline", "OVERHEAD_FACTOR",
    "load_cached", "save_report", "validate_report", "cache_path", "hybridl_home",
    "SCHEMA_VERSION",
]
