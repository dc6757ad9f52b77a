"""A broad sweep of bad inputs, as a new user makes them: is every outcome clean?

Run: python bench/bench_bad_inputs.py [--only SUBSTRING] [--show-clean]

Classes: models (unreadable, odd or hostile files), flags (values out of range or of the
wrong form), files (samples, stats, plans, profiles and reports that do not fit), outputs
(paths that clash with inputs, folders), a file-size limit standing in for a full disk.
Each case runs the installed CLI (`python -m npuprep`) in a fresh folder. Clean means:
no traceback and no "this is a bug" line; exit 2 with exactly one stderr line for the
user's mistake (or 0/1 when the case is allowed to work); every file that was there before
byte-identical; no temporary left behind. Prints the unclean cases and a count per class.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from npuprep.examples import example_data_dir, example_model_path


def relu(path: Path, *, name: str = "g", out: str = "y", elem: int = T.FLOAT, dims: tuple = (1, 4),
         opset: int = 17, ir: int = 8) -> Path:
    """x -> Relu -> out (or one Relu read by two listed outputs)."""
    g = h.make_graph([h.make_node("Relu", ["x"], [out], name="relu")], name,
                     [h.make_tensor_value_info("x", elem, list(dims))],
                     [h.make_tensor_value_info(out, elem, list(dims))])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = ir
    onnx.save(m, path)
    return path


def embed(path: Path) -> Path:
    """ids (int64) -> Gather(table 10x4) -> y."""
    table = nh.from_array(np.ones((10, 4), np.float32), "table")
    g = h.make_graph([h.make_node("Gather", ["table", "ids"], ["y"], name="gather")], "g",
                     [h.make_tensor_value_info("ids", T.INT64, [1, 3])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 4])], [table])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def external(path: Path, location: str) -> Path:
    """x -> Add(w, external data at `location`) -> y."""
    w = nh.from_array(np.ones((1, 4), np.float32), "w")
    w.data_location = T.EXTERNAL
    w.ClearField("raw_data")
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=k, value=v)
    g = h.make_graph([h.make_node("Add", ["x", "w"], ["y"])], "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 4])], [w])
    path.write_bytes(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString())
    return path


def refused(path: Path) -> Path:
    """x -> MatMul(w 3x3, external data) -> y: onnx.checker passes it, onnxruntime refuses."""
    w = nh.from_array(np.ones((3, 3), np.float32), "w")
    g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [1, 4])], [h.make_tensor_value_info("y", T.FLOAT, [1, 3])], [w])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path, save_as_external_data=True,
              location=path.stem + ".data", size_threshold=0)
    return path


def fp16_mask(path: Path) -> Path:
    """An FP16 model: s = x + Constant(-inf mask), returned, and Softmax(s)."""
    mask = nh.from_array(np.array([[0, -np.inf, 0, -np.inf]], np.float16), "m")
    g = h.make_graph([h.make_node("Constant", [], ["m"], value=mask), h.make_node("Add", ["x", "m"], ["s"]),
                      h.make_node("Softmax", ["s"], ["y"])], "g", [h.make_tensor_value_info("x", T.FLOAT16, [1, 4])],
                     [h.make_tensor_value_info(o, T.FLOAT16, [1, 4]) for o in ("s", "y")])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


@dataclass
class Case:
    cls: str
    name: str
    args: list[str]
    setup: Callable[[Path], None] = lambda w: None
    may_work: bool = False  # 0/1 are fine too (the case is odd, not wrong)
    fsize: int | None = None  # RLIMIT_FSIZE in bytes: a disk that fills up
    env: dict[str, str] = field(default_factory=dict)


def _m(w: Path) -> None:
    relu(w / "m.onnx")


def odd(path: Path, kind: str) -> Path:
    """x -> one odd node -> y: `domain` (com.microsoft Gelu), `if` (an If on a constant),
    `nan` (Add of a NaN weight), `empty` (no node: y is x), `uint8` (a uint8 input, Cast)."""
    x = h.make_tensor_value_info("x", T.UINT8 if kind == "uint8" else T.FLOAT, [1, 4])
    y = h.make_tensor_value_info("y", T.FLOAT, [1, 4])
    inits, opsets = [], [h.make_opsetid("", 17)]
    if kind == "domain":
        nodes = [h.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")]
        opsets.append(h.make_opsetid("com.microsoft", 1))
    elif kind == "if":
        inits = [nh.from_array(np.array(True), "c")]
        branch = h.make_graph([h.make_node("Relu", ["x"], ["r"])], "b", [], [h.make_tensor_value_info("r", T.FLOAT, [1, 4])])
        nodes = [h.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    elif kind == "nan":
        inits = [nh.from_array(np.full((1, 4), np.nan, np.float32), "w")]
        nodes = [h.make_node("Add", ["x", "w"], ["y"])]
    elif kind == "empty":
        nodes, y = [], h.make_tensor_value_info("x", T.FLOAT, [1, 4])
    else:
        nodes = [h.make_node("Cast", ["x"], ["y"], to=T.FLOAT)]
    onnx.save(h.make_model(h.make_graph(nodes, "g", [x], [y], inits), opset_imports=opsets), path)
    return path


def _plan_of_another(w: Path) -> None:
    _m(w)
    relu(w / "other.onnx", name="other", out="z")
    subprocess.run([sys.executable, "-m", "npuprep", "convert", "other.onnx", "-t", "generic", "--synthetic",
                    "2", "--plan-only", "-o", "other.plan.yaml"], cwd=w, capture_output=True, check=True)
    (w / "r.csv").write_text("node,precision\nrelu,fp16\n")


def _ex(w: Path) -> None:
    shutil.copy(example_model_path(), w / "ex.onnx")
    shutil.copytree(example_data_dir(), w / "D")


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        _m(w)
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            (w / name).write_text(data)
        else:
            (w / name).write_bytes(data)
    return setup


def _npz(**arrays: np.ndarray) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        _m(w)
        (w / "S").mkdir()
        np.savez(w / "S" / "s0.npz", **arrays)
    return setup


def _both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        for s in setups:
            s(w)
    return setup


def cases() -> list[Case]:
    conv = ["convert", "m.onnx", "-t", "generic", "--synthetic", "2"]
    check = ["check", "m.onnx", "-t", "generic"]
    x4 = np.zeros((1, 4), np.float32)
    out: list[Case] = [
        # -- models
        Case("models", "missing model", ["check", "none.onnx", "-t", "generic"]),
        Case("models", "empty file", ["check", "e.onnx", "-t", "generic"], _write("e.onnx", b"")),
        Case("models", "garbage bytes", ["check", "g.onnx", "-t", "generic"], _write("g.onnx", os.urandom(256))),
        Case("models", "text file", ["check", "t.onnx", "-t", "generic"], _write("t.onnx", "hello\n")),
        Case("models", "a folder", ["check", "F", "-t", "generic"], lambda w: (w / "F").mkdir()),
        Case("models", "truncated", ["check", "tr.onnx", "-t", "generic"],
             lambda w: (w / "tr.onnx").write_bytes(example_model_path().read_bytes()[:3000])),
        Case("models", "opset 30", ["check", "o.onnx", "-t", "generic"], lambda w: relu(w / "o.onnx", opset=30)),
        Case("models", "opset 7 IR 3 convert", ["convert", "o.onnx", "-t", "generic", "--synthetic", "2"],
             lambda w: relu(w / "o.onnx", opset=7, ir=3), may_work=True),
        Case("models", "no graph name", ["convert", "n.onnx", "-t", "generic", "--synthetic", "2"],
             lambda w: relu(w / "n.onnx", name=""), may_work=True),
        Case("models", "fp16 io check", ["check", "h.onnx", "-t", "a2000", "--synthetic", "2"],
             lambda w: relu(w / "h.onnx", elem=T.FLOAT16), may_work=True),
        Case("models", "fp16 io convert", ["convert", "h.onnx", "-t", "a2000", "--synthetic", "2"],
             lambda w: relu(w / "h.onnx", elem=T.FLOAT16), may_work=True),
        Case("models", "bf16 io convert", ["convert", "b.onnx", "-t", "generic", "--synthetic", "2"],
             lambda w: relu(w / "b.onnx", elem=T.BFLOAT16), may_work=True),
        Case("models", "255-char output", ["convert", "m.onnx", "-t", "generic", "--synthetic", "1", "-o",
                                           "a" * 251 + ".onnx"], _m),
        Case("models", "external data missing", ["check", "x.onnx", "-t", "generic", "--synthetic", "1"],
             lambda w: external(w / "x.onnx", "w.bin")),
        Case("models", "external data outside", ["check", "x.onnx", "-t", "generic", "--synthetic", "1"],
             lambda w: (external(w / "x.onnx", "../w.bin"), (w.parent / "w.bin").write_bytes(b"\0" * 16))),
        Case("models", "external data absolute", ["check", "x.onnx", "-t", "generic", "--synthetic", "1"],
             lambda w: external(w / "x.onnx", "/etc/passwd")),
        Case("models", "dynamic dim 1e10", ["check", "d.onnx", "-t", "generic", "--synthetic", "1",
                                            "--input-shape", "x:1x10000000000"],
             lambda w: relu(w / "d.onnx", dims=(1, "n"))),
        Case("models", "dynamic dim 1e9", ["convert", "d.onnx", "-t", "generic", "--synthetic", "2",
                                           "--input-shape", "x:1x1000000000"],
             lambda w: relu(w / "d.onnx", dims=(1, "n"))),
        Case("models", "onnxruntime refuses (external data)", ["calibrate", "r.onnx", "--synthetic", "1"],
             lambda w: refused(w / "r.onnx")),
        Case("models", "fp16 -inf mask returned", ["convert", "k.onnx", "-t", "a2000", "--synthetic", "2"],
             lambda w: fp16_mask(w / "k.onnx"), may_work=True),
        *(Case("models", f"odd: {k}", ["convert", f"{k}.onnx", "-t", "generic", "--synthetic", "2"],
               lambda w, k=k: odd(w / f"{k}.onnx", k), may_work=True)
          for k in ("domain", "if", "nan", "empty", "uint8")),
        # -- flags
        Case("flags", "top-k past the classes", [*conv, "--top-k", "y:10"], _m),
        Case("flags", "io-types target", [*conv, "--io-types", "target"], _m, may_work=True),
        Case("flags", "crosscheck foreign plan", ["crosscheck", "m.onnx", "--report", "r.csv", "-t", "generic", "--plan",
                                                  "other.plan.yaml"], _plan_of_another),
        Case("flags", "vendor-python prints garbage", ["convert", "m.onnx", "-t", "rk3588", "--synthetic", "2",
                                                       "--verify-with", "rknn", "--vendor-python", "v.sh"],
             lambda w: (_m(w), (w / "v.sh").write_text("#!/bin/sh\necho garbage\n"), os.chmod(w / "v.sh", 0o755))),
        Case("flags", "vendor-python plain python", ["convert", "m.onnx", "-t", "rk3588", "--synthetic", "2",
                                                     "--verify-with", "rknn", "--vendor-python", sys.executable],
             _m),
        Case("flags", "input-range bad form", [*check, "--synthetic", "1", "--input-range", "x:1"], _m),
        Case("flags", "input-range unknown", [*check, "--synthetic", "1", "--input-range", "q:0:1"], _m),
        Case("flags", "input-range lo>hi", [*check, "--synthetic", "1", "--input-range", "x:5:1"], _m),
        Case("flags", "input-range nan", [*check, "--synthetic", "1", "--input-range", "x:nan:1"], _m),
        Case("flags", "input-range inf", [*check, "--synthetic", "1", "--input-range", "x:0:inf"], _m),
        Case("flags", "input-range int 1e30", ["check", "e.onnx", "-t", "generic", "--synthetic", "1",
                                               "--input-range", "ids:0:1e30"], lambda w: embed(w / "e.onnx")),
        Case("flags", "input-range past table", ["check", "e.onnx", "-t", "generic", "--synthetic", "1",
                                                 "--input-range", "ids:0:99"], lambda w: embed(w / "e.onnx")),
        Case("flags", "input-shape zero", [*check, "--synthetic", "1", "--input-shape", "x:0x4"], _m),
        Case("flags", "input-shape text", [*check, "--synthetic", "1", "--input-shape", "x:abc"], _m),
        Case("flags", "input-shape wrong rank", [*check, "--synthetic", "1", "--input-shape", "x:1x4x4"], _m),
        Case("flags", "synthetic 0", [*check, "--synthetic", "0"], _m),
        Case("flags", "synthetic -1", [*check, "--synthetic", "-1"], _m),
        Case("flags", "rtol negative", [*conv, "--rtol", "-1"], _m),
        Case("flags", "rtol nan", [*conv, "--rtol", "nan"], _m),
        Case("flags", "max-fp32-share 200", [*conv, "--max-fp32-share", "200"], _m),
        Case("flags", "max-fp32-share text", [*conv, "--max-fp32-share", "lots"], _m),
        Case("flags", "top-k 0", [*conv, "--top-k", "y:0"], _m),
        Case("flags", "top-k unknown output", [*conv, "--top-k", "q:1"], _m),
        Case("flags", "top-k 1e20", [*conv, "--top-k", "y:100000000000000000000"], _m),
        Case("flags", "unknown target", ["check", "m.onnx", "-t", "nosuch"], _m),
        Case("flags", "precision int4", [*conv, "--precision", "int4"], _m),
        Case("flags", "precision bf16 a2000", ["convert", "m.onnx", "-t", "a2000", "--synthetic", "2",
                                               "--precision", "bf16"], _m),
        Case("flags", "export bogus", [*conv, "--export", "bogus"], _m),
        Case("flags", "opset 3", [*conv, "--opset", "3"], _m),
        Case("flags", "opset 99", [*conv, "--opset", "99"], _m),
        Case("flags", "max-rounds -1", [*conv, "--max-rounds", "-1"], _m),
        Case("flags", "max-memory text", [*conv, "--max-memory", "lots"], _m),
        Case("flags", "max-memory tiny", [*conv, "--max-memory", "1KB"], _m, may_work=True),
        Case("flags", "holdout missing", ["convert", "m.onnx", "-t", "generic", "--synthetic", "2",
                                          "--holdout", "nope"], _m),
        Case("flags", "jobs 0 (= auto)", ["calibrate", "m.onnx", "--synthetic", "2", "--jobs", "0"], _m,
             may_work=True),
        Case("flags", "shard 3/2", ["calibrate", "m.onnx", "--synthetic", "2", "--shard", "3/2"], _m),
        Case("flags", "shard text", ["calibrate", "m.onnx", "--synthetic", "2", "--shard", "x"], _m),
        Case("flags", "streams -1", ["calibrate", "m.onnx", "--synthetic", "2", "--streams", "-1"], _m),
        Case("flags", "gain 0", ["probe", "m.onnx", "-t", "generic", "--gain", "0"], _m),
        Case("flags", "layer unknown", ["probe", "m.onnx", "-t", "generic", "--layer", "nope"], _m),
        Case("flags", "compare emulate no target", ["compare", "m.onnx", "--emulate", "--synthetic", "1"], _m),
        Case("flags", "ledger peak text", ["ledger", "m.onnx", "-t", "generic", "--peak", "fast"], _m),
        Case("flags", "vendor-python false", ["convert", "m.onnx", "-t", "rk3588", "--synthetic", "2",
                                              "--verify-with", "rknn", "--vendor-python", "/bin/false"], _m),
        # -- files
        Case("files", "data missing", [*check, "--data", "nope"], _m),
        Case("files", "data empty folder", [*check, "--data", "S"], lambda w: (_m(w), (w / "S").mkdir())),
        Case("files", "npz wrong input", [*check, "--data", "S"], _npz(q=x4)),
        Case("files", "npz wrong dtype", [*check, "--data", "S"], _npz(x=x4.astype(np.int32))),
        Case("files", "npz wrong shape", [*check, "--data", "S"], _npz(x=np.zeros((2, 3), np.float32))),
        Case("files", "npz nan", [*check, "--data", "S"], _npz(x=np.full((1, 4), np.nan, np.float32)),
             may_work=True),
        Case("files", "npz corrupt", [*check, "--data", "S"], _write("S/s0.npz", b"PK\x03\x04garbage")),
        Case("files", "npz object array", [*check, "--data", "S"], _npz(x=np.array([None] * 4, object))),
        Case("files", "polygraphy json garbage", [*check, "--data", "d.json"], _write("d.json", "{nope")),
        Case("files", "polygraphy json list of ints", [*check, "--data", "d.json"], _write("d.json", "[1, 2]")),
        Case("files", "stats garbage", [*check, "--stats", "s.json"], _write("s.json", "not json")),
        Case("files", "stats other schema", [*check, "--stats", "s.json"], _write("s.json", '{"kind": "stats"}')),
        Case("files", "stats a list", [*check, "--stats", "s.json"], _write("s.json", "[]")),
        Case("files", "plan garbage", [*conv, "--plan", "p.yaml"], _write("p.yaml", ":::\n- [")),
        Case("files", "plan wrong shape", [*conv, "--plan", "p.yaml"], _write("p.yaml", "actions: 5\n")),
        Case("files", "plan a list", [*conv, "--plan", "p.yaml"], _write("p.yaml", "- 1\n- 2\n")),
        Case("files", "profile garbage", ["check", "m.onnx", "-t", "t.yaml"], _write("t.yaml", "{{{")),
        Case("files", "profile empty", ["check", "m.onnx", "-t", "t.yaml"], _write("t.yaml", "")),
        Case("files", "profile bad max", ["check", "m.onnx", "-t", "t.yaml"],
             _write("t.yaml", "name: x\ndefault_precision: fp99\n")),
        Case("files", "report of garbage", ["report", "r.json", "-o", "r.html"], _write("r.json", "{")),
        Case("files", "report wrong kind", ["report", "r.json", "-o", "r.html"], _write("r.json", '{"kind": "x"}')),
        Case("files", "report an array", ["report", "r.json", "-o", "r.html"], _write("r.json", "[1]")),
        Case("files", "stats merge folder", ["stats", "merge", "F", "-o", "s.json"],
             lambda w: (w / "F").mkdir()),
        Case("files", "stats merge garbage", ["stats", "merge", "a.json", "b.json", "-o", "s.json"],
             lambda w: ((w / "a.json").write_text("{}"), (w / "b.json").write_text("[]"))),
        Case("files", "crosscheck report garbage", ["crosscheck", "m.onnx", "--report", "r.csv", "-t", "generic"],
             _write("r.csv", "\x00\x01\x02")),
        Case("files", "crosscheck empty csv", ["crosscheck", "m.onnx", "--report", "r.csv", "-t", "generic"],
             _write("r.csv", "")),
        Case("files", "checklist garbage stats", ["checklist", "m.onnx", "-t", "generic", "--stats", "s.json"],
             _write("s.json", "{")),
        Case("files", "classify missing kit", ["probe", "--classify", "K", "--outputs", "O"], _m),
        # -- outputs
        Case("outputs", "-o is the model", [*conv, "-o", "m.onnx"], _m),
        Case("outputs", "-o through ..", [*conv, "-o", "F/../m.onnx"], lambda w: (_m(w), (w / "F").mkdir())),
        Case("outputs", "html is -o", [*conv, "-o", "o.onnx", "--html", "o.onnx"], _m),
        Case("outputs", "-o in missing folder", [*conv, "-o", "no/such/o.onnx"], _m, may_work=True),
        Case("outputs", "-o a folder without slash", [*conv, "-o", "F"], lambda w: (_m(w), (w / "F").mkdir()),
             may_work=True),
        Case("outputs", "-o over a symlink to the model", [*conv, "-o", "l.onnx"],
             lambda w: (_m(w), (w / "l.onnx").symlink_to(w / "m.onnx"))),
        Case("outputs", "calibrate -o is the data", ["calibrate", "m.onnx", "--data", "S", "-o", "S/s0.npz"],
             _npz(x=x4)),
        Case("outputs", "report -o is its input", ["report", "r.json", "-o", "r.json"],
             _write("r.json", '{"kind": "check"}')),
        Case("outputs", "read-only folder", [*conv, "-o", "R/o.onnx"],
             lambda w: (_m(w), (w / "R").mkdir(), os.chmod(w / "R", 0o500)),
             may_work=os.geteuid() == 0),  # root writes there all the same
        # -- a full disk: writes past 64 KB fail (EFBIG), as ENOSPC would
        Case("disk", "convert example", ["convert", "ex.onnx", "-t", "generic", "--data", "D"], _ex,
             fsize=64 * 1024),
        Case("disk", "calibrate example", ["calibrate", "ex.onnx", "--data", "D", "-o", "s.json"], _ex,
             fsize=4 * 1024),
        Case("disk", "probe kit", ["probe", "ex.onnx", "-t", "generic", "--export-kit", "K"], _ex,
             fsize=2 * 1024),
        Case("disk", "html", ["check", "ex.onnx", "-t", "generic", "--data", "D", "--html", "c.html"], _ex,
             fsize=8 * 1024),
    ]
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            for p in sorted(folder.rglob("*")) if not p.is_dir()}


def run(case: Case, root: Path) -> tuple[bool, str]:
    w = root / "w"
    w.mkdir()
    case.setup(w)
    before = files_of(w)

    def limit() -> None:
        if case.fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))

    env = dict(os.environ, **case.env)
    try:
        done = subprocess.run([sys.executable, "-m", "npuprep", *case.args], cwd=w, capture_output=True,
                              text=True, timeout=120, preexec_fn=limit, env=env)
    except subprocess.TimeoutExpired:
        return False, "still running after 120 s"
    for p in w.rglob("*"):
        if p.is_dir():
            os.chmod(p, 0o700)
    after = files_of(w)
    err = done.stderr.strip()
    problems = []
    if "Traceback" in done.stderr or "this is a bug" in done.stderr:
        problems.append("traceback/bug")
    if done.returncode == 2 and len(err.splitlines()) != 1:
        problems.append(f"{len(err.splitlines())} stderr lines")
    if done.returncode not in ((0, 1, 2) if case.may_work else (2,)) and not (case.fsize and done.returncode == 1):
        problems.append(f"exit {done.returncode}")
    changed = [k for k, v in before.items() if after.get(k) != v]
    if changed:
        problems.append(f"changed {changed[:3]}")
    temps = [k for k in after if k not in before and (".npuprep-" in k or k.endswith(".tmp") or k.endswith(".lock"))]
    if temps:
        problems.append(f"left {temps[:3]}")
    if case.fsize and done.returncode == 0:
        problems.append("exit 0 on a full disk")
    last = (err.splitlines() or [done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""])[-1]
    return not problems, f"exit {done.returncode}: {last[:160]}" + (f"  [{'; '.join(problems)}]" if problems else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--show-clean", action="store_true")
    args = ap.parse_args()
    tally: Counter[tuple[str, bool]] = Counter()
    for case in cases():
        if args.only not in f"{case.cls} {case.name}":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "sub").mkdir()
            clean, said = run(case, Path(tmp) / "sub")
        tally[(case.cls, clean)] += 1
        if not clean or args.show_clean:
            print(f"{'ok ' if clean else 'BAD'} {case.cls:8} {case.name:32} {said}")
    print("| class | cases | clean | unclean |")
    print("|---|---|---|---|")
    for cls in dict.fromkeys(c.cls for c in cases()):
        good, bad = tally[(cls, True)], tally[(cls, False)]
        if good + bad:
            print(f"| {cls} | {good + bad} | {good} | {bad} |")


if __name__ == "__main__":
    main()
