"""FP32 islands: grown forward until every exit fits, merged to keep Casts few (read-only)."""

from __future__ import annotations

import numpy as np
import pytest
from rewrite_util import build

from npuprep.errors import NpuprepError
from npuprep.rewrite.lower import lower
from npuprep.rewrite.pin import cast_count, grow_island, island_of, merge_islands

HEAD = '<ir_version: 8, opset_import: ["" : 17]>'


def layernorm():
    # x -> Sub(mean) -> c -> Mul(c, c) -> ReduceMean -> Add(eps) -> Sqrt -> Div(c, sd) -> Relu -> y
    return build(HEAD + """
    g (float[2,16] x) => (float[2,16] y) <float eps> {
      mu = ReduceMean<axes=[-1]>(x)
      c = Sub(x, mu)
      c2 = Mul(c, c)
      v = ReduceMean<axes=[-1]>(c2)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      n = Div(c, sd)
      y = Relu(n)
    }""", eps=np.array(1e-5, np.float32))


BIG = {"c2", "v", "ve"}


def fits(tensor: str) -> bool:
    return tensor not in BIG


def test_island_grows_until_exits_fit():
    island = grow_island(layernorm(), "node_of_c2", fits)
    assert island and island.nodes == ("node_of_c2", "node_of_v", "node_of_ve", "node_of_sd")
    assert island.exit_tensors == ("sd",) and island.entry_tensors == ("c",)
    assert island.cast_count == 2


def test_island_that_cannot_close_reports_unfit_exits():
    island = grow_island(layernorm(), "node_of_c2", fits, max_nodes=2)
    assert not island and island.unfit_exits == ("v",)


def test_graph_output_needs_no_fit_when_outputs_stay_fp32():
    model = layernorm()
    assert grow_island(model, "node_of_y", lambda t: False)
    assert not grow_island(model, "node_of_y", lambda t: False, outputs_fp32=False)


def test_merge_bridges_short_gaps_and_keeps_apart_far_islands():
    model = layernorm()
    a = island_of(model, ["node_of_c2"])
    b = island_of(model, ["node_of_n"])
    merged = merge_islands(model, [a, b])
    assert len(merged) == 1
    assert merged[0].nodes == ("node_of_c2", "node_of_v", "node_of_ve", "node_of_sd", "node_of_n")
    assert merged[0].cast_count < a.cast_count + b.cast_count
    apart = merge_islands(model, [a, b], max_gap=0)
    assert [i.nodes for i in apart] == [("node_of_c2",), ("node_of_n",)]


def test_cast_count_matches_lowering():
    model = layernorm()
    pinned = ["node_of_c2", "node_of_v", "node_of_ve", "node_of_sd"]
    lowered = lower(model, "fp16", pinned_nodes=pinned)
    io_casts = 2  # x in, y out (outputs and inputs stay FP32)
    assert cast_count(model, pinned) + io_casts == lowered.cast_count


def test_island_inside_if_body():
    # If(c) { then: Mul(x, x) -> Sqrt } else { Neg(x) } -> y
    model = build(HEAD + """
    g (float[3] x, bool c) => (float[3] y) {
      y = If(c) <then_branch = t () => (float[3] o1) { sq = Mul(x, x)
                                                       o1 = Sqrt(sq) },
                 else_branch = e () => (float[3] o2) { o2 = Neg(x) }>
    }""")
    island = grow_island(model, "node_of_sq", lambda t: t != "sq")
    assert island.nodes == ("node_of_sq", "node_of_o1") and island.scope.endswith("then_branch")


def test_unknown_node_is_a_user_error():
    with pytest.raises(NpuprepError, match="nowhere"):
        grow_island(layernorm(), "nowhere", fits)
