"""opswap's static int8 sites handed to Inductor's own int8 lowering under torch.compile.

In eager mode (and in model.pt2) a static int8 site is one opaque op,
`opswap::int8_static_conv2d` or `opswap::int8_static_linear`, which calls onednn's int8
kernel from Python (kernels/int8_static.py). Compiled, that op stays a Python call per
site, with its input quantised in a pass of its own. Inductor has
an int8 path of its own for CPU inference, the one torchao's PT2E flow feeds: with
freezing on, its passes match quantize -> dequantize -> conv / linear -> quantize
patterns, prepack the int8 weights once as constants, and emit onednn's int8 kernels with
the ReLU, GELU and requantisation fused into them, the work between them (residual adds,
the quantisation of the next input) in Inductor's own fused loops. (On the small ResNet
the adds stay in those loops: no convolution takes one as its epilogue's sum.)

`lower` writes each site of a graph in that form, with the site's own calibrated scales
and int8 weights (nothing is calibrated again), so the values are those of the op up to
the rounding of values on a half step. A site's input must be known to be float32 or
uint8 (the graph's node values, as model.pt2 has them); another site keeps the op.
`compile_module` compiles the lowered copy with every call (and so every recompile, for
a new batch size) under freezing and no_grad, since Dynamo decides whether parameters
are frozen when it traces. Measured on
the ResNet-50-size CNN (VNNI VM, batch 1, one interleaved run): 15.6 ms against 21.0 for
the ops in eager mode and 20.2 (an earlier run) for the ops compiled as they are;
torchao's PT2E flow 15.2 ms and OpenVINO's NNCF int8 11.1 in the same run (chapter 06).
A graph with no such site is compiled as it is.
"""

from __future__ import annotations

import copy
import platform
import warnings
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn

from opswap.kernels._cache_key import inductor_options


def _ops() -> dict[Any, str]:
    """The ops lowered (their OpOverloads), with the kind of each."""
    from opswap.kernels import int8_static  # noqa: F401  (registers the ops)

    return {
        torch.ops.opswap.int8_static_conv2d.default: "conv",
        torch.ops.opswap.int8_static_linear.default: "linear",
    }


def _bind(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in from the op's schema."""
    schema = node.target._schema  # type: ignore[union-attr]
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update(zip([a.name for a in schema.arguments][: len(node.args)], node.args, strict=True))
    out.update(node.kwargs)
    return out


def _site(gm: fx.GraphModule, node: fx.Node, ops: dict[Any, str]) -> dict[str, Any] | None:
    """A site's kind, input node, tensors and constants, from an op call on constants (a
    program as model.pt2 holds it); None for any other node. A graph as planned, where the
    sites are opswap's modules, has none: the race compiles the file it saved."""
    if node.op != "call_function" or node.target not in ops:
        return None
    a = _bind(node)

    def tensor(n: Any) -> torch.Tensor | None:
        if n is None:
            return None
        if not isinstance(n, fx.Node) or n.op != "get_attr":
            raise _NotConstant
        mod, _, attr = str(n.target).rpartition(".")
        return getattr(gm.get_submodule(mod), attr)

    a["kind"] = ops[node.target]
    a["wq"], a["w_scale"], a["bias"] = tensor(a["wq"]), tensor(a["w_scale"]), tensor(a["bias"])
    return a


class _NotConstant(Exception):
    """A site whose weights are not constants of the graph: left as the op."""


def lower(module: nn.Module) -> tuple[nn.Module, int]:
    """A copy of `module` (an FX GraphModule) with every opswap static int8 site written as
    Inductor's int8 pattern, and how many; `(module, 0)`, the module itself, when it is
    not a graph or has no site that can be lowered (an input whose dtype is not known to
    be float32 or uint8 keeps the op). The module given is not changed."""
    if not isinstance(module, fx.GraphModule):
        return module, 0
    # registers torch.ops.quantized_decomposed, the ops Inductor's int8 passes match (torch's
    # own module, not the deprecated eager quantization API; no warning on 2.13)
    import torch.ao.quantization.fx._decomposed  # noqa: F401

    qd = torch.ops.quantized_decomposed
    ops = _ops()

    if not any(n.op == "call_function" and n.target in ops for n in module.graph.nodes):
        return module, 0
    gm = copy.deepcopy(module)
    g = gm.graph
    # the dtype each lowered site writes (float32: a handoff too, below), for its readers
    wrote: dict[fx.Node, torch.dtype] = {}
    count = 0
    for node in list(g.nodes):
        try:
            a = _site(gm, node, ops)
        except _NotConstant:
            continue
        if a is None:
            continue
        x = a["x"]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        dtype = wrote.get(x, getattr(val, "dtype", None))
        if dtype not in (torch.uint8, torch.float32):
            continue
        given_uint8 = dtype == torch.uint8
        wq: torch.Tensor = a["wq"]
        n_out = wq.shape[0]
        scale = a["w_scale"].detach().float().reshape(-1)
        if scale.numel() == 1:  # per-tensor weights: one scale for every channel
            scale = scale.expand(n_out)

        def const(name: str, t: torch.Tensor, i: int = count) -> fx.Node:
            # plain tensor attributes, as PT2E's convert writes them: frozen with the rest
            setattr(gm, f"_opswap_int8_{i}_{name}", t)
            with warnings.catch_warnings():  # FX asks for a buffer; a plain one is meant
                warnings.simplefilter("ignore", UserWarning)
                return g.get_attr(f"_opswap_int8_{i}_{name}")

        xs, xz = float(a["x_scale"]), int(a["x_zp"])
        with g.inserting_before(node):
            if a["kind"] == "linear" and (val is None or val.dim() > 2):
                # tokens [..., K] in a contiguous buffer, as the op read them: Inductor's
                # pattern for a strided 3-D input (a transpose) compares sizes that are
                # symbolic under dynamic shapes and fails (torch 2.13)
                x = g.call_function(torch.ops.aten.contiguous.default, (x,))
            xq = x
            if not given_uint8:
                xq = g.call_function(
                    qd.quantize_per_tensor.default, (x, xs, xz, 0, 255, torch.uint8)
                )
            xdq = g.call_function(
                qd.dequantize_per_tensor.default, (xq, xs, xz, 0, 255, torch.uint8)
            )
            w = g.call_function(
                qd.dequantize_per_channel.default,
                (
                    const("weight", wq.detach().clone()),
                    const("scale", scale.clone()),
                    const("zero_point", torch.zeros(n_out, dtype=torch.int64)),
                    0, -128, 127, torch.int8,
                ),
            )  # fmt: skip
            bias = None if a["bias"] is None else const("bias", a["bias"].detach().float().clone())
            if a["kind"] == "conv":
                y = g.call_function(
                    torch.ops.aten.conv2d.default,
                    (xdq, w, bias, list(a["stride"]), list(a["padding"]), list(a["dilation"]),
                     int(a["groups"])),
                )  # fmt: skip
            else:
                y = g.call_function(torch.ops.aten.linear.default, (xdq, w, bias))
            post = a["post"]
            if post == "relu":
                y = g.call_function(torch.ops.aten.relu.default, (y,))
            elif post in ("gelu", "gelu_tanh"):
                approx = "tanh" if post == "gelu_tanh" else "none"
                y = g.call_function(torch.ops.aten.gelu.default, (y,), {"approximate": approx})
        # a handoff (out_scale > 0: uint8 for the one int8 site that reads it, which takes it
        # as quantised with its own input scale) is written as a float output that the
        # reader quantises with that scale: the same numbers and the same pattern
        # (quantize right after the epilogue, dequantize before the reader), which Inductor
        # fuses into the convolution before as in PT2E's graphs; and a reader left as the
        # op quantises a float input itself
        wrote[y] = torch.float32
        node.replace_all_uses_with(y)
        g.erase_node(node)
        count += 1
    if count == 0:
        return module, 0
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return gm, count


_SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), where onednn's
    bfloat16 GEMM runs at about twice the float32 rate."""
    from opswap.rules.precision._half import _CPU_FLAGS, _cpu_flags

    return platform.machine().lower() in ("x86_64", "amd64") and any(
        f in _cpu_flags() for f in _CPU_FLAGS[torch.bfloat16]
    )


def attention_bf16(gm: fx.GraphModule) -> int:
    """Rewrite each float32 `aten.scaled_dot_product_attention` call of `gm` (no dropout,
    not causal, a float or boolean mask or none) as its two matmuls in bfloat16 around a
    float32 softmax, in place; returns how many. A row with every key masked gives zeros,
    as the CPU flash kernel and `aten._safe_softmax` do, not NaN. The scores are scaled, masked and
    normalised in float32 (one Inductor loop with the casts on both sides), so the only
    rounding added is bfloat16's on q, k, v and the probabilities (2^-9 relative). At
    BERT-base's shape (12 heads, 128 tokens, 64 per head) one layer's attention took 0.38
    ms of CPU time against 0.67 for the float32 flash kernel (one thread, AVX-512 BF16)."""
    bf16, f32 = torch.bfloat16, torch.float32
    aten = torch.ops.aten
    g = gm.graph

    def to(x: fx.Node, dtype: torch.dtype) -> fx.Node:
        return g.call_function(aten._to_copy.default, (x,), {"dtype": dtype})

    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        a = {**_SDPA_DEFAULTS, **_bind(node)}
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (q, k, v)]
        if a["dropout_p"] != 0.0 or a["is_causal"] or a["enable_gqa"]:
            continue
        if any(getattr(t, "dtype", None) != f32 for t in vals):
            continue
        mval = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if mask is not None and getattr(mval, "dtype", None) not in (f32, torch.bool):
            continue
        head = int(vals[0].shape[-1]) if vals[0] is not None else 0
        scale = a["scale"] if a["scale"] is not None else head**-0.5
        boolean = getattr(mval, "dtype", None) == torch.bool
        with g.inserting_before(node):
            kt = g.call_function(aten.transpose.int, (to(k, bf16), -2, -1))
            s = g.call_function(aten.matmul.default, (to(q, bf16), kt))
            s = g.call_function(aten.mul.Tensor, (to(s, f32), float(scale)))
            if mask is not None and boolean:
                s = g.call_function(aten.masked_fill.Scalar, (s, g.call_function(
                    aten.logical_not.default, (mask,)), float("-inf")))  # fmt: skip
            elif mask is not None:
                s = g.call_function(aten.add.Tensor, (s, mask))
            # softmax by hand, a row whose scores are all -inf giving zeros: one pass less
            # than aten._safe_softmax's (0.32 ms a layer against 0.42, CPU time compiled)
            top = g.call_function(aten.amax.default, (s, [-1], True))
            e = g.call_function(aten.exp.default, (g.call_function(aten.sub.Tensor, (s, top)),))
            total = g.call_function(aten.sum.dim_IntList, (e, [-1], True))
            p = g.call_function(aten.div.Tensor, (e, total))
            none = g.call_function(aten.eq.Scalar, (top, float("-inf")))
            p = to(g.call_function(aten.where.ScalarSelf, (none, 0.0, p)), bf16)
            out = to(g.call_function(aten.matmul.default, (p, to(v, bf16))), f32)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count


class FrozenCompiled(nn.Module):
    """torch.compile of a lowered graph, each call under Inductor's freezing and no_grad
    (Dynamo reads both when it traces, also when a new batch size recompiles): the int8
    weights are constants, prepacked once. For inference only, as the int8 sites are.

    `cpp_wrapper`: Inductor writes the code that calls the kernels in C++ rather than
    Python (its `cpp_wrapper` setting): a BERT-base forward makes about 130 calls (49
    onednn GEMMs, its own fused loops, the attention), whose Python dispatch cost about
    2.5 ms of CPU time a forward on the development CPU (one thread), against some
    seconds more of C++ compilation once."""

    def __init__(self, lowered: nn.Module, sites: int, *, cpp_wrapper: bool = True):
        super().__init__()
        self.lowered = lowered
        self.sites = sites
        self.cpp_wrapper = cpp_wrapper
        options = {**inductor_options(), **({"cpp_wrapper": True} if cpp_wrapper else {})}
        self._fn = torch.compile(lowered, options=options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._inductor.config as inductor_config

        # set and put back by hand: `inductor_config.patch(...)` built per call cost 18 us
        # a call here, this 6 (a 1 ms model pays it on every call)
        was = inductor_config.freezing
        inductor_config.freezing = True
        try:
            with torch.no_grad():
                return self._fn(*args, **kwargs)
        finally:
            inductor_config.freezing = was


def compile_module(
    module: nn.Module,
    *,
    cudagraphs: bool = False,
    bf16_attention: bool | None = None,
    cpp_wrapper: bool = True,
) -> nn.Module:
    """torch.compile of `module`, where it holds opswap's static int8 sites through
    Inductor's int8 lowering (`lower`, `FrozenCompiled`); as it is otherwise. `cudagraphs`:
    Inductor replays its kernels from CUDA graphs, as `mode="reduce-overhead"` does (the
    int8 lowering is CPU-only, so it never meets that). For a graph with int8 sites:
    `bf16_attention` rewrites its attention calls with `attention_bf16` (None: where this
    CPU computes bfloat16 natively, `native_bf16`), and `cpp_wrapper` is FrozenCompiled's."""
    lowered, sites = lower(module)
    if sites:
        if bf16_attention is None:
            bf16_attention = native_bf16()
        if bf16_attention and isinstance(lowered, fx.GraphModule):
            attention_bf16(lowered)
        return FrozenCompiled(lowered, sites, cpp_wrapper=cpp_wrapper)
    options = {**inductor_options(), **({"triton.cudagraphs": True} if cudagraphs else {})}
    compiled = torch.compile(module, options=options)
    return cast(nn.Module, compiled)  # an OptimizedModule for a module
