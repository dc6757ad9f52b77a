"""Graph rewrites (the only home of onnx-graphsurgeon): rescale, clamp, pin islands, lower.

Each rewrite returns a RewriteResult (model, modified, reason, details) and runs the checker
on its output; rewriting never decides, the planner does. Public entry points:

- rescale.check_rescale(model, entry, k) -> RescaleCheck; rescale.apply_rescale(model, entry, k)
- clamp.apply_clamp(model, tensor, lo, hi, consumers=None); clamp.guard_denominator(model,
  div_node, eps); clamp.clamp_exp_input / clamp_square_input; exp_input_bound / square_input_bound
- pin.grow_island(model, seed_node, fits) -> Island; pin.merge_islands; pin.island_of; pin.cast_count
- lower.lower(model, fmt, pinned_nodes=(), io_types="fp32") -> Lowered
"""

from npuprep.rewrite.result import RewriteResult

__all__ = ["RewriteResult"]
