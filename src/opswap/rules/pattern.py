"""Fixed patterns stated as data: `op("mul", var("x"), op("sigmoid", var("x")))`.

A pattern is a tree of op kinds (`op_kind`'s names, so one pattern matches both capture
flavours: `x * torch.sigmoid(x)` traced by FX, `nn.Sigmoid` modules, and
`aten.mul.Tensor(x, aten.sigmoid.default(x))` from torch.export) over variables:

- `op(kind, *args)` matches a call whose `op_kind` is `kind` (or one of a tuple of
  kinds) and whose first positional arguments match `args`, left to right; arguments
  past the pattern's are the rule's to read. `add` and `mul` also match with their two
  operands swapped.
- `var(name)` matches any node and binds it; the same name twice must be the same node
  (`x * sigmoid(x)` does not match `x * sigmoid(y)`).
- `const(name)` matches a constant: a Python number, or a node that stands for a fixed
  tensor (a weight, or a transpose or view of one), and binds its value.

`PATTERN.match(gm, node)` returns a `Match` (the bindings, and the op nodes it covered,
the root last, ready to hand to `Found`) or None.

Why not torch.fx's `SubgraphMatcher` or Inductor's pattern matcher: both match by call
target, so one rule would need a pattern per spelling (`torch.sigmoid`, `Tensor.sigmoid`,
`F.sigmoid`, `nn.Sigmoid`, `aten.sigmoid.default`, ...) and per flavour, and neither
says why a near-match failed. Matching on `op_kind` keeps one pattern per rule; the
reasons, the safety checks (other readers, in-place writes) and the transactional
rewrite stay in `Rule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.rules._matching import const as _const

#: kinds whose two operands may come in either order
COMMUTATIVE = frozenset({"add", "mul"})


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Const:
    name: str


@dataclass(frozen=True)
class Op:
    kinds: tuple[str, ...]
    args: tuple[Pattern, ...]
    name: str | None = None

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Match | None:
        """The match of this pattern rooted at `node`, or None."""
        binds: dict[str, Any] = {}
        ops: list[fx.Node] = []
        if not _match(gm, self, node, binds, ops):
            return None
        return Match(binds, tuple(dict.fromkeys(ops)))  # inputs before their readers


Pattern = Op | Var | Const


@dataclass(frozen=True)
class Match:
    """What a pattern bound (`m["x"]`) and the op nodes it covered, each after the ops
    it reads: the pattern's root comes last."""

    binds: dict[str, Any]
    nodes: tuple[fx.Node, ...]

    def __getitem__(self, name: str) -> Any:
        return self.binds[name]


def op(kinds: str | tuple[str, ...], *args: Pattern, name: str | None = None) -> Op:
    """A call of one of `kinds` whose first arguments match `args`; `name` binds the node."""
    return Op((kinds,) if isinstance(kinds, str) else tuple(kinds), tuple(args), name)


def var(name: str) -> Var:
    return Var(name)


def const(name: str) -> Const:
    return Const(name)


def _bind(binds: dict[str, Any], name: str, value: Any) -> bool:
    if name in binds:
        held = binds[name]
        return held is value if isinstance(held, (fx.Node, torch.Tensor)) else held == value
    binds[name] = value
    return True


def _match(
    gm: fx.GraphModule, pat: Pattern, value: Any, binds: dict[str, Any], ops: list[fx.Node]
) -> bool:
    if isinstance(pat, Var):
        return isinstance(value, fx.Node) and _bind(binds, pat.name, value)
    if isinstance(pat, Const):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _bind(binds, pat.name, value)
        tensor = _const(gm, value)
        return tensor is not None and _bind(binds, pat.name, tensor)
    if (
        not isinstance(value, fx.Node)
        or value.op not in ("call_function", "call_method", "call_module")
        or op_kind(value) not in pat.kinds
    ):
        return False
    if len(value.args) < len(pat.args):
        return False
    orders = [value.args[: len(pat.args)]]
    if len(pat.args) == 2 and op_kind(value) in COMMUTATIVE:
        orders.append(orders[0][::-1])
    for args in orders:
        trial, covered = dict(binds), list(ops)
        if all(_match(gm, p, a, trial, covered) for p, a in zip(pat.args, args, strict=True)):
            if pat.name is not None and not _bind(trial, pat.name, value):
                continue
            binds.clear()
            binds.update(trial)
            ops[:] = [*covered, value]
            return True
    return False
