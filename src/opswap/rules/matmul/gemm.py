"""matmul.gemm: a Linear / matmul / addmm (+ activation) (+ residual add) -> opswap::gemm,
opswap's tiled Triton GEMM with the bias, the activation and the residual in its
epilogue, where it measured faster than cuBLAS (the original ops, eager) at the site's
shape on the target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost
from opswap.cost.pointwise import gelu_tanh
from opswap.graph.ops import arg, copy_meta, module_of, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.kernels import crossover
from opswap.kernels import gemm as kg
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase
from opswap.rules._matching import input_of, setting
from opswap.rules.base import Estimate, Exactness, Found, Refused, Rule
from opswap.rules.registry import register

GEMM = torch.ops.opswap.gemm.default
_MATMUL_NAMES = {"matmul", "__matmul__", "mm"}
_ACTS = {"relu": "relu", "silu": "silu"}
CPU_REASON = "opswap::gemm is a CUDA kernel; on a CPU the op runs PyTorch's own product"
NEEDS_TIMING = (
    "needs timing on the target: no timer to race cuBLAS against opswap::gemm at this "
    "shape and no measured crossover entry (benchmarks/bench_gemm.py --update-crossover)"
)

#: (rule, site shape, dtype, activation, bias, residual, timer) -> (cuBLAS s, ours s)
_TIMED: dict[tuple[Any, ...], tuple[float, float]] = {}


def _operands(gm: fx.GraphModule, mm: fx.Node) -> tuple[fx.Node, Any, Any, bool] | str:
    """(x, weight, bias, b_transposed) of a GEMM node as graph values (weight and bias
    nodes, or the call_module Linear itself, read through get_attr by the rewrite), or why
    the GEMM cannot be read."""
    kind = op_kind(mm)
    x = input_of(mm)
    if x is None:
        return f"the input of {mm.name} is not a tensor of the graph"
    if kind == "addmm":
        if setting(mm, "beta", 1) != 1 or setting(mm, "alpha", 1) != 1:
            return f"{mm.name} scales its terms (beta or alpha not 1)"
        bias, xa, wa = mm.args[0], mm.args[1], mm.args[2]
        if not (isinstance(bias, fx.Node) and isinstance(xa, fx.Node) and isinstance(wa, fx.Node)):
            return f"the operands of {mm.name} are not tensors of the graph"
        bi = info(bias)
        if bi is None or len(bi.shape) != 1:
            return f"the bias of {mm.name} is not a vector; the epilogue adds a 1-D bias"
        return xa, wa, bias, False
    if kind == "matmul":
        if raw_name(mm) not in _MATMUL_NAMES:
            return f"{mm.name} is a {raw_name(mm)}, not a plain matrix product"
        w = mm.args[1] if len(mm.args) > 1 else None
        wi = info(w) if isinstance(w, fx.Node) else None
        if wi is None or len(wi.shape) != 2:
            return f"the second operand of {mm.name} is not a 2-D matrix (a batched product)"
        return x, w, None, False
    mod = module_of(mm)
    if mm.op == "call_module":
        if not isinstance(mod, torch.nn.Linear):
            return f"{mm.name} is a {type(mod).__name__}, not an nn.Linear"
        return x, mm, mm if mod.bias is not None else None, True
    w, b = arg(mm, 1, "weight"), arg(mm, 2, "bias")
    if not isinstance(w, fx.Node) or (b is not None and not isinstance(b, fx.Node)):
        return f"the weight or bias of {mm.name} is not a tensor of the graph"
    return x, w, b, True


def _activation(node: fx.Node) -> str | None:
    kind = op_kind(node)
    if kind == "gelu":
        return "gelu_tanh" if gelu_tanh(node) else "gelu"
    return _ACTS.get(kind)


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _residual(add: fx.Node, last: fx.Node) -> fx.Node | None:
    """The other operand of `add` when it adds a tensor of last's shape and dtype."""
    if op_kind(add) != "add" or len(add.args) != 2 or setting(add, "alpha", 1) != 1:
        return None
    if raw_name(add).endswith("_") or add.target == "add_":
        return None  # an in-place add writes into its first operand
    other = add.args[1] if add.args[0] is last else add.args[0]
    if other is last or not isinstance(other, fx.Node):
        return None
    oi, li = info(other), info(last)
    if oi is None or li is None or tuple(oi.shape) != tuple(li.shape) or oi.dtype != li.dtype:
        return None
    return other


def read_site(gm: fx.GraphModule, mm: fx.Node, dtypes: tuple[torch.dtype, ...]) -> Found | Refused:
    """The GEMM at `mm` with the activation and residual add that follow it (each only
    when it is the one reader of what comes before), or why opswap::gemm cannot take it."""
    ops = _operands(gm, mm)
    if isinstance(ops, str):
        return Refused(ops)
    x, w, b, bt = ops
    xi, oi = info(x), info(mm)
    if xi is None or oi is None:
        return Refused(f"the shapes of {mm.name}'s input and output are unknown")
    if oi.dtype not in dtypes or xi.dtype != oi.dtype:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return Refused(f"{mm.name} computes in {xi.dtype} -> {oi.dtype}; this rule takes {names}")
    if len(xi.shape) < 1 or len(oi.shape) < 1:
        return Refused(f"{mm.name} multiplies vectors; opswap::gemm takes a matrix of rows")
    nodes, act, res = [mm], "none", None
    nxt = _only_user(mm)
    if nxt is not None and (a := _activation(nxt)) is not None and input_of(nxt) is mm:
        nodes.append(nxt)
        act = a
    nxt = _only_user(nodes[-1])
    if nxt is not None and (r := _residual(nxt, nodes[-1])) is not None:
        nodes.append(nxt)
        res = r
    k, n = int(xi.shape[-1]), int(oi.shape[-1])
    rows = max(1, oi.numel // max(n, 1))
    parts = (
        [f"{rows} x {k} -> {n}"]
        + ([act] if act != "none" else [])
        + (["+ residual"] if res else [])
    )
    return Found(
        nodes,
        f"{mm.name}: {' '.join(parts)} -> opswap::gemm",
        dict(x=x, w=w, b=b, bt=bt, act=act, res=res, m=rows, n=n, k=k, dtype=oi.dtype),
        record=dict(gemm=mm.name, activation=act, residual=res is not None, m=rows, n=n, k=k),
    )


def rewrite_site(gm: fx.GraphModule, found: Found, precision: str) -> None:
    """Replace the site's nodes by one opswap::gemm call."""
    mm, last = found.nodes[0], found.nodes[-1]
    g = gm.graph
    with g.inserting_before(last):
        w, b = found["w"], found["b"]
        if mm.op == "call_module":
            w = g.get_attr(f"{mm.target}.weight")
            b = g.get_attr(f"{mm.target}.bias") if b is not None else None
        y = g.call_function(
            GEMM, (found["x"], w, b, found["res"], found["act"], found["bt"], precision)
        )
    copy_meta(y, last)
    last.replace_all_uses_with(y)
    drop_dead_attrs(gm, erase(gm, list(reversed(found.nodes))))


def _eager(found: Found) -> Callable[..., torch.Tensor]:
    """The site's original ops, as eager PyTorch (cuBLAS on a GPU) runs them."""
    act, bt = found["act"], found["bt"]

    def run(
        x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor | None
    ) -> torch.Tensor:
        y = F.linear(x, w if bt else w.t(), b)
        y = kg.activate(y, act)
        return y + r if r is not None else y

    return run


def time_site(found: Found, timer: Any, precision: str, key: str) -> tuple[float, float]:
    """(cuBLAS seconds, opswap::gemm seconds) of the site at its shape, timed by `timer`
    on the GPU when there is one (random inputs of the site's sizes), cached per shape."""
    m, n, k, dtype = found["m"], found["n"], found["k"], found["dtype"]
    bias, act, res = found["b"] is not None, found["act"], found["res"] is not None
    full = (key, m, n, k, dtype, act, bias, res, found["bt"], timer)
    hit = _TIMED.get(full)
    if hit is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        if not found["bt"]:
            w = w.t().contiguous()
        b = torch.randn(n, device=dev, dtype=dtype) if bias else None
        r = torch.randn(m, n, device=dev, dtype=dtype) if res else None
        eager, bt = _eager(found), found["bt"]
        with torch.inference_mode():
            got = timer(
                {
                    "cublas": lambda: eager(x, w, b, r),
                    "ours": lambda: GEMM(x, w, b, r, act, bt, precision),
                }
            )
        hit = _TIMED[full] = (float(got["cublas"]), float(got["ours"]))
    return hit


def _gemm_cost(found: Found, size: int) -> NodeCost:
    m, n, k = found["m"], found["n"], found["k"]
    extra = (n if found["b"] is not None else 0) + (m * n if found["res"] is not None else 0)
    return NodeCost(2 * m * n * k, size * (m * k + n * k + m * n + extra))


def predict_site(
    gm: fx.GraphModule, found: Found, target: Any, precision: str, key: str
) -> Estimate:
    """Measured where it can be: the target's timer (cuBLAS against ours at the site's
    shape), else the crossover table's entry for the shape class; neither: refused as
    needing a measurement (a negative saving the planner skips with this reason)."""
    if getattr(target, "kind", "cpu") != "cuda":
        return Estimate(0.0, 0.0, -1e-9, CPU_REASON)
    where = f"{found['m']} x {found['k']} -> {found['n']}"
    timer = getattr(target, "timer", None)
    if timer is not None:
        t_cublas, t_ours = time_site(found, timer, precision, key)
        verdict = "ours faster" if t_ours < t_cublas else "cuBLAS faster: kept"
        return Estimate(
            0.0,
            0.0,
            t_cublas - t_ours,
            f"timed at {where}: cuBLAS and the separate ops {t_cublas * 1e6:.1f} us, "
            f"opswap::gemm {t_ours * 1e6:.1f} us ({verdict})",
        )
    dev = crossover.device_class(target)
    shape = kg.shape_class(found["m"], found["n"], found["k"])
    entry = crossover.lookup(key, dev, found["dtype"], 0, 0, shape=shape)
    if entry is None:
        return Estimate(0.0, 0.0, -1e-9, f"{where}: {NEEDS_TIMING} ({dev}, {shape})")
    size = torch.empty((), dtype=found["dtype"]).element_size()
    est = saving(target, found.nodes, [_gemm_cost(found, size)], "")
    t = abs(est.time_saved_s or 1e-9)
    return Estimate(
        0.0,
        est.bytes_saved,
        t if entry.beats_eager else -t,
        f"{where}: measured {entry.speedup_vs_eager}x cuBLAS on {dev} ({entry.source})",
    )


@register
class Gemm(Rule):
    """Linear / matmul / addmm, with the activation (ReLU, GELU erf or tanh, SiLU) and the
    residual add that follow it, -> opswap::gemm: the bias, the activation and the residual
    are applied to the fp32 accumulator before the one store, where eager writes the
    product and reads it back once per following op.

    Exact: the same product (fp32 accumulate over the same inputs; the order of the sum
    differs, as between any two GEMM kernels) and one rounding to the dtype where eager
    rounds after each op. The choice is measured: with the target's timer, cuBLAS (the
    original ops, eager) against ours at the site's shape, ours kept only where faster;
    without one, the crossover table (kernels/crossover.py, "gemm"); neither: the site is
    skipped as needing timing on the target. CUDA only: on a CPU the op runs PyTorch's
    product, no faster.
    """

    name = "matmul.gemm"
    family = "matmul"
    chapter = 12
    exactness: ClassVar[Exactness] = "exact"
    implementation = "triton"
    targets = ("cuda",)
    # Linears made by fusion (matmul_add, BatchNorm folds) first; the cuBLASLt epilogue
    # rule takes Linear + ReLU / tanh-GELU without a measurement: this one is measured
    after = ("fusion.*", "activation.gelu_tanh")
    before: ClassVar[tuple[str, ...]] = ("activation.linear_epilogue",)
    relieves: ClassVar[tuple[str, ...]] = ("compute:matmul", "memory:activation")
    anchors = ("linear", "addmm", "matmul")
    description = (
        "Linear/matmul/addmm (+ activation)(+ residual add) -> opswap::gemm, a tiled Triton "
        "GEMM with the epilogue fused, where timed faster than cuBLAS at the site's shape."
    )
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    precision = "ieee"

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        return read_site(gm, node, self.dtypes)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        rewrite_site(gm, found, self.precision)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        return predict_site(gm, found, target, self.precision, "gemm")
