"""Property tests of the layout rules: random permutation chains, reshape chains, dropout
modes, identity ops and CNN sizes. Each rule keeps outputs equal, finds nothing more to
do on its own result, and refuses exactly where it must."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph import capture, op_kind
from opswap.graph.shapes import propagate
from opswap.rules import registry
from opswap.rules._layout_graph import matmul_reads_in_place
from opswap.rules._layout_nhwc import nhwc_strides
from opswap.rules.base import misses_of, sites_of
from opswap.search.plan import apply_plan, make_plan
from opswap.targets import Target

from ._shapes import assert_same_at_other_shapes

TARGET = Target(name="cpu", description="test CPU", kind="cpu", peak_flops={"float32": 1e12},
                mem_bandwidth=50e9, memory_bytes=0, dtypes=("float32",), layout="channels_last")
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
flavours = st.sampled_from(["fx", "fx", "export"])  # export captures are slower: fewer


def apply_rule(model, x, rule, method):
    captured = capture(model, (x,), method=method)
    plan = make_plan(captured, rules=[rule], target=TARGET)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert_same_at_other_shapes(model, captured, applied.gm)
    return plan, applied


def outputs(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for o in out for t in outputs(o)]


def shapes(rank_min=2, rank_max=5):
    return st.lists(st.integers(1, 6), min_size=rank_min, max_size=rank_max)


# --------------------------------------------------------------------------- cancel_transpose


class PermChain(nn.Module):
    """x.permute / x.transpose steps; the output of step `read_at` is also summed."""

    def __init__(self, steps, read_at):
        super().__init__()
        self.steps, self.read_at = steps, read_at

    def forward(self, x):
        extra = 0
        for i, (kind, dims) in enumerate(self.steps):
            x = getattr(x, kind)(*dims)
            if i == self.read_at:
                extra = x.sum()
        return x + extra


@st.composite
def perm_chains(draw):
    shape = draw(shapes())
    rank = len(shape)
    steps, total = [], list(range(rank))
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            p = list(draw(st.permutations(range(rank))))
            steps.append(("permute", tuple(p)))
        else:
            a, b = draw(st.lists(st.integers(-rank, rank - 1), min_size=2, max_size=2))
            steps.append(("transpose", (a, b)))
            p = list(range(rank))
            p[a % rank], p[b % rank] = b % rank, a % rank
        total = [total[i] for i in p]
    if draw(st.booleans()):  # close the chain with the inverse of what it did so far
        steps.append(("permute", tuple(total.index(i) for i in range(rank))))
    read_at = draw(st.sampled_from([None, *range(len(steps) - 1)]))
    return shape, steps, read_at


@SETTINGS
@given(perm_chains(), flavours)
def test_cancel_transpose_preserves_and_refuses(case, method):
    shape, steps, read_at = case
    model, x = PermChain(steps, read_at), torch.randn(shape)
    plan, applied = apply_rule(model, x, "layout.cancel_transpose", method)
    assert torch.equal(applied.gm(x), model(x))  # views only: bit-identical
    rule = registry.get("layout.cancel_transpose")
    again = rule.match(applied.gm)
    assert not [s for s in sites_of(again) if len(s.nodes) > 1]
    if read_at is not None:
        assert any("is also read by sum" in m.reason for m in plan.misses)
    if read_at is None:  # one chain: at most one permute is left
        assert sum(op_kind(n) in ("permute", "transpose") for n in applied.gm.graph.nodes) <= 1


# --------------------------------------------------------------------------- collapse_view


def _factor(n: int, parts: int, draw) -> list[int]:
    dims = []
    for _ in range(parts - 1):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        n //= d
    return [*dims, n]


@st.composite
def reshape_chains(draw):
    shape = draw(shapes(2, 4))
    numel = math.prod(shape)
    steps, cur = [], list(shape)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["view", "reshape", "flatten", "unsqueeze", "squeeze"]))
        if kind in ("view", "reshape"):
            cur = _factor(numel, draw(st.integers(1, 4)), draw)
            if draw(st.booleans()):
                spelled = list(cur)
                spelled[draw(st.integers(0, len(cur) - 1))] = -1
                steps.append((kind, spelled))
            else:
                steps.append((kind, list(cur)))
        elif kind == "flatten" and len(cur) > 1:
            a = draw(st.integers(0, len(cur) - 2))
            b = draw(st.integers(a + 1, len(cur) - 1))
            steps.append(("flatten", (a, b)))
            cur = cur[:a] + [math.prod(cur[a:b + 1])] + cur[b + 1:]
        elif kind == "unsqueeze":
            d = draw(st.integers(0, len(cur)))
            steps.append(("unsqueeze", d))
            cur = cur[:d] + [1] + cur[d:]
        elif kind == "squeeze" and 1 in cur and len(cur) > 1:
            d = cur.index(1)
            steps.append(("squeeze", d))
            cur = cur[:d] + cur[d + 1:]
    return shape, steps


class ReshapeChain(nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        x = x * 2  # the chain starts on a computed, contiguous tensor
        for kind, a in self.steps:
            x = getattr(x, kind)(*a) if isinstance(a, (list, tuple)) else getattr(x, kind)(a)
        return x + 1


@SETTINGS
@given(reshape_chains(), flavours)
def test_collapse_view_preserves(case, method):
    shape, steps = case
    model, x = ReshapeChain(steps), torch.randn(shape)
    plan, applied = apply_rule(model, x, "layout.collapse_view", method)
    assert torch.equal(applied.gm(x), model(x))
    left = [n for n in applied.gm.graph.nodes
            if op_kind(n) in ("view", "reshape", "flatten", "squeeze")]
    assert len(left) <= 1  # the whole chain is one reshape, or gone
    assert not sites_of(registry.get("layout.collapse_view").match(applied.gm))


# --------------------------------------------------------------------------- drop_dropout


class DropoutStack(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.drops = nn.ModuleList(nn.Dropout(p) for _, _, p in spec)
        for d, (_, train, _) in zip(self.drops, spec, strict=True):
            d.train(train)

    def forward(self, x):
        for d, (functional, train, p) in zip(self.drops, self.spec, strict=True):
            x = F.dropout(x, p, training=train) if functional else d(x)
            x = x * 1.5
        return x


@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.sampled_from([0.0, 0.25, 0.5])),
                min_size=1, max_size=5), flavours)
def test_drop_dropout_counts(spec, method):
    model, x = DropoutStack(spec), torch.randn(3, 5, 7)
    captured = capture(model, (x,), method=method)
    plan = make_plan(captured, rules=["layout.drop_dropout"], target=TARGET)
    in_training = sum(1 for _, train, p in spec if train and p > 0)
    assert len(plan.decisions) == len(spec) - in_training
    assert len(plan.misses) == in_training
    assert all("is in training mode" in m.reason for m in plan.misses)
    applied = apply_plan(captured, plan)
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)  # removed dropouts drew no random numbers: masks line up
    assert torch.equal(applied.gm(x), want)


# --------------------------------------------------------------------------- drop_identity

_IDENTITY_STEPS = ["identity", "contiguous", "clone", "to", "float", "alias", "transposed"]


class IdentityStack(nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.idn = nn.Identity()

    def forward(self, x):
        y = x + 1
        for s in self.steps:
            if s == "identity":
                y = self.idn(y)
            elif s == "to":
                y = y.to(torch.float32)
            elif s == "alias":
                y = torch.ops.aten.alias(y)
            elif s == "transposed":
                y = y.transpose(0, 1).contiguous()  # a real copy: must stay
            else:
                y = getattr(y, s)()
        return y * 3


@SETTINGS
@given(st.lists(st.sampled_from(_IDENTITY_STEPS), min_size=1, max_size=6), flavours)
def test_drop_identity_preserves(steps, method):
    model, x = IdentityStack(steps), torch.randn(4, 5, 7)
    plan, applied = apply_rule(model, x, "layout.drop_identity", method)
    assert torch.equal(applied.gm(x), model(x))
    again = registry.get("layout.drop_identity").match(applied.gm)
    assert not sites_of(again)
    real_copies = [n for n in applied.gm.graph.nodes if op_kind(n) == "contiguous"]
    assert len(real_copies) == steps.count("transposed")
    assert all("real copy" in m.reason for m in misses_of(again))


# --------------------------------------------------------------------------- channels_last


class ConvNet(nn.Module):
    def __init__(self, c_in, c_mid, k):
        super().__init__()
        self.a = nn.Conv2d(c_in, c_mid, k, padding=k // 2)
        self.b = nn.Conv2d(c_mid, c_mid, 3, padding=1, groups=1)

    def forward(self, x):
        return self.b(F.relu(self.a(x))) + 1


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=4, max_size=4), st.permutations(range(4)))
def test_nhwc_strides_agrees_with_torch(shape, order):
    """The rule's reading of 4-D strides matches torch's own, ambiguous size-1 cases
    included (torch settles those as NCHW)."""
    import torch._prims_common as prims

    t = torch.empty([shape[d] for d in order]).permute(*[order.index(i) for i in range(4)])
    want = prims.suggest_memory_format(t) == torch.channels_last
    assert nhwc_strides(t.shape, t.stride()) == want


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(2, 7), st.integers(3, 9),
       st.integers(3, 9), st.sampled_from([1, 3]), flavours)
def test_channels_last_preserves(n, c_in, c_mid, h, w, k, method):
    torch.manual_seed(0)
    model, x = ConvNet(c_in, c_mid, k).eval(), torch.randn(n, c_in, h, w)
    plan, applied = apply_rule(model, x, "layout.channels_last", method)
    assert len(plan.decisions) == 1
    fresh = torch.randn_like(x)
    want, got = model(fresh), applied.gm(fresh)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    assert got.is_contiguous()
    propagate(applied.gm, (x,))
    for node in applied.gm.graph.nodes:
        if op_kind(node) == "conv":
            meta = node.meta["tensor_meta"]
            assert nhwc_strides(meta.shape, meta.stride)


# --------------------------------------------------------------------------- matmul strides


def _matmul_copies(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.profiler import profile

    with profile() as prof:
        torch.matmul(a, b)
    return any(e.name in ("aten::copy_", "aten::clone", "aten::contiguous")
               for e in prof.events())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.integers(2, 11), min_size=2, max_size=4), st.data())
def test_matmul_reads_in_place_agrees_with_torch(shape, data):
    """The rule's model of torch.matmul: an operand it says can be read in place is never
    copied by matmul; one it says cannot is copied once the matrices are large enough for
    BLAS (CPU bmm multiplies tiny matrices with a plain loop that takes any strides)."""
    perm = data.draw(st.permutations(range(len(shape))))
    a = torch.randn(shape).permute(*perm)
    b = torch.randn(*a.shape[:-2], a.shape[-1], 9)
    copies = _matmul_copies(a, b)
    if matmul_reads_in_place(a.shape, a.stride()):
        assert not copies
    elif a.shape[-2] * a.shape[-1] * 9 >= 400:
        assert copies
