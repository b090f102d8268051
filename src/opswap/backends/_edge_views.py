"""An edge-dialect pass for the XNNPACK delegate: a reshape whose target shape holds one
symbolic size (a dynamic batch times the heads, say) is written with -1 there.

XNNPACK's static_reshape takes at most one inferred dim and no symbolic ones
(ViewCopyConfig in executorch/backends/xnnpack/partition/config/generic_node_configs.py
refuses "Symbolic reshape is not supported"), so in a program that keeps its batch
dynamic every reshape stays on the portable kernels and splits the delegate, although
-1 says the same thing: the other sizes are constants and the element count fixes the one
left. A reshape with two symbolic sizes is left as it is.
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult


def _is_view(node: fx.Node) -> bool:
    name = str(getattr(node.target, "__name__", ""))
    return node.op == "call_function" and name == "aten.view_copy.default"


def one_inferred_dim(gm: fx.GraphModule) -> PassResult:
    """Every view_copy of `gm` whose shape has exactly one symbolic size, with -1 for it."""
    changed = False
    for node in gm.graph.nodes:
        if not _is_view(node) or len(node.args) < 2:
            continue
        shape: Any = node.args[1]
        if not isinstance(shape, (list, tuple)):
            continue
        symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
        if len(symbolic) != 1 or -1 in shape:
            continue
        new = list(shape)
        new[symbolic[0]] = -1
        node.args = (node.args[0], new, *node.args[2:])
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return PassResult(gm, changed)
