"""Chapter 4 fusion rules: where each fires, where it refuses and why, and that the
rewritten model computes the same numbers (relative L2 <= 1e-5 on fresh inputs).

Every model is checked in both capture flavours (FX leaves and torch.export ATen),
on odd shapes (batch 3, 5 x 7 images, 13 channels).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.graph.ops import op_kind
from opswap.rules import registry
from opswap.rules._fusion_modules import FusedConvReLU, mkldnn_fused_available
from opswap.search.plan import apply_plan, make_plan

METHODS = ("fx", "export")
TOL = 1e-5


# --------------------------------------------------------------------------- helpers


def _bn(kind, c: int) -> nn.Module:
    """A BatchNorm with statistics and affine parameters far from the identity."""
    bn = kind(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.3, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).norm() / ref.norm()).item()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def optimize(model: nn.Module, inputs: tuple, rules, method: str):
    """Plan and apply `rules` on a capture of `model`; check the user's module is untouched."""
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, inputs, method=method)
    plan = make_plan(captured, rules=rules)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "the user's model was mutated"
    return plan, applied


def fired(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> list[str]:
    return [m.reason for m in plan.misses if m.rule == rule]


def assert_same(model, applied, make_inputs, samples: int = 2) -> None:
    """Original and rewritten model agree on fresh random inputs."""
    for _ in range(samples):
        inputs = make_inputs()
        with torch.no_grad():
            ref, out = _first(model(*inputs)), _first(applied.gm(*inputs))
        assert ref.shape == out.shape
        assert rel_l2(ref, out) <= TOL


def check(model, make_inputs, rules, method, expect: dict[str, int]):
    model = model.eval()
    plan, applied = optimize(model, make_inputs(), rules, method)
    for rule, n in expect.items():
        assert fired(plan, rule) == n, (rule, [d.site.key for d in plan.decisions], plan.misses)
    assert_same(model, applied, make_inputs)
    for d in plan.decisions:
        assert d.estimate.bytes_saved >= 0, d
    return plan, applied


def images(*shape):
    return lambda: (torch.randn(*shape),)


# --------------------------------------------------------------------------- registry


def test_rules_are_registered_exact_chapter_4():
    names = {r.name for r in registry.select("fusion.*")}
    assert names == {"fusion.conv_bn", "fusion.conv_relu", "fusion.linear_bn",
                     "fusion.matmul_add", "fusion.layer_norm", "fusion.parallel_linear",
                     "fusion.log_softmax"}
    for r in registry.select("fusion.*"):
        assert (r.family, r.chapter, r.exactness) == ("fusion", 4, "exact")
        assert r.description


# --------------------------------------------------------------------------- conv_bn


class ConvBNs(nn.Module):
    """Conv1d/2d/3d, grouped, bias-free, transposed and functional convs, each then a BN."""

    def __init__(self):
        super().__init__()
        self.c2 = nn.Conv2d(13, 12, 3, stride=2, padding=1, groups=1)
        self.b2 = _bn(nn.BatchNorm2d, 12)
        self.g2 = nn.Conv2d(12, 12, 3, padding=1, groups=4, bias=False)
        self.bg = _bn(nn.BatchNorm2d, 12)
        self.t2 = nn.ConvTranspose2d(12, 6, 3, stride=2, groups=3)
        self.bt = _bn(nn.BatchNorm2d, 6)
        self.w = nn.Parameter(torch.randn(5, 6, 1, 1))
        self.bf = _bn(nn.BatchNorm2d, 5)
        self.c1 = nn.Conv1d(13, 7, 2, dilation=2)
        self.b1 = _bn(nn.BatchNorm1d, 7)
        self.c3 = nn.Conv3d(13, 4, (1, 3, 3), padding=(0, 1, 1))
        self.b3 = _bn(nn.BatchNorm3d, 4)

    def forward(self, x):  # x: [B, 13, 5, 7]
        y = self.bg(self.g2(self.b2(self.c2(x))))
        y = self.bt(self.t2(y))
        y = self.bf(F.conv2d(y, self.w))
        z = self.b1(self.c1(x.flatten(2)))
        v = self.b3(self.c3(x.unsqueeze(2)))
        return y.mean((2, 3)).sum(1) + z.mean((1, 2)) + v.mean((1, 2, 3, 4))


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_folds_every_kind_of_conv(method):
    plan, applied = check(ConvBNs(), images(3, 13, 5, 7), ["fusion.conv_bn"], method,
                          {"fusion.conv_bn": 6})
    assert not reasons(plan, "fusion.conv_bn")
    assert "batch_norm" not in [op_kind(n) for n in applied.gm.graph.nodes]


class ConvBNCases(nn.Module):
    """Four conv+BN pairs, three of which must be refused."""

    def __init__(self):
        super().__init__()
        self.ok, self.bn_ok = nn.Conv2d(13, 13, 3, padding=1), _bn(nn.BatchNorm2d, 13)
        self.tr, self.bn_tr = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)
        self.sh, self.bn_sh = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)

    def forward(self, x, w):
        y = self.bn_ok(self.ok(x))
        y = self.bn_tr(self.tr(y))  # bn_tr alone is put in training mode
        s = self.sh(y)
        y = self.bn_sh(s) + s  # the conv output is read twice
        return self.bn_ok(F.conv2d(y, w, padding=1))  # weight is a forward argument


def _cases():
    m = ConvBNCases().eval()
    m.bn_tr.train()
    return m


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_refuses_with_reasons(method):
    model = _cases()
    inputs = (torch.randn(3, 13, 5, 7), torch.randn(13, 13, 3, 3))
    plan, applied = optimize(model, inputs, ["fusion.conv_bn"], method)
    assert fired(plan, "fusion.conv_bn") == 1
    why = " | ".join(reasons(plan, "fusion.conv_bn"))
    assert "is in training mode" in why
    assert "output is also read by" in why and "cannot be folded" in why
    assert "weight of" in why and "not a constant" in why and "model input w" in why
    # training-mode BN keeps its batch statistics: compare in the same mode on the same batch
    new = (torch.randn(3, 13, 5, 7), torch.randn(13, 13, 3, 3))
    with torch.no_grad():
        assert rel_l2(model(*new), _first(applied.gm(*new))) <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_refuses_non_constant_statistics(method):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(13, 4, 3)

        def forward(self, x, mean):
            return F.batch_norm(self.conv(x), mean, torch.ones(4) * 2, training=False)

    plan, _ = optimize(M().eval(), (torch.randn(3, 13, 5, 7), torch.randn(4)),
                       ["fusion.conv_bn"], method)
    assert fired(plan, "fusion.conv_bn") == 0
    assert any("running mean" in r and "not a constant" in r
               for r in reasons(plan, "fusion.conv_bn"))


def test_conv_bn_keeps_state_dict_keys_in_fx():
    plan, applied = optimize(nn.Sequential(nn.Conv2d(13, 8, 3), _bn(nn.BatchNorm2d, 8)).eval(),
                             (torch.randn(3, 13, 5, 7),), ["fusion.conv_bn"], "fx")
    assert set(applied.gm.state_dict()) == {"0.weight", "0.bias"}
    assert all(type(t) is torch.nn.Parameter or isinstance(t, torch.Tensor)
               for t in applied.gm.state_dict().values())


def test_conv_bn_folds_a_shared_conv_module_into_a_copy():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)

        def forward(self, x):
            return self.conv(self.bn(self.conv(x)))  # the same conv called twice

    check(M(), images(3, 13, 5, 7), ["fusion.conv_bn"], "fx", {"fusion.conv_bn": 1})


# --------------------------------------------------------------------------- conv_relu


class ConvReLUs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn_a, self.relu = nn.Conv2d(13, 16, 3, padding=1), _bn(nn.BatchNorm2d, 16), nn.ReLU()
        self.b = nn.Conv2d(16, 9, 3, stride=2, padding="valid", bias=False)
        self.c = nn.Conv2d(9, 9, 3, padding="same", groups=3)
        self.d, self.bn_d = nn.Conv1d(13, 5, 3), _bn(nn.BatchNorm1d, 5)

    def forward(self, x):
        y = self.relu(self.bn_a(self.a(x)))
        y = F.relu(self.b(y), inplace=True)
        y = torch.relu(self.c(y))
        z = self.bn_d(self.d(x.flatten(2))).relu()
        return y.flatten(1).sum(1, keepdim=True) + z.flatten(1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rules", [["fusion.conv_relu"], ["fusion.conv_bn", "fusion.conv_relu"]])
def test_conv_relu_fuses_with_or_without_conv_bn_first(method, rules):
    expect = {"fusion.conv_relu": 4}
    if "fusion.conv_bn" in rules:
        expect["fusion.conv_bn"] = 2
    plan, applied = check(ConvReLUs(), images(3, 13, 5, 7), rules, method, expect)
    fused = [m for m in applied.gm.modules() if isinstance(m, FusedConvReLU)]
    assert len(fused) == 4
    ops = [str(n.target) for n in applied.gm.graph.nodes]
    assert not any("relu" in o or "batch_norm" in o for o in ops)
    keys = {d.site.key for d in plan.decisions if d.rule == "fusion.conv_relu"}
    if method == "fx" and rules == ["fusion.conv_relu"]:
        assert "a+bn_a+relu" in keys and "b+relu_1" in keys


class ConvReLUCases(nn.Module):
    def __init__(self):
        super().__init__()
        self.refl = nn.Conv2d(13, 8, 3, padding=1, padding_mode="reflect")
        self.even = nn.Conv2d(13, 8, 2, padding="same")
        self.tr = nn.ConvTranspose2d(13, 8, 3)
        self.sh = nn.Conv2d(13, 8, 3, padding=1)

    def forward(self, x):
        a = torch.relu(self.refl(x))
        b = torch.relu(self.even(x))
        c = torch.relu(self.tr(x))[:, :, 1:-1, 1:-1]
        s = self.sh(x)
        return a + b + c + torch.relu(s) + s


@pytest.mark.parametrize("method", METHODS)
def test_conv_relu_refuses_with_reasons(method):
    # export spells reflect padding as a pad op and a plain conv, which does fuse
    plan, applied = check(ConvReLUCases(), images(3, 13, 5, 7), ["fusion.conv_relu"], method,
                          {"fusion.conv_relu": 0 if method == "fx" else 1})
    why = " | ".join(reasons(plan, "fusion.conv_relu"))
    if method == "fx":
        assert "padding_mode='reflect'" in why
    assert "padding='same' with an even kernel" in why
    assert "transposed convolution" in why
    assert "also read by" in why


def test_fused_conv_relu_module_paths_agree():
    torch.manual_seed(0)
    w, b = torch.randn(8, 13, 3, 3), torch.randn(8)
    m = FusedConvReLU(w, b, (2, 1), (1, 0), (1, 2), 1)
    x = torch.randn(3, 13, 5, 7)
    ref = F.relu(F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2)))
    with torch.no_grad():
        fast = m(x)
    assert rel_l2(ref, fast) <= TOL
    if mkldnn_fused_available():
        assert m._packed is not None  # the oneDNN path ran, with the weight reordered once
    slow = m(x.requires_grad_())  # gradients needed: plain conv + relu, differentiable
    slow.sum().backward()
    assert rel_l2(ref, slow.detach()) <= TOL and x.grad is not None
    again = pickle.loads(pickle.dumps(copy.deepcopy(m)))
    assert again._packed is None and set(again.state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        assert rel_l2(ref, again(x.detach())) <= TOL
        x64, w64, b64 = x.detach().double(), w.double(), b.double()
        ref64 = F.relu(F.conv2d(x64, w64, b64, (2, 1), (1, 0), (1, 2)))
        assert rel_l2(ref64, m.double()(x64)) <= 1e-12  # float64 takes the plain path


def test_fused_conv_relu_sees_new_weights():
    m = FusedConvReLU(torch.randn(4, 3, 3, 3), None, (1, 1), (1, 1), (1, 1), 1)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        m(x)
        m.load_state_dict({"weight": torch.randn(4, 3, 3, 3)})
        assert rel_l2(F.relu(F.conv2d(x, m.weight, None, 1, 1)), m(x)) <= TOL


# --------------------------------------------------------------------------- linear_bn


class LinearBNs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(13, 17), _bn(nn.BatchNorm1d, 17)
        self.fc2, self.bn2 = nn.Linear(17, 6, bias=False), _bn(nn.BatchNorm1d, 6)
        self.fc3, self.bn3 = nn.Linear(7, 7), _bn(nn.BatchNorm1d, 6)  # on [N, C=6, L=7]

    def forward(self, x):
        y = self.bn2(self.fc2(torch.relu(self.bn(self.fc(x)))))
        z = self.bn3(self.fc3(y.unsqueeze(2).expand(-1, 6, 7)))
        return y + z.mean(2)


@pytest.mark.parametrize("method", METHODS)
def test_linear_bn_folds_2d_and_refuses_3d(method):
    plan, _ = check(LinearBNs(), lambda: (torch.randn(3, 13),), ["fusion.linear_bn"], method,
                    {"fusion.linear_bn": 2})
    why = reasons(plan, "fusion.linear_bn")
    assert len(why) == 1 and "3-D" in why[0] and "not the Linear's output features" in why[0]


# --------------------------------------------------------------------------- matmul_add


class MatMulAdds(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(13, 17)), nn.Parameter(torch.randn(17))
        self.w2, self.b2 = nn.Parameter(torch.randn(17, 9)), nn.Parameter(torch.randn(1, 9))
        self.w3 = nn.Parameter(torch.randn(9, 5))
        self.table = nn.Parameter(torch.randn(5, 5))  # [S, N]: not a bias
        self.w4, self.b4 = nn.Parameter(torch.randn(5, 5)), nn.Parameter(torch.randn(5))

    def forward(self, x, w):  # x: [B, S=5, 13]
        y = x @ self.w1 + self.b1
        y = self.b2 + torch.matmul(y, self.w2)
        y = y @ self.w3 + 0.5  # a scalar bias
        y = y @ self.w4.t() + self.table  # bias varies along S: refused
        m = y @ w  # w is a forward argument: refused
        y = m + self.b4
        s = y @ self.w4
        return (s + self.b4) * s  # matmul output read twice: refused


@pytest.mark.parametrize("method", METHODS)
def test_matmul_add_becomes_linear_and_refuses_with_reasons(method):
    plan, applied = check(MatMulAdds(), lambda: (torch.randn(3, 5, 13), torch.randn(5, 5)),
                          ["fusion.matmul_add"], method, {"fusion.matmul_add": 3})
    why = " | ".join(reasons(plan, "fusion.matmul_add"))
    assert "not a bias along the last dim" in why
    assert "not a constant" in why and "model input w" in why
    assert "also read by" in why
    lin = [n for n in applied.gm.graph.nodes if "linear" in str(n.target)]
    assert len(lin) == 3


# --------------------------------------------------------------------------- layer_norm


class HandNorms(nn.Module):
    """Five spellings of LayerNorm, then three near-misses."""

    def __init__(self, h: int = 13):
        super().__init__()
        self.w, self.b = nn.Parameter(1 + 0.1 * torch.randn(h)), nn.Parameter(torch.randn(h))
        self.w2 = nn.Parameter(torch.randn(5, h))  # normalised over the last two dims

    def forward(self, x, scale):  # x: [B, 5, 13]
        m = x.mean(-1, keepdim=True)
        v = x.var(-1, keepdim=True, unbiased=False)
        x = (x - m) / torch.sqrt(v + 1e-5) * self.w + self.b
        m = x.mean(dim=-1, keepdim=True)
        x = (x - m) * torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-6)
        m = torch.mean(x, (-2, -1), keepdim=True)
        d = x - m
        x = self.w2 * (d / (d.pow(2).mean((-2, -1), keepdim=True) + 1e-3).sqrt())
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(torch.var(x, -1, keepdim=True, correction=0) + 1e-5) + self.b
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) + 1.0  # unbiased: refused
        m = x.mean(1, keepdim=True)
        x = (x - m) / torch.sqrt(((x - m) ** 2).mean(1, keepdim=True) + 1e-5)  # dim 1: refused
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * scale
        return x  # the last multiply is by a forward argument: norm fused, multiply kept


@pytest.mark.parametrize("method", METHODS)
def test_layer_norm_spellings_and_refusals(method):
    make = lambda: (torch.randn(3, 5, 13) * 3 + 1, torch.randn(13))  # noqa: E731
    plan, applied = check(HandNorms(), make, ["fusion.layer_norm"], method,
                          {"fusion.layer_norm": 5})
    why = " | ".join(reasons(plan, "fusion.layer_norm"))
    assert "unbiased variance" in why
    assert "not its last dim(s)" in why
    assert "not folded into the LayerNorm" in why and "model input scale" in why
    lns = [m for m in applied.gm.modules() if isinstance(m, nn.LayerNorm)]
    assert sorted(m.eps for m in lns) == sorted([1e-5, 1e-6, 1e-3, 1e-5, 1e-5])
    assert sorted(tuple(m.normalized_shape) for m in lns).count((5, 13)) == 1
    eps = sorted(d.site.data["eps"] for d in plan.decisions)
    assert eps == sorted([1e-5, 1e-6, 1e-3, 1e-5, 1e-5])


# --------------------------------------------------------------------------- parallel_linear


class Attention(nn.Module):
    """Q, K, V projections of one input (K without bias), heads split with .view, plus
    a pair of functional linears and a reader that flattens its slice with .view(-1)."""

    def __init__(self, h: int = 12, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h, bias=False), nn.Linear(h, 6)
        self.wa, self.wb = nn.Parameter(torch.randn(7, 6)), nn.Parameter(torch.randn(5, 6))
        self.ba = nn.Parameter(torch.randn(7))
        self.other = nn.Linear(h, h)

    def forward(self, x, w):  # x: [B, S, h], w: [4, 6]
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, -1).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        y = att.transpose(1, 2).reshape(b, s, -1)  # y: [B, S, 6]
        z = F.linear(y, self.wa, self.ba).view(-1)  # a slice cannot .view(-1): made contiguous
        u = F.linear(y, self.wb)
        t = F.linear(y, w)  # non-constant weight: stays apart
        side = (u.sum(-1) + t.sum(-1)).unsqueeze(-1)
        return z.sum() + side + self.other(u.sum(-1, keepdim=True).expand(b, s, h))


@pytest.mark.parametrize("method", METHODS)
def test_parallel_linear_merges_siblings(method):
    make = lambda: (torch.randn(3, 5, 12), torch.randn(4, 6))  # noqa: E731
    plan, applied = check(Attention(), make, ["fusion.parallel_linear"], method,
                          {"fusion.parallel_linear": 2})
    sizes = sorted(len(d.site.data["members"]) for d in plan.decisions)
    assert sizes == [2, 3]
    why = reasons(plan, "fusion.parallel_linear")
    assert len(why) == 1 and "not a constant" in why[0] and "cannot merge" in why[0]
    qkv = [d for d in plan.decisions if len(d.site.data["members"]) == 3][0]
    assert "zero bias" in qkv.site.description
    if method == "fx":
        assert isinstance(applied.gm.get_submodule("q_k_v"), nn.Linear)
        assert applied.gm.get_submodule("q_k_v").weight.shape == (30, 12)


# --------------------------------------------------------------------------- log_softmax


class LogSoftmaxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.sm = nn.Softmax(dim=1)

    def forward(self, x):
        a = torch.log(torch.softmax(x, -1))
        b = self.sm(x).log()
        p = F.softmax(x * 2, dim=0)
        return a + b + torch.log(p) + p  # p also read directly: softmax kept


@pytest.mark.parametrize("method", METHODS)
def test_log_softmax_replaces_log_of_softmax(method):
    plan, applied = check(LogSoftmaxes(), images(3, 13), ["fusion.log_softmax"], method,
                          {"fusion.log_softmax": 3})
    shared = [d for d in plan.decisions if d.site.data["shared"]]
    assert len(shared) == 1 and "stays" in shared[0].site.description
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("log_softmax") == 3 and kinds.count("softmax") == 1
    assert "log" not in kinds


def test_log_softmax_is_more_accurate_where_softmax_underflows():
    class M(nn.Module):
        def forward(self, x):
            return torch.log(torch.softmax(x, dim=-1))

    x = torch.tensor([[0.0, -200.0, 5.0]])
    _, applied = optimize(M(), (x,), ["fusion.log_softmax"], "fx")
    with torch.no_grad():
        assert torch.isinf(M()(x)).any()
        assert torch.isfinite(applied.gm(x)).all()
        assert torch.allclose(applied.gm(x), torch.log_softmax(x.double(), -1).float())


def test_log_softmax_refuses_an_implicit_dim():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.sm = nn.Softmax()

        def forward(self, x):
            return torch.log(self.sm(x))

    with pytest.warns(UserWarning):
        plan, _ = optimize(M(), (torch.randn(3, 13),), ["fusion.log_softmax"], "fx")
    assert fired(plan, "fusion.log_softmax") == 0
    assert any("implicit dim" in r for r in reasons(plan, "fusion.log_softmax"))


# --------------------------------------------------------------------------- zoo


def _zoo(name):
    from opswap.models import load

    return load(f"zoo:{name}")


@pytest.mark.parametrize("method", METHODS)
def test_zoo_resnet(method):
    lm = _zoo("resnet")
    pairs = sum(isinstance(m, nn.BatchNorm2d) for m in lm.module.modules())  # each after a conv
    plan, applied = optimize(lm.module, lm.example_inputs, ["fusion.*"], method)
    assert fired(plan, "fusion.conv_bn") == pairs == 8
    assert fired(plan, "fusion.conv_relu") == 4
    assert fired(plan, "fusion.linear_bn") == 1
    x = torch.randn_like(lm.example_inputs[0])
    with torch.no_grad():
        assert rel_l2(lm.module(x), _first(applied.gm(x))) <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_zoo_bert(method):
    lm = _zoo("bert")
    layers = len(lm.module.layers)
    plan, applied = optimize(lm.module, lm.example_inputs, ["fusion.*"], method)
    assert fired(plan, "fusion.layer_norm") == 2 * layers + 1
    assert fired(plan, "fusion.parallel_linear") == layers
    assert fired(plan, "fusion.matmul_add") == 1
    assert fired(plan, "fusion.log_softmax") == 1
    ids = torch.randint_like(lm.example_inputs[0], 0, 1000)
    with torch.no_grad():
        assert rel_l2(lm.module(ids), _first(applied.gm(ids))) <= TOL
