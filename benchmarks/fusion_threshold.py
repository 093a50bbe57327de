"""Measure the element count from which the fused elementwise kernel (numexpr, what the
``fuse_elementwise`` pass emits) beats NumPy op by op, on this machine.

    python benchmarks/fusion_threshold.py

Prints the timings per size and the threshold to use with
``hl.graph.set_fusion_threshold(n)`` or ``HYBRIDL_FUSION_THRESHOLD=n``.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybridl.graph import passes  # noqa: E402


def main(argv=None):
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    thr, rows = passes.measure_fusion_threshold()
    print("chain relu(tanh(a * b + a)), float32; medians")
    print(f"{'elements':>10} {'numpy us':>10} {'fused us':>10} {'numpy/fused':>12}")
    for n, a, b in rows:
        print(f"{n:>10} {a * 1e6:>10.1f} {b * 1e6:>10.1f} {a / b:>12.2f}")
    print(f"threshold: {thr} elements (current default {passes.fusion_threshold()})")


if __name__ == "__main__":
    main()
