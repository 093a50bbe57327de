"""The cached hardware profile: ``$HYBRIDL_HOME/hardware.json`` (default ``~/.hybridl``).

The file is the JSON report of ``hybridl hw`` (schema in :mod:`hybridl.hardware.report`),
written atomically (temp file in the same directory + ``os.replace``), so readers never see a
half-written file.
"""
from __future__ import annotations

import json
import os

__all__ = ["SCHEMA_VERSION", "hybridl_home", "cache_path", "save_report", "load_cached",
           "validate_report"]

SCHEMA_VERSION = 1
_memo: dict = {}

# top-level keys and their JSON types (see hybridl.hardware.report for their meaning)
_TOP = {"schema_version": int, "created_utc": str, "quick": bool, "duration_s": (int, float), "group_seconds": dict,
        "platform": dict, "probe": dict, "measurements": dict, "errors": dict, "roofline": dict}
_GROUPS = {"memory_bandwidth": list, "memory_latency": (dict, type(None)), "gemm": list,
           "storage": list, "interconnect": list}
_MEAS_KEYS = {"name", "value", "unit", "method", "settings", "samples", "details"}


def hybridl_home() -> str:
    """``$HYBRIDL_HOME`` if set (``~`` expanded; blank counts as unset), else ``~/.hybridl``
    (not created here)."""
    home = os.environ.get("HYBRIDL_HOME", "").strip()
    return os.path.expanduser(home) if home else os.path.join(os.path.expanduser("~"), ".hybridl")


def cache_path() -> str:
    """Path of the cached profile: ``<hybridl_home()>/hardware.json``."""
    return os.path.join(hybridl_home(), "hardware.json")


def save_report(report: dict, path: str | None = None) -> str:
    """Write ``report`` as JSON atomically (temp file + os.replace); returns the path.

    Args:
        report: a dict following the schema (checked with :func:`validate_report`).
        path: destination; default :func:`cache_path` (its directory is created).

    Raises:
        ValueError: the report does not follow the schema.
        OSError: the file cannot be written.
    """
    from .._io import atomic_write
    validate_report(report)
    path = os.fspath(path or cache_path())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(report, indent=1, allow_nan=False)

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    # (the one writer of hybridl's files: the umask's mode, a link's target replaced)
    atomic_write(path, write)
    return path


def load_cached(path: str | None = None) -> dict | None:
    """The cached hardware profile as a dict, or None if absent, unreadable, not JSON, or of
    another schema version. Memoized on (path, mtime), so the profiler may call it per op."""
    path = os.fspath(path or cache_path())
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_mtime_ns, st.st_size)
    if _memo.get("key") == key:
        return _memo["value"]
    try:
        with open(path) as f:
            data = json.load(f)
        validate_report(data)
    except (OSError, ValueError):
        data = None
    _memo.update(key=key, value=data)
    return data


def validate_report(report) -> None:
    """Check the documented schema (keys and types, not values).

    Raises:
        ValueError: naming the first key that is missing or of the wrong type.
    """
    if not isinstance(report, dict):
        raise ValueError(f"report must be a dict, got {type(report).__name__}")
    if report.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"report['schema_version'] must be {SCHEMA_VERSION}, got "
                         f"{report.get('schema_version')!r}")
    for k, t in _TOP.items():
        if k not in report or not isinstance(report[k], t):
            raise ValueError(f"report[{k!r}] missing or not {t}: {report.get(k)!r:.80}")
    for k, t in _GROUPS.items():
        if not isinstance(report["measurements"].get(k), t):
            raise ValueError(f"report['measurements'][{k!r}] missing or not {t}")
    for k, group in report["measurements"].items():
        items = group if isinstance(group, list) else ([group] if group else [])
        for m in items:
            if not isinstance(m, dict) or set(m) != _MEAS_KEYS:
                raise ValueError(f"report['measurements'][{k!r}] entries must have keys "
                                 f"{sorted(_MEAS_KEYS)}, got {sorted(m) if isinstance(m, dict) else m!r}")
    roof = report["roofline"]
    for k in ("peak_gflops", "bandwidth_gbs", "ridge_flop_per_byte", "points"):
        if k not in roof:
            raise ValueError(f"report['roofline'][{k!r}] missing")
