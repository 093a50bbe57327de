"""``hybridl hw [--quick] [--json PATH] [--plot PATH] [--storage-dir DIR] [--no-cache]``.

Probes and measures this machine, prints the figures beside typical values from the
literature, caches the result at ``$HYBRIDL_HOME/hardware.json`` (default
``~/.hybridl/hardware.json``, written atomically) and optionally writes the same JSON to
``--json PATH`` and a roofline PNG to ``--plot PATH`` (needs matplotlib). Full run: 10-60 s
on a 2-core machine; ``--quick``: a few seconds. Bad options: exit code 2.

JSON schema (``schema_version`` 1). Units: bytes, seconds, GB/s = 10**9 bytes/s,
MB/s = 10**6 bytes/s, GFLOP/s = 10**9 FLOP/s, ns, us.

- ``schema_version`` (int): 1. Readers reject other versions (:func:`load_cached` -> None).
- ``created_utc`` (str): ISO-8601 UTC time the run finished.
- ``quick`` (bool): whether ``--quick`` settings were used.
- ``duration_s`` (float): wall time of the whole run, seconds.
- ``group_seconds`` (dict): measurement group name -> its wall time, seconds.
- ``platform`` (dict): ``python``, ``numpy`` versions (str), ``blas`` (str or null: BLAS
  library and version reported by threadpoolctl), ``hostname`` (str).
- ``probe`` (dict): :class:`HardwareInfo` fields — ``system``, ``machine``, ``cpu_model``,
  ``cpu_vendor`` (str|null), ``physical_cores``, ``logical_cores``, ``usable_cpus``,
  ``sockets`` (int|null), ``simd`` (list of str), ``caches`` (list of {``level``, ``type``,
  ``size_bytes``, ``line_size_bytes``, ``shared_by_cpus``, ``ways``}), ``memory_bytes``,
  ``numa_nodes`` (int|null), ``max_frequency_mhz`` (float|null), ``gpus`` (list of
  {``index``, ``name``, ``memory_bytes``, ``compute_capability``, ``multiprocessors``}).
- ``measurements`` (dict): groups of Measurement records. A record is
  {``name`` (str), ``value`` (float|null), ``unit`` (str), ``method`` (str), ``settings``
  (dict), ``samples`` (list of float, same unit), ``details`` (dict)}.

  - ``memory_bandwidth`` (list): ``stream_copy|scale|add|triad`` (GB/s), once per thread
    count (``settings.threads``), ``settings.array_bytes`` per array.
  - ``memory_latency`` (record|null): ``memory_latency`` (ns, random order at the largest
    working set); ``details``: ``sizes_bytes`` (list of int), ``random_ns``,
    ``sequential_ns`` (lists of float aligned with sizes), ``cache_levels`` (list of
    {``size_bytes``, ``latency_before_ns``, ``latency_after_ns``, ``kind`` "cache" |
    "tlb_or_dram"}), ``compared_with_probe`` (list of {``level``, ``probed_bytes``,
    ``detected_bytes``, ``ratio``, ``shared_by_cpus``}).
  - ``gemm`` (list): ``gemm_fp32`` / ``gemm_fp64`` (GFLOP/s) per BLAS thread count
    (``settings.threads``, ``settings.n``), and ``gemm_scalar_python`` (GFLOP/s).
  - ``storage`` (list): ``seq_write``, ``seq_read`` (MB/s), ``rand_read`` (IOPS);
    ``settings.cache_bypass`` says "O_DIRECT", "posix_fadvise(DONTNEED)" or "none ...".
  - ``interconnect`` (list): ``pipe_latency`` / ``mpi_latency`` (us), ``pipe_bandwidth`` /
    ``mpi_bandwidth``, ``shm_bandwidth`` (GB/s).
- ``errors`` (dict): group name -> error message for any group that failed or was skipped.
- ``roofline`` (dict): ``peak_gflops`` ({"float32": float|null, "float64": float|null},
  best GEMM over thread counts), ``bandwidth_gbs`` (float|null, best STREAM figure over
  kernels and thread counts), ``ridge_flop_per_byte`` ({"float32", "float64"}: peak /
  bandwidth), ``points`` (list of {``name``, ``flops``, ``nbytes``, ``seconds``,
  ``intensity`` (FLOP/byte), ``gflops``, ``bound``}) — the measured ops placed on the roofline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time

from .cache import SCHEMA_VERSION, cache_path, save_report, validate_report

__all__ = ["run", "format_table", "main"]

_MiB, _GiB = 1024**2, 1024**3

LITERATURE = {
    "bandwidth": "DDR4 module 20-25 GB/s; 2-4 channels up to ~100 GB/s",
    "latency": "first access to DRAM ~100 ns",
    "burst": "~0.2 ns per following word in a burst",
    "l1": "L1 32-64 KB per core",
    "l2": "L2 256-512 KB per core",
    "l3": "L3 4-8 MB typical (shared)",
    "seq_io": "HDD 100-200 MB/s; SSD 1-3 GB/s",
    "iops": "HDD ~100 IOPS; SSD 100k-500k IOPS",
    "interconnect": "PCIe 4.0 x16 32 GB/s; NVLink 300 Gbit/s (37.5 GB/s) per link",
    "gemm": "one core: 2 FMA units x SIMD width x 2 FLOP x GHz (e.g. AVX2 fp32: 32 FLOP/cycle)",
}

QUICK = dict(lat_max=64 * _MiB, lat_target=0.004, lat_repeats=2, bw_repeats=2, gemm_n=512,
             gemm_repeats=3, io_bytes=32 * _MiB, io_seconds=0.3, ic_rounds=500, ic_big=5,
             ic_msg=4 * _MiB)
FULL = dict(lat_max=1 * _GiB, lat_target=0.01, lat_repeats=3, bw_repeats=5, gemm_n=1024,
            gemm_repeats=5, io_bytes=256 * _MiB, io_seconds=1.0, ic_rounds=2000, ic_big=20,
            ic_msg=16 * _MiB)


def _platform_info() -> dict:
    import numpy as np
    blas = None
    try:
        from threadpoolctl import threadpool_info
        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                blas = f"{lib.get('internal_api')} {lib.get('version')}"
                break
    except Exception:
        pass
    return {"python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "hostname": socket.gethostname()}


def run(quick: bool = False, storage_dir: str | None = None, progress: bool = True,
        skip=()) -> dict:
    """Probe and measure everything; return the report dict (schema: module docstring).

    Args:
        quick: smaller sizes and fewer repeats (seconds instead of about ten on a 2-core machine).
        storage_dir: directory for the storage test's temp file (default: temp dir).
        progress: show a tqdm progress bar on stderr.
        skip: group names to leave out ("memory_bandwidth", "memory_latency", "gemm",
            "storage", "interconnect"); recorded in ``errors`` as skipped.

    Raises:
        ValueError: storage_dir is not an existing writable directory; unknown skip name.
    """
    from . import compute, interconnect, memory, storage
    from .probe import probe
    from .roofline import roofline as make_roof
    groups = ("memory_bandwidth", "memory_latency", "gemm", "storage", "interconnect")
    for s in skip:
        if s not in groups:
            raise ValueError(f"skip entries must be among {groups}, got {s!r}")
    if storage_dir is not None and not os.path.isdir(storage_dir):
        raise ValueError(f"storage_dir must be an existing directory, got {storage_dir!r}")
    cfg = QUICK if quick else FULL
    t_start = time.perf_counter()
    info = probe()
    ncpu = info.usable_cpus or info.logical_cores or 1
    threads = sorted({1, ncpu})
    weights = {"memory_bandwidth": 10, "memory_latency": 40, "gemm": 15, "storage": 20,
               "interconnect": 10}
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=sum(weights.values()), desc="hybridl hw", file=sys.stderr,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} {postfix}",
                       leave=False)
        except ImportError:
            bar = None
    meas = {"memory_bandwidth": [], "memory_latency": None, "gemm": [], "storage": [],
            "interconnect": []}
    errors = {}
    group_seconds = {}
    state = {"done": 0.0}

    def advance(group, frac):
        if bar is None:
            return
        target = state["base"] + weights[group] * frac
        bar.update(target - state["done"])
        state["done"] = target

    def step(group, fn):
        state["base"] = state["done"]
        if bar is not None:
            bar.set_postfix_str(group)
        t0 = time.perf_counter()
        if group in skip:
            errors[group] = "skipped"
        else:
            try:
                fn()
            except Exception as e:  # one failing group must not lose the others
                errors[group] = f"{type(e).__name__}: {e}"
        group_seconds[group] = time.perf_counter() - t0
        advance(group, 1.0)

    def bw():
        for t in threads:
            r = memory.measure_memory_bandwidth(threads=t, repeats=cfg["bw_repeats"],
                                                probe_info=info)
            meas["memory_bandwidth"] += [m.to_dict() for m in r.values()]

    def lat():
        m = memory.measure_memory_latency(max_bytes=cfg["lat_max"],
                                          target_seconds=cfg["lat_target"],
                                          repeats=cfg["lat_repeats"], probe_info=info,
                                          progress=lambda f: advance("memory_latency", f))
        meas["memory_latency"] = m.to_dict()

    def gemm():
        for dt in ("float32", "float64"):
            meas["gemm"] += [m.to_dict() for m in compute.measure_gemm(
                cfg["gemm_n"], dt, threads=threads, repeats=cfg["gemm_repeats"])]
        meas["gemm"].append(compute.measure_scalar_gemm(32 if quick else 48).to_dict())

    def io():
        r = storage.measure_storage(storage_dir, file_bytes=cfg["io_bytes"],
                                    random_seconds=cfg["io_seconds"])
        meas["storage"] = [m.to_dict() for m in r.values()]

    def ic():
        r = interconnect.measure_interconnect(message_bytes=cfg["ic_msg"],
                                              rounds=cfg["ic_rounds"], big_rounds=cfg["ic_big"])
        meas["interconnect"] = [m.to_dict() for m in r.values()]

    try:
        for g, fn in (("memory_bandwidth", bw), ("memory_latency", lat), ("gemm", gemm),
                      ("storage", io), ("interconnect", ic)):
            step(g, fn)
    finally:
        if bar is not None:
            bar.close()

    # roofline
    peaks = {}
    for dt, tag in (("float32", "gemm_fp32"), ("float64", "gemm_fp64")):
        vals = [m["value"] for m in meas["gemm"] if m["name"] == tag and m["value"]]
        peaks[dt] = max(vals) if vals else None
    bws = [m["value"] for m in meas["memory_bandwidth"] if m["value"]]
    bandwidth = max(bws) if bws else None
    ridge = {dt: (p / bandwidth if p and bandwidth else None) for dt, p in peaks.items()}
    points = []
    roof = None
    if peaks["float32"] and bandwidth:
        roof = make_roof(peaks["float32"], bandwidth)
        best = max((m for m in meas["gemm"] if m["name"] == "gemm_fp32" and m["value"]),
                   key=lambda m: m["value"], default=None)
        if best is not None:
            n = best["settings"]["n"]
            flops = 2.0 * n**3
            points.append({"name": f"GEMM fp32 n={n} {best['settings']['threads']}T",
                           "flops": flops, "nbytes": 3.0 * n * n * 4,
                           "seconds": flops / (best["value"] * 1e9)})
        for m in meas["memory_bandwidth"]:
            if m["settings"]["threads"] == ncpu and m["name"] in ("stream_add", "stream_triad"):
                ne = m["settings"]["elements"]
                nb = m["settings"]["bytes_per_element"] * ne
                flops = (2.0 if m["name"] == "stream_triad" else 1.0) * ne
                points.append({"name": m["name"].replace("stream_", "vector ") + " (f64)",
                               "flops": flops, "nbytes": float(nb),
                               "seconds": nb / (m["value"] * 1e9)})
        for p in points:
            p["intensity"] = p["flops"] / p["nbytes"]
            p["gflops"] = p["flops"] / p["seconds"] / 1e9
            p["bound"] = roof.classify(flops=p["flops"], nbytes=p["nbytes"])
    report = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "duration_s": time.perf_counter() - t_start,
        "group_seconds": group_seconds,
        "platform": _platform_info(),
        "probe": info.to_dict(),
        "measurements": meas,
        "errors": errors,
        "roofline": {"peak_gflops": peaks, "bandwidth_gbs": bandwidth,
                     "ridge_flop_per_byte": ridge, "points": points},
    }
    validate_report(report)
    return report


def _fmt_bytes(b):
    if b is None:
        return "?"
    for unit, f in (("GiB", _GiB), ("MiB", _MiB), ("KiB", 1024)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b} B"


def _get(report, group, name, **settings):
    items = report["measurements"].get(group) or []
    if isinstance(items, dict):
        items = [items]
    for m in items:
        if m["name"] == name and all(m["settings"].get(k) == v for k, v in settings.items()):
            return m
    return None


def format_table(report: dict) -> str:
    """The human-readable table: measured figure | typical value from the literature."""
    p = report["probe"]
    rows = []

    def row(what, measured, typical=""):
        rows.append((what, measured, typical))

    ncpu = p.get("usable_cpus") or p.get("logical_cores") or 1
    row("CPU", f"{p.get('cpu_model')} ({p.get('physical_cores')} cores, "
               f"{p.get('logical_cores')} logical, {p.get('sockets')} socket(s))")
    row("SIMD", ", ".join(p.get("simd") or []) or "?")
    row("Memory", f"{_fmt_bytes(p.get('memory_bytes'))}, NUMA nodes: {p.get('numa_nodes')}")
    for g in p.get("gpus") or []:
        row(f"GPU {g['index']}", f"{g['name']}, {_fmt_bytes(g['memory_bytes'])}, "
                                 f"cc {g['compute_capability']}")
    lat = report["measurements"].get("memory_latency")
    cmp_ = {c["level"]: c for c in (lat or {}).get("details", {}).get("compared_with_probe", [])}
    for c in p.get("caches") or []:
        if c["type"] not in ("Data", "Unified"):
            continue
        det = cmp_.get(c["level"], {}).get("detected_bytes")
        lit = LITERATURE.get(f"l{c['level']}", "")
        row(f"L{c['level']} cache", f"{_fmt_bytes(c['size_bytes'])} probed (shared by "
                                    f"{c['shared_by_cpus']}), knee at {_fmt_bytes(det)}", lit)
    for t in sorted({1, ncpu}):
        best = [m for m in report["measurements"]["memory_bandwidth"]
                if m["settings"]["threads"] == t and m["value"]]
        if best:
            txt = ", ".join(f"{m['name'][7:]} {m['value']:.1f}" for m in best)
            row(f"Memory bandwidth {t}T", txt + " GB/s", LITERATURE["bandwidth"])
    if lat and lat.get("value"):
        d = lat["details"]
        row(f"Latency random @ {_fmt_bytes(d['sizes_bytes'][-1])}", f"{lat['value']:.1f} ns",
            LITERATURE["latency"])
        seq = d.get("sequential_ns")
        if seq:
            row("Latency sequential (per line)", f"{seq[-1]:.2f} ns (dependent loads)")
        for lv in d.get("cache_levels", []):
            row(f"  knee @ {_fmt_bytes(lv['size_bytes'])} ({lv['kind']})",
                f"{lv['latency_before_ns']:.1f} -> {lv['latency_after_ns']:.1f} ns")
    copy = _get(report, "memory_bandwidth", "stream_copy", threads=1)
    if copy and copy["value"]:
        row("Streaming, per 8-byte word", f"{8 / copy['value']:.2f} ns (1 thread copy)",
            LITERATURE["burst"])
    for tag in ("gemm_fp32", "gemm_fp64"):
        for m in report["measurements"]["gemm"]:
            if m["name"] == tag:
                row(f"GEMM {tag[5:]} n={m['settings']['n']} {m['settings']['threads']}T",
                    f"{m['value']:.1f} GFLOP/s", LITERATURE["gemm"] if tag == "gemm_fp32" else "")
    sc = _get(report, "gemm", "gemm_scalar_python")
    g1 = _get(report, "gemm", "gemm_fp64", threads=1)
    if sc and sc["value"]:
        ratio = f" (BLAS 1T fp64 is {g1['value'] / sc['value']:.0f}x faster)" if g1 else ""
        row("GEMM scalar Python loop", f"{sc['value'] * 1e3:.1f} MFLOP/s{ratio}")
    for name, lit in (("seq_write", "seq_io"), ("seq_read", "seq_io"), ("rand_read", "iops")):
        m = _get(report, "storage", name)
        if m and m["value"]:
            v = f"{m['value']:.0f} {m['unit']}"
            row(f"Storage {name}", f"{v} [{m['settings']['cache_bypass']}]", LITERATURE[lit])
    for m in report["measurements"]["interconnect"]:
        if m["value"] is not None:
            row(f"Process-to-process {m['name']}", f"{m['value']:.3g} {m['unit']}",
                LITERATURE["interconnect"] if "bandwidth" in m["name"] else "")
    r = report["roofline"]
    if r.get("bandwidth_gbs"):
        for dt in ("float32", "float64"):
            if r["ridge_flop_per_byte"].get(dt):
                row(f"Roofline ridge {dt}", f"{r['ridge_flop_per_byte'][dt]:.1f} FLOP/byte "
                    f"({r['peak_gflops'][dt]:.0f} GFLOP/s / {r['bandwidth_gbs']:.1f} GB/s)")
        for pt in r["points"]:
            row(f"  {pt['name']}", f"I={pt['intensity']:.3g} FLOP/B, {pt['gflops']:.3g} "
                                   f"GFLOP/s -> {pt['bound']}-bound")
    for g, e in report.get("errors", {}).items():
        row(f"({g})", e)
    w0 = max(len(a) for a, _, _ in rows)
    # the measured column is as wide as its rows that have a typical value beside them (a
    # long row without one, the SIMD list, must not push that column off the screen)
    w1 = max([len(b) for _, b, c in rows if c] or [len("measured")])
    lines = [f"{'':<{w0}}  {'measured':<{w1}}  typical (literature)",
             "-" * (w0 + w1 + 24)]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    lines.append(f"({'quick' if report['quick'] else 'full'} run, "
                 f"{report['duration_s']:.1f} s)")
    return "\n".join(lines)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parser():
    p = _Parser(prog="hybridl hw", description="Probe and measure this machine: caches, "
                "memory bandwidth and latency, GEMM, storage, process-to-process transfer, "
                "roofline. Results are cached in $HYBRIDL_HOME/hardware.json.")
    p.add_argument("--quick", action="store_true", help="smaller, faster run (a few seconds)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON report to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a roofline PNG (needs matplotlib)")
    p.add_argument("--storage-dir", metavar="DIR", help="directory for the storage test file")
    p.add_argument("--no-cache", action="store_true",
                   help=f"do not update the cached profile ({cache_path()})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    """Entry point of ``hybridl hw``; returns the exit code (0 ok, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        for opt, path in (("--json", args.json), ("--plot", args.plot)):
            if path is not None:
                from .._io import _check_target, probe_write, resolve
                try:                     # checked before measuring for minutes, not after
                    _check_target(resolve(path))
                except (ValueError, OSError) as e:
                    raise _UsageError(f"{opt}: {e}") from None
                try:                     # a directory it cannot write into (/proc, read-only)
                    probe_write(resolve(path), opt)
                except OSError as e:
                    raise _UsageError(str(e)) from None
        if args.storage_dir is not None and not os.path.isdir(args.storage_dir):
            raise _UsageError(f"--storage-dir: {args.storage_dir!r} is not a directory")
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise _UsageError("--plot needs matplotlib: pip install -e \".[plot]\" (source checkout)")
            from .roofline import plot_format
            try:
                plot_format(args.plot)
            except ValueError as e:
                raise _UsageError(f"--plot: {e}") from None
    except _UsageError as e:
        from .._argparse import usage_error
        return usage_error("hybridl hw", e)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    # a bar only on a terminal (as `hybridl train`): not into a log file or a pipe
    report = run(quick=args.quick, storage_dir=args.storage_dir,
                 progress=not args.no_progress and sys.stderr.isatty())
    print(format_table(report))
    if not args.no_cache:
        try:
            print(f"cached: {save_report(report)}")
        except OSError as e:
            print(f"hybridl hw: warning: could not write the cache: {e}", file=sys.stderr)
    if args.json:
        save_report(report, args.json)
        print(f"json: {args.json}")
    if args.plot:
        from .roofline import plot_roofline, roofline
        r = report["roofline"]
        if r["peak_gflops"].get("float32") and r["bandwidth_gbs"]:
            roof = roofline(r["peak_gflops"]["float32"], r["bandwidth_gbs"])
            extra = {}
            if r["peak_gflops"].get("float64"):
                extra[f"fp64 peak {r['peak_gflops']['float64']:.0f} GFLOP/s"] = \
                    r["peak_gflops"]["float64"]
            plot_roofline(roof, r["points"], args.plot, extra_roofs=extra)
            print(f"plot: {args.plot}")
        else:
            print("hybridl hw: warning: no roofline figures, plot not written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
