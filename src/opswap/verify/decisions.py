"""What decides the outcome of an output whose rows are class scores.

The plain metrics (`verify.metrics`) compare the numbers as they are, and a common
offset hides what decides the class: log-probabilities of 32 classes all sit near
-log 32 = -3.47, so an error that moves the differences between classes by 5% is 0.2% of
the values, 54 dB. For such outputs verification also measures the error of the rows
centred (each row minus its mean, in both) and counts the rows whose top-1 class (and
set of top-5 classes, where there are more than 5) changed.

Which outputs are class scores (`read_scores`): a floating tensor of 1 to 3 dims whose
last dim, of at least 2, holds the classes ([C], [batch, C], [batch, seq, C]), that is

- log-probabilities: every value <= 0 and every row's logsumexp 0, within the dtype's
  rounding (log_softmax's output, read from the values);
- probabilities: every value in [0, 1] and every row summing to 1 (softmax's output);
- logits: the op that makes it in the captured graph is a linear layer (nn.Linear,
  F.linear, addmm, a matmul with a weight), reached back through ops that keep the
  values (view, reshape, flatten, squeeze, contiguous, a dtype cast, dropout, a scale by
  a number); or the output is named `logits` (Hugging Face's outputs).

The values are read on the example's reference output, the graph from the capture when
the caller has one. Outputs of 4 or more dims are maps (attention weights, images,
segmentation scores with the classes on dim 1), not rows of scores. An activation after
the last linear layer ends the head: sigmoid (multi-label scores), tanh or ReLU (bounded
regression) outputs, layer-normed hidden states and embeddings are not class scores. A
regression head that is a bare linear layer cannot be told from logits and is judged as
logits; the budget `top1>=0,top5>=0,centred_rel_l2<=inf` judges it by the plain metrics
alone.

A common offset per row carries no information in log-probabilities and logits
(softmax(x + a) = softmax(x)), so they are compared centred; probabilities are not (the
sum fixes their offset). Top-1 agreement is the fraction of rows whose top class is the
same in both; top-5 agreement the fraction whose reference top class is among the
candidate's top 5 (top-5 accuracy with the reference's decisions as labels: how far a
decision moved). A row counts as changed only when the reference scores its top class
above the candidate's choice by more than rounding: twice `Tolerance.rounding_rel` of the
larger score (1e-5 relative for float32 models; a low-precision model's own rounding).
Closer than that, even an exact rewrite may swap them: a tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from opswap.graph.copies import private_copy
from opswap.graph.ops import op_kind
from opswap.verify.metrics import Metrics, combine, compare, resolution

#: ops between a head and the output that keep its values (per row)
_SAME_VALUES = frozenset(
    {"view", "reshape", "flatten", "squeeze", "contiguous", "to", "identity", "dropout"}
)
#: ops a weight reaches a matmul through
_WEIGHT_PATH = frozenset({"transpose", "permute", "to", "contiguous", "identity"})
_MAX_DIMS = 3


@dataclass(frozen=True)
class Scores:
    """An output read as class scores: `kind` (log_probs, probs or logits) and why."""

    kind: str
    why: str

    @property
    def offset_free(self) -> bool:
        """Whether a common offset per row carries no information (compare centred)."""
        return self.kind in ("log_probs", "logits")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).to(torch.float64)


def _shaped(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and 1 <= x.dim() <= _MAX_DIMS
        and x.shape[-1] >= 2
        and x.numel() > 0
    )


def read_scores(name: str, ref: Any, head: str | None = None) -> Scores | None:
    """Whether the reference output `ref` (named `name`) holds rows of class scores;
    `head` describes the linear layer that makes it in the graph, if one does."""
    if not _shaped(ref):
        return None
    rows = _rows(ref)
    c = rows.shape[-1]
    eps = torch.finfo(ref.dtype).eps
    finite = rows[torch.isfinite(rows)]
    peak = float(finite.abs().max()) if finite.numel() else 0.0
    # what rounding to the dtype and a reduction over C does to a row's sum or logsumexp,
    # several times over; at most 0.02 (bfloat16's rounding alone errs ~0.002 on a sum)
    slack = 16 * eps * math.ceil(math.log2(c))
    if bool(torch.isfinite(rows).all()):
        lo, hi = float(rows.min()), float(rows.max())
        near = min(0.02, slack)
        sums = rows.sum(-1)
        if lo >= -near and hi <= 1 + near and bool(((sums - 1).abs() <= near).all()):
            return Scores("probs", "its rows are probabilities (each sums to 1)")
    if not bool((torch.isnan(rows) | (rows == math.inf)).any()):
        lse = torch.logsumexp(rows, -1)
        tol = min(0.05, slack * max(1.0, peak))
        if float(rows.max()) <= tol and bool((lse.abs() <= tol).all()):
            return Scores("log_probs", "its rows are log-probabilities (each logsumexp is 0)")
    if head is not None:
        return Scores("logits", f"it comes from a linear head ({head})")
    last = name.rsplit("[", 1)[-1].rsplit(".", 1)[-1].strip("]'\"")
    if last == "logits":
        return Scores("logits", "it is named logits")
    return None


def graph_heads(gm: Any) -> list[str | None] | None:
    """Per output leaf of the graph module `gm` (pytree order), the linear layer it comes
    from, described ('fc2'), or None; None for what is not an fx.GraphModule."""
    if not isinstance(gm, fx.GraphModule):
        return None
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None or not out.args:
        return None
    return [_head(x) if isinstance(x, fx.Node) else None for x in pytree.tree_leaves(out.args[0])]


def traced(fn: Any) -> fx.GraphModule | None:
    """A graph to read `fn`'s heads from: `fn` itself when it is a graph module, else the
    FX trace of a copy of it (so that tracing cannot touch the module verified); None
    where it does not trace (control flow on values: most Hugging Face models)."""
    if isinstance(fn, fx.GraphModule):
        return fn
    if not isinstance(fn, torch.nn.Module):
        return None
    try:
        return fx.symbolic_trace(private_copy(fn))
    except Exception:  # untraceable: class scores are read from the values and names alone
        return None


def _head(node: fx.Node) -> str | None:
    last = _last_dim(node)
    for _ in range(32):  # a chain of reshapes is short; a cycle is impossible in a graph
        kind = op_kind(node)
        if kind in ("linear", "addmm") or (kind == "matmul" and _has_weight(node)):
            if last is not None and _last_dim(node) not in (None, last):
                return None  # a reshape moved the classes off the last dim
            return str(node.target) if node.op == "call_module" else node.name
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if kind in ("mul", "div"):  # a scale by a positive number (a temperature) keeps order
            scale = [a for a in node.args if not isinstance(a, fx.Node)]
            if (
                len(tensors) != 1
                or len(scale) != 1
                or not isinstance(scale[0], int | float)
                or not scale[0] > 0
                or (kind == "div" and node.args[0] is not tensors[0])
            ):
                return None
        elif kind not in _SAME_VALUES or not tensors:
            return None
        node = tensors[0]
    return None


def _has_weight(node: fx.Node) -> bool:
    for arg in node.args:
        while isinstance(arg, fx.Node) and op_kind(arg) in _WEIGHT_PATH and arg.args:
            arg = arg.args[0]
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            return True
    return False


def _last_dim(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta") or node.meta.get("val")
    shape = getattr(meta, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) else None


def centred(x: torch.Tensor) -> torch.Tensor:
    """`x` in float64 less each row's mean (over its finite values)."""
    r = x.detach().to(torch.float64)
    ok = torch.isfinite(r)
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    return r - torch.where(ok, r, 0.0).sum(-1, keepdim=True) / n


@dataclass
class Agreement:
    """Rows whose reference top-1 class is among the candidate's top k (k = 1: the same
    top-1 class): `changed` rows where it is not, beyond rounding ties, of `rows`."""

    k: int
    rows: int = 0
    changed: int = 0

    @property
    def agreement(self) -> float:
        return 1.0 - self.changed / self.rows if self.rows else 1.0

    def add(self, other: Agreement) -> None:
        self.rows += other.rows
        self.changed += other.changed

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "rows": self.rows,
            "changed": self.changed,
            "agreement": self.agreement,
        }


def agreement(ref: torch.Tensor, cand: torch.Tensor, k: int, rounding_rel: float) -> Agreement:
    """Top-k agreement of two [..., C] tensors row by row: a row changed when the
    reference's top class is not among the candidate's top k and the reference scores it
    above each of those by more than twice `rounding_rel` of the larger score (closer, it
    is a tie). Rows where the reference holds NaN are left out."""
    r = _rows(ref)
    c = _rows(cand).to(r.device)
    keep = ~torch.isnan(r).any(-1)
    r, c = r[keep], c[keep]
    best = r.argmax(-1, keepdim=True)  # the reference's decision
    top = c.topk(min(k, r.shape[-1]), -1).indices  # the candidate's short list
    kept = (top == best).any(-1)
    score = r.gather(1, best).squeeze(1)
    last = r.gather(1, top).amin(-1)  # the reference's score of the weakest on the list
    scale = torch.maximum(score.abs(), last.abs())
    changed = ~kept & ((score - last) > 2 * rounding_rel * scale)  # NaN (-inf, -inf): a tie
    return Agreement(k, int(r.shape[0]), int(changed.sum()))


@dataclass
class Judged:
    """What verification gathered on one class-score output: its reading, its metrics
    centred per row (offset-free kinds), the largest ||ref|| / ||ref centred|| over the
    samples, and its top-1 and top-5 agreement."""

    scores: Scores
    centred: list[Metrics] = field(default_factory=list)
    offset: float = 1.0
    top1: Agreement = field(default_factory=lambda: Agreement(1))
    top5: Agreement | None = None

    def add(self, ref: torch.Tensor, cand: torch.Tensor, rounding_rel: float) -> None:
        """Judge one sample's pair (of the same shape)."""
        if self.scores.offset_free:
            rc = centred(ref)
            self.centred.append(compare(rc, centred(cand), floor=resolution(ref)))
            fin = torch.isfinite(rc)
            norm_c = float(torch.linalg.vector_norm(rc[fin]))
            norm = float(torch.linalg.vector_norm(ref.detach().to(torch.float64)[fin]))
            self.offset = max(self.offset, norm / norm_c if norm_c > 0 else math.inf)
        self.top1.add(agreement(ref, cand, 1, rounding_rel))
        if ref.shape[-1] > 5:
            self.top5 = self.top5 or Agreement(5)
            self.top5.add(agreement(ref, cand, 5, rounding_rel))

    @property
    def centred_metrics(self) -> Metrics | None:
        return combine(self.centred) if self.centred else None

    def check(self, tol: Any, plain: Metrics, agreement: bool = True) -> list[str]:
        """Reasons this output breaks `tol` (a verify.tolerance.Tolerance) beyond its plain
        metrics (without `agreement`, on its centred metrics only)."""
        why: list[str] = []
        mc = self.centred_metrics
        if mc is not None:
            why += tol.check_centred(mc, plain, self.offset)
        for a in (self.top1, self.top5) if agreement else ():
            if a is not None:
                why += tol.check_agreement(a)
        return why

    def to_json(self) -> dict[str, Any]:
        mc = self.centred_metrics
        return {
            "kind": self.scores.kind,
            "why": self.scores.why,
            "centred_rel_l2": mc.rel_l2 if mc is not None else None,
            "centred_sqnr_db": mc.sqnr_db if mc is not None else None,
            "top1": self.top1.to_json(),
            "top5": self.top5.to_json() if self.top5 is not None else None,
        }

    def __str__(self) -> str:
        mc = self.centred_metrics
        text = f"top-1 agreement {self.top1.agreement:.4g} on {self.top1.rows} rows"
        if self.top5 is not None:
            text += f", top-5 {self.top5.agreement:.4g}"
        return (f"centred rel_l2={mc.rel_l2:.3g} " if mc is not None else "") + text
