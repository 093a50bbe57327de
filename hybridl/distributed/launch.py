"""``hybridl launch -n N [options] -- COMMAND ...``: run COMMAND as N MPI processes (mpiexec).

::

    hybridl launch -n 2 -- hybridl train --distributed
    hybridl launch -n 8 --hostfile hosts -- python train.py      # several machines

It runs ``mpiexec -n N [-f/--hostfile FILE] COMMAND ...`` and returns the job's exit code.
``mpiexec`` is looked up in this order: ``--mpiexec PATH``, ``$HYBRIDL_MPIEXEC``, next to the
running Python (a virtual environment's ``bin/``, where the ``mpich`` wheel puts it), the
``mpich`` wheel's own files, then ``PATH``. The folder of the running Python is put first on
the job's ``PATH`` so that ``python`` and ``hybridl`` in COMMAND are this environment's.

An aborted job (``MPI_Abort``: a failed rank, the collective timeout; a killed rank) leaves
its shared-memory files in ``/dev/shm`` (MPICH removes them only at a clean ``MPI_Finalize``,
about 2 MB per job on one machine). A rank that aborts the job itself (the collective
timeout, an MPI error) first unlinks the files it maps (:func:`unlink_own_shm`); for the rest
(a rank killed, or one that called ``MPI_Abort`` directly), when the job has ended, ``launch``
deletes the files of that kind that appeared while it ran and that no running process maps
any more (:func:`remove_stale_shm`).
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys

from .._argparse import Parser, usage_error

__all__ = ["main", "find_mpiexec", "shm_files", "remove_stale_shm", "unlink_own_shm"]

_SHM = "/dev/shm"
_SHM_PREFIXES = ("mpich_shm_", "mpich_", "vader_")     # MPICH (ch4/ch3), Open MPI's vader


def shm_files():
    """Names of the MPI shared-memory files now in ``/dev/shm`` (an empty set where there is
    no such folder or it cannot be read)."""
    try:
        return {f for f in os.listdir(_SHM) if f.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


def _mapped_anywhere(path):
    """Whether a running process (that this user may inspect) still maps ``path``."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True                     # cannot tell: keep the file
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
        except OSError:
            continue
    return False


def unlink_own_shm():
    """Unlink the MPI shared-memory files this process maps (called by a rank right before it
    aborts the job: the other local ranks have mapped them since ``MPI_Init``, so nothing
    still running loses them, and the memory is freed when the last rank ends). Covers jobs
    started with plain ``mpiexec``; returns the paths unlinked."""
    gone = []
    try:
        with open("/proc/self/maps") as f:     # "address perms offset dev inode [path]"
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return gone
    paths = {x[5].strip() for x in fields if len(x) == 6}
    for path in sorted(paths):
        if (os.path.dirname(path) == _SHM and os.path.basename(path).startswith(_SHM_PREFIXES)):
            try:
                os.unlink(path)
                gone.append(path)
            except OSError:
                pass
    return gone


def remove_stale_shm(before):
    """Delete the MPI shared-memory files that are not in ``before`` (a :func:`shm_files`
    result from before a job started) and that no running process maps: what an aborted job
    left behind. Files of other users cannot be deleted (``/dev/shm`` is sticky) and are left
    alone, as is any file still in use. Returns the names deleted.

    Raises:
        TypeError: ``before`` is not a collection of file names."""
    if isinstance(before, (str, bytes)) or not hasattr(before, "__iter__"):
        raise TypeError(f"before: expected the set of names shm_files() returned, got "
                        f"{type(before).__name__} {before!r}")
    gone = []
    for f in sorted(shm_files() - set(before)):
        path = os.path.join(_SHM, f)
        if not _mapped_anywhere(path):
            try:
                os.unlink(path)
                gone.append(f)
            except OSError:
                pass
    return gone


def find_mpiexec(explicit=None):
    """Path of the ``mpiexec`` to use (see the module docstring), or None when there is none."""
    for cand in (explicit, os.environ.get("HYBRIDL_MPIEXEC")):
        if cand:
            return cand if os.path.sep in cand else shutil.which(cand)
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    try:
        from importlib import metadata
        files = metadata.distribution("mpich").files or []
        for f in files:
            if f.name == "mpiexec":
                p = str(f.locate())
                if os.path.isfile(p) and os.access(p, os.X_OK):
                    return p
    except Exception:  # noqa: BLE001 - no mpich wheel
        pass
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _flavour(mpiexec):
    """'openmpi', 'mpich' or 'unknown' (for the hostfile option's spelling)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10)
        text = (out.stdout + out.stderr).lower()
    except Exception:  # noqa: BLE001
        return "unknown"
    if "open mpi" in text or "openrte" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def build_parser():
    p = Parser(
        prog="hybridl launch",
        description="Run a command as N MPI processes (wraps mpiexec); returns its exit code.",
        epilog="example: hybridl launch -n 2 -- hybridl train --distributed")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of processes")
    p.add_argument("--hostfile", default=None,
                   help="machines to run on (MPICH/Intel: 'host:slots' lines; Open MPI: "
                        "'host slots=N' lines)")
    p.add_argument("--mpiexec", default=None, help="the mpiexec to use (default: found)")
    p.add_argument("--timeout", type=float, default=None,
                   help="collective timeout in seconds (sets HYBRIDL_DIST_TIMEOUT): a "
                        "collective (allreduce, broadcast, ...) of the job that has not "
                        "finished after this long aborts the whole job; it does not limit "
                        "the job's run time")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command only")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def main(argv=None):
    """Entry point of ``hybridl launch``; returns the job's exit code (2: bad usage, 127: no
    mpiexec)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return usage_error("hybridl launch", "no command given (e.g. hybridl launch -n 2 -- "
                           "hybridl train --distributed)")
    if args.n < 1:
        return usage_error("hybridl launch", f"-n: expected a positive number of processes, "
                           f"got {args.n}")
    if args.timeout is not None:
        from ._backend import check_seconds     # the rule HYBRIDL_DIST_TIMEOUT is read with
        try:
            check_seconds(args.timeout, "--timeout")
        except ValueError as e:
            return usage_error("hybridl launch", e)
    mpiexec = find_mpiexec(args.mpiexec)
    if args.dry_run and (not mpiexec or not os.path.exists(mpiexec)):
        print("hybridl launch: note: mpiexec not found; showing the command with 'mpiexec'",
              file=sys.stderr)
        mpiexec = args.mpiexec or "mpiexec"
    elif args.mpiexec and (not mpiexec or not os.path.exists(mpiexec)):
        print(f"hybridl launch: error: --mpiexec: no such program: {args.mpiexec!r}",
              file=sys.stderr)
        return 127
    elif os.environ.get("HYBRIDL_MPIEXEC") and not args.mpiexec and \
            (not mpiexec or not os.path.exists(mpiexec)):
        print(f"hybridl launch: error: HYBRIDL_MPIEXEC: no such program: "
              f"{os.environ['HYBRIDL_MPIEXEC']!r} (unset it to use the mpiexec found next to "
              f"Python or on PATH)", file=sys.stderr)
        return 127
    elif not mpiexec or not os.path.exists(mpiexec):
        print("hybridl launch: error: mpiexec not found (looked at --mpiexec, $HYBRIDL_MPIEXEC, "
              f"{os.path.dirname(sys.executable)}, the mpich wheel and PATH). Install it with "
              "`pip install 'hybridl[mpi]'` (from a source checkout: `pip install -e \".[mpi]\"`; "
              "mpi4py + the mpich wheel, which provides mpiexec), "
              "or on a cluster load the site's MPI module and `pip install mpi4py`.",
              file=sys.stderr)
        return 127
    full = [mpiexec, "-n", str(args.n)]
    if args.hostfile:
        if not os.path.isfile(args.hostfile):
            return usage_error("hybridl launch", f"--hostfile: no such file: {args.hostfile!r}")
        full += (["--hostfile", args.hostfile] if _flavour(mpiexec) == "openmpi"
                 else ["-f", args.hostfile])
    full += cmd
    env = dict(os.environ)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if args.timeout is not None:
        env["HYBRIDL_DIST_TIMEOUT"] = str(args.timeout)
    if args.dry_run:                # (with the environment the real run sets)
        print(" ".join(([f"HYBRIDL_DIST_TIMEOUT={args.timeout:g}"] if args.timeout is not None
                        else []) + full))
        return 0
    before = shm_files()
    try:
        proc = subprocess.Popen(full, env=env)
    except OSError as e:
        print(f"hybridl launch: error: cannot run {mpiexec!r}: {e}", file=sys.stderr)
        return 127
    try:
        try:
            return proc.wait()
        except KeyboardInterrupt:       # forward Ctrl-C to mpiexec (it forwards to the ranks)
            proc.send_signal(signal.SIGINT)
            try:
                return proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
    finally:
        if proc.returncode not in (None, 0):      # a clean job removed its own files
            remove_stale_shm(before)


if __name__ == "__main__":
    sys.exit(main())
