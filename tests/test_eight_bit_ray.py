"""The 8-bit search's trials as Ray actors (local Ray, 2 CPUs): the same conversion as in one
process, bit for bit; a worker's failure is one line."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.errors import NpuprepError
from npuprep.model_io import Model, fingerprint
from npuprep.pipeline import convert
from npuprep.profiles import load_profile

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'npuprep[ray]')")


# x (log-normal magnitudes) -> MatMul "wide" -> h;  z -> MatMul "plain" -> v -> MatMul "next";
# y = both side by side: "wide" is what INT8's one scale holds worst
GRAPH = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[64, 16] x, float[64, 16] z) => (float[64, 16] y) {
    [wide] h = MatMul (x, W1)
    [plain] v = MatMul (z, W2)
    [next] u = MatMul (v, W3)
    y = Concat <axis = 1> (h, u)
}
"""


def _setup() -> tuple[Model, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(3)
    proto = parser.parse_model(GRAPH)
    for name, shape in (("W1", (16, 8)), ("W2", (16, 8)), ("W3", (8, 8))):
        proto.graph.initializer.append(
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
    feeds = []
    for _ in range(8):
        x = np.sign(rng.standard_normal((64, 16))) * np.exp(rng.normal(0, 1.3, (64, 16)))
        feeds.append({"x": x.astype(np.float32),
                      "z": rng.standard_normal((64, 16)).astype(np.float32)})
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds


def test_the_search_on_ray_gives_the_conversion_of_one_process(local_ray, monkeypatch):
    from npuprep.calibrate import on_ray

    model, feeds = _setup()
    stats = calibrate(model, feeds, detail="all")
    profile = load_profile("a2000")
    runs = on_ray._RunsOnRay.run
    dealt: list[int] = []

    def counted(self, jobs):  # noqa: ANN001, ANN202 - wraps the real method
        dealt.append(len(jobs))
        return runs(self, jobs)

    for precision in ("int8",):
        here = convert(model, profile, feeds, precision=precision, stats=stats, rtol=0.03)
        dealt.clear()
        monkeypatch.setattr(on_ray._RunsOnRay, "run", counted)
        there = convert(model, profile, feeds, precision=precision, stats=stats, rtol=0.03, ray="")
        monkeypatch.setattr(on_ray._RunsOnRay, "run", runs)
        # The ranking's runs went to the actors as one batch, beside the widening checks.
        assert len(dealt) >= 3 and max(dealt) > len(feeds), dealt
        assert here.eight_bit is not None and there.eight_bit is not None
        assert len(here.eight_bit.curve) > 1, precision  # the search ranked and tried heads
        assert there.plan.eight_bit == here.plan.eight_bit
        assert there.eight_bit.curve == here.eight_bit.curve
        assert there.eight_bit.sensitivity == here.eight_bit.sensitivity
        assert there.eight_bit.tensor_rules == here.eight_bit.tensor_rules
        assert there.output_check.outputs == here.output_check.outputs
        assert (there.lowered.model.SerializeToString()
                == here.lowered.model.SerializeToString())


def _until_dead(actor: object) -> None:
    """ray.kill returns before the actor's process is gone: a call made at once may still run
    (CI saw one succeed on a loaded machine)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers after 60 s")


def test_a_model_the_workers_refuse_or_a_dead_worker_is_one_line(local_ray):
    from npuprep.calibrate.on_ray import SessionsOnRay

    model, feeds = _setup()
    broken = onnx.ModelProto()
    broken.CopyFrom(model.proto)
    broken.graph.node[0].op_type = "NoSuchOp"
    sessions = SessionsOnRay(ray, retries=0)
    try:
        with pytest.raises(NpuprepError, match=r"cannot load the model.*NoSuchOp") as caught:
            sessions(broken, feeds)
        assert "\n" not in str(caught.value)
        runs = sessions(model.proto, feeds)
        assert len(runs.run([(i, {}) for i in range(3)])) == 3
        for actor in sessions.actors:
            ray.kill(actor, no_restart=True)
            _until_dead(actor)
        with pytest.raises(NpuprepError, match=r"^Ray: a trial run failed after 1 try \(") as caught:
            runs.run([(0, {})])
        assert "\n" not in str(caught.value)
    finally:
        sessions.close()
    with pytest.raises(NpuprepError, match=r"--ray-cpus 3: the Ray cluster has 2 CPUs"):
        SessionsOnRay(ray, cpus_per_actor=3)


def test_ray_with_a_wider_format_is_refused_in_one_line():
    model, feeds = _setup()
    with pytest.raises(NpuprepError, match="--ray runs the 8-bit search's trials"):
        convert(model, load_profile("a2000"), feeds, precision="fp16", stats="calibrate", ray="")
