"""Roofline model (Williams, Waterman & Patterson, "Roofline: An Insightful Visual Performance
Model for Multicore Architectures", CACM 52(4), 2009) and per-op bound classification.

Attainable GFLOP/s at arithmetic intensity I (FLOP per byte of memory traffic) is
``min(peak_gflops, bandwidth_gbs * I)``; the ridge point ``peak_gflops / bandwidth_gbs`` is the
intensity at which the two roofs meet: work with I below it is memory-bound, above it
compute-bound.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ._records import check_positive_float

__all__ = ["Roofline", "roofline", "classify_op", "plot_roofline", "OVERHEAD_FACTOR"]

OVERHEAD_FACTOR = 10.0
_DTYPE_KEYS = {"float32": "float32", "fp32": "float32", "f4": "float32", "float64": "float64",
               "fp64": "float64", "f8": "float64", "float16": "float32", "bfloat16": "float32"}


@dataclass
class Roofline:
    """A machine's two roofs.

    Attributes:
        peak_gflops: compute roof, GFLOP/s (10**9 FLOP/s), e.g. measured GEMM peak.
        bandwidth_gbs: memory roof, GB/s (10**9 bytes/s), e.g. STREAM triad/best.
        dtype: the precision the compute roof was measured in.
    """

    peak_gflops: float
    bandwidth_gbs: float
    dtype: str = "float32"

    @property
    def ridge(self) -> float:
        """Ridge point, FLOP/byte: ``peak_gflops / bandwidth_gbs``."""
        return self.peak_gflops / self.bandwidth_gbs

    def attainable_gflops(self, intensity: float) -> float:
        """Roofline bound at ``intensity`` FLOP/byte: min(peak, bandwidth * intensity)."""
        if intensity < 0:
            raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity!r}")
        return min(self.peak_gflops, self.bandwidth_gbs * intensity)

    def classify(self, flops: float = None, nbytes: float = None, intensity: float = None) -> str:
        """``"compute"`` if arithmetic intensity (flops / nbytes, or ``intensity``) is at or
        above the ridge point, else ``"memory"``.

        Raises:
            ValueError: negative flops/nbytes/intensity, or neither intensity nor both counts.
        """
        if intensity is None:
            if flops is None or nbytes is None:
                raise ValueError("classify needs intensity=..., or flops=... and nbytes=...")
            if flops < 0 or nbytes < 0:
                raise ValueError(f"flops and nbytes must be >= 0, got {flops!r}, {nbytes!r}")
            intensity = math.inf if nbytes == 0 else flops / nbytes
        if intensity < 0:
            raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity!r}")
        return "compute" if intensity >= self.ridge else "memory"

    def min_seconds(self, flops: float, nbytes: float) -> float:
        """Roofline time, seconds: max(flops / peak, bytes / bandwidth)."""
        return max(flops / (self.peak_gflops * 1e9), nbytes / (self.bandwidth_gbs * 1e9))

    def to_dict(self) -> dict:
        """{"peak_gflops", "bandwidth_gbs", "ridge_flop_per_byte", "dtype"}."""
        return {"peak_gflops": self.peak_gflops, "bandwidth_gbs": self.bandwidth_gbs,
                "ridge_flop_per_byte": self.ridge, "dtype": self.dtype}


def _dtype_key(dtype) -> str:
    if dtype is None:
        return "float32"
    name = getattr(dtype, "name", None) or str(dtype)
    return _DTYPE_KEYS.get(name, "float32")


def roofline(peak_gflops: float | None = None, bandwidth_gbs: float | None = None,
             profile: dict | None = None, dtype="float32") -> Roofline:
    """Build a :class:`Roofline` from explicit roofs or from a hardware profile.

    Args:
        peak_gflops: compute roof, GFLOP/s. bandwidth_gbs: memory roof, GB/s.
        profile: a report dict as written by ``hybridl hw`` (see
            :mod:`hybridl.hardware.report`); used for any roof not given; if None and a roof
            is missing, the cached profile (:func:`load_cached`) is used.
        dtype: which compute roof to take from the profile ("float32" or "float64").

    Raises:
        ValueError: a roof is not positive, or missing and no profile is available.
    """
    key = _dtype_key(dtype)
    if peak_gflops is None or bandwidth_gbs is None:
        if profile is None:
            from .cache import load_cached
            profile = load_cached()
        if profile is None:
            raise ValueError("roofline needs peak_gflops and bandwidth_gbs, or a hardware "
                             "profile; none is cached (run `hybridl hw` first)")
        roof = profile.get("roofline") or {}
        if peak_gflops is None:
            peaks = roof.get("peak_gflops") or {}
            peak_gflops = peaks.get(key) or peaks.get("float32")
        if bandwidth_gbs is None:
            bandwidth_gbs = roof.get("bandwidth_gbs")
        if peak_gflops is None or bandwidth_gbs is None:
            raise ValueError("the hardware profile has no roofline figures (got "
                             f"peak_gflops={peak_gflops!r}, bandwidth_gbs={bandwidth_gbs!r})")
    return Roofline(check_positive_float("peak_gflops", peak_gflops),
                    check_positive_float("bandwidth_gbs", bandwidth_gbs), key)


def classify_op(flops, nbytes, seconds, profile=None, dtype=None,
                overhead_factor: float = OVERHEAD_FACTOR) -> dict:
    """Achieved rates of one executed op and what bounds it (for the profiler's table).

    Rule: with the machine's roofline (Williams et al. 2009), the roofline time is
    ``t_roof = max(flops / peak, nbytes / bandwidth)``. If the measured ``seconds`` exceed
    ``overhead_factor`` (10) x t_roof, the op is ``"overhead"``-bound (Python dispatch, kernel
    launch, allocation, synchronization dominate: neither FLOPs nor bytes explain the time).
    Otherwise it is ``"compute"`` if its arithmetic intensity flops/nbytes is at or above the
    ridge point (flops/peak >= bytes/bandwidth), else ``"memory"``.

    Args:
        flops: floating-point operations of the op (>= 0). nbytes: bytes it moved (>= 0).
        seconds: its measured duration, seconds (> 0).
        profile: a hardware profile dict (``hybridl hw`` JSON) or a :class:`Roofline`;
            default: :func:`load_cached`; if none exists, ``bound`` is None.
        dtype: the op's dtype, to pick the fp32 or fp64 compute roof (default float32).
        overhead_factor: the multiple of the roofline time beyond which an op is overhead-bound.

    Returns:
        dict with ``gflops`` (achieved GFLOP/s), ``gbs`` (achieved GB/s), ``intensity``
        (FLOP/byte, None if nbytes == 0), ``bound`` ("compute" | "memory" | "overhead" | None)
        and ``roofline_fraction`` (t_roof / seconds, None without a profile).

    Raises:
        ValueError: negative flops/nbytes, non-positive seconds or overhead_factor.
    """
    if flops is None or nbytes is None or flops < 0 or nbytes < 0:
        raise ValueError(f"flops and nbytes must be >= 0, got flops={flops!r}, "
                         f"nbytes={nbytes!r}")
    seconds = check_positive_float("seconds", seconds)
    overhead_factor = check_positive_float("overhead_factor", overhead_factor)
    out = {"gflops": flops / seconds / 1e9, "gbs": nbytes / seconds / 1e9,
           "intensity": (flops / nbytes) if nbytes else None, "bound": None,
           "roofline_fraction": None}
    if isinstance(profile, Roofline):
        roof = profile
    else:
        if profile is None:
            from .cache import load_cached
            profile = load_cached()
        if profile is None:
            return out
        try:
            roof = roofline(profile=profile, dtype=dtype)
        except ValueError:
            return out
    t_roof = roof.min_seconds(flops, nbytes)
    out["roofline_fraction"] = t_roof / seconds
    if seconds > overhead_factor * t_roof:
        out["bound"] = "overhead"
    else:
        out["bound"] = roof.classify(flops=flops, nbytes=nbytes)
    return out


def plot_roofline(roof: Roofline, points=(), path: str = "roofline.png", title=None,
                  extra_roofs=None) -> str:
    """Write a log-log roofline plot (PNG) with measured ops as points.

    Args:
        roof: the machine's :class:`Roofline`.
        points: iterable of dicts ``{"name", "flops", "nbytes", "seconds"}`` (achieved
            GFLOP/s = flops/seconds, intensity = flops/nbytes) or
            ``{"name", "intensity", "gflops"}``.
        path: output PNG path. title: plot title.
        extra_roofs: optional {label: GFLOP/s} drawn as additional horizontal roofs
            (e.g. fp64 peak, 1-thread peak).

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install hybridl[plot]``).
        ValueError: a point lacks the needed keys.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_roofline needs matplotlib: pip install -e \".[plot]\" "
                          "(source checkout)") from e
    pts = []
    for p in points:
        if "intensity" in p and "gflops" in p:
            pts.append((p.get("name", "?"), float(p["intensity"]), float(p["gflops"])))
        elif {"flops", "nbytes", "seconds"} <= set(p):
            pts.append((p.get("name", "?"), p["flops"] / p["nbytes"],
                        p["flops"] / p["seconds"] / 1e9))
        else:
            raise ValueError("each point needs (intensity, gflops) or (flops, nbytes, seconds), "
                             f"got keys {sorted(p)}")
    lo = min([roof.ridge / 100] + [i / 4 for _, i, _ in pts if i > 0])
    hi = max([roof.ridge * 100] + [i * 4 for _, i, _ in pts])
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(xs, [roof.attainable_gflops(x) for x in xs], "k-", lw=2,
              label=f"roofline ({roof.dtype}): {roof.peak_gflops:.1f} GFLOP/s, "
                    f"{roof.bandwidth_gbs:.1f} GB/s")
    ax.axvline(roof.ridge, color="gray", ls=":", label=f"ridge {roof.ridge:.2f} FLOP/byte")
    for label, g in (extra_roofs or {}).items():
        ax.loglog(xs, [min(g, roof.bandwidth_gbs * x) for x in xs], "--", lw=1, label=label)
    for name, i, g in pts:
        ax.loglog([i], [g], "o")
        ax.annotate(name, (i, g), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or "Roofline (Williams, Waterman & Patterson 2009)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    from .._io import atomic_write
    try:        # through a temporary file (format from path's extension, png without one)
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=plot_format(path)))
    finally:
        plt.close(fig)
    return path


def plot_format(path):
    """The image format ``path``'s extension names (``png`` when it has none).

    Raises:
        ValueError: matplotlib cannot write that format."""
    from matplotlib.figure import Figure
    ext = os.path.splitext(str(path))[1][1:].lower() or "png"
    kinds = Figure().canvas.get_supported_filetypes()
    if ext not in kinds:
        raise ValueError(f"cannot write a plot as {ext!r} ({path!r}); formats: "
                         f"{', '.join(sorted(kinds))}")
    return ext
