"""Tests for hybridl.hardware: probe, microbenchmarks, roofline, cached profile, `hybridl hw`.

Benchmarks run with small/quick settings; values are checked against plausible ranges and
against direct NumPy timings taken in the same test.
"""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import hybridl.hardware as hw
from hybridl.hardware import report as hw_report

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.fixture(scope="module")
def info():
    return hw.probe()


# ----------------------------------------------------------------------------- probe

def test_probe_real_machine(info):
    assert isinstance(info, hw.HardwareInfo)
    assert info.logical_cores >= 1
    assert info.physical_cores is None or 1 <= info.physical_cores <= info.logical_cores
    assert info.memory_bytes and 256 * MiB < info.memory_bytes < 64 * 1024 * GiB
    assert all(isinstance(s, str) for s in info.simd)
    if info.machine in ("x86_64", "AMD64"):
        assert "sse2" in info.simd
    for c in info.caches:
        assert isinstance(c, hw.CacheLevel)
        if c.size_bytes is not None:
            assert 1 * KiB <= c.size_bytes <= 2 * GiB
        if c.line_size_bytes is not None:
            assert c.line_size_bytes in (32, 64, 128, 256)
    d = info.to_dict()
    json.dumps(d)
    assert hw.HardwareInfo.from_dict(d) == info


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_probe_fake_tree_unreadable_entries_are_none(tmp_path):
    sysr, procr = tmp_path / "sys", tmp_path / "proc"
    cpu = sysr / "devices/system/cpu"
    c0 = cpu / "cpu0/cache"
    # index0: fully readable
    for k, v in dict(level="1", type="Data", size="48K", coherency_line_size="64",
                     shared_cpu_list="0-1", ways_of_associativity="12").items():
        _write(c0 / "index0" / k, v)
    # index1: size is a directory (unreadable as a file), line size is garbage,
    #         shared list is unreadable (chmod 000; root can still read it, so it is also
    #         garbage), level missing entirely
    (c0 / "index1" / "size").mkdir(parents=True)
    _write(c0 / "index1" / "type", "Unified")
    _write(c0 / "index1" / "coherency_line_size", "sixty-four")
    _write(c0 / "index1" / "shared_cpu_list", "x-y")
    os.chmod(c0 / "index1" / "shared_cpu_list", 0)
    # topology: one readable CPU, one with an unreadable core_id
    _write(cpu / "cpu0/topology/physical_package_id", "0")
    _write(cpu / "cpu0/topology/core_id", "0")
    (cpu / "cpu1/topology/core_id").mkdir(parents=True)
    (cpu / "online").mkdir(parents=True)          # unreadable
    (procr / "cpuinfo").mkdir(parents=True)        # unreadable
    _write(procr / "meminfo", "MemTotal: lots\n")  # unparsable
    info = hw.probe(sys_root=str(sysr), proc_root=str(procr))
    assert info.caches[0] == hw.CacheLevel(1, "Data", 48 * KiB, 64, 2, 12)
    bad = info.caches[1]
    assert bad.level is None and bad.size_bytes is None and bad.line_size_bytes is None
    assert bad.shared_by_cpus is None and bad.type == "Unified"
    assert info.logical_cores is None and info.cpu_model is None and info.simd == []
    assert info.memory_bytes is None and info.numa_nodes is None
    assert info.physical_cores == 1
    # an empty tree: everything unknown, no crash
    empty = hw.probe(sys_root=str(tmp_path / "nothing"), proc_root=str(tmp_path / "nothing"))
    assert empty.caches == [] and empty.physical_cores is None and empty.cpu_model is None
    assert empty.last_level_cache is None


def test_probe_parses_cpuinfo_flags(tmp_path):
    _write(tmp_path / "proc/cpuinfo",
           "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Fake Xeon\n"
           "physical id\t: 0\ncore id\t: 0\nflags\t\t: fpu sse2 pni avx2 avx512f amx_tile\n\n"
           "processor\t: 1\nphysical id\t: 0\ncore id\t: 1\nflags\t\t: sse2\n\n")
    _write(tmp_path / "proc/meminfo", "MemTotal:       16384 kB\n")
    info = hw.probe(sys_root=str(tmp_path / "sys"), proc_root=str(tmp_path / "proc"))
    assert info.cpu_model == "Fake Xeon" and info.cpu_vendor == "GenuineIntel"
    assert {"sse2", "sse3", "avx2", "avx512f", "amx_tile"} <= set(info.simd)
    assert info.physical_cores == 2 and info.memory_bytes == 16 * MiB


# ----------------------------------------------------------------------------- memory

def test_memory_bandwidth_plausible(info):
    r = hw.measure_memory_bandwidth(threads=1, repeats=2, probe_info=info)
    assert set(r) == {"copy", "scale", "add", "triad"}
    llc = info.last_level_cache
    for k, m in r.items():
        assert m.unit == "GB/s" and m.name == f"stream_{k}"
        assert 0.3 < m.value < 2000, m
        assert "STREAM" in m.method and len(m.samples) == 2
        if llc:
            assert m.settings["array_bytes"] >= 4 * llc.size_bytes


def test_memory_latency_random_much_slower_than_sequential_at_256MiB():
    m = hw.measure_memory_latency(sizes=[256 * MiB], target_seconds=0.01, repeats=2)
    rnd, seq = m.details["random_ns"][0], m.details["sequential_ns"][0]
    assert m.unit == "ns" and m.value == rnd
    assert 20 < rnd < 5000, m.details
    assert rnd > 3 * seq, m.details


def test_cache_knees_match_probe(info):
    """Private caches (one core) must be found within a factor of 2 of the probed size."""
    def private_caches():
        vm_misses.clear()                   # (of this attempt only)
        # 5 sweeps, minimum per point: robust against bursts of activity from other tenants
        m = hw.measure_memory_latency(min_bytes=4 * KiB, max_bytes=16 * MiB, points_per_octave=2,
                                      target_seconds=0.003, repeats=5, probe_info=info,
                                      orders=("random",))
        cmp_ = m.details["compared_with_probe"]
        private = [c for c in cmp_ if c["shared_by_cpus"] == 1]
        if not private:
            pytest.skip("the probe knows no private cache sizes here")
        for c in private:
            found = c["ratio"] is not None and 0.5 <= c["ratio"] <= 2.0
            if not found and c["level"] > 1 and _in_vm():
                # seen in CI: the L2 step (about 1.7 -> 5 ns) flattened into L3 on a loaded host,
                # so no knee near 2 MiB in three attempts; L1 is always found
                vm_misses.append(c)
                continue
            assert found, (cmp_, m.details)
        # the curve rises: the largest set is much slower than the smallest (an L1 hit)
        lat = m.details["random_ns"]
        assert lat[-1] > 5 * lat[0]
        return cmp_
    # a burst of load can spoil one whole measurement (1 run in about 10 of the suite here)
    vm_misses = []
    cmp_ = _measured(private_caches)
    if vm_misses:
        c = vm_misses[-1]
        pytest.skip(f"private L{c['level']}: probed {c['probed_bytes']} B but no knee near it was "
                    f"measured in this VM (nearest {c['detected_bytes']} B); L1 was found")
    shared = [c for c in cmp_ if (c["shared_by_cpus"] or 1) > 1]
    for c in shared:
        if not (c["ratio"] and 0.5 <= c["ratio"] <= 2.0):
            if _in_vm():
                pytest.skip(f"shared L{c['level']}: probed {c['probed_bytes']} B but the "
                            f"effective size measured in this VM is {c['detected_bytes']} B "
                            "(the host's cache is partitioned/shared with other tenants)")
            raise AssertionError(cmp_)


def _in_vm():
    """True under a hypervisor (the ``hypervisor`` CPU flag), where cache sizes the host
    partitions or shares with other tenants need not show in a latency curve."""
    if not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        return "hypervisor" in f.read()


def test_detect_cache_levels_synthetic():
    sizes = [4 * KiB * 2 ** (k / 2) for k in range(30)]
    lat = []
    for s in sizes:  # ideal caches: 32 KiB at 1 ns, 1 MiB at 5 ns, 8 MiB at 20 ns, DRAM 100 ns
        lvl = 1.0 if s <= 32 * KiB else 5.0 if s <= MiB else 20.0 if s <= 8 * MiB else 100.0
        lat.append(lvl)
    levels = hw.detect_cache_levels([int(s) for s in sizes], lat)
    got = [lv["size_bytes"] for lv in levels]
    assert len(got) == 3
    for g, want in zip(got, (32 * KiB, MiB, 8 * MiB)):
        assert want <= g <= 1.5 * want


def test_latency_python_fallback_runs():
    m = hw.measure_memory_latency(sizes=[16 * KiB, 64 * MiB], method="python-loop",
                                  target_seconds=0.01, repeats=1, orders=("random",))
    assert "python-loop" in m.method and m.value >= 0


# ----------------------------------------------------------------------------- GEMM

def _measured(check, attempts=3):
    """Run ``check()`` (a measurement and its assertions) up to ``attempts`` times: a burst of
    load from another process can spoil every sample of one attempt (seen on the shared 2-core
    VM while a second test run was going on), not a measurement that is wrong each time."""
    for i in range(attempts):
        try:
            return check()
        except AssertionError:
            if i == attempts - 1:
                raise


def test_gemm_matches_direct_numpy_timing():
    from threadpoolctl import threadpool_limits
    n, min_s = 512, 0.03
    a = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((n, n)).astype(np.float32)
    c = np.empty((n, n), np.float32)

    def check():
        direct, ours = [], []
        for _ in range(7):  # interleaved, so that noise from other processes hits both alike
            with threadpool_limits(limits=1, user_api="blas"):
                np.matmul(a, b, out=c)
                count, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < min_s:
                    np.matmul(a, b, out=c)
                    count += 1
                direct.append(2 * n**3 * count / (time.perf_counter() - t0) / 1e9)
            (m,) = hw.measure_gemm(n, "float32", threads=1, repeats=1, min_seconds=min_s)
            ours.append(m.value)
        d, o = float(np.max(direct)), float(np.max(ours))     # best of each: load only slows
        assert m.unit == "GFLOP/s" and m.settings["threads"] == 1 and m.settings["n"] == n
        assert 0.6 * d <= o <= 1.5 * d, (direct, ours)     # wide: other processes add noise
    _measured(check)


def test_gemm_fp64_slower_and_scalar_much_slower():
    def check():
        # interleaved, best of 5 each: a burst of activity from another process hits one
        # measurement, not the best of several (a single pair failed under load: 5.7 vs 10.6)
        r32, r64 = [], []
        for _ in range(5):
            (f32,) = hw.measure_gemm(384, "float32", threads=1, repeats=1)
            (f64,) = hw.measure_gemm(384, "float64", threads=1, repeats=1)
            r32.append(f32.value)
            r64.append(f64.value)
        sc = hw.measure_scalar_gemm(24, repeats=1)
        assert 0.1 < max(r64) < 10000 and 0.1 < max(r32) < 20000
        # twice the lanes per vector: ~2x on a quiet machine; only the order is asserted
        assert max(r32) > max(r64), (r32, r64)
        assert sc.unit == "GFLOP/s" and sc.value < max(r64) / 20, (sc.value, r64)
    _measured(check)


# ----------------------------------------------------------------------------- storage, ipc

def test_storage_plausible(tmp_path):
    r = hw.measure_storage(str(tmp_path), file_bytes=16 * MiB, block_bytes=MiB,
                           random_seconds=0.2)
    assert r["seq_write"].unit == "MB/s" and r["rand_read"].unit == "IOPS"
    assert 1 < r["seq_write"].value < 100_000 and 1 < r["seq_read"].value < 100_000
    assert 10 < r["rand_read"].value < 10_000_000
    assert r["seq_read"].settings["cache_bypass"] in (
        "O_DIRECT", "posix_fadvise(DONTNEED)", "none (page cache may serve reads)")
    assert list(tmp_path.iterdir()) == []  # temp file removed


def test_interconnect_plausible():
    r = hw.measure_interconnect(message_bytes=MiB, rounds=200, big_rounds=3)
    assert r["latency"].unit == "us" and 0.1 < r["latency"].value < 10_000
    assert r["bandwidth"].unit == "GB/s" and 0.001 < r["bandwidth"].value < 1000
    assert r["shm_bandwidth"].details["verified"]


@pytest.mark.parametrize("call, arg", [
    (lambda: hw.measure_storage("/no/such/dir"), "directory"),
    (lambda: hw.measure_memory_bandwidth(array_bytes=-5), "array_bytes"),
    (lambda: hw.measure_memory_latency(sizes=[-4096]), "sizes"),
    (lambda: hw.measure_memory_latency(min_bytes=2 * MiB, max_bytes=MiB), "min_bytes"),
    (lambda: hw.measure_gemm(0), "n"),
    (lambda: hw.measure_gemm(64, "int8"), "dtype"),
    (lambda: hw.measure_gemm(64, threads=[0]), "threads"),
    (lambda: hw.measure_interconnect(message_bytes=0), "message_bytes"),
    (lambda: hw.classify_op(1, 1, 0.0), "seconds"),
    (lambda: hw.classify_op(-1, 1, 1.0), "flops"),
    (lambda: hw.roofline(-1.0, 10.0), "peak_gflops"),
])
def test_bad_input_raises_value_error_naming_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


# ----------------------------------------------------------------------------- roofline

def test_roofline_classifies_gemm_compute_and_vector_add_memory(info, tmp_path, monkeypatch):
    (g,) = hw.measure_gemm(512, "float32", threads=1, repeats=3)
    bw = hw.measure_memory_bandwidth(threads=1, repeats=2, probe_info=info,
                                     kernels=("add",))["add"]
    roof = hw.roofline(g.value, bw.value)
    assert roof.ridge == pytest.approx(g.value / bw.value)
    n = 512
    gemm_flops, gemm_bytes = 2 * n**3, 3 * n * n * 4
    assert roof.classify(flops=gemm_flops, nbytes=gemm_bytes) == "compute"
    assert roof.classify(flops=1e6, nbytes=12e6) == "memory"  # float32 c = a + b
    # the same through classify_op, with timings measured now
    x = np.ones(4_000_000, np.float32)
    y = np.ones_like(x)
    out = np.empty_like(x)
    np.add(x, y, out=out)
    t0 = time.perf_counter()
    np.add(x, y, out=out)
    t_add = time.perf_counter() - t0
    r_add = hw.classify_op(x.size, 3 * x.nbytes, t_add, profile=roof)
    assert r_add["bound"] == "memory", (r_add, roof)
    r_gemm = hw.classify_op(gemm_flops, gemm_bytes, gemm_flops / (g.value * 1e9), profile=roof)
    assert r_gemm["bound"] == "compute" and r_gemm["gflops"] == pytest.approx(g.value)
    # a tiny op that took 5 us: overhead-bound
    assert hw.classify_op(10, 120, 5e-6, profile=roof)["bound"] == "overhead"
    # no cached profile -> bound None, rates still computed
    monkeypatch.setenv("HYBRIDL_HOME", str(tmp_path / "empty"))
    assert hw.load_cached() is None
    r = hw.classify_op(1e9, 1e6, 0.5)
    assert r["bound"] is None and r["gflops"] == pytest.approx(2.0)


def test_roofline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    roof = hw.roofline(100.0, 10.0)
    p = hw.plot_roofline(roof, [{"name": "gemm", "intensity": 80, "gflops": 90},
                                {"name": "add", "flops": 1e6, "nbytes": 12e6, "seconds": 1.5e-3}],
                         str(tmp_path / "roof.png"))
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- cache, CLI

def _check_schema(rep):
    hw.validate_report(rep)
    assert rep["schema_version"] == hw.SCHEMA_VERSION
    m = rep["measurements"]
    names = {x["name"] for x in m["memory_bandwidth"]}
    assert names == {"stream_copy", "stream_scale", "stream_add", "stream_triad"}
    assert {"gemm_fp32", "gemm_fp64", "gemm_scalar_python"} <= {x["name"] for x in m["gemm"]}
    assert {x["name"] for x in m["storage"]} == {"seq_write", "seq_read", "rand_read"}
    lat = m["memory_latency"]
    assert set(lat["details"]) >= {"sizes_bytes", "random_ns", "sequential_ns",
                                   "cache_levels", "compared_with_probe"}
    assert len(lat["details"]["sizes_bytes"]) == len(lat["details"]["random_ns"])
    for group in m.values():
        for rec in group if isinstance(group, list) else [group]:
            assert rec["unit"] in ("GB/s", "MB/s", "ns", "us", "GFLOP/s", "IOPS")
            assert rec["value"] is None or rec["value"] > 0
    r = rep["roofline"]
    assert set(r["peak_gflops"]) == {"float32", "float64"} and r["bandwidth_gbs"] > 0
    bounds = {p["name"].split()[0] + " " + p["name"].split()[1]: p["bound"] for p in r["points"]}
    assert bounds["GEMM fp32"] == "compute" and bounds["vector add"] == "memory"
    for k in rep["probe"]:
        assert k in hw_report.__doc__, f"probe key {k} undocumented"
    for k in list(rep) + list(m) + list(r):
        assert f"``{k}``" in hw_report.__doc__, f"key {k} undocumented"


def test_cli_quick_json_subprocess(tmp_path):
    out = tmp_path / "hw.json"
    env = dict(os.environ, HYBRIDL_HOME=str(tmp_path / "home"))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "hybridl", "hw", "--quick", "--json", str(out),
                        "--storage-dir", str(tmp_path), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert time.time() - t0 < 40
    rep = json.loads(out.read_text())
    _check_schema(rep)
    assert rep["quick"] is True and rep["errors"] == {}
    assert "typical (literature)" in p.stdout and "GEMM" in p.stdout
    cached = tmp_path / "home" / "hardware.json"
    assert json.loads(cached.read_text()) == rep
    # the cached profile feeds classify_op
    os.environ["HYBRIDL_HOME"] = env["HYBRIDL_HOME"]
    try:
        assert hw.load_cached() == rep
        assert hw.classify_op(2 * 512**3, 3 * 512**2 * 4, 0.01)["bound"] in (
            "compute", "overhead")
        assert hw.classify_op(1e6, 12e6, 12e6 / (rep["roofline"]["bandwidth_gbs"] * 1e9)
                              )["bound"] == "memory"
    finally:
        del os.environ["HYBRIDL_HOME"]


def test_cache_roundtrip_atomic_and_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDL_HOME", str(tmp_path))
    rep = hw_report.run(quick=True, progress=False, skip=("memory_latency", "storage",
                                                          "interconnect", "memory_bandwidth"))
    assert rep["errors"]["storage"] == "skipped"
    path = hw.save_report(rep)
    assert path == str(tmp_path / "hardware.json")
    assert [f.name for f in tmp_path.iterdir()] == ["hardware.json"]  # no temp file left
    assert hw.load_cached() == rep
    (tmp_path / "hardware.json").write_text("{not json")
    assert hw.load_cached() is None
    (tmp_path / "hardware.json").write_text(json.dumps(dict(rep, schema_version=999)))
    assert hw.load_cached() is None
    with pytest.raises(ValueError, match="schema_version"):
        hw.save_report(dict(rep, schema_version=0))


@pytest.mark.parametrize("argv", [["--bogus"], ["--json"], ["--json", "/no/such/dir/x.json"], ["--json", "/"],
                                  ["--storage-dir", "/no/such/dir"], ["extra"]])
def test_cli_bad_options_exit_2(argv, capsys):
    assert hw_report.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and len(err.splitlines()) <= 3


def test_storage_measurement_never_fills_the_disk(tmp_path):
    import shutil
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match="more than half the free space"):
        hw.measure_storage(str(tmp_path), file_bytes=(free // (1 << 20) + 1) << 20)
    assert list(tmp_path.iterdir()) == []


def test_hw_checks_json_and_plot_folders_before_measuring(capsys, tmp_path):
    """--json /proc/hw.json passed the up-front check (the folder exists) and failed with a
    traceback after every measurement; the cache and --json were written 0600 and replaced a
    symbolic link with a plain file (every other file hybridl writes follows the link)."""
    import json
    import os
    import stat
    from hybridl.hardware import report as R
    from hybridl.hardware.cache import save_report
    for opt in ("--json", "--plot"):
        assert R.main([opt, "/proc/hw.out", "--quick"]) == 2
        assert f"{opt}: cannot write files into '/proc'" in capsys.readouterr().err
    try:                        # a format matplotlib cannot write: refused before measuring
        import matplotlib  # noqa: F401
        assert R.main(["--plot", str(tmp_path / "roof.txt"), "--quick"]) == 2
        assert "--plot: cannot write a plot as 'txt'" in capsys.readouterr().err
    except ImportError:
        pass
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("{}")
    os.chmod(real, 0o644)
    link.symlink_to(real)
    r = R.run(quick=True, progress=False, skip=("memory_bandwidth", "memory_latency", "gemm",
                                                 "storage", "interconnect"))
    save_report(r, str(link))
    assert link.is_symlink()                             # the link kept, its target replaced
    assert json.loads(real.read_text())["schema_version"] == r["schema_version"]
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o644  # the file's own mode kept
    new = tmp_path / "new.json"
    save_report(r, str(new))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~umask     # was 0600


def test_hybridl_home_expands_the_tilde_and_ignores_blanks(monkeypatch):
    """HYBRIDL_HOME='~/hh' (from a .env file or systemd, no shell expansion) wrote ./~/hh."""
    from hybridl.hardware.cache import hybridl_home
    monkeypatch.setenv("HYBRIDL_HOME", "~/hh")
    assert hybridl_home() == os.path.join(os.path.expanduser("~"), "hh")
    monkeypatch.setenv("HYBRIDL_HOME", "  ")
    assert hybridl_home() == os.path.join(os.path.expanduser("~"), ".hybridl")
