"""A Dynamo graph made into something opswap's planner can run: real inputs, the module's
weights as constants, and probes at other sizes where the graph is dynamic.

What Dynamo hands a backend (torch 2.13): a GraphModule whose placeholders are the
forward's inputs *and* every parameter and buffer the frame reads (nn.Modules are
inlined, so there is no get_attr and no submodule), plus one `torch.SymInt`
placeholder per symbolic size when the graph is dynamic. `example_inputs` holds the
real tensors (Parameters for the weights) and, for those sizes, SymInts;
`node.meta["grapharg"].source` says where each placeholder came from
(`L['self']._modules['conv']._parameters['weight']`).

Rules that fold or repack weights (Conv+BN, Conv+ReLU, int8) read them as constants,
i.e. from get_attr nodes. `freeze` turns each parameter or buffer placeholder that
the graph only reads into a get_attr of that very tensor, leaving the placeholder in
the signature (Dynamo still passes it) but unused; the `Frozen` record lets the
compiled graph check, on every call, that the same tensors at the same version
counter come in, so a weight changed after compiling (load_state_dict, an
optimizer step, a new Parameter) is never answered with the folded old one.
Placeholders the graph writes into (a training-mode BatchNorm's running statistics,
an in-place op on a buffer) stay inputs.

Everything here runs outside Dynamo's fake mode and tracing context: inside them
shape propagation would run on fake tensors (torch's ShapeProp picks up the tracing
context's fake mode) and `.item()` would fail.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.graph.dynamic import resized
from opswap.graph.purity import writes_in_place
from opswap.rules._matching import storage_root


@contextlib.contextmanager
def outside_dynamo() -> Iterator[None]:
    """Run real tensors through real kernels while Dynamo is compiling: no fake mode, no
    tracing context."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), tracing(None), torch.no_grad():
        yield


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def source_of(node: fx.Node) -> str:
    """Where Dynamo took a placeholder from (`L['self']._modules['fc']._parameters['weight']`),
    or "" when it does not say."""
    arg = node.meta.get("grapharg")
    source: Any = getattr(arg, "source", None)
    try:
        return str(source.name) if isinstance(source.name, str) else str(source.name())
    except Exception:  # an unfamiliar source: not a module weight as far as we know
        return ""


def is_weight(node: fx.Node, value: Any) -> bool:
    """Whether a placeholder is a parameter or buffer of one of the frame's modules."""
    if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
        return False
    where = source_of(node)
    return isinstance(value, nn.Parameter) or "._buffers[" in where or "._parameters[" in where


def hint(value: Any) -> Any:
    """A SymInt's size at this call (its hint), anything else as it is; None for a size
    Dynamo does not know (data-dependent)."""
    if isinstance(value, torch.SymInt):
        return value.node.hint
    return value


def records_autograd(example_inputs: list[Any]) -> bool:
    """Whether the graph runs with grad mode on and an input that requires grad: a
    training (or grad-recording) graph."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


def _bn_training(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (F.batch_norm, torch.batch_norm):
        return False
    flag = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    return flag is not False


def written(gm: fx.GraphModule) -> set[fx.Node]:
    """The placeholders the graph writes into: targets of in-place ops, and the running
    statistics of a BatchNorm in training mode."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if writes_in_place(n):
            target = n.args[0] if n.args else None
            if isinstance(target, fx.Node):
                root = storage_root(target)
                if root is not None and root.op == "placeholder":
                    out.add(root)
        if _bn_training(n):
            out.update(a for a in n.all_input_nodes if a.op == "placeholder")
    return out


@dataclass
class Frozen:
    """The weights a graph holds as constants: (input position, tensor, version counter).
    `holds(args)` is the per-call check that they are still what the graph was planned
    on."""

    weights: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # why a weight stayed an input

    def holds(self, args: tuple | list) -> bool:
        for i, t, v in self.weights:
            a = args[i]
            if a is not t or a._version != v:
                return False
        return True

    def changed(self, args: tuple | list) -> str:
        """Which weight no longer holds, in words."""
        for i, t, v in self.weights:
            a = args[i]
            if a is not t:
                return f"input {i} is another tensor than the one compiled with"
            if a._version != v:
                return f"input {i} was written to after compiling"
        return ""


def weight_positions(gm: fx.GraphModule, example_inputs: list[Any]) -> list[int]:
    """The input positions of the module weights, read at compile time (Dynamo drops the
    placeholders' sources once the backend returns)."""
    return [
        i
        for i, (n, v) in enumerate(zip(placeholders(gm), example_inputs, strict=True))
        if is_weight(n, v)
    ]


_PREFIX = "_frozen_"


def freeze(gm: fx.GraphModule, example_inputs: list[Any], weights: list[int]) -> Frozen:
    """Make each module weight at `weights` that the graph only reads a get_attr of the
    tensor itself (no copy), in place on `gm`; the placeholders stay, unused. Buffers
    become plain attributes, so that shape propagation (which puts buffers back after
    each run) never writes into the user's tensors. Returns what was frozen."""
    frozen = Frozen()
    writes = written(gm)
    nodes = placeholders(gm)
    for i in weights:
        node, value = nodes[i], example_inputs[i]
        if node in writes:
            frozen.kept.append(f"{node.name} is written by the graph")
            continue
        try:
            version = value._version
        except RuntimeError:  # an inference tensor keeps no version counter to check
            frozen.kept.append(f"{node.name} is an inference tensor")
            continue
        name = _PREFIX + node.name
        if isinstance(value, nn.Parameter):
            gm.register_parameter(name, value)
        else:
            setattr(gm, name, value)
        with gm.graph.inserting_after(node), warnings.catch_warnings():
            # FX warns of a get_attr that is neither a parameter nor a buffer: here on purpose
            warnings.simplefilter("ignore", UserWarning)
            attr = gm.graph.get_attr(name)
        attr.meta.update({k: v for k, v in node.meta.items() if k != "grapharg"})
        node.replace_all_uses_with(attr)
        frozen.weights.append((i, value, version))
    gm.graph.lint()
    gm.recompile()
    return frozen


def thaw(gm: fx.GraphModule, frozen: Frozen) -> Frozen:
    """Give every frozen weight that no rule consumed its placeholder back, in place on the
    rewritten `gm`: the graph then reads it as Dynamo passes it (no copy kept, nothing to
    check). Returns the weights still frozen, those rules folded or repacked."""
    nodes = {n.name: n for n in placeholders(gm)}
    original = {nodes_name: t for nodes_name, t in _frozen_names(gm, frozen)}
    back: set[str] = set()
    for n in list(gm.graph.nodes):
        name = str(n.target)[len(_PREFIX) :]
        if n.op != "get_attr" or not str(n.target).startswith(_PREFIX) or name not in original:
            continue
        # a rule may have put a folded tensor under the same name: only the weight as it
        # was (a copy of it, after the planner's copies) goes back to its placeholder
        held = getattr(gm, str(n.target), None)
        if not _same(held, original[name]):
            continue
        n.replace_all_uses_with(nodes[name])
        gm.graph.erase_node(n)
        back.add(name)
    for name in back:
        if hasattr(gm, _PREFIX + name):
            delattr(gm, _PREFIX + name)
    gm.graph.lint()
    gm.recompile()
    names = [n.name for n in placeholders(gm)]
    kept = [(i, t, v) for i, t, v in frozen.weights if names[i] not in back]
    return Frozen(kept, list(frozen.kept))


def _frozen_names(gm: fx.GraphModule, frozen: Frozen) -> list[tuple[str, torch.Tensor]]:
    names = [n.name for n in placeholders(gm)]
    return [(names[i], t) for i, t, _ in frozen.weights]


def _same(a: Any, b: torch.Tensor) -> bool:
    """Whether `a` is `b` or an exact copy of it (values, dtype, shape and strides)."""
    if a is b:
        return True
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
        and bool(torch.equal(a, b))
    )


def real_inputs(gm: fx.GraphModule, example_inputs: list[Any], frozen: Frozen) -> tuple | None:
    """The inputs to plan with: each SymInt at its hint, and an empty stand-in for each
    frozen placeholder (nothing reads it, so shape propagation need not copy it).
    None when a size has no hint."""
    stand_in = {i for i, _, _ in frozen.weights}
    out = []
    for i, x in enumerate(example_inputs):
        if i in stand_in:
            out.append(torch.empty(0, dtype=x.dtype, device=x.device))
            continue
        x = hint(x)
        if x is None:
            return None
        out.append(x)
    return tuple(out)


def _symbols(gm: fx.GraphModule, inputs: tuple) -> dict[Any, int]:
    """Every free symbol of the placeholders' sizes, with its value in `inputs` (where a
    size is the symbol itself) or else Dynamo's hint."""
    out: dict[Any, int] = {}
    hints: dict[Any, int] = {}
    for i, n in enumerate(placeholders(gm)):
        v = n.meta.get("example_value")
        x = inputs[i] if i < len(inputs) else None
        sizes: list[Any]
        real: list[Any]
        if isinstance(v, torch.SymInt):
            sizes, real = [v], [x]
        elif isinstance(v, torch.Tensor):
            sizes = list(v.shape)
            real = list(x.shape) if isinstance(x, torch.Tensor) and x.dim() == v.dim() else []
        else:
            continue
        for d, s in enumerate(sizes):
            if not isinstance(s, torch.SymInt):
                continue
            expr, env = s.node.expr, s.node.shape_env
            known = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
            for sym in expr.free_symbols:
                if sym in known:
                    hints[sym] = int(known[sym])
            if expr.is_Symbol and d < len(real) and isinstance(real[d], int):
                out[expr] = int(real[d])
    return {**hints, **out}


def is_dynamic(gm: fx.GraphModule) -> bool:
    """Whether a placeholder has a symbolic size."""
    return any(
        isinstance(v, torch.SymInt)
        or (isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape))
        for v in (n.meta.get("example_value") for n in placeholders(gm))
    )


def probes(gm: fx.GraphModule, inputs: tuple, scale: int) -> tuple | None:
    """`inputs` with every symbolic size moved: each symbol at its hint + 1 (`scale` 1) or
    twice its hint (`scale` 2), tensors cut or extended along the dims that follow it
    (graph.dynamic.resized, so ids and masks keep their structure). None when the graph
    has no symbolic size."""
    symbols = _symbols(gm, inputs)
    if not symbols:
        return None
    alt = {s: (h + 1 if scale == 1 else 2 * h) for s, h in symbols.items()}
    sizes: dict[tuple[int, int], int] = {}
    out = list(inputs)
    for i, n in enumerate(placeholders(gm)):
        v = n.meta.get("example_value")
        if isinstance(v, torch.SymInt):
            out[i] = int(v.node.expr.xreplace(alt))
        elif isinstance(v, torch.Tensor) and isinstance(out[i], torch.Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt):
                    sizes[(i, d)] = int(s.node.expr.xreplace(alt))
    return resized(tuple(out), sizes)
