"""Process-to-process bandwidth and latency: MPI ping-pong, else pipes / shared memory."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np

from ._records import Measurement, check_positive_int, median

__all__ = ["measure_interconnect"]

_MiB = 1024**2


def _mp_context():
    # fork avoids re-importing the parent's modules in the child (fast, and independent of
    # whatever the rest of the package imports); spawn where fork is unavailable or unsafe.
    if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _pipe_echo(conn, rounds, nbytes_big, big_rounds):
    """Child: echo small messages, then receive big ones and acknowledge each."""
    for _ in range(rounds):
        conn.send_bytes(conn.recv_bytes())
    for _ in range(big_rounds):
        conn.recv_bytes()
        conn.send_bytes(b"k")
    conn.close()


def _shm_echo(name, nbytes, rounds, conn):
    """Child: copy the parent's block (first half) into the second half of the segment."""
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=name)
    try:
        arr = np.ndarray((2, nbytes), dtype=np.uint8, buffer=shm.buf)
        for _ in range(rounds):
            conn.recv_bytes()
            np.copyto(arr[1], arr[0])
            conn.send_bytes(b"k")
        del arr
    finally:
        shm.close()
        conn.close()


def _under_mpi() -> bool:
    env = os.environ
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                  "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD"))


def _mpi_pingpong(rounds, nbytes, big_rounds):
    from mpi4py import MPI  # optional
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        return None
    rank = comm.Get_rank()
    small = np.zeros(1, dtype=np.uint8)
    big = np.zeros(nbytes, dtype=np.uint8)
    res = {}
    for label, buf, n in (("latency", small, rounds), ("bandwidth", big, big_rounds)):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(n):
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            elif rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
        res[label] = (MPI.Wtime() - t0) / n
    if rank != 0:
        return None
    return {"latency": Measurement("mpi_latency", res["latency"] / 2 * 1e6, "us",
                                   "MPI ping-pong (Send/Recv of 1 byte), half round trip",
                                   {"rounds": rounds, "ranks": 2}),
            "bandwidth": Measurement("mpi_bandwidth", 2 * nbytes / res["bandwidth"] / 1e9,
                                     "GB/s", "MPI ping-pong of large messages, 2 x bytes per "
                                     "round trip", {"message_bytes": nbytes,
                                                    "rounds": big_rounds})}


def measure_interconnect(message_bytes: int = 16 * _MiB, rounds: int = 2000,
                         big_rounds: int = 20, use_mpi: bool | None = None) -> dict:
    """Bandwidth (GB/s, 10**9 bytes/s) and one-way latency (microseconds) between two
    processes on this machine.

    Method: when running under mpiexec with >= 2 ranks and mpi4py is installed (or
    ``use_mpi=True``), an MPI ping-pong between ranks 0 and 1 (latency = half the round trip
    of a 1-byte message, as in the OSU/Intel MPI benchmarks; bandwidth = 2 x message bytes
    per round trip; only rank 0 returns figures). Otherwise a child process is started with
    multiprocessing and: (1) pipe latency = half the round trip of a 1-byte message over a
    ``multiprocessing.Pipe``; (2) pipe bandwidth = bytes of ``message_bytes`` messages sent
    one way, acknowledged by 1 byte; (3) shared-memory bandwidth = the child copies a
    ``message_bytes`` block from one half of a ``multiprocessing.shared_memory`` segment into
    the other (counted as read + write = 2 x bytes), synchronized over the pipe.
    Value of each record = median over rounds (pipe bandwidth: over rounds; latency: over
    blocks of 100 round trips).

    Args:
        message_bytes: large-message size in bytes (>= 1). rounds: small-message round trips.
        big_rounds: large-message transfers. use_mpi: force (True) or forbid (False) MPI;
            default: MPI only under mpiexec with mpi4py importable.

    Returns:
        dict of :class:`Measurement` s: ``"latency"`` (us), ``"bandwidth"`` (GB/s) and, for the
        multiprocessing path, ``"shm_bandwidth"`` (GB/s). Under MPI on ranks other than 0: {}.

    Raises:
        ValueError: message_bytes, rounds or big_rounds < 1.
        ImportError: use_mpi=True without mpi4py.
    """
    message_bytes = check_positive_int("message_bytes", message_bytes)
    rounds = check_positive_int("rounds", rounds, minimum=100)
    big_rounds = check_positive_int("big_rounds", big_rounds)
    if use_mpi is None:
        use_mpi = _under_mpi()
        if use_mpi:
            try:
                import mpi4py  # noqa: F401
            except ImportError:
                use_mpi = False
    if use_mpi:
        got = _mpi_pingpong(rounds, message_bytes, big_rounds)
        if got is not None or _under_mpi():
            return got or {}

    rounds = rounds // 100 * 100
    ctx = _mp_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pipe_echo, args=(child, rounds, message_bytes, big_rounds),
                    daemon=True)
    p.start()
    out = {}
    try:
        msg = b"x"
        lat = []
        for _ in range(rounds // 100):
            t0 = time.perf_counter()
            for _ in range(100):
                parent.send_bytes(msg)
                parent.recv_bytes()
            lat.append((time.perf_counter() - t0) / 100 / 2 * 1e6)
        payload = np.ones(message_bytes, dtype=np.uint8).tobytes()
        bw = []
        for _ in range(big_rounds):
            t0 = time.perf_counter()
            parent.send_bytes(payload)
            parent.recv_bytes()
            bw.append(message_bytes / (time.perf_counter() - t0) / 1e9)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
        parent.close()
    method = f"multiprocessing ({ctx.get_start_method()}) Pipe"
    out["latency"] = Measurement("pipe_latency", median(lat), "us",
                                 method + ": half round trip of a 1-byte message",
                                 {"rounds": rounds}, lat)
    out["bandwidth"] = Measurement("pipe_bandwidth", median(bw), "GB/s",
                                   method + ": one-way large messages, 1-byte ack",
                                   {"message_bytes": message_bytes, "rounds": big_rounds}, bw)
    out["shm_bandwidth"] = _shm_bandwidth(ctx, message_bytes, big_rounds)
    return out


def _shm_bandwidth(ctx, nbytes, rounds):
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=2 * nbytes)
    parent, child = ctx.Pipe()
    p = None
    try:
        arr = np.ndarray((2, nbytes), dtype=np.uint8, buffer=shm.buf)
        arr[0] = 7
        arr[1] = 0
        p = ctx.Process(target=_shm_echo, args=(shm.name, nbytes, rounds, child), daemon=True)
        p.start()
        rates = []
        ok = True
        for k in range(rounds):
            # fresh data written by this process each round: the child reads what another
            # core just wrote (its own copy of a block it read last round would stay in its
            # cache, and measured an in-cache memcpy, above the memory bandwidth)
            arr[0] = 8 + k % 200
            t0 = time.perf_counter()
            parent.send_bytes(b"g")
            parent.recv_bytes()
            rates.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
            ok = ok and bool(arr[1, -1] == 8 + k % 200)
        del arr
    finally:
        if p is not None:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        parent.close()
        shm.close()
        shm.unlink()
    return Measurement("shm_bandwidth", median(rates), "GB/s",
                       "multiprocessing.shared_memory: the parent writes a block, the child "
                       "copies it into the other half of the shared segment (2 x bytes per "
                       "round), pipe-synchronized; a block smaller than the last-level cache "
                       "moves between the cores' caches, not through memory",
                       {"message_bytes": nbytes, "rounds": rounds}, rates,
                       {"verified": ok})
