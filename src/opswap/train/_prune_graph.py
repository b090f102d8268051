"""The dependency graph behind structured pruning (opswap.train.prune).

Removing output channel c of a conv is only half an edit: the BatchNorm after it keeps
four vectors per channel, the next conv reads channel c as an input, a residual add ties
the channel to the other branch (and so to every conv that writes into that sum), a
concat shifts it by the widths before it, and a flatten turns it into H*W consecutive
inputs of a Linear. This module walks a torch.fx trace of the model, with the example's
shapes, and follows which dimension of each value carries channels and which sets of
channels (a `Space`) are tied together; every parameter or buffer slice that indexes a
space is one of its `Member`s. A space the walk cannot follow safely (it reaches the
model's output, an op the walk does not know, a grouped conv) is `blocked`, with the
reason, and is never pruned.

Attention is followed by module: a module with query/key/value/output Linear children and
a head-count attribute (`heads`, `num_heads`, `num_attention_heads`, ...) makes its
Q, K and V outputs one space pruned a whole head at a time (`unit` = head dim); the ops
inside the module (views, transposes, the two matmuls, softmax) carry it to the output
projection's input, and pruning sets the head count to what is left.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from opswap.errors import RuleError
from opswap.graph.ops import arg, op_kind
from opswap.train._prune_spaces import Inside, Label, Segment, Spaces, Tag

HEAD_ATTRS = ("heads", "num_heads", "num_attention_heads", "n_heads", "n_head")
_Q, _K, _V = ("query", "q_proj", "q"), ("key", "k_proj", "k"), ("value", "v_proj", "v")
_O = ("output", "o_proj", "out_proj", "o")

# ops that keep every dimension where it is and only change values
_ELEMENTWISE_1 = {
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid",
    "hardtanh", "leaky_relu", "elu", "celu", "selu", "mish", "softplus", "prelu", "abs",
    "neg", "exp", "log", "sqrt", "rsqrt", "erf", "to", "contiguous", "identity",
    "dropout", "clamp",
}  # fmt: skip
_ELEMENTWISE_2 = {"add", "sub", "mul", "div", "maximum", "pow", "where"}
_CHANNEL_FIRST = {"max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool", "upsample"}
_REDUCE = {"mean", "sum", "amax", "std", "var", "norm", "prod"}
_META = (("shape",), ("dtype",), ("device",), ("ndim",), ("is_cuda",))


@dataclass
class _Attention:
    path: str
    q: str
    k: str
    v: str
    o: str
    attr: str
    space: int = -1
    closed: bool = False


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


class Dependencies(Spaces):
    """The spaces of `model` at `example_inputs`, their members and why some are blocked."""

    def __init__(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> None:
        self.model = model
        try:
            self.gm = fx.symbolic_trace(model)
            with torch.no_grad():
                ShapeProp(self.gm).propagate(*example_inputs)
        except Exception as exc:  # noqa: BLE001 - any trace failure is one sentence
            raise RuleError(
                f"structured pruning traces the model with torch.fx, which failed for "
                f"{type(model).__name__}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            ) from None
        super().__init__()
        self.tags: dict[fx.Node, Tag] = {}
        self.attention = self._find_attention()
        for node in self.gm.graph.nodes:
            self.tags[node] = self._visit(node)
        for att in self.attention.values():
            if att.space >= 0 and not att.closed:
                self.block(
                    Inside(att.path, att.space),
                    f"the heads of {att.path} do not reach its {att.o} projection",
                )

    # ------------------------------------------------------------------ attention modules

    def _find_attention(self) -> dict[str, _Attention]:
        found: dict[str, _Attention] = {}
        for path, mod in self.model.named_modules():
            names = dict(mod.named_children())
            pick = [next((n for n in group if isinstance(names.get(n), nn.Linear)), None)
                    for group in (_Q, _K, _V, _O)]  # fmt: skip
            attr = next((a for a in HEAD_ATTRS if isinstance(getattr(mod, a, None), int)), None)
            if attr is None or any(p is None for p in pick):
                continue
            q, k, v, o = (f"{path}.{p}" if path else str(p) for p in pick)
            found[path] = _Attention(path, q, k, v, o, attr)
        return found

    def _attention_of(self, linear: str) -> tuple[_Attention, str] | None:
        for att in self.attention.values():
            for role in ("q", "k", "v", "o"):
                if getattr(att, role) == linear:
                    return att, role
        return None

    def _linear(self, path: str) -> nn.Linear:
        mod = self.model.get_submodule(path)
        assert isinstance(mod, nn.Linear)
        return mod

    def _head_space(self, att: _Attention) -> int:
        if att.space < 0:
            mod = self.model.get_submodule(att.path)
            heads = int(getattr(mod, att.attr))
            sizes = {self._linear(p).out_features for p in (att.q, att.k, att.v)}
            width = next(iter(sizes))
            att.space = self.new_space(width, f"the heads of {att.path}")
            sp = self.spaces[att.space]
            sp.heads.append((att.path, att.attr))
            if len(sizes) != 1 or heads < 1 or width % heads:
                sp.blocked.append(
                    f"{att.path}'s query, key and value widths {sorted(sizes)} do not split "
                    f"into {heads} equal heads (grouped-query attention is not pruned by head)"
                )
            else:
                sp.unit = width // heads
        return att.space

    @staticmethod
    def _scopes(node: fx.Node) -> set[str]:
        stack = node.meta.get("nn_module_stack") or {}
        return {v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()}

    # ------------------------------------------------------------------ the walk

    def _tag(self, a: Any) -> Tag:
        return self.tags.get(a) if isinstance(a, fx.Node) else None

    @staticmethod
    def _shape(a: Any) -> tuple[int, ...] | None:
        if not isinstance(a, fx.Node):
            return None
        tm = a.meta.get("tensor_meta")
        shape = getattr(tm, "shape", None)
        return tuple(int(s) for s in shape) if shape is not None else None

    def _inputs(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if self._tag(a) is not None]

    def _unknown(self, node: fx.Node, kind: str) -> Tag:
        for a in self._inputs(node):
            self.block(self._tag(a), f"{node.name} ({kind}) is an op the pruner does not follow")
        return None

    def _visit(self, node: fx.Node) -> Tag:
        if node.op == "output":
            for a in node.all_input_nodes:
                self.block(self._tag(a), "it reaches the model's output")
            return None
        if node.op in ("placeholder", "get_attr"):
            return None
        kind = op_kind(node)
        if kind == "size" or (raw_target(node) == "getattr" and node.args[1:2] in _META):
            return None  # a shape, dtype or device: no channels to carry
        inside = [t for a in self._inputs(node) if isinstance(t := self._tag(a), Inside)]
        if inside and node.op != "call_module":
            scopes = self._scopes(node)
            if all(t.path in scopes for t in inside):
                for a in self._inputs(node):
                    t = self._tag(a)
                    if isinstance(t, Label):
                        self.block(t, f"{node.name} mixes it into the heads of {inside[0].path}")
                return inside[0]
            for t in inside:
                self.block(t, f"the heads of {t.path} leave the module at {node.name}")
            return None
        if node.op == "call_module":
            return self._module(node, kind)
        if kind in _ELEMENTWISE_1 or kind in ("softmax", "log_softmax"):
            return self._elementwise(node)
        if kind in _ELEMENTWISE_2:
            return self._elementwise(node)
        if kind in _CHANNEL_FIRST:
            return self._channel_first(node, kind)
        if kind == "flatten":
            start, end = arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)
            return self._flatten(node, int(start), int(end))
        if kind in ("view", "reshape", "squeeze"):
            return self._view(node, kind)
        if kind in ("transpose", "permute"):
            return self._permute(node, kind)
        if kind in _REDUCE:
            return self._reduce(node, kind)
        if kind == "cat" and raw_target(node) != "stack":
            return self._cat(node)
        if kind == "slice" and raw_target(node) == "getitem":
            return self._getitem(node)
        if kind == "matmul" and raw_target(node) in ("matmul", "__matmul__", "mm"):
            return self._matmul(node)
        return self._unknown(node, kind)

    # ------------------------------------------------------------------ modules

    def _new_out(self, node: fx.Node, size: int, dim: int, what: str) -> Label:
        sid = self.new_space(size, f"{node.target}'s {what}")
        return Label(dim, (Segment(sid),))

    def _params(self, path: str, names: tuple[str, ...], dim: int, tag: Label) -> None:
        mod = self.model.get_submodule(path)
        for name in names:
            if isinstance(getattr(mod, name, None), torch.Tensor):
                self.member(f"{path}.{name}", dim, tag.segments)

    def _module(self, node: fx.Node, kind: str) -> Tag:
        path = str(node.target)
        mod = self.model.get_submodule(path)
        x = node.args[0] if node.args else None
        xt, xs, ys = self._tag(x), self._shape(x), self._shape(node)
        if isinstance(mod, nn.Linear) and ys is not None:
            role = self._attention_of(path)
            if isinstance(xt, Inside):
                if role is not None and role[1] == "o" and role[0].path == xt.path:
                    role[0].closed = True
                    self.member(f"{path}.weight", 1, (Segment(xt.space),))
                else:
                    self.block(
                        xt, f"the heads of {xt.path} reach {path}, not its output projection"
                    )
            elif isinstance(xt, Label):
                if xs is not None and xt.dim == len(xs) - 1:
                    self.member(f"{path}.weight", 1, xt.segments)
                else:
                    self.block(xt, f"{path} reads them on a dimension other than its last")
            if role is not None and role[1] != "o":
                sid = self._head_space(role[0])
                self._params(path, ("weight", "bias"), 0, Label(0, (Segment(sid),)))
                return Inside(role[0].path, sid)
            out = self._new_out(node, mod.out_features, len(ys) - 1, "output features")
            self._params(path, ("weight", "bias"), 0, out)
            return out
        if isinstance(mod, nn.modules.conv._ConvNd) and not isinstance(mod, nn.ConvTranspose2d):
            if mod.transposed or ys is None:
                return self._unknown(node, kind)
            cin, cout, g = mod.in_channels, mod.out_channels, mod.groups
            if isinstance(xt, Label) and xt.dim != 1:
                self.block(xt, f"{path} reads them on a dimension other than its channels")
                xt = None
            if g == 1:
                if isinstance(xt, Label):
                    self.member(f"{path}.weight", 1, xt.segments)
                out = self._new_out(node, cout, 1, "output channels")
                self._params(path, ("weight", "bias"), 0, out)
                return out
            if g == cin == cout and isinstance(xt, Label):  # depthwise: channels pass through
                self._params(path, ("weight", "bias"), 0, xt)
                return xt
            self.block(xt, f"{path} is a grouped convolution ({g} groups)")
            out = self._new_out(node, cout, 1, "output channels")
            self.block(out, f"{path} is a grouped convolution ({g} groups)")
            return out
        if isinstance(
            mod, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
        ):
            if isinstance(xt, Label):
                if xt.dim != 1:
                    self.block(xt, f"{path} normalises another dimension than theirs")
                    return None
                self._params(path, ("weight", "bias", "running_mean", "running_var"), 0, xt)
            return xt
        if isinstance(mod, nn.LayerNorm):
            if isinstance(xt, Label):
                last = xs is not None and xt.dim == len(xs) - 1
                if not last or len(mod.normalized_shape) != 1 or mod.weight is None:
                    self.block(
                        xt, f"{path} normalises over more than their last dim, or has no weight"
                    )
                    return None
                self._params(path, ("weight", "bias"), 0, xt)
            return xt
        if isinstance(mod, nn.Embedding) and ys is not None:
            out = self._new_out(node, mod.embedding_dim, len(ys) - 1, "embedding width")
            self._params(path, ("weight",), 1, out)
            return out
        if kind in _ELEMENTWISE_1 or kind in ("softmax", "log_softmax"):
            return xt
        if kind in _CHANNEL_FIRST:
            return self._channel_first(node, kind)
        if isinstance(mod, nn.Flatten):
            return self._flatten(node, mod.start_dim, mod.end_dim)
        return self._unknown(node, kind)

    # ------------------------------------------------------------------ functions

    def _elementwise(self, node: fx.Node) -> Tag:
        """Broadcasting ops: tracked operands must agree (their spaces merge), a parameter
        broadcast along the channels becomes a member, a fixed-size tensor blocks them."""
        out = self._shape(node)
        if out is None:
            return self._unknown(node, op_kind(node))
        operands = [a for a in node.all_input_nodes if self._shape(a) is not None]
        result: Label | None = None
        for a in operands:
            t = self._tag(a)
            if isinstance(t, Label):
                shape = self._shape(a) or ()
                aligned = Label(t.dim + len(out) - len(shape), t.segments)
                if shape[t.dim] != out[aligned.dim]:
                    self.block(t, f"{node.name} broadcasts them")
                elif result is None:
                    result = aligned
                elif result.dim != aligned.dim or not self._unify(
                    result.segments, aligned.segments
                ):
                    self.block(t, f"{node.name} combines two different channel layouts")
                    self.block(result, f"{node.name} combines two different channel layouts")
        if result is None:
            return None
        width = out[result.dim]
        for a in operands:
            if self._tag(a) is not None:
                continue
            shape = self._shape(a) or ()
            d = result.dim - (len(out) - len(shape))
            if d < 0 or shape[d] == 1:
                continue
            if a.op == "get_attr":
                self.member(str(a.target), d, result.segments)
            elif shape[d] == width:
                self.block(result, f"{node.name} combines them with {a.name}, whose size is fixed")
        return result

    def _channel_first(self, node: fx.Node, kind: str) -> Tag:
        t = self._tag(node.args[0] if node.args else None)
        if isinstance(t, Label) and t.dim != 1:
            self.block(t, f"{node.name} ({kind}) acts on their dimension")
            return None
        return t

    def _flatten(self, node: fx.Node, start: int, end: int) -> Tag:
        x = node.args[0] if node.args else None
        t, xs = self._tag(x), self._shape(x)
        if not isinstance(t, Label) or xs is None:
            return t
        n = len(xs)
        start, end = start % n if n else 0, end % n if n else 0
        if t.dim < start:
            return t
        if t.dim > end:
            return Label(t.dim - (end - start), t.segments)
        if t.dim == start:
            factor = _numel(xs[start + 1 : end + 1])
            return Label(start, tuple(Segment(s.space, s.inner * factor) for s in t.segments))
        self.block(t, f"{node.name} flattens them inside an outer dimension")
        return None

    def _view(self, node: fx.Node, kind: str) -> Tag:
        x = node.args[0] if node.args else None
        t, xs, ys = self._tag(x), self._shape(x), self._shape(node)
        if not isinstance(t, Label) or xs is None or ys is None:
            return t
        d, n, m = t.dim, len(xs), len(ys)
        if m >= n - d and xs[d:] == ys[m - (n - d) :]:
            return Label(m - (n - d), t.segments)
        if ys[: d + 1] == xs[: d + 1] and _numel(ys[d + 1 :]) == _numel(xs[d + 1 :]):
            return t
        if m == d + 1 and ys[:d] == xs[:d]:
            factor = _numel(xs[d + 1 :])
            return Label(d, tuple(Segment(s.space, s.inner * factor) for s in t.segments))
        self.block(t, f"{node.name} ({kind}) splits or merges their dimension")
        return None

    def _permute(self, node: fx.Node, kind: str) -> Tag:
        x = node.args[0] if node.args else None
        t, xs = self._tag(x), self._shape(x)
        if not isinstance(t, Label) or xs is None:
            return t
        n = len(xs)
        if raw_target(node) == "t":
            order = list(range(n))[::-1]
        elif kind == "transpose":
            a, b = int(arg(node, 1, "dim0")) % n, int(arg(node, 2, "dim1")) % n
            order = list(range(n))
            order[a], order[b] = order[b], order[a]
        else:
            dims: Any = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
            order = [int(d) % n for d in dims]
        return Label(order.index(t.dim), t.segments)

    def _reduce(self, node: fx.Node, kind: str) -> Tag:
        x = node.args[0] if node.args else None
        t, xs, ys = self._tag(x), self._shape(x), self._shape(node)
        if not isinstance(t, Label) or xs is None or ys is None:
            return None
        dims = arg(node, 1, "dim")
        if dims is None:
            return None
        reduced = {int(d) % len(xs) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        if t.dim in reduced:
            return None  # the statistic now runs over the channels that are left
        if len(ys) == len(xs):
            return t
        return Label(t.dim - sum(d < t.dim for d in reduced), t.segments)

    def _cat(self, node: fx.Node) -> Tag:
        parts = arg(node, 0, "tensors")
        out = self._shape(node)
        if not isinstance(parts, (list, tuple)) or out is None:
            return self._unknown(node, "cat")
        dim = int(arg(node, 1, "dim", 0)) % len(out)
        tags = [self._tag(p) for p in parts]
        labels = [t for t in tags if isinstance(t, Label)]
        if not labels:
            return None
        if any(t.dim != dim for t in labels):
            return self._elementwise_like(node, labels)
        segments: list[Segment] = []
        for p, t in zip(parts, tags, strict=True):
            if isinstance(t, Label):
                segments.extend(t.segments)
            else:
                shape = self._shape(p) or (1,) * len(out)
                sid = self.new_space(shape[dim], f"{getattr(p, 'name', p)}'s fixed channels")
                self.spaces[sid].blocked.append("it is a fixed part of a concatenation")
                segments.append(Segment(sid))
        return Label(dim, tuple(segments))

    def _elementwise_like(self, node: fx.Node, labels: list[Label]) -> Tag:
        first = labels[0]
        for t in labels[1:]:
            if t.dim != first.dim or not self._unify(first.segments, t.segments):
                self.block(t, f"{node.name} joins two different channel layouts")
                self.block(first, f"{node.name} joins two different channel layouts")
                return None
        return first

    def _getitem(self, node: fx.Node) -> Tag:
        x = node.args[0] if node.args else None
        t, xs = self._tag(x), self._shape(x)
        if not isinstance(t, Label) or xs is None:
            return t
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        dim_out, dim_in = 0, 0
        for item in items:
            if item is Ellipsis or item is None or isinstance(item, fx.Node):
                break
            full = isinstance(item, slice) and item == slice(None, None, None)
            if dim_in == t.dim:
                if not full:
                    break
                return Label(dim_out, t.segments)
            dim_in += 1
            dim_out += 1 if isinstance(item, slice) else 0
        else:
            return Label(t.dim - (dim_in - dim_out), t.segments)
        self.block(t, f"{node.name} indexes their dimension")
        return None

    def _matmul(self, node: fx.Node) -> Tag:
        a, b = node.args[0], node.args[1]
        ta, tb, sa, sb = self._tag(a), self._tag(b), self._shape(a), self._shape(b)
        w = b if isinstance(b, fx.Node) and b.op == "get_attr" else None
        if w is not None and sb is not None and sa is not None and len(sb) == 2:
            if isinstance(ta, Label):
                if ta.dim != len(sa) - 1:
                    self.block(ta, f"{node.name} multiplies them on a batch dimension")
                else:
                    self.member(str(w.target), 0, ta.segments)
            ys = self._shape(node) or ()
            sid = self.new_space(sb[1], f"{w.target}'s columns")
            self.member(str(w.target), 1, (Segment(sid),))
            return Label(len(ys) - 1, (Segment(sid),))
        self.block(ta, f"{node.name} multiplies two activations")
        self.block(tb, f"{node.name} multiplies two activations")
        return None


def raw_target(node: fx.Node) -> str:
    """The bare name of a call_function or call_method target ('getitem', 'stack', 't')."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    return str(t) if isinstance(t, str) else getattr(t, "__name__", str(t))
