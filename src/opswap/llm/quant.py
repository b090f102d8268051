"""Low-bit weights for the serving engine's runners (chapter 29, with chapter 6's kernels).

    engine = LLMEngine(model, weights="int4", device="cuda", dtype=torch.bfloat16)
    engine.weight_stats        # WeightStats: bytes a decode step reads, before and after

A decode step at small batch reads every projection's weight once per token, so its time
is those bytes over the memory bandwidth. `quantize_runner` replaces each projection of a
runner (the packed qkv, o, the packed gate|up and down of a Llama; c_attn, c_proj, c_fc
and the MLP's c_proj of a GPT-2) by a `QuantWeight`, the same codes and scales the
chapter-6 rules store, and the runners' `linear` calls it:

- `int8`: `opswap::wo_linear`, symmetric per output channel (one scale per row);
- `int4`: `opswap::wo_linear`, asymmetric groups of 128 along K (scale and offset per
  group), two codes a byte;
- `fp8`: `opswap::fp8_linear`, e4m3 weights with a scale per row (per tensor on
  compute capability 8.9), the activations quantised per row on every call. Only on a
  GPU with FP8 tensor cores (8.9 and later); refused elsewhere.

Both weight-only schemes scale rows or groups along K of one row, so quantising the packed
[q; k; v] or [gate; up] matrix gives the codes each projection would get alone: a
transformers model whose Linears are replaced by the dequantised codes computes the same
function (the tests' exact check). On CUDA the ops run the Triton GEMV / skinny GEMM up
to 16 rows and dequantise + cuBLAS above (prefill); on the CPU INT8 per channel runs
`aten._weight_int8pack_mm` and the rest dequantise + `F.linear` (correct, not faster).
Under TRITON_INTERPRET=1 CPU bf16/fp16 activations take the Triton kernel, for tests.

The LM head stays in the run's dtype unless `WeightQuant(lm_head=True)`: its logits go
straight to sampling, with no later layer to average the rounding out, and int4 recipes
(GPTQ, AWQ, gpt-fast) leave it unquantised for that reason; at 32k x 2048 it is about 6%
of a 1.1B Llama's bytes. GPT-2's head is its token embedding, which the runner still
needs in float for the lookup, so quantising the head adds a copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from opswap.errors import OpswapError
from opswap.kernels import fp8_linear as fp8
from opswap.kernels import weight_only as wo

SCHEMES = ("int8", "int4", "fp8")


class QuantError(OpswapError, ValueError):
    """A weight scheme or setting the runners cannot take."""


@dataclass(frozen=True)
class WeightQuant:
    """How a runner's projections are stored: `scheme` one of SCHEMES; `group_size` for
    int8/int4 (default: the kernels', per channel for int8 and 128 for int4); `lm_head`
    also quantises the LM head (off by default: see the module docstring)."""

    scheme: str
    group_size: int | None = None
    lm_head: bool = False


@dataclass(frozen=True)
class WeightStats:
    """Bytes of the weights a decode step reads through `linear` (every projection and the
    LM head; biases, norms and embeddings left out): in the run's dtype, and as stored."""

    scheme: str  # "float" when nothing is quantised
    float_bytes: int
    stored_bytes: int
    quantized: int  # how many matrices are stored low-bit

    @property
    def ratio(self) -> float:
        """float_bytes / stored_bytes: how many times fewer bytes a decode step reads."""
        return self.float_bytes / self.stored_bytes if self.stored_bytes else 1.0


def _triton_here(x: torch.Tensor) -> bool:
    """Whether the interpreter should run the Triton kernel on x (CPU, TRITON_INTERPRET=1)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and wo.interpreting()
        and rows <= wo.TRITON_MAX_ROWS
        and wo.triton_supported(x) is None
    )


class QuantWeight(ABC):
    """A Linear weight [N, K] stored low-bit; `self(x, b)` is `F.linear(x, W, b)` with W
    the weight the codes stand for."""

    scheme: str
    out_features: int
    in_features: int

    @abstractmethod
    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the stored values stand for."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of everything stored: codes, scales, offsets."""


class WeightOnly(QuantWeight):
    """INT8 or INT4 codes with their scales (and INT4 offsets): `opswap::wo_linear`."""

    def __init__(self, weight: torch.Tensor, bits: int, group_size: int | None) -> None:
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.bits, self.scheme = bits, f"int{bits}"
        self.qweight, self.scale, self.offset, self.group_size = wo.quantize(
            weight, bits, group_size
        )

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        args = (x, self.qweight, self.scale, self.offset, b, self.bits, self.in_features)
        if _triton_here(x):
            return wo.triton_wo_linear(*args)
        return torch.ops.opswap.wo_linear(*args)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return wo.dequantize(
            self.qweight, self.scale, self.offset, self.bits, self.in_features, dtype
        )

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scale, self.offset)
        return sum(t.nbytes for t in parts if t is not None)


class FP8Weight(QuantWeight):
    """e4m3 weight with a scale per row (or per tensor): `opswap::fp8_linear`."""

    scheme = "fp8"

    def __init__(self, weight: torch.Tensor, rowwise: bool) -> None:
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.rowwise = rowwise
        self.wq, self.w_scale = fp8.quantize_weight(weight, rowwise)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.opswap.fp8_linear(x, self.wq, self.w_scale, b, self.rowwise)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.w_scale[:, None] if self.rowwise else self.w_scale
        return (self.wq.float() * s).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.w_scale.nbytes


#: what a runner's `linear` takes as its weight
Weight = torch.Tensor | QuantWeight


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times a float or low-bit weight [N, K], plus b."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w(x, b)


class Projections(Protocol):
    """A runner whose Linear weights can be swapped: each (holder, attribute) names one."""

    device: torch.device
    dtype: torch.dtype

    def projections(self) -> list[tuple[object, str]]: ...

    def head(self) -> tuple[object, str]: ...


def as_quant(weights: str | WeightQuant | None) -> WeightQuant | None:
    """A `weights=` argument checked: None, a scheme name or a WeightQuant."""
    if weights is None:
        return None
    q = WeightQuant(weights) if isinstance(weights, str) else weights
    if not isinstance(q, WeightQuant) or q.scheme not in SCHEMES:
        got = q.scheme if isinstance(q, WeightQuant) else q
        raise QuantError(
            f"weights must be None or one of {', '.join(SCHEMES)} (or a WeightQuant); got {got!r}."
        )
    if q.scheme == "fp8" and q.group_size is not None:
        raise QuantError("fp8 weights take no group_size: they have one scale per row.")
    return q


def fp8_refusal(device: torch.device) -> str | None:
    """Why FP8 weights cannot run on `device` (one sentence), or None when they can."""
    why = fp8.fp8_supported(device, rowwise=False)
    return None if why is None else f"fp8 weights cannot run here: {why}; use int8 or int4."


def _rowwise(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _quantize(w: torch.Tensor, q: WeightQuant, rowwise: bool) -> QuantWeight:
    if q.scheme == "fp8":
        return FP8Weight(w, rowwise)
    try:
        return WeightOnly(w, 8 if q.scheme == "int8" else 4, q.group_size)
    except wo.WeightOnlyError as e:
        raise QuantError(str(e)) from None


def _nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()


def quantize_runner(runner: object, weights: str | WeightQuant | None) -> WeightStats:
    """Store the runner's projections (and the LM head if asked) in the chosen scheme, in
    place; returns the bytes before and after. None quantises nothing (the stats only)."""
    q = as_quant(weights)
    if not hasattr(runner, "projections") or not hasattr(runner, "head"):
        if q is None:
            return WeightStats("float", 0, 0, 0)  # a runner of another package: unknown
        raise QuantError(
            f"{type(runner).__name__} does not list its projections, so its weights cannot "
            "be quantised; use weights=None."
        )
    r: Projections = runner  # type: ignore[assignment]
    sites = r.projections()
    head = r.head()
    before = sum(_nbytes(getattr(o, a)) for o, a in (*sites, head))
    if q is None:
        return WeightStats("float", before, before, 0)
    if q.scheme == "fp8":
        why = fp8_refusal(r.device)
        if why is not None:
            raise QuantError(why)
    chosen = [*sites, head] if q.lm_head else sites
    if q.scheme == "fp8":
        for o, a in chosen:
            n, k = getattr(o, a).shape
            why = fp8.shape_supported(int(k), int(n))
            if why is not None:
                raise QuantError(f"fp8 weights cannot take a projection of {why}.")
    rowwise = _rowwise(r.device)
    for o, a in chosen:
        w = getattr(o, a)
        if isinstance(w, torch.Tensor):
            setattr(o, a, _quantize(w, q, rowwise))
    after = sum(_nbytes(getattr(o, a)) for o, a in (*sites, head))
    return WeightStats(q.scheme, before, after, len(chosen))
