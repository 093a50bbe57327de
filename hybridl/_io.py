"""Safe file writing: nothing half-written is ever left under a user's file name.

Every file hybridl writes (parameters, trainer states, exported graphs, traces) is written to a
temporary file in the same directory, flushed to disk (``fsync``) and renamed into place
(``os.replace`` is atomic on POSIX), so that after a crash or a power cut the name holds the
old file or the new one, whole. A file that exists keeps its permissions; a new one gets those
a plain ``open()`` would give under the current umask. A symbolic link stays a link: the file
it points to is replaced. Temporary names are unique (``tempfile.mkstemp``), so two threads or
processes saving to the same path never write into one temporary file; the last rename wins,
and each file under the name is whole. Within one process the renames of one call are not
interleaved with another call's: a set of files (a graph and its parameters) comes from one
writer (between processes, the last rename of each file wins). A target that exists and is not
a regular file (a FIFO, a device such as /dev/null) is written into, never replaced.
"""
import os
import shutil
import stat
import tempfile
import threading

__all__ = ["atomic_write", "atomic_write_all", "check_path", "check_file"]

_RENAMES = threading.Lock()     # the rename phase of atomic_write_all (see there)


def check_path(path, who):
    """``path`` as a str (a str or an ``os.PathLike``); ``who``: the function and argument to
    name in the error, e.g. ``"save_parameters: path"``.

    Raises:
        TypeError: anything else (None, a number, bytes)."""
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if isinstance(p, str):
            return p
    raise TypeError(f"{who}: expected a file path (str or os.PathLike), got "
                    f"{type(path).__name__} {path!r}")


def check_file(path, who):
    """``path`` (see :func:`check_path`) names an existing file to read.

    Raises:
        TypeError: not a path.  FileNotFoundError: no such file.  IsADirectoryError: a
        directory."""
    p = check_path(path, who)
    if os.path.isdir(p):
        raise IsADirectoryError(f"{who}: {p!r} is a directory, expected a file")
    if not os.path.exists(p):
        raise FileNotFoundError(f"{who}: no such file: {p!r}")
    return p


def resolve(path):
    """The file a write to ``path`` replaces: a symbolic link's target (followed all the way;
    a dangling link: the file it would create), else ``path``."""
    p = os.fspath(path)
    return os.path.realpath(p) if os.path.islink(p) else p


def probe_write(path, option):
    """Create and remove a temporary file beside ``path``: a directory the process cannot
    write into (permissions, /proc, a read-only mount) is an error before any work is done
    (the command-line tools check their output paths so).

    Raises:
        PermissionError: naming ``option`` and the directory."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".hybridl-probe-", dir=d)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise PermissionError(f"{option}: cannot write files into {d!r} ({e.strerror})") from None


def _check_target(path):
    """The target's directory must exist and the target must not be a directory (checked for
    every file before anything is written)."""
    if not path or os.path.basename(path) == "":
        raise ValueError(f"path: expected a file name, got {path!r}")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"path: directory {d!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory, expected a file name")
    return d


def atomic_write_all(items):
    """Write several files: ``items`` is a list of ``(path, write)`` where ``write(tmp_path)``
    writes the content. All are complete before any is renamed into place; on an error no
    temporary file is left behind and, unless a rename itself fails (the targets are checked
    first: directory exists, target not a directory), the existing files are untouched.

    Raises:
        ValueError: an empty path or one ending in a separator.
        FileNotFoundError: a target directory does not exist.
        IsADirectoryError: a target is a directory.
        Whatever ``write`` raises.
    """
    # a link is followed: its target is replaced and the link kept (os.replace on the link
    # itself would put a plain file in its place)
    items = [(resolve(check_path(path, "path")), write) for path, write in items]
    dirs = [_check_target(path) for path, _ in items]
    tmps = []
    try:
        for (path, write), d in zip(items, dirs):
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                           dir=d)
            except OSError as e:            # name the user's file, not the temporary one
                raise type(e)(e.errno, f"cannot write {path!r}: cannot create a file in "
                                       f"{d!r} ({e.strerror})") from None
            os.close(fd)
            tmps.append((path, tmp))
            try:
                write(tmp)
            except OSError:
                raise
            except Exception as e:          # safetensors reports a failed write (disk full,
                if "I/O error" not in str(e):   # file too large) as SafetensorError: an
                    raise                   # OSError, as for any other write
                raise OSError(f"writing {path!r} failed: {e}") from e
            _fsync(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path, tmp in tmps:
            try:                            # an existing file keeps its permissions
                mode = os.stat(path).st_mode & 0o7777
            except OSError:
                mode = 0o666 & ~umask
            os.chmod(tmp, mode)
        with _RENAMES:      # one writer's set at a time: two threads exporting to one
            for path, tmp in tmps:      # prefix leave one export's pair, not a mix
                if _special(path):      # a FIFO or a device (/dev/null): written into, never
                    with open(tmp, "rb") as src, open(path, "wb") as dst:   # replaced
                        shutil.copyfileobj(src, dst)
                else:
                    os.replace(tmp, path)
        for d in set(dirs):                 # the renames themselves, on disk
            _fsync(d, directory=True)
    finally:
        for _, tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)


def _special(path):
    """An existing target that is not a regular file (a FIFO, a character or block device
    such as /dev/null, a socket): renaming over it would replace the special file itself."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _fsync(path, directory=False):
    """Flush ``path``'s data (or a directory's entries) to disk; a file system that cannot
    (some network or virtual ones refuse a directory) is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def atomic_write(path, write):
    """Write one file through ``write(tmp_path)`` then rename it to ``path`` (see above)."""
    atomic_write_all([(path, write)])
