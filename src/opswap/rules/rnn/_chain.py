"""Read an unrolled cell loop off a captured graph: T calls of one LSTMCell / GRUCell /
RNNCell, step k reading time step k of one input tensor and the state step k-1 left.

Both capture flavours: an FX capture keeps the cell as a `call_module` (`cell(x_t, (h,
c))`, its tuple taken apart with getitem), torch.export leaves `aten.lstm_cell(x_t, [h,
c], w_ih, w_hh, b_ih, b_hh)` (`gru_cell`, `rnn_tanh_cell`, `rnn_relu_cell` likewise).
A time step is `x[:, t]`, `x.select(1, t)`, `x[t]` or `x.unbind(1)[t]` in any of their
spellings (export writes `x[:, t]` as a full slice and a select).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument

from opswap.graph.ops import arg, attr_tensor, module_of, op_kind, raw_name
from opswap.graph.purity import writes_in_place
from opswap.graph.shapes import dynamic_dims, info

#: the cell modules and ATen cell ops, by the name of the sequence RNN they become
_MODULES: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.LSTMCell, "lstm"),
    (nn.GRUCell, "gru"),
    (nn.RNNCell, "rnn"),
)
_ATEN = {"lstm_cell": "lstm", "gru_cell": "gru", "rnn_tanh_cell": "rnn", "rnn_relu_cell": "rnn"}
#: how far back (or forward) a state is followed through other ops to name what sits
#: between two steps
_DEPTH = 6
_BIG = 2**62  # a slice's end at least this large means "to the end"


@dataclass
class Cell:
    """One call of the cell: its node, its step input, its state in and out."""

    node: fx.Node
    x: fx.Node
    h_in: fx.Node | None
    c_in: fx.Node | None
    h: fx.Node | None  # what reads as this step's h (getitem 0 of an LSTM cell, else the call)
    c: fx.Node | None


@dataclass
class Chain:
    """An unrolled loop: `cells` in time order over `source` along `axis`, from step
    `start`; `collect` is a stack (or cat of unsqueezes) of every step's h along
    `collect_dim`, when the loop builds one."""

    kind: str  # "lstm" | "gru" | "rnn"
    cells: list[Cell]
    source: fx.Node
    axis: int
    start: int
    input_size: int
    hidden_size: int
    bias: bool
    nonlinearity: str
    dtype: torch.dtype
    weights: dict[str, torch.Tensor]
    narrow: bool
    collect: fx.Node | None = None
    collect_dim: int = 0
    collect_parts: list[fx.Node] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.cells)

    def nodes(self) -> list[fx.Node]:
        out: list[fx.Node] = []
        for c in self.cells:
            out.append(c.node)
            out += [n for n in (c.h, c.c) if n is not None and n is not c.node]
        return out + self.collect_parts + ([self.collect] if self.collect is not None else [])


def cell_kind(node: fx.Node) -> str | None:
    """'lstm', 'gru' or 'rnn' for a call of an LSTM/GRU/RNN cell, else None."""
    if op_kind(node) != "rnn_cell":
        return None
    mod = module_of(node)
    if mod is not None:
        return next((k for cls, k in _MODULES if type(mod) is cls), None)
    return _ATEN.get(raw_name(node))


def _identity(node: fx.Node) -> tuple:
    """What makes two cell calls the same cell: the module, or the weight attributes."""
    if node.op == "call_module":
        return ("module", str(node.target))
    return ("aten", raw_name(node), *(str(a) for a in node.args[2:6]))


def _state_args(node: fx.Node, kind: str) -> tuple[Argument, Argument]:
    """(h, c) a cell call reads; c is None except for LSTM, both None without a state."""
    hx = arg(node, 1, "hx")
    if kind != "lstm":
        return hx, None
    if isinstance(hx, (tuple, list)) and len(hx) == 2:
        return hx[0], hx[1]
    return hx, None  # a whole tuple (another call's output) or None


def _outputs(node: fx.Node, kind: str) -> tuple[fx.Node | None, fx.Node | None, str | None]:
    """(h, c) of a cell call, or why they cannot be told apart."""
    if kind != "lstm":
        return node, None, None
    parts: dict[int, fx.Node] = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is node:
            i = u.args[1]
            if not isinstance(i, int) or i in parts:
                return None, None, f"{node.name}'s output is taken apart more than once"
            parts[i] = u
    return parts.get(0), parts.get(1), None


def _full_slice(node: fx.Node) -> fx.Node | None:
    """The sliced tensor when `node` is a slice that keeps everything (export's `x[:, t]`)."""
    if raw_name(node) != "slice" or node.op != "call_function" or not node.args:
        return None
    base, start, end, step = (
        node.args[0],
        arg(node, 2, "start", 0),
        arg(node, 3, "end", None),
        arg(node, 4, "step", 1),
    )
    full_end = end is None or (isinstance(end, int) and end >= _BIG)
    if isinstance(base, fx.Node) and start in (0, None) and full_end and step == 1:
        return base
    return None


def _tensor_base(a: Argument) -> fx.Node | None:
    if not isinstance(a, fx.Node):
        return None
    while (inner := _full_slice(a)) is not None:
        a = inner
    return a


def step_of(x: fx.Node) -> tuple[fx.Node, int, int] | str:
    """(source, axis, index) when `x` is one time step of a tensor, else why not."""
    name = raw_name(x)
    if name == "select" and len(x.args) >= 1:
        base, axis, index = _tensor_base(x.args[0]), arg(x, 1, "dim"), arg(x, 2, "index")
    elif name == "getitem" and x.op == "call_function" and isinstance(x.args[0], fx.Node):
        src, index = x.args[0], x.args[1]
        if raw_name(src) == "unbind":
            base, axis = _tensor_base(src.args[0]), arg(src, 1, "dim", 0)
        else:
            base, axis = _tensor_base(src), 0
            if isinstance(index, tuple):
                lead = 0
                while lead < len(index) and index[lead] == slice(None):
                    lead += 1
                rest = index[lead + 1 :]
                if lead == len(index) or any(r != slice(None) for r in rest):
                    return f"{x.name} indexes {src.name} with {index!r}, not one time step"
                axis, index = lead, index[lead]
    else:
        return f"the step input {x.name} is {name}(...), not a time step of one tensor"
    if base is None or not isinstance(axis, int):
        return f"{x.name} does not take a step of a tensor along a fixed axis"
    if not isinstance(index, int):
        return (
            f"{x.name} takes a step whose index is computed at run time: the loop's length "
            "depends on the input, and a fixed nn.LSTM call cannot follow it"
        )
    bi = info(base)
    if bi is None:
        return f"the shape of {base.name} is unknown"
    rank = len(bi.shape)
    axis = axis + rank if axis < 0 else axis
    if index < 0:
        if axis in dynamic_dims(base):
            return f"{x.name} counts steps from the end of a dynamic axis of {base.name}"
        index += bi.shape[axis]
    return base, axis, index


def _reaches(start: fx.Node, ident: tuple, forward: bool) -> list[fx.Node] | None:
    """A path (excluding `start`) to a call of the same cell within _DEPTH ops."""
    todo: list[tuple[fx.Node, list[fx.Node]]] = [(start, [])]
    seen = {start}
    while todo:
        cur, path = todo.pop(0)
        nxt = list(cur.users) if forward else cur.all_input_nodes
        for n in nxt:
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_module" or n.op == "call_function" or n.op == "call_method":
                if cell_kind(n) is not None and _identity(n) == ident:
                    return path
                if len(path) < _DEPTH:
                    todo.append((n, [*path, n]))
    return None


def is_continuation(node: fx.Node, kind: str) -> bool:
    """Whether a cell call's state comes (directly or through other ops) from an earlier
    call of the same cell: then it is not where a loop starts."""
    ident = _identity(node)
    for s in _state_args(node, kind):
        if isinstance(s, fx.Node):
            if cell_kind(s) is not None and _identity(s) == ident:
                return True
            if _reaches(s, ident, forward=False) is not None:
                return True
    return False


def _describe(path: Sequence[fx.Node]) -> str:
    names = [op_kind(n).removeprefix("unknown:") for n in path if raw_name(n) != "getitem"]
    return " -> ".join(dict.fromkeys(names)) or "other ops"


def _cell(node: fx.Node, kind: str) -> Cell | str:
    x = arg(node, 0, "input")
    if not isinstance(x, fx.Node):
        return f"{node.name}'s input is not a tensor"
    h_in, c_in = _state_args(node, kind)
    h, c, why = _outputs(node, kind)
    if why:
        return why
    if (h_in is not None and not isinstance(h_in, fx.Node)) or (
        c_in is not None and not isinstance(c_in, fx.Node)
    ):
        return f"{node.name}'s state is not a pair of tensors"
    return Cell(node, x, h_in, c_in, h, c)


def _next(cell: Cell, kind: str, ident: tuple) -> tuple[fx.Node | None, str | None]:
    """The next call of the same cell, fed this step's state as it is; or why the loop
    cannot be followed past this step."""
    outs = [n for n in (cell.h, cell.c, cell.node if kind == "lstm" else None) if n is not None]
    direct = {
        u for o in outs for u in o.users if cell_kind(u) is not None and _identity(u) == ident
    }
    if len(direct) > 1:
        return None, f"the state of {cell.node.name} feeds {len(direct)} calls of the cell"
    if direct:
        return direct.pop(), None
    for o in outs:
        for u in o.users:
            path = _reaches(u, ident, forward=True)
            if path is not None and cell_kind(u) is None:
                return None, (
                    f"the state of {cell.node.name} passes through {_describe([u, *path])} "
                    "before the next step; only a state handed on unchanged maps to one RNN call"
                )
    return None, None


def _sized(
    gm: fx.GraphModule, node: fx.Node, kind: str
) -> tuple[dict[str, torch.Tensor], int, int, bool, str]:
    """(weights, input size, hidden size, bias, nonlinearity) of a cell call."""
    mod = module_of(node)
    if isinstance(mod, nn.RNNCellBase):
        params = {n: p.detach() for n, p in mod.named_parameters()}
        nonlin = str(getattr(mod, "nonlinearity", ""))
        return params, int(mod.input_size), int(mod.hidden_size), bool(mod.bias), nonlin
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    w: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        t = attr_tensor(gm, node.args[2 + i]) if len(node.args) > 2 + i else None
        if t is not None:
            w[name] = t.detach()
    gates = {"lstm": 4, "gru": 3}.get(kind, 1)
    hidden = int(w["weight_hh"].shape[1]) if "weight_hh" in w else 0
    nonlin = {"rnn_tanh_cell": "tanh", "rnn_relu_cell": "relu"}.get(raw_name(node), "")
    ok = "weight_ih" in w and "weight_hh" in w and w["weight_ih"].shape[0] == gates * hidden
    return w, (int(w["weight_ih"].shape[1]) if ok else 0), hidden, "bias_ih" in w, nonlin


def _collect(chain_h: list[fx.Node | None]) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """A stack of every step's h in order (or a cat of their unsqueezes) along one dim."""
    last = chain_h[-1]
    if any(h is None for h in chain_h) or last is None:
        return None
    for u in last.users:
        name = raw_name(u)
        parts = arg(u, 0, "tensors")
        dim = arg(u, 1, "dim", 0)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int):
            continue
        if name == "stack" and list(parts) == chain_h:
            return u, dim, []
        if name in ("cat", "concat", "concatenate") and len(parts) == len(chain_h):
            ups = []
            for p, h in zip(parts, chain_h, strict=True):
                ok = isinstance(p, fx.Node) and raw_name(p) == "unsqueeze" and p.args[0] is h
                if not ok or len(p.users) != 1:
                    break
                assert isinstance(p, fx.Node)
                ups.append(p)
                d = arg(p, 1, "dim")
                if d != dim:
                    break
            else:
                return u, dim, ups
    return None


def read(gm: fx.GraphModule, node: fx.Node) -> Chain | str | None:
    """The loop that starts at cell call `node`; a reason when it cannot become one RNN
    call; None when `node` is not where a loop starts."""
    kind = cell_kind(node)
    if kind is None or is_continuation(node, kind):
        return None
    ident = _identity(node)
    cells: list[Cell] = []
    cur: fx.Node | None = node
    while cur is not None:
        cell = _cell(cur, kind)
        if isinstance(cell, str):
            return cell
        if cells:
            prev = cells[-1]
            whole = kind == "lstm" and cell.h_in is prev.node and cell.c_in is None
            if not whole and (cell.h_in is not prev.h or cell.c_in is not prev.c):
                return f"{cur.name} does not take the state {prev.node.name} left"
            if whole:  # cell(x, previous call's tuple): its h and c are the previous outputs
                cell.h_in, cell.c_in = prev.h, prev.c
        cells.append(cell)
        cur, why = _next(cell, kind, ident)
        if why:
            return why
    if len(cells) < 2:
        return None  # one call is not a loop
    return _chain(gm, kind, cells)


def _chain(gm: fx.GraphModule, kind: str, cells: list[Cell]) -> Chain | str:
    steps: list[tuple[fx.Node, int, int]] = []
    for c in cells:
        s = step_of(c.x)
        if isinstance(s, str):
            return s
        steps.append(s)
    src, axis, start = steps[0]
    for k, s in enumerate(steps):
        if s[0] is not src or s[1] != axis:
            return (
                f"step {k} ({cells[k].node.name}) reads {s[0].name} along axis {s[1]}, not "
                f"{src.name} along axis {axis} as step 0 does"
            )
        if s[2] != start + k:
            order = "backwards" if s[2] == start - k else "out of order"
            return f"the loop runs over {src.name}'s time steps {order} (step {k} reads {s[2]})"
    si = info(src)
    assert si is not None
    if len(si.shape) != 3 or axis not in (0, 1):
        return (
            f"the loop steps over axis {axis} of a {len(si.shape)}-d tensor {src.name}; "
            "nn.LSTM takes [batch, time, features] or [time, batch, features]"
        )
    if not si.dtype.is_floating_point:
        return f"{src.name} is {si.dtype}; a recurrent network takes floating-point inputs"
    first = cells[0]
    for name, h0 in (("h", first.h_in), ("c", first.c_in)):
        hi = info(h0) if h0 is not None else None
        if h0 is not None and (hi is None or len(hi.shape) != 2):
            return f"the initial {name} ({h0.name}) is not a [batch, hidden] tensor"
    if first.h_in is None and first.node.op != "call_module":
        return "the first step has no initial state"
    weights, isz, hsz, bias, nonlin = _sized(gm, first.node, kind)
    if not hsz or not isz:
        return f"the weights of {first.node.name} are not constants of the model"
    for k, c in enumerate(cells):
        for name, o in (("h", c.h), ("c", c.c)):
            for u in o.users if o is not None else ():
                if writes_in_place(u):
                    return f"{u.name} changes step {k}'s {name} in place"
        if c.c is not None and k < len(cells) - 1:
            later = cells[k + 1].node
            outside = [u for u in c.c.users if u is not later]
            if outside:
                return (
                    f"the cell state of step {k} is read by {outside[0].name} outside the "
                    "loop; nn.LSTM returns only the last one"
                )
        if kind == "lstm":
            whole = [u for u in c.node.users if raw_name(u) != "getitem"]
            nxt = cells[k + 1].node if k < len(cells) - 1 else None
            if any(u is not nxt for u in whole):
                return f"the (h, c) tuple of step {k} is read whole outside the loop"
    narrow = start != 0 or axis in dynamic_dims(src) or si.shape[axis] != len(cells)
    chain = Chain(
        kind,
        cells,
        src,
        axis,
        start,
        isz,
        hsz,
        bias,
        nonlin or "tanh",
        si.dtype,
        weights,
        narrow,
    )
    found = _collect([c.h for c in cells])
    if found is not None and found[1] in (0, 1, -3, -2):
        chain.collect, dim, chain.collect_parts = found
        chain.collect_dim = dim % 3
    return chain


def outside_readers(chain: Chain) -> Iterator[tuple[int, str, fx.Node]]:
    """(step, 'h' or 'c', node) for every step output read by something other than the
    loop itself."""
    inside = set(chain.nodes())
    for k, c in enumerate(chain.cells):
        for name, o in (("h", c.h), ("c", c.c)):
            if o is not None and any(u not in inside for u in o.users):
                yield k, name, o
