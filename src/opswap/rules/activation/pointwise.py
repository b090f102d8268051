"""activation.pointwise: an activation eager runs as several kernels -> one
`opswap::bias_act` call: one Triton kernel that reads x (and a bias) once and writes y.

Two kinds of site, matched on what the graph computes (FX leaves and torch.export ATen):

- a formula written out: GPT-2's gelu_new (transformers' NewGELUActivation,
  `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`), FastGELUActivation
  (`0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))`), both the tanh
  GELU; QuickGELUActivation (`x * sigmoid(1.702 x)`); hard-swish as `x * relu6(x + 3) / 6`
  and hard-sigmoid as `relu6(x + 3) / 6` (relu6 also as hardtanh or clamp to [0, 6]).
  When x is itself `y + b` with a 1-D bias read by nothing else, the add goes in too;
- one of the op's nine activations applied to `x + b`, b 1-D along x's last dim, the sum
  read by nothing else: the add and the activation in one kernel.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.kernels import crossover
from opswap.rules import _triton
from opswap.rules._edits import replace_with
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.pattern import Match, Op, const, op, var
from opswap.rules.registry import register
from opswap.targets.base import Target

_CLAMP = ("relu6", "hardtanh", "clamp")


def _tanh_gelu(inner: Op) -> Op:
    """0.5 * x * (1 + tanh(inner)), the factors in any order."""
    return op("mul", op("mul", var("x"), const("half")), op("add", const("one"), op("tanh", inner)))


def _relu6_of_x_plus_3() -> Op:
    return op(_CLAMP, op("add", var("x"), const("three")))


# sqrt(2/pi) * (x + 0.044715 * x^3): NewGELUActivation (gelu_new), GELUTanh's python form
_GELU_NEW = _tanh_gelu(
    op(
        "mul",
        const("k"),
        op("add", var("x"), op("mul", const("c"), op("pow", var("x"), const("three")))),
    )
)
# x * 0.7978845608 * (1 + 0.044715 * x * x): FastGELUActivation
_FAST_GELU = _tanh_gelu(
    op(
        "mul",
        op("mul", var("x"), const("k")),
        op("add", const("one2"), op("mul", op("mul", var("x"), const("c")), var("x"))),
    )
)
_TANH_GELU = dict(half=0.5, one=1.0, k=math.sqrt(2 / math.pi), c=0.044715)
_HARD = dict(three=3.0, six=6.0)

#: spelled-out formulas: (form, the activation the op computes, pattern, constants)
FORMULAS: tuple[tuple[str, str, Op, dict[str, float]], ...] = (
    ("gelu_new", "gelu_tanh", _GELU_NEW, dict(_TANH_GELU, three=3.0)),
    ("fast_gelu", "gelu_tanh", _FAST_GELU, dict(_TANH_GELU, one2=1.0)),
    (
        "quick_gelu",
        "quick_gelu",
        op("mul", var("x"), op("sigmoid", op("mul", var("x"), const("q")))),
        dict(q=1.702),
    ),
    (  # x * relu6(x + 3) / 6
        "hardswish",
        "hardswish",
        op("div", op("mul", var("x"), _relu6_of_x_plus_3()), const("six")),
        _HARD,
    ),
    (  # x * (relu6(x + 3) / 6)
        "hardswish",
        "hardswish",
        op("mul", var("x"), op("div", _relu6_of_x_plus_3(), const("six"))),
        _HARD,
    ),
    ("hardsigmoid", "hardsigmoid", op("div", _relu6_of_x_plus_3(), const("six")), _HARD),
)

#: op kinds of the activations applied to `x + b` (relu6 also as hardtanh / clamp to [0, 6])
_ACT_KINDS = (
    "relu",
    "relu6",
    "leaky_relu",
    "hardswish",
    "hardsigmoid",
    "silu",
    "gelu",
    "hardtanh",
    "clamp",
)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _num(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        return float(v)
    return None


def _constants_fit(m: Match, want: dict[str, float]) -> bool:
    for name, value in want.items():
        got = _num(m[name])
        if got is None or not math.isclose(got, value, rel_tol=1e-9):
            return False
    return True


def _bounds(node: fx.Node) -> tuple[float | None, float | None]:
    """The (low, high) a relu6 / hardtanh / clamp call or module clamps to."""
    if op_kind(node) == "relu6":
        return 0.0, 6.0
    if op_kind(node) == "hardtanh":  # nn.Hardtanh, F.hardtanh, aten.hardtanh
        return _num(setting(node, "min_val")), _num(setting(node, "max_val"))
    name = raw_name(node)
    if name.startswith("clamp_min"):
        return _num(arg(node, 1, "min")), None
    if name.startswith("clamp_max"):
        return None, _num(arg(node, 1, "max"))
    return _num(arg(node, 1, "min")), _num(arg(node, 2, "max"))


def _activation(node: fx.Node) -> tuple[str, float] | None:
    """(the op's activation name, negative_slope) that `node` computes, or None."""
    kind = op_kind(node)
    if kind in ("hardtanh", "clamp", "relu6"):
        return ("relu6", 0.0) if _bounds(node) == (0.0, 6.0) else None
    if kind == "leaky_relu":
        value = _num(setting(node, "negative_slope", 0.01))
        return ("leaky_relu", float(value)) if value is not None else None
    if kind == "gelu":
        approx = setting(node, "approximate", "none")
        return (
            ("gelu_tanh" if approx == "tanh" else "gelu", 0.0)
            if approx in ("none", "tanh")
            else None
        )
    return kind, 0.0


def _bias_add(add: fx.Node) -> tuple[fx.Node, fx.Node] | Refused | None:
    """(x, b) when `add` is x + b with b broadcast along x's last dim; a Refused for an
    add that broadcasts some other way; None for one that does not broadcast (a residual
    sum) or adds a number."""
    if op_kind(add) != "add" or len(add.args) < 2 or _num(arg(add, 2, "alpha", 1)) != 1.0:
        return None
    a, c = add.args[0], add.args[1]
    if not (isinstance(a, fx.Node) and isinstance(c, fx.Node)):
        return None
    ai, ci, si = info(a), info(c), info(add)
    if ai is None or ci is None or si is None:
        return Refused(f"the shapes of {a.name} + {c.name} are unknown")
    if ai.shape == ci.shape:
        return None
    x, b = (a, c) if ai.shape == si.shape else (c, a)
    xi, bi = info(x), info(b)
    assert xi is not None and bi is not None
    if xi.shape != si.shape or len(bi.shape) != 1 or not xi.shape or bi.shape[0] != xi.shape[-1]:
        return Refused(
            f"{add.name} broadcasts {list(ci.shape)} against {list(ai.shape)} other than a 1-D "
            "bias along the last dim; the kernel adds only such a bias"
        )
    return x, b


def _dtype_reason(x: fx.Node, out: fx.Node) -> str | None:
    xi, oi = info(x), info(out)
    if xi is None or oi is None:
        return f"the dtype of {x.name} is unknown"
    if xi.dtype not in _FLOATS:
        return f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32"
    if oi.dtype != xi.dtype:
        return f"{out.name} promotes {x.name} from {xi.dtype} to {oi.dtype}; the op keeps x's dtype"
    return None


@register
class PointwiseTriton(_triton.TritonRule):
    """A written-out activation, or an activation of x + b, as one Triton kernel with fp32
    math inside. Exact: the same function, with fewer roundings than eager's (which rounds
    x + b and every step of a formula to the input dtype). Not measured on a GPU yet: on a
    CUDA target it is taken only where the crossover table says the kernel beats eager."""

    name = "activation.pointwise"
    family = "activation"
    chapter = 9
    relieves = ("memory:activation", "memory:elementwise")
    anchors = ("mul", "div", *_ACT_KINDS)
    description = (
        "written-out gelu_new / FastGELU / QuickGELU / hard-swish / hard-sigmoid, or an "
        "activation of x + a 1-D bias -> opswap::bias_act: one Triton kernel (CUDA; only "
        "where measured faster)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if op_kind(node) in ("mul", "div"):
            return self._formula(gm, node)
        return self._activation_of_sum(node)

    def _formula(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        for form, activation, pattern, want in FORMULAS:
            m = pattern.match(gm, node)
            if m is None or not _constants_fit(m, want):
                continue
            clamps = [n for n in m.nodes if op_kind(n) in _CLAMP]
            if clamps and _bounds(clamps[0]) != (0.0, 6.0):
                return Refused(f"{clamps[0].name} clamps to other bounds than [0, 6]")
            if form == "hardsigmoid" and any(_is_hardswish(gm, u) for u in node.users):
                return None  # the inside of x * (relu6(x + 3) / 6): the hard-swish takes it
            x, nodes, bias = m["x"], list(m.nodes), None
            folded = _bias_add(x) if isinstance(x, fx.Node) else None
            if isinstance(folded, tuple) and all(u in m.nodes for u in x.users):
                nodes, (x, bias) = [x, *nodes], folded
            why = _dtype_reason(x, node)
            if why:
                return Refused(why)
            return self._found(nodes, x, bias, activation, 0.0, f"bias_act:{form}", form)
        return None

    def _activation_of_sum(self, node: fx.Node) -> Found | Refused | None:
        got = _activation(node)
        add = arg(node, 0, "input")
        if got is None or not isinstance(add, fx.Node):
            return None
        pair = _bias_add(add)
        if not isinstance(pair, tuple):
            return pair
        x, bias = pair
        why = _dtype_reason(x, node) or _dtype_reason(x, add)
        if why:
            return Refused(why)
        activation, slope = got
        return self._found([add, node], x, bias, activation, slope, "bias_act", "bias")

    def _found(
        self,
        nodes: list[fx.Node],
        x: fx.Node,
        bias: fx.Node | None,
        activation: str,
        slope: float,
        kernel: str,
        form: str,
    ) -> Found:
        out, xi = nodes[-1], info(x)
        assert xi is not None
        hidden = int(xi.shape[-1]) if xi.shape else 1
        what = f"{form} on {x.name}" + (f" + {bias.name}" if bias is not None else "")
        return Found(
            nodes,
            f"{out.name} = {what} -> opswap::bias_act({activation})",
            dict(x=x, bias=bias, activation=activation, slope=slope, kernel=kernel),
            record=dict(out=out.name, form=form, activation=activation, bias=bias is not None),
            hidden=hidden,
            rows=int(xi.numel // max(hidden, 1)),
            dtype=xi.dtype,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        args = (found["x"], found["bias"], found["activation"], float(found["slope"]))
        op = torch.ops.opswap.bias_act.default
        replace_with(gm, found.nodes[-1], op, args, remove=found.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        h, m, dtype, kernel = found["hidden"], found["rows"], found["dtype"], found["kernel"]
        note = f"{len(found.nodes)} ops -> 1 at {m} x {h}"
        if getattr(target, "kind", "cpu") == "cuda":
            dev = crossover.device_class(target)
            if crossover.lookup(kernel, dev, dtype, h, m) is None:
                # like norm.group_norm: an unmeasured kernel does not replace eager's
                return Estimate(
                    0.0,
                    0.0,
                    -1e-9,
                    f"no measured crossover for {kernel} at {crossover.shape_class(h, m)} on "
                    f"{dev} (none yet): eager's ops are kept until the kernel is measured faster",
                )
        elt = torch.empty((), dtype=dtype).element_size()
        flops = sum(node_cost(n).flops for n in found.nodes)
        fused = NodeCost(flops, 2 * m * h * elt + h * elt)
        return _triton.predict(target, kernel, found.nodes, fused, dtype, h, m, note)


def _is_hardswish(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` is x * (relu6(x + 3) / 6), the second hard-swish spelling."""
    form = FORMULAS[4]
    m = form[2].match(gm, node)
    return m is not None and _constants_fit(m, form[3])
