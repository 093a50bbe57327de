"""Safe file writing: nothing half-written is ever left under a user's file name.

Every file hybridl writes (parameters, trainer states, exported graphs, traces) is written to a
temporary file in the same directory and renamed into place (``os.replace`` is atomic on POSIX),
with the permissions a plain ``open()`` would give under the current umask.
"""
import os

__all__ = ["atomic_write", "atomic_write_all"]


def _tmp_name(path):
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"path: directory {d!r} does not exist")
    return os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")


def atomic_write_all(items):
    """Write several files: ``items`` is a list of ``(path, write)`` where ``write(tmp_path)``
    writes the content. All are complete before any is renamed into place; on an error no
    temporary file is left behind and the existing files are untouched.

    Raises:
        FileNotFoundError: a target directory does not exist; whatever ``write`` raises.
    """
    tmps = [(path, _tmp_name(path), write) for path, write in items]
    try:
        for _, tmp, write in tmps:
            write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path, tmp, _ in tmps:
            os.chmod(tmp, 0o666 & ~umask)
        for path, tmp, _ in tmps:
            os.replace(tmp, path)
    finally:
        for _, tmp, _ in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)


def atomic_write(path, write):
    """Write one file through ``write(tmp_path)`` then rename it to ``path`` (see above)."""
    atomic_write_all([(os.fspath(path), write)])
