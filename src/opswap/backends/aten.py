"""An exported program with opswap's own ops traced into the ATen ops they are made of,
for the runtimes that compile a program themselves and know nothing of
`torch.ops.opswap.*` (ExecuTorch, TVM).

    from opswap.backends.aten import to_aten
    program = to_aten(program, kept)                      # dynamic as it was
    program = to_aten(program, kept, bound=upper_bound)   # with an upper bound per axis

The program is exported again from its own graph, with two changes. Each opswap op calls
the Python definition it was registered with (`torch.library.custom_op` / `triton_op`
keep it), so the export traces it into ATen ops (and makes an in-place write in it
functional, as for the model's own); an op without one is refused in one sentence. And
weights the channels_last rule left NHWC in memory are made contiguous: the runtimes'
passes read weights in the default layout. The axes `kept` names stay dynamic, each up
to `bound(axis)` when a bound is given (ExecuTorch plans memory for the largest sizes).
A program with none of these to change is returned as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from opswap.errors import ExportError

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from opswap.graph.dynamic import Dynamic


def definitions(program: ExportedProgram, runtime: str) -> dict[Any, Any]:
    """{op: its Python definition} for every opswap op in `program`: the function the op
    was registered with, which on a CPU tensor computes the op with ATen ops. `runtime`
    names the runtime in the refusal of an op without one."""
    from torch._library.custom_ops import OPDEFS

    table = {}
    for node in program.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        if t.namespace != "opswap":
            continue
        opdef = OPDEFS.get(t.name().removesuffix(".default"))
        fn = getattr(opdef, "_init_fn", None)
        if fn is None:
            raise ExportError(
                f"The model calls {t.name()}, which has no definition {runtime} can run; "
                "leave out the rule that puts it there (--rules) or export to model.pt2."
            )
        table[t] = fn
    return table


def to_aten(
    program: ExportedProgram,
    kept: Dynamic | None = None,
    bound: Callable[[Any], int] | None = None,
    runtime: str = "the runtime",
    lower: Callable[[Any], Callable | None] | None = None,
) -> Any:
    """`program` exported again with each opswap op replaced by its definition (traced
    through), contiguous weights, and the axes of `kept` (a graph.dynamic.Dynamic) dynamic,
    up to `bound(axis)` each when given. `lower(node)`, when given, may name a function to
    trace in place of any other call (a runtime's own lowering of an ATen op), or None."""
    table = definitions(program, runtime)
    plain = all(t.is_contiguous() for t in program.state_dict.values())
    bounded = bound is not None and kept is not None and bool(kept.axes)

    def ours(n: fx.Node) -> Callable | None:
        return lower(n) if lower is not None and n.op == "call_function" else None

    if not table and plain and not bounded and not any(ours(n) for n in program.graph.nodes):
        return program
    module = program.module()
    for node in module.graph.nodes:
        if (fn := ours(node)) is not None:
            node.target = fn
        elif node.op == "call_function" and node.target in table:
            node.target = table[node.target]
    module.recompile()
    # The module is the program's own copy: its tensors are swapped, the program's stay.
    for owner in module.modules():
        for pname, p in list(owner.named_parameters(recurse=False)):
            if not p.is_contiguous():
                setattr(owner, pname, nn.Parameter(p.detach().contiguous(), p.requires_grad))
        for bname, b in list(owner.named_buffers(recurse=False)):
            if b is not None and not b.is_contiguous():
                owner.register_buffer(bname, b.contiguous())
    example = program.example_inputs
    if example is None:
        raise ExportError("The exported program holds no example inputs to export it again.")
    args, kwargs = example
    shapes = None
    if kept is not None and kept.axes:
        marks = {d: a for a in kept.axes for d in a.dims}
        leaves, spec = pytree.tree_flatten(list(args))
        per_leaf: list[Any] = []
        for i, x in enumerate(leaves):
            dims = {
                d: torch.export.Dim.AUTO(min=1, max=bound(a))
                if bound is not None
                else torch.export.Dim.AUTO
                for (li, d), a in marks.items()
                if li == i
            }
            per_leaf.append(dims if isinstance(x, torch.Tensor) and dims else None)
        shapes = tuple(pytree.tree_unflatten(per_leaf, spec))
    return torch.export.export(module, tuple(args), kwargs, dynamic_shapes=shapes, strict=False)
