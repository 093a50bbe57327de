"""Vision datasets: Digits (bundled with scikit-learn), MNIST and Fashion-MNIST.

Every dataset here is an :class:`~hybridl.data.ArrayDataset` of ``(image, label)`` with

* images: float32, NCHW ``(N, 1, H, W)``, values in ``[0, 1]``;
* labels: int32 in ``[0, 10)``.

Sources:

* Digits — the UCI "Optical Recognition of Handwritten Digits" test set (optdigits; Alpaydin &
  Kaynak, 1998) as shipped inside scikit-learn (``sklearn.datasets.load_digits``): 1,797 8x8
  images, values 0..16. No network needed.
* MNIST — Y. LeCun, L. Bottou, Y. Bengio, P. Haffner, "Gradient-based learning applied to
  document recognition", Proc. IEEE 86(11), 1998. 60,000 + 10,000 28x28 images.
* Fashion-MNIST — H. Xiao, K. Rasul, R. Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
  Benchmarking Machine Learning Algorithms", arXiv:1708.07747, 2017. Same layout as MNIST.

MNIST / Fashion-MNIST files are the standard gzip-compressed IDX files, read from ``root``
(default ``$HYBRIDL_DATA/<name>`` if ``HYBRIDL_DATA`` is set, else
``~/.hybridl/datasets/<name>``, with ``<name>`` = ``mnist`` or ``fashion-mnist``). Files are
parsed without pickle and validated (IDX magic number, dimensions vs. file size, expected
sample count and image size, image/label count match) and, for MNIST, the MD5 of the
*decompressed* bytes is checked against the official values. For Fashion-MNIST only the MD5s
of the official ``.gz`` files are published (by Zalando); those are checked on download, and
files already on disk are validated by their IDX structure only (a re-compressed ``.gz``
holding correct data is accepted).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import threading
import time
import urllib.request
import zlib

import numpy as np

from .dataset import ArrayDataset

__all__ = ["Digits", "MNIST", "FashionMNIST", "DatasetError", "DownloadError", "parse_idx"]


class DatasetError(RuntimeError):
    """A data file is corrupt / fails verification, or no mirror delivered a valid copy."""


class DownloadError(DatasetError):
    """No mirror delivered a valid copy of a file (network errors, bad downloads)."""


# ------------------------------------------------------------------------------------------------
# Digits
# ------------------------------------------------------------------------------------------------

_DIGITS_SEED = 20240917
_DIGITS_TEST_FRACTION = 0.2
DIGITS_NUM_TRAIN = 1438
DIGITS_NUM_TEST = 359


def _read_sklearn_digits():
    """(data (1797, 64) values 0..16, target (1797,)) from scikit-learn's bundled CSV.

    Reads ``sklearn/datasets/data/digits.csv.gz`` directly (locating the package without
    importing it: ``import sklearn.datasets`` takes seconds); falls back to
    ``sklearn.datasets.load_digits()`` if the file is not where expected.
    """
    import importlib.util
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise ImportError("Digits needs scikit-learn (it ships the data): pip install scikit-learn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # pragma: no cover - unusual install layout
    d = load_digits()
    return d.data, d.target


def _digits_split():
    """(images uint8-like float (N,1,8,8), labels int32, train_idx, test_idx), cached."""
    if "digits" not in _CACHE:
        data, target = _read_sklearn_digits()
        images = np.asarray(data, dtype=np.float32).reshape(-1, 1, 8, 8) / np.float32(16.0)
        labels = np.asarray(target, dtype=np.int32)
        if images.shape != (1797, 1, 8, 8) or labels.min() < 0 or labels.max() > 9:
            raise DatasetError(f"Digits: unexpected data from scikit-learn: images "
                               f"{images.shape}, labels in [{labels.min()}, {labels.max()}]")
        rs = np.random.RandomState(_DIGITS_SEED)  # legacy RNG: stream frozen across NumPy versions
        test = []
        for c in range(10):
            idx = np.flatnonzero(labels == c)
            perm = rs.permutation(idx)
            test.append(perm[:int(round(_DIGITS_TEST_FRACTION * len(idx)))])
        test = np.sort(np.concatenate(test))
        mask = np.ones(len(labels), dtype=bool)
        mask[test] = False
        train = np.flatnonzero(mask)
        for a in (images, labels):
            a.setflags(write=False)
        _CACHE["digits"] = (images, labels, train, test)
    return _CACHE["digits"]


class Digits(ArrayDataset):
    """The 8x8 handwritten digits bundled with scikit-learn (UCI optdigits), no download.

    1,797 images of digits 0..9 — the data of ``sklearn.datasets.load_digits`` (read from
    scikit-learn's bundled ``digits.csv.gz``), pixel values 0..16 scaled by 1/16 to ``[0, 1]``.

    Fixed split (stratified, identical on every machine): for each class ``c`` (in order
    0..9) the indices of that class are permuted with one ``np.random.RandomState(20240917)``
    (legacy generator, whose stream NumPy keeps frozen) and the first
    ``round(0.2 * count_c)`` go to the test set. Result: **1,438 train / 359 test** images,
    each kept in the original sklearn order.

    Args:
        train: True for the 1,438-image train split, False for the 359-image test split.

    Samples: ``(image float32 (1, 8, 8) in [0, 1], label int32)``.
    Attributes: ``images`` float32 ``(N, 1, 8, 8)``, ``labels`` int32 ``(N,)``, ``classes``.

    Raises:
        TypeError: ``train`` not a bool.
    """

    classes = tuple(str(i) for i in range(10))

    def __init__(self, train=True):
        _check_train(train, "Digits")
        images, labels, tr, te = _digits_split()
        idx = tr if train else te
        self.train = bool(train)
        self.images = images[idx]
        self.labels = labels[idx]
        super().__init__(self.images, self.labels)


# ------------------------------------------------------------------------------------------------
# IDX files
# ------------------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(data, name="<bytes>"):
    """Parse the bytes of an (uncompressed) IDX file into a NumPy array.

    IDX layout (LeCun et al.): 2 zero bytes, 1 dtype byte (0x08 = uint8, ...), 1 byte ``ndim``,
    then ``ndim`` big-endian uint32 dimensions, then the data in C order.

    Args:
        data: the file's bytes. name: file name used in error messages.

    Returns: array of shape ``dims`` (read-only view for uint8 data).

    Raises:
        DatasetError: bad magic number, unknown dtype code, or a size that does not match the
            header (truncated or padded file); the message names ``name``.
    """
    data = memoryview(data)
    if len(data) < 4:
        raise DatasetError(f"{name}: not an IDX file (only {len(data)} bytes)")
    z0, z1, code, ndim = bytes(data[:4])
    if z0 != 0 or z1 != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise DatasetError(f"{name}: bad IDX magic number 0x{bytes(data[:4]).hex()} "
                           f"(expected 0x0000<dtype><ndim>, e.g. 0x00000803 for images)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{name}: truncated IDX header ({len(data)} bytes, need {header})")
    dims = tuple(int(x) for x in np.frombuffer(data[4:header], dtype=">u4"))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise DatasetError(f"{name}: IDX size mismatch: header says dims {dims} of {dtype} "
                           f"({expected} bytes in all), file has {len(data)} bytes "
                           f"({'truncated' if len(data) < expected else 'trailing data'})")
    return np.frombuffer(data[header:], dtype=dtype).reshape(dims)


def _decompress(raw, name, limit=None):
    """gunzip ``raw`` if it is gzip data; clear error naming the file on corruption. With
    ``limit`` (bytes), data that inflates beyond it is an error found after inflating at most
    ``limit + 1`` bytes (a small file that inflates to gigabytes must not exhaust memory)."""
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        if limit is None:
            return gzip.decompress(raw)
        out, data = bytearray(), raw
        while True:             # every gzip member, as gzip.decompress (a re-compressed or
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)     # concatenated .gz has several)
            out += d.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise DatasetError(f"{name}: the gzip data inflates to more than {limit} bytes, "
                                   f"the size of the expected IDX file (not the official file)")
            if not d.eof:
                raise EOFError("compressed stream ended before the end-of-stream marker")
            data = d.unused_data
            if not data.strip(b"\0"):                # (zero padding after the last member)
                return bytes(out)
            if data[:2] != b"\x1f\x8b":
                raise EOFError(f"{len(data)} bytes of trailing data after the gzip stream")
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{name}: corrupt or truncated gzip data ({type(exc).__name__}: "
                           f"{exc})") from exc


def _md5(b):
    return hashlib.md5(b).hexdigest()


_CACHE = {}
_CACHE_LOCK = threading.Lock()


_MAX_TIMEOUT = 86400.0       # a socket timeout beyond ~1e9 s overflows the C time_t
_MIN_BYTES = 1024            # a mirror must deliver this much per `timeout` seconds
_GZIP_MAGIC = b"\x1f\x8b"


class _Resource:
    """One IDX file: name, expected shape, md5 of decompressed bytes and of the official .gz."""

    def __init__(self, fname, shape, md5=None, gz_md5=None, others=None):
        self.fname, self.shape, self.md5, self.gz_md5 = fname, shape, md5, gz_md5
        # md5 of the decompressed file of the same name in another data set -> its name:
        # refused when only the structure can be checked (MNIST's files are Fashion-MNIST's
        # shape, and --data-dir pointing at them trained on digits labelled as clothes)
        self.others = others or {}

    def verify(self, raw, where, downloaded=False):
        """Decompress, check checksums and structure; return the parsed array."""
        if downloaded and self.md5 is None and self.gz_md5 is not None:
            got = _md5(raw)
            if got != self.gz_md5:
                raise DatasetError(f"{where}: MD5 of the downloaded .gz is {got}, expected "
                                   f"{self.gz_md5} (corrupt or not the official file)")
        # an IDX file of uint8: magic, one int32 per dimension, then the values
        data = _decompress(raw, where, 4 + 4 * len(self.shape) + int(np.prod(self.shape)))
        if self.md5 is None and self.others:
            other = self.others.get(_md5(data))
            if other is not None:
                raise DatasetError(f"{where}: this is {other}'s {self.fname}, not this data "
                                   f"set's; point root (--data-dir) at the right folder")
        if self.md5 is not None:
            got = _md5(data)
            if got != self.md5:
                raise DatasetError(f"{where}: MD5 of the decompressed data is {got}, expected "
                                   f"{self.md5} " + ("(corrupt or not the official file)"
                                                     if downloaded else "(corrupt or modified "
                                                     "file; delete it and download again)"))
        arr = parse_idx(data, where)
        if arr.shape != self.shape:
            raise DatasetError(f"{where}: expected IDX array of shape {self.shape}, "
                               f"got {arr.shape}")
        if arr.dtype != np.uint8:
            raise DatasetError(f"{where}: expected uint8 IDX data, got {arr.dtype}")
        return arr


def _check_train(train, name):
    """``train`` must be a bool (a string such as 'test' would silently mean the train split)."""
    if not isinstance(train, (bool, np.bool_)):
        raise TypeError(f"{name}: train must be True (training split) or False (test split), "
                        f"got {train!r}")


def _default_root(name, who):
    """``$HYBRIDL_DATA/<name>``, else ``~/.hybridl/datasets/<name>``.

    Raises:
        NotADirectoryError: ``HYBRIDL_DATA`` names a file (it must be a folder)."""
    base = os.environ.get("HYBRIDL_DATA", "").strip()    # (blank: unset)
    if base:
        base = os.path.expanduser(base)
        if os.path.exists(base) and not os.path.isdir(base):
            raise NotADirectoryError(
                f"{who}: the HYBRIDL_DATA environment variable is {base!r}, a file; expected a "
                f"folder (the dataset is looked for in $HYBRIDL_DATA/{name})")
        return os.path.join(base, name)
    return os.path.join(os.path.expanduser("~"), ".hybridl", "datasets", name)


class _IDXImageDataset(ArrayDataset):
    """Shared implementation of MNIST-layout datasets (see MNIST's docstring)."""

    name = None            # folder name under HYBRIDL_DATA
    resources = None       # {"train": (images, labels), "test": (images, labels)}
    default_mirrors = ()
    classes = ()

    def __init__(self, root=None, train=True, download=False, mirrors=None, timeout=30.0):
        _check_train(train, type(self).__name__)
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"{type(self).__name__}: root must be a path, got {type(root).__name__}")
        if root is not None and not os.fspath(root).strip():
            raise ValueError(f"{type(self).__name__}: root must be a folder path, got {root!r} "
                             f"(None: the default, $HYBRIDL_DATA/{self.name})")
        if not isinstance(download, (bool, np.bool_)):
            raise TypeError(f"{type(self).__name__}: download must be True or False, got "
                            f"{download!r}")
        if root is not None and os.path.exists(root) and not os.path.isdir(root):
            raise NotADirectoryError(f"{type(self).__name__}: root {root!r} is a file, expected "
                                     f"the folder holding the IDX files")
        self.root = (os.path.abspath(os.path.expanduser(root)) if root else
                     _default_root(self.name, type(self).__name__))
        self.train = bool(train)
        if mirrors is None:
            mirrors = list(self.default_mirrors)
        elif isinstance(mirrors, str):
            mirrors = [mirrors]
        else:
            given = mirrors
            try:
                mirrors = list(mirrors)
            except TypeError:
                mirrors = None
            if mirrors is None or not all(isinstance(m, str) and m.strip() for m in mirrors):
                raise TypeError(f"{type(self).__name__}: mirrors must be a base URL or a list "
                                f"of base URLs (str), got {given!r}")
        if download and not mirrors:
            raise ValueError(f"{type(self).__name__}: mirrors must be a non-empty list of base "
                             f"URLs when download=True, got {mirrors!r}")
        self.mirrors = mirrors
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= _MAX_TIMEOUT:
            raise ValueError(f"{type(self).__name__}: timeout must be a number of seconds, > 0 "
                             f"and at most {_MAX_TIMEOUT:.0f} (one day; per network request), "
                             f"got {timeout!r}")
        self.timeout = float(timeout)
        img_res, lbl_res = self.resources["train" if train else "test"]
        if download:
            for res in (img_res, lbl_res):
                if self._find(res) is None:
                    self._download(res)
        # float32 NCHW in [0, 1]; labels int32. Shared (read-only) between instances.
        self.images = self._load(img_res, self._images_to_float)
        self.labels = self._load(lbl_res, self._labels_to_int)
        if len(self.images) != len(self.labels):  # pragma: no cover - shapes already checked
            raise DatasetError(f"{self.root}: {len(self.images)} images but "
                               f"{len(self.labels)} labels")
        super().__init__(self.images, self.labels)

    def _labels_to_int(self, a):
        k = len(self.classes)
        if a.size and int(a.max()) >= k:
            raise DatasetError(f"{type(self).__name__}: labels file holds label {int(a.max())}, "
                               f"expected classes in [0, {k}) (corrupt or not a "
                               f"{type(self).__name__} labels file)")
        return a.astype(np.int32)

    @staticmethod
    def _images_to_float(a):
        out = a.astype(np.float32).reshape(-1, 1, *a.shape[1:])
        out *= np.float32(1.0 / 255.0)
        return out

    # -- files -----------------------------------------------------------------------------------
    def _find(self, res):
        """Path of the file for ``res`` (``.gz`` preferred, uncompressed accepted) or None."""
        for fname in (res.fname + ".gz", res.fname):
            p = os.path.join(self.root, fname)
            if os.path.isfile(p):
                return p
        return None

    def _load(self, res, convert):
        """Read, verify and convert (``convert(uint8 array)``) one file; cached per process."""
        path = self._find(res)
        if path is None:
            raise FileNotFoundError(
                f"{type(self).__name__}: {res.fname}.gz not found in {self.root} "
                f"(looked for {os.path.join(self.root, res.fname + '.gz')} and the uncompressed "
                f"{res.fname}). Fix: pass download=True (CLI: --download) to fetch it, or point root= "
                f"(CLI: --data-dir; or the "
                f"HYBRIDL_DATA environment variable, which is searched as "
                f"$HYBRIDL_DATA/{self.name}) at a folder holding the IDX files.")
        st = os.stat(path)
        # the key holds what was verified (the resource's checksums and shape) and how it was
        # converted, not only the file: another dataset class reading the same path (MNIST
        # after FashionMNIST) must verify it against its own checksums
        key = (path, st.st_size, st.st_mtime_ns, type(self).__name__, res.fname, res.md5,
               res.gz_md5, res.shape)
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
        if hit is not None:
            return hit
        with open(path, "rb") as f:
            raw = f.read()
        try:
            arr = convert(res.verify(raw, path))
        except DatasetError as e:
            if "delete it" in str(e) or "right folder" in str(e):
                raise                   # (another data set's valid file: never advise deleting)
            raise DatasetError(f"{e}; delete {path} and run again with download=True (CLI: "
                               f"--download) to fetch a fresh copy") from None
        arr.setflags(write=False)
        with _CACHE_LOCK:
            for k in [k for k in _CACHE if k[0] == path and k[1:3] != key[1:3]]:
                del _CACHE[k]           # a changed file: its old arrays are never hit again
            _CACHE[key] = arr
        return arr

    def _download(self, res):
        """Fetch ``res`` from the mirrors in order; install it only when whole and verified."""
        os.makedirs(self.root, exist_ok=True)
        fname = res.fname + ".gz"
        dest = os.path.join(self.root, fname)
        errors = []
        for mirror in self.mirrors:
            url = mirror.rstrip("/") + "/" + fname
            tmp = None
            try:
                tmp = self._fetch(url, fname)
                with open(tmp, "rb") as f:
                    raw = f.read()
                res.verify(raw, f"{fname} from {url}", downloaded=True)
                os.chmod(tmp, 0o644)
                # a mirror that served the IDX file uncompressed: kept under its own name
                # (read as well), not as a .gz that gzip tools would refuse
                to = dest if raw[:2] == _GZIP_MAGIC else os.path.join(self.root, res.fname)
                os.replace(tmp, to)
                tmp = None
                return to
            except Exception as exc:  # URLError/HTTPError/timeouts (OSError), HTTPException,
                errors.append(f"  {url}: {type(exc).__name__}: {exc}")  # DatasetError: next mirror
            finally:
                if tmp is not None:
                    try:
                        os.remove(tmp)
                    except OSError:
                        pass
        raise DownloadError(f"{type(self).__name__}: could not download a valid {fname} into "
                           f"{self.root}; tried {len(self.mirrors)} mirror(s):\n"
                           + "\n".join(errors))

    def _fetch(self, url, fname):
        """Stream ``url`` to a temp file in root; returns its path (caller removes it)."""
        import tempfile
        fd, tmp = tempfile.mkstemp(prefix=f".{fname}.", suffix=".part", dir=self.root)
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "hybridl"})
            with urllib.request.urlopen(req, timeout=self.timeout) as resp, \
                    os.fdopen(fd, "wb") as out:
                fd = None
                expected = resp.headers.get("Content-Length")
                got = 0
                # a mirror that sends but too slowly (each read within the socket timeout, the
                # whole file in hours) is given up: at least _MIN_BYTES per `timeout` seconds
                window, at = time.monotonic(), 0
                read = getattr(resp, "read1", resp.read)    # what has arrived (read() waits
                while True:                                 # for the whole 1 MiB)
                    chunk = read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                    got += len(chunk)
                    now = time.monotonic()
                    if now - window >= self.timeout:
                        if got - at < _MIN_BYTES:
                            raise DatasetError(
                                f"{fname} from {url}: too slow, {got - at} bytes in the last "
                                f"{now - window:.0f} s (at least {_MIN_BYTES} per timeout="
                                f"{self.timeout:g} s), {got} bytes in all")
                        window, at = now, got
            if expected is not None and got != int(expected):
                raise DatasetError(f"{fname} from {url}: truncated download, got {got} bytes "
                                   f"of {int(expected)}")
            return tmp
        except BaseException:
            if fd is not None:
                os.close(fd)
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise


_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

_FASHION_MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)


class MNIST(_IDXImageDataset):
    """MNIST handwritten digits (LeCun, Bottou, Bengio & Haffner, 1998).

    Args:
        root: folder holding the IDX files ``train-images-idx3-ubyte.gz``,
            ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
            ``t10k-labels-idx1-ubyte.gz`` (uncompressed copies without ``.gz`` are accepted).
            Default ``$HYBRIDL_DATA/mnist``, else ``~/.hybridl/datasets/mnist``.
        train: True: the 60,000 training images; False: the 10,000 test images.
        download: fetch the files of the requested split that are missing from ``root``.
            Each file is streamed to a temp file in ``root``, verified (size vs.
            Content-Length, gzip integrity, IDX structure, MD5) and only then moved into
            place with ``os.replace``; on failure the temp file is removed and the next mirror
            is tried.
        mirrors: base URLs tried in order (default: the usual public mirrors).
        timeout: per-request network timeout in seconds (> 0, at most 86400); a mirror
            that delivers less than 1 KiB in that many seconds is given up too.

    Samples: ``(image float32 (1, 28, 28) in [0, 1], label int32)``.
    Attributes: ``images`` float32 ``(N, 1, 28, 28)``, ``labels`` int32 ``(N,)``.

    Verification: MD5 of the decompressed files against the official values. Parsed arrays
    are cached per process (keyed by path, size and mtime).

    Raises:
        FileNotFoundError: a file is missing and ``download`` is False (says where it looked
            and how to fix it).
        DatasetError: a file is corrupt (names the file), or (DownloadError) no mirror
            delivered a valid copy (names each URL and its error).
        ValueError: ``timeout`` not a number of seconds > 0; an empty mirror list with
            ``download``. TypeError: ``train`` not a bool, ``root`` not a path.
    """

    name = "mnist"
    default_mirrors = _MNIST_MIRRORS
    classes = tuple(str(i) for i in range(10))
    resources = {
        "train": (_Resource("train-images-idx3-ubyte", (60000, 28, 28),
                            md5="6bbc9ace898e44ae57da46a324031adb"),
                  _Resource("train-labels-idx1-ubyte", (60000,),
                            md5="a25bea736e30d166cdddb491f175f624")),
        "test": (_Resource("t10k-images-idx3-ubyte", (10000, 28, 28),
                           md5="2646ac647ad5339dbf082846283269ea"),
                 _Resource("t10k-labels-idx1-ubyte", (10000,),
                           md5="27ae3e4e09519cfbb04c329615203637")),
    }


class FashionMNIST(_IDXImageDataset):
    """Fashion-MNIST clothing images (Xiao, Rasul & Vollgraf, 2017), MNIST's file layout.

    Same arguments, file names, shapes and errors as :class:`MNIST`; default root
    ``$HYBRIDL_DATA/fashion-mnist``, else ``~/.hybridl/datasets/fashion-mnist``.

    Verification: Zalando publishes the MD5 of the ``.gz`` files only, so a *download* is
    checked against those (mirrors must serve the official ``.gz``); files already on disk are
    checked structurally (IDX magic, dims vs. size, 60,000/10,000 x 28 x 28, uint8), and
    MNIST's files (same names and shapes) are recognised by their MD5 and refused.

    Classes: T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag,
    Ankle boot.
    """

    name = "fashion-mnist"
    default_mirrors = _FASHION_MIRRORS
    classes = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
               "Sneaker", "Bag", "Ankle boot")
    resources = {
        split: tuple(_Resource(r.fname, r.shape, gz_md5=gz, others={r.md5: "MNIST"})
                     for r, gz in zip(MNIST.resources[split], gzs))
        for split, gzs in (("train", ("8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                                      "25c81989df183df01b3e8a0aad5dffbe")),
                           ("test", ("bef4ecab320f06d8554ea6380940ec79",
                                     "bb300cfdad3c16e7a12a480ee83cd310")))
    }
