"""onnx.constant_fold: every node whose inputs are all constants, computed once now and
stored as a constant (shape arithmetic an exporter leaves behind, weight transposes),
with onnxscript's constant folder. A node with constant inputs that stays is a miss: its
output is past the folder's size limit, or the op cannot be evaluated ahead of time."""

from __future__ import annotations

import onnx_ir as ir

from opswap.onnx.rule import OnnxRule, RuleRun, const
from opswap.rules.base import Miss, Site

#: outputs up to this many elements are folded (a Transpose of a weight counts)
OUTPUT_LIMIT = 1 << 24


class ConstantFold(OnnxRule):
    name = "onnx.constant_fold"
    # every other rule reads the constants folding makes (a weight's Transpose, shape arithmetic)
    phase = "early"
    before = ("onnx.*",)
    exactness = "exact"
    description = "Nodes whose inputs are all constants -> the constants they compute."
    produces = ()

    def pattern(self, op, x):  # not a pattern rule: the folder visits every node
        return op.Identity(x)

    def check(self, context, x, **_):  # pragma: no cover - run() is overridden
        raise NotImplementedError

    def rewrite(self, op, x, **_):  # pragma: no cover - run() is overridden
        raise NotImplementedError

    def run(self, model: ir.Model) -> RuleRun:
        from onnxscript.optimizer import fold_constants

        before = {id(n): n.name or n.op_type for n in model.graph}
        fold_constants(model, output_size_limit=OUTPUT_LIMIT, input_size_limit=OUTPUT_LIMIT)
        from onnxscript.optimizer import remove_unused_nodes

        remove_unused_nodes(model)
        after = {id(n) for n in model.graph}
        gone = [name for i, name in before.items() if i not in after]
        out = RuleRun(self.name)
        if gone:
            out.sites.append(
                Site(
                    self.name,
                    "+".join(gone[:8]) + ("+..." if len(gone) > 8 else ""),
                    tuple(gone),
                    f"{len(gone)} nodes computed ahead of time",
                    {},
                    gone[0],
                )
            )
        for n in model.graph:
            if n.op_type == "Constant" or not n.inputs:
                continue
            if all(v is not None and const(v) is not None for v in n.inputs):
                out.misses.append(
                    Miss(
                        self.name,
                        n.name or n.op_type,
                        f"{n.op_type} has constant inputs but stays: its result is past the "
                        "folding size limit or cannot be computed ahead of time",
                    )
                )
        return out
