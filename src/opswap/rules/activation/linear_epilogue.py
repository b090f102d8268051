"""activation.linear_epilogue: Linear (with bias) + ReLU or tanh-GELU ->
`aten._addmm_activation`, so that cuBLASLt adds the bias and applies the activation in
the GEMM's epilogue."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.cost.pointwise import gelu_tanh
from opswap.graph.ops import arg, copy_meta, module_of, op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, shape_args
from opswap.rules._matching import has_layout, input_of, setting, shared_reason, strides
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

ADDMM_ACTIVATION = torch.ops.aten._addmm_activation.default
#: the dtypes whose addmm takes the cuBLASLt path (Blas.cpp, isInputCompliesAddmmCudaLt)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _parts(gm: fx.GraphModule, mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, bool] | str:
    """(input, weight, bias, weight_is_kn) of a Linear or addmm node, as graph values, or
    why the epilogue cannot take it. `weight_is_kn`: the weight is already [K, N] (addmm)."""
    if op_kind(mm) == "addmm":
        if setting(mm, "beta", 1) != 1 or setting(mm, "alpha", 1) != 1:
            return f"{mm.name} scales its terms (beta or alpha not 1); the epilogue adds the bias as it is"
        bias, x, w = mm.args[0], mm.args[1], mm.args[2]
        if not all(isinstance(v, fx.Node) for v in (bias, x, w)):
            return f"the operands of {mm.name} are not tensors of the graph"
        return x, w, bias, True  # type: ignore[return-value]
    mod = module_of(mm)
    if mod is not None and not isinstance(mod, torch.nn.Linear):
        return f"{mm.name} is a {type(mod).__name__}, not an nn.Linear"
    found = weighted(gm, mm)
    if isinstance(found, str):
        return found
    if found.bias is None:
        return f"{mm.name} has no bias, and the epilogue is the one that adds a bias"
    x = input_of(mm)
    if x is None:
        return f"the input of {mm.name} is not a tensor of the graph"
    if mm.op == "call_module":
        # the module's tensors, read through get_attr nodes made by the rewrite
        return x, mm, mm, False
    wn, bn = arg(mm, 1, "weight"), arg(mm, 2, "bias")
    return x, wn, bn, False


def epilogue_refusal(
    gm: fx.GraphModule, mm: fx.Node, act: fx.Node, as_tanh: bool = False
) -> str | None:
    """Why `act`, reading `mm` (a Linear or addmm), cannot run in the GEMM's epilogue
    through `_addmm_activation`'s cuBLASLt path, or None when it can (`as_tanh`: judge a
    GELU as if it were the tanh form already). Each condition is one of Blas.cpp's
    isInputCompliesAddmmCudaLt, or what the reshape to 2-D needs."""
    parts = _parts(gm, mm)
    if isinstance(parts, str):
        return parts
    x, _, bias, kn = parts
    xi, oi = info(x), info(mm)
    if xi is None or oi is None:
        return f"the shapes of {mm.name}'s input and output are unknown"
    if oi.dtype not in DTYPES:
        return (
            f"{mm.name} computes in {oi.dtype}; cuBLASLt's epilogue takes float32, "
            "float16, bfloat16 or float64"
        )
    if xi.dtype != oi.dtype:
        return f"{mm.name} reads {xi.dtype} and writes {oi.dtype}; the epilogue keeps one dtype"
    if len(xi.shape) < 2:
        return f"{mm.name}'s input is 1-D; the epilogue needs a matrix of rows"
    if kn:
        bi = info(bias)
        if bi is None or len(bi.shape) != 1:
            shape_ = "unknown" if bi is None else f"{list(bi.shape)}"
            return f"the bias of {mm.name} is {shape_}, not a vector; the epilogue adds a 1-D bias"
    k, n = int(xi.shape[-1]), int(oi.shape[-1])
    if k == 1 or n == 1:
        return (
            f"{mm.name} is {k} -> {n}; cuBLASLt refuses a matrix with one row or column, "
            "and the op would fall back to a GEMM and a separate activation"
        )
    st = strides(x)
    if len(xi.shape) > 2 and st is not None and not has_layout(xi.shape, st):
        return f"{x.name} is not contiguous; flattening it to 2-D for the GEMM would copy it"
    if op_kind(act) == "gelu" and not (as_tanh or gelu_tanh(act)):
        return (
            f"{act.name} is GELU in its erf form, and cuBLASLt's epilogue computes the tanh "
            "form (activation.gelu_tanh makes it tanh under --exactness approx)"
        )
    return shared_reason(mm, {act}, "the activation cannot move into its epilogue")


@register
class LinearEpilogue(Rule):
    """Linear (or addmm) with a bias, then ReLU or tanh-GELU -> `aten._addmm_activation`:
    on CUDA, cuBLASLt adds the bias and applies the activation to the fp32 accumulator
    in the GEMM's epilogue, so the Linear's output is written once and never re-read.

    What PyTorch does with the op (the Python side read in the installed torch 2.13; the
    C++ files, which the wheel does not ship, in PyTorch's current source):

    - CUDA, aten/src/ATen/native/cuda/Blas.cpp: `addmm_activation_out_cuda` calls
      `addmm_out_cuda_impl` with Activation::RELU or GELU. The cuBLASLt path
      (`launchGemmAndBiasCublasLt`, the RELU_BIAS / GELU_BIAS epilogues) is taken when
      `isInputCompliesAddmmCudaLt` holds: beta == 1, the bias 1-D, of size N and
      contiguous, the result 2-D and contiguous, float32 / float16 / bfloat16 / float64,
      every size of both matrices > 1 (and, before CUDA 12.1, sizes < 65535 * 32 and
      16-bit inputs non-overlapping and dense), and DISABLE_ADDMM_CUDA_LT not set.
      Otherwise, or when cuBLASLt fails, it runs a plain GEMM and then `relu_` or
      `gelu_(..., "tanh")` on the result in place: the same math, one pass more. The
      GELU is the tanh form on both paths.
    - CPU, aten/src/ATen/native/LinearAlgebra.cpp: `addmm_activation_out_cpu` runs
      addmm, then `relu_` or `gelu_` with the default approximate="none": the erf form.
      So use_gelu=True means tanh-GELU on CUDA and erf-GELU on CPU (the decomposition
      in torch/_decomp/decompositions.py, `_addmm_activation`, branches on is_cuda the
      same way). ReLU is the same on both.
    - torch.export keeps the op (it is not in the core ATen decomposition table, and
      run_decompositions() leaves it); Inductor has no lowering and calls it as an extern
      kernel (torch/_inductor/lowering.py, `make_fallback(aten._addmm_activation)`), so
      under torch.compile it is not fused with what follows: the race decides.
    - ONNX: torch.onnx would decompose it on the CPU, i.e. to erf-GELU; opswap's lowering
      (backends/lowerings.py) writes MatMul + Add + Relu or Gelu(approximate="tanh"), the
      function the rule replaced.

    Exact on CUDA: eager rounds the Linear's output to the dtype, then the activation
    reads it back; the epilogue applies bias and activation on the fp32 accumulator and
    rounds once, one rounding fewer (ReLU commutes with rounding, so for ReLU the bits
    are the same). cuBLASLt's tanh is not correctly rounded: in float32 the folded
    tanh-GELU erred 2.2e-6 at most against float64 on the H200 (torch 2.11), where
    eager's rounding erred 1.2e-7, within the exact class's rel_l2 bound of 1e-5; in
    bfloat16 it errs less than eager. Only the tanh form of GELU folds; the erf form is refused with the
    rule that turns it into tanh. A model run on a CPU after the rewrite computes the
    erf form at the GELU sites (see above): within 4.7e-4 of the tanh form, the bound
    activation.gelu_tanh documents; the ReLU sites are identical.
    """

    name = "activation.linear_epilogue"
    family = "activation"
    chapter = 9
    exactness = "exact"
    targets = ("cuda",)
    # Linears made by matmul_add or with a BatchNorm folded, and GELUs made tanh, first
    after = ("fusion.*", "activation.gelu_tanh")
    relieves = ("memory:activation",)
    anchors = ("relu", "gelu")
    description = (
        "Linear/addmm with bias + ReLU or tanh-GELU -> aten._addmm_activation: cuBLASLt "
        "applies bias and activation in the GEMM epilogue (CUDA), one fewer pass over "
        "the activation tensor."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        mm = input_of(node)
        if mm is None or op_kind(mm) not in ("linear", "addmm"):
            return None
        why = epilogue_refusal(gm, mm, node)
        if why is not None:
            return Refused(why)
        parts = _parts(gm, mm)
        assert not isinstance(parts, str)  # epilogue_refusal read the same parts
        x, w, b, kn = parts
        gelu = op_kind(node) == "gelu"
        xi, oi = info(x), info(mm)
        assert xi is not None and oi is not None
        return Found(
            (mm, node),
            f"{mm.name} + {node.name} -> _addmm_activation (bias and "
            f"{'tanh-GELU' if gelu else 'ReLU'} in the GEMM epilogue)",
            dict(x=x, w=w, b=b, kn=kn, gelu=gelu, rank=len(xi.shape), n=int(oi.shape[-1])),
            record=dict(linear=mm.name, activation="gelu_tanh" if gelu else "relu"),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        mm, act = found.nodes
        xi = info(found["x"])
        assert xi is not None  # check() read it
        x, rank, n, k = found["x"], found["rank"], found["n"], xi.shape[-1]
        g = gm.graph
        with g.inserting_before(act):
            if mm.op == "call_module":
                w, b = g.get_attr(f"{mm.target}.weight"), g.get_attr(f"{mm.target}.bias")
            else:
                w, b = found["w"], found["b"]
            wt = w if found["kn"] else call(g, act, "t", (w,))
            x2 = x if rank == 2 else call(g, act, "reshape", (x, [-1, int(k)]))
            y = g.call_function(ADDMM_ACTIVATION, (b, x2, wt), {"use_gelu": found["gelu"]})
            if rank != 2:
                lead = shape_args(g, act, x, [(d,) for d in range(rank - 1)])
                y = call(g, act, "reshape", (y, [*lead, n]))
        copy_meta(y, act)
        act.replace_all_uses_with(y)
        # a call_module Linear's parameters stay on its module, read by the get_attr nodes
        drop_dead_attrs(gm, erase(gm, [act, mm]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        act = found.nodes[-1]
        # the activation's arithmetic moves into the GEMM's epilogue; its bytes go
        return saving(
            target,
            [act],
            [NodeCost(node_cost(act).flops, 0)],
            "bias and activation in the cuBLASLt epilogue: the Linear output is written "
            "once, never re-read (not yet measured on a GPU: benchmarks/bench_epilogue.py)",
        )
