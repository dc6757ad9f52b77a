"""An INT8 model through the rknn-toolkit2 simulator (rk3588): the vendor's own INT8 of the FP32
model, and npuprep's QDQ model as the toolkit imports it, each beside npuprep's QDQ error."""

from __future__ import annotations

import numpy as np
import pytest
from test_eight_bit import CONVS, _convert, _model

from npuprep.runtime.session import make_session, run
from npuprep.vendors.rockchip import run_rknn, vendor_python

pytestmark = pytest.mark.skipif(vendor_python() is None,
                                reason="no rknn-toolkit2 venv ($NPUPREP_RKNN_PYTHON or "
                                       "~/.cache/npuprep/rknn-venv)")


def _rel(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    num = sum(float(np.sum((g - r) ** 2)) for g, r in zip(got, ref, strict=True))
    return float(np.sqrt(num / sum(float(np.sum(r**2)) for r in ref)))


def test_an_int8_model_through_the_rknn_simulator(tmp_path):
    rng = np.random.default_rng(1)
    # x -> Conv -> Relu -> Conv -> y, weights of about unit gain
    model = _model(tmp_path, CONVS, {"W1": rng.standard_normal((8, 4, 3, 3)) / 6,
                                     "W2": rng.standard_normal((4, 8, 3, 3)) / 8})
    feeds = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(6)]
    calib, held = feeds[:4], feeds[4:]
    result = _convert(model, calib, "int8")
    ref = [run(make_session(model.proto), f)["y"] for f in held]
    ours = _rel([run(make_session(result.lowered.model), f)["y"] for f in held], ref)
    vendor = run_rknn(model.proto, held, quantize_on=calib, work_dir=tmp_path / "vendor_int8")
    assert vendor, vendor.refusal
    assert (tmp_path / "vendor_int8" / "dataset.txt").read_text().count("\n") == len(calib)
    imported = run_rknn(result.lowered.model, held, work_dir=tmp_path / "qdq")
    assert imported, imported.refusal
    theirs = _rel([o["y"] for o in vendor.outputs], ref)
    as_imported = _rel([o["y"] for o in imported.outputs], ref)
    # All three are 8-bit errors: above FP16's (~1e-3), within the 5e-2 tolerance.
    assert 2e-3 < ours < 5e-2 and 2e-3 < theirs < 5e-2 and as_imported < 5e-2
