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
- keyword settings, `op("softplus", var("x"), beta=1.0)`, are the values the op's
  settings must have, read whatever the spelling (`_matching.setting`: a module's
  attribute, a positional or keyword argument, else the default in the op's signature).
  A `var(name)` as a setting binds its value instead (`op("layer_norm", var("x"),
  eps=var("eps"))`).

`PATTERN.match(gm, node)` returns a `Match` (the bindings, and the op nodes it covered,
the root last, ready to hand to `Found`) or None. `PATTERN.check(gm, node)` answers as a
rule's check does: the Match, a `Refused` naming the setting when everything but a
setting matched ("softplus has beta=2.0, not 1.0"), or None.

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
from opswap.rules._matching import NO_SETTING, Refused, setting
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
    #: (setting, the value it must have or a Var binding it), in the order written
    settings: tuple[tuple[str, Any], ...] = ()

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Match | None:
        """The match of this pattern rooted at `node`, or None."""
        m = self._find(gm, node)
        return m if isinstance(m, Match) else None

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Match | Refused | None:
        """The match rooted at `node`; a Refused saying which setting differs when the ops
        and arguments match and a setting does not; None when it is no candidate."""

        m = self._find(gm, node)
        return Refused(m) if isinstance(m, str) else m

    def _find(self, gm: fx.GraphModule, node: fx.Node) -> Match | str | None:
        binds: dict[str, Any] = {}
        ops: list[fx.Node] = []
        why: list[str] = []
        if not _match(gm, self, node, binds, ops, why):
            return None
        if why:
            return why[0]
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


def op(
    kinds: str | tuple[str, ...], *args: Pattern, name: str | None = None, **settings: Any
) -> Op:
    """A call of one of `kinds` whose first arguments match `args` and whose settings have
    the values given by keyword (a `var` binds the value); `name` binds the node."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    return Op(kinds, tuple(args), name, tuple(settings.items()))


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


def _settings(op_: Op, node: fx.Node, binds: dict[str, Any]) -> str | None:
    """Bind the settings `op_` names with a Var; the first one whose value differs from the
    pattern's, as a sentence, or None."""
    for key, want in op_.settings:
        got = setting(node, key)
        if got is NO_SETTING:
            return f"{node.name} ({op_kind(node)}) has no setting {key!r}"
        if isinstance(want, Var):
            if not _bind(binds, want.name, got):
                return f"{node.name} has {key}={got!r}, not the {key} bound before"
        elif not _same(got, want):
            return f"{node.name} ({op_kind(node)}) has {key}={got!r}, not {want!r}"
    return None


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want, strict=True))
    if isinstance(got, bool) != isinstance(want, bool):
        return False  # keepdim=True is not dim=1
    return bool(got == want)


def _match(
    gm: fx.GraphModule,
    pat: Pattern,
    value: Any,
    binds: dict[str, Any],
    ops: list[fx.Node],
    why: list[str],
) -> bool:
    """Whether `value` matches `pat`, extending `binds` and `ops`. A node that matches but
    for a setting counts as a match with the reason added to `why`, so that a pattern
    that matches everywhere else is reported as a near miss naming that setting."""
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
    near: tuple[dict[str, Any], list[fx.Node], list[str]] | None = None
    for args in orders:
        trial, covered, reasons = dict(binds), list(ops), list(why)
        if all(
            _match(gm, p, a, trial, covered, reasons) for p, a in zip(pat.args, args, strict=True)
        ):
            if pat.name is not None and not _bind(trial, pat.name, value):
                continue
            off = _settings(pat, value, trial)
            if off is not None:
                reasons.append(off)
            if len(reasons) == len(why):  # matched, settings and all
                near = (trial, covered, reasons)
                break
            if near is None:
                near = (trial, covered, reasons)
    if near is None:
        return False
    binds.clear()
    binds.update(near[0])
    ops[:] = [*near[1], value]
    why[:] = near[2]
    return True
