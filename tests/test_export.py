"""Export (graph JSON + safetensors) and SymbolBlock.imports: round trip in a fresh process that
imports only hybridl (never the model code), and clear errors for corrupt files."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hybridl as hl
from hybridl import nd
from hybridl import nn


def _randomize(net, x):
    net(nd.array(x))
    rng = np.random.default_rng(0)
    for n, p in sorted(net.collect_params().items()):
        v = rng.uniform(0.5, 1.5, p.shape) if n.endswith("running_var") else rng.standard_normal(p.shape) * 0.3
        p.set_data(v.astype(np.float32))


class TwoHeads(nn.HybridBlock):
    """Two inputs, two outputs, a constant and a parameter-free op (for the round trip)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(6, activation="tanh")
        self.out = nn.Dense(3)

    def forward(self, x, z):
        h = self.fc(x) * np.linspace(0.5, 1.5, 6, dtype=np.float32) + nd.sum(z, axis=1, keepdims=True)
        return self.out(h), nd.softmax(h)


def _fresh_process(code, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(hl.__file__))] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=str(tmp_path), env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


CHILD = """
    import sys
    import numpy as np
    import hybridl as hl
    blk = hl.nn.SymbolBlock.imports({sym!r}, {names!r})
    xs = [hl.nd.array(np.load(f"x{{i}}.npy")) for i in range({n_in})]
    for mode in ("eager", "hybrid"):
        if mode == "hybrid":
            blk.hybridize()
        out = blk(*xs)
        out = out if isinstance(out, tuple) else (out,)
        for k, o in enumerate(out):
            np.save(f"{{mode}}_y{{k}}.npy", o.asnumpy())
    assert blk.cache_info().programs == 1
    assert "hybridl.models" not in sys.modules, "the model code was imported"
    assert "test_export" not in sys.modules
    print("ok", len(out))
"""


@pytest.mark.parametrize("which", ["resnet18", "inception", "two_heads"])
def test_export_round_trip_in_a_fresh_process(which, tmp_path):
    rng = np.random.default_rng(1)
    if which == "resnet18":
        net = hl.models.resnet18(width=8)
        xs = [rng.standard_normal((2, 3, 16, 16)).astype(np.float32)]
    elif which == "inception":
        net = hl.models.inception_net(width=4)
        xs = [rng.standard_normal((2, 3, 8, 8)).astype(np.float32)]
    else:
        net = TwoHeads()
        xs = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)]
    net.initialize()
    with hl.autograd.pause():
        net(*[nd.array(x) for x in xs])
    _randomize(net, xs[0]) if which != "two_heads" else None
    net.hybridize()
    want = net(*[nd.array(x) for x in xs])
    want = [w.asnumpy() for w in (want if isinstance(want, tuple) else (want,))]
    prefix = str(tmp_path / which)
    sym_file, param_file = net.export(prefix)               # shapes of the last call
    assert sym_file == prefix + "-symbol.json" and param_file == prefix + ".safetensors"
    doc = json.loads(open(sym_file).read())
    assert doc["format"] == "hybridl-graph" and doc["version"] == 1
    assert [i["shape"] for i in doc["inputs"]] == [list(x.shape) for x in xs]
    assert len(doc["params"]) == len(net.collect_params())
    for i, x in enumerate(xs):
        np.save(tmp_path / f"x{i}.npy", x)
    names = [i["name"] for i in doc["inputs"]]
    out = _fresh_process(CHILD.format(sym=sym_file, names=names, n_in=len(xs)), tmp_path)
    assert out.strip() == f"ok {len(want)}"
    for mode in ("eager", "hybrid"):
        for k, w in enumerate(want):
            got = np.load(tmp_path / f"{mode}_y{k}.npy")
            assert got.shape == w.shape and got.dtype == w.dtype
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    # in this process too, and with explicit example inputs
    blk = hl.nn.SymbolBlock.imports(sym_file, names, param_file)
    got = blk(*[nd.array(x) for x in xs])
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-5, atol=1e-6)


def test_export_with_example_inputs_and_predict_mode(tmp_path):
    net = nn.HybridSequential()
    net.add(nn.Dense(8, activation="relu"), nn.Dropout(0.5), nn.BatchNorm(), nn.Dense(2))
    net.initialize()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    _randomize(net, x)
    with pytest.raises(RuntimeError, match="example inputs"):
        net.export(str(tmp_path / "never_called"))
    sym_file, _ = net.export(str(tmp_path / "m"), nd.array(x))
    doc = json.loads(open(sym_file).read())
    ops = {n.get("op") for n in doc["nodes"]}
    assert "dropout" not in ops and "batch_norm_train" not in ops   # the predict-mode graph
    blk = hl.nn.SymbolBlock.imports(sym_file)
    np.testing.assert_allclose(blk(nd.array(x)).asnumpy(), net(nd.array(x)).asnumpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="exported shape"):
        blk(nd.ones((5, 4)))
    with pytest.raises(ValueError, match="input_names"):
        hl.nn.SymbolBlock.imports(sym_file, ["a", "b"])


# ---------------------------------------------------------------------------- corrupt files


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp")
    net = nn.HybridSequential()
    net.add(nn.Dense(4, activation="relu"), nn.Dense(2))
    net.initialize()
    x = nd.ones((2, 3))
    sym, par = net.export(str(d / "net"), x)
    return d, open(sym).read(), open(par, "rb").read()


def _write(d, name, sym_text, par_bytes):
    s, p = d / f"{name}-symbol.json", d / f"{name}.safetensors"
    s.write_text(sym_text)
    p.write_bytes(par_bytes)
    return str(s), str(p)


def test_corrupt_symbol_files(exported):
    d, sym, par = exported
    s, _ = _write(d, "ok", sym, par)
    assert hl.nn.SymbolBlock.imports(s)(nd.ones((2, 3))).shape == (2, 2)
    s, _ = _write(d, "trunc", sym[: len(sym) // 2], par)
    with pytest.raises(ValueError, match="not valid JSON") as ei:
        hl.nn.SymbolBlock.imports(s)
    assert "trunc-symbol.json" in str(ei.value)
    s, _ = _write(d, "garbage", "\x00\x01 not json", par)
    with pytest.raises(ValueError, match="not valid JSON"):
        hl.nn.SymbolBlock.imports(s)
    doc = json.loads(sym)
    bad = dict(doc, format="onnx")
    s, _ = _write(d, "fmt", json.dumps(bad), par)
    with pytest.raises(ValueError, match="not a hybridl graph"):
        hl.nn.SymbolBlock.imports(s)
    s, _ = _write(d, "list", json.dumps([1, 2]), par)
    with pytest.raises(ValueError, match="not a hybridl graph"):
        hl.nn.SymbolBlock.imports(s)
    s, _ = _write(d, "ver", json.dumps(dict(doc, version=99)), par)
    with pytest.raises(ValueError, match="version 99"):
        hl.nn.SymbolBlock.imports(s)
    bad = json.loads(sym)
    next(n for n in bad["nodes"] if n["kind"] == "op")["op"] = "launch_missiles"
    s, _ = _write(d, "unknown", json.dumps(bad), par)
    with pytest.raises(ValueError, match="unknown op 'launch_missiles'"):
        hl.nn.SymbolBlock.imports(s)
    bad = json.loads(sym)
    del bad["nodes"]
    s, _ = _write(d, "nonodes", json.dumps(bad), par)
    with pytest.raises(ValueError, match="malformed"):
        hl.nn.SymbolBlock.imports(s)
    bad = json.loads(sym)
    bad["outputs"] = [[123456789, 0]]
    s, _ = _write(d, "dangling", json.dumps(bad), par)
    with pytest.raises(ValueError, match="unknown node 123456789"):
        hl.nn.SymbolBlock.imports(s)
    with pytest.raises(FileNotFoundError, match="symbol_file"):
        hl.nn.SymbolBlock.imports(str(d / "absent-symbol.json"))


def test_corrupt_param_files(exported):
    from safetensors.numpy import load_file, save_file
    d, sym, par = exported
    good = str(d / "net.safetensors")
    tensors = load_file(good)
    doc = json.loads(sym)
    pname = doc["params"][0]["name"]
    s, p = _write(d, "missing", sym, par)
    save_file({k: v for k, v in tensors.items() if k != pname}, p)
    with pytest.raises(ValueError, match=f"lacks parameter '{pname}'"):
        hl.nn.SymbolBlock.imports(s)
    s, p = _write(d, "shape", sym, par)
    save_file(dict(tensors, **{pname: np.zeros((7, 7), np.float32)}), p)
    with pytest.raises(ValueError, match=rf"'{pname}' has shape \[7, 7\]"):
        hl.nn.SymbolBlock.imports(s)
    s, p = _write(d, "notst", sym, b"this is not a safetensors file at all")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        hl.nn.SymbolBlock.imports(s)
    s, p = _write(d, "pickle", sym, par)
    import pickle
    with open(p, "wb") as f:
        pickle.dump({pname: np.zeros(3)}, f)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        hl.nn.SymbolBlock.imports(s)
    s, p = _write(d, "truncp", sym, par[: len(par) // 2])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        hl.nn.SymbolBlock.imports(s)
    s, p = _write(d, "nop", sym, par)
    os.remove(p)
    with pytest.raises(FileNotFoundError, match="param_file"):
        hl.nn.SymbolBlock.imports(s)


@pytest.mark.parametrize("tamper,msg", [
    (lambda d: d["outputs"].__setitem__(0, [d["outputs"][0][0], 5]), "out of range"),
    (lambda d: [n for n in d["nodes"] if n["kind"] == "op"][0].__setitem__("inputs", [[1]]),
     "expected a reference"),
    (lambda d: d["nodes"][0].__setitem__("kind", "weird"), "unknown kind"),
    (lambda d: d["params"].pop(), "not listed"),
    (lambda d: d["nodes"][0].__setitem__("specs", [["abc", "float32"]]), "shape must be"),
    # an attribute name is a keyword argument and, hybridized, generated code: no injection
    (lambda d: _op_node(d)["attrs"].__setitem__(
        "x=0) or __import__('os').system('touch PWNED') or k0(v0, y", 1), "not a plain identifier"),
    (lambda d: _op_node(d)["attrs"].__setitem__("foo", 1), "do not fit the op"),
    (lambda d: _op_node(d).__setitem__("op", "fused_elementwise"), "internal to compiled programs"),
    (lambda d: _op_node(d, "fully_connected")["specs"][0].__setitem__(0, [2, 99]),
     r"declared float32 \[2, 99\]"),
    (lambda d: d["params"][0].__setitem__("dtype", "float99"), "unsupported dtype 'float99'"),
    (lambda d: d["params"][0].__setitem__("dtype", "float64"), "its node"),
    (lambda d: d["inputs"].append(dict(d["inputs"][0])), "listed more than once"),
    (lambda d: d.__setitem__("outputs", []), "non-empty list"),
    (lambda d: d.__setitem__("version", True), "version True"),
    # a runtime keyword as an attribute imported, then every compiled call failed
    (lambda d: _op_node(d)["attrs"].__setitem__("out", None), "attribute 'out' is reserved"),
    (lambda d: d["params"][0].__setitem__("grad_req", "frob"), "grad_req must be"),
    # a declared 16 TiB input: a clear error, not MemoryError from a zeros() at import
    (lambda d: [n for n in d["nodes"] if n["kind"] == "input"][0]["specs"][0].__setitem__(
        0, [2 ** 40, 5]) or d["inputs"][0].__setitem__("shape", [2 ** 40, 5]), "declared"),
])
def test_tampered_graph_is_rejected_at_import(tmp_path, tamper, msg, monkeypatch):
    import copy
    net = hl.models.mlp((8,), 3)
    net.initialize()
    net.hybridize()
    net(hl.nd.ones((2, 5)))
    sym, par = net.export(str(tmp_path / "m"))
    d = copy.deepcopy(json.load(open(sym)))
    tamper(d)
    bad = tmp_path / "bad-symbol.json"
    bad.write_text(json.dumps(d))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=msg):
        hl.nn.SymbolBlock.imports(str(bad), None, par)
    assert not (tmp_path / "PWNED").exists()


def _op_node(d, name=None):
    return next(n for n in d["nodes"] if n["kind"] == "op" and (name is None or n["op"] == name))




class _DenseThen(nn.HybridBlock):
    """A Dense layer and ``then(self, x, dense(x))`` as the forward's result."""

    def __init__(self, then):
        super().__init__()
        self.d = nn.Dense(2, in_units=3)
        self._then = then

    def forward(self, x):
        return self._then(x, self.d(x))


def test_imported_parameters_and_constants_must_match_the_graph(tmp_path):
    from safetensors.numpy import load_file, save_file
    # a constant in the graph: stored beside the parameters
    net = _DenseThen(lambda x, y: y * nd.array(np.array([2.0, 3.0], np.float32)))
    net.initialize()
    x = nd.ones((2, 3))
    sym, par = net.export(str(tmp_path / "m"), x)
    t = load_file(par)
    assert any(k.startswith("__const__/") for k in t)
    for change, msg in ((lambda t: t.__setitem__("d.weight", t["d.weight"].astype(np.float64)),
                         "has dtype float64, the graph expects float32"),
                        (lambda t: [t.__setitem__(k, v[:1]) for k, v in list(t.items())
                                    if k.startswith("__const__/")], "the graph expects float32")):
        t2 = dict(t)
        change(t2)
        save_file(t2, par)
        with pytest.raises(ValueError, match=msg):
            hl.nn.SymbolBlock.imports(sym, ["data0"], par)
    save_file(t, par)
    with pytest.raises(ValueError, match=r"input\(s\) are \['data0'\], got \['x'\]"):
        hl.nn.SymbolBlock.imports(sym, ["x"], par)
    import pathlib
    blk = hl.nn.SymbolBlock.imports(pathlib.Path(sym))     # a Path; the param file derived
    np.testing.assert_array_equal(blk(x).asnumpy(), net(x).asnumpy())


def test_imported_block_returns_copies_of_inputs_and_parameters(tmp_path):
    net = _DenseThen(lambda x, y: (x * 1, y))    # x * 1 simplifies to x: an output that is an input
    net.initialize()
    x = nd.ones((2, 3))
    sym, par = net.export(str(tmp_path / "m"), x)
    blk = hl.nn.SymbolBlock.imports(sym, ["data0"], par)
    for hyb in (False, True):
        blk.hybridize(hyb)
        a, b = blk(x)
        a[:] = 5
        np.testing.assert_array_equal(x.asnumpy(), np.ones((2, 3), np.float32))


def test_imported_block_outputs_that_the_export_merged_are_separate_arrays(tmp_path):
    class Two(nn.HybridBlock):
        def forward(self, x):
            return x * 2, x * 2          # two results, merged into one node by the export's CSE
    x = nd.ones((2, 3))
    sym, _ = Two().export(str(tmp_path / "two"), x)
    blk = hl.nn.SymbolBlock.imports(sym)
    for hyb in (False, True):
        blk.hybridize(hyb)
        a, b = blk(x)
        assert a is not b
        a[0, 0] = 99
        np.testing.assert_array_equal(b.asnumpy(), np.full((2, 3), 2, np.float32))


def test_models_with_scalar_constants_0d_parameters_and_dropout_round_trip(tmp_path):
    class Odd(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.d = nn.Dense(2, in_units=3)
            self.t = nn.Parameter("temp", (), init="ones")

        def forward(self, x):           # scalar constants, a 0-d parameter, dropout always on
            y = (self.d(x) * 0.5 + 1.0) * self.t.data()
            return y, hl.nd.dropout(y, 0.5, training=True)
    net = Odd()
    net.initialize()
    net.t.set_data(np.array(3.0, np.float32))
    x = nd.ones((2, 3))
    sym, par = net.export(str(tmp_path / "m"), x)
    blk = hl.nn.SymbolBlock.imports(sym, ["data0"], par)
    np.testing.assert_array_equal(blk(x)[0].asnumpy(), net(x)[0].asnumpy())
    assert set(np.unique(blk(x)[1].asnumpy() / blk(x)[0].asnumpy() / 2).round(6)) <= {0.0, 1.0}
    p = str(tmp_path / "p.safetensors")
    net.save_parameters(p)
    net2 = Odd()
    net2.initialize()
    net2.load_parameters(p)
    assert net2.t.data().shape == () and net2.t.data().asnumpy() == 3.0
