"""Property tests for the fusion rules: on random shapes and random small graphs built
from the patterns, every rule keeps the outputs (relative L2 <= 1e-5) and fires
exactly where its checks allow, never where they must refuse."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph.capture import capture
from opswap.search.plan import apply_plan, make_plan

from ._shapes import assert_same_at_other_shapes

TOL = 1e-5
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# export captures cost ~10x an FX trace: one example in four uses it
METHOD = st.sampled_from(["fx", "fx", "fx", "export"])


def _bn(kind, c: int) -> nn.Module:
    bn = kind(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.3, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(model: nn.Module, inputs: tuple, rules, method: str):
    """(plan, worst error the rewrite adds) over two fresh input draws; asserts nothing
    failed, that the user's module was not touched, and that the result matches the
    module at two other sizes along every batch/sequence axis the capture claims. The model comes in the mode to test.

    The error is measured against a float64 run of the original and counted beyond 4x
    the float32 original's own error there, so deep stacks whose BN folds amplify
    rounding (and oneDNN's fused kernels, which sum in another order) are judged by
    what the rewrite adds, not by float32 rounding the original suffers too.
    """
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, inputs, method=method)
    plan = make_plan(captured, rules=rules)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert_same_at_other_shapes(model, captured, applied.gm)
    truth_model = copy.deepcopy(model).double()
    worst = 0.0
    for _ in range(2):
        fresh = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in inputs)
        with torch.no_grad():
            ref, out = model(*fresh), applied.gm(*fresh)
            truth = truth_model(*(t.double() if t.is_floating_point() else t for t in fresh))
        out = out[0] if isinstance(out, (tuple, list)) else out
        worst = max(worst, _rel(out, truth) - 4 * _rel(ref, truth))
    return plan, worst


def count(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == rule)


# --------------------------------------------------------------------------- conv + bn (+ relu)


class ConvBlock(nn.Module):
    def __init__(self, conv: nn.Module, bn: nn.Module, relu: bool, refuse: str):
        super().__init__()
        self.conv, self.bn, self.relu, self.refuse = conv, bn, relu, refuse

    def forward(self, x):
        c = self.conv(x)
        y = self.bn(c)
        if self.relu:
            y = torch.relu(y)
        if self.refuse == "shared":
            y = y + c.mean()  # the conv output escapes the pattern
        return y


@st.composite
def conv_cases(draw):
    dims = draw(st.sampled_from([1, 2, 2, 3]))
    transposed = draw(st.booleans()) and dims == 2
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 4)), groups * draw(st.integers(1, 4))
    k, stride = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    pad, dil = draw(st.integers(0, 2)), draw(st.integers(1, 2))
    if transposed:
        pad = min(pad, dil * (k - 1) // 2)  # keeps the transposed output non-empty
    size = [draw(st.integers(max(dil * (k - 1) + 1, 3), 9)) for _ in range(dims)]
    cls = {1: nn.Conv1d, 2: nn.ConvTranspose2d if transposed else nn.Conv2d, 3: nn.Conv3d}[dims]
    extra = {"output_padding": stride - 1} if transposed and dil == 1 else {}
    conv = cls(cin, cout, k, stride=stride, padding=pad, dilation=dil, groups=groups,
               bias=draw(st.booleans()), **extra)
    bn = _bn({1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims], cout)
    refuse = draw(st.sampled_from(["", "", "", "training", "shared"]))
    relu = draw(st.booleans())
    x = torch.randn(draw(st.integers(2, 3)), cin, *size)
    model = ConvBlock(conv, bn, relu, refuse).eval()
    if refuse == "training":
        model.bn.train()  # only the BN: the rest of the model is in eval mode
    return model, x, refuse, relu, transposed


@SETTINGS
@given(case=conv_cases(), method=METHOD)
def test_conv_bn_and_conv_relu_keep_outputs(case, method):
    model, x, refuse, relu, transposed = case
    plan, err = run(model, (x,), ["fusion.conv_bn", "fusion.conv_relu"], method)
    assert err <= TOL
    folds = 0 if refuse else 1
    assert count(plan, "fusion.conv_bn") == folds
    fuses = relu and not transposed and not refuse
    assert count(plan, "fusion.conv_relu") == fuses
    if refuse == "training":
        assert "training mode" in reasons(plan, "fusion.conv_bn")
    if refuse == "shared":
        assert "also read by" in reasons(plan, "fusion.conv_bn")


# --------------------------------------------------------------------------- linear + bn


@SETTINGS
@given(n=st.integers(2, 5), fin=st.integers(1, 17), fout=st.integers(1, 17),
       bias=st.booleans(), refuse=st.sampled_from(["", "", "training", "shared"]), method=METHOD)
def test_linear_bn_keeps_outputs(n, fin, fout, bias, refuse, method):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(fin, fout, bias=bias), _bn(nn.BatchNorm1d, fout)

        def forward(self, x):
            y = self.fc(x)
            return self.bn(y) + (y if refuse == "shared" else 0)

    m = M().eval()
    if refuse == "training":
        m.bn.train()
    plan, err = run(m, (torch.randn(n, fin),), ["fusion.linear_bn"], method)
    assert err <= TOL
    assert count(plan, "fusion.linear_bn") == (0 if refuse else 1)


# --------------------------------------------------------------------------- matmul + add


@SETTINGS
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2), k=st.integers(1, 13),
       n=st.integers(1, 13), bias=st.sampled_from(["vec", "row", "scalar", "table", "input_w"]),
       first=st.booleans(), method=METHOD)
def test_matmul_add_keeps_outputs(lead, k, n, bias, first, method):
    lead = lead or [3]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(k, n))
            shape = {"vec": (n,), "row": (1, n), "table": (lead[-1], n), "input_w": (n,)}
            self.b = nn.Parameter(torch.randn(*shape.get(bias, (n,))))

        def forward(self, x, w):
            mm = x @ (w if bias == "input_w" else self.w)
            b = 0.25 if bias == "scalar" else self.b
            return b + mm if first else mm + b

    x = torch.randn(*lead, k)
    plan, err = run(M().eval(), (x, torch.randn(k, n)), ["fusion.matmul_add"], method)
    assert err <= TOL
    ok = bias in ("vec", "row", "scalar") or (bias == "table" and lead[-1] == 1)
    assert count(plan, "fusion.matmul_add") == ok
    if not ok:
        assert reasons(plan, "fusion.matmul_add")


# --------------------------------------------------------------------------- layer norm


@st.composite
def ln_cases(draw):
    k = draw(st.integers(1, 2))
    shape = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))] + \
        [draw(st.integers(2, 9)) for _ in range(k)]
    return dict(
        shape=shape, k=k,
        variance=draw(st.sampled_from(["var", "pow", "mul", "square"])),
        root=draw(st.sampled_from(["div_sqrt", "mul_rsqrt"])),
        affine=draw(st.sampled_from(["none", "w", "wb", "b"])),
        eps=draw(st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3])),
        refuse=draw(st.sampled_from(["", "", "", "unbiased", "dim"])),
    )


class HandLN(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        norm = c["shape"][-c["k"]:]
        self.w = nn.Parameter(1 + 0.2 * torch.randn(norm))
        self.b = nn.Parameter(torch.randn(norm))

    def forward(self, x):
        c = self.c
        dims = tuple(range(-c["k"], 0)) if c["refuse"] != "dim" else (0,)
        m = x.mean(dims, keepdim=True)
        d = x - m
        if c["variance"] == "var" or c["refuse"] == "unbiased":
            v = x.var(dims, keepdim=True, unbiased=c["refuse"] == "unbiased")
        elif c["variance"] == "pow":
            v = d.pow(2).mean(dims, keepdim=True)
        elif c["variance"] == "mul":
            v = (d * d).mean(dims, keepdim=True)
        else:
            v = torch.square(d).mean(dims, keepdim=True)
        if c["root"] == "div_sqrt":
            y = d / torch.sqrt(v + c["eps"])
        else:
            y = d * torch.rsqrt(v + c["eps"])
        if "w" in c["affine"]:
            y = y * self.w
        if "b" in c["affine"]:
            y = y + self.b
        return y


@SETTINGS
@given(case=ln_cases(), method=METHOD)
def test_layer_norm_keeps_outputs(case, method):
    if case["refuse"] == "dim" and len(case["shape"]) == case["k"]:
        case["shape"] = [3, *case["shape"]]  # dim 0 must not be one of the last dims
    x = torch.randn(*case["shape"]) * 2 + 0.5
    plan, err = run(HandLN(case).eval(), (x,), ["fusion.layer_norm"], method)
    assert err <= TOL
    # normalising over dim 0, the batch (which stays dynamic unless a weight of that size
    # ties it down): nn.LayerNorm would fix its size
    over_batch = (not case["refuse"] and len(case["shape"]) == case["k"] >= 2
                  and case["affine"] == "none")
    if over_batch:
        assert count(plan, "fusion.layer_norm") == 0
        assert "whose size follows the input" in reasons(plan, "fusion.layer_norm")
        return
    assert count(plan, "fusion.layer_norm") == (0 if case["refuse"] else 1)
    if case["refuse"] == "unbiased":
        assert "unbiased variance" in reasons(plan, "fusion.layer_norm")
    if case["refuse"] == "dim":
        assert "not its last dim(s)" in reasons(plan, "fusion.layer_norm")
    if not case["refuse"]:
        assert plan.decisions[0].site.data["eps"] == case["eps"]


# --------------------------------------------------------------------------- parallel linears


@SETTINGS
@given(outs=st.lists(st.integers(1, 9), min_size=2, max_size=4), hidden=st.integers(1, 11),
       lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), data=st.data(), method=METHOD)
def test_parallel_linear_keeps_outputs(outs, hidden, lead, data, method):
    biases = [data.draw(st.booleans()) for _ in outs]
    from_input = data.draw(st.integers(-1, len(outs) - 1))  # -1: all weights constant

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(hidden, o, bias=b) for o, b in zip(outs, biases, strict=True))

        def forward(self, x, w):
            ys = [F.linear(x, w) if i == from_input else lin(x) for i, lin in enumerate(self.lins)]
            return torch.cat([y.sum(-1, keepdim=True) * (i + 1) for i, y in enumerate(ys)], -1)

    x = torch.randn(*lead, hidden)
    plan, err = run(M().eval(), (x, torch.randn(outs[max(from_input, 0)], hidden)),
                    ["fusion.parallel_linear"], method)
    assert err <= TOL
    merged = len(outs) - (from_input >= 0)
    assert count(plan, "fusion.parallel_linear") == (merged >= 2)
    if from_input >= 0:
        assert "not a constant" in reasons(plan, "fusion.parallel_linear")


# --------------------------------------------------------------------------- log softmax


@SETTINGS
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), data=st.data(),
       shared=st.booleans(), method=METHOD)
def test_log_softmax_keeps_outputs(shape, data, shared, method):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))

    class M(nn.Module):
        def forward(self, x):
            p = torch.softmax(x, dim)
            return torch.log(p) + (p if shared else 0)

    plan, err = run(M().eval(), (torch.randn(*shape) * 3,), ["fusion.log_softmax"], method)
    assert err <= TOL
    assert count(plan, "fusion.log_softmax") == 1


# --------------------------------------------------------------------------- random graphs


def _block(kind: str, h: int) -> tuple[nn.Module, dict[str, int]]:
    """A [B, S, h] -> [B, S, h] block holding one pattern, and what it should fire."""
    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(h, h) / h ** 0.5)
            self.b = nn.Parameter(torch.randn(h))
            self.q, self.k = nn.Linear(h, h), nn.Linear(h, h, bias=False)
            self.g = nn.Parameter(1 + 0.1 * torch.randn(h))

        def forward(self, x):
            if kind == "matmul_add":
                return x @ self.w + self.b
            if kind == "parallel_linear":
                return self.q(x) * torch.sigmoid(self.k(x))
            if kind == "layer_norm":
                m = x.mean(-1, keepdim=True)
                return (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * self.g
            return torch.log(torch.softmax(x, -1))

    fires = {"matmul_add": {"fusion.matmul_add": 1}, "parallel_linear": {"fusion.parallel_linear": 1},
             "layer_norm": {"fusion.layer_norm": 1}, "log_softmax": {"fusion.log_softmax": 1}}
    return B(), fires[kind]


@SETTINGS
@given(kinds=st.lists(st.sampled_from(["matmul_add", "parallel_linear", "layer_norm",
                                       "log_softmax"]), min_size=1, max_size=5),
       h=st.integers(2, 12), b=st.integers(1, 3), s=st.integers(1, 6), method=METHOD)
def test_random_sequence_graphs_keep_outputs(kinds, h, b, s, method):
    blocks, expect = [], {}
    for kind in kinds:
        m, fires = _block(kind, h)
        blocks.append(m)
        for r, n in fires.items():
            expect[r] = expect.get(r, 0) + n
    plan, err = run(nn.Sequential(*blocks).eval(), (torch.randn(b, s, h),), ["fusion.*"], method)
    assert err <= TOL
    for rule, n in expect.items():
        assert count(plan, rule) == n, (rule, [d.site.key for d in plan.decisions])
    assert len(plan.decisions) == sum(expect.values())


@SETTINGS
@given(layers=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 3]), st.booleans(),
                                 st.booleans()), min_size=1, max_size=4),
       cin=st.integers(1, 5), size=st.integers(5, 9), method=METHOD)
def test_random_cnn_graphs_keep_outputs(layers, cin, size, method):
    mods, bns, relus = [], 0, 0
    c = cin
    for cout, k, bn, relu in layers:
        mods.append(nn.Conv2d(c, cout, k, padding=k // 2))
        if bn:
            mods.append(_bn(nn.BatchNorm2d, cout))
            bns += 1
        if relu:
            mods.append(nn.ReLU())
            relus += 1
        c = cout
    plan, err = run(nn.Sequential(*mods).eval(), (torch.randn(2, cin, size, size + 2),), ["fusion.*"],
                    method)
    assert err <= TOL
    assert count(plan, "fusion.conv_bn") == bns
    assert count(plan, "fusion.conv_relu") == relus
