"""Tests for hybridl.data.vision: Digits, MNIST / Fashion-MNIST files, download path (offline)."""

import functools
import gzip
import hashlib
import http.server
import os
import shutil
import threading
import time

import numpy as np
import pytest

from hybridl.data import MNIST, DatasetError, Digits, FashionMNIST
from hybridl.data.vision import DIGITS_NUM_TEST, DIGITS_NUM_TRAIN, parse_idx


# ------------------------------------------------------------------------------------------------
# Digits
# ------------------------------------------------------------------------------------------------

def test_digits_split_and_values():
    tr, te = Digits(train=True), Digits(train=False)
    assert (len(tr), len(te)) == (1438, 359) == (DIGITS_NUM_TRAIN, DIGITS_NUM_TEST)
    assert len(tr) + len(te) == 1797
    for ds in (tr, te):
        assert ds.images.shape == (len(ds), 1, 8, 8) and ds.images.dtype == np.float32
        assert ds.labels.shape == (len(ds),) and ds.labels.dtype == np.int32
        assert ds.images.min() == 0.0 and ds.images.max() == 1.0
        x, y = ds[0]
        assert x.shape == (1, 8, 8) and x.dtype == np.float32
    assert sorted(set(te.labels.tolist())) == list(range(10))
    np.testing.assert_array_equal(np.bincount(te.labels), [36, 36, 35, 37, 36, 36, 36, 36, 35, 36])
    # the split is a partition of sklearn's 1,797 images, stratified ~20% per class
    from sklearn.datasets import load_digits
    d = load_digits()
    allimg = np.concatenate([tr.images, te.images]).reshape(1797, 64) * 16
    key = lambda a: sorted(map(bytes, np.round(a).astype(np.uint8)))  # noqa: E731
    assert key(allimg) == key(d.data)
    total = np.bincount(d.target)
    np.testing.assert_array_equal(np.bincount(tr.labels) + np.bincount(te.labels), total)
    np.testing.assert_array_equal(np.bincount(te.labels), np.round(0.2 * total).astype(int))
    # deterministic
    np.testing.assert_array_equal(Digits(train=False).labels, te.labels)


# ------------------------------------------------------------------------------------------------
# MNIST from the shared folder
# ------------------------------------------------------------------------------------------------

FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
TEST_FILES = FILES[2:]
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _shared_mnist():
    cands = []
    if os.environ.get("HYBRIDL_DATA"):
        cands.append(os.path.join(os.environ["HYBRIDL_DATA"], "mnist"))
    # the project's shared folder sits beside the checkout (CI: a fresh clone with shared/ beside)
    here = os.path.dirname(os.path.abspath(__file__))
    cands.append(os.path.join(here, "..", "..", "shared", "datasets", "mnist"))
    cands.append("/work/shared/datasets/mnist")
    for c in cands:
        if all(os.path.isfile(os.path.join(c, f)) for f in FILES):
            return c
    return None


SHARED = _shared_mnist()
needs_mnist = pytest.mark.skipif(SHARED is None, reason="shared MNIST folder not available")


@needs_mnist
def test_mnist_shared_folder():
    tr = MNIST(root=SHARED, train=True)
    te = MNIST(root=SHARED, train=False)
    assert tr.images.shape == (60000, 1, 28, 28) and te.images.shape == (10000, 1, 28, 28)
    assert tr.images.dtype == np.float32 and tr.labels.dtype == np.int32
    assert tr.images.min() == 0.0 and tr.images.max() == 1.0
    np.testing.assert_array_equal(np.bincount(tr.labels), TRAIN_COUNTS)
    np.testing.assert_array_equal(np.bincount(te.labels), TEST_COUNTS)
    # the decompressed bytes are the official files (independent check of the verified md5s)
    with gzip.open(os.path.join(SHARED, "t10k-labels-idx1-ubyte.gz"), "rb") as f:
        assert hashlib.md5(f.read()).hexdigest() == "27ae3e4e09519cfbb04c329615203637"
    x, y = te[0]
    assert x.shape == (1, 28, 28) and int(y) == 7  # the famous first test digit


@needs_mnist
def test_mnist_default_root_from_env(monkeypatch):
    monkeypatch.setenv("HYBRIDL_DATA", os.path.dirname(SHARED))
    if os.path.basename(SHARED) != "mnist":
        pytest.skip("shared folder not named mnist")
    te = MNIST(train=False)
    assert te.root == SHARED and len(te) == 10000


def test_missing_files_message(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as ei:
        MNIST(root=str(tmp_path), train=False)
    msg = str(ei.value)
    assert str(tmp_path) in msg and "t10k-images-idx3-ubyte.gz" in msg
    assert "download=True" in msg and "HYBRIDL_DATA" in msg
    monkeypatch.setenv("HYBRIDL_DATA", str(tmp_path / "data"))
    with pytest.raises(FileNotFoundError, match=r"fashion-mnist"):
        FashionMNIST(train=True)


def _copy_test_split(dst):
    dst.mkdir(parents=True, exist_ok=True)
    for f in TEST_FILES:
        shutil.copy(os.path.join(SHARED, f), dst / f)
    return dst


@needs_mnist
def test_mnist_truncated_copy(tmp_path):
    root = _copy_test_split(tmp_path / "m")
    p = root / "t10k-images-idx3-ubyte.gz"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match=r"t10k-images-idx3-ubyte\.gz.*(corrupt|truncated)"):
        MNIST(root=str(root), train=False)


@needs_mnist
def test_mnist_altered_copy(tmp_path):
    root = _copy_test_split(tmp_path / "m")
    p = root / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(p.read_bytes()))
    raw[100] = (raw[100] + 1) % 10  # still a valid IDX file with valid labels: only md5 catches it
    p.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte\.gz.*MD5.*27ae3e4e"):
        MNIST(root=str(root), train=False)
    # an uncompressed copy is accepted too
    p.unlink()
    (root / "t10k-labels-idx1-ubyte").write_bytes(
        gzip.decompress((open(os.path.join(SHARED, TEST_FILES[1]), "rb").read())))
    assert len(MNIST(root=str(root), train=False)) == 10000


def _idx(arr):
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    head = bytes([0, 0, 0x08, arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes()
    return head + arr.tobytes()


def test_parse_idx_errors():
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(parse_idx(_idx(a)), a)
    b = _idx(a)
    with pytest.raises(DatasetError, match=r"f\.idx.*magic"):
        parse_idx(b"\x01\x02" + b[2:], "f.idx")
    with pytest.raises(DatasetError, match=r"f\.idx.*size mismatch.*truncated"):
        parse_idx(b[:-1], "f.idx")
    with pytest.raises(DatasetError, match=r"f\.idx.*trailing"):
        parse_idx(b + b"\x00", "f.idx")
    with pytest.raises(DatasetError, match=r"f\.idx.*header"):
        parse_idx(b[:9], "f.idx")


def _fake_fashion(root, n=10000, bad_dims=False):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    side = 27 if bad_dims else 28
    imgs = rng.integers(0, 256, (n, side, side)).astype(np.uint8)
    lbls = (np.arange(n) % 10).astype(np.uint8)
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(imgs), 1))
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(lbls), 1))
    return imgs, lbls


def test_fashion_structural_check(tmp_path):
    imgs, lbls = _fake_fashion(tmp_path / "ok")
    ds = FashionMNIST(root=str(tmp_path / "ok"), train=False)
    assert ds.images.shape == (10000, 1, 28, 28) and ds.labels.dtype == np.int32
    np.testing.assert_allclose(ds.images[:, 0], imgs / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.labels, lbls)
    assert len(FashionMNIST.classes) == 10
    _fake_fashion(tmp_path / "bad", bad_dims=True)
    with pytest.raises(DatasetError, match=r"t10k-images-idx3-ubyte\.gz.*shape \(10000, 28, 28\)"):
        FashionMNIST(root=str(tmp_path / "bad"), train=False)


# ------------------------------------------------------------------------------------------------
# Download path, offline (local HTTP server on 127.0.0.1)
# ------------------------------------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Liar(_Quiet):
    """Announces the full Content-Length but sends only half of the body, then hangs up."""

    def do_GET(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        data = open(path, "rb").read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def serve():
    servers = []

    def start(directory, handler=_Quiet):
        h = functools.partial(handler, directory=str(directory))
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), h)
        srv.daemon_threads = True
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                             daemon=True)
        t.start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@needs_mnist
def test_download_ok(tmp_path, serve):
    url = serve(_copy_test_split(tmp_path / "srv"))
    root = tmp_path / "root"
    ds = MNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=10)
    assert ds.images.shape == (10000, 1, 28, 28)
    np.testing.assert_array_equal(np.bincount(ds.labels), TEST_COUNTS)
    assert sorted(os.listdir(root)) == sorted(TEST_FILES)  # no temp files left
    # files now present: no download needed (the mirror is not contacted)
    assert len(MNIST(root=str(root), train=False, download=True,
                     mirrors=["http://127.0.0.1:9/"], timeout=1)) == 10000


@needs_mnist
def test_download_404_falls_through(tmp_path, serve):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = serve(empty)
    good = serve(_copy_test_split(tmp_path / "srv"))
    root = tmp_path / "root"
    ds = MNIST(root=str(root), train=False, download=True, mirrors=[bad, good], timeout=10)
    assert len(ds) == 10000
    assert sorted(os.listdir(root)) == sorted(TEST_FILES)


@needs_mnist
def test_download_truncated_file(tmp_path, serve):
    srv = _copy_test_split(tmp_path / "srv")
    for f in TEST_FILES:
        p = srv / f
        p.write_bytes(p.read_bytes()[:-200])  # served consistently, just short
    url = serve(srv)
    root = tmp_path / "root"
    with pytest.raises(DatasetError) as ei:
        MNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=10)
    msg = str(ei.value)
    assert "t10k-images-idx3-ubyte.gz" in msg and url in msg
    assert "truncated" in msg or "corrupt" in msg
    assert os.listdir(root) == []


@needs_mnist
def test_download_connection_cut(tmp_path, serve):
    url = serve(_copy_test_split(tmp_path / "srv"), handler=_Liar)
    root = tmp_path / "root"
    with pytest.raises(DatasetError, match=r"t10k-images-idx3-ubyte\.gz") as ei:
        MNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=10)
    assert url in str(ei.value)
    assert os.listdir(root) == []


@needs_mnist
def test_download_corrupt_content(tmp_path, serve):
    srv = _copy_test_split(tmp_path / "srv")
    p = srv / "t10k-images-idx3-ubyte.gz"
    raw = bytearray(gzip.decompress(p.read_bytes()))
    raw[5000] ^= 0xFF
    p.write_bytes(gzip.compress(bytes(raw), 1))
    url = serve(srv)
    root = tmp_path / "root"
    with pytest.raises(DatasetError, match=r"t10k-images-idx3-ubyte\.gz from .*MD5"):
        MNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=10)
    assert os.listdir(root) == []


class _Trickle(_Quiet):
    """Sends the file's bytes a few at a time, steadily (each read well within the socket
    timeout, the whole file in hours)."""

    def do_GET(self):
        data = open(self.translate_path(self.path), "rb").read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            for i in range(0, len(data), 10):
                self.wfile.write(data[i:i + 10])
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:             # the client gave up
            pass


@needs_mnist
def test_download_gives_up_on_a_mirror_that_sends_too_slowly(tmp_path, serve):
    """A steady trickle (200 bytes/s) never hit the per-read timeout: the download of a 1.6 MB
    file went on for hours. At least 1 KiB per timeout is required now."""
    url = serve(_copy_test_split(tmp_path / "srv"), handler=_Trickle)
    root = tmp_path / "root"
    t0 = time.monotonic()
    with pytest.raises(DatasetError, match=r"too slow, \d+ bytes in the last 1 s"):
        MNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=1)
    assert time.monotonic() - t0 < 10
    assert os.listdir(root) == []


@needs_mnist
def test_download_of_uncompressed_files_keeps_their_name(tmp_path, serve):
    """A mirror that serves the IDX data uncompressed (under the .gz URL) had it installed as a
    .gz file that gzip tools refuse; it is kept under the uncompressed name (read as well)."""
    srv = _copy_test_split(tmp_path / "srv")
    for f in TEST_FILES:
        (srv / f).write_bytes(gzip.decompress((srv / f).read_bytes()))
    root = tmp_path / "root"
    ds = MNIST(root=str(root), train=False, download=True, mirrors=[serve(srv)], timeout=10)
    assert len(ds) == 10000
    assert sorted(os.listdir(root)) == sorted(f[:-3] for f in TEST_FILES)


def test_timeout_beyond_a_day_is_refused():
    for bad in (1e10, 86401, 0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            MNIST(root="/nonexistent", train=False, download=True, mirrors=["http://x/"],
                  timeout=bad)


def test_download_fashion_checks_official_gz_md5(tmp_path, serve):
    _fake_fashion(tmp_path / "srv")  # valid IDX, but not the official .gz
    url = serve(tmp_path / "srv")
    root = tmp_path / "root"
    with pytest.raises(DatasetError, match=r"MD5 of the downloaded \.gz.*bef4ecab"):
        FashionMNIST(root=str(root), train=False, download=True, mirrors=[url], timeout=10)
    assert os.listdir(root) == []


def test_download_unreachable_mirror(tmp_path):
    root = tmp_path / "root"
    with pytest.raises(DatasetError, match=r"127\.0\.0\.1:9/t10k-images"):
        MNIST(root=str(root), train=False, download=True, mirrors=["http://127.0.0.1:9/"],
              timeout=2)
    assert os.listdir(root) == []
    with pytest.raises(ValueError, match="mirrors"):
        MNIST(root=str(root), train=False, download=True, mirrors=[])


def test_train_exits_1_not_2_when_the_download_fails(tmp_path, monkeypatch, capsys):
    # the options were valid, the network failed: exit code 2 and "see --help" were wrong
    from hybridl.cli import main
    from hybridl.data import DownloadError
    monkeypatch.setattr(MNIST, "default_mirrors", ("http://127.0.0.1:9/",))
    init = MNIST.__init__

    def quick(self, *a, **k):
        init(self, *a, **dict(k, timeout=2))
    monkeypatch.setattr(MNIST, "__init__", quick)
    rc = main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--download",
               "--epochs", "1", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "could not download a valid" in err and "--help" not in err, err
    assert issubclass(DownloadError, DatasetError)


def test_fashion_rejects_labels_outside_its_classes(tmp_path):
    _fake_fashion(tmp_path / "f")
    p = tmp_path / "f" / "t10k-labels-idx1-ubyte.gz"
    lbls = (np.arange(10000) % 10).astype(np.uint8)
    lbls[0] = 200
    p.write_bytes(gzip.compress(_idx(lbls), 1))
    with pytest.raises(DatasetError, match=r"label 200, expected classes in \[0, 10\).*download=True"):
        FashionMNIST(root=str(tmp_path / "f"), train=False)


def test_a_file_verified_by_one_dataset_class_is_verified_again_by_another(tmp_path):
    # FashionMNIST checks structure only; MNIST checks the MD5: a modified MNIST labels file
    # loaded first as FashionMNIST must not be served to MNIST from the parsed-array cache
    rng = np.random.default_rng(0)
    root = tmp_path / "m"
    root.mkdir()
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(_idx(rng.integers(0, 256, (10000, 28, 28)).astype(np.uint8)), 1))
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(np.zeros(10000, np.uint8)), 1))
    assert len(FashionMNIST(root=str(root), train=False)) == 10000
    with pytest.raises(DatasetError, match="MD5"):
        MNIST(root=str(root), train=False)
    # a changed file replaces its old parsed arrays in the cache (they are never hit again)
    from hybridl.data import vision
    p = str(root / "t10k-labels-idx1-ubyte.gz")
    os.utime(p, ns=(1, 1))
    FashionMNIST(root=str(root), train=False)
    assert sum(1 for k in vision._CACHE if isinstance(k, tuple) and k[0] == p) == 1


def test_split_and_root_arguments_are_checked(tmp_path):
    for bad in ("test", "False", 1):
        with pytest.raises(TypeError, match="train must be True"):
            Digits(train=bad)
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        MNIST(root=str(f))


@needs_mnist
def test_fashion_mnist_refuses_mnist_files():
    """Fashion-MNIST has the same file names and shapes as MNIST and only .gz checksums, so
    --dataset fashion-mnist --data-dir <MNIST folder> trained on digits labelled as clothes."""
    with pytest.raises(DatasetError, match="MNIST's t10k-images-idx3-ubyte, not this data set's") as e:
        FashionMNIST(root=SHARED, train=False)
    assert "delete" not in str(e.value)         # a valid file in the wrong folder: keep it


def test_a_small_gz_that_inflates_far_beyond_the_file_size_is_refused_early(tmp_path):
    """A 1 MB .gz of zeros inflating to 1 GiB was decompressed whole (2 GB of memory) before
    the checksum said no. Inflating stops one byte past the expected IDX size."""
    root = tmp_path / "bomb"
    root.mkdir()
    import zlib
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    parts = [c.compress(chunk) for _ in range(64)] + [c.flush()]     # 64 MiB of zeros
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(b"".join(parts))
    with pytest.raises(DatasetError, match=r"inflates to more than 7840016 bytes"):
        FashionMNIST(root=str(root), train=False)


def test_a_gz_of_several_members_is_read_whole(tmp_path):
    # a valid multi-member .gz (re-compressed or concatenated; gzip.decompress and zcat read
    # it) was taken as truncated, and the message said to delete it
    imgs, lbls = _fake_fashion(tmp_path / "one")
    root = tmp_path / "multi"
    root.mkdir()
    for name, arr in (("t10k-images-idx3-ubyte.gz", imgs), ("t10k-labels-idx1-ubyte.gz", lbls)):
        b = _idx(arr)
        (root / name).write_bytes(gzip.compress(b[:len(b) // 3], 1) + gzip.compress(b[len(b) // 3:], 1))
    ds = FashionMNIST(root=str(root), train=False)
    np.testing.assert_allclose(ds.images[:, 0], imgs / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.labels, lbls)
    bad = tmp_path / "junk"
    bad.mkdir()
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (bad / name).write_bytes((root / name).read_bytes() + b"junk")
    with pytest.raises(DatasetError, match="trailing data after the gzip stream"):
        FashionMNIST(root=str(bad), train=False)


def test_dataset_arguments_are_checked(tmp_path):
    """download='no' downloaded (any truthy value did); mirrors=5 or [None] failed with
    Python's own TypeError/AttributeError after creating the root folder; root='' silently
    meant the default folder."""
    with pytest.raises(TypeError, match="download must be True or False, got 'no'"):
        MNIST(root=str(tmp_path / "a"), train=False, download="no", mirrors=["http://127.0.0.1:1/"])
    for bad in (5, [5], [None], [""]):
        with pytest.raises(TypeError, match="mirrors must be a base URL or a list of base URLs"):
            MNIST(root=str(tmp_path / "b"), train=False, download=True, mirrors=bad)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="root must be a folder path, got ''"):
        MNIST(root="", train=False)


def test_blank_hybridl_data_counts_as_unset(monkeypatch):
    """HYBRIDL_DATA=' ' made a folder named ' ' in the current directory."""
    from hybridl.data.vision import _default_root
    monkeypatch.setenv("HYBRIDL_DATA", " ")
    assert _default_root("mnist", "MNIST") == os.path.join(os.path.expanduser("~"), ".hybridl",
                                                           "datasets", "mnist")
    monkeypatch.setenv("HYBRIDL_DATA", "~/d")
    assert _default_root("mnist", "MNIST") == os.path.join(os.path.expanduser("~"), "d", "mnist")


def test_hybridl_data_naming_a_file_says_so(tmp_path, monkeypatch):
    """It said '... not found in <file>/mnist', as if the folder were only empty."""
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("HYBRIDL_DATA", str(f))
    with pytest.raises(NotADirectoryError, match=r"FashionMNIST: the HYBRIDL_DATA environment "
                       r"variable is '.*afile', a file; expected a folder"):
        FashionMNIST(train=False)
