"""A check of a trial the 8-bit search has checked before (a head two searches share, an FP8
search's start its INT8 search tried) is not run again: the same check, bit for bit what
running it again gives."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_trials import Trials, Variant, switched_qdq

# x [32, 16] -> MatMul "a" (Wa) -> Relu -> MatMul "b" (Wb) -> y
TWO_LAYERS = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[32, 16] x) => (float[32, 8] y) {
    [a] h = MatMul (x, Wa)
    r = Relu (h)
    [b] y = MatMul (r, Wb)
}
"""


def _setup() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]], object]:
    rng = np.random.default_rng(11)
    proto = parser.parse_model(TWO_LAYERS)
    proto.graph.initializer.extend([
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "Wa"),
        numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "Wb")])
    feeds = [{"x": rng.standard_normal((32, 16)).astype(np.float32)} for _ in range(8)]
    stats = calibrate(Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds,
                      detail="all")
    return proto, feeds, stats


def test_a_trial_checked_before_is_not_run_again_and_its_check_is_the_same() -> None:
    proto, feeds, stats = _setup()
    int8 = eight_bit_format("int8")
    switched = switched_qdq(proto, ["a", "b"], stats, [Variant(int8, (ScaleRule.ABSMAX,), True)])
    trials = Trials(proto, switched, get_format("fp16"), (), feeds, saturate=True)
    both, one = {"a": "int8", "b": "int8"}, {"a": "int8"}
    first = trials.check(both, {}, rtol=0.05, top_k={})
    assert trials.runs == 1
    again = trials.check(dict(both), {}, rtol=0.05, top_k={})
    assert again is first and trials.runs == 1
    other = trials.check(one, {}, rtol=0.05, top_k={})
    assert trials.runs == 2 and other.worst_rel_l2 != first.worst_rel_l2
    # Another gate, or a check bounded where the first was not, is another check.
    assert trials.check(both, {}, rtol=0.01, top_k={}) is not first and trials.runs == 3
    assert trials.check(both, {}, rtol=0.05, top_k={}, stop_past=1e-9) is not first
    assert trials.runs == 4
    # The same trial on a fresh session gives the same numbers.
    fresh = Trials(proto, switched, get_format("fp16"), (), feeds, saturate=True)
    assert fresh.check(both, {}, rtol=0.05, top_k={}).outputs == first.outputs
