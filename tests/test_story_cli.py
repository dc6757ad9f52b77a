"""The bring-up story on a mini-BERT (issue 28): masks, lowering-kept lookups, 12 layers told
apart, crosscheck without a plan, one count of pins, flags, the checklist's family, the HTML.

Every test runs the CLI as a user would, on one small model with the features of an
all-MiniLM export: an additive `-inf` mask from an integer `attention_mask`, a position lookup
the lowering keeps FP32 (its indices come from a Range), 12 layers named alike but the index.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

LAYERS, SEQ, DIM, VOCAB = 12, 8, 4, 50


def mini_bert() -> onnx.ModelProto:
    """input_ids -> Gather(word) + Gather(pos, Range(len)) -> 12 x [MatMul -> MatMul(x^T) ->
    Add(mask) -> Softmax -> MatMul]; attention_mask -> Equal(0) -> Where(-inf, 0) = mask."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.normal(size=(VOCAB, DIM)).astype(np.float32), "word"),
             nh.from_array(rng.normal(size=(SEQ, DIM)).astype(np.float32), "pos_table"),
             nh.from_array(np.array(0, np.int64), "zero_i"), nh.from_array(np.array(1, np.int64), "one_i"),
             nh.from_array(np.array([0], np.int64), "axes0"), nh.from_array(np.array([1], np.int64), "axes1"),
             nh.from_array(np.array(0.0, np.float32), "zero_f"),
             nh.from_array(np.array(-np.inf, np.float32), "neginf")]
    nodes = [h.make_node("Gather", ["word", "input_ids"], ["we"], name="/m/embeddings/word_embeddings/Gather"),
             h.make_node("Shape", ["input_ids"], ["ids_shape"], name="/m/Shape"),
             h.make_node("Gather", ["ids_shape", "one_i"], ["seq"], axis=0, name="/m/Gather_len"),
             h.make_node("Range", ["zero_i", "seq", "one_i"], ["pos"], name="/m/Range"),
             h.make_node("Unsqueeze", ["pos", "axes0"], ["pos_ids"], name="/m/Unsqueeze_pos"),
             h.make_node("Gather", ["pos_table", "pos_ids"], ["pe"],
                         name="/m/embeddings/position_embeddings/Gather"),
             h.make_node("Add", ["we", "pe"], ["h0"], name="/m/embeddings/Add"),
             h.make_node("Equal", ["attention_mask", "zero_i"], ["masked"], name="/m/Equal"),
             h.make_node("Where", ["masked", "neginf", "zero_f"], ["mask_raw"], name="/m/Where"),
             h.make_node("Unsqueeze", ["mask_raw", "axes1"], ["mask"], name="/m/Unsqueeze")]
    x = "h0"
    for i in range(LAYERS):
        p = f"/m/encoder/layer.{i}/attention/self"
        inits.append(nh.from_array(rng.normal(size=(DIM, DIM)).astype(np.float32), f"wq{i}"))
        nodes += [h.make_node("MatMul", [x, f"wq{i}"], [f"q{i}"], name=f"{p}/MatMul"),
                  h.make_node("Transpose", [x], [f"kt{i}"], perm=[0, 2, 1], name=f"{p}/Transpose"),
                  h.make_node("MatMul", [f"q{i}", f"kt{i}"], [f"s{i}"], name=f"{p}/MatMul_1"),
                  h.make_node("Add", [f"s{i}", "mask"], [f"{p}/Add_output_0"], name=f"{p}/Add"),
                  h.make_node("Softmax", [f"{p}/Add_output_0"], [f"p{i}"], axis=-1, name=f"{p}/Softmax"),
                  h.make_node("MatMul", [f"p{i}", x], [f"o{i}"], name=f"{p}/MatMul_2")]
        x = f"o{i}"
    nodes.append(h.make_node("Identity", [x], ["last_hidden_state"], name="/m/out"))
    graph = h.make_graph(nodes, "minibert",
                         [h.make_tensor_value_info("input_ids", T.INT64, [1, SEQ]),
                          h.make_tensor_value_info("attention_mask", T.INT64, [1, SEQ])],
                         [h.make_tensor_value_info("last_hidden_state", T.FLOAT, [1, SEQ, DIM])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """W/: the model, 4 real-looking samples (every row has a 1 in its mask), 2 held out,
    stats, and a conversion with its reports (made once for the module)."""
    w = tmp_path_factory.mktemp("story")
    onnx.save(mini_bert(), str(w / "bert.onnx"))
    rng = np.random.default_rng(1)
    for folder, count in (("data", 4), ("holdout", 2)):
        (w / folder).mkdir()
        for i in range(count):
            ids = rng.integers(0, VOCAB, (1, SEQ)).astype(np.int64)
            mask = np.ones((1, SEQ), np.int64)
            mask[0, rng.integers(4, SEQ):] = 0
            np.savez(w / folder / f"s{i}.npz", input_ids=ids, attention_mask=mask)
    r = run_cli("calibrate", w / "bert.onnx", "--data", w / "data", "-o", w / "stats.json", "-t", "a2000")
    assert r.returncode == 0, r.stderr
    (w / "calibrate.txt").write_text(r.stdout)
    r = run_cli("convert", w / "bert.onnx", "-t", "a2000", "-s", w / "stats.json", "--data", w / "data",
                "--holdout", w / "holdout", "-o", w / "bert.a2000.onnx")
    assert r.returncode == 0, r.stdout + r.stderr
    (w / "convert.txt").write_text(r.stdout)
    return w


def fp16_report(path, model_path):
    """A compiler report (generic CSV) that runs every node of the model in FP16."""
    names = [n.name for n in onnx.load(str(model_path)).graph.node]
    path.write_text("node,precision\n" + "".join(f"{n},fp16\n" for n in names))
    return path


def test_compare_after_convert_passes_on_the_lowered_mask(ws):
    # The conversion stores the -inf mask as -65504: no saturation, masks below the real rows.
    r = run_cli("compare", ws / "bert.onnx", ws / "bert.a2000.onnx", "--data", ws / "data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL:saturated" not in r.stdout and "PASSED" in r.stdout
    worst = r.stdout.split("Worst")[1].split("\n")[3:8]
    assert not any("Add_output" in line for line in worst), worst


def test_compare_labels_masks_as_masks_in_terminal_json_and_html(ws, tmp_path):
    # Every -inf row is a mask here: labelled `ok:mask`, grey diamonds, never a red cross.
    r = run_cli("compare", ws / "bert.onnx", ws / "bert.a2000.onnx", "--data", ws / "data", "--worst", "100",
                "--html", tmp_path / "cmp.html")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok:ref-nan" not in r.stdout and r.stdout.count("ok:mask") >= LAYERS + 1
    assert "ok:mask = an intentional -inf mask" in " ".join(r.stdout.split())
    doc = json.loads(run_cli("compare", ws / "bert.onnx", ws / "bert.a2000.onnx", "--data", ws / "data",
                             "--json").stdout)
    assert {f"/m/encoder/layer.{i}/attention/self/Add_output_0" for i in range(LAYERS)} <= set(doc["masks"])
    page = (tmp_path / "cmp.html").read_text()
    charts = page.split('id="headroom-chart"')[1].split('id="errors"')[0]
    assert ": non-finite" not in charts and "mask (-inf on purpose)" in charts
    assert "Grey diamonds: intentional -inf masks" in charts
    assert "the reference holds non-finite values" not in page and "an intentional -inf mask" in page


def test_calibrate_marks_masks_and_ranks_them_last(ws):
    rows = [line for line in (ws / "calibrate.txt").read_text().splitlines() if line.startswith(("…", "/", "s", "q"))]
    assert "mask" not in rows[0] and "inf" not in rows[0].split()[1]
    assert re.search(r"\d+ tensor\(s\) hold an intentional -inf mask", (ws / "calibrate.txt").read_text())
    r = run_cli("calibrate", ws / "bert.onnx", "--data", ws / "data", "--top", "100")
    marked = [line for line in r.stdout.splitlines() if " mask " in line or line.endswith(" mask")]
    assert len(marked) >= LAYERS
    table = r.stdout.splitlines()
    assert table.index(marked[0]) > max(i for i, line in enumerate(table) if "0/0" in line)


def test_twelve_layers_are_told_apart_in_a_100_column_table(ws):
    r = run_cli("calibrate", ws / "bert.onnx", "--data", ws / "data", "--top", "100")
    shown = {m.group(1) for m in re.finditer(r"…(layer\.\d+)/attention/self/Add", r.stdout)}
    assert shown == {f"layer.{i}" for i in range(LAYERS)}
    assert max(map(len, r.stdout.splitlines())) <= 100


def test_check_v_prints_sentences_whole_and_never_pin_fp32_beside_no_pin(ws):
    r = run_cli("check", ws / "bert.onnx", "-t", "a2000", "-s", ws / "stats.json", "-v")
    assert r.returncode == 0, r.stderr
    assert "0 node(s) pinned" in r.stdout and "pin_fp32" not in r.stdout
    # The mask's sentence is whole (wrapped, never cut with …).
    flat = " ".join(r.stdout.split())
    assert "nothing to do if these are masks; check that -max survives the compiler" in flat
    assert max(map(len, r.stdout.splitlines())) <= 100


def test_crosscheck_without_plan_agrees_with_check_and_lists_no_ok_rows(ws, tmp_path):
    report = fp16_report(tmp_path / "all_fp16.csv", ws / "bert.onnx")
    r = run_cli("crosscheck", ws / "bert.onnx", "-r", report, "-t", "a2000", "-s", ws / "stats.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mismatch" not in r.stdout and "the planner's plan" in r.stdout
    assert not any(line.startswith("ok ") for line in r.stdout.splitlines())
    every = run_cli("crosscheck", ws / "bert.onnx", "-r", report, "-t", "a2000", "-s", ws / "stats.json",
                    "--show-all")
    assert sum(line.startswith("ok ") for line in every.stdout.splitlines()) > 50


def test_crosscheck_plan_of_a_conversion_ignores_lowering_kept_lookups(ws, tmp_path):
    precision = (ws / "bert.a2000.precision.yaml").read_text()
    assert "position_embeddings/Gather" in precision and "kept FP32 by lowering" in precision
    report = fp16_report(tmp_path / "conv_fp16.csv", ws / "bert.a2000.onnx")
    r = run_cli("crosscheck", ws / "bert.a2000.onnx", "-r", report, "-t", "a2000", "--report-format",
                "generic", "-p", ws / "bert.a2000.precision.yaml", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [v for v in json.loads(r.stdout)["verdicts"] if v["verdict"] == "pin-ignored"]


def test_convert_counts_pins_by_meaning_and_prints_held_out_errors(ws):
    out = " ".join((ws / "convert.txt").read_text().split())
    assert "0 pinned by the plan, 2 kept FP32 by lowering" in out
    assert "Outputs on held-out samples (2 samples)" in (ws / "convert.txt").read_text()


def test_synthetic_mask_inputs_are_zero_one_with_a_one_per_row(ws):
    from npuprep.data import synthetic_samples

    for feed in synthetic_samples(mini_bert(), 8):
        mask = feed["attention_mask"]
        assert set(np.unique(mask)) <= {0, 1} and (mask.max(axis=-1) == 1).all()
    r = run_cli("check", ws / "bert.onnx", "-t", "a2000", "--synthetic", "4", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "range.nonfinite" not in r.stdout


def test_probe_without_data_says_what_it_ran_on(ws):
    r = run_cli("probe", ws / "bert.onnx", "-t", "a2000", "--precision", "fp16")
    assert r.returncode == 0, r.stderr
    assert "no --data: one synthetic sample (input_ids 1x8, attention_mask 1x8)" in " ".join(r.stdout.split())


def test_flags_mean_one_thing(ws):
    assert run_cli("calibrate", ws / "bert.onnx", "--data", ws / "data", "-t", "nosuch").returncode == 2
    refusal = run_cli("probe", "-t", "a2000", "--write-profile", ws / "p.yaml")
    assert refusal.returncode == 2 and "--backend ort" not in refusal.stderr
    assert "--export-kit" in refusal.stderr and not (ws / "p.yaml").exists()


def test_checklist_ticks_from_the_conversion_of_the_same_model(ws, tmp_path):
    report = fp16_report(tmp_path / "conv_fp16.csv", ws / "bert.a2000.onnx")
    r = run_cli("crosscheck", ws / "bert.a2000.onnx", "-r", report, "-t", "a2000",
                "-p", ws / "bert.a2000.precision.yaml", "--json")
    (ws / "crosscheck.json").write_text(r.stdout)
    for model in ("bert.onnx", "bert.a2000.onnx"):
        out = run_cli("checklist", ws / model, "-t", "a2000", "-w", ws, "--json")
        assert out.returncode == 0, out.stderr
        items = {i["key"]: i for i in json.loads(out.stdout)["items"]}
        assert items["crosscheck"]["done"], model
        assert items["precision"]["done"] and not any("npuprep convert" in s for s in items["precision"]["steps"])


def test_html_of_a_check_json_without_model_says_by_name_and_notes_follow_the_chart(ws, tmp_path):
    doc = run_cli("check", ws / "bert.onnx", "-t", "a2000", "-s", ws / "stats.json", "--json")
    (tmp_path / "check.json").write_text(doc.stdout)
    r = run_cli("report", tmp_path / "check.json", "-o", tmp_path / "check.html")
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "check.html").read_text()
    assert "tensor by name" in page or "by name (give the model" in page
    assert "(input)" not in page and "non-finite" not in page.split('id="headroom-chart"')[1].split("</svg>")[0]
    if 'id="notes"' in page:
        assert page.index('id="charts"') < page.index('id="notes"')


def test_calibrate_finds_masks_with_weights_left_on_disk(tmp_path, ws):
    # The same mini-BERT with its tables and weights in external data (scalars inline, as
    # exporters write them): calibrate reads no weight, and still tells the mask.
    model = mini_bert()
    onnx.save(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.onnx.data", size_threshold=64)
    r = run_cli("calibrate", tmp_path / "ext.onnx", "--data", ws / "data", "--top", "100")
    assert r.returncode == 0, r.stderr
    assert "intentional -inf mask" in r.stdout


def test_compare_reads_the_scales_a_conversion_records(tmp_path):
    from npuprep.model_io import load_model
    from npuprep.provenance import record_source

    # ref: x -> Mul(2) -> y -> Relu -> z; cand: x -> Mul(8) -> y (stored x4) -> Relu -> Mul(1/4) -> z
    head = '<ir_version: 8, opset_import: ["" : 17]>\n'
    ref = onnx.parser.parse_model(head + "g (float[4] x) => (float[4] z) "
                                  "{ k = Constant <value = float {2.0}> () y = Mul (x, k) z = Relu (y) }")
    cand = onnx.parser.parse_model(head + "g (float[4] x) => (float[4] z) "
                                   "{ k = Constant <value = float {8.0}> () q = Constant <value = float {0.25}> () "
                                   "y = Mul (x, k) r = Relu (y) z = Mul (r, q) }")
    onnx.save(ref, str(tmp_path / "ref.onnx"))
    record_source(cand, load_model(tmp_path / "ref.onnx").fingerprint, {"y": 4.0})
    onnx.save(cand, str(tmp_path / "cand.onnx"))
    r = run_cli("compare", tmp_path / "ref.onnx", tmp_path / "cand.onnx", "--synthetic", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conversion of the reference" in " ".join(r.stdout.split())
