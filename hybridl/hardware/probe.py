"""Probe the machine: CPU model, cores, SIMD features, caches, memory, NUMA nodes, GPUs.

Linux first: everything is read from sysfs (``/sys``) and procfs (``/proc``), whose roots are
parameters so that tests can point the probe at a fake tree. psutil fills gaps (core counts,
total memory) when the real roots are used. Any piece that cannot be read or parsed becomes
``None`` (or an empty list); the probe never raises because of the machine.
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from typing import Optional

from ._records import _jsonable

__all__ = ["CacheLevel", "GPUInfo", "HardwareInfo", "probe", "parse_size"]


@dataclass
class CacheLevel:
    """One cache (as seen by CPU 0).

    Attributes:
        level: 1, 2, 3, ...
        type: ``"Data"``, ``"Instruction"`` or ``"Unified"`` (None if unknown).
        size_bytes: capacity of one instance, bytes.
        line_size_bytes: coherency line size, bytes.
        shared_by_cpus: number of logical CPUs sharing one instance.
        ways: associativity.
    """

    level: Optional[int]
    type: Optional[str]
    size_bytes: Optional[int]
    line_size_bytes: Optional[int] = None
    shared_by_cpus: Optional[int] = None
    ways: Optional[int] = None


@dataclass
class GPUInfo:
    """One GPU found through CuPy: name, memory in bytes, compute capability "major.minor",
    streaming multiprocessor count."""

    index: int
    name: Optional[str]
    memory_bytes: Optional[int]
    compute_capability: Optional[str] = None
    multiprocessors: Optional[int] = None


@dataclass
class HardwareInfo:
    """What :func:`probe` found. Unknown fields are None (lists: empty).

    Attributes:
        system, machine: ``platform.system()`` / ``platform.machine()``, e.g. "Linux", "x86_64".
        cpu_model, cpu_vendor: strings from /proc/cpuinfo.
        physical_cores: distinct (package, core) pairs; logical_cores: online logical CPUs;
        usable_cpus: CPUs this process may run on (sched affinity).
        sockets: physical packages.
        simd: normalized SIMD feature names, e.g. ["sse2", "sse4_2", "avx2", "fma", "avx512f",
            "amx_tile", "neon", "sve"].
        caches: one :class:`CacheLevel` per cache of CPU 0.
        memory_bytes: total RAM, bytes. numa_nodes: NUMA node count.
        max_frequency_mhz: cpufreq maximum (or /proc/cpuinfo "cpu MHz"), MHz.
        gpus: :class:`GPUInfo` list (only when CuPy is installed and a GPU is visible).
    """

    system: Optional[str] = None
    machine: Optional[str] = None
    cpu_model: Optional[str] = None
    cpu_vendor: Optional[str] = None
    physical_cores: Optional[int] = None
    logical_cores: Optional[int] = None
    usable_cpus: Optional[int] = None
    sockets: Optional[int] = None
    simd: list = field(default_factory=list)
    caches: list = field(default_factory=list)
    memory_bytes: Optional[int] = None
    numa_nodes: Optional[int] = None
    max_frequency_mhz: Optional[float] = None
    gpus: list = field(default_factory=list)

    def cache(self, level: int, kind: str = "data") -> Optional[CacheLevel]:
        """The cache at ``level`` holding data (type Data or Unified); None if unknown.
        ``kind="instruction"`` selects the instruction cache instead."""
        want = ("Instruction",) if kind == "instruction" else ("Data", "Unified")
        for c in self.caches:
            if c.level == level and c.type in want:
                return c
        return None

    @property
    def last_level_cache(self) -> Optional[CacheLevel]:
        """The highest-level data/unified cache with a known size, or None."""
        cands = [c for c in self.caches if c.type in ("Data", "Unified") and c.size_bytes
                 and c.level is not None]
        return max(cands, key=lambda c: c.level) if cands else None

    def to_dict(self) -> dict:
        """JSON-serializable dict of every field (see the class docstring)."""
        return _jsonable(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareInfo":
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["caches"] = [CacheLevel(**c) for c in d.get("caches") or []]
        d["gpus"] = [GPUInfo(**g) for g in d.get("gpus") or []]
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text) -> Optional[int]:
    """Parse a sysfs-style size ("32K", "1024 KiB", "8M", "512") into bytes; None if invalid."""
    if text is None:
        return None
    m = _SIZE_RE.match(str(text))
    if not m:
        return None
    mult = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def _read(path: str) -> Optional[str]:
    """File contents stripped, or None if it cannot be read (missing, permission, directory)."""
    try:
        with open(path, "r", errors="replace") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _int(text) -> Optional[int]:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


def _cpulist_count(text) -> Optional[int]:
    """Count CPUs in a sysfs cpu list such as "0-3,8,10-11"; None if unparsable."""
    if text is None or not str(text).strip():
        return None
    n = 0
    try:
        for part in str(text).strip().split(","):
            if "-" in part:
                a, b = part.split("-")
                n += int(b) - int(a) + 1
            else:
                int(part)
                n += 1
    except ValueError:
        return None
    return n


def _listdir(path: str) -> list:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# /proc/cpuinfo flag -> normalized feature name
_X86_FLAGS = {
    "sse": "sse", "sse2": "sse2", "pni": "sse3", "ssse3": "ssse3", "sse4_1": "sse4_1",
    "sse4_2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512_vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16", "avx512_fp16": "avx512_fp16", "avx_vnni": "avx_vnni",
    "amx_tile": "amx_tile", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8",
}
_ARM_FLAGS = {"asimd": "neon", "neon": "neon", "asimdhp": "neon_fp16", "asimddp": "neon_dotprod",
              "sve": "sve", "sve2": "sve2", "sme": "sme", "bf16": "bf16", "i8mm": "i8mm"}


def _parse_cpuinfo(text: str):
    """Return (model, vendor, simd list, sockets, physical cores, mhz) from /proc/cpuinfo."""
    model = vendor = None
    flags: set = set()
    cores = set()
    packages = set()
    mhz = None
    phys = core = None
    for line in text.splitlines() + [""]:
        if not line.strip():
            if phys is not None and core is not None:
                cores.add((phys, core))
            phys = core = None
            continue
        key, _, val = line.partition(":")
        key, val = key.strip().lower(), val.strip()
        if key in ("model name", "cpu model", "hardware") and model is None and val:
            model = val
        elif key in ("vendor_id", "cpu implementer") and vendor is None:
            vendor = val
        elif key in ("flags", "features"):
            flags.update(val.split())
        elif key == "physical id":
            phys = val
            packages.add(val)
        elif key == "core id":
            core = val
        elif key == "cpu mhz" and mhz is None:
            try:
                mhz = float(val)
            except ValueError:
                pass
    table = dict(_X86_FLAGS)
    table.update(_ARM_FLAGS)
    simd = sorted({table[f] for f in flags if f in table})
    return model, vendor, simd, (len(packages) or None), (len(cores) or None), mhz


def _probe_caches(sys_root: str) -> list:
    base = os.path.join(sys_root, "devices/system/cpu/cpu0/cache")
    out = []
    for name in _listdir(base):
        if not name.startswith("index"):
            continue
        d = os.path.join(base, name)
        out.append(CacheLevel(
            level=_int(_read(os.path.join(d, "level"))),
            type=_read(os.path.join(d, "type")),
            size_bytes=parse_size(_read(os.path.join(d, "size"))),
            line_size_bytes=_int(_read(os.path.join(d, "coherency_line_size"))),
            shared_by_cpus=_cpulist_count(_read(os.path.join(d, "shared_cpu_list"))),
            ways=_int(_read(os.path.join(d, "ways_of_associativity"))),
        ))
    out.sort(key=lambda c: (c.level or 99, c.type or ""))
    return out


def _probe_topology(sys_root: str):
    """(logical online CPUs, physical cores, sockets) from sysfs topology; None where unknown."""
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
    logical = _cpulist_count(_read(os.path.join(cpu_dir, "online")))
    cores, pkgs = set(), set()
    for name in _listdir(cpu_dir):
        if not re.fullmatch(r"cpu[0-9]+", name):
            continue
        topo = os.path.join(cpu_dir, name, "topology")
        pkg = _read(os.path.join(topo, "physical_package_id"))
        core = _read(os.path.join(topo, "core_id"))
        if pkg is not None and core is not None:
            cores.add((pkg, core))
            pkgs.add(pkg)
    return logical, (len(cores) or None), (len(pkgs) or None)


def _probe_gpus() -> list:
    try:
        import cupy  # noqa: F401  (optional)
        from cupy.cuda import runtime
    except Exception:
        return []
    gpus = []
    try:
        for i in range(runtime.getDeviceCount()):
            p = runtime.getDeviceProperties(i)
            name = p.get("name")
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            gpus.append(GPUInfo(index=i, name=name, memory_bytes=p.get("totalGlobalMem"),
                                compute_capability=f"{p.get('major')}.{p.get('minor')}",
                                multiprocessors=p.get("multiProcessorCount")))
    except Exception:
        pass
    return gpus


def probe(sys_root: str = "/sys", proc_root: str = "/proc", use_psutil: Optional[bool] = None,
          gpus: bool = True) -> HardwareInfo:
    """Describe this machine's CPU, caches, memory and GPUs.

    Args:
        sys_root: root of sysfs (default ``"/sys"``); tests point it at a fake tree.
        proc_root: root of procfs (default ``"/proc"``).
        use_psutil: fill gaps (core counts, memory) with psutil/os; default True only when both
            roots are the real ones (so a fake tree is not mixed with the real machine).
        gpus: look for GPUs through CuPy (optional dependency; none found without it).

    Returns:
        :class:`HardwareInfo`. Sizes are bytes, frequencies MHz. Anything unreadable or
        unparsable is None — the probe does not raise because of missing files or permissions.

    Raises:
        ValueError: if ``sys_root`` or ``proc_root`` is not a string/path.
    """
    for n, v in (("sys_root", sys_root), ("proc_root", proc_root)):
        if not isinstance(v, (str, os.PathLike)):
            raise ValueError(f"{n} must be a path (str or os.PathLike), got {v!r}")
    sys_root, proc_root = os.fspath(sys_root), os.fspath(proc_root)
    if use_psutil is None:
        use_psutil = os.path.abspath(sys_root) == "/sys" and os.path.abspath(proc_root) == "/proc"

    info = HardwareInfo(system=platform.system() or None, machine=platform.machine() or None)
    cpuinfo = _read(os.path.join(proc_root, "cpuinfo"))
    model = vendor = mhz = None
    simd: list = []
    sockets = phys = None
    if cpuinfo:
        model, vendor, simd, sockets, phys, mhz = _parse_cpuinfo(cpuinfo)
    info.cpu_model, info.cpu_vendor, info.simd = model, vendor, simd

    logical, phys_sys, sockets_sys = _probe_topology(sys_root)
    info.logical_cores = logical
    info.physical_cores = phys_sys or phys
    info.sockets = sockets_sys or sockets
    info.caches = _probe_caches(sys_root)

    meminfo = _read(os.path.join(proc_root, "meminfo"))
    if meminfo:
        m = re.search(r"^MemTotal:\s*([0-9]+)\s*kB", meminfo, re.MULTILINE)
        if m:
            info.memory_bytes = int(m.group(1)) * 1024
    nodes = [n for n in _listdir(os.path.join(sys_root, "devices/system/node"))
             if re.fullmatch(r"node[0-9]+", n)]
    info.numa_nodes = len(nodes) or None
    fmax = _int(_read(os.path.join(sys_root, "devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")))
    info.max_frequency_mhz = fmax / 1000.0 if fmax else mhz

    if use_psutil:
        try:
            import psutil
            info.logical_cores = info.logical_cores or psutil.cpu_count(logical=True)
            info.physical_cores = info.physical_cores or psutil.cpu_count(logical=False)
            info.memory_bytes = info.memory_bytes or int(psutil.virtual_memory().total)
        except Exception:
            pass
        info.logical_cores = info.logical_cores or os.cpu_count()
        try:
            info.usable_cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            info.usable_cpus = info.logical_cores
        if info.cpu_model is None:
            info.cpu_model = platform.processor() or None
        if info.numa_nodes is None and info.system == "Linux":
            info.numa_nodes = 1 if os.path.isdir(os.path.join(sys_root, "devices")) else None
    if gpus:
        info.gpus = _probe_gpus()
    return info
