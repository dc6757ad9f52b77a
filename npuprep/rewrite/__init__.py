"""Graph rewrites (the only home of onnx-graphsurgeon): rescale, clamp, pin islands, lower.

Each rewrite returns a RewriteResult; rewriting never decides, the planner does.
"""

from npuprep.rewrite.result import RewriteResult

__all__ = ["RewriteResult"]
