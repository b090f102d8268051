"""FLOPs per FX node, in both graph flavours (FX call_module leaves and ATen ops).

Conventions:

- A multiply-add counts 2. Conv, linear, addmm, mm, bmm, matmul, baddbmm and
  scaled_dot_product_attention count exactly what `torch.utils.flop_counter.
  FlopCounterMode` counts: the products only, not the bias add of conv / linear /
  addmm, nor the scale, mask and softmax inside attention (which add about
  5 * B*H*Sq*Sk, small next to 2 * B*H*Sq*Sk*(D + Dv) once D >= 32). A causal
  mask is not discounted either (a causal kernel skips about half).
- LSTM / GRU / RNN (and their cells): the gate matmuls only, 2 * batch * steps *
  (numel of every weight matrix: W_ih, W_hh and LSTM's W_hr), per layer and
  direction. FlopCounterMode counts the same for GRU on CPU (which decomposes into
  addmm) and nothing for LSTM (one fused kernel); gate nonlinearities are not counted.
- Everything else counts per element, with the constants of `opswap.cost.pointwise`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx
from torch import nn

from opswap.cost._nodes import out_infos, prod, tensor_inputs, tinfo
from opswap.cost.pointwise import (
    ACTIVATION_FLOPS,
    ELEMENTWISE_FLOPS,
    ONE_FLOP_NAMES,
    SOFTMAX_FLOPS,
    gelu_tanh,
    norm,
    out_numel,
    pool,
    reduction,
    shape_of,
    training_dropout,
    upsample,
)
from opswap.graph.ops import arg, module_of, op_kind, raw_name

# --------------------------------------------------------------------------- conv / matmul


def conv_flops(x_shape, w_shape, out_shape, transposed: bool = False) -> int:
    """2 * batch * spatial positions * prod(weight shape), as FlopCounterMode counts.

    Weight is [C_out, C_in/groups, *k] (transposed: [C_in, C_out/groups, *k]), so
    groups are accounted for. A transposed conv visits every *input* position.
    """
    k = len(w_shape) - 2
    batch = prod(x_shape[: len(x_shape) - k - 1]) if len(x_shape) > k + 1 else 1
    positions = x_shape if transposed else out_shape
    spatial = positions[len(positions) - k :]
    return 2 * batch * prod(spatial) * prod(w_shape)


def _conv(node: fx.Node, kind: str) -> int:
    mod = module_of(node)
    x, out = shape_of(node.args[0]), shape_of(node)
    w: tuple[int, ...] | None
    if mod is not None:
        # modules opswap installs that hold no float `weight` say its shape themselves
        own = getattr(mod, "opswap_weight_shape", None)
        w = tuple(own) if own is not None else tuple(cast(torch.Tensor, mod.weight).shape)
    else:
        w = shape_of(arg(node, 1, "weight"))
    if x is None or w is None or out is None:
        return 0
    transposed = kind == "conv_transpose"
    if raw_name(node) in ("convolution", "_convolution"):
        transposed = bool(arg(node, 6, "transposed", False))
    return conv_flops(x, w, out, transposed)


def _einsum(node: fx.Node) -> int:
    eq = arg(node, 0, "equation")
    ops = node.args[1:] if len(node.args) > 1 else []
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    shapes = [shape_of(o) for o in ops]
    if not isinstance(eq, str) or any(s is None for s in shapes) or "." in eq:
        return 2 * out_numel(node)
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    sizes: dict[str, int] = {}
    for term, s in zip(lhs.split(","), shapes, strict=False):
        for letter, n in zip(term, cast(tuple[int, ...], s), strict=False):  # no None here
            sizes[letter] = int(n)
    total = prod(sizes.values())
    contracted = set(sizes) - set(rhs) if "->" in eq else set()
    # Each pair of operands multiplies over every index combination; a contraction adds too.
    per = 2 if contracted else 1
    return per * total * max(1, len(shapes) - 1)


def _matmul(node: fx.Node) -> int:
    name = raw_name(node)
    if name == "einsum":
        return _einsum(node)
    if name in ("addmm", "baddbmm"):
        a = shape_of(arg(node, 1, "mat1" if name == "addmm" else "batch1"))
    elif name == "addbmm":
        a, b = shape_of(arg(node, 1, "batch1")), shape_of(arg(node, 2, "batch2"))
        return 2 * prod(a) * b[-1] if a and b else 0
    else:
        a = shape_of(node.args[0] if node.args else None)
    if not a:
        return 0
    # out[..., m, n] = sum_k a[..., m, k] b[..., k, n]: one multiply-add per (output, k).
    return 2 * out_numel(node) * a[-1]


def _linear(node: fx.Node) -> int:
    mod = module_of(node)
    if isinstance(mod, nn.Bilinear):
        return 2 * out_numel(node) * mod.in1_features * mod.in2_features
    if mod is not None:
        k = cast(int, mod.in_features)
    else:
        w = shape_of(arg(node, 1, "weight"))
        if not w:
            return 0
        k = w[-1]
    return 2 * out_numel(node) * k


# --------------------------------------------------------------------------- attention / rnn


def sdpa_flops(q_shape, k_shape, v_shape) -> int:
    """Q @ K^T and P @ V: 2 * B*H * Sq * Sk * (D + Dv), as FlopCounterMode counts."""
    bh = prod(q_shape[:-2])
    sq, d = q_shape[-2], q_shape[-1]
    sk, dv = k_shape[-2], v_shape[-1]
    return 2 * bh * sq * sk * (d + dv)


def _mha_module(node: fx.Node, mod: nn.MultiheadAttention) -> int:
    q = shape_of(arg(node, 0, "query"))
    k = shape_of(arg(node, 1, "key"))
    if q is None or k is None:
        return 0
    e = mod.embed_dim
    if len(q) == 2:
        n, tq, tk = 1, q[0], k[0]
    elif mod.batch_first:
        n, tq, tk = q[0], q[1], k[1]
    else:
        n, tq, tk = q[1], q[0], k[0]
    in_proj = 2 * n * tq * e * e + 2 * n * tk * e * (mod.kdim + mod.vdim)
    scores_and_mix = 2 * n * tq * tk * e * 2
    out_proj = 2 * n * tq * e * e
    return in_proj + scores_and_mix + out_proj


def _attention(node: fx.Node) -> int:
    mod = module_of(node)
    if isinstance(mod, nn.MultiheadAttention):
        return _mha_module(node, mod)
    q, k, v = (shape_of(arg(node, i, n)) for i, n in enumerate(("query", "key", "value")))
    if q is None or k is None or v is None:
        return 0
    return sdpa_flops(q, k, v)


def _rnn(node: fx.Node, kind: str) -> int:
    mod = module_of(node)
    if mod is not None:
        mats = [t for n, t in mod.named_parameters() if n.startswith("weight") and t.dim() == 2]
        mat_numel = sum(t.numel() for t in mats)
        batch_first = bool(getattr(mod, "batch_first", False))
    elif kind == "rnn":
        params = arg(node, 2, "params") or []
        shapes = [shape_of(p) for p in params]
        mat_numel = sum(prod(s) for s in shapes if s is not None and len(s) == 2)
        batch_first = bool(arg(node, 8, "batch_first", False))
    else:  # lstm_cell(input, hx, w_ih, w_hh, ...), gru_cell / rnn_*_cell likewise
        shapes = [shape_of(arg(node, i, n)) for i, n in ((2, "w_ih"), (3, "w_hh"))]
        mat_numel = sum(prod(s) for s in shapes if s is not None)
        batch_first = False
    x = shape_of(node.args[0] if node.args else None)
    if x is None:
        return 0
    if kind == "rnn_cell":
        batch, steps = (x[0] if len(x) == 2 else 1), 1
    elif len(x) == 2:  # unbatched [T, I]
        batch, steps = 1, x[0]
    else:
        batch, steps = (x[0], x[1]) if batch_first else (x[1], x[0])
    return 2 * batch * steps * mat_numel


def _module_flops_measured(node: fx.Node) -> int | None:
    """FLOPs of an unrecognised leaf module, counted by FlopCounterMode on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    mod = cast(nn.Module, module_of(node))  # a call_module node (node_flops)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):

            def fake(v):
                if isinstance(v, fx.Node):
                    ti = tinfo(v)
                    if ti is None:
                        raise ValueError("non-tensor argument")
                    return torch.empty(ti.shape, dtype=ti.dtype)
                return v

            args = [fake(a) for a in node.args]
            kwargs = {k: fake(v) for k, v in node.kwargs.items()}
            # Grad on keeps nn fast paths (fused kernels FlopCounterMode cannot see) off, and
            # the math SDPA backend makes attention visible as bmm, as sdpa_flops counts it.
            with (
                FlopCounterMode(display=False) as counter,
                torch.enable_grad(),
                sdpa_kernel(SDPBackend.MATH),
            ):
                mod(*args, **kwargs)
        return int(counter.get_total_flops())
    except Exception:  # any module may fail on fake tensors; the caller notes it
        return None


def node_flops(node: fx.Node) -> int:
    """FLOPs of one compute node (multiply-add = 2). Unrecognised ops count 0."""
    kind = op_kind(node)
    if kind in ("conv", "conv_transpose"):
        return _conv(node, kind)
    if kind == "linear":
        return _linear(node)
    if kind in ("matmul", "addmm"):
        return _matmul(node)
    if kind == "attention":
        return _attention(node)
    if kind in ("rnn", "rnn_cell"):
        return _rnn(node, kind)
    if kind in (
        "batch_norm",
        "layer_norm",
        "group_norm",
        "instance_norm",
        "rms_norm",
        "local_response_norm",
    ):
        return norm(node, kind)
    if kind in ("softmax", "log_softmax"):
        return SOFTMAX_FLOPS * out_numel(node)
    if kind in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"):
        return pool(node, kind)
    if kind in ("sum", "mean", "var", "std", "amax", "prod", "norm", "cumsum", "topk", "sort"):
        return reduction(node, kind)
    if kind == "gelu":
        return ACTIVATION_FLOPS["gelu_tanh" if gelu_tanh(node) else "gelu"] * out_numel(node)
    if kind in ACTIVATION_FLOPS:
        return ACTIVATION_FLOPS[kind] * out_numel(node)
    if kind in ELEMENTWISE_FLOPS:
        return ELEMENTWISE_FLOPS[kind] * out_numel(node)
    if kind == "embedding_bag":
        ins = tensor_inputs(node, skip=(0,)) if module_of(node) is None else tensor_inputs(node)
        mod = module_of(node)
        dim = (
            cast(int, mod.embedding_dim)
            if mod is not None
            else (shape_of(node.args[0]) or (0, 0))[-1]
        )
        return (ins[0][1].numel if ins else 0) * dim
    if kind == "upsample":
        return upsample(node)
    if kind == "dropout":
        return 2 * out_numel(node) if training_dropout(node) else 0
    if kind.startswith("unknown:"):
        if node.op == "call_module":
            return _module_flops_measured(node) or 0
        name = kind.split(":", 1)[1].rstrip("_")
        if name in ONE_FLOP_NAMES:
            return sum(o.numel for o in out_infos(node)[:1])
    return 0


__all__ = ["ACTIVATION_FLOPS", "ELEMENTWISE_FLOPS", "conv_flops", "node_flops", "sdpa_flops"]
